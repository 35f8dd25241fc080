"""Helpers shared by tests: real HTTP servers on loopback and small real models."""

from __future__ import annotations

import asyncio
import importlib
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis
import requests
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.services.shardcast.protocol import serve_until
from rlfleet.wire.ports import free_port
from tests.runs import bundle_yaml, rlrun

REPO = Path(__file__).resolve().parent.parent  # the repository root


def benchmark_module(monkeypatch, name: str):
    """benchmarks/`name`.py imported as a module, its folder on sys.path for this test (the scripts import their
    neighbours by file name: `_paths`, `delta`)."""
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    return importlib.import_module(name)


def wait_for(what: str, fn, timeout: float = 10.0, every: float = 0.1):
    """fn() until it returns something true, and that value; AssertionError naming `what` and fn's last
    answer after `timeout` seconds. A KeyError, IndexError or TypeError from fn counts as not yet (a
    status or object that is not there yet) and is its last answer."""
    deadline, last = time.monotonic() + timeout, None
    while True:
        try:
            last = fn()
        except (KeyError, IndexError, TypeError) as exc:
            last = exc
        if last and not isinstance(last, Exception):
            return last
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}; last: {last!r}")
        time.sleep(every)


def tiny_policy_dir(
    dest: Path, seed: int, hidden_size: int = 64, num_attention_heads: int = 4, num_key_value_heads: int = 2
) -> Path:
    """A randomly initialised Qwen2 policy with the builtin tokenizer, saved in HF format.

    The default head size 16 is the builtin tiny-arithmetic's; vLLM's CPU attention needs 32 or more
    (e.g. `num_attention_heads=2, num_key_value_heads=1`)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from rlfleet.models.builtin import build_tokenizer
    from rlfleet.versions.checkpoint import save_model_dir

    tokenizer = build_tokenizer()
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=2,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    save_model_dir(Qwen2ForCausalLM(config), tokenizer, dest)
    return dest


def trainer_run_config(model: Path, store: Path, trainer: str) -> str:
    """The RLRun YAML the trainer tests use: tiny groups of the arithmetic task, `trainer` as given (a flow mapping)."""
    return bundle_yaml(
        rlrun(
            "tr",
            model=model,
            task={"maxOperand": 20},
            sampling={"groupSize": 2, "maxTokens": 4},
            trainer=yaml.safe_load(trainer),
            store=store,
            shardcast={"requireSignatures": False},
        )
    )


def start_trainer(
    config: Path, redis_url: str, out: Path, *extra: str, log: str = "trainer.log", env: dict[str, str] | None = None
) -> subprocess.Popen:
    """`rlfleet trainer` as its own process (one torch thread, `env` added), metrics.jsonl in `out`,
    its output appended to `out/log`."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rlfleet.cli",
            "trainer",
            "--config",
            str(config),
            "--redis-url",
            redis_url,
            "--output-dir",
            str(out),
            *extra,
        ],
        stdout=open(out / log, "ab"),
        stderr=subprocess.STDOUT,
        env={**os.environ, "RLFLEET_TORCH_THREADS": "1", **(env or {})},
    )


CHART = REPO / "charts" / "rlfleet"


def render_chart(chart, values: dict, release: str = "rl", namespace: str = "rlfleet") -> list[dict]:
    """Every object the chart renders with `values` (the real Helm SDK: `chart` from helm_python.Chart.load)."""
    import yaml

    objects = []
    for path, text in sorted(chart.render(values, name=release, namespace=namespace, is_install=True).items()):
        if not path.endswith(".txt"):
            objects += [doc for doc in yaml.safe_load_all(text) if doc]
    return objects


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def trained_versions(dest: Path, count: int, dtype: str = "float32", lr: float = 1e-4, seed: int = 0) -> list[Path]:
    """`count` consecutive policy versions dest/v0, dest/v1, ... (HF directories): a tiny Qwen2 policy, then
    one AdamW step per version on the next-token loss of random sequences weighted by random advantages,
    which moves every weight like a GRPO step does (Adam's update is about lr per element, whatever the loss)."""
    import torch

    from rlfleet.models.policy import load_policy
    from rlfleet.versions.checkpoint import save_model_dir

    first = tiny_policy_dir(dest / "init", seed=seed)
    model, tokenizer = load_policy(first, dtype)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(seed)
    paths = []
    for v in range(count):
        if v:
            ids = torch.randint(3, len(tokenizer), (4, 12), generator=generator)
            logp = model(input_ids=ids).logits.float().log_softmax(-1)[:, :-1].gather(-1, ids[:, 1:, None])
            loss = -(logp.squeeze(-1) * torch.randn(4, 1, generator=generator)).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        paths.append(dest / f"v{v}")
        save_model_dir(model, tokenizer, paths[-1])
    return paths


@contextmanager
def serving(
    app: web.Application,
    host: str = "127.0.0.1",
    start_timeout: float = 10.0,
    tls_files: tuple[Path, Path] | None = None,
    ca_file: Path | None = None,
) -> Iterator[str]:
    """Serve `app` on a free port of `host` from a background thread (tests, benchmarks); yield its
    base URL once `/healthz` answers. On exit the server stops and its thread is joined. With `tls_files`
    (certificate, key) it serves HTTPS only, and `/healthz` is asked with `ca_file` as the CA bundle."""
    port, stop = free_port(), threading.Event()
    thread = threading.Thread(target=lambda: asyncio.run(serve_until(app, host, port, stop, tls_files)), daemon=True)
    thread.start()
    url = f"{'https' if tls_files else 'http'}://{host}:{port}"
    deadline = time.monotonic() + start_timeout
    while True:
        try:
            if requests.get(url + "/healthz", timeout=1, verify=str(ca_file) if ca_file else True).ok:
                break
        except requests.ConnectionError:
            if time.monotonic() > deadline or not thread.is_alive():
                raise RuntimeError(f"server on {url} did not start") from None
            time.sleep(0.02)
    try:
        yield url
    finally:
        stop.set()
        thread.join(15)
        if thread.is_alive():
            raise RuntimeError(f"server on {url} did not stop within 15 s")


@contextmanager
def serving_hub(hub, hf_home: Path, monkeypatch) -> Iterator[str]:
    """`hub` (tests/hub_server.py) served as huggingface_hub's endpoint (HF_ENDPOINT), with an empty cache in
    `hf_home`, online and without a token; yields its URL."""
    with serving(hub.app()) as url:
        monkeypatch.setenv("HF_ENDPOINT", url)
        monkeypatch.setenv("HF_HOME", str(hf_home))
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("HF_TOKEN", raising=False)
        yield url


# redis-py retries a failed call (10 times with back-off in 8.x, each waiting out its socket timeout):
# against a test's own server, which is either up or dead, that only turns a dead server into a hang.
CLIENT_TIMEOUTS = {"socket_connect_timeout": 2, "socket_timeout": 10}


def redis_client(port: int, **kwargs) -> redis.Redis:
    """A client for a test's own redis-server on 127.0.0.1:`port` that never retries: a refused
    connection fails the call at once."""
    return redis.Redis(port=port, **_no_retry(kwargs))


def redis_from_url(url: str, **kwargs) -> redis.Redis:
    """`redis.Redis.from_url` for a test's own server (EmbeddedRedis's URL, an ACL user's), never retrying."""
    return redis.Redis.from_url(url, **_no_retry(kwargs))


def _no_retry(kwargs: dict) -> dict:
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    return {"retry": Retry(NoBackoff(), 0), **CLIENT_TIMEOUTS, **kwargs}


def start_rendered_redis(args: list[str], data_dir: Path, **auth) -> tuple[subprocess.Popen, int]:
    """A real redis-server started with the arguments a rendered container runs, its `--port` and
    `--dir` replaced by a free port and `data_dir` (a chart renders `--dir /data`, a path a machine
    may lack). Returns (process, port) once the server answers PING as `auth` (username/password);
    a server that exits or never answers fails in seconds with what it printed."""
    from rlfleet.local.redis_server import redis_server_binary

    args = list(args)
    port = free_port()
    args[args.index("--port") + 1] = str(port)
    if "--dir" in args:
        args[args.index("--dir") + 1] = str(data_dir)
    else:
        args += ["--dir", str(data_dir)]
    log = data_dir / f"redis-{port}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([redis_server_binary(), *args], stdout=out, stderr=subprocess.STDOUT)
    client = redis_client(port, **auth)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            return proc, port
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait(5)
                raise AssertionError(f"redis-server {args} did not start: {log.read_text()[-2000:]}") from None
            time.sleep(0.05)


def scrape(url: str) -> dict[tuple[str, frozenset], float]:
    """A Prometheus /metrics page as {(sample name, its labels): value}."""
    text = requests.get(url, timeout=10).text
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
