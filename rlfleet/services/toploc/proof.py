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
   `< k` over GF(p), p = 65497, through the points `(i mod m, v)` (Newton divided differences,
   expanded to ascending monomial coefficients). Bytes: `m`, then the k coefficients, each a
   2-byte big-endian integer: 2 + 2k bytes, 258 at k = 128.
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
vectors hold both, so `verify_proofs` makes the same split (`_median`).
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

We implement this ourselves rather than depend on `toploc`: its wheels are C++ extensions
compiled against one torch build, and the numpy version below is short (STYLE.md 12).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

PRIME = 65497  # the field GF(p) the polynomial lives in; also the largest modulus tried
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


def _chunk_topk(acts: torch.Tensor, ranges: list[tuple[int, int]], topk: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per chunk: flat indices (k,) int64 and bf16 bit patterns (k,) int64 of the k largest |values|."""
    if topk < 1:
        raise ValueError(f"topk must be >= 1, got {topk}")
    out = []
    for start, end in ranges:
        flat = acts[start:end].reshape(-1)  # (rows*H,) bf16, still on the tensor's device
        idx = flat.abs().topk(min(topk, flat.numel())).indices  # the reference's ranking, ties too
        values = flat[idx].view(torch.int16).cpu().numpy().astype(np.int64) & 0xFFFF
        out.append((idx.cpu().numpy().astype(np.int64), values))
    return out


# ----------------------------------------------------------------------------- GF(p) helpers


@functools.cache
def _inverses() -> np.ndarray:
    """(p,) table of multiplicative inverses mod p (a**(p-2)); entry 0 is unused."""
    base = np.arange(PRIME, dtype=np.int64)
    result = np.ones(PRIME, dtype=np.int64)
    e = PRIME - 2
    while e:
        if e & 1:
            result = result * base % PRIME
        base = base * base % PRIME
        e >>= 1
    return result


def _injective_modulus(idx: np.ndarray) -> int:
    """Largest m <= p with `idx % m` pairwise distinct (m divides no index difference)."""
    if idx.max() < PRIME:  # distinct values below p stay distinct mod p
        return PRIME
    for m in range(PRIME, PRIME - 8, -1):  # the usual case: one of the first few works
        if np.unique(idx % m).size == idx.size:
            return m
    diffs = np.unique(np.abs(idx[:, None] - idx[None, :])[np.triu_indices(len(idx), 1)])
    diffs = diffs[diffs >= 2]  # no m >= 2 divides a difference of 1
    block, top = 16, PRIME - 8
    while top >= 2:
        ms = np.arange(top, max(top - block, 1), -1, dtype=np.int64)  # (B,) candidates, descending
        ok = ~(diffs[None, :] % ms[:, None] == 0).any(axis=1)
        if ok.any():
            return int(ms[np.argmax(ok)])
        top -= block
        block = min(block * 4, 4096)
    raise ValueError(f"no modulus <= {PRIME} keeps these {len(idx)} top-k indices distinct")


def _interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Ascending coefficients (C, k) of the degree < k polynomials through rows (x, y) (C, k) over GF(p).

    Newton divided differences column by column, then Horner-style expansion of the Newton form
    c0 + (X - x0)(c1 + (X - x1)(c2 + ...)) into monomials; all C chunks at once.
    """
    inv = _inverses()  # indexing it with -d (0 < d < p) wraps to inv[p - d], the inverse of -d
    n_chunks, k = x.shape
    dd = y % PRIME  # (C, k); column j becomes the j-th divided difference
    for j in range(1, k):  # |x_a - x_b| < p, and numpy's % is non-negative
        dd[:, j:] = (dd[:, j:] - dd[:, j - 1 : -1]) * inv[x[:, j:] - x[:, :-j]] % PRIME
    coeffs = np.zeros((n_chunks, k), dtype=np.int64)
    coeffs[:, 0] = dd[:, k - 1]
    for i in range(k - 2, -1, -1):  # multiply the degree (k-2-i) polynomial by (X - x_i), add dd_i
        deg = k - 2 - i
        scaled = x[:, i : i + 1] * coeffs[:, : deg + 1]
        coeffs[:, 1 : deg + 2] = coeffs[:, : deg + 1]  # numpy copes with the overlap
        coeffs[:, 0] = dd[:, i]
        coeffs[:, : deg + 1] -= scaled
        coeffs[:, : deg + 2] %= PRIME
    return coeffs


def _evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Horner evaluation of ascending coefficients (C, k) at points (C, n) over GF(p)."""
    acc = np.repeat(coeffs[:, -1:], x.shape[1], axis=1)  # (C, n)
    for j in range(coeffs.shape[1] - 2, -1, -1):
        acc *= x
        acc += coeffs[:, j : j + 1]
        acc %= PRIME
    return acc


# -------------------------------------------------------------------------------- proofs


def _encode(modulus: int, coeffs: np.ndarray) -> bytes:
    return np.concatenate([[modulus], coeffs]).astype(">u2").tobytes()


def _decode(proof: bytes, k: int, chunk_no: int) -> tuple[int, np.ndarray]:
    """(modulus, coefficients (k,) int64) of one proof, or ProofFormatError."""
    if not isinstance(proof, (bytes, bytearray, memoryview)):
        raise ProofFormatError(f"proof {chunk_no} must be bytes, got {type(proof).__name__}")
    if len(proof) != 2 + 2 * k:
        raise ProofFormatError(
            f"proof {chunk_no} is {len(proof)} bytes; its chunk has k={k} top values, so it must be {2 + 2 * k}"
        )
    words = np.frombuffer(bytes(proof), dtype=">u2").astype(np.int64)
    modulus, coeffs = int(words[0]), words[1:]
    if not 1 <= modulus <= PRIME:
        raise ProofFormatError(f"proof {chunk_no} has modulus {modulus}; a valid one lies in [1, {PRIME}]")
    if (coeffs >= PRIME).any():
        raise ProofFormatError(f"proof {chunk_no} has a coefficient >= {PRIME}, outside the field")
    return modulus, coeffs


def _groups_by_k(tops: list[tuple[np.ndarray, np.ndarray]]) -> dict[int, list[int]]:
    """Chunk numbers grouped by their k, so each group is processed as one (C, k) batch."""
    groups: dict[int, list[int]] = {}
    for n, (idx, _) in enumerate(tops):
        groups.setdefault(len(idx), []).append(n)
    return groups


def build_proofs(
    activations, prompt_len: int, decode_batching_size: int = 32, topk: int = 128, skip_prefill: bool = False
) -> list[bytes]:
    """One proof per chunk of `chunk_rows` for activations (T, H) (see the module docstring)."""
    acts = _as_bf16(activations)
    tops = _chunk_topk(acts, chunk_rows(acts.shape[0], prompt_len, decode_batching_size, skip_prefill), topk)
    proofs: list[bytes] = [b""] * len(tops)
    for members in _groups_by_k(tops).values():
        moduli = [_injective_modulus(tops[n][0]) for n in members]
        x = np.stack([tops[n][0] % m for n, m in zip(members, moduli)])  # (C, k)
        y = np.stack([tops[n][1] for n in members])  # (C, k)
        for n, m, c in zip(members, moduli, _interpolate(x, y)):
            proofs[n] = _encode(m, c)
    return proofs


def _median(errs: np.ndarray, upper: bool) -> float:
    s = np.sort(errs)
    mid = len(s) // 2
    return float(s[mid]) if upper or len(s) % 2 else (float(s[mid - 1]) + float(s[mid])) / 2


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
    acts = _as_bf16(activations)
    ranges = chunk_rows(acts.shape[0], prompt_len, decode_batching_size, skip_prefill)
    if len(proofs) != len(ranges):
        raise ProofFormatError(f"got {len(proofs)} proofs for {len(ranges)} chunks of {acts.shape[0]} rows")
    tops = _chunk_topk(acts, ranges, topk)
    decoded = [_decode(p, len(idx), n) for n, (p, (idx, _)) in enumerate(zip(proofs, tops))]
    results: dict[int, ChunkResult] = {}
    for members in _groups_by_k(tops).values():
        coeffs = np.stack([decoded[n][1] for n in members])  # (C, k)
        x = np.stack([tops[n][0] % decoded[n][0] for n in members])  # (C, k)
        claimed = _evaluate(coeffs, x)  # (C, k) bf16 bit patterns
        actual = np.stack([tops[n][1] for n in members])
        exp_ok = (claimed >> 7 & 0xFF) == (actual >> 7 & 0xFF)
        mant_err = np.abs((claimed & 0x7F) - (actual & 0x7F))
        for row, n in enumerate(members):
            errs = mant_err[row][exp_ok[row]]
            mismatches = int((~exp_ok[row]).sum())
            if errs.size == 0:
                results[n] = ChunkResult(mismatches, NO_MATCH, NO_MATCH)
            else:
                results[n] = ChunkResult(mismatches, float(errs.mean()), _median(errs, upper=skip_prefill))
    return [results[n] for n in range(len(tops))]
