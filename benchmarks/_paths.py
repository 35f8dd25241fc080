"""The one way a benchmark reaches the repository's top-level packages (`rlfleet`, `tests`, `testbed`):
`import _paths` before them. A script run as `python benchmarks/X.py` has benchmarks/ on sys.path, not
the repository root; this puts the root first (once), so the checkout's code is the one imported even
without PYTHONPATH=$PWD. It imports nothing of the repository itself, so it sits at the bottom of every
benchmark's imports."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
