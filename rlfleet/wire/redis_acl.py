"""Redis ACL users, one per role (issue 16 item 6): each component may run only the commands its job
needs, on only its run's keys (`RunKeys`), so a rollout worker holding Redis credentials can add
groups to its run's inbox and read the policy stream, and cannot write `verified`, reputation or bans,
announce a policy version, touch the trainer's state or another run. The worker id in a group is
whatever the worker wrote: only the ingest binds worker ids to tokens.

  worker    XADD / XLEN the inbox, count the groups it did not send (repeats of trained work, groups of equal
            rewards), and set its field of the pool's sampling record: the only keys a rollout worker writes
  reader    read the policy stream, the trainer's demand, the sampling record, the retired prompts and the
            server's clock (TIME), XLEN the inbox and the verified stream, ZMSCORE the trained set (a worker
            sends no repeat of trained work): a worker's reads (a second client, env RLFLEET_REDIS_READ_URL),
            the origin, relays
  tickets   HINCRBY the work-ticket counters (spec.sampling.assignment: run; env RLFLEET_REDIS_TICKETS_URL)
  ingest    the inbox (its admission script: XLEN, XADD, GET/SET of its submission records), ban
            lookups, work tickets, its door (hashed tokens, joins, used invites, active workers, join
            addresses; rlfleet/services/ingest/door.py) and a joined worker's standing (its rate)
  verifier  the inbox's consumer group (read, claim, ack, delete), XADD verified / rejected / dead
            letter (the last two trimmed by bytes: XRANGE, XDEL, their audit-bytes totals), its attempt counts,
            run stats, reputation and bans, its one-time guards, work tickets (read), join records (read: a
            joined worker's probation), standings (the ingest's copy) and the retired prompts (read: a ticket's
            redraws)
  trainer   the verified stream's consumer group, the trained set, run stats and repeats (read), XADD policy, HSET
            its demand, RPUSH the retired prompts, SET the run's failure record
  admin     everything on the run's keys (the local launcher; on a cluster the operator keeps the
            urlSecret's `url`)
A worker has three users rather than one because Redis 6.2 (the embedded one) grants commands per
user, not per key: a user that may XADD the inbox and read the policy stream could also XADD to the
policy stream (a fake version would stall every worker and the gate), or HINCRBY it into a hash.

Where it is used: `rlfleet run` gives its embedded Redis these users with fresh passwords and each
component its role's URLs (rlfleet/local/plan.py); the chart renders the same rules for the users listed in
`redis.acl.users` (charts/rlfleet/files/redis-acl-roles.yaml, generated from `ROLES` by
`python -m rlfleet.wire.redis_acl`; a test keeps them equal), and with `spec.redis.roleUrls` the operator
gives each pod the urlSecret's `url-{role}` keys.

What ACLs cannot express: command arguments. A worker may XADD with MAXLEN and trim its run's inbox,
or flood it. Untrusted pools therefore submit through the ingest (`InferencePool.spec.ingestUrl`),
which authenticates each worker by its token, never trims, bounds the backlog and rate, and their
workers get no Redis credentials at all; direct Redis writes are for workers the run's operator
trusts that far.
"""

from __future__ import annotations

import secrets
import sys
from dataclasses import dataclass
from urllib.parse import quote, urlsplit, urlunsplit

from rlfleet.wire.components import COMPONENTS, INGEST, READER, ROLLOUT, TICKETS, TRAINER, VERIFIER, WORKER
from rlfleet.wire.streams import RunKeys

CONNECT = ["ping", "client|setinfo"]  # what redis-py sends on connect (SETINFO's refusal is ignored)
SCRIPTS = ["evalsha", "eval", "script|load"]  # redis-py's registered scripts; their commands are checked too

# Per role: the RunKeys attributes (or per-item key patterns, `RunKeys.patterns`) and the commands.
ROLES: dict[str, tuple[list[str], list[str]]] = {
    WORKER: (["rollouts", "repeats", "sampling"], ["xadd", "xlen", "hincrby", "hincrbyfloat", "hset", "hdel"]),
    READER: (
        ["policy", "rollouts", "verified", "demand", "retired_prompts", "trained", "sampling"],
        ["xread", "xrevrange", "xlen", "hmget", "hgetall", "lrange", "zmscore", "time"],
    ),
    TICKETS: (["tickets"], ["hincrby"]),
    INGEST: (
        [
            *("rollouts", "banned", "tickets", "submitted"),
            *("credentials", "joined", "invites_used", "active", "join_addresses", "standing"),
        ],
        [
            *("xadd", "xlen", "get", "set", "hexists", "hincrby", "hget", "hset"),
            *("zadd", "zcard", "zrem", "zremrangebyscore", "zrange", *SCRIPTS),
        ],
    ),
    VERIFIER: (
        [
            "rollouts",
            "verified",
            "rejected",
            "policy",
            "stats",
            "workers",
            "banned",
            "tickets",
            "seen",
            "seen_versions",
            "tickets_used",
            "joined",
            "standing",
            "attempts",
            "dead_letter",
            "audit_bytes",
            "retired_prompts",
        ],
        [
            "xgroup|create",
            "xreadgroup",
            "xautoclaim",
            "xack",
            "xdel",
            "xadd",
            "xlen",
            "xrange",
            "xrevrange",
            "hincrby",
            "hget",
            "hmget",
            "hgetall",
            "hscan",
            "hexists",
            "hsetnx",
            "hset",
            "hdel",
            "zadd",
            "zrangebyscore",
            "zrem",
            "get",
            "set",
            "lrange",
            *SCRIPTS,
        ],
    ),
    TRAINER: (
        ["verified", "policy", "trained", "stats", "demand", "retired_prompts", "failure", "repeats"],
        [
            "hset",
            "rpush",
            "lrange",
            "xgroup|create",
            "xreadgroup",
            "xack",
            "xdel",
            "xadd",
            "xrevrange",
            "zadd",
            "zmscore",
            "zremrangebyrank",
            "hgetall",
            "multi",
            "exec",
            "discard",
        ],
    ),
}
ADMIN = "admin"
# The role of each `rlfleet` subcommand's main Redis client (env RLFLEET_REDIS_URL), from the component
# registry; a rollout worker also reads as `reader` and takes tickets as `tickets` (WORKER_ROLES), one of a
# pool with ingestUrl only reads.
COMPONENT_ROLES = {c.name: c.role for c in COMPONENTS.values()}
WORKER_ROLES = dict(zip(("write", "read", "tickets"), COMPONENTS[ROLLOUT].roles, strict=True))


def role_rules(role: str, keys: RunKeys) -> str:
    """The ACL rules (after `user NAME on >PASSWORD`) of `role` for the run of `keys`."""
    if role == ADMIN:
        return f"resetkeys ~{keys.prefix}:* resetchannels +@all"
    names, commands = ROLES[role]
    patterns = keys.patterns()
    key_rules = " ".join(f"~{patterns[n] if n in patterns else getattr(keys, n)}" for n in names)
    return f"resetkeys {key_rules} resetchannels -@all " + " ".join(f"+{c}" for c in [*CONNECT, *commands])


def user_name(role: str, run: str) -> str:
    return f"{run}-{role}"


@dataclass(frozen=True)
class RunAcl:
    """The users of one run: role -> password (fresh for each local run)."""

    keys: RunKeys
    passwords: dict[str, str]

    @classmethod
    def generate(cls, run: str) -> RunAcl:
        return cls(RunKeys(run), {role: secrets.token_urlsafe(24) for role in [ADMIN, *ROLES]})

    def acl_file(self) -> str:
        """A redis-server `aclfile`: the default user off, one user per role."""
        lines = ["user default off"]
        for role, password in self.passwords.items():
            lines.append(f"user {user_name(role, self.keys.run)} on >{password} {role_rules(role, self.keys)}")
        return "\n".join(lines) + "\n"

    def url(self, base_url: str, role: str) -> str:
        """`base_url` (redis://host:port/db) with the credentials of `role`."""
        parts = urlsplit(base_url)
        host = parts.netloc.rsplit("@", 1)[-1]
        user, password = quote(user_name(role, self.keys.run), safe=""), quote(self.passwords[role], safe="")
        return urlunsplit((parts.scheme, f"{user}:{password}@{host}", parts.path, parts.query, parts.fragment))


def chart_roles() -> str:
    """charts/rlfleet/files/redis-acl-roles.yaml: each role's rules with `{run}` for the run name."""
    keys = RunKeys("{run}")
    lines = [
        "# Generated by `python -m rlfleet.wire.redis_acl` from rlfleet/wire/redis_acl.py; do not edit"
        " (a test compares).",
        "# role: ACL rules of a run's user of that role, `{run}` standing for the run's name.",
    ]
    lines += [f'{role}: "{role_rules(role, keys)}"' for role in [ADMIN, *ROLES]]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(chart_roles())
