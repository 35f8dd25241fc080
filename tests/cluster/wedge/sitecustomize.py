"""A wedged engine for the cluster-in-a-box test (tests/cluster/test_wedged_worker.py), test-only: this
directory goes first on a rollout pod's PYTHONPATH through the pool's podTemplate, so Python imports this
file when the worker starts. It makes the torch engine's generation block forever (the process alive,
its signal handler still setting `stop`, no forward step ever completing) after RLFLEET_TEST_WEDGE_AFTER
generations, once per pod: the marker file RLFLEET_TEST_WEDGE_MARKER (on the pod's emptyDir, which outlives
container restarts) says it happened, so the restarted container generates normally."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

_AFTER, _MARKER = os.environ.get("RLFLEET_TEST_WEDGE_AFTER"), os.environ.get("RLFLEET_TEST_WEDGE_MARKER")

if _AFTER and _MARKER and not Path(_MARKER).exists():
    from rlfleet.engines.torch_engine import TorchEngine

    _original, _calls = TorchEngine.generate_groups, [0]  # every generation: batches and idle probes

    def _generate_groups(self, *args, **kwargs):
        _calls[0] += 1
        if _calls[0] > int(_AFTER):
            Path(_MARKER).write_text("wedged\n")
            print(f"test wedge: generation {_calls[0]} blocks forever", file=sys.stderr, flush=True)
            threading.Event().wait()
        return _original(self, *args, **kwargs)

    TorchEngine.generate_groups = _generate_groups
