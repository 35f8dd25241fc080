"""Copy the generated CRDs (crds/*.yaml, from `rlfleet crds --out crds/`) into the chart's crds/.

    python charts/rlfleet/sync_crds.py

Helm installs a chart's crds/ before its templates and never templates them, so the chart carries
byte-identical copies; tests/chart/test_chart.py fails when they drift.
"""

from __future__ import annotations

import shutil
from pathlib import Path

CHART = Path(__file__).resolve().parent
SOURCE = CHART.parent.parent / "crds"
TARGET = CHART / "crds"


def main() -> None:
    sources = sorted(SOURCE.glob("*.yaml"))
    if not sources:
        raise SystemExit(f"no CRDs in {SOURCE}: run `rlfleet crds --out crds/` first")
    TARGET.mkdir(exist_ok=True)
    wanted = {p.name for p in sources}
    for stale in TARGET.glob("*.yaml"):
        if stale.name not in wanted:
            stale.unlink()
    for src in sources:
        shutil.copyfile(src, TARGET / src.name)
        print(TARGET / src.name)


if __name__ == "__main__":
    main()
