"""Seeded Gumbel-max noise, the replay check and the termination check (rollout/gumbel.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from p2p.errors import LocalProtocolError
from rollout.gumbel import (
    CHUNK,
    NoiseKey,
    TerminationFailure,
    check_replay,
    check_termination,
    group_seed,
    gumbel_argmax,
    gumbel_noise,
    judge_replay,
    replay_gaps,
    sample_key,
)

KEY = sample_key("run", "12D3KooWPeer", 3, 1, 2)
V = 300
T = 1.0


def _logits(n: int, vocab: int = V, seed: int = 0, scale: float = 2.0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((n, vocab)) * scale).astype(np.float32)


def _sample(logits: np.ndarray, key: NoiseKey, temperature: float = T) -> list[int]:
    return [
        int(gumbel_argmax(logits[j : j + 1], [key], j, temperature)[0])
        for j in range(logits.shape[0])
    ]


def test_known_values() -> None:
    """Pins the scheme: seed hash, Philox key and noise values. A change here means every
    peer and validator must change together (new NOISE_DOMAIN)."""
    assert group_seed("run", "12D3KooWPeer", 3, 1) == KEY.seed
    assert KEY.seed == 0x54CADDDF6651622B5E3A0F90D587B4D6
    assert KEY.philox_key().tolist() == [4619018598282230246, 3944772667510788915]
    noise = gumbel_noise(NoiseKey(7, 0), 0, 4)
    assert noise.dtype == np.float32
    assert noise.tolist() == pytest.approx(
        [0.5824096202850342, 0.38571545481681824, -0.12391738593578339, 2.170558214187622],
        abs=1e-6,
    )
    assert gumbel_noise(NoiseKey(7, 0), 3, CHUNK + 2, CHUNK).tolist() == pytest.approx(
        [0.021464573219418526, 1.7603336572647095], abs=1e-6
    )


def test_noise_independent_of_vocab_size_and_range() -> None:
    full = gumbel_noise(KEY, 5, 3 * CHUNK + 17)
    np.testing.assert_array_equal(gumbel_noise(KEY, 5, 100), full[:100])
    np.testing.assert_array_equal(
        gumbel_noise(KEY, 5, 2 * CHUNK + 3, CHUNK - 2), full[CHUNK - 2 : 2 * CHUNK + 3]
    )
    assert not np.array_equal(gumbel_noise(KEY, 6, 100), full[:100])
    assert not np.array_equal(gumbel_noise(NoiseKey(KEY.seed, 3), 5, 100), full[:100])


def test_keys_differ_by_every_field() -> None:
    base = ("run", "peer", 3, 1)
    seeds = {
        group_seed(*base),
        group_seed("run2", "peer", 3, 1),
        group_seed("run", "peer2", 3, 1),
        group_seed("run", "peer", 4, 1),
        group_seed("run", "peer", 3, 2),
        group_seed("run", "pee", 3, 1),  # length prefixes: no ambiguity across fields
        group_seed("runp", "eer", 3, 1),
    }
    assert len(seeds) == 7
    assert all(0 <= s < 1 << 128 for s in seeds)


def test_noise_is_standard_gumbel() -> None:
    g = gumbel_noise(KEY, 0, 200_000).astype(np.float64)
    assert abs(g.mean() - 0.5772) < 0.01  # Euler-Mascheroni
    assert abs(g.var() - math.pi**2 / 6) < 0.03
    assert np.isfinite(g).all()


def test_argmax_independent_of_batch_layout() -> None:
    """Same key → same token, whatever other samples share the batch, and in any order."""
    logits = _logits(8, seed=1)
    keys = [sample_key("run", "peer", 2, p, i) for p in range(2) for i in range(4)]
    together = gumbel_argmax(logits, keys, 4, T)
    alone = [int(gumbel_argmax(logits[i : i + 1], [k], 4, T)[0]) for i, k in enumerate(keys)]
    order = [5, 2, 7, 0, 1, 6, 3, 4]
    shuffled = gumbel_argmax(logits[order], [keys[i] for i in order], 4, T)
    assert together.tolist() == alone
    assert shuffled.tolist() == [alone[i] for i in order]


def test_gumbel_max_samples_softmax() -> None:
    """argmax(z + g) over many keys follows softmax(z)."""
    z = np.array([1.0, 0.0, -1.0, 0.5], dtype=np.float32)
    n = 4000
    counts = np.bincount(
        [int(gumbel_argmax(z[None], [NoiseKey(s, 0)], 0, 1.0)[0]) for s in range(n)],
        minlength=4,
    )
    p = np.exp(z) / np.exp(z).sum()
    assert np.abs(counts / n - p).max() < 0.025


def test_honest_completion_replays_with_zero_gap() -> None:
    logits = _logits(32)
    ids = _sample(logits, KEY)
    gaps = replay_gaps(logits, ids, KEY, T)
    assert gaps.max() == 0.0
    r = check_replay(logits, ids, KEY, T, margin=0.0)
    assert r.passed
    assert r.worst_gap == 0.0
    assert r.positions == 32


def test_honest_completion_with_validator_noise_passes_margin() -> None:
    """Validator logits a little off (bf16-scale drift) pass with a small margin."""
    logits = _logits(64, seed=3)
    ids = _sample(logits, KEY)
    drift = logits + np.random.default_rng(9).normal(0, 0.01, logits.shape).astype(np.float32)
    r = check_replay(drift, ids, KEY, T, margin=0.1)
    assert r.passed, r


@pytest.mark.parametrize("position", [0, 15, 31])
def test_tampered_token_fails(position: int) -> None:
    logits = _logits(32)
    ids = _sample(logits, KEY)
    scores = logits[position] + gumbel_noise(KEY, position, V)
    ids[position] = int(np.argsort(scores)[V // 2])  # a mid-ranked token
    r = check_replay(logits, ids, KEY, T, margin=0.5)
    assert not r.passed
    assert r.worst_position == position
    assert r.worst_gap > 0.5


def test_greedy_completion_fails() -> None:
    logits = _logits(32, seed=4)
    greedy = np.argmax(logits, axis=1).tolist()
    r = check_replay(logits, greedy, KEY, T, margin=0.5)
    assert not r.passed
    assert r.worst_gap > 0.5


def test_other_temperature_fails() -> None:
    logits = _logits(32, seed=5)
    cold = _sample(logits, KEY, temperature=0.5)  # right noise, wrong temperature
    assert not check_replay(logits, cold, KEY, 1.0, margin=0.5).passed
    hot = _sample(logits, KEY, temperature=1.6)
    assert not check_replay(logits, hot, KEY, 1.0, margin=0.5).passed


def test_other_key_fails() -> None:
    logits = _logits(32, seed=6)
    ids = _sample(logits, NoiseKey(KEY.seed, KEY.sample_index + 1))
    assert not check_replay(logits, ids, KEY, T, margin=0.5).passed


def test_replay_fails_closed() -> None:
    assert not judge_replay([], 1.0).passed
    r = judge_replay([0.0, float("nan")], 1.0, first_position=4)
    assert not r.passed
    assert r.worst_position == 5
    with pytest.raises(LocalProtocolError):
        judge_replay([0.0], -1.0)
    with pytest.raises(LocalProtocolError):
        replay_gaps(_logits(2), [0], KEY, T)
    with pytest.raises(LocalProtocolError):
        replay_gaps(_logits(1), [V], KEY, T)
    with pytest.raises(LocalProtocolError):
        replay_gaps(_logits(1), [0], KEY, 0.0)
    with pytest.raises(LocalProtocolError):
        NoiseKey(-1, 0)


EOS = 2


@pytest.mark.parametrize(
    ("ids", "finish", "lp", "failure"),
    [
        ([5, 6, EOS], "stop", math.log(0.5), None),
        ([5, 6, EOS], "stop", None, None),
        ([5, 6, EOS], "stop", math.log(0.021), None),
        ([5, 6, EOS], "stop", math.log(0.019), TerminationFailure.EOS_IMPROBABLE),
        ([5, 6, EOS], "stop", float("nan"), TerminationFailure.EOS_IMPROBABLE),
        ([5, 6, 7], "stop", 0.0, TerminationFailure.STOP_WITHOUT_EOS),
        ([5, EOS, EOS], "stop", 0.0, TerminationFailure.EOS_INSIDE),
        ([5, 6, 7, 8], "length", None, None),
        ([5, 6, 7], "length", None, TerminationFailure.LENGTH_NOT_AT_CAP),
        ([5, 6, 7, 8, 9], "length", None, TerminationFailure.LENGTH_NOT_AT_CAP),
        ([5, 6, 7, EOS], "length", None, TerminationFailure.LENGTH_NOT_AT_CAP),
        ([5, EOS, 7, 8], "length", None, TerminationFailure.EOS_INSIDE),
        ([5, 6, 7, 8], "abort", None, TerminationFailure.UNKNOWN_FINISH),
    ],
)
def test_termination(
    ids: list[int], finish: str, lp: float | None, failure: TerminationFailure | None
) -> None:
    r = check_termination(
        ids, finish, eos_id=EOS, max_new_tokens=4, eos_logprob=lp, eos_min_prob=0.02
    )
    assert r.passed == (failure is None)
    assert r.failure is failure
