"""A trainer replica's rank group: `rlfleet trainer --ranks N` runs N rank processes, torchrun-style.

A replica (one local process, or one trainer pod) is a group of N = `trainer.ranksPerReplica` rank
processes, one per GPU (rlfleet/config/training.py: N defaults to `gpus`, or 1 without GPUs). With N > 1 the
command started for the replica is the group's parent: it trains nothing, it starts N children running the
same command line, each with the torchrun environment of its rank (`rank_env`):
  LOCAL_RANK = i (0..N-1: the GPU index in the pod, rlfleet/models/device.py), LOCAL_WORLD_SIZE = N,
  RANK = GROUP_RANK x N + i, WORLD_SIZE = replicas x N (given), MASTER_ADDR/MASTER_PORT (given),
where GROUP_RANK is the replica's index (the pod's ordinal; the local launcher's replica number); a lone
replica started by hand without MASTER_ADDR rendezvouses on 127.0.0.1 and a free port. A process
with ranks 1 (or a child, which has LOCAL_RANK set) is a rank itself; without RANK in its environment it
takes GROUP_RANK x 1 + 0.

A group lives and dies together (`run_group`): a torch.distributed process group cannot lose a member
(its peers block in the next collective or fail on the closed socket), so when one rank exits with an
error or a signal the parent kills the others and exits with that rank's status, and the supervisor
(rlfleet/local/supervisor.py) or the kubelet restarts the whole replica, whose ranks rejoin from the
saved resume state (state.py). The parent exits 0 once every rank has; it forwards SIGTERM/SIGINT to
every rank, and each child dies with the parent (PR_SET_PDEATHSIG), so a `kill -9` of the parent never
leaves ranks behind holding the rendezvous port. Only local rank 0 serves /metrics (the pod's port; the
probes ask it); the world's rank 0 alone reads the streams, publishes and saves the commit.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping

from rlfleet.wire import env
from rlfleet.wire.ports import free_port

PR_SET_PDEATHSIG = 1


def rank_env(environ: Mapping[str, str], local_rank: int, ranks: int) -> dict[str, str]:
    """The torchrun variables of local rank `local_rank` of a replica of `ranks` ranks (module docstring)."""
    group = int(environ.get(env.GROUP_RANK, "0"))
    world = int(environ.get(env.WORLD_SIZE, str(ranks)))
    rank = group * ranks + local_rank
    if world % ranks or rank >= world:
        raise SystemExit(
            f"trainer: {env.WORLD_SIZE}={world} is not replicas x {ranks} ranks per replica with replica "
            f"{env.GROUP_RANK}={group} in it; give every replica the same --ranks and WORLD_SIZE = replicas x ranks"
        )
    return {
        env.LOCAL_RANK: str(local_rank),
        env.LOCAL_WORLD_SIZE: str(ranks),
        env.RANK: str(rank),
        env.WORLD_SIZE: str(world),
    }


def is_group_parent(ranks: int, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process starts a group of ranks rather than being one (a child has LOCAL_RANK)."""
    return ranks > 1 and env.LOCAL_RANK not in environ


def become_rank(ranks: int) -> None:
    """Set this process's RANK/WORLD_SIZE from GROUP_RANK when it is a rank that was not given them."""
    if env.RANK not in os.environ:
        os.environ.update(rank_env(os.environ, int(os.environ.get(env.LOCAL_RANK, "0")), ranks))


def _die_with_parent() -> None:
    # Linux only; elsewhere a child outlives a killed parent (the supervisor's group kill still ends it).
    try:
        ctypes.CDLL(None).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        pass


def run_group(ranks: int, argv: list[str] | None = None, poll_s: float = 0.2) -> int:
    """Start `ranks` children of `argv` (default: this command line), each with its rank's environment;
    return 0 when all exit 0, else the first failure's status after killing the others."""
    argv = argv or [sys.executable, "-m", "rlfleet.cli", *sys.argv[1:]]
    base = dict(os.environ)
    if env.MASTER_ADDR not in base and int(base.get(env.WORLD_SIZE, ranks)) == ranks:
        base.update({env.MASTER_ADDR: "127.0.0.1", env.MASTER_PORT: str(free_port())})  # one replica, by hand
    envs = [{**base, **rank_env(base, i, ranks)} for i in range(ranks)]
    procs = [subprocess.Popen(argv, env=e, preexec_fn=_die_with_parent) for e in envs]

    def forward(signum, frame) -> None:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, code = failed[0]
            print(f"trainer: local rank {i} exited with {code}; stopping the replica's other ranks", file=sys.stderr)
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return code if code > 0 else 128 - code  # a signal's status as a shell reports it
        if all(c == 0 for c in codes):
            return 0
        time.sleep(poll_s)
