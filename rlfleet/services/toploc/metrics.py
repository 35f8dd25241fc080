"""The verifier's Prometheus metrics (main.py counts into them).

Every series a dashboard selects by a label value that is known in advance exists from the start, at 0: each
rejection reason (config RejectionReason) for verdicts and bans, and the accepted verdict. A panel of rejections on
a run without any then shows 0, not "No data". Handling failures are labelled by the exception's type, which is
not known until one happens.
"""

from __future__ import annotations

from typing import get_args

from prometheus_client import Counter

from rlfleet.config import RejectionReason
from rlfleet.wire.timing import Laps, lap_counter

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

# Where the verifier's seconds go (rlfleet/wire/timing.py `Laps`; nested parts count exclusively): `fetch`
# (downloading a version from the trusted origin: hashes, signature, delta rebuild), `load` (loading it
# into a model, an adapter merged), `decode` (inbox messages into groups), `prefill` (the forward passes
# recomputing hidden states and logprobs), `checks` (every check around them: envelope, prompt, replay
# guard, TOPLOC and logprob comparisons, seed replay, reward), `commit` (the verdict's Lua script).
PARTS = ("fetch", "load", "decode", "prefill", "checks", "commit")
SECONDS = Counter("rlfleet_verifier_seconds_total", "Seconds spent by part of the verifier's work", ["part"])
for _part in PARTS:
    SECONDS.labels(_part)
LAPS = Laps(PARTS, on_lap=lap_counter(SECONDS))
