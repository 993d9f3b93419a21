"""The vectorized Philox4x64-10 and Gumbel noise equal numpy's Philox and rollout.gumbel."""

from __future__ import annotations

import numpy as np
import pytest

from rollout.gumbel import CHUNK, NoiseKey, gumbel_noise, sample_key
from rollout.philox import gumbel_noise_positions, raw_values


@pytest.mark.parametrize("position", [0, 1, 37, 2**40 + 3])
def test_raw_values_equal_numpy_philox(position: int) -> None:
    key = np.array([0x0123456789ABCDEF, 0xFEDCBA9876543210], dtype=np.uint64)
    counter = np.array([0, 2, position, 0], dtype=np.uint64)
    expected = np.random.Philox(key=key, counter=counter).random_raw(CHUNK)
    assert (raw_values(key, 2, [position], 0, CHUNK)[0] == expected).all()
    assert (raw_values(key, 2, [position], 5, 130)[0] == expected[5:130]).all()


@pytest.mark.parametrize(
    ("vocab", "start"), [(128, 0), (1, 0), (5000, 0), (9000, 4000), (32000, 4096), (4097, 4096)]
)
def test_noise_rows_equal_gumbel_noise(vocab: int, start: int) -> None:
    key = sample_key("run", "peer", 3, 1, 5)
    positions = [0, 1, 2, 127, 1000]
    got = gumbel_noise_positions(key, positions, vocab, start)
    assert got.shape == (len(positions), vocab - start)
    assert got.dtype == np.float32
    for row, j in zip(got, positions, strict=True):
        assert row.tobytes() == gumbel_noise(key, j, vocab, start).tobytes()


def test_plain_seed_keys() -> None:
    key = NoiseKey(7, 0)
    assert gumbel_noise_positions(key, [4], 64)[0].tobytes() == gumbel_noise(key, 4, 64).tobytes()
