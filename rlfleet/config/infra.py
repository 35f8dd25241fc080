"""Where a run keeps its state and how its checkpoints and groups travel: `spec.redis`, `spec.store`,
`spec.shardcast`, `spec.ingest`, and the TLS of what crosses a cluster's edge (`spec.tls`, `tls` of the ingest
and of a RelayTier)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from rlfleet.config.base import NAME_PATTERN, Spec
from rlfleet.config.workload import ResourcesSpec, pod_template, resources


class RedisSpec(Spec):
    url: str | None = Field(
        default=None,
        description="redis:// URL. Empty: `rlfleet run` starts an embedded redis-server; the operator uses the Helm "
        "chart's Redis when it has one (a Secret RUN-redis-url, named in urlSecret), else requires it (or urlSecret).",
    )
    url_secret: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: name of a Secret whose key `url` holds the redis:// URL (keeps a password out of "
        "the spec); wins over url.",
    )
    stream_max_len: int = Field(
        default=10000, ge=100, description="Approximate MAXLEN of every stream; nothing grows without bound."
    )
    audit_stream_max_bytes: int = Field(
        default=256 * 2**20,
        ge=2**20,
        description="Bytes each of the verifier's audit streams (rejected, deadletter) holds at most, besides "
        "streamMaxLen entries: the oldest entries go first. An entry keeps its original message up to 1/16 of "
        "this (cut beyond, with its length and sha256), so at least the newest 16 are whole.",
    )
    role_urls: bool = Field(
        default=False,
        description="Cluster only: urlSecret also holds one URL per Redis ACL role "
        "(rlfleet/wire/redis_acl.py; the chart's redis.acl.users), keys url-trainer, url-verifier, url-ingest, "
        "url-reader (origin, relays, worker reads), "
        "url-worker and url-tickets (worker writes); each pod gets its role's, so a worker can only add to the "
        "inbox. `url` stays the operator's.",
    )

    @model_validator(mode="after")
    def _role_urls_need_a_secret(self) -> RedisSpec:
        if self.role_urls and not self.url_secret:
            raise ValueError("roleUrls: needs urlSecret (the Secret that holds the url-<role> keys)")
        return self


class StoreSpec(Spec):
    uri: str | None = Field(
        default=None,
        description="Checkpoint store: `file:///abs/dir`, `file://./relative/dir` or `s3://bucket/prefix`. Empty: "
        "`rlfleet run` uses RUN_DIR/store; the operator fills in the Helm chart's defaults.store, else requires it.",
    )
    endpoint_url: str | None = Field(
        default=None, description="S3 API endpoint (for MinIO, Ceph or a test server); empty = AWS default."
    )
    credentials_secret: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: name of a Secret whose keys (e.g. AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY) become "
        "environment variables of the pods that read or write the store.",
    )

    @model_validator(mode="after")
    def _scheme(self) -> StoreSpec:
        if self.uri is not None and not (self.uri.startswith("file://") or self.uri.startswith("s3://")):
            raise ValueError(f"uri {self.uri!r} must start with file:// or s3://")
        return self


class DeltaSpec(Spec):
    """How the trainer publishes a version: whole, or as what changed since the previous one
    (rlfleet/versions/). A client holding the previous version downloads only the delta; one without it
    downloads the newest full version and the deltas after it."""

    enabled: bool = Field(
        default=True,
        description="Publish versions as deltas against the previous version where they pay (see maxRatio). False: "
        "every version is published whole.",
    )
    full_every: int = Field(
        default=10,
        ge=1,
        le=1_000_000,
        description="Every version whose number is a multiple of this is published whole, whatever the delta "
        "would cost; 1 publishes every version whole.",
    )
    max_ratio: float = Field(
        default=0.8,
        gt=0.0,
        le=1.0,
        description="A delta larger than this fraction of the whole checkpoint is not worth it: the version is "
        "published whole instead.",
    )
    max_chain_ratio: float = Field(
        default=2.0,
        ge=0.0,
        le=100.0,
        description="The deltas since the last whole version may add up to at most this many whole checkpoints; the "
        "version that would pass it is published whole. A client without a base downloads a whole version and the "
        "deltas after it, so it never fetches more than (1 + maxChainRatio) checkpoints.",
    )
    delta_with_whole: bool = Field(
        default=True,
        description="A version published whole also carries its delta against the previous version (one manifest), "
        "so workers holding that one still download only the delta; relays then pull both. False: whole versions "
        "are only whole, which costs the workers a whole checkpoint every so often and the relays less. True suits "
        "trees where the relays' fan-out to workers is the bottleneck, false the origin's uplink.",
    )


class ShardcastSpec(Spec):
    keep_versions: int = Field(
        default=3,
        ge=1,
        description="Versions a relay and a worker keep on disk (a relay also keeps the versions that the delta chains "
        "of those pass through, back to a whole version).",
    )
    signing_key_secret: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: name of a Secret with keys `signing-key` (PEM ed25519 private key, mounted "
        "read-only into the trainer pods only; env RLFLEET_SIGNING_KEY_FILE) and `public-key` "
        "(`ed25519:<base64>`, given to every other pod as env RLFLEET_PUBLIC_KEY unless publicKey is "
        "set). Empty while requireSignatures is true: the operator makes a fresh key pair in a Secret "
        "RUN-signing-key, owned by the run, and names it here.",
    )
    require_signatures: bool = Field(
        default=True,
        description="Every policy manifest must be signed (ed25519) by the trainer; relays, workers and the verifier "
        "refuse unsigned or forged ones. `rlfleet run` generates a key pair per run. False: publish and "
        "accept unsigned manifests.",
    )
    public_key: str | None = Field(
        default=None,
        pattern=r"^ed25519:[A-Za-z0-9+/]{43}=$",
        description="The run's manifest verification key, `ed25519:<base64 of 32 bytes>` (the public half of the "
        "signing key; not a secret). Env RLFLEET_PUBLIC_KEY overrides it; `rlfleet run` sets that env.",
    )
    shard_size_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=4096,
        le=1 << 30,
        description="Checkpoint files are split into byte ranges of this size, each with its sha256 in the manifest; "
        "the unit of parallel download, retry and cut-through relaying.",
    )
    min_rate_bytes_per_second: int = Field(
        default=4 * 2**20,
        ge=1024,
        description="The slowest download that is not a failure. A fetch of a version (a worker's, the "
        "verifier's, a relay's pull) may take its fixed deadline plus the bytes it still needs at this rate, so a "
        "65 GB version on a slow link is slow, not failed (4 MiB/s: 4.4 hours); past it, the download stops and "
        "its next try resumes from the shards it verified.",
    )
    relay_max_disk_bytes: int | None = Field(
        default=None,
        ge=1,
        description="Disk bound of each relay's cache: older versions are dropped to stay under it, and a version "
        "larger than it is refused. Empty: bounded by keepVersions only.",
    )
    deltas: DeltaSpec = Field(
        default_factory=DeltaSpec, description="Delta versions: send what changed since the previous version."
    )


class ServerTLSSpec(Spec):
    """HTTPS of a server that traffic from outside the cluster reaches: the ingest, a relay tier (cluster only;
    rlfleet/wire/tls.py)."""

    secret_name: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: name of a Secret of type kubernetes.io/tls (keys tls.crt and tls.key; a "
        "cert-manager Certificate writes one) with the certificate the server presents. With it the server speaks "
        "only HTTPS on its port (plain HTTP gets no answer), and its URLs are https://; the certificate's names "
        "must include every host name clients use (the exposed name, and SERVICE.NAMESPACE.svc for clients in "
        "this cluster). Empty: plain HTTP.",
    )


class TrustSpec(Spec):
    """The CA bundle the run's relays and rollout workers in this cluster verify https:// servers with (the
    ingest, relay tiers, in this cluster or another; cluster only, rlfleet/wire/tls.py)."""

    ca_secret: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: name of a Secret whose key ca.crt is the PEM CA bundle (a cert-manager CA "
        "issuer's Certificate Secrets carry one). Empty, and no caConfigMap: the image's system trust store.",
    )
    ca_config_map: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: name of a ConfigMap whose key ca.crt is the PEM CA bundle (e.g. a trust-manager "
        "Bundle); instead of caSecret.",
    )

    @model_validator(mode="after")
    def _one_bundle(self) -> TrustSpec:
        if self.ca_secret and self.ca_config_map:
            raise ValueError("tls: name the CA bundle once, in caSecret or in caConfigMap, not both")
        return self


class AdmissionSpec(Spec):
    """How a worker gets an ingest token (`POST /v1/{run}/join`, rlfleet/services/ingest/door.py)."""

    mode: Literal["tokens", "open", "invite"] = Field(
        default="tokens",
        description="tokens: only the pre-written tokens (tokens / tokensFile), no joining; open: anyone may join "
        "(rate-limited per address and in total, up to maxActiveWorkers); invite: a join needs a single-use code "
        "(invites / invitesFile).",
    )
    invites: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only, mode invite: name of a Secret whose key `invites.yaml` holds the invite codes "
        "as a YAML/JSON list of strings.",
    )
    invites_file: str | None = Field(
        default=None, description="Local, mode invite: path of a YAML/JSON list of invite codes (each usable once)."
    )
    joins_per_minute_per_address: int = Field(
        default=6, ge=1, description="Joins one client address may make per minute (per ingest replica); over it 429."
    )
    joins_per_minute: int = Field(
        default=120, ge=1, description="Joins all addresses together may make per minute (per replica); over it 429."
    )
    max_active_workers: int = Field(
        default=256,
        ge=1,
        description="Joined workers active at once (joined or submitted within activeSeconds, not banned); a join "
        "over it gets 503 with Retry-After.",
    )
    active_seconds: int = Field(
        default=900, ge=10, description="A joined worker stops counting as active this long after its last request."
    )
    probation_groups: int = Field(
        default=20,
        ge=0,
        description="A joined worker is on probation until this many of its groups were accepted: every one of its "
        "groups gets the prefill checks (whatever spotCheckFraction) and its rate starts at probationRatePerMinute.",
    )
    probation_rate_per_minute: int = Field(
        default=6,
        ge=1,
        description="Groups per minute of a joined worker on probation; the rate doubles with each probationGroups "
        "accepted groups, up to ratePerMinute.",
    )
    rejoin_ban_seconds: int = Field(
        default=86400,
        ge=0,
        description="An address from which a worker that is now banned joined cannot join again for this long after "
        "the ban (403).",
    )
    relay_urls: list[str] = Field(
        default_factory=list,
        description="Public relay (or origin) base URLs a joining worker fetches policy versions from (announced in "
        "the run document `GET /v1/{run}`). Modes open and invite need them on a cluster; `rlfleet run` announces "
        "its own relays when this is empty.",
    )


class IngestSpec(Spec):
    """The authenticated HTTP front of the inbox for workers outside the cluster (`rlfleet ingest`)."""

    tokens: str | None = Field(
        default=None,
        pattern=NAME_PATTERN,
        description="Cluster only: name of a Secret whose key `tokens.yaml` holds the worker tokens as a YAML/JSON "
        "map `{workerId: token}`.",
    )
    tokens_file: str | None = Field(
        default=None,
        description="Local: path of a YAML/JSON file `{workerId: token}` (`rlfleet ingest --tokens-file` overrides "
        "it). A worker sends its token as `Authorization: Bearer <token>`.",
    )
    max_body_bytes: int = Field(
        default=32 * 2**20,
        ge=1024,
        description="Largest accepted group message in bytes (checked from Content-Length and while reading); larger "
        "ones get 413. Keep it at or below verifier.maxMessageBytes.",
    )
    rate_per_minute: int = Field(
        default=600,
        ge=1,
        description="Groups each worker may submit per minute (token bucket per ingest replica, bursts up to this "
        "many); over it gets 429 with Retry-After.",
    )
    max_backlog: int = Field(
        default=1000,
        ge=1,
        description="While the inbox holds this many unverified groups, submissions get 503 with Retry-After (the "
        "workers wait and resend); checked and added atomically, so the inbox never holds more. Must be below "
        "spec.redis.streamMaxLen.",
    )
    max_buffered_bytes: int = Field(
        default=128 * 2**20,
        ge=1024,
        description="Request bodies all submissions in flight may hold together; a submission that would go over it "
        "gets 503 with Retry-After before its body is read.",
    )
    request_timeout_seconds: float = Field(
        default=30.0,
        gt=0.0,
        le=3600.0,
        description="A connection must deliver a whole request (headers and body) within this many seconds of "
        "opening or of its previous response, else it is closed (slow clients); a slow body gets 408.",
    )
    max_connections: int = Field(
        default=512, ge=1, description="Requests served at once; more get 503 at once (uvicorn limit_concurrency)."
    )
    redis_timeout_seconds: float = Field(
        default=2.0,
        gt=0.0,
        le=60.0,
        description="Longest wait for Redis on a submission; a Redis that is down or stalled gives 503 with "
        "Retry-After, never an error or a hang.",
    )
    admission: AdmissionSpec = Field(
        default_factory=AdmissionSpec,
        description="Who may join the run through `POST /v1/{run}/join` (modes tokens, open, invite).",
    )
    tls: ServerTLSSpec = Field(
        default_factory=ServerTLSSpec,
        description="Cluster only: serve HTTPS with the certificate of a kubernetes.io/tls Secret (tls.secretName).",
    )
    resources: ResourcesSpec = resources("250m", "256Mi")
    pod_template: dict[str, Any] | None = pod_template()
