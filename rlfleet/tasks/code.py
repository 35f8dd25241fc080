"""Code problems: binary reward = the completion's program passes every test of its row.

The program is the last ```python (or ```py / bare ```) fenced block of the completion, else the whole
text. Tests are stdin/stdout pairs (`[{input, output}]` or `{inputs: [...], outputs: [...]}`; outputs
compared line by line with trailing whitespace ignored) or a string of assert code run after the
program, which must then reach its end: the harness prints a per-run nonce only after the asserts, so
`sys.exit(0)` or `os._exit(0)` before them scores 0. Tests run one process each, stopping at the first
failure.

Sandbox of each run (a fresh temporary directory as cwd, removed afterwards; a minimal environment
without the verifier's variables or credentials; `python -I`):
  - limits set by the harness before the program runs: RLIMIT_AS (memory), RLIMIT_FSIZE (stdout goes
    to a file, so this caps output and files), RLIMIT_NPROC (fork bombs), RLIMIT_CPU, no core dumps;
    a wall-clock timeout kills the whole process group (SIGKILL).
  - network: `namespace` runs `unshare --net --pid --fork --kill-child` (plus `--map-root-user` when not
    root): no interface but a down loopback, and every process of the run dies with it.
    `audit-hook`: a `sys.addaudithook` hook raises on socket creation/connect and on process spawning
    (exec, posix_spawn, system); weaker, as ctypes can bypass it. `auto` probes unshare once.
  - as root (where RLIMIT_NPROC is not enforced, even in a user namespace) the harness drops to uid/gid
    65534 (nobody) if that uid can run this Python; else it warns and runs as root, where a fork bomb is
    bounded only by the time limit (and, with namespaces, dies with the PID namespace).
Not isolated: the filesystem (the program can read what its user can read; run the verifier as a
non-root user in its own container). A program's result never raises in the verifier.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlfleet.tasks.base import Problem
from rlfleet.tasks.datasets import DatasetError, DatasetTask, dataset_name, load_rows

log = logging.getLogger(__name__)
NOBODY = 65534
_FENCE = re.compile(r"```(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)

# Runs in the child as `python -I -c HARNESS mode limits... program tests`; stdin is the test input.
HARNESS = r"""
import os, resource, sys
mode, mem, fsize, nproc, cpu, drop, program_path, tests_path, nonce = sys.argv[1:10]
for lim, v in ((resource.RLIMIT_AS, int(mem)), (resource.RLIMIT_FSIZE, int(fsize)),
               (resource.RLIMIT_NPROC, int(nproc)), (resource.RLIMIT_CPU, int(cpu)), (resource.RLIMIT_CORE, 0)):
    resource.setrlimit(lim, (v, v))
if drop == "1":
    os.setgroups([]); os.setgid(65534); os.setuid(65534)
if mode == "audit-hook":
    def _deny(event, args):
        if event.startswith("socket.") or event in ("os.system", "os.exec", "os.posix_spawn", "os.spawn",
                                                    "subprocess.Popen", "os.forkpty", "pty.spawn"):
            raise PermissionError(f"sandbox: {event} is not allowed")
    sys.addaudithook(_deny)
source = open(program_path).read()
tests = open(tests_path).read() if tests_path != "-" else ""
del sys.argv[1:]
sys.path.insert(0, os.getcwd())
code = compile(source + "\n\n" + tests, "solution.py", "exec")
exec(code, {"__name__": "__main__", "__builtins__": __builtins__})
if tests:
    sys.stdout.flush()
    sys.stdout.write("\n" + nonce + "\n")
"""


def extract_program(completion: str) -> str:
    """The last fenced python block, else the whole completion."""
    blocks = _FENCE.findall(completion)
    return blocks[-1] if blocks else completion


@dataclass(frozen=True)
class Limits:
    timeout_seconds: float = 10.0
    memory_mb: int = 1024
    max_output_bytes: int = 1 << 20
    max_processes: int = 16


@functools.cache
def namespaces_available() -> bool:
    """Whether `unshare` can give a run its own network and PID namespaces here."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run([*_unshare_prefix(), "true"], capture_output=True, timeout=10).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _unshare_prefix() -> list[str]:
    # Not root: a user namespace (ns-root maps to our uid, which RLIMIT_NPROC binds, counted per namespace).
    root = os.geteuid() == 0
    return ["unshare", *([] if root else ["--user", "--map-root-user"]), "--net", "--pid", "--fork", "--kill-child"]


@functools.cache
def can_drop_to_nobody() -> bool:
    """Root only: whether uid 65534 can run this Python (its files world-readable, e.g. not under /root)."""
    probe = subprocess.run(
        [
            sys.executable,
            "-I",
            "-c",
            "import os; os.setgid(65534); os.setuid(65534); "
            "import math, json, re, collections, itertools, heapq, bisect, functools",
        ],
        capture_output=True,
        timeout=30,
    )
    if probe.returncode != 0:
        log.warning(
            "code task: the verifier runs as root and uid 65534 cannot run %s; programs run as root, "
            "where RLIMIT_NPROC does not bind (a fork bomb is bounded only by the time limit). "
            "Run the verifier as a non-root user.",
            sys.executable,
        )
    return probe.returncode == 0


def resolve_isolation(isolation: str) -> str:
    if isolation == "auto":
        return "namespace" if namespaces_available() else "audit-hook"
    if isolation == "namespace" and not namespaces_available():
        raise RuntimeError(
            "task.networkIsolation: namespace, but `unshare --net --pid` does not work here "
            "(no unshare binary or user namespaces disabled); use audit-hook or auto"
        )
    return isolation


def _tasks_of(uid: int) -> int:
    """Processes + threads of `uid` now (what RLIMIT_NPROC counts outside a user namespace)."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            continue
        uid_line = re.search(r"^Uid:\s+(\d+)", status, re.M)
        threads = re.search(r"^Threads:\s+(\d+)", status, re.M)
        if uid_line and int(uid_line.group(1)) == uid and threads:
            count += int(threads.group(1))
    return count


def _wait_unreaped(pid: int, timeout: float) -> bool:
    """Wait until `pid` exits (True) or `timeout` passes (False), leaving it a zombie (not reaped)."""
    deadline = time.monotonic() + timeout
    delay = 0.001
    while os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT | os.WNOHANG) is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


@dataclass(frozen=True)
class RunResult:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    timed_out: bool


def run_program(
    program: str,
    stdin: str = "",
    tests: str | None = None,
    limits: Limits = Limits(),
    isolation: str = "auto",
    tmp_root: str | None = None,
) -> tuple[RunResult, str]:
    """Run `program` (then `tests`, if given) in the sandbox; (result, nonce the harness prints after tests)."""
    mode = resolve_isolation(isolation)
    root = os.geteuid() == 0  # RLIMIT_NPROC does not bind root (nor root in a user namespace): drop to nobody
    drop = root and can_drop_to_nobody()
    userns = mode == "namespace" and not root
    nproc = limits.max_processes + (0 if userns else _tasks_of(NOBODY if drop else os.getuid()))
    nonce = secrets.token_hex(16)
    with tempfile.TemporaryDirectory(prefix="rlfleet-code-", dir=tmp_root) as work:
        if drop:
            os.chmod(work, 0o777)
        Path(work, "solution.py").write_text(program)
        if tests is not None:
            Path(work, "tests.py").write_text(tests)
        Path(work, "stdin.txt").write_text(stdin)
        cmd = [
            sys.executable,
            "-I",
            "-c",
            HARNESS,
            mode,
            str(limits.memory_mb << 20),
            str(limits.max_output_bytes),
            str(nproc),
            str(math.ceil(limits.timeout_seconds) + 1),
            "1" if drop else "0",
            "solution.py",
            "tests.py" if tests is not None else "-",
            nonce,
        ]
        if mode == "namespace":
            cmd = [*_unshare_prefix(), *cmd]
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": work,
            "TMPDIR": work,
            "PYTHONHASHSEED": "0",
            "PYTHONDONTWRITEBYTECODE": "1",
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
        }
        out_path = Path(work, ".stdout")
        with open(Path(work, "stdin.txt"), "rb") as fin, open(out_path, "wb") as fout:
            proc = subprocess.Popen(
                cmd,
                cwd=work,
                env=env,
                stdin=fin,
                stdout=fout,
                stderr=subprocess.DEVNULL,
                start_new_session=True,
                close_fds=True,
            )
            timed_out = not _wait_unreaped(proc.pid, limits.timeout_seconds)
            try:  # the whole group, forked children too; the unreaped leader keeps the group id from reuse
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        with open(out_path, "rb") as f:
            stdout = f.read(limits.max_output_bytes + 1).decode("utf-8", errors="replace")
    return RunResult(None if timed_out else proc.returncode, stdout, timed_out), nonce


def _lines(text: str) -> list[str]:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def parse_tests(tests) -> tuple[list[tuple[str, str]], str | None]:
    """(stdin/stdout pairs, assert code) of a row's tests; ValueError when neither shape fits."""
    if isinstance(tests, str):
        try:
            decoded = json.loads(tests)
        except json.JSONDecodeError:
            return [], tests  # assert code
        return parse_tests(decoded)
    if isinstance(tests, dict) and "inputs" in tests and "outputs" in tests:
        if len(tests["inputs"]) != len(tests["outputs"]):
            raise ValueError("tests: inputs and outputs differ in length")
        return [(str(i), str(o)) for i, o in zip(tests["inputs"], tests["outputs"])], None
    if isinstance(tests, list) and all(isinstance(t, dict) and "input" in t and "output" in t for t in tests):
        return [(str(t["input"]), str(t["output"])) for t in tests], None
    raise ValueError("tests: expected assert code (a string), a list of {input, output}, or {inputs, outputs}")


def passes(
    program: str, tests, limits: Limits = Limits(), isolation: str = "auto", tmp_root: str | None = None
) -> bool:
    """True when the program passes every test within the limits."""
    pairs, asserts = parse_tests(tests)
    if asserts is not None:
        result, nonce = run_program(program, "", asserts, limits, isolation, tmp_root)
        return result.returncode == 0 and _lines(result.stdout)[-1:] == [nonce]
    if not pairs:
        return False
    for stdin, expected in pairs:
        result, _ = run_program(program, stdin, None, limits, isolation, tmp_root)
        if (
            result.returncode != 0
            or len(result.stdout) > limits.max_output_bytes
            or _lines(result.stdout) != _lines(expected)
        ):
            return False
    return True


class CodeTask(DatasetTask):
    """Rows with a prompt and tests (field `tests_field`); Problem.answer is the tests as JSON, Problem.reference
    a row's `solution` (a program that passes them) when it has one."""

    reference_field = "solution"

    def __init__(
        self,
        rows: list[dict],
        name: str,
        prompt_template: str = "{prompt}",
        tests_field: str = "tests",
        limits: Limits = Limits(),
        isolation: str = "auto",
        tmp_root: str | None = None,
        **kw,
    ):
        self.tests_field, self.limits, self.tmp_root = tests_field, limits, tmp_root
        self.required_fields = (tests_field,)
        super().__init__(rows, name, prompt_template, **kw)
        for task_id in self._ids:
            try:
                parse_tests(self._rows[task_id][tests_field])
            except ValueError as exc:
                raise DatasetError(f"task.dataset: row {task_id!r}: field {tests_field!r}: {exc}") from None
        self.isolation = resolve_isolation(isolation)

    def answer(self, row: dict) -> str:
        tests = row[self.tests_field]
        return tests if isinstance(tests, str) else json.dumps(tests)

    def reward(self, problem: Problem, completion: str) -> float:
        program = extract_program(completion)
        return 1.0 if passes(program, problem.answer, self.limits, self.isolation, self.tmp_root) else 0.0


def from_spec(spec) -> CodeTask:
    """A CodeTask from config.CodeTaskSpec (loads the dataset)."""
    limits = Limits(spec.timeout_seconds, spec.memory_mb, spec.max_output_bytes, spec.max_processes)
    return CodeTask(
        load_rows(spec.dataset),
        dataset_name(spec.dataset),
        spec.prompt_template,
        spec.tests_field,
        limits,
        spec.network_isolation,
        solve_rate_min=spec.solve_rate_min,
        solve_rate_max=spec.solve_rate_max,
        solve_rate_field=spec.solve_rate_field,
    )
