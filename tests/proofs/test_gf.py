"""GF(p) arithmetic of TOPLOC proofs (rlfleet/proofs/gf.py) and the many-sample proof calls:
the closed-form interpolation and the baby-step giant-step evaluation agree with the textbook loops,
and proofs of several samples at once are those of one sample at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rlfleet.proofs import gf
from rlfleet.proofs.toploc import ProofFormatError, build_proofs, build_proofs_many, verify_proofs, verify_proofs_many


def horner(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    acc = np.zeros(x.shape, dtype=np.int64)
    for j in range(coeffs.shape[1] - 1, -1, -1):
        acc = (acc * x + coeffs[:, j : j + 1]) % gf.PRIME
    return acc


@pytest.mark.parametrize("k", [1, 2, 3, 5, 64, 127, 128, 200, gf.FAST_MAX_K, gf.FAST_MAX_K + 1])
def test_interpolation_and_evaluation_agree_with_the_loops(k):
    rng = np.random.default_rng(k)
    x = np.stack([rng.choice(gf.PRIME, k, replace=False) for _ in range(5)]).astype(np.int64)  # (5, k) distinct
    y = rng.integers(0, 2**16, (5, k))  # bf16 bit patterns, some >= p
    coeffs = gf.interpolate(x, y)
    assert coeffs.shape == (5, k) and coeffs.min() >= 0 and coeffs.max() < gf.PRIME
    assert (coeffs == gf.interpolate_newton(x, y)).all()
    assert (gf.evaluate(coeffs, x) == y % gf.PRIME).all()  # it goes through the points
    points = rng.integers(0, gf.PRIME, (5, 33))
    assert (gf.evaluate(coeffs, points) == horner(coeffs, points)).all()


def test_many_samples_give_each_samples_proofs_and_results():
    g = torch.Generator().manual_seed(3)
    samples = [torch.randn(n, 64, generator=g) for n in (40, 7, 71, 33)]  # chunks of 32 rows and shorter
    prompt_lens = [5, 7, 6, 1]
    many = build_proofs_many(samples, prompt_lens)
    assert many == [build_proofs(s, p) for s, p in zip(samples, prompt_lens)]

    other = [s + 0.05 * torch.randn(s.shape, generator=g) for s in samples]  # another model's rows
    got = verify_proofs_many(other, many, prompt_lens)
    assert got == [verify_proofs(s, p, n) for s, p, n in zip(other, many, prompt_lens)]
    assert all(
        r.exp_mismatches == 0 and r.mant_err_mean == 0 for r in verify_proofs_many(samples, many, prompt_lens)[2]
    )
    assert any(r.mant_err_mean > 0 for rs in got for r in rs)

    bad = [list(p) for p in many]
    bad[2][1] = b"\x00\x00" + bad[2][1][2:]
    with pytest.raises(ProofFormatError, match=r"samples\[2\]: proof 1 has modulus 0"):
        verify_proofs_many(samples, bad, prompt_lens)
    with pytest.raises(ProofFormatError, match=r"samples\[1\]: got 2 proofs for 1 chunks"):
        verify_proofs_many(samples, [many[0], many[0][:2], *many[2:]], prompt_lens)
