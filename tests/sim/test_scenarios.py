"""Scenarios of the real node code on the in-memory network, in virtual time
(:mod:`simulations.scenarios`): every invariant must hold.

Default suite: each fault at a small size (7-20 nodes, a few real seconds each). ``slow``: the
scenarios at full size (21-45 nodes) and the seeded sweep (``SHARDNET_SIM_SWEEP`` runs,
default 1,000, from seed ``SHARDNET_SIM_SWEEP_FROM``, default 0, cycling through the scenarios
on tiny worlds; ``.ci/run`` runs it in chunks of seeds).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

import pytest

from simulations.scenarios import SCENARIOS, format_table, run_scenario, sweep_case
from simulations.world import seeded_scheduler

SMALL = {
    "baseline": (2, 4),
    "relay_dies": (3, 5),
    "corrupt_relays": (5, 6),
    "partition_heals": (2, 4),
    "churn": (2, 6),
    "sybils": (2, 3),
    "lossy_links": (2, 4),
}


def _check(name: str, seed: int, relays: int | None = None, peers: int | None = None) -> None:
    result = run_scenario(SCENARIOS[name], seed, relays=relays, peers=peers)
    assert result.ok, format_table([result])
    assert result.converge_s is not None


def test_a_seed_replays_the_same_run() -> None:
    """Trio orders each batch of runnable tasks at random; the simulator seeds that order, so
    a scenario and seed give the same virtual times every run (a sweep failure replays)."""
    runs = [run_scenario(SCENARIOS["partition_heals"], 203, relays=2, peers=3) for _ in range(2)]
    assert runs[0].ok, format_table(runs[:1])
    assert [(r.converge_s, r.invariants, r.notes) for r in runs] == [
        (runs[0].converge_s, runs[0].invariants, runs[0].notes)
    ] * 2


def test_a_run_out_of_wall_time_fails_instead_of_hanging() -> None:
    """A run that cannot converge spends its virtual deadline slowly (each retry is real work):
    the wall-clock budget turns that into a failed invariant, not a hang."""
    result = run_scenario(SCENARIOS["baseline"], 1, relays=1, peers=2, wall_s=0.0)
    assert not result.ok
    assert result.invariants["within_wall_clock"] is False
    assert result.converge_s is None
    assert any("wall-clock limit" in note for note in result.notes)


def test_the_scheduler_switch_is_found_and_restored() -> None:
    run: Any = importlib.import_module("trio._core._run")
    before = (run._ALLOW_DETERMINISTIC_SCHEDULING, run._r.getstate())
    with seeded_scheduler(1):
        assert run._ALLOW_DETERMINISTIC_SCHEDULING
        first = run._r.random()
    with seeded_scheduler(1):
        assert run._r.random() == first
    assert (run._ALLOW_DETERMINISTIC_SCHEDULING, run._r.getstate()) == before


@pytest.mark.parametrize("name", sorted(SMALL))
def test_scenario_small(name: str) -> None:
    relays, peers = SMALL[name]
    _check(name, seed=1, relays=relays, peers=peers)


def test_republished_step_small() -> None:
    _check("republish", seed=1, relays=2, peers=4)


@pytest.mark.slow
@pytest.mark.parametrize(
    "name",
    sorted(SCENARIOS),
)
def test_scenario_full_size(name: str) -> None:
    _check(name, seed=1)


SWEEP = int(os.environ.get("SHARDNET_SIM_SWEEP", "1000"))
SWEEP_FROM = int(os.environ.get("SHARDNET_SIM_SWEEP_FROM", "0"))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(SWEEP_FROM, SWEEP_FROM + SWEEP))
def test_sweep(seed: int) -> None:
    name, relays, peers = sweep_case(seed)
    _check(name, seed=seed, relays=relays, peers=peers)
