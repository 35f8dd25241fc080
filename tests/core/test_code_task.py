"""Code task: real sandboxed subprocesses; hostile programs score 0 and never hurt the verifier."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

from rlfleet.config import CodeTaskSpec
from rlfleet.tasks import make_task
from rlfleet.tasks.code import CodeTask, Limits, can_drop_to_nobody, extract_program, namespaces_available, passes

PAIRS = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 7\n", "output": "12"}]
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"
LIMITS = Limits(timeout_seconds=2.0, memory_mb=256, max_output_bytes=64 * 1024, max_processes=8)
MODES = [
    "audit-hook",
    pytest.param(
        "namespace", marks=pytest.mark.skipif(not namespaces_available(), reason="unshare does not work here")
    ),
]


def test_extract_program_takes_the_last_python_block():
    text = "try:\n```python\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```\n"
    assert extract_program(text) == "print(2)\n"
    assert extract_program("print(3)") == "print(3)"


@pytest.mark.parametrize("mode", MODES)
def test_correct_and_wrong_programs(mode, tmp_path):
    assert passes(ADD, PAIRS, LIMITS, mode, str(tmp_path))
    assert not passes("print(3)", PAIRS, LIMITS, mode, str(tmp_path))  # passes the first pair only
    assert passes("def f(x):\n    return 2 * x\n", "assert f(2) == 4\nassert f(0) == 0", LIMITS, mode, str(tmp_path))
    assert not passes("def f(x):\n    return 3 * x\n", "assert f(2) == 4", LIMITS, mode, str(tmp_path))
    assert list(tmp_path.iterdir()) == []  # every working directory removed


@pytest.mark.parametrize(
    "program",
    [
        "raise RuntimeError('crash')",
        "while True: pass",
        "x = bytearray(4 * 1024**3)\nprint(3)",
        "while True: print('x' * 1000)",
        "import os\nwhile True:\n    os.fork()",
        "import os\nos._exit(0)",  # exits before the asserts run
        "import sys\nsys.exit(0)",
    ],
)
@pytest.mark.parametrize("mode", MODES)
def test_hostile_programs_score_zero_within_the_time_limit(program, mode, tmp_path):
    if "fork" in program and os.geteuid() == 0 and not can_drop_to_nobody():
        pytest.skip("root, and uid 65534 cannot run this Python: RLIMIT_NPROC would not bound a fork bomb")
    tests = "assert False" if "exit" in program else PAIRS
    start = time.monotonic()
    assert not passes(program + "\nprint(3)\n", tests, LIMITS, mode, str(tmp_path))
    assert time.monotonic() - start < LIMITS.timeout_seconds * len(PAIRS) + 3
    assert list(tmp_path.iterdir()) == []
    time.sleep(0.2)
    assert sandboxed_processes_in(tmp_path) == [], "a sandboxed process outlived its run"


def sandboxed_processes_in(root) -> list[int]:
    """The harness's processes (their command line names `program_path, tests_path`) whose working directory is
    under `root`: this test's own, not those of a run another test, or another pytest worker, has going."""
    found = []
    for proc in psutil.process_iter(["cmdline", "cwd"]):
        command, cwd = " ".join(proc.info["cmdline"] or ()), proc.info["cwd"] or ""
        if "program_path, tests_path" in command and cwd.startswith(str(root)):
            found.append(proc.pid)
    return found


@pytest.mark.parametrize("mode", MODES)
def test_a_program_cannot_connect_to_a_local_server(mode, tmp_path):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    server.settimeout(0.2)
    port = server.getsockname()[1]
    accepted, done = [], threading.Event()
    acceptor = threading.Thread(target=_accept_all, args=(server, accepted, done), daemon=True)
    acceptor.start()
    program = f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nprint('connected')\n"
    # The same program unsandboxed does connect (so the assertion below can fail).
    plain = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=10)
    assert plain.stdout.strip() == "connected"
    deadline = time.monotonic() + 10
    while not accepted and time.monotonic() < deadline:  # the acceptor may lag behind on a busy machine
        time.sleep(0.05)
    assert len(accepted) == 1
    assert not passes(program, [{"input": "", "output": "connected\n"}], LIMITS, mode, str(tmp_path))
    time.sleep(0.5)
    done.set()
    acceptor.join()
    server.close()
    assert len(accepted) == 1, "the sandboxed program connected"


def _accept_all(server: socket.socket, accepted: list, done: threading.Event) -> None:
    while not done.is_set():
        try:
            conn, _ = server.accept()
        except OSError:  # the timeout: look at `done` again
            continue
        accepted.append(conn)
        conn.close()


def test_the_verifier_environment_is_not_passed_to_the_program(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "very-secret")
    program = "import os\nprint(os.environ.get('AWS_SECRET_ACCESS_KEY', 'none'))"
    assert passes(program, [{"input": "", "output": "none"}], LIMITS, "auto", str(tmp_path))


def test_code_task_from_config_and_sample_dataset():
    spec = CodeTaskSpec.model_validate(
        {
            "type": "code",
            "dataset": {"path": "data/samples/code.jsonl"},
            "timeoutSeconds": 3,
            "memoryMb": 256,
            "solveRateMin": 0.2,
        }
    )
    task = make_task(spec)
    assert isinstance(task, CodeTask) and task.stats.kept == 9 and task.stats.dropped_out_of_band == 1
    assert task.limits.timeout_seconds == 3 and task.limits.memory_mb == 256
    p = task.problem("code-0")
    assert p.prompt.startswith("Read two integers")
    assert task.reward(p, f"Here you go:\n```python\n{ADD}```") == 1.0
    assert task.reward(p, "```python\nprint(0)\n```") == 0.0
    fib = task.problem("code-2")
    solution = "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)\n"
    assert task.reward(fib, f"```python\n{solution}```") == 1.0
    gcd = task.problem("code-7")
    assert task.reward(gcd, "```python\nimport math\ndef gcd(a, b):\n    return math.gcd(a, b)\n```") == 1.0
    assert task.reward(gcd, "```python\ndef gcd(a, b):\n    return 1\n```") == 0.0
    assert task.sample_id(np.random.default_rng(0)) in task.ids()
    with pytest.raises(KeyError):
        task.problem("code-9")  # filtered out (solve_rate 0.1)
