"""A cheating outside worker: `python -m tests.cluster.cheating_worker URL [rlfleet join's options]` is
`rlfleet join URL ...` (it joins through the door and works from the run document alone, as any outside
worker does) whose every group is replaced before it is posted by a forced answer (tests/toploc/attacks.py):
each completion becomes the task's right answer and EOS, its logprobs and TOPLOC proofs recomputed by a
real prefill of the weights the worker holds, its rewards then honestly 1. Only seed replay can tell: its
seeds never drew those tokens. A group the policy already answered right in every sample gives the attack
nothing to change; it is not posted, so every group this worker posts is poisoned. Once banned, the
ingest's 403 ends the worker (rlfleet/services/ingest/client.py raises on it)."""

from __future__ import annotations

import sys

from rlfleet import cli
from rlfleet.engines.torch_engine import TorchEngine
from rlfleet.services.rollout.main import Worker
from rlfleet.wire.streams import RolloutGroup
from tests.toploc import attacks

_honest_send = Worker.send


def send_forced(self: Worker, group: RolloutGroup) -> bool:
    engine = self.loaded  # the version that drew `group`: swaps happen only between batches
    assert isinstance(engine, TorchEngine), "the cheat proves its tokens with the torch model it holds"
    forced = attacks.forced(group, engine.model, engine.tokenizer, self.spec)
    if attacks.tokens(forced) == attacks.tokens(group):
        return True  # nothing to cheat with; an honest group is never posted
    return _honest_send(self, forced)


if __name__ == "__main__":
    Worker.send = send_forced  # type: ignore[method-assign]
    sys.exit(cli.main(["join", *sys.argv[1:]]))
