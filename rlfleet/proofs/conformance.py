"""Check `proof.py` against reference TOPLOC vectors (tests/data/toploc/case_*.json).

A case passes when (see tests/data/toploc/README.md):
1. `build_proofs` on the `honest` activations gives the reference `proofs_base64`, byte for byte;
2. `verify_proofs` of every candidate in `verification` against the *reference* proofs gives, per
   chunk, the same `exp_mismatches` and mantissa mean/median within 1e-6 (2**64, "no exponent
   matched", compares equal to itself).
A case file that cannot be read is a failing case, named with the field at fault.
"""

from __future__ import annotations

import base64
import binascii
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from rlfleet.proofs.toploc import ProofFormatError, build_proofs, verify_proofs

STAT_TOLERANCE = 1e-6
_REQUIRED = (
    "shape",
    "prompt_len",
    "skip_prefill",
    "decode_batching_size",
    "topk",
    "activations",
    "proofs_base64",
    "verification",
)


@dataclass
class CaseReport:
    name: str
    passed: bool
    failures: list[str] = field(default_factory=list)
    chunks: int = 0
    candidates: int = 0


def _stat_equal(got: float, want: float) -> bool:
    return got == want or abs(got - want) <= STAT_TOLERANCE


def _decode_activations(blob: str, shape: tuple[int, int], name: str) -> np.ndarray:
    raw = base64.b64decode(blob, validate=True)
    if len(raw) != 2 * shape[0] * shape[1]:
        raise ValueError(
            f"activations[{name!r}] holds {len(raw)} bytes, shape {list(shape)} needs {2 * shape[0] * shape[1]}"
        )
    return np.frombuffer(raw, dtype="<u2").reshape(shape)  # (T, H) bf16 bits


def _check_case(case: dict, report: CaseReport) -> None:
    """Append every discrepancy between this implementation and the case to `report.failures`."""
    missing = [k for k in _REQUIRED if k not in case]
    if missing:
        report.failures.append(f"case file lacks field(s) {', '.join(missing)}")
        return
    shape = tuple(case["shape"])
    kw = dict(
        prompt_len=case["prompt_len"],
        decode_batching_size=case["decode_batching_size"],
        topk=case["topk"],
        skip_prefill=case["skip_prefill"],
    )
    ref_proofs = [base64.b64decode(p, validate=True) for p in case["proofs_base64"]]
    report.chunks = len(ref_proofs)
    report.candidates = len(case["verification"])

    honest = _decode_activations(case["activations"]["honest"], shape, "honest")
    ours = build_proofs(honest, **kw)
    if len(ours) != len(ref_proofs):
        report.failures.append(f"build_proofs gave {len(ours)} proofs, the reference {len(ref_proofs)}")
    for n, (mine, ref) in enumerate(zip(ours, ref_proofs)):
        if mine != ref:
            first = next((i for i, (a, b) in enumerate(zip(mine, ref)) if a != b), min(len(mine), len(ref)))
            report.failures.append(
                f"proof {n}: bytes differ from the reference at byte {first} ({len(mine)} vs {len(ref)} bytes)"
            )

    for cand, expected in case["verification"].items():
        if cand not in case["activations"]:
            report.failures.append(f"verification names candidate {cand!r} with no activations")
            continue
        acts = _decode_activations(case["activations"][cand], shape, cand)
        try:
            got = verify_proofs(acts, ref_proofs, **kw)
        except ProofFormatError as exc:
            report.failures.append(f"{cand}: verify_proofs rejected the reference proofs: {exc}")
            continue
        if len(got) != len(expected):
            report.failures.append(f"{cand}: {len(got)} chunk results, the reference has {len(expected)}")
        for n, (r, (exp_mm, mean, median)) in enumerate(zip(got, expected)):
            if (
                r.exp_mismatches != exp_mm
                or not _stat_equal(r.mant_err_mean, mean)
                or not _stat_equal(r.mant_err_median, median)
            ):
                report.failures.append(
                    f"{cand} chunk {n}: got [{r.exp_mismatches}, {r.mant_err_mean}, {r.mant_err_median}], "
                    f"reference [{exp_mm}, {mean}, {median}]"
                )


def run_conformance(case_dir) -> list[CaseReport]:
    """One report per `case_*.json` in `case_dir`, in name order."""
    reports = []
    for path in sorted(Path(case_dir).glob("case_*.json")):
        report = CaseReport(name=path.stem, passed=False)
        try:
            _check_case(json.loads(path.read_text()), report)
        except (json.JSONDecodeError, binascii.Error, KeyError, TypeError, ValueError) as exc:
            # A malformed case file (or one our API refuses, e.g. a bad prompt_len) fails the case.
            report.failures.append(f"cannot check {path.name}: {type(exc).__name__}: {exc}")
        report.passed = not report.failures
        reports.append(report)
    return reports


def run_conformance_cli(case_dir: str) -> int:
    """Print a PASS/FAIL line per case and a summary; 0 iff there are cases and all pass."""
    if not Path(case_dir).is_dir():
        print(f"error: conformance directory {case_dir} does not exist", file=sys.stderr)
        return 2
    reports = run_conformance(case_dir)
    if not reports:
        print(f"error: no case_*.json files in {case_dir}", file=sys.stderr)
        return 1
    for r in reports:
        counts = f"({r.chunks} chunks, {r.candidates} candidates)"
        if r.passed:
            print(f"PASS {r.name} {counts}")
        else:
            print(f"FAIL {r.name} {counts}: {r.failures[0]}")
            for extra in r.failures[1:10]:
                print(f"     {extra}")
            if len(r.failures) > 10:
                print(f"     ... and {len(r.failures) - 10} more")
    passed = sum(r.passed for r in reports)
    print(f"{passed}/{len(reports)} TOPLOC conformance cases passed")
    return 0 if passed == len(reports) else 1
