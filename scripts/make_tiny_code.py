"""Write rlfleet/tasks/samples/tiny-code.jsonl: the data set `builtin://tiny-code`, a code task written
with the characters of the builtin model `builtin://tiny-math`, so a mixture of math and code runs on it
(examples/mixture).

Each row asks for a program that sets `x` to the value of a short integer expression: the prompt is the
expression (`7*8-3`), the tests are the assert statement run after the program (`assert x==53`), and
`solution` is a program that passes (`x=53`), the completion a builtin model warm-starts on. The code
task scores a completion by running it (rlfleet/tasks/code.py): `x=7*8-3` passes too. Rows are drawn
without repetition by a fixed seed, so the file is the same on every run of this script:

    python scripts/make_tiny_code.py            # rewrites rlfleet/tasks/samples/tiny-code.jsonl
    python scripts/make_tiny_code.py --check    # fails if the file differs from what it would write
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "rlfleet" / "tasks" / "samples" / "tiny-code.jsonl"
SEED = 20261
ROWS = 240


def rows() -> list[dict]:
    rng = random.Random(SEED)
    seen: set[str] = set()
    out = []
    while len(out) < ROWS:
        a, b, c = rng.randint(2, 9), rng.randint(2, 9), rng.randint(1, 9)
        expression = f"{a}*{b}{rng.choice('+-')}{c}"
        if expression in seen:
            continue
        seen.add(expression)
        value = eval(expression)  # our own digits and operators only
        out.append({"prompt": expression, "tests": f"assert x=={value}", "solution": f"x={value}"})
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true")
    args = ap.parse_args()
    text = "".join(json.dumps(r) + "\n" for r in rows())
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} differs from what scripts/make_tiny_code.py writes; rerun it", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {ROWS} rows to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
