"""Vectorized Philox4x64-10 and the Gumbel noise of :mod:`rollout.gumbel` for many positions.

Theory of operation
-------------------
:func:`rollout.gumbel.gumbel_noise` builds one ``numpy.random.Philox`` per (key, position,
vocabulary chunk) and draws a whole :data:`~rollout.gumbel.CHUNK` of raw values: about 0.15 ms
per position on this project's CPU whatever the vocabulary, which is more than the
teacher-forced pass itself on small models. This module computes the *same* values for all
positions of a completion at once:

- :func:`philox4x64` is the Philox4x64-10 block function (Salmon et al., SC'11, "Parallel
  random numbers: as easy as 1, 2, 3"; the Random123 constants and round structure that
  ``numpy.random.Philox`` uses): ten rounds of two 64x64 -> 128-bit multiplications
  (``0xD2E7470EE14C6C93``, ``0xCA5A826395121157``) with the key bumped by the Weyl constants
  (``0x9E3779B97F4A7C15``, ``0xBB67AE8584CAA73B``) before every round but the first, computed
  on ``uint64`` arrays (the high word from 32-bit halves).
- ``numpy.random.Philox(key, counter=c)`` increments counter word 0 before each block, so raw
  value ``i`` of a stream is output ``i mod 4`` of the block with counter
  ``[c0 + i // 4 + 1, c1, c2, c3]`` (no carry for the counters used here).
- :func:`gumbel_noise_positions` evaluates exactly the blocks that
  :func:`rollout.gumbel.gumbel_noise` reads for the requested vocabulary range (counter
  ``[0, chunk, position, 0]``) and applies the same float64 transform, so row ``r`` equals
  ``gumbel_noise(key, positions[r], vocab_size, start)`` bit for bit
  (``tests/unit/test_philox.py``), at a few microseconds per position.

Pure numpy; thread-safe.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import numpy.typing as npt

from p2p.errors import LocalProtocolError
from rollout.gumbel import CHUNK, NoiseKey

__all__ = ["gumbel_noise_positions", "philox4x64", "raw_values"]

_U64 = npt.NDArray[np.uint64]
_M0, _M1 = np.uint64(0xD2E7470EE14C6C93), np.uint64(0xCA5A826395121157)
_W0, _W1 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBB67AE8584CAA73B)
_LOW, _SHIFT = np.uint64(0xFFFFFFFF), np.uint64(32)
_MAX_POSITION = 1 << 62


def _mulhilo(a: np.uint64, b: _U64) -> tuple[_U64, _U64]:
    """``(high, low)`` 64-bit words of the 128-bit products ``a * b``."""
    a_lo, a_hi = a & _LOW, a >> _SHIFT
    b_lo, b_hi = b & _LOW, b >> _SHIFT
    ll, lh, hl = a_lo * b_lo, a_lo * b_hi, a_hi * b_lo
    mid = (ll >> _SHIFT) + (lh & _LOW) + (hl & _LOW)
    high = a_hi * b_hi + (lh >> _SHIFT) + (hl >> _SHIFT) + (mid >> _SHIFT)
    return high, a * b


def philox4x64(counters: _U64, key: _U64) -> _U64:
    """Philox4x64-10 of many counters under one key.

    Args:
        counters: ``[4, n]`` ``uint64``, word 0 first.
        key: ``[2]`` ``uint64``.

    Returns:
        ``[4, n]`` ``uint64``: the four output words of each block, in output order.
    """
    x0, x1, x2, x3 = (np.asarray(w, dtype=np.uint64) for w in counters)
    k0, k1 = np.uint64(key[0]), np.uint64(key[1])
    with np.errstate(over="ignore"):
        for r in range(10):
            if r:
                k0, k1 = k0 + _W0, k1 + _W1
            hi0, lo0 = _mulhilo(_M0, x0)
            hi1, lo1 = _mulhilo(_M1, x2)
            x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
    return np.stack([x0, x1, x2, x3])


def raw_values(key: _U64, chunk: int, positions: Sequence[int], lo: int, hi: int) -> _U64:
    """Raw values ``lo .. hi-1`` of the streams ``Philox(key, counter=[0, chunk, j, 0])`` for
    every ``j`` in ``positions``: ``[len(positions), hi - lo]`` ``uint64``."""
    first, last = lo // 4, -(-hi // 4)
    pos = np.asarray(list(positions), dtype=np.uint64)
    blocks = np.arange(first + 1, last + 1, dtype=np.uint64)
    ctr = np.zeros((4, pos.size, blocks.size), dtype=np.uint64)
    ctr[0] = blocks[None, :]
    ctr[1] = np.uint64(chunk)
    ctr[2] = pos[:, None]
    out = philox4x64(ctr.reshape(4, -1), key).reshape(4, pos.size, blocks.size)
    flat = out.transpose(1, 2, 0).reshape(pos.size, blocks.size * 4)
    return flat[:, lo - first * 4 : hi - first * 4]


def gumbel_noise_positions(
    key: NoiseKey, positions: Sequence[int], vocab_size: int, start: int = 0
) -> npt.NDArray[np.float32]:
    """:func:`rollout.gumbel.gumbel_noise` of ``key`` at every position of ``positions``.

    Args:
        key: the sample's noise key.
        positions: completion positions ``j >= 0``.
        vocab_size: one past the last vocabulary entry, ``> start``.
        start: first vocabulary entry, ``>= 0``.

    Returns:
        ``[len(positions), vocab_size - start]`` float32; row ``r`` is bit-identical to
        ``gumbel_noise(key, positions[r], vocab_size, start)``.

    Raises:
        LocalProtocolError: a position out of range or an empty vocabulary range.
    """
    pos = list(positions)
    if any(not 0 <= j < _MAX_POSITION for j in pos) or not 0 <= start < vocab_size:
        raise LocalProtocolError(f"bad noise range: positions {pos[:4]}, [{start}, {vocab_size})")
    pk = key.philox_key()
    parts = []
    for c in range(start // CHUNK, (vocab_size - 1) // CHUNK + 1):
        lo, hi = max(start, c * CHUNK) - c * CHUNK, min(vocab_size, (c + 1) * CHUNK) - c * CHUNK
        parts.append(raw_values(pk, c, pos, lo, hi))
    raw = np.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
    u = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0**-53)
    return (-np.log(-np.log(u))).astype(np.float32)
