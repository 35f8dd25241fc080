"""TOPLOC proofs: reference conformance, round trips, tamper detection, malformed input."""

from __future__ import annotations

import base64
import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from rlfleet.cli import main as cli_main
from rlfleet.proofs.conformance import run_conformance
from rlfleet.proofs.toploc import (
    PRIME,
    ChunkResult,
    ProofFormatError,
    Thresholds,
    build_proofs,
    chunk_rows,
    verify_proofs,
)
from tests.support import REPO

CONFORMANCE_DIR = REPO / "tests" / "data" / "toploc"


def _hidden(weights_seed: int, T: int = 70, H: int = 256, noise: float = 0.0) -> torch.Tensor:
    """(T, H) float32 final hidden states of a tiny random "model" on a fixed token sequence."""
    tokens = torch.randint(0, 100, (T,), generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(weights_seed)
    emb, w = torch.randn(100, 64, generator=g), torch.randn(64, H, generator=g) / 8
    h = torch.tanh(emb[tokens]) @ w
    if noise:  # another kernel's rounding: relative jitter around bf16's half-ulp (2**-9)
        h = h * (1 + noise * torch.randn(h.shape, generator=torch.Generator().manual_seed(99)))
    return h


def _cli(case_dir) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rlfleet.cli", "toploc", "conformance", str(case_dir)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


# ------------------------------------------------------------------------------ conformance


def test_reference_vectors_all_pass():
    reports = run_conformance(CONFORMANCE_DIR)
    assert reports, f"no case_*.json in {CONFORMANCE_DIR}"
    failed = {r.name: r.failures for r in reports if not r.passed}
    assert not failed, failed
    assert all(r.chunks > 0 and r.candidates > 0 for r in reports)


def test_cli_passes_on_reference_vectors():
    result = _cli(CONFORMANCE_DIR)
    assert result.returncode == 0, result.stdout + result.stderr
    n_cases = len(list(CONFORMANCE_DIR.glob("case_*.json")))
    assert result.stdout.count("PASS ") == n_cases


def test_cli_fails_on_a_corrupted_proof_and_on_an_empty_dir(tmp_path, capsys):
    # In-process through the same argv parsing and dispatch: the subprocess test above already
    # covers `python -m rlfleet.cli`, and each extra interpreter costs seconds of torch import.
    source = sorted(CONFORMANCE_DIR.glob("case_*.json"))[0]
    case = json.loads(source.read_text())
    proof = bytearray(base64.b64decode(case["proofs_base64"][0]))
    proof[5] ^= 0x01  # one bit of one coefficient
    case["proofs_base64"][0] = base64.b64encode(bytes(proof)).decode()
    (tmp_path / source.name).write_text(json.dumps(case))

    assert cli_main(["toploc", "conformance", str(tmp_path)]) != 0
    out = capsys.readouterr().out
    assert f"FAIL {source.stem}" in out
    assert "proof 0: bytes differ" in out
    assert "honest chunk 0" in out  # the flipped proof no longer verifies the honest activations

    empty = tmp_path / "empty"
    empty.mkdir()
    assert cli_main(["toploc", "conformance", str(empty)]) != 0


# ----------------------------------------------------------------------------- behaviour


def test_chunking():
    assert chunk_rows(70, prompt_len=6) == [(0, 6), (6, 38), (38, 70)]
    assert chunk_rows(65, prompt_len=0, skip_prefill=True) == [(0, 32), (32, 64), (64, 65)]
    assert chunk_rows(10, prompt_len=10, decode_batching_size=4) == [(0, 10)]
    with pytest.raises(ValueError, match="prompt_len"):
        chunk_rows(5, prompt_len=0)
    with pytest.raises(ValueError, match="decode_batching_size"):
        chunk_rows(5, prompt_len=1, decode_batching_size=0)


def test_proofs_are_258_bytes_and_round_trip():
    hidden = _hidden(0).to(torch.bfloat16)
    proofs = build_proofs(hidden, prompt_len=6)
    assert [len(p) for p in proofs] == [258, 258, 258]
    results = verify_proofs(hidden, proofs, prompt_len=6)
    assert results == [ChunkResult(0, 0.0, 0.0)] * 3
    assert all(Thresholds().accepts(r) for r in results)


def test_input_forms_agree():
    hidden = _hidden(0)
    proofs = build_proofs(hidden.to(torch.bfloat16), prompt_len=6)
    assert build_proofs(hidden, prompt_len=6) == proofs  # float32 is cast to bf16 first
    bits = hidden.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert build_proofs(bits, prompt_len=6) == proofs
    with pytest.raises(ValueError, match="uint16"):
        build_proofs(bits.astype(np.float32), prompt_len=6)


def test_another_model_is_rejected_and_rerounding_accepted():
    proofs = build_proofs(_hidden(0), prompt_len=6)

    other = verify_proofs(_hidden(1), proofs, prompt_len=6)
    assert not any(Thresholds().accepts(r) for r in other), other

    rerounded = _hidden(0, noise=1e-3).to(torch.bfloat16)
    assert not torch.equal(rerounded, _hidden(0).to(torch.bfloat16))
    near = verify_proofs(rerounded, proofs, prompt_len=6)
    assert all(Thresholds().accepts(r) for r in near), near
    assert any(r.mant_err_mean > 0 for r in near)  # the jitter did change bf16 values


def test_thresholds_bounds():
    t = Thresholds()
    assert (t.max_exp_mismatches, t.max_mant_err_mean, t.max_mant_err_median) == (38, 10.0, 8.0)
    assert t.accepts(ChunkResult(38, 10.0, 8.0))
    assert not t.accepts(ChunkResult(39, 0.0, 0.0))
    assert not t.accepts(ChunkResult(0, 10.5, 0.0))
    assert not t.accepts(ChunkResult(0, 0.0, 9.0))
    assert not t.accepts(ChunkResult(128, float(2**64), float(2**64)))


def test_malformed_proofs_raise_proof_format_error():
    hidden = _hidden(0)
    good = build_proofs(hidden, prompt_len=6)

    def check(bad_first: bytes | str, match: str):
        with pytest.raises(ProofFormatError, match=match):
            verify_proofs(hidden, [bad_first, *good[1:]], prompt_len=6)

    check(good[0][:-1], "257 bytes")
    check(b"", "0 bytes")
    check(good[0] + b"\x00\x00", "260 bytes")
    check(b"\x00\x00" + good[0][2:], "modulus 0")
    check(b"\xff\xda" + good[0][2:], "modulus 65498")
    check(good[0][:2] + b"\xff\xff" + good[0][4:], "coefficient")
    check(base64.b64encode(good[0]).decode(), "must be bytes")
    with pytest.raises(ProofFormatError, match="2 proofs for 3 chunks"):
        verify_proofs(hidden, good[:2], prompt_len=6)
    assert issubclass(ProofFormatError, ValueError)


def test_chunks_with_fewer_values_than_topk():
    # H = 64: a 1-row chunk has 64 values (k = 64), a 2-row one 128, a 3-row one 192.
    hidden = _hidden(0, T=36, H=64).to(torch.bfloat16)
    assert chunk_rows(36, prompt_len=1) == [(0, 1), (1, 33), (33, 36)]
    proofs = build_proofs(hidden, prompt_len=1)
    assert [len(p) for p in proofs] == [2 + 2 * 64, 258, 258]
    assert verify_proofs(hidden, proofs, prompt_len=1) == [ChunkResult(0, 0.0, 0.0)] * 3

    tail = build_proofs(hidden[:34], prompt_len=0, skip_prefill=True)  # rows 32..33: 128 values
    assert [len(p) for p in tail] == [258, 258]

    # A small chunk still detects tampering: scaling by 4 moves every exponent.
    tampered = hidden.clone()
    tampered[0] *= 4
    first = verify_proofs(tampered, proofs, prompt_len=1)[0]
    assert first.exp_mismatches == 64 and not Thresholds().accepts(first)

    with pytest.raises(ProofFormatError, match="k=64"):
        verify_proofs(hidden, [proofs[1], *proofs[1:]], prompt_len=1)


def test_modulus_avoids_index_collisions():
    # Top values at flat indices 0 and 65490..65497: every modulus in 65490..65497 maps two of
    # them together, so the largest injective one is 65489.
    indices = [0, *range(65490, 65498)]
    flat = torch.full((2 * 40_000,), 0.01)
    flat[indices] = torch.arange(1, 10, dtype=torch.float32)
    hidden = flat.reshape(2, 40_000)
    (proof,) = build_proofs(hidden, prompt_len=0, topk=9, skip_prefill=True)
    expected = next(m for m in range(PRIME, 0, -1) if len({i % m for i in indices}) == len(indices))
    assert expected == 65489
    assert int.from_bytes(proof[:2], "big") == expected
    assert verify_proofs(hidden, [proof], prompt_len=0, topk=9, skip_prefill=True) == [ChunkResult(0, 0.0, 0.0)]
