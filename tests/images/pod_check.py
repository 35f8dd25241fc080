"""Run inside a container of a rendered pod (tests/images/test_images.py passes this file to `python3 -c`):
does every path the pod's command and env name exist, or can it be written, as the image's user with
the pod's volumes on a read-only root filesystem? Prints one JSON object: {"ok": [...], "errors": [...]}.

argv[1] is the pod container's command as JSON. The config file is loaded the way the component
loads it, and the task is built from it (a dataset task reads its file, relative paths from the
working directory the pod gets: the image's), so a dataset the image should ship is looked for too.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

READ_FLAGS = ("--config", "--tokens-file")  # files the component reads
WRITE_FLAGS = ("--output-dir", "--cache-dir")  # directories the component creates and writes
READ_ENV = ("RLFLEET_SIGNING_KEY_FILE",)
WRITE_ENV = ("RLFLEET_CACHE", "TMPDIR", "HF_HOME", "XDG_CACHE_HOME", "MPLCONFIGDIR")

command = json.loads(sys.argv[1])
ok: list[str] = []
errors: list[str] = []


def check(what: str, fn) -> None:
    try:
        fn()
        ok.append(what)
    except Exception as exc:  # every failure is reported, not only the first
        errors.append(f"{what}: {type(exc).__name__}: {exc}")


def readable(path: str) -> None:
    Path(path).read_bytes()


def writable(path: str) -> None:
    Path(path).mkdir(parents=True, exist_ok=True)
    probe = Path(path) / ".write-probe"
    probe.write_text("x")
    probe.unlink()


def on_path(name: str) -> None:
    if shutil.which(name) is None:
        raise FileNotFoundError(f"{name} is not on PATH ({os.environ.get('PATH')})")


def config_and_task(path: str) -> None:
    from rlfleet.config import load_bundle
    from rlfleet.models.builtin import BUILTIN_PREFIX
    from rlfleet.tasks import make_task

    run = load_bundle(path).run
    make_task(run.spec.task)  # a dataset task reads its rows here
    if not run.spec.model.path.startswith(BUILTIN_PREFIX):
        readable(str(Path(run.spec.model.path) / "config.json"))


check(f"command {command[0]}", lambda: on_path(command[0]))
for i, arg in enumerate(command[:-1]):
    value = command[i + 1]
    if arg in READ_FLAGS:
        check(f"{arg} {value}", lambda v=value: readable(v))
    if arg in WRITE_FLAGS:
        check(f"{arg} {value}", lambda v=value: writable(v))
for name in READ_ENV:
    if os.environ.get(name):
        check(f"${name} {os.environ[name]}", lambda n=name: readable(os.environ[n]))
for name in WRITE_ENV:
    if os.environ.get(name):
        check(f"${name} {os.environ[name]}", lambda n=name: writable(os.environ[n]))
check("tempfile", lambda: tempfile.TemporaryDirectory().cleanup())
if "--config" in command:
    check("config and task", lambda: config_and_task(command[command.index("--config") + 1]))
print(json.dumps({"ok": ok, "errors": errors, "cwd": os.getcwd(), "uid": os.getuid()}))
