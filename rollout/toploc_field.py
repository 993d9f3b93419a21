"""GF(65497) polynomial arithmetic for TOPLOC proofs (interpolation, evaluation, modulus search).

Theory of operation
-------------------
A TOPLOC proof commits to ``k`` points ``(X_j, Y_j)`` with distinct ``X_j`` by storing the
unique polynomial ``P`` of degree ``< k`` over the prime field GF(p), ``p = 65497``, that passes
through them (TOPLOC.md §4 steps 3–4). This module holds the three numeric kernels:

* :func:`interpolate` — Newton divided differences, expanded to monomial form. Every step is a
  whole-vector numpy operation on ``int64``; all values stay in ``[0, p)`` and every product of
  two field elements is below ``(p-1)**2 < 2**33``, so ``int64`` never overflows. Division uses a
  table of all ``p - 1`` inverses, built once (vectorized Fermat: ``a**(p-2) mod p``).
* :func:`evaluate` — Horner's rule, vectorized over the evaluation points (TOPLOC.md §6 step 2,
  §11: ``(p-1)·(p-1) + (p-1) < 2**33``).
* :func:`find_injective_modulus` — the largest ``m <= p`` under which the committed indices are
  pairwise distinct (TOPLOC.md §4 step 2). Residues ``i mod m`` collide exactly when ``m``
  divides a pairwise difference, so candidate moduli are tested in blocks against the pairwise
  differences instead of one ``unique`` call per candidate.

Any correct interpolation method yields the same coefficients (the polynomial is unique), which
is what makes the proof bytes reproducible across implementations (TOPLOC.md §4 step 4).

Everything here is pure, allocation-bounded by ``k`` (and ``k**2/2`` for the modulus search), and
safe to call concurrently from several threads.
"""

from __future__ import annotations

import functools

import numpy as np
from numpy.typing import NDArray

from p2p.errors import LocalProtocolError

__all__ = ["FIELD_PRIME", "evaluate", "find_injective_modulus", "interpolate"]

#: The prime ``p`` of the field GF(p) used for every proof (TOPLOC.md §1), 0xFFD9.
FIELD_PRIME = 65497

_MODULUS_BLOCK = 64  # candidate moduli tested per vectorized step of the search

Int64Array = NDArray[np.int64]


@functools.cache
def _inverse_table() -> Int64Array:
    """Return ``inv`` with ``inv[a] = a**-1 mod p`` for ``a`` in ``1..p-1`` (``inv[0] = 0``).

    Computed once by square-and-multiply on the whole vector (Fermat's little theorem), ~1 ms.
    The returned array is read-only.
    """
    p = FIELD_PRIME
    base = np.arange(p, dtype=np.int64)
    result = np.ones(p, dtype=np.int64)
    exponent = p - 2
    while exponent:
        if exponent & 1:
            result = (result * base) % p
        base = (base * base) % p
        exponent >>= 1
    result[0] = 0
    result.setflags(write=False)
    return result


def _as_field_vector(values: NDArray[np.integer], name: str) -> Int64Array:
    arr = np.asarray(values)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise LocalProtocolError(f"{name} must be a 1-D integer array, got {arr.dtype}{arr.shape}")
    out = arr.astype(np.int64)
    if out.size and (int(out.min()) < 0 or int(out.max()) >= FIELD_PRIME):
        raise LocalProtocolError(f"{name} must lie in [0, {FIELD_PRIME})")
    return out


def interpolate(xs: NDArray[np.integer], ys: NDArray[np.integer]) -> Int64Array:
    """Coefficients of the unique polynomial of degree ``< k`` through ``k`` points, over GF(p).

    Args:
        xs: shape ``[k]``, integer dtype, pairwise distinct field elements in ``[0, p)``.
        ys: shape ``[k]``, integer dtype, field elements in ``[0, p)``.

    Returns:
        shape ``[k]``, ``int64``: ``c_0 … c_{k-1}`` in ascending order of degree (``c_0`` is the
        constant term), each in ``[0, p)``. Leading coefficients may be 0.

    Raises:
        LocalProtocolError: shapes differ, an input is out of range, or two ``xs`` are equal.
    """
    x = _as_field_vector(xs, "xs")
    y = _as_field_vector(ys, "ys")
    k = x.size
    if y.size != k or k == 0:
        raise LocalProtocolError(f"need the same positive number of xs and ys, got {k}, {y.size}")
    if np.unique(x).size != k:
        raise LocalProtocolError("interpolation points must have distinct xs")
    p = FIELD_PRIME
    inv = _inverse_table()
    # Newton divided differences in place: after level j, dd[i] = f[x_{i-j} .. x_i] for i >= j.
    dd = y.copy()
    for j in range(1, k):
        num = (dd[j:] - dd[j - 1 : -1]) % p
        dd[j:] = (num * inv[(x[j:] - x[: k - j]) % p]) % p
    # Expand P(X) = dd_0 + (X - x_0)(dd_1 + (X - x_1)(dd_2 + ...)) from the innermost term.
    coeffs = np.zeros(k, dtype=np.int64)
    coeffs[0] = dd[k - 1]
    for i in range(k - 2, -1, -1):
        # coeffs·(X - x_i) + dd_i; the degree is < k - 1 here, so nothing shifts out at the top.
        step = coeffs * ((p - x[i]) % p)
        step[1:] += coeffs[:-1]
        step[0] += dd[i]
        coeffs = step % p
    return coeffs


def evaluate(coeffs: NDArray[np.integer], xs: NDArray[np.integer]) -> Int64Array:
    """Evaluate a polynomial over GF(p) at many points with Horner's rule.

    Args:
        coeffs: shape ``[k]``, integer dtype, ascending degree, each in ``[0, p)``.
        xs: shape ``[n]``, integer dtype, points in ``[0, p)``.

    Returns:
        shape ``[n]``, ``int64``, each value ``P(x) mod p`` in ``[0, p)``.

    Raises:
        LocalProtocolError: an input is not a 1-D integer array or is out of range.
    """
    c = _as_field_vector(coeffs, "coeffs")
    x = _as_field_vector(xs, "xs")
    p = FIELD_PRIME
    # Blocked Horner, exact in int64: P(x) = sum_b (x^B)^b · Q_b(x), Q_b the b-th block of B
    # coefficients. Powers x^0..x^(B-1) are a [n, B] table, all Q_b(x) one integer matmul
    # (each entry a sum of B products < p², below 2^37), then Horner in x^B over the blocks:
    # about 2·B + k/B array operations instead of 2·k.
    blocks = -(-c.size // _EVAL_BLOCK)
    padded = np.zeros(blocks * _EVAL_BLOCK, dtype=np.int64)
    padded[: c.size] = c
    powers = np.empty((x.size, _EVAL_BLOCK), dtype=np.int64)
    powers[:, 0] = 1
    for j in range(1, _EVAL_BLOCK):
        powers[:, j] = (powers[:, j - 1] * x) % p
    step = (powers[:, -1] * x) % p  # x^B
    partial = (powers @ padded.reshape(blocks, _EVAL_BLOCK).T) % p  # [n, blocks]: Q_b(x)
    acc = np.zeros(x.size, dtype=np.int64)
    for b in range(blocks - 1, -1, -1):
        acc = (acc * step + partial[:, b]) % p
    return acc


_EVAL_BLOCK = 16
"""Coefficients per block of :func:`evaluate`'s blocked Horner rule."""


def find_injective_modulus(indices: NDArray[np.integer], *, min_modulus: int = 1) -> int:
    """Largest ``m`` in ``[max(min_modulus, n), p]`` with ``indices mod m`` pairwise distinct.

    The search order is ``p, p-1, …`` exactly as in TOPLOC.md §4 step 2; since ``n`` distinct
    residues need ``m >= n``, stopping at ``n`` returns the same answer as searching down to 1.

    Args:
        indices: shape ``[n]``, integer dtype, pairwise distinct non-negative flat indices.
        min_modulus: the smallest modulus to accept.

    Returns:
        The modulus ``m`` (``p`` whenever every index is below ``p``).

    Raises:
        LocalProtocolError: indices are negative, not distinct, or no modulus is injective.
    """
    idx = np.asarray(indices)
    if idx.ndim != 1 or not np.issubdtype(idx.dtype, np.integer):
        raise LocalProtocolError("indices must be a 1-D integer array")
    idx = np.unique(idx.astype(np.int64))
    n = int(np.asarray(indices).size)
    if idx.size != n:
        raise LocalProtocolError("indices must be pairwise distinct")
    if n == 0 or int(idx[0]) < 0:
        raise LocalProtocolError("indices must be non-empty and non-negative")
    p = FIELD_PRIME
    if int(idx[-1]) < p or np.unique(idx % p).size == n:
        return p
    # Residues collide under m  <=>  m divides some pairwise difference (all differences > 0).
    diffs = (idx[None, :] - idx[:, None]).reshape(-1)
    lowest = max(min_modulus, n, 1)
    hi = p
    while hi >= lowest:
        lo = max(lowest, hi - _MODULUS_BLOCK + 1)
        candidates = np.arange(hi, lo - 1, -1, dtype=np.int64)
        relevant = diffs[diffs >= lo]  # smaller positive differences are divisible by no m >= lo
        if relevant.size == 0:
            return hi
        collides = ((relevant[None, :] % candidates[:, None]) == 0).any(axis=1)
        free = np.flatnonzero(~collides)
        if free.size:
            return int(candidates[free[0]])
        hi = lo - 1
    raise LocalProtocolError(f"no injective modulus in [{lowest}, {p}] for {n} indices")
