"""TOPLOC proofs: commit to the top-k of a chunk of bf16 hidden states, check them on replay.

Algorithm (Ong et al., "TOPLOC: A Locality Sensitive Hashing Scheme for Trustless Verifiable
Inference", arXiv:2501.16007; byte-compatible with the authors' `toploc` 0.1.6, files
`toploc/poly.py`, `toploc/C/csrc/{poly,ndd,utils}.cpp`):

1. Chunking (`chunk_rows`). The final hidden states `(T, H)` are cut into row ranges: the
   prompt's `prompt_len` rows form one chunk, then the decode rows go in chunks of
   `decode_batching_size`. With `skip_prefill` the activations hold no prompt rows and all T
   rows are chunked by `decode_batching_size` (`prompt_len` is then not used).
2. Proof (`build_proofs`). Flatten a chunk (cast to bfloat16) to `(rows*H,)`, take the k entries
   of largest |value| (`torch.topk`), with their flat indices `i` and raw bf16 bit patterns
   `v`. Pick the largest modulus `m <= 65497` under which the indices stay distinct
   (`m` divides no pairwise index difference), then interpolate the unique polynomial of degree
   `< k` over GF(p), p = 65497, through the points `(i mod m, v)` (ascending monomial
   coefficients; gf.py). Bytes: `m`, then the k coefficients, each a 2-byte big-endian integer:
   2 + 2k bytes, 258 at k = 128.
3. Check (`verify_proofs`). Recompute the chunk's own top-k `(i', v')`, evaluate the claimed
   polynomial at `i' mod m` and read the results as bf16 bits. Per chunk report the number of
   positions whose 8 exponent bits differ, and the mean and median of |mantissa difference|
   (7 bits) over positions whose exponents agree; both are 2**64 when none agree. The sign
   bit is compared by neither, as in the reference.

Invariants: a proof depends only on the *set* of top-k (index, value) pairs (interpolation is
unique, the modulus depends on the index set), so the order `topk` returns them in does not
matter; an honest proof has 1 <= m <= 65497 and every coefficient < 65497.

A reference quirk we keep: its two verifiers disagree on the median of an even count. The C++
one (taken for one (T, H) tensor with `skip_prefill=True`) reports the upper middle element; the
Python one (all other calls) `statistics.median`, the mean of the two middle ones. The conformance
vectors hold both, so `verify_proofs` makes the same split (`_medians`).
Where we differ on purpose: a chunk with fewer than `topk` values makes the reference's `topk`
raise; its `build_proofs` swallows that and returns all-zero "null" proofs for every chunk, and
its verifier crashes. Here such a chunk uses k = its number of values, so its proof is
2 + 2*numel bytes and the verifier expects exactly that length. Proofs of another length, with a
modulus outside [1, p] or a coefficient >= p raise `ProofFormatError` (the reference reads
whatever bytes it gets).

Thresholds: the authors' validation script, toploc-experiments `vllm_validate_poly.py`
(github.com/PrimeIntellect-ai/toploc-experiments, also quoted in its README), accepts a top-128
chunk when at least 90 exponents agree (`TEXP = 90`, i.e. at most 128 - 90 = 38 mismatches), the
mantissa error mean is <= 10 (`TMEAN`) and the median <= 8 (`TMEDIAN`). `toploc` 0.1.6 itself
ships no thresholds.

Cost: `build_proofs_many` / `verify_proofs_many` take every chunk of several samples (a group) at
once: one `topk` per chunk size (on the activations' device: a GPU verifier ranks there), one host
copy of the top-k, and the field arithmetic of gf.py, which runs a fixed number of batched numpy
operations per call whatever the number of chunks. A worker builds a group's proofs in one call and
the gate checks a group's in one.

We implement this ourselves rather than depend on `toploc`: its wheels are C++ extensions
compiled against one torch build, and the numpy version below is short (docs/code.md, "Write it ourselves
when the dependency costs more").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch

from rlfleet.proofs.gf import PRIME, evaluate, injective_modulus, interpolate

NO_MATCH = float(2**64)  # mantissa statistics when no exponent matched


class ProofFormatError(ValueError):
    """A proof's bytes (or the number of proofs) do not fit the activations they are checked on."""


@dataclass(frozen=True)
class ChunkResult:
    exp_mismatches: int
    mant_err_mean: float
    mant_err_median: float


@dataclass(frozen=True)
class Thresholds:
    """Largest per-chunk errors still accepted: the authors' values (module docstring).

    `max_exp_mismatches` is an absolute count tuned for k = 128 (38 = 128 - 90); a chunk with
    fewer top values is judged on the same count, so pass a stricter one if that matters.
    """

    max_exp_mismatches: int = 38
    max_mant_err_mean: float = 10.0
    max_mant_err_median: float = 8.0

    def accepts(self, r: ChunkResult) -> bool:
        return (
            r.exp_mismatches <= self.max_exp_mismatches
            and r.mant_err_mean <= self.max_mant_err_mean
            and r.mant_err_median <= self.max_mant_err_median
        )


# ---------------------------------------------------------------------------------- chunking


def chunk_rows(
    n_rows: int, prompt_len: int, decode_batching_size: int = 32, skip_prefill: bool = False
) -> list[tuple[int, int]]:
    """Row ranges `[start, end)` of the proof chunks of `n_rows` positions."""
    if decode_batching_size < 1:
        raise ValueError(f"decode_batching_size must be >= 1, got {decode_batching_size}")
    if n_rows < 0:
        raise ValueError(f"n_rows must be >= 0, got {n_rows}")
    if skip_prefill:
        first = 0
        ranges = []
    else:
        if not 1 <= prompt_len <= n_rows:
            raise ValueError(
                f"prompt_len must be between 1 and the {n_rows} activation rows when skip_prefill "
                f"is false, got {prompt_len}; pass skip_prefill=True if the rows hold no prompt"
            )
        first = prompt_len
        ranges = [(0, prompt_len)]
    ranges += [(s, min(s + decode_batching_size, n_rows)) for s in range(first, n_rows, decode_batching_size)]
    return ranges


def _as_bf16(activations) -> torch.Tensor:
    """`(T, H)` bfloat16 tensor from a float tensor or a numpy uint16 array of bf16 bits."""
    if isinstance(activations, np.ndarray):
        if activations.dtype != np.uint16:
            raise ValueError(
                f"numpy activations must be uint16 bf16 bit patterns, got dtype {activations.dtype}; "
                "pass a torch tensor for float data"
            )
        bits = np.ascontiguousarray(activations)
        if not bits.flags.writeable:  # torch.from_numpy wants a writable buffer
            bits = bits.copy()
        t = torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16)
    elif isinstance(activations, torch.Tensor):
        if not activations.is_floating_point():
            raise ValueError(f"activations tensor must be floating point, got {activations.dtype}")
        t = activations.detach().to(torch.bfloat16)
    else:
        raise ValueError(f"activations must be a torch.Tensor or numpy uint16 array, got {type(activations).__name__}")
    if t.dim() != 2 or t.shape[1] < 1:
        raise ValueError(f"activations must have shape (T, H) with H >= 1, got {tuple(t.shape)}")
    return t


@dataclass
class _Tops:
    """The top-k of several chunks with the same k, as one batch."""

    members: list[int]  # (C,) chunk numbers, in the caller's order of chunks
    idx: np.ndarray  # (C, k) int64 flat indices into each chunk's rows*H values
    bits: np.ndarray  # (C, k) int64 raw bf16 bit patterns of those values


def _chunk_topk(chunks: list[torch.Tensor], topk: int) -> list[_Tops]:
    """Top-k by |value| of every chunk `(rows, H)` bf16, batched: chunks with the same number of values
    are stacked `(C, rows*H)` and ranked by one `topk(dim=1)`, which runs the same per-row kernel as a
    1-D `topk` (so ties resolve as the reference's); one host copy per batch. Batches of equal k merge."""
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    by_numel: dict[int, list[int]] = {}
    for n, chunk in enumerate(chunks):
        by_numel.setdefault(chunk.numel(), []).append(n)
    by_k: dict[int, list[tuple[list[int], torch.Tensor, torch.Tensor]]] = {}
    for numel, members in by_numel.items():
        flat = torch.stack([chunks[n].reshape(-1) for n in members])  # (C, rows*H) bf16
        idx = flat.abs().topk(min(topk, numel), dim=1).indices  # (C, k)
        bits = flat.gather(1, idx).view(torch.int16)  # (C, k)
        by_k.setdefault(idx.shape[1], []).append((members, idx, bits))
    out = []
    for parts in by_k.values():
        all_idx = torch.cat([i for _, i, _ in parts]).cpu().numpy().astype(np.int64)
        all_bits = torch.cat([b for _, _, b in parts]).cpu().numpy().astype(np.int64) & 0xFFFF
        out.append(_Tops([n for m, _, _ in parts for n in m], all_idx, all_bits))
    return out


# -------------------------------------------------------------------------------- proofs


def _split_chunks(activations: list, prompt_len, decode_batching_size: int, skip_prefill: bool):
    """Every sample's chunk views (rows, H) bf16 in one list, and sample i's span [a, b) of it."""
    lens = list(prompt_len) if isinstance(prompt_len, (list, tuple)) else [prompt_len] * len(activations)
    if len(lens) != len(activations):
        raise ValueError(f"{len(lens)} prompt lengths for {len(activations)} samples")
    chunks: list[torch.Tensor] = []
    spans: list[tuple[int, int]] = []
    for acts, plen in zip(activations, lens):
        acts = _as_bf16(acts)
        ranges = chunk_rows(acts.shape[0], plen, decode_batching_size, skip_prefill)
        spans.append((len(chunks), len(chunks) + len(ranges)))
        chunks += [acts[a:b] for a, b in ranges]
    return chunks, spans


def build_proofs_many(
    activations: list, prompt_len, decode_batching_size: int = 32, topk: int = 128, skip_prefill: bool = False
) -> list[list[bytes]]:
    """`build_proofs` of several samples (`prompt_len`: one for all, or one per sample), with one batched
    top-k per chunk size and one interpolation per k over all their chunks: the numpy work per call
    is a fixed number of k-step loops, so a whole group costs about what one sample did."""
    chunks, spans = _split_chunks(activations, prompt_len, decode_batching_size, skip_prefill)
    proofs: list[bytes] = [b""] * len(chunks)
    for tops in _chunk_topk(chunks, topk):
        moduli = np.full(len(tops.members), PRIME, dtype=np.int64)  # distinct indices below p stay distinct
        for row in np.flatnonzero(tops.idx.max(axis=1) >= PRIME):
            moduli[row] = injective_modulus(tops.idx[row])
        coeffs = interpolate(tops.idx % moduli[:, None], tops.bits)  # (C, k)
        words = np.concatenate([moduli[:, None], coeffs], axis=1).astype(">u2")  # (C, 1 + k) big-endian
        for row, n in enumerate(tops.members):
            proofs[n] = words[row].tobytes()
    return [proofs[a:b] for a, b in spans]


def build_proofs(
    activations, prompt_len: int, decode_batching_size: int = 32, topk: int = 128, skip_prefill: bool = False
) -> list[bytes]:
    """One proof per chunk of `chunk_rows` for activations (T, H) (see the module docstring)."""
    return build_proofs_many([activations], prompt_len, decode_batching_size, topk, skip_prefill)[0]


def _decode(proofs: list, tops: _Tops, names: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Moduli (C,) and coefficients (C, k) int64 of the proofs of one batch, or ProofFormatError naming
    the first bad one in chunk order (`names`: how to call each chunk)."""
    k = tops.idx.shape[1]
    words = np.frombuffer(b"".join(bytes(proofs[n]) for n in tops.members), dtype=">u2").astype(np.int64)
    words = words.reshape(len(tops.members), k + 1)
    bad_modulus = (words[:, 0] < 1) | (words[:, 0] > PRIME)
    bad_coeff = (words[:, 1:] >= PRIME).any(axis=1)
    bad = np.flatnonzero(bad_modulus | bad_coeff)
    if bad.size:
        row = min(bad, key=lambda r: tops.members[r])
        name = names[tops.members[row]]
        if bad_modulus[row]:
            raise ProofFormatError(f"{name} has modulus {words[row, 0]}; a valid one lies in [1, {PRIME}]")
        raise ProofFormatError(f"{name} has a coefficient >= {PRIME}, outside the field")
    return words[:, 0], words[:, 1:]


def _medians(errs: np.ndarray, ok: np.ndarray, counts: np.ndarray, upper: bool) -> np.ndarray:
    """Per row, the median of `errs` where `ok` ((C, k), `counts` (C,) such entries, >= 1): the upper middle
    element of an even count when `upper`, else the mean of the two middle ones."""
    s = np.sort(np.where(ok, errs, np.iinfo(np.int64).max), axis=1)  # the counted entries first
    rows = np.arange(len(s))
    hi = s[rows, counts // 2].astype(np.float64)
    if upper:
        return hi
    lo = s[rows, np.maximum(counts // 2 - 1, 0)].astype(np.float64)
    return np.where(counts % 2 == 1, hi, (lo + hi) / 2)


def verify_proofs_many(
    activations: list,
    proofs: list[list[bytes]],
    prompt_len,
    decode_batching_size: int = 32,
    topk: int = 128,
    skip_prefill: bool = False,
) -> list[list[ChunkResult]]:
    """`verify_proofs` of several samples at once (`prompt_len`: one for all, or one per sample): one batched
    top-k per chunk size and one evaluation per k over all their chunks."""
    chunks, spans = _split_chunks(activations, prompt_len, decode_batching_size, skip_prefill)
    many = len(spans) > 1
    names: list[str] = []
    flat: list = []
    for i, ((a, b), sample_proofs) in enumerate(zip(spans, proofs, strict=True)):
        where = f"samples[{i}]: " if many else ""
        if len(sample_proofs) != b - a:
            rows = sum(len(c) for c in chunks[a:b])
            raise ProofFormatError(f"{where}got {len(sample_proofs)} proofs for {b - a} chunks of {rows} rows")
        names += [f"{where}proof {c}" for c in range(b - a)]
        flat += sample_proofs
    batches = _chunk_topk(chunks, topk)
    k_of = {n: t.idx.shape[1] for t in batches for n in t.members}
    for n, proof in enumerate(flat):  # types and lengths first, in chunk order
        if not isinstance(proof, (bytes, bytearray, memoryview)):
            raise ProofFormatError(f"{names[n]} must be bytes, got {type(proof).__name__}")
        if len(proof) != 2 + 2 * k_of[n]:
            raise ProofFormatError(
                f"{names[n]} is {len(proof)} bytes; its chunk has k={k_of[n]} top values, so it must be "
                f"{2 + 2 * k_of[n]}"
            )
    decoded = [_decode(flat, t, names) for t in batches]
    results: list[ChunkResult | None] = [None] * len(chunks)
    for tops, (moduli, coeffs) in zip(batches, decoded):
        claimed = evaluate(coeffs, tops.idx % moduli[:, None])  # (C, k) bf16 bit patterns
        exp_ok = (claimed >> 7 & 0xFF) == (tops.bits >> 7 & 0xFF)  # (C, k)
        mant_err = np.abs((claimed & 0x7F) - (tops.bits & 0x7F))  # (C, k)
        counts = exp_ok.sum(axis=1)  # (C,)
        some = np.maximum(counts, 1)
        means = np.where(exp_ok, mant_err, 0).sum(axis=1) / some  # an int sum over its count: np.mean's value
        medians = _medians(mant_err, exp_ok, some, upper=skip_prefill)
        for row, n in enumerate(tops.members):
            if counts[row] == 0:
                results[n] = ChunkResult(int(exp_ok.shape[1]), NO_MATCH, NO_MATCH)
            else:
                results[n] = ChunkResult(int(exp_ok.shape[1] - counts[row]), float(means[row]), float(medians[row]))
    # Every chunk is in exactly one batch, so no entry is None any more.
    return [cast(list[ChunkResult], results[a:b]) for a, b in spans]


def verify_proofs(
    activations,
    proofs: list[bytes],
    prompt_len: int,
    decode_batching_size: int = 32,
    topk: int = 128,
    skip_prefill: bool = False,
) -> list[ChunkResult]:
    """Per chunk, how far the top-k claimed by `proofs` is from these activations' own top-k.

    Judge each result with `Thresholds.accepts`. Raises ProofFormatError when the number of
    proofs differs from the number of chunks or a proof is not a well-formed 2 + 2k byte proof.
    """
    return verify_proofs_many([activations], [proofs], prompt_len, decode_batching_size, topk, skip_prefill)[0]
