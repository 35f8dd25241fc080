"""`rlfleet join URL [--code C] [--engine torch|vllm]`: a worker from the run document's URL alone.

URL is the run document of an ingest, `https://ingest.example.org/v1/RUN` (the ingest's base URL is what
comes before `/v1/`). The steps:
  1. GET the run document (rlfleet/services/ingest/door.py): the RLRun as a worker reads it, the engines the
     gate admits, the relays, the manifest public key;
  2. POST /v1/RUN/join (with the invite code, if any): a worker id and its token;
  3. write, under --work-dir, the worker's config (the document's RLRun, its shardcast.publicKey set to the
     document's key, so every manifest fetched from the relays is checked with it, and one InferencePool
     whose ingestUrl is the ingest) and its credentials (mode 0600);
  4. run `rlfleet rollout` in this process: weights from the relays, groups to the ingest with the token.
A second `rlfleet join` with the same --work-dir and URL resumes as the same worker (the credentials file)
instead of joining again, so a restart keeps its reputation and does not spend a join or an invite.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

import requests
import yaml

from rlfleet.config import API_VERSION, ConfigError
from rlfleet.services.ingest.client import join_url
from rlfleet.wire import env, tls

POOL = "joined"  # the InferencePool of the written config


@dataclass(frozen=True)
class JoinOptions:
    url: str  # the run document: BASE/v1/RUN
    code: str | None = None
    engine: str | None = None  # default: the first engine the run admits
    work_dir: Path | None = None  # default ./rlfleet-join-RUN
    metrics_port: int = 0
    ca_file: Path | None = None  # the CA bundle an https:// ingest and the relays are checked with (wire/tls.py)


def split_url(url: str) -> tuple[str, str]:
    """(ingest base URL, run) of a run document URL `BASE/v1/RUN`; ConfigError naming the expected form."""
    parts = urlsplit(url.rstrip("/"))
    head, sep, run = parts.path.rpartition("/v1/")
    if parts.scheme not in ("http", "https") or not parts.netloc or not sep or not run or "/" in run:
        raise ConfigError(url, ["rlfleet join: URL must be a run document, http(s)://HOST[:PORT]/v1/RUN"])
    return f"{parts.scheme}://{parts.netloc}{head}", run


def _fail(what: str, resp: requests.Response) -> ConfigError:
    try:
        detail = resp.json().get("detail", resp.text)
    except ValueError:
        detail = resp.text
    return ConfigError(resp.url, [f"{what}: HTTP {resp.status_code}: {detail}"])


def fetch_document(url: str) -> dict:
    try:
        resp = requests.get(url, timeout=30, verify=tls.requests_verify())
    except requests.RequestException as exc:
        raise ConfigError(url, [f"rlfleet join: cannot reach the ingest: {tls.describe(exc)}"]) from None
    if resp.status_code != 200:
        raise _fail("rlfleet join: no run document", resp)
    try:
        document = resp.json()
    except ValueError:
        document = None
    if not isinstance(document, dict) or not isinstance(document.get("rlrun"), dict):
        raise ConfigError(url, ["rlfleet join: the answer is not an rlfleet run document (is this an ingest?)"])
    return document


def join_run(base: str, run: str, code: str | None, engine: str) -> dict:
    """POST the join; the ingest's answer (worker_id, token, probation) or ConfigError with its detail."""
    body = {"engine": engine, **({"code": code} if code else {})}
    resp = requests.post(join_url(base, run), json=body, timeout=30, verify=tls.requests_verify())
    if resp.status_code != 201:
        hint = f" (retry after {resp.headers['Retry-After']} s)" if "Retry-After" in resp.headers else ""
        raise _fail(f"rlfleet join: the ingest refused the join{hint}", resp)
    return resp.json()


def worker_config(document: dict, base: str, engine: str) -> str:
    """The worker's config: the document's RLRun (its public key the document's) and one pool posting to `base`."""
    rlrun = json.loads(json.dumps(document["rlrun"]))  # a copy
    if document.get("publicKey"):
        rlrun["spec"].setdefault("shardcast", {})["publicKey"] = document["publicKey"]
    pool = {
        "apiVersion": API_VERSION,
        "kind": "InferencePool",
        "metadata": {"name": POOL},
        "spec": {"run": document["run"], "engine": engine, "ingestUrl": base},
    }
    return yaml.safe_dump_all([rlrun, pool], sort_keys=False)


def prepare(options: JoinOptions) -> tuple[Path, dict, dict]:
    """Steps 1-3 (module docstring): (config path, the run document, credentials {worker_id, token, ...})."""
    base, run = split_url(options.url)
    if options.ca_file is not None:  # this process's every https:// connection (the worker's too) checks with it
        os.environ[env.TLS_CA_FILE] = str(options.ca_file.resolve())
        tls.ca_file()  # a missing file: an error naming it, before anything is contacted
    document = fetch_document(options.url)
    engines = document.get("engines") or ["torch"]
    engine = options.engine or engines[0]
    if engine not in engines:
        raise ConfigError(options.url, [f"--engine {engine}: this run admits only {engines}"])
    if not document.get("relayUrls"):
        raise ConfigError(options.url, ["the run document names no relayUrls: the run's operator must set them"])
    work = options.work_dir or Path(f"rlfleet-join-{run}")
    work.mkdir(parents=True, exist_ok=True)
    saved = work / "credentials.json"
    credentials = json.loads(saved.read_text()) if saved.exists() else None
    if credentials is None or credentials.get("url") != options.url:
        credentials = {"url": options.url, **join_run(base, run, options.code, engine)}
        fd = os.open(saved, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(credentials, f)
    config = work / "rlrun.yaml"
    config.write_text(worker_config(document, base, engine))
    return config, document, credentials


def main(options: JoinOptions) -> int:
    config, document, credentials = prepare(options)
    work = config.parent
    worker = credentials["worker_id"]
    print(f"rlfleet join: worker {worker} of run {document['run']} (config {config})", file=sys.stderr)
    os.environ[env.WORKER_TOKEN] = credentials["token"]
    # A joined worker speaks only to the ingest and the relays, and checks manifests with the document's key.
    for name in (env.WORKER_TOKEN_FILE, env.REDIS_URL, env.REDIS_READ_URL, env.REDIS_TICKETS_URL, env.PUBLIC_KEY):
        os.environ.pop(name, None)
    from rlfleet.services.rollout.main import RolloutOptions
    from rlfleet.services.rollout.main import main as rollout_main

    rollout = RolloutOptions(
        config=config,
        worker_id=worker,
        cache_dir=work / "cache",
        relay_urls=list(document["relayUrls"]),
        pool=POOL,
        metrics_port=options.metrics_port,
    )
    return rollout_main(rollout)
