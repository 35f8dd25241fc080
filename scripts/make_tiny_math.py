"""Write rlfleet/tasks/samples/tiny-math.jsonl: the data set `builtin://tiny-math`, on which the model
`builtin://tiny-math` warm-starts and examples/math train.

Four families of short problems with exact rational answers, written the way the math task scores
them (rlfleet/tasks/math.py: the answer in `\\boxed{}`, compared by value, so `10/12` counts for `5/6`):
  fraction sums and differences   "1/2+1/3=?"   -> "5/6"      (denominators 2..6)
  fraction products               "2/3*3/4=?"   -> "1/2"
  linear equations                "3x+4=19,x=?" -> "5"        (integer or fractional solutions)
Answers are written reduced ("5/6", "-1/2", "2"). Rows are drawn without repetition by a fixed
seed, so the file is the same on every run of this script:

    python scripts/make_tiny_math.py            # rewrites rlfleet/tasks/samples/tiny-math.jsonl
    python scripts/make_tiny_math.py --check    # fails if the file differs from what it would write
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from fractions import Fraction
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "rlfleet" / "tasks" / "samples" / "tiny-math.jsonl"
SEED = 20260
PER_FAMILY = 160
DENOMINATORS = range(2, 7)


def written(value: Fraction) -> str:
    return str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"


def proper_fractions() -> list[tuple[int, int]]:
    return [(a, b) for b in DENOMINATORS for a in range(1, b)]


def fraction_rows(op: str) -> list[dict]:
    rows = []
    for a, b in proper_fractions():
        for c, d in proper_fractions():
            x, y = Fraction(a, b), Fraction(c, d)
            value = {"+": x + y, "-": x - y, "*": x * y}[op]
            rows.append({"problem": f"{a}/{b}{op}{c}/{d}=?", "answer": written(value), "family": f"fraction{op}"})
    return rows


def equation_rows() -> list[dict]:
    rows = []
    for a in range(2, 6):
        for b in range(-9, 10):
            for c in range(-9, 20):
                if b == 0:
                    continue
                x = Fraction(c - b, a)
                rows.append(
                    {
                        "problem": f"{a}x{'+' if b > 0 else '-'}{abs(b)}={c},x=?",
                        "answer": written(x),
                        "family": "equation",
                    }
                )
    return rows


def build() -> list[dict]:
    rng = random.Random(SEED)
    rows = []
    for family in (fraction_rows("+"), fraction_rows("-"), fraction_rows("*"), equation_rows()):
        rows.extend(rng.sample(family, PER_FAMILY))
    rng.shuffle(rows)
    return rows


def encode(rows: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--check", action="store_true", help="compare with the file instead of writing it")
    args = parser.parse_args()
    text = encode(build())
    if args.check:
        if not OUT.exists() or OUT.read_text() != text:
            print(f"{OUT} differs from what scripts/make_tiny_math.py writes; rerun it", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(f"wrote {len(text.splitlines())} rows to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
