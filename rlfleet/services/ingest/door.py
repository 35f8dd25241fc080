"""The ingest's door: how a worker nobody wrote a token for joins a run (`spec.ingest.admission`).

  GET  /v1/{run}        the public run document: what a worker needs to configure itself (the RLRun cut to
                        the fields a worker reads, minus Redis and the store; relay URLs; the manifest
                        public key; the limits it will meet)
  POST /v1/{run}/join   body: a JSON object, `{}` or `{"code": "<invite code>"}` (and optionally `"engine"`);
                        201 {"worker_id", "token", ...}: the token authenticates that worker id only

Checks in order, each refusal storing nothing: 404 another run; 403 joining closed (mode tokens);
429 (Retry-After) the client address over joinsPerMinutePerAddress or all joins over joinsPerMinute;
413 / 422 a body over 4 KiB or not a JSON object with the right fields; 403 invite code missing or
unknown; then one Lua script (atomic, so replicas agree) answers 409 for a code already used, 403 for an
address from which a worker now banned joined within rejoinBanSeconds of its ban, 503 (Retry-After)
with maxActiveWorkers joined workers active, else stores the join.

What is stored (RunKeys): sha256(token) -> worker id (never the token), the join record, the code's
digest as used, the worker as active, its id under the client address. Every ingest replica reads the
same hashes, so a worker joined at one replica submits through any. A ban (the gate writes it in
RunKeys.banned) refuses the worker's next request at every replica: the ban check runs per request.

Probation: a joined worker with fewer than probationGroups accepted groups has every group prefill-checked
by the gate (reputation.on_probation) and a rate of probationRatePerMinute, doubled for every
probationGroups accepted groups, up to ratePerMinute (`Door.rate_for`).
"""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from pathlib import Path
from typing import cast

import redis
import yaml
from prometheus_client import Counter, Gauge

from rlfleet.config import API_VERSION, ConfigError, IngestSpec, strict_yaml
from rlfleet.services.ingest.client import JOIN_PATH, ROLLOUTS_PATH, RUN_PATH, TICKETS_PATH
from rlfleet.services.ingest.limits import RateLimiter
from rlfleet.versions.signing import KeyConfigError, public_key_text, run_public_key
from rlfleet.wire.streams import RunKeys
from rlfleet.wire.views import PUBLIC, project

JOIN_BODY_MAX_BYTES = 4096
FULL_RETRY_SECONDS = 30
JOINS = Counter("rlfleet_ingest_joins_total", "Join requests answered, by outcome", ["outcome"])
BANNED_REFUSALS = Counter(
    "rlfleet_ingest_banned_refusals_total", "Requests refused because their worker (or a join's address) is banned"
)
ACTIVE = Gauge("rlfleet_ingest_active_workers", "Joined workers active at the last join (this replica's view)")

# KEYS: credentials, joined, invites used, active, join addresses, banned.
# ARGV: worker, token digest, join record, address, now, activeSeconds, maxActiveWorkers, rejoinBanSeconds,
# invite digest ('' without). Answers {'reused'} | {'banned', worker, seconds left} | {'full', n} | {'ok', n}.
_JOIN = """
if ARGV[9] ~= '' and redis.call('HEXISTS', KEYS[3], ARGV[9]) == 1 then return {'reused'} end
local now = tonumber(ARGV[5])
local earlier = redis.call('HGET', KEYS[5], ARGV[4])
if earlier then
  for id in string.gmatch(earlier, '%S+') do
    local ban = redis.call('HGET', KEYS[6], id)
    if ban then
      local left = (tonumber(cjson.decode(ban).at) or now) + tonumber(ARGV[8]) - now  -- no time: as if now
      if left > 0 then return {'banned', id, tostring(math.ceil(left))} end
    end
  end
end
redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now - tonumber(ARGV[6]))
for _, id in ipairs(redis.call('ZRANGE', KEYS[4], 0, -1)) do
  if redis.call('HEXISTS', KEYS[6], id) == 1 then redis.call('ZREM', KEYS[4], id) end
end
local active = redis.call('ZCARD', KEYS[4])
if active >= tonumber(ARGV[7]) then return {'full', tostring(active)} end
redis.call('HSET', KEYS[1], ARGV[2], ARGV[1])
redis.call('HSET', KEYS[2], ARGV[1], ARGV[3])
if ARGV[9] ~= '' then redis.call('HSET', KEYS[3], ARGV[9], ARGV[1]) end
redis.call('ZADD', KEYS[4], now, ARGV[1])
redis.call('HSET', KEYS[5], ARGV[4], (earlier and (earlier .. ' ') or '') .. ARGV[1])
return {'ok', tostring(active + 1)}
"""


def secret_digest(secret: str) -> str:
    """sha256 hex of a token or invite code: what Redis and memory hold instead of it."""
    return hashlib.sha256(secret.encode()).hexdigest()


def read_secret_file(path: str | Path, what: str) -> object:
    """The YAML/JSON content of a mounted secrets file (`what`: "tokens", "invites"); ConfigError naming the file
    when it cannot be read or parsed."""
    try:
        return strict_yaml.load(Path(path).read_text())  # a worker id given twice: an error, not a lost token
    except OSError as exc:
        raise ConfigError(str(path), [f"cannot read {what} file: {exc.strerror}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), [f"{what} file is not valid YAML/JSON: {exc}"]) from None


def load_invites(path: str | Path) -> set[str]:
    """Digests of the invite codes in a YAML/JSON list file; ConfigError naming what is wrong."""
    source = str(path)
    data = read_secret_file(path, "invites")
    if not isinstance(data, list) or not data or not all(isinstance(c, str) and c for c in data):
        raise ConfigError(source, ["invites file must be a non-empty list of invite codes (non-empty strings)"])
    return {secret_digest(code) for code in data}


def local_admission_problems(spec) -> list[str]:
    """What stops a local run's ingest (`rlfleet run`) from admitting joins, found before anything starts: mode
    invite without spec.ingest.admission.invitesFile, or an invites file that cannot be read as codes."""
    admission = spec.ingest.admission
    if admission.mode != "invite":
        return []
    if not admission.invites_file:
        return [
            "spec.ingest.admission.invitesFile: mode invite needs a YAML/JSON list of invite codes on a local run "
            "(the Secret named by `invites` is for clusters)"
        ]
    try:
        load_invites(admission.invites_file)
    except ConfigError as exc:
        return [f"spec.ingest.admission.invitesFile: {p}" for p in exc.problems]
    return []


def run_document(
    run_doc: dict, ingest: IngestSpec, engines: list[str], public_key: str | None, relay_urls: list[str]
) -> dict:
    """The public run document (`GET /v1/{run}`). `run_doc`: the RLRun as dumped by alias; only the fields a
    worker reads (views.PUBLIC) go out, so the Redis URL, the store and Secret names never do. `engines`:
    the engines the gate admits (spec.verifier.engines); `relay_urls`: where a joined worker fetches versions."""
    public = project(run_doc, PUBLIC)
    spec, admission = public["spec"], ingest.admission
    run = public["metadata"]["name"]
    paths = {"join": JOIN_PATH, "rollouts": ROLLOUTS_PATH, "tickets": TICKETS_PATH, "document": RUN_PATH}
    return {
        "apiVersion": API_VERSION,
        "run": run,
        "rlrun": public,  # a worker writes this as its config (`rlfleet join`)
        "model": spec.get("model"),
        "engines": list(engines),
        "sampling": spec.get("sampling", {}),
        "taskIds": {
            "task": spec.get("task", {}).get("type"),
            "assignment": spec.get("sampling", {}).get("assignment", "worker"),
            "scheme": "ids of the run's task source; with assignment `run` a ticket from POST tickets picks them",
        },
        "relayUrls": relay_urls,
        "publicKey": public_key,
        "admission": {"mode": admission.mode, "codeRequired": admission.mode == "invite"},
        "limits": {
            "maxBodyBytes": ingest.max_body_bytes,
            "ratePerMinute": ingest.rate_per_minute,
            "probationGroups": admission.probation_groups,
            "probationRatePerMinute": admission.probation_rate_per_minute,
            "maxActiveWorkers": admission.max_active_workers,
            "joinsPerMinutePerAddress": admission.joins_per_minute_per_address,
            "rejoinBanSeconds": admission.rejoin_ban_seconds,
        },
        "paths": {k: v.format(run=run) for k, v in paths.items()},
    }


class Refusal(Exception):
    """A join refused: HTTP `code`, `detail` for the client, `retry_after` seconds for 429/503."""

    def __init__(self, code: int, detail: str, retry_after: float | None = None):
        super().__init__(detail)
        self.code, self.detail, self.retry_after = code, detail, retry_after


def parse_join_body(body: bytes, engines: list[str]) -> dict:
    """The join request's fields (`code`, `engine`), or Refusal 413/422 naming what is wrong."""
    if len(body) > JOIN_BODY_MAX_BYTES:
        raise Refusal(413, f"join body is over {JOIN_BODY_MAX_BYTES} bytes")
    try:
        data = json.loads(body or b"{}")
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise Refusal(422, f"join body is not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise Refusal(422, 'join body must be a JSON object: {} or {"code": "<invite code>"}')
    unknown = sorted(set(data) - {"code", "engine"})
    if unknown:
        raise Refusal(422, f"join body has unknown fields {unknown}; known: code, engine")
    code, engine = data.get("code"), data.get("engine")
    if code is not None and (not isinstance(code, str) or not code or len(code) > 256):
        raise Refusal(422, "code must be a non-empty string of at most 256 characters")
    if engine is not None and engine not in engines:
        raise Refusal(422, f"engine {engine!r} is not admitted by this run; admitted: {engines}")
    return {"code": code, "engine": engine}


class Door:
    """Joins and joined workers' credentials of one run (module docstring)."""

    def __init__(self, run: str, spec: IngestSpec, client: redis.Redis, invites: set[str], document: dict):
        self.run, self.spec, self.admission, self.client = run, spec, spec.admission, client
        self.keys, self.invites, self.document = RunKeys(run), invites, document
        self.per_address = RateLimiter(self.admission.joins_per_minute_per_address)
        self.overall = RateLimiter(self.admission.joins_per_minute)
        self._join = client.register_script(_JOIN)

    def worker_for(self, token: str) -> str | None:
        """The joined worker this token belongs to (Redis, so any replica's joins count), else None."""
        if self.admission.mode == "tokens":
            return None
        found = cast(bytes | None, self.client.hget(self.keys.credentials, secret_digest(token)))
        return found.decode() if found else None

    def rate_for(self, worker: str) -> int:
        """Groups per minute of a joined worker: probationRatePerMinute doubled per probationGroups accepted
        (the count the gate copies to RunKeys.standing)."""
        full, groups = self.spec.rate_per_minute, self.admission.probation_groups
        if groups <= 0:
            return full
        accepted = int(cast(bytes | None, self.client.hget(self.keys.standing, worker)) or 0)
        return min(full, self.admission.probation_rate_per_minute * 2 ** min(accepted // groups, 30))

    def check_rate(self, address: str) -> None:
        """Refusal 429 when the address, or everyone together, is over its join rate (the tokens are spent)."""
        for limiter, key, what in ((self.per_address, address, "this address"), (self.overall, "*", "all joins")):
            wait = limiter.take(key)
            if wait > 0:
                raise Refusal(429, f"{what} over the run's join rate; retry later", retry_after=wait)

    def join(self, address: str, body: bytes) -> dict:
        """Admit one worker (module docstring for the checks); its id and token, or Refusal."""
        mode = self.admission.mode
        if mode == "tokens":
            raise Refusal(403, f"run {self.run!r} admits only workers with operator-written tokens (mode tokens)")
        self.check_rate(address)
        request = parse_join_body(body, self.document["engines"])
        invite = ""
        if mode == "invite":
            if request["code"] is None:
                raise Refusal(403, 'run admits by invitation: send {"code": "<invite code>"}')
            invite = secret_digest(request["code"])
            if invite not in self.invites:
                raise Refusal(403, "unknown invite code")
        worker, token = f"j-{secrets.token_hex(8)}", secrets.token_urlsafe(32)
        now = time.time()
        record = json.dumps({"address": address, "mode": mode, "at": now, "engine": request["engine"]})
        a = self.admission
        keys = [self.keys.credentials, self.keys.joined, self.keys.invites_used, self.keys.active]
        keys += [self.keys.join_addresses, self.keys.banned]
        args: list[str | float] = [worker, secret_digest(token), record, address, now, a.active_seconds]
        args += [a.max_active_workers, a.rejoin_ban_seconds, invite]
        answer = [v.decode() for v in self._join(keys=keys, args=args)]
        if answer[0] == "reused":
            raise Refusal(409, "invite code already used")
        if answer[0] == "banned":
            BANNED_REFUSALS.inc()
            raise Refusal(403, f"a worker that joined from this address is banned ({answer[1]})", float(answer[2]))
        ACTIVE.set(int(answer[1]))
        if answer[0] == "full":
            raise Refusal(503, f"{answer[1]} workers active (maxActiveWorkers)", retry_after=FULL_RETRY_SECONDS)
        return {
            "worker_id": worker,
            "token": token,
            "run": self.run,
            "probation": {"groups": a.probation_groups, "ratePerMinute": self.rate_for(worker)},
        }


def make_door(run, client: redis.Redis, invites_file: str | None, relay_urls: list[str] | None = None) -> Door:
    """The door of the ingest of `run` (an RLRun, or the ingest's view of it): invites loaded (mode invite),
    the run document with the manifest public key and `relay_urls` (default spec.ingest.admission.relayUrls;
    `rlfleet run` passes its own relays, whose ports the spec cannot know)."""
    spec, mode, where = run.spec.ingest, run.spec.ingest.admission.mode, "spec.ingest.admission"
    relays = list(relay_urls or spec.admission.relay_urls)
    if mode == "invite" and not invites_file:
        raise ConfigError(where, ["invitesFile: required by mode invite (or pass --invites-file)"])
    if mode != "tokens" and not relays:
        raise ConfigError(
            where, [f"relayUrls: mode {mode} needs the public relay URLs joining workers fetch from (or --relay-url)"]
        )
    try:
        key = run_public_key(run.spec.shardcast)
    except KeyConfigError:
        if mode != "tokens":
            raise  # a joining worker could not check a manifest: the message names the setting
        key = None
    run_doc = run.model_dump(mode="json", by_alias=True, exclude_none=True)
    public = public_key_text(key) if key else None
    document = run_document(run_doc, spec, run.spec.verifier.engines, public, relays)
    invites = load_invites(invites_file) if invites_file else set()
    return Door(run.metadata.name, spec, client, invites, document)
