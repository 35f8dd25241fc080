"""The verifier's Prometheus metrics (gate.py counts into them).

Every series a dashboard selects by a label value that is known in advance exists from the start, at 0: each
rejection reason (config RejectionReason) for verdicts and bans, and the accepted verdict. A panel of rejections on
a run without any then shows 0, not "No data". Handling failures are labelled by the exception's type, which is
not known until one happens.
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import Counter

from rlfleet.config import RejectionReason

VERDICTS = Counter("rlfleet_verifier_groups_total", "Groups verified", ["verdict", "reason"])
REWARD_MISMATCH = Counter(
    "rlfleet_verifier_reward_mismatch_total", "Samples whose claimed reward differed from the trusted one"
)
UNCHECKED = Counter(
    "rlfleet_verifier_unchecked_groups_total", "Accepted groups that skipped the prefill checks (spot-checking)"
)
TOKENS = Counter("rlfleet_verifier_tokens_total", "Completion tokens of handled groups", ["prefill"])
BANS = Counter("rlfleet_verifier_bans_total", "Workers banned by this replica", ["reason"])
DUPLICATES = Counter(
    "rlfleet_verifier_already_committed_total", "Verdicts dropped because another replica committed the entry first"
)
FAILURES = Counter(
    "rlfleet_verifier_handle_failures_total",
    "Inbox entries whose handling raised (retried, then dead-lettered)",
    ["error"],
)
DEAD_LETTERS = Counter(
    "rlfleet_verifier_dead_letters_total", "Inbox entries moved to the dead-letter stream after verifier.maxAttempts"
)

VERDICTS.labels("accepted", "")
for _reason in get_args(RejectionReason):
    VERDICTS.labels("rejected", _reason)
    BANS.labels(_reason)
