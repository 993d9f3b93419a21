"""Fair staleness: long rollouts are trained on about as often as short ones.

A pure simulation of the trainer's intake decisions (:func:`rollout.intake.judge_staleness` at
admission, :func:`rollout.intake.oldest_trainable_step` when the optimizer takes the buffer,
:class:`rollout.intake.IntakeLedger` for the report) with heavy-tailed rollout lengths: Pareto
(alpha 1.1, from 16 tokens) capped at ``max_new_tokens``. Peers generate at a fixed token rate
and see a new version some seconds after the trainer publishes it.

Stated factor: with pacing (a peer takes the newest version before each group and announces
each group on its own) and the default grace of one step, the trained-on share of the longest
decile is at least 0.9 times that of the shortest. The old rule (a whole batch of groups on the
version it started with, no grace) is shown to fail the same bound, so the test can fail.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from rollout.intake import (
    IntakeLedger,
    Staleness,
    judge_staleness,
    length_bucket,
    oldest_trainable_step,
)
from rollout.reputation import Reputation

STEP_S = 10.0  # trainer step period
VISIBLE_AFTER_S = 2.0  # a version reaches peers this long after it is published
TOKENS_PER_S = 60.0  # generation speed of a peer
MAX_NEW_TOKENS = 1024  # the length cap: 17 s of generation at most
ASYNC_LEVEL = 2
FACTOR = 0.9


@dataclass(frozen=True)
class Rollout:
    length: int
    trained: bool


def _length(rng: random.Random) -> int:
    return min(MAX_NEW_TOKENS, int(16 * rng.paretovariate(1.1)))


def _simulate(
    *, paced: bool, grace_steps: int, seed: int = 7
) -> tuple[list[Rollout], IntakeLedger]:
    rng = random.Random(seed)
    ledger = IntakeLedger()
    out: list[Rollout] = []
    groups_per_batch = 1 if paced else 8
    for peer in range(16):
        t = rng.uniform(0, STEP_S)
        while t < 2000.0:
            version = max(0, math.floor((t - VISIBLE_AFTER_S) / STEP_S))
            lengths = [_length(rng) for _ in range(groups_per_batch)]
            t += sum(lengths) / TOKENS_PER_S + 0.5
            current = math.floor(t / STEP_S)
            verdict = judge_staleness(version, current, ASYNC_LEVEL, grace_steps)
            admitted = verdict in (Staleness.FRESH, Staleness.LATE)
            # the optimizer takes the buffer at the next step boundary
            trained = admitted and version >= oldest_trainable_step(
                current + 1, ASYNC_LEVEL, grace_steps
            )
            bucket = length_bucket(sum(lengths) / len(lengths))
            ledger.count(f"peer-{peer}", bucket, accepted=admitted, late=verdict is Staleness.LATE)
            if trained:
                ledger.count_trained(f"peer-{peer}", bucket)
            out += [Rollout(n, trained) for n in lengths]
    return out, ledger


def _decile_shares(rollouts: list[Rollout]) -> tuple[float, float]:
    ordered = sorted(rollouts, key=lambda r: r.length)
    tenth = len(ordered) // 10
    short, long = ordered[:tenth], ordered[-tenth:]
    return (
        sum(r.trained for r in short) / len(short),
        sum(r.trained for r in long) / len(long),
    )


def test_longest_decile_is_trained_on_like_the_shortest() -> None:
    rollouts, ledger = _simulate(paced=True, grace_steps=1)
    short, long = _decile_shares(rollouts)
    assert len(rollouts) > 5_000
    assert long >= FACTOR * short, (short, long)
    # the report says the same, per length bucket and per submitter
    by_length = ledger.by_length()
    assert by_length[length_bucket(MAX_NEW_TOKENS)].trained_rate >= FACTOR * min(
        a.trained_rate for a in by_length.values()
    )
    assert all(a.acceptance_rate >= FACTOR for a in ledger.by_submitter().values())


def test_the_old_rule_is_biased_against_long_rollouts() -> None:
    rollouts, _ = _simulate(paced=False, grace_steps=0)
    short, long = _decile_shares(rollouts)
    assert long < FACTOR * short, (short, long)


def test_arriving_late_costs_no_reputation() -> None:
    rep = Reputation()
    for i in range(100):
        rep.record("slow-peer", False, "stale_step", now=float(i))
    assert rep.score("slow-peer", now=100.0) == rep.config.initial
    assert not rep.refused("slow-peer", now=100.0)


def test_no_refusal_is_permanent() -> None:
    rep = Reputation()
    rep.record("peer", False, "toploc", now=0.0)
    rep.record("peer", False, "toploc", now=0.0)
    rep.record("peer", False, "toploc", now=0.0)
    assert rep.refused("peer", now=1.0)
    # the score recovers with time; at readmit_score the peer is heard again
    later = (rep.config.readmit_score - rep.score("peer", now=0.0)) / rep.config.recovery_per_s
    assert not rep.refused("peer", now=later)
    assert rep.score("peer", now=later) >= rep.config.readmit_score
    # one more forgery and it is refused again
    rep.record("peer", False, "toploc", now=later)
    assert rep.refused("peer", now=later)
