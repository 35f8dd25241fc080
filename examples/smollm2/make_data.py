"""Write the data of examples/smollm2: train.jsonl and held-out.jsonl, integer sums and differences asked
the way a person asks them ("What is 23 + 48?"), for SmolLM2-135M-Instruct through its chat template.

The math task scores a row by value (rlfleet/tasks/math.py): the last \\boxed{} of a completion, else the text
after "answer is", else its last number, compared with `answer`. Untrained, the model mostly restates the
sum and writes a wrong total ("23 + 48 = 100"), so the reward is the value alone.

Five levels of difficulty, so a prompt filter has solved and unsolved prompts to tell apart:
  1  a + b, both one digit                      "What is 3 + 5?"
  2  a two-digit number plus a one-digit one    "What is 23 + 7?"
  3  two two-digit numbers, no carry            "What is 23 + 41?"
  4  two two-digit numbers with a carry         "What is 27 + 48?"
  5  a two-digit number minus a smaller one     "What is 72 - 35?"
Each row carries its `level`. Rows are all the distinct problems of each level drawn without repetition by
a fixed seed; a problem is in one split only, so the held-out split is problems the run never trains on, and
the files are the same on every run of this script:

    python examples/smollm2/make_data.py            # rewrites examples/smollm2/{train,held-out}.jsonl
    python examples/smollm2/make_data.py --check    # fails if the files differ from what it would write
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 43
TRAIN_PER_LEVEL = 400
HELD_OUT_PER_LEVEL = 20  # 100 held-out problems: one greedy evaluation of them is a few seconds on 2 cores


def problems(level: int) -> list[tuple[str, int]]:
    """Every distinct (problem, answer) of a level, in a fixed order."""
    if level == 1:
        pairs = [(a, b, "+") for a in range(1, 10) for b in range(1, 10)]
    elif level == 2:
        pairs = [(a, b, "+") for a in range(10, 100) for b in range(1, 10)]
    elif level == 3:
        pairs = [(a, b, "+") for a in range(10, 100) for b in range(10, 100) if a % 10 + b % 10 < 10 and a + b < 100]
    elif level == 4:
        pairs = [(a, b, "+") for a in range(10, 100) for b in range(10, 100) if a % 10 + b % 10 >= 10]
    else:
        pairs = [(a, b, "-") for a in range(20, 100) for b in range(10, a) if a - b >= 5]
    return [(f"What is {a} {op} {b}?", a + b if op == "+" else a - b) for a, b, op in pairs]


def splits() -> tuple[list[dict], list[dict]]:
    rng = random.Random(SEED)
    train: list[dict] = []
    held_out: list[dict] = []
    for level in range(1, 6):
        pool = problems(level)
        rng.shuffle(pool)
        held = pool[:HELD_OUT_PER_LEVEL]
        rest = pool[HELD_OUT_PER_LEVEL : HELD_OUT_PER_LEVEL + TRAIN_PER_LEVEL]  # level 1 has only 81 problems
        held_out += [{"problem": p, "answer": str(v), "level": level} for p, v in held]
        train += [{"problem": p, "answer": str(v), "level": level} for p, v in rest]
    rng.shuffle(train)
    rng.shuffle(held_out)
    return train, held_out


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="fail if the files differ from what would be written")
    args = parser.parse_args()
    train, held_out = splits()
    files = {HERE / "train.jsonl": jsonl(train), HERE / "held-out.jsonl": jsonl(held_out)}
    if args.check:
        stale = [path.name for path, text in files.items() if not path.exists() or path.read_text() != text]
        if stale:
            print(f"out of date: {', '.join(stale)}; run python examples/smollm2/make_data.py", file=sys.stderr)
            return 1
        return 0
    for path, text in files.items():
        path.write_text(text)
        print(f"{path}: {text.count(chr(10))} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
