"""Stream protocol: every Redis key of a run, and the versioned messages on its streams.

Streams (keys built only by `RunKeys`):
  rollouts  inbox: one message per group from the workers (untrusted)
  verified  groups the verifier accepted, with trusted rewards and no proofs (consumed by the trainer)
  rejected  groups refused, with the reason (audit)
  policy    one message per published policy version: {version, time, step (the trainer step whose weights
            it is; it lags the version after a resume that republished, services/trainer/state.py), reward}
  deadletter inbox entries whose handling failed verifier.maxAttempts times (kept for an operator)
A message is one Redis field `m` holding compact JSON; token ids, logprobs and proofs travel as
base64 of little-endian int32 / float32 / raw bytes. `SCHEMA_VERSION` changes with any
incompatible change; a consumer dead-letters what it cannot decode and keeps running.
Schema 2: samples are drawn as rlfleet/models/sampling.py says (seed per sample, replayable), and a group
records the `engine` that drew it and, when the run assigns work, its `ticket` (and `ticket_draw`, which of
the ticket's draws, when it is not the first: an optional field, absent meaning 0).

What a group *is* (`group_digest`): its prompt tokens, sampling parameters (not the seed) and the
multiset of its completions. The gate's replay guard, the trainer's exactly-once and the ingest's
idempotency all key on it, never on ids the worker chooses (rollout id, worker id, seed, task id).
"""

from __future__ import annotations

import base64
import hashlib
import json
import math
import struct
import uuid
from dataclasses import asdict, dataclass, field
from typing import cast

import numpy as np

from rlfleet.wire.components import TRAINER

SCHEMA_VERSION = 2
MESSAGE_FIELD = b"m"


class RunKeys:
    """The Redis keys of one run; the only place they are spelled."""

    def __init__(self, run: str):
        self.run = run
        self.prefix = prefix = f"rlfleet:{run}"  # every key of the run starts with it (ACL rules, cleanup)
        self.rollouts = f"{prefix}:rollouts"
        self.verified = f"{prefix}:verified"
        self.rejected = f"{prefix}:rejected"
        self.policy = f"{prefix}:policy"
        self.stats = f"{prefix}:stats"
        # hash reason/message/time: a fatal error of the run's config that the trainer found (e.g. its model cannot
        # be fetched); the operator sets the run's Failed condition from it (rlfleet/wire/runtime.py record_failure)
        self.failure = f"{prefix}:failure"
        self.trained = f"{prefix}:trained"  # sorted set: content digest -> policy version it trained
        # hash: what the trainer still wants (oldest: the oldest policy version it will still train; need:
        # the groups its current step lacks; held: verified entries it holds; kept: the share of the groups it
        # reads that it keeps); trainer/batches.py set_demand
        self.demand = f"{prefix}:demand"
        # hash: worker id -> "groups deadline", the groups each worker expects to send from the batch it is sampling
        # now (rlfleet/services/rollout/backpressure.py); its peers count them as queued
        self.sampling = f"{prefix}:sampling"
        # hash groups/samples/reward_sum/flat by task source: the groups workers sampled and did not send, repeats
        # of trained work or (flat) groups of equal rewards (rlfleet/fleet/repeats.py); the trainer counts them in the
        # sampled reward
        self.repeats = f"{prefix}:repeats"
        # hash: "{worker}|{counter}" -> count (reputation, rlfleet/fleet/reputation.py)
        self.workers = f"{prefix}:workers"
        self.banned = f"{prefix}:banned"  # hash: worker id -> JSON ban record (why, when)
        self.tickets = f"{prefix}:tickets"  # hash: worker id -> work tickets issued (rlfleet/fleet/assignment.py)
        self.attempts = f"{prefix}:attempts"  # hash: inbox entry id -> verifier attempts not yet committed
        self.dead_letter = f"{prefix}:deadletter"  # inbox entries no verifier could handle (poison pills)
        # hash: audit stream key (rejected, deadletter) -> bytes of its entries (services/toploc/audit.py)
        self.audit_bytes = f"{prefix}:audit-bytes"
        # The gate's one-time guards (rlfleet/services/toploc/guards.py): hash content digest -> entry|seed,
        # zset content digest -> newest policy version claimed (pruned to the async window), hash ticket -> entry.
        self.seen = f"{prefix}:seen"
        self.seen_versions = f"{prefix}:seen-versions"
        self.tickets_used = f"{prefix}:tickets-used"
        # list of prompt keys the online filter retired, append-only (rlfleet/fleet/prompt_filter.py)
        self.retired_prompts = f"{prefix}:retired-prompts"
        # The ingest's door (rlfleet/services/ingest/door.py): hash sha256(token) -> worker id (tokens are
        # never stored), hash worker id -> JSON join record (address, mode, time), hash sha256(invite code)
        # -> worker id (codes used), zset worker id -> last request time (joined workers active), hash
        # client address -> worker ids joined from it (space-separated; refuses rejoins after a ban), hash
        # worker id -> its accepted groups as the gate last saw them (reputation.on_probation; the rate).
        self.credentials = f"{prefix}:credentials"
        self.joined = f"{prefix}:joined"
        self.invites_used = f"{prefix}:invites-used"
        self.active = f"{prefix}:active"
        self.join_addresses = f"{prefix}:join-addresses"
        self.standing = f"{prefix}:standing"
        self._submitted_prefix = f"{prefix}:submitted:"
        self.verifier_group = "verifiers"
        self.trainer_group = TRAINER

    def submitted(self, digest: str) -> str:
        """The ingest's idempotency record of one submission, by content digest (a key with a TTL)."""
        return f"{self._submitted_prefix}{digest}"

    def patterns(self) -> dict[str, str]:
        """Glob patterns of the per-item keys (for Redis ACL key rules, rlfleet/wire/redis_acl.py)."""
        return {"submitted": f"{self._submitted_prefix}*"}

    def all(self) -> list[str]:
        """Fixed keys of the run (the ingest's per-submission records expire by themselves)."""
        return [
            self.rollouts,
            self.verified,
            self.rejected,
            self.policy,
            self.stats,
            self.failure,
            self.trained,
            self.demand,
            self.sampling,
            self.repeats,
            self.workers,
            self.banned,
            self.tickets,
            self.attempts,
            self.dead_letter,
            self.audit_bytes,
            self.seen,
            self.seen_versions,
            self.tickets_used,
            self.retired_prompts,
            self.credentials,
            self.joined,
            self.invites_used,
            self.active,
            self.join_addresses,
            self.standing,
        ]


class MessageError(ValueError):
    """A message that cannot be decoded; it is dead-lettered with this text as the reason."""


_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "max_tokens", "seed"}
ID_MAX_CHARS = 1024  # task, worker and rollout ids and the engine name


def text_field(body: dict, key: str, max_chars: int | None = None) -> str:
    """`body[key]` when it is a string Redis and JSON can carry back (UTF-8: no lone surrogate)."""
    value = body[key]
    if not isinstance(value, str):
        raise MessageError(f"{key} is a {type(value).__name__}, not a string")
    if max_chars is not None and len(value) > max_chars:
        raise MessageError(f"{key} has {len(value)} characters, more than {max_chars}")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise MessageError(f"{key} is not UTF-8 text (it holds a lone surrogate)") from None
    return value


def _integer(body: dict, key: str) -> int:
    """`body[key]` when it is a JSON integer in [0, 2**63)."""
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**63:
        raise MessageError(f"{key} must be an integer in [0, 2**63), not {ascii(value)[:50]}")
    return value


def _number(body: dict, key: str) -> float:
    """`body[key]` when it is a finite JSON number."""
    value = body[key]
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise MessageError(f"{key} must be a finite number, not {ascii(value)[:50]}")
    return float(value)


def spans_problem(spans: list[int], tokens: int) -> str | None:
    """What is wrong with a sample's `spans` (Sample.spans) for its `tokens` completion tokens, or None."""
    if len(spans) % 2 == 0:
        return (
            f"spans has {len(spans)} lengths; a transcript alternates model and environment spans and ends with a "
            f"model span (an odd count)"
        )
    if sum(spans) != tokens:
        return f"spans add up to {sum(spans)} tokens, the completion has {tokens}"
    if any(n < 1 for n in spans[::2]) or any(n < 0 for n in spans[1::2]):
        return "a model span is empty or a span length is negative"
    return None


def encode_ints(values) -> str:
    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode()


def decode_ints(text: str) -> list[int]:
    return np.frombuffer(base64.b64decode(text), dtype="<i4").tolist()


def encode_floats(values) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def decode_floats(text: str) -> list[float]:
    return np.frombuffer(base64.b64decode(text), dtype="<f4").tolist()


@dataclass
class Sample:
    """One completion of a group."""

    completion_ids: list[int]
    logprobs: list[float]  # (T,) logprob of each sampled token under the sampling distribution
    proofs: list[bytes]  # TOPLOC proofs: prompt chunk first, then one per decode chunk
    reward: float = 0.0  # claimed by the worker; replaced by the verifier's own
    finish_reason: str = "length"
    # A multi-turn episode's turns (rlfleet/tasks/turns.py): the lengths of the spans `completion_ids` is made of,
    # the model's first and then alternating with the environment's, ending with the model's (an odd count; model
    # spans >= 1 token, environment spans >= 0). None: one model span, a single-turn completion.
    spans: list[int] | None = None

    def to_wire(self) -> dict:
        wire = {
            "c": encode_ints(self.completion_ids),
            "l": encode_floats(self.logprobs),
            "p": [base64.b64encode(p).decode() for p in self.proofs],
            "r": self.reward,
            "f": self.finish_reason,
        }
        if self.spans is not None:
            wire["s"] = encode_ints(self.spans)
        return wire

    @classmethod
    def from_wire(cls, d: dict) -> Sample:
        if not isinstance(d, dict) or not isinstance(d["p"], list):
            raise MessageError("a sample is not an object with a list of proofs `p`")
        return cls(
            completion_ids=decode_ints(text_field(d, "c")),
            logprobs=decode_floats(text_field(d, "l")),
            proofs=[base64.b64decode(p) for p in d["p"]],
            reward=_number(d, "r"),
            finish_reason=text_field(d, "f"),
            spans=None if d.get("s") is None else decode_ints(text_field(d, "s")),
        )


@dataclass
class SamplingParams:
    temperature: float
    top_p: float
    top_k: int
    max_tokens: int
    seed: int  # the group's; sample i draws with rlfleet.models.sampling.sample_seed(seed, i)


@dataclass
class RolloutGroup:
    """G completions of one prompt, produced by one worker with one policy version."""

    task_id: str
    worker_id: str
    policy_version: int
    prompt_ids: list[int]
    sampling: SamplingParams
    samples: list[Sample]
    rollout_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    engine: str = "torch"  # what drew the samples: "torch" (replayable, rlfleet/models/sampling.py) or "vllm"
    ticket: int | None = None  # the run-assigned work ticket (spec.sampling.assignment: run), else None
    ticket_draw: int = 0  # which of the ticket's draws (the online filter's redraws; rlfleet/fleet/assignment.py)
    schema: int = SCHEMA_VERSION

    def encode(self) -> dict[bytes, bytes]:
        body = {
            "schema": self.schema,
            "rollout_id": self.rollout_id,
            "task_id": self.task_id,
            "worker_id": self.worker_id,
            "policy_version": self.policy_version,
            "prompt": encode_ints(self.prompt_ids),
            "sampling": asdict(self.sampling),
            "samples": [s.to_wire() for s in self.samples],
            "engine": self.engine,
        }
        if self.ticket is not None:
            body["ticket"] = self.ticket
        if self.ticket_draw:
            body["ticket_draw"] = self.ticket_draw
        return {MESSAGE_FIELD: json.dumps(body, separators=(",", ":")).encode()}

    @classmethod
    def decode(cls, fields: dict) -> RolloutGroup:
        """Decode a stream entry; raise MessageError naming what is wrong."""
        raw = fields.get(MESSAGE_FIELD) or fields.get(MESSAGE_FIELD.decode())
        if raw is None:
            raise MessageError(f"no '{MESSAGE_FIELD.decode()}' field in message")
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nested too deep
            raise MessageError(f"body is not JSON: {type(exc).__name__}: {str(exc)[:200]}") from None
        if not isinstance(body, dict):
            raise MessageError("body is not a JSON object")
        if body.get("schema") != SCHEMA_VERSION:
            raise MessageError(f"schema {ascii(body.get('schema'))[:50]} is not the supported {SCHEMA_VERSION}")
        try:
            sampling = body["sampling"]
            if not isinstance(sampling, dict) or set(sampling) != _SAMPLING_FIELDS:
                raise MessageError(f"sampling must be an object with exactly {sorted(_SAMPLING_FIELDS)}")
            if not isinstance(body["samples"], list):
                raise MessageError("samples is not a list")
            group = cls(
                task_id=text_field(body, "task_id", ID_MAX_CHARS),
                worker_id=text_field(body, "worker_id", ID_MAX_CHARS),
                policy_version=_integer(body, "policy_version"),
                prompt_ids=decode_ints(text_field(body, "prompt")),
                sampling=SamplingParams(
                    temperature=_number(sampling, "temperature"),
                    top_p=_number(sampling, "top_p"),
                    top_k=_integer(sampling, "top_k"),
                    max_tokens=_integer(sampling, "max_tokens"),
                    seed=_integer(sampling, "seed"),
                ),
                samples=[Sample.from_wire(s) for s in body["samples"]],
                rollout_id=text_field(body, "rollout_id", ID_MAX_CHARS),
                engine=text_field(body, "engine", ID_MAX_CHARS),
                ticket=None if body.get("ticket") is None else _integer(body, "ticket"),
                ticket_draw=0 if body.get("ticket_draw") is None else _integer(body, "ticket_draw"),
                schema=SCHEMA_VERSION,
            )
        except MessageError:
            raise
        except (KeyError, TypeError, ValueError, OverflowError, RecursionError) as exc:
            raise MessageError(f"malformed field: {str(exc)[:200]!r}") from None
        for i, s in enumerate(group.samples):
            if len(s.completion_ids) != len(s.logprobs):
                raise MessageError(f"samples[{i}]: {len(s.completion_ids)} tokens but {len(s.logprobs)} logprobs")
            if s.spans is not None:
                problem = spans_problem(s.spans, len(s.completion_ids))
                if problem:
                    raise MessageError(f"samples[{i}]: {problem}")
        return group


def group_digest(group: RolloutGroup) -> str:
    """What the work is, as a hex sha256: prompt tokens, sampling parameters but the seed, and the
    completions as a multiset (sorted), so a replay under new ids, another seed or task id, or with
    its samples reordered has the same digest. The one helper for every dedup of groups."""
    h = hashlib.sha256(b"rlfleet-work-1\0")

    def part(data: bytes) -> None:
        h.update(struct.pack("<Q", len(data)))
        h.update(data)

    s = group.sampling
    part(np.asarray(group.prompt_ids, dtype="<i4").tobytes())
    part(json.dumps([float(s.temperature), float(s.top_p), int(s.top_k), int(s.max_tokens)]).encode())
    for completion in sorted(np.asarray(c.completion_ids, dtype="<i4").tobytes() for c in group.samples):
        part(completion)
    return h.hexdigest()


def rewards_all_equal(group: RolloutGroup) -> bool:
    """Whether every completion of `group` has the same reward: its advantages are all zero, so it adds nothing
    to a GRPO update (with `trainer.skipZeroAdvantageGroups` the trainer drops it, and workers hold it back)."""
    return len({s.reward for s in group.samples}) == 1


# XRANGE/XREVRANGE and XREAD/XREADGROUP replies on rlfleet's clients (RESP2, bytes, never decoded): redis-py
# types the replies of every protocol and decoding at once, so readers cast to the one they get.
StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]
StreamReply = list[tuple[bytes, StreamEntries]]


def stream_entries(resp: object) -> StreamEntries:
    """An XRANGE/XREVRANGE reply as rlfleet's clients get it."""
    return cast(StreamEntries, resp)


def stream_reply(resp: object) -> StreamReply:
    """An XREAD/XREADGROUP reply as rlfleet's clients get it ([] for the None of a block that timed out)."""
    return cast(StreamReply, resp or [])


def encode_json(payload: dict) -> dict[bytes, bytes]:
    """A small JSON stream message (policy announcements, rejections)."""
    return {MESSAGE_FIELD: json.dumps(payload, separators=(",", ":")).encode()}


def decode_json(fields: dict) -> dict:
    raw = fields.get(MESSAGE_FIELD) or fields.get(MESSAGE_FIELD.decode())
    if raw is None:
        raise MessageError("no message field")
    return json.loads(raw)
