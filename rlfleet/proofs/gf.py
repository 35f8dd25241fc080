"""Arithmetic over GF(p), p = 65497, for TOPLOC proofs (proof.py): interpolation and evaluation of
many polynomials at once, in a fixed number of batched numpy operations rather than loops over
their k points (a loop's per-step cost, not its arithmetic, was most of a proof's time).

Exactness: every value is reduced below p < 2**16, so a product is < 2**32 and a sum of up to
2**21 products stays below 2**53; such sums are taken exactly in float64 (BLAS) and reduced after.

Evaluation (`evaluate`) of degree < k polynomials at n points: baby-step giant-step. With
B = ceil(sqrt(k)) and A = ceil(k / B), x**(a*B + b) = (x**B)**a * x**b, so
    sum_j c_j x**j = sum_a (x**B)**a * (sum_b c_{a*B+b} x**b):
one (n, B) x (B, A) product and an A-term sum, from power tables with B and A columns.

Interpolation (`interpolate`), the unique polynomial of degree < k through (x_j, y_j), x distinct:
Lagrange in closed form. With P(X) = prod_m (X - x_m) = sum_t a_t X**t and u_j = y_j / P'(x_j),
    L(X) = sum_j u_j P(X) / (X - x_j),  and synthetic division by (X - x_j) gives
    c_i = sum_{s=0}^{k-1-i} a_{i+1+s} S_s,  where S_s = sum_j u_j x_j**s.
So: P's coefficients by a product tree (log2 k levels of pairwise products, each a batched
convolution), P' at every x_j (`evaluate`), the power sums S (baby-step giant-step, transposed)
and one Hankel product. Above `FAST_MAX_K` points the (k, k) intermediates grow large and Newton's
divided differences (k sequential steps) are used instead; both give the same, unique, polynomial.
"""

from __future__ import annotations

import functools
import math

import numpy as np

PRIME = 65497  # the field GF(p) the polynomials live in; also the largest modulus tried
FAST_MAX_K = 256  # largest k interpolated in closed form; Newton's loop above it


@functools.cache
def inverses() -> np.ndarray:
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


def injective_modulus(idx: np.ndarray) -> int:
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


def _exact(a: np.ndarray) -> np.ndarray:
    """float64 holding exact non-negative integers -> int64 reduced mod p."""
    return a.astype(np.int64) % PRIME


def _power_table(x: np.ndarray, m: int) -> np.ndarray:
    """(..., m) table x**0 .. x**(m-1) mod p of points x (...) < p."""
    table = np.empty((*x.shape, m), dtype=np.int64)
    table[..., 0] = 1
    for j in range(1, m):
        table[..., j] = table[..., j - 1] * x % PRIME
    return table


def _baby_giant(x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Power tables (C, n, B) of x**b and (C, n, A) of (x**B)**a, B = ceil(sqrt(k)), A = ceil(k / B)."""
    b = math.isqrt(k - 1) + 1 if k > 1 else 1
    baby = _power_table(x, b)
    return baby, _power_table(baby[..., -1] * x % PRIME, -(-k // b))


def evaluate(coeffs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Values (C, n) of the polynomials with ascending coefficients (C, k) at points (C, n) < p."""
    n_poly, k = coeffs.shape
    baby, giant = _baby_giant(x, k)  # (C, n, B), (C, n, A)
    b, a = baby.shape[-1], giant.shape[-1]
    padded = np.zeros((n_poly, a * b), dtype=np.float64)
    padded[:, :k] = coeffs
    inner = _exact(np.matmul(baby.astype(np.float64), padded.reshape(n_poly, a, b).transpose(0, 2, 1)))  # (C, n, A)
    return (inner * giant).sum(axis=-1) % PRIME


def _power_sums(u: np.ndarray, x: np.ndarray, k: int) -> np.ndarray:
    """(C, k) S_s = sum_j u_j x_j**s mod p for weights u and points x (C, n): `evaluate` transposed."""
    baby, giant = _baby_giant(x, k)  # (C, n, B), (C, n, A)
    left = (giant * u[..., None] % PRIME).transpose(0, 2, 1).astype(np.float64)  # (C, A, n)
    sums = _exact(np.matmul(left, baby.astype(np.float64)))  # (C, A, B): S_{a*B+b}
    return sums.reshape(len(u), -1)[:, :k]


def _poly_mul(f: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Products (C, n, 2m-1) of the polynomials f, g (C, n, m), ascending coefficients mod p.

    The outer product's anti-diagonals are summed by a skew: rows of length 2m (m values, m
    zeros) read back with length 2m - 1 put row i's entries i places to the right."""
    c, n, m = f.shape
    skew = np.zeros((c, n, m, 2 * m), dtype=np.int64)
    skew[..., :m] = f[..., :, None] * g[..., None, :]  # (C, n, m, m), each < p**2
    rows = skew.reshape(c, n, 2 * m * m)[..., : m * (2 * m - 1)].reshape(c, n, m, 2 * m - 1)
    return rows.sum(axis=2) % PRIME


def _from_roots(x: np.ndarray) -> np.ndarray:
    """(C, k+1) ascending coefficients of prod_m (X - x_m) for roots x (C, k): a product tree."""
    n_poly, k = x.shape
    width = 1 << (k - 1).bit_length()  # leaves padded to a power of two with the constant 1
    polys = np.zeros((n_poly, width, 2), dtype=np.int64)
    polys[..., 0] = 1
    polys[:, :k, 0] = -x % PRIME
    polys[:, :k, 1] = 1
    while polys.shape[1] > 1:  # level l: (C, width / 2**l, 2**l + 1)
        polys = _poly_mul(polys[:, 0::2], polys[:, 1::2])
    return polys[:, 0, : k + 1]


def interpolate(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Ascending coefficients (C, k) of the degree < k polynomials through rows (x, y) (C, k) over GF(p);
    x < p distinct within a row, y any non-negative integers (taken mod p)."""
    n_poly, k = x.shape
    if k > FAST_MAX_K:
        return interpolate_newton(x, y)
    a = _from_roots(x)  # (C, k+1), a_k = 1
    slope = evaluate(np.arange(1, k + 1) * a[:, 1:] % PRIME, x)  # (C, k) P'(x_j), non-zero: x distinct
    u = y % PRIME * inverses()[slope] % PRIME  # (C, k)
    sums = _power_sums(u, x, k).astype(np.float64)  # (C, k)
    shifted = np.zeros((n_poly, 2 * k - 1), dtype=np.float64)
    shifted[:, :k] = a[:, 1:]
    hankel = np.lib.stride_tricks.sliding_window_view(shifted, k, axis=1)  # (C, k, k) [i, s] = a_{i+1+s}
    return _exact(np.matmul(hankel, sums[:, :, None])[..., 0])


def interpolate_newton(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """`interpolate` by Newton divided differences, column by column, then a Horner-style expansion of
    the Newton form c0 + (X - x0)(c1 + (X - x1)(c2 + ...)) into monomials: 2k steps of (C, k) work."""
    inv = inverses()  # indexing it with -d (0 < d < p) wraps to inv[p - d], the inverse of -d
    n_poly, k = x.shape
    dd = y % PRIME  # (C, k); column j becomes the j-th divided difference
    for j in range(1, k):  # |x_a - x_b| < p, and numpy's % is non-negative
        dd[:, j:] = (dd[:, j:] - dd[:, j - 1 : -1]) * inv[x[:, j:] - x[:, :-j]] % PRIME
    coeffs = np.zeros((n_poly, k), dtype=np.int64)
    coeffs[:, 0] = dd[:, k - 1]
    for i in range(k - 2, -1, -1):  # multiply the degree (k-2-i) polynomial by (X - x_i), add dd_i
        deg = k - 2 - i
        scaled = x[:, i : i + 1] * coeffs[:, : deg + 1]
        coeffs[:, 1 : deg + 2] = coeffs[:, : deg + 1]  # numpy copes with the overlap
        coeffs[:, 0] = dd[:, i]
        coeffs[:, : deg + 1] -= scaled
        coeffs[:, : deg + 2] %= PRIME
    return coeffs
