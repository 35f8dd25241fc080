"""User environments (`spec.task.type: python`): a TaskSource written by the user, run in a child process.

The entry point is `package.module:Factory` (an attribute path) or the name of an entry point in the
`rlfleet.environments` group; the factory is called with `spec.task.config` as keyword arguments and
must return a `rlfleet.tasks.TaskSource` (docs/environments.md states the contract).

Isolation: the environment lives in one child process (a fresh interpreter, so it inherits no threads
or CUDA state of the worker or the verifier, with the parent's sys.path as its PYTHONPATH) that answers
calls over a pair of pipes. Every call waits
at most `timeoutSeconds`; a call that raises, outlives the limit, kills its process, or returns what
the contract does not allow (a reward that is not a finite number, one reward per completion) raises
EnvironmentFailure with the reason. After a timeout or a crash the child is killed and started again
on the next call, so an environment that hangs on one completion costs that group only: the verifier
rejects it (reason `environment`, forgiven by the ban policy: an honest worker gets it too) and goes on.
`sample_id` draws a 64-bit seed from the caller's generator and passes the seed, so the caller's draw
stays deterministic although the generator never crosses the pipe.
"""

from __future__ import annotations

import importlib
import json
import math
import os
import subprocess
import sys
import threading
from importlib import metadata
from multiprocessing.connection import Connection

import numpy as np

from rlfleet.tasks.base import Problem, TaskSource, ToolError

GROUP = "rlfleet.environments"
START_SECONDS = 120.0  # importing the user's package (and numpy, torch...) in a fresh interpreter


class EnvironmentFailure(RuntimeError):
    """A call into a user environment failed; the message says how."""


def load_factory(entrypoint: str, field: str):
    """The factory an entry point names; ValueError naming `field` when it cannot be found."""
    if ":" in entrypoint:
        module_name, _, attr_path = entrypoint.partition(":")
        try:
            obj = importlib.import_module(module_name)
        except ImportError as exc:
            raise ValueError(
                f"{field}: cannot import module {module_name!r} ({exc}); install the environment's package in the "
                f"image (docs/environments.md) or put its directory on PYTHONPATH"
            ) from None
        for part in attr_path.split("."):
            if not hasattr(obj, part):
                raise ValueError(f"{field}: module {module_name!r} has no attribute {attr_path!r}")
            obj = getattr(obj, part)
        return obj
    found = [ep for ep in metadata.entry_points(group=GROUP) if ep.name == entrypoint]
    if not found:
        known = sorted(ep.name for ep in metadata.entry_points(group=GROUP))
        raise ValueError(
            f"{field}: no installed package has an entry point {entrypoint!r} in group {GROUP} (installed: "
            f"{known or 'none'}); write package.module:Factory or install the package"
        )
    try:
        return found[0].load()
    except Exception as exc:  # the user's import: any error is theirs to see
        raise ValueError(f"{field}: loading entry point {entrypoint!r} failed: {type(exc).__name__}: {exc}") from None


def build_environment(entrypoint: str, config: dict[str, str], field: str) -> TaskSource:
    """Call the factory; ValueError naming `field` unless it returns a TaskSource."""
    factory = load_factory(entrypoint, field)
    if not callable(factory):
        raise ValueError(f"{field}: {entrypoint!r} is a {type(factory).__name__}, not a factory to call")
    try:
        env = factory(**config)
    except Exception as exc:
        raise ValueError(f"{field}: {entrypoint}(**config) raised {type(exc).__name__}: {exc}") from None
    if not isinstance(env, TaskSource):
        raise ValueError(
            f"{field}: {entrypoint} returned a {type(env).__name__}, not a rlfleet.tasks.TaskSource "
            f"(subclass it and implement problem, sample_id and reward)"
        )
    return env


def _child_main(read_fd: int, write_fd: int, spec_json: str) -> None:
    """The child process's entry (`python -c`): serve the environment `spec_json` describes over the two pipes."""
    spec = json.loads(spec_json)
    requests_in, replies_out = Connection(read_fd, writable=False), Connection(write_fd, readable=False)
    _serve(requests_in, replies_out, spec["entrypoint"], spec["config"], spec["field"])


def _serve(requests_in, conn, entrypoint: str, config: dict[str, str], field: str) -> None:
    """The child: build the environment, then answer (method, args) calls until the pipe closes."""
    try:
        env = build_environment(entrypoint, config, field)
    except Exception as exc:
        conn.send(("error", str(exc)))
        return
    conn.send(("ok", {"multi_turn": bool(env.multi_turn)}))
    while True:
        try:
            method, args = requests_in.recv()
        except EOFError:
            return
        try:
            if method == "sample_id":
                result = env.sample_id(np.random.default_rng(args[0]))
            else:
                result = getattr(env, method)(*args)
            conn.send(("ok", result))
        except Exception as exc:
            try:
                conn.send(("error", f"{type(exc).__name__}: {exc}"))
            except Exception:  # the exception itself does not pickle
                conn.send(("error", type(exc).__name__))


class PythonEnvironment(TaskSource):
    """A user environment behind a process boundary and a time limit (see the module docstring)."""

    def __init__(self, entrypoint: str, config: dict[str, str], timeout_seconds: float, field: str = "spec.task"):
        self.entrypoint, self.config, self.timeout = entrypoint, dict(config), timeout_seconds
        self.field = f"{field}.entrypoint"
        self._lock = threading.Lock()
        self._process: subprocess.Popen | None = None
        self._requests: Connection | None = None
        self._conn: Connection | None = None
        self._start()  # a bad entry point fails here, when the run's task is made, not at the first group

    def _start(self) -> None:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        spec = json.dumps({"entrypoint": self.entrypoint, "config": self.config, "field": self.field})
        code = f"from rlfleet.tasks.python_env import _child_main; _child_main({to_child_r}, {from_child_w}, {spec!r})"
        environ = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(to_child_r, from_child_w), env=environ)
        os.close(to_child_r)
        os.close(from_child_w)
        requests = Connection(to_child_w, readable=False)
        replies = Connection(from_child_r, writable=False)
        try:
            if not replies.poll(START_SECONDS):
                raise ValueError(f"{self.field}: the environment did not start within {START_SECONDS:.0f}s")
            try:
                status, detail = replies.recv()
            except EOFError:
                raise ValueError(f"{self.field}: the environment's process exited while starting") from None
            if status != "ok":
                raise ValueError(detail)
            self.multi_turn = detail["multi_turn"]
        except ValueError:
            self._kill(process, requests, replies)
            raise
        self._process, self._requests, self._conn = process, requests, replies

    @staticmethod
    def _kill(process: subprocess.Popen, *conns: Connection) -> None:
        process.kill()
        process.wait(5)
        for conn in conns:
            conn.close()

    def _stop(self) -> None:
        if self._process is not None:
            assert self._requests is not None and self._conn is not None
            self._kill(self._process, self._requests, self._conn)
        self._process = self._requests = self._conn = None

    def close(self) -> None:
        with self._lock:
            self._stop()

    def __del__(self) -> None:
        try:
            self._stop()
        except Exception:  # interpreter shutdown: the child dies with its pipes anyway
            pass

    def _call(self, method: str, *args):
        with self._lock:
            if self._process is None:
                try:
                    self._start()
                except ValueError as exc:
                    raise EnvironmentFailure(f"restarting the environment failed: {exc}") from None
            assert self._requests is not None and self._conn is not None
            try:
                self._requests.send((method, args))
                reply = self._conn.recv() if self._conn.poll(self.timeout) else None
            except (EOFError, OSError):
                self._stop()
                raise EnvironmentFailure(f"{method}: the environment's process exited") from None
            if reply is None:
                self._stop()  # it may never return: a new process serves the next call
                raise EnvironmentFailure(f"{method}: no answer within timeoutSeconds {self.timeout:g}")
        status, value = reply
        if status != "ok":
            raise EnvironmentFailure(f"{method} raised {value}")
        return value

    def problem(self, task_id: str) -> Problem:
        try:
            problem = self._call("problem", task_id)
        except EnvironmentFailure as exc:
            if "raised KeyError" in str(exc):  # the contract's "not an id of this source"
                raise KeyError(f"task id {task_id!r}: {exc}") from None
            raise
        if not isinstance(problem, Problem) or not isinstance(problem.prompt, str):
            raise EnvironmentFailure(f"problem returned a {type(problem).__name__}, not a rlfleet.tasks.Problem")
        return problem

    def sample_id(self, rng: np.random.Generator) -> str:
        task_id = self._call("sample_id", int(rng.integers(0, 2**63)))
        if not isinstance(task_id, str) or not task_id:
            raise EnvironmentFailure(f"sample_id returned {task_id!r}, not a non-empty str")
        return task_id

    def respond(self, problem: Problem, turns: list[str]) -> str | None:
        text = self._call("respond", problem, list(turns))
        if text is not None and not isinstance(text, str):
            raise EnvironmentFailure(
                f"respond returned a {type(text).__name__}, not a str (the turn) or None (the end)"
            )
        return text

    def call_tool(self, problem: Problem, name: str, arguments: dict) -> str:
        try:
            result = self._call("call_tool", problem, name, dict(arguments))
        except EnvironmentFailure as exc:
            if str(exc).startswith("call_tool raised ToolError: "):  # the contract's "the tool refuses the call"
                raise ToolError(str(exc).removeprefix("call_tool raised ToolError: ")) from None
            raise
        if not isinstance(result, str):
            raise EnvironmentFailure(f"call_tool returned a {type(result).__name__}, not a str")
        return result

    def episode_text(self, problem: Problem, turns: list[str]) -> str:
        text = self._call("episode_text", problem, list(turns))
        if not isinstance(text, str):
            raise EnvironmentFailure(f"episode_text returned a {type(text).__name__}, not a str")
        return text

    def reward(self, problem: Problem, completion: str) -> float:
        return self.rewards(problem, [completion])[0]

    def rewards(self, problem: Problem, completions: list[str]) -> list[float]:
        values = self._call("rewards", problem, list(completions))
        if not isinstance(values, (list, tuple)) or len(values) != len(completions):
            raise EnvironmentFailure(
                f"rewards returned {type(values).__name__} {str(values)[:80]}, not {len(completions)} numbers"
            )
        out = []
        for value in values:
            if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)):
                raise EnvironmentFailure(f"reward returned {value!r} ({type(value).__name__}), not a number")
            if not math.isfinite(float(value)):
                raise EnvironmentFailure(f"reward returned {value!r}, not a finite number")
            out.append(float(value))
        return out


def from_spec(spec, field: str = "spec.task", isolate: bool = True) -> TaskSource:
    """The environment of a PythonTaskSpec: behind the process boundary, or (isolate=False) called directly."""
    if not isolate:
        return build_environment(spec.entrypoint, spec.config, f"{field}.entrypoint")
    return PythonEnvironment(spec.entrypoint, spec.config, spec.timeout_seconds, field)
