"""The sans-IO source scheduler (``shardcast.core.select``): pure, seeded, no clock.

Each test plays the driver by hand: it asks :meth:`Scheduler.next_request` for work, decides
the outcome, and reports it with an explicit ``now``. A Hypothesis test then drives random
event sequences and checks the scheduler's invariants after every event.
"""

from __future__ import annotations

import math
import random
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p.errors import LocalProtocolError
from shardcast.core.blame import blame
from shardcast.core.failure import FailureKind
from shardcast.core.select import Request, Scheduler, SchedulerConfig, SourceState

MB = 1_000_000


def state(sched: Scheduler, source: str) -> SourceState:
    return next(s for s in sched.sources() if s.source == source)


def drain(sched: Scheduler, now: float) -> list[Request]:
    """Everything the scheduler would start now (the driver's inner loop)."""
    out = []
    while (req := sched.next_request(now)) is not None:
        out.append(req)
    return out


# --- choosing a source ------------------------------------------------------------------------


def _fast_vs_slow(explore: float, seed: int, decisions: int = 400) -> Counter[str]:
    """Measure a slow and a fast source once, then count who gets the next ``decisions``."""
    true_rate_bps = {"a-slow": 1 * MB, "b-fast": 50 * MB}
    cfg = SchedulerConfig(
        max_inflight=2,
        per_source_inflight=1,
        explore=explore,
        ewma_alpha=0.5,
        initial_rate_bps=10 * MB,
    )
    sched = Scheduler([MB] * (decisions + 2), random.Random(seed), cfg)
    for name in true_rate_bps:
        sched.add_source(name)
    now = 0.0
    warm = drain(sched, now)  # per-source cap 1: each unmeasured source gets one request
    assert sorted(r.source for r in warm) == sorted(true_rate_bps)
    for r in warm:
        sched.on_first_byte(r.id, now)
        sched.on_success(r.id, now + r.length / true_rate_bps[r.source])
    now = 10.0
    assert state(sched, "b-fast").rate_bps > 5 * state(sched, "a-slow").rate_bps
    counts: Counter[str] = Counter()
    for _ in range(decisions):  # one transfer at a time: every decision sees idle sources
        req = sched.next_request(now)
        assert req is not None
        counts[req.source] += 1
        sched.on_first_byte(req.id, now)
        now += req.length / true_rate_bps[req.source]
        assert sched.on_success(req.id, now) == []
    assert sched.done()
    return counts


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_measured_fast_source_gets_most_requests_but_slow_one_is_explored(seed: int) -> None:
    counts = _fast_vs_slow(explore=0.2, seed=seed)
    # explore=0.2 between two sources: ~10% random picks of the slow one, the rest greedy
    assert counts["b-fast"] >= 0.8 * 400
    assert counts["a-slow"] >= 10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_exploration_the_slow_source_is_never_chosen_again(seed: int) -> None:
    assert _fast_vs_slow(explore=0.0, seed=seed) == Counter({"b-fast": 400})


def test_first_sample_replaces_the_prior_and_later_ones_are_averaged() -> None:
    cfg = SchedulerConfig(initial_rate_bps=100 * MB, ewma_alpha=0.5, explore=0.0)
    sched = Scheduler([MB] * 4, random.Random(0), cfg)
    sched.add_source("relay")
    req = sched.next_request(0.0)
    assert req is not None
    sched.on_first_byte(req.id, 0.0)
    sched.on_success(req.id, 1.0)  # 1 MB/s, far below the 100 MB/s prior
    assert state(sched, "relay").rate_bps == pytest.approx(1 * MB)
    req = sched.next_request(1.0)
    assert req is not None
    sched.on_first_byte(req.id, 1.0)
    sched.on_success(req.id, 1.5)  # 2 MB/s
    assert state(sched, "relay").rate_bps == pytest.approx(1.5 * MB)


def test_unmeasured_peer_is_assumed_as_fast_as_the_best_measured_and_loses_ties() -> None:
    """A newly discovered peer is not assumed faster than the fastest measured source (a
    fixed 100 MB/s prior used to pull traffic off idle relays onto congested peer uplinks)."""
    cfg = SchedulerConfig(
        initial_rate_bps=100 * MB, explore=0.0, per_source_inflight=8, max_inflight=8
    )
    sched = Scheduler([MB] * 20, random.Random(0), cfg)
    sched.add_source("relay")
    req = sched.next_request(0.0)
    assert req is not None
    sched.on_first_byte(req.id, 0.0)
    sched.on_success(req.id, 0.1)  # the relay: 10 MB/s per request
    sched.add_source("a-peer", range(20))  # sorts before "relay" by name, holds everything
    picks = [r.source for r in drain(sched, 1.0)]
    # the relay goes first (tie at equal assumed rate); requests then alternate as the
    # relay's queue grows: the peer does not take everything
    assert picks[0] == "relay"
    assert 3 <= picks.count("a-peer") <= 5
    peer = state(sched, "a-peer")
    assert peer.samples == 0


def test_failure_of_an_unmeasured_source_decays_from_the_prior_it_is_judged_by() -> None:
    cfg = SchedulerConfig(initial_rate_bps=100 * MB, explore=0.0, failure_decay=0.5)
    sched = Scheduler([MB] * 4, random.Random(0), cfg)
    sched.add_source("relay")
    r = sched.next_request(0.0)
    assert r is not None
    sched.on_first_byte(r.id, 0.0)
    sched.on_success(r.id, 0.1)  # 10 MB/s measured
    sched.add_source("peer", range(4))
    # take the relay out of the way so the peer gets one request, then fail it
    state(sched, "relay").blocked_until = 5.0
    r = sched.next_request(1.0)
    assert r is not None
    assert r.source == "peer"
    sched.on_failure(r.id, 1.0, kind=FailureKind.BROKEN)
    assert state(sched, "peer").rate_bps == pytest.approx(5 * MB)  # half the 10 MB/s prior


@pytest.mark.parametrize(
    ("late", "expect"),
    [("held", "quick-peer"), ("streamed", "late-peer")],
)
def test_a_peer_slow_to_answer_for_a_shard_it_holds_is_measured_from_the_request(
    late: str, expect: str
) -> None:
    """A peer that held the shard whole when asked and sent its first byte only after 0.5 s
    is measured from the request (its wait is its own: a busy process, a slow lane), so a
    peer that answers at once wins the next shard; a peer that was still receiving the shard
    (streaming its verified prefix) is measured from its first byte, as relays are."""
    cfg = SchedulerConfig(explore=0.0, per_source_inflight=1, max_inflight=2)
    sched = Scheduler([MB] * 4, random.Random(0), cfg)
    sched.add_source("late-peer", (0, 1, 2, 3) if late == "held" else ())
    if late == "streamed":
        sched.set_prefixes("late-peer", {0: MB, 1: MB, 2: MB, 3: MB})
    sched.add_source("quick-peer", (0, 1, 2, 3))
    first, second = sched.next_request(0.0), sched.next_request(0.0)
    assert first is not None
    assert second is not None
    by_source = {first.source: first, second.source: second}
    slow, quick = by_source["late-peer"], by_source["quick-peer"]
    sched.on_first_byte(slow.id, 0.5)
    sched.on_success(slow.id, 0.51)  # 1 MB in 10 ms after a 0.5 s wait
    sched.on_first_byte(quick.id, 0.01)
    sched.on_success(quick.id, 0.11)  # 1 MB in 100 ms, from an answer at once
    late_rate = state(sched, "late-peer").rate_bps
    assert late_rate == pytest.approx(MB / 0.51 if late == "held" else MB / 0.01)
    req = sched.next_request(1.0)
    assert req is not None
    assert req.source == expect


def _measured(sched: Scheduler, source: str, rate_bps: float, now: float) -> None:
    """Give ``source`` one request and complete it at ``rate_bps``."""
    req = sched.next_request(now)
    assert req is not None
    assert req.source == source
    sched.on_first_byte(req.id, now)
    sched.on_success(req.id, now + req.length / rate_bps)


@pytest.mark.parametrize(("slack", "expect"), [(1.5, "peer"), (float("inf"), "relay")])
def test_rare_shard_on_a_slow_source_yields_to_a_common_one_on_a_fast_source(
    slack: float, expect: str
) -> None:
    """Rarest first, unless the rare shard's only source is much slower (rarity_slack): a
    congested relay must not take every slot while a fast peer holds shards we lack."""
    cfg = SchedulerConfig(explore=0.0, rarity_slack=slack, per_source_inflight=1)
    sched = Scheduler([MB] * 6, random.Random(0), cfg)
    sched.add_source("relay")
    _measured(sched, "relay", 1 * MB, 0.0)  # the relay: 1 MB/s
    sched.add_source("peer", (4, 5))
    sched.add_source("peer-2", (5,))  # shard 5 has two partial holders: the least rare
    state(sched, "peer-2").blocked_until = 100.0  # never asked in this test
    state(sched, "relay").blocked_until = 2.5  # so that the peer gets measured first
    _measured(sched, "peer", 10 * MB, 2.0)  # the peer: 10 MB/s (on shard 4)
    # left: shards 1-3 (the rarest: only the relay has them) and 5 (the peer has it)
    req = sched.next_request(3.0)
    assert req is not None
    assert req.source == expect
    # with the slack, the fast peer gets the common shard it holds; strict rarest first
    # sends a rarer one to the slow relay
    assert req.shard == (5 if expect == "peer" else req.shard)
    assert (req.shard in (1, 2, 3)) == (expect == "relay")


def test_a_queued_source_gets_the_next_delta_blob_at_the_first_look() -> None:
    """Delta blobs (light shards, ~1 % of a raw shard) from the one source a follower has
    (its upstream), with requests queued there: the rarity bar is taken at the blob's own
    length, so the first idle blob looked at passes it. A bar per byte at the raw shard's
    length failed every blob once a few were queued, and each request looked at 64 idle
    shards before falling back to the first one (half of a follower's CPU in a next version
    with 1,260 shards, ``bench/follower_cpu.py``). A second source holding nothing idle
    sets no bar."""
    n, blob = 1000, 12_000
    cfg = SchedulerConfig(explore=0.0, per_source_inflight=1000, max_inflight=1000)
    sched = Scheduler([MB] * n, random.Random(0), cfg)
    for i in range(n):
        sched.mark_known(i, blob, light=True)
    sched.add_source("relay")
    sched.add_source("peer", set())
    _measured(sched, "relay", 10 * MB, 0.0)
    looked = 0
    pop = sched._pop_idle

    def counting(aside: list[tuple[int, float, int]]) -> tuple[int, int] | None:
        nonlocal looked
        looked += 1
        return pop(aside)

    sched._pop_idle = counting  # type: ignore[method-assign]
    got = [sched.next_request(1.0) for _ in range(200)]
    assert all(r is not None and r.source == "relay" and r.length == blob for r in got)
    assert len({r.shard for r in got if r is not None}) == 200
    assert looked <= 2 * len(got)


def test_decisions_replay_exactly_for_a_seed() -> None:
    def run(seed: int) -> list[tuple[int, str]]:
        sched = Scheduler([100] * 12, random.Random(seed), SchedulerConfig(explore=0.5))
        for name in ("a", "b", "c"):
            sched.add_source(name)
        return [(r.shard, r.source) for r in drain(sched, 0.0)]

    assert run(7) == run(7)
    assert len({tuple(run(s)) for s in range(8)}) > 1  # the seed does matter


# --- choosing a shard ---------------------------------------------------------------------------


def test_rarest_shard_first() -> None:
    cfg = SchedulerConfig(explore=0.0, endgame_duplicates=0)
    sched = Scheduler([100, 100, 100], random.Random(0), cfg)
    sched.add_source("a")  # holds every shard
    sched.add_source("b", have={1, 2})
    sched.add_source("c", have={2})
    # availability: shard 0 -> 1 source, shard 1 -> 2, shard 2 -> 3
    assert [(r.shard, r.source) for r in drain(sched, 0.0)] == [(0, "a"), (1, "b"), (2, "c")]


@pytest.mark.parametrize("leaves", ["completes", "is_removed", "is_banned"])
def test_a_source_that_held_prefixes_leaves_the_rarity_counts_right(leaves: str) -> None:
    """A partial source that served prefixes and then completes, leaves or is banned stops
    counting as one holder of each of those shards: rarity is counted in holders, never in
    the prefixes' bytes (they were once subtracted as counts, which made a shard held by
    many look rarer than any other for the rest of the download)."""
    for seed in range(6):
        cfg = SchedulerConfig(explore=0.0, endgame_duplicates=0)
        sched = Scheduler([100, 100, 100], random.Random(seed), cfg)
        sched.add_source("q", have={0, 1})
        sched.add_source("r", have={1, 2})
        sched.add_source("s", have={0})
        sched.add_source("p", have=())
        sched.set_prefixes("p", {0: 50})
        if leaves == "completes":
            sched.add_source("p")  # its /have now says it holds every shard
        elif leaves == "is_removed":
            sched.remove_source("p")
        else:
            sched.ban("p")
        # holders now: shard 0 -> q, s; shard 1 -> q, r; shard 2 -> r alone
        req = sched.next_request(0.0)
        assert req is not None
        assert req.shard == 2, seed


def test_equally_rare_shards_are_spread_by_the_seed() -> None:
    firsts = set()
    for seed in range(10):
        sched = Scheduler([100] * 8, random.Random(seed), SchedulerConfig(explore=0.0))
        sched.add_source("a")
        req = sched.next_request(0.0)
        assert req is not None
        firsts.add(req.shard)
    assert len(firsts) > 2  # peers do not all start with shard 0


def test_partially_received_shard_resumes_before_rarer_ones() -> None:
    cfg = SchedulerConfig(max_inflight=1, explore=0.0, penalty_s=1.0)
    sched = Scheduler([100] * 4, random.Random(3), cfg)
    sched.add_source("a")
    first = sched.next_request(0.0)
    assert first is not None
    sched.on_failure(first.id, 0.0, kind=FailureKind.BROKEN, received=10)
    sched.add_source("b", have={first.shard})  # the partial shard is now the least rare
    req = sched.next_request(1.0)
    assert req is not None
    assert (req.shard, req.start, req.length) == (first.shard, 10, 90)
    assert req.source == "b"  # "a" failed: its rate was decayed
    assert sched.statistics().resumed == 1


# --- limits and have-sets ------------------------------------------------------------------------


def test_global_and_per_source_inflight_caps() -> None:
    cfg = SchedulerConfig(max_inflight=3, per_source_inflight=2, explore=1.0)
    sched = Scheduler([100] * 10, random.Random(1), cfg)
    sched.add_source("a")
    sched.add_source("b")
    reqs = drain(sched, 0.0)
    assert len(reqs) == 3 == sched.inflight()
    assert max(Counter(r.source for r in reqs).values()) == 2

    cfg = SchedulerConfig(max_inflight=8, per_source_inflight=2, explore=1.0)
    sched = Scheduler([100] * 10, random.Random(1), cfg)
    sched.add_source("a")
    sched.add_source("b")
    reqs = drain(sched, 0.0)
    assert Counter(r.source for r in reqs) == {"a": 2, "b": 2}
    sched.on_success(reqs[0].id, 1.0)
    more = drain(sched, 1.0)
    assert [r.source for r in more] == [reqs[0].source]


@pytest.mark.parametrize("seed", range(5))
def test_a_source_never_gets_a_shard_it_does_not_hold(seed: int) -> None:
    cfg = SchedulerConfig(explore=1.0)  # always a random eligible source
    sched = Scheduler([100, 100, 100], random.Random(seed), cfg)
    sched.add_source("a", have={0})
    sched.add_source("b", have={1})
    sched.add_source("c", have={0, 1})
    holders = {"a": {0}, "b": {1}, "c": {0, 1}}
    reqs = drain(sched, 0.0)
    assert sorted(r.shard for r in reqs) == [0, 1]  # shard 2: nobody holds it
    assert all(r.shard in holders[r.source] for r in reqs)
    for r in reqs:
        sched.on_success(r.id, 1.0)
    assert drain(sched, 1.0) == []
    assert sched.missing == 1
    assert not sched.done()
    sched.add_have("b", [2])
    reqs = drain(sched, 2.0)
    assert [(r.shard, r.source) for r in reqs] == [(2, "b")]


# --- failures ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [FailureKind.TIMEOUT, FailureKind.BROKEN])
def test_transfer_failure_keeps_bytes_and_resumes_elsewhere(kind: FailureKind) -> None:
    cfg = SchedulerConfig(explore=0.0, penalty_s=2.0, endgame_duplicates=0)
    sched = Scheduler([1000], random.Random(0), cfg)
    sched.add_source("a")
    sched.add_source("b")
    r1 = sched.next_request(0.0)
    assert r1 is not None
    assert (r1.source, r1.start, r1.length) == ("a", 0, 1000)  # tie: source name
    assert sched.next_request(0.0) is None  # no endgame: the only shard is in flight
    rate_before = state(sched, "a").rate_bps
    sched.on_failure(r1.id, 10.0, kind=kind, received=400)
    assert sched.resume_offset(0) == 400
    assert state(sched, "a").rate_bps == rate_before * cfg.failure_decay
    r2 = sched.next_request(10.0)
    assert r2 is not None
    assert (r2.source, r2.start, r2.length, r2.duplicate) == ("b", 400, 600, False)
    sched.on_failure(r2.id, 10.0, kind=kind, received=100)
    assert sched.resume_offset(0) == 500  # offsets accumulate across sources
    assert sched.next_request(10.0 + 2.0 - 1e-9) is None  # both blocked for penalty_s
    r3 = sched.next_request(10.0 + 2.0)
    assert r3 is not None
    assert (r3.start, r3.length) == (500, 500)
    assert sched.statistics().resumed == 2
    assert sched.statistics().failures == 2


# --- overdue transfers -------------------------------------------------------------------------


def _overdue_config(factor: float, inflight: int, per_source: int) -> SchedulerConfig:
    """No exploration, endgame or preference for complete sources; overdue_min_s 4 s."""
    return SchedulerConfig(
        explore=0.0,
        max_inflight=inflight,
        per_source_inflight=per_source,
        endgame_duplicates=0,
        complete_cost_factor=1.0,
        overdue_factor=factor,
        overdue_min_s=4.0,
    )


def _overdue_world(factor: float = 4.0) -> tuple[Scheduler, Request]:
    """One 100 MB shard in flight from the slow home peer ``p`` (unmeasured, so it was
    assumed as fast as relay ``r``, measured at 100 MB/s); ``r`` has a free slot."""
    cfg = _overdue_config(factor, 1, 1)
    sched = Scheduler([100 * MB] * 2, random.Random(0), cfg)
    sched.add_source("r")
    warm = sched.next_request(0.0)
    assert warm is not None
    assert warm.source == "r"
    sched.on_first_byte(warm.id, 0.0)
    sched.on_success(warm.id, 1.0)  # r: 100 MB/s
    left = 1 - warm.shard
    sched.add_source("p", have=[0, 1])  # a peer, rate unmeasured
    state(sched, "r").not_before[left] = 2.0  # r refused the other shard a moment ago
    req = sched.next_request(1.0)
    assert req is not None
    assert (req.shard, req.source) == (left, "p")
    sched.on_first_byte(req.id, 1.0)
    return sched, req


def test_a_transfer_far_slower_than_a_ready_source_is_handed_back_and_resumes_there() -> None:
    sched, req = _overdue_world()
    sched.on_progress(req.id, 4 * MB)  # 1 MB/s: 96 s to go, r would take ~1 s
    assert sched.overdue(4.9) == []  # not before it ran overdue_min_s
    assert sched.overdue(5.0) == [req.id]
    assert sched.overdue(5.5) == []  # handed back once
    sched.on_failure(req.id, 6.0, kind=FailureKind.OVERDUE, received=4 * MB)
    assert sched.resume_offset(req.shard) == 4 * MB
    p = state(sched, "p")
    assert p.samples == 1
    assert p.rate_bps == pytest.approx(4 * MB / 5.0)
    assert p.blocked_until <= 6.0
    assert p.not_before[req.shard] == 10.0
    resumed = sched.next_request(6.0)
    assert resumed is not None
    assert (resumed.source, resumed.start, resumed.length) == ("r", 4 * MB, 96 * MB)
    stats = sched.statistics()
    assert (stats.overdue, stats.failures, stats.resumed) == (1, 0, 1)


@pytest.mark.parametrize(
    ("relay_mb_s", "received_mb", "handed_back"),
    [
        (100, 40, True),  # 10 MB/s: 6 s to go; r 0.6 s
        (100, 99, False),  # 1 MB to go: ends within overdue_min_s
        (2, 20, False),  # 5 MB/s: 16 s to go; r 40 s (slower)
        (10, 12, False),  # 3 MB/s: 29.3 s to go; r 8.8 s, within 4x
        (10, 8, True),  # 2 MB/s: 46 s to go; r 9.2 s, 5x
    ],
)
def test_overdue_judges_the_projection_against_the_best_other_source(
    relay_mb_s: int, received_mb: int, handed_back: bool
) -> None:
    """After 4 s of a 100 MB transfer, the rest's projected time at its own throughput
    against the relay's expected time for the rest (overdue_factor 4, overdue_min_s 4 s)."""
    sched, req = _overdue_world()
    state(sched, "r").rate_bps = relay_mb_s * MB
    sched.on_progress(req.id, received_mb * MB)
    assert (sched.overdue(5.0) == [req.id]) == handed_back


def test_no_transfer_is_handed_back_without_a_ready_source_that_holds_the_rest() -> None:
    sched, req = _overdue_world()
    sched.on_progress(req.id, 4 * MB)
    state(sched, "r").not_before[req.shard] = 100.0  # r will not serve this shard for now
    assert sched.overdue(5.0) == []
    state(sched, "r").not_before[req.shard] = 0.0
    state(sched, "r").blocked_until = 100.0  # r failed: blocked
    assert sched.overdue(5.0) == []
    state(sched, "r").blocked_until = 0.0
    assert sched.overdue(5.0) == [req.id]


def test_overdue_off_with_an_infinite_factor_and_never_for_unmeasured_progress() -> None:
    sched, req = _overdue_world(factor=math.inf)
    sched.on_progress(req.id, 1 * MB)
    assert sched.overdue(50.0) == []
    sched, req = _overdue_world()
    assert sched.overdue(50.0) == []  # no bytes reported: the stall timeout's business


def test_several_slow_transfers_are_not_all_handed_to_one_source() -> None:
    """Two 100 MB transfers crawl from peers; the one relay with room could take the rest of
    one of them in ~1 s, but of both only in ~2 s: each is projected to take 196 s, so with
    factor 150 the first is handed back (196 > 150 x 0.98) and the second is not
    (196 < 150 x 1.96)."""
    sched = Scheduler([100 * MB] * 3, random.Random(0), _overdue_config(150.0, 3, 2))
    sched.add_source("r")
    warm = sched.next_request(0.0)
    assert warm is not None
    sched.on_first_byte(warm.id, 0.0)
    sched.on_success(warm.id, 1.0)
    for name in ("p", "q"):
        sched.add_source(name, have=[0, 1, 2])
    state(sched, "r").not_before.update({0: 2.0, 1: 2.0, 2: 2.0})
    reqs = drain(sched, 1.0)
    assert sorted(r.source for r in reqs) == ["p", "q"]
    for r in reqs:
        sched.on_first_byte(r.id, 1.0)
        sched.on_progress(r.id, 2 * MB)  # 0.5 MB/s: 196 s to go
    assert len(sched.overdue(5.0)) == 1


def test_penalty_doubles_per_consecutive_failure_and_resets_on_success() -> None:
    cfg = SchedulerConfig(penalty_s=1.0)
    sched = Scheduler([100] * 10, random.Random(0), cfg)
    sched.add_source("a")
    now = 0.0
    for expected_block in (1.0, 2.0, 4.0, 8.0):
        req = sched.next_request(now)
        assert req is not None
        sched.on_failure(req.id, now, kind=FailureKind.TIMEOUT)
        assert sched.next_request(now + expected_block - 1e-6) is None
        now += expected_block
    req = sched.next_request(now)
    assert req is not None
    sched.on_success(req.id, now + 1.0)
    assert state(sched, "a").consecutive_failures == 0
    req = sched.next_request(now + 1.0)
    assert req is not None
    sched.on_failure(req.id, now + 1.0, kind=FailureKind.BROKEN)
    assert state(sched, "a").blocked_until == now + 1.0 + 1.0  # back to one penalty_s


def test_penalty_is_capped_at_32_times() -> None:
    sched = Scheduler([100], random.Random(0), SchedulerConfig(penalty_s=1.0))
    sched.add_source("a")
    now = 0.0
    for _ in range(8):
        now = max(now, state(sched, "a").blocked_until)
        req = sched.next_request(now)
        assert req is not None
        sched.on_failure(req.id, now, kind=FailureKind.TIMEOUT)
    assert state(sched, "a").blocked_until == now + 32.0


def test_requests_in_flight_when_a_source_failed_share_that_failure() -> None:
    """A dropped connection fails every request in flight to the source at once: that is one
    outage, blocked for one penalty_s, not doubled per request (4 in flight would block 8 s)."""
    cfg = SchedulerConfig(penalty_s=1.0, per_source_inflight=4, max_inflight=8)
    sched = Scheduler([100] * 10, random.Random(0), cfg)
    sched.add_source("a")
    reqs = drain(sched, 0.0)
    assert len(reqs) == 4
    for k, req in enumerate(reqs):
        sched.on_failure(req.id, 0.5 + k * 0.01, kind=FailureKind.BROKEN)
    a = state(sched, "a")
    assert a.consecutive_failures == 1
    assert a.failures == 4
    assert a.blocked_until == 1.5
    assert sched.next_request(1.5 - 1e-6) is None
    # a request started after that failure that fails again is a new failure: it doubles
    again = sched.next_request(1.5)
    assert again is not None
    sched.on_failure(again.id, 2.0, kind=FailureKind.TIMEOUT)
    assert state(sched, "a").blocked_until == 2.0 + 2.0


def test_a_source_back_after_an_outage_is_asked_at_once() -> None:
    sched = Scheduler([100] * 10, random.Random(0), SchedulerConfig(penalty_s=1.0))
    sched.add_source("a")
    now = 0.0
    for _ in range(6):  # a long outage: the block grew to 32 s
        now = max(now, state(sched, "a").blocked_until)
        req = sched.next_request(now)
        assert req is not None
        sched.on_failure(req.id, now, kind=FailureKind.BROKEN)
    assert state(sched, "a").blocked_until == now + 32.0
    assert sched.next_request(now + 1.0) is None
    sched.source_back("a", now + 1.0)
    req = sched.next_request(now + 1.0)
    assert req is not None
    assert req.source == "a"
    sched.on_failure(
        req.id, now + 1.5, kind=FailureKind.BROKEN
    )  # a new failure starts from penalty_s
    assert state(sched, "a").blocked_until == now + 2.5
    sched.source_back("unknown", now)  # a source the scheduler never heard of: ignored


def test_unavailable_blocks_only_briefly_and_does_not_count_as_a_fault() -> None:
    cfg = SchedulerConfig(penalty_s=4.0)
    sched = Scheduler([100], random.Random(0), cfg)
    sched.add_source("a")
    rate = state(sched, "a").rate_bps
    req = sched.next_request(0.0)
    assert req is not None
    sched.on_failure(req.id, 0.0, kind=FailureKind.UNAVAILABLE)
    a = state(sched, "a")
    assert (a.rate_bps, a.consecutive_failures, a.corrupt, a.banned) == (rate, 0, 0, False)
    assert sched.next_request(0.399) is None  # only this shard, only for penalty_s / 10
    again = sched.next_request(0.4)
    assert again is not None
    assert again.source == "a"


def test_unavailable_removes_the_shard_from_a_partial_sources_have_set() -> None:
    cfg = SchedulerConfig(explore=0.0, endgame_duplicates=0)
    sched = Scheduler([100, 100], random.Random(0), cfg)
    sched.add_source("a", have={0, 1})
    sched.add_source("b")
    reqs = {r.source: r for r in drain(sched, 0.0)}
    shard_a = reqs["a"].shard
    sched.on_failure(reqs["a"].id, 0.0, kind=FailureKind.UNAVAILABLE)
    assert shard_a not in (state(sched, "a").have or set())


def test_corrupt_bans_after_max_corrupt_and_drops_partial_bytes() -> None:
    cfg = SchedulerConfig(max_corrupt=2, penalty_s=1.0, explore=0.0)
    sched = Scheduler([100] * 5, random.Random(0), cfg)
    sched.add_source("a")
    r1 = sched.next_request(0.0)
    assert r1 is not None
    sched.on_failure(r1.id, 0.0, kind=FailureKind.BROKEN, received=30)
    assert sched.resume_offset(r1.shard) == 30
    r2 = sched.next_request(1.0)
    assert r2 is not None
    assert r2.start == 30
    sched.on_failure(r2.id, 1.0, kind=FailureKind.CORRUPT)
    assert sched.resume_offset(r1.shard) == 0  # the kept prefix can no longer be trusted
    assert not state(sched, "a").banned
    assert sched.next_request(1.0 + 4.0 - 1e-6) is None  # corrupt: 4 x penalty_s
    r3 = sched.next_request(5.0)
    assert r3 is not None
    sched.on_failure(r3.id, 5.0, kind=FailureKind.CORRUPT)
    assert state(sched, "a").banned
    assert sched.statistics().banned == ("a",)
    assert sched.statistics().corrupt == 2
    assert sched.next_request(1e9) is None  # banned forever


def test_suspect_penalizes_nobody() -> None:
    cfg = SchedulerConfig(explore=0.0, penalty_s=1.0)
    sched = Scheduler([100], random.Random(0), cfg)
    sched.add_source("a")
    sched.add_source("b")
    r1 = sched.next_request(0.0)
    assert r1 is not None
    sched.on_failure(r1.id, 0.0, kind=FailureKind.BROKEN, received=50)
    r2 = sched.next_request(0.0)
    assert r2 is not None
    assert (r2.source, r2.start) == ("b", 50)
    b_rate = state(sched, "b").rate_bps
    sched.on_failure(r2.id, 0.0, kind=FailureKind.SUSPECT)  # the copy of a + b failed its digest
    b = state(sched, "b")
    assert (b.rate_bps, b.blocked_until, b.corrupt, b.consecutive_failures) == (b_rate, 0, 0, 0)
    assert sched.resume_offset(0) == 0  # the assembled bytes are dropped
    r3 = sched.next_request(0.0)
    assert r3 is not None
    assert (r3.source, r3.start) == ("b", 0)  # "b" is still eligible at once
    sched.penalize_corrupt("b", 0.0)  # blame() named it later
    assert state(sched, "b").corrupt == 1


# --- endgame ---------------------------------------------------------------------------------


def test_no_endgame_while_a_shard_waits_for_its_manifest_part() -> None:
    cfg = SchedulerConfig(max_inflight=20, per_source_inflight=4, explore=0.0)
    sched = Scheduler([100, 100, 100], random.Random(0), cfg, known=[0])
    for name in "abc":
        sched.add_source(name)
    first = drain(sched, 0.0)
    assert [r.shard for r in first] == [0]  # no duplicate of 0: shards 1, 2 are unknown
    assert " unknown=2 " in sched.explain(0.0)
    sched.mark_known(1)
    assert [r.shard for r in drain(sched, 0.0)] == [1]  # still no endgame: 2 is unknown
    sched.on_success(first[0].id, 1.0)  # shard 0 done while 2 is still unknown
    sched.mark_known(2)
    sched.mark_known(2)  # a part that arrives twice changes nothing
    assert " unknown=0 " in sched.explain(1.0)
    later = drain(sched, 1.0)
    assert later[0].shard == 2
    assert not later[0].duplicate
    assert any(r.duplicate for r in later[1:])  # every shard known: the endgame starts


def test_endgame_duplicates_are_bounded_and_losers_are_returned() -> None:
    cfg = SchedulerConfig(
        max_inflight=20,
        per_source_inflight=4,
        explore=0.0,
        endgame_duplicates=2,
        endgame_max_total=3,
    )
    sched = Scheduler([100, 100], random.Random(0), cfg)
    for name in "abcde":
        sched.add_source(name)
    reqs = drain(sched, 0.0)
    primaries = [r for r in reqs if not r.duplicate]
    dups = [r for r in reqs if r.duplicate]
    assert sorted(r.shard for r in primaries) == [0, 1]
    assert len(dups) == 3  # endgame_max_total
    assert max(Counter(r.shard for r in dups).values()) <= 2  # endgame_duplicates per shard
    for d in dups:
        assert d.start == 0
        assert d.length == 100
        assert d.source not in {r.source for r in reqs if r.shard == d.shard and r is not d}
    assert sched.statistics().duplicates == 3

    winner = next(r for r in dups if r.shard == 0)
    losers = sched.on_success(winner.id, 1.0)
    assert sorted(losers) == sorted(r.id for r in reqs if r.shard == 0 and r is not winner)
    assert sched.is_done(0)
    for lid in losers:
        sched.on_cancelled(lid)
    # the freed duplicate budget goes to shard 1, up to its two duplicates
    more = drain(sched, 1.0)
    assert all(r.shard == 1 and r.duplicate for r in more)
    assert sum(1 for r in [*dups, *more] if r.shard == 1) == 2
    assert sched.inflight() == 3


def test_no_endgame_while_a_missing_shard_is_idle() -> None:
    cfg = SchedulerConfig(max_inflight=20, per_source_inflight=1, explore=0.0)
    sched = Scheduler([100, 100, 100], random.Random(0), cfg)
    sched.add_source("a")
    sched.add_source("b")
    reqs = drain(sched, 0.0)  # the third shard waits for a free source: no duplicates yet
    assert len(reqs) == 2
    assert not any(r.duplicate for r in reqs)


def test_endgame_disabled() -> None:
    cfg = SchedulerConfig(max_inflight=20, explore=0.0, endgame_duplicates=0)
    sched = Scheduler([100, 100], random.Random(0), cfg)
    for name in "abc":
        sched.add_source(name)
    reqs = drain(sched, 0.0)
    assert len(reqs) == 2
    assert not any(r.duplicate for r in reqs)


# --- blame -----------------------------------------------------------------------------------


def test_blame_names_only_the_sources_whose_bytes_differ() -> None:
    good = bytes(range(100))
    parts = [("a", 0, 50), ("b", 50, 100)]
    second_bad = bytearray(good)
    second_bad[70] ^= 0xFF
    assert blame(parts, second_bad, good) == {"b"}
    first_bad = bytearray(good)
    first_bad[0] ^= 1
    assert blame(parts, memoryview(first_bad), good) == {"a"}
    both = bytearray(first_bad)
    both[99] ^= 1
    assert blame(parts, both, good) == {"a", "b"}
    assert blame(parts, good, good) == set()
    with pytest.raises(LocalProtocolError):
        blame(parts, good[:-1], good)


# --- invariants under random events ---------------------------------------------------------

# every kind but OVERDUE, which only follows Scheduler.overdue (the "progress" event)
KINDS = tuple(k for k in FailureKind if k is not FailureKind.OVERDUE)


@dataclass(frozen=True)
class _Op:
    """One driver event: ``next`` drains requests; the others act on an in-flight request."""

    what: str
    pick: int = 0  # which in-flight request (modulo their number)
    dt: float = 0.0  # time advanced before the event, seconds
    kind: FailureKind = FailureKind.BROKEN
    frac: float = 0.0  # fraction of the request received before a timeout/broken failure


_next = st.builds(_Op, st.just("next"), dt=st.floats(0, 10))
_ops = st.one_of(
    _next,
    _next,  # twice: requests must be issued before anything can happen to them
    st.builds(_Op, st.just("first_byte"), st.integers(0, 50)),
    st.builds(_Op, st.just("success"), st.integers(0, 50), st.floats(0, 3)),
    st.builds(
        _Op,
        st.just("failure"),
        st.integers(0, 50),
        st.floats(0, 3),
        st.sampled_from(KINDS),
        st.floats(0, 1),
    ),
    st.builds(_Op, st.just("cancel"), st.integers(0, 50)),
    # bytes of one request arrive (frac of it), then the driver hands back what is overdue
    st.builds(_Op, st.just("progress"), st.integers(0, 50), st.floats(0, 10), frac=st.floats(0, 1)),
)


@dataclass(frozen=True)
class _World:
    lengths: list[int]
    have: dict[str, frozenset[int] | None]
    initially_done: frozenset[int]
    config: SchedulerConfig
    measured: frozenset[str] = frozenset()  # sources whose rate a transfer already measured


@st.composite
def _worlds(draw: st.DrawFn) -> _World:
    n = draw(st.integers(1, 6))
    lengths = draw(st.lists(st.integers(1, 1000), min_size=n, max_size=n))
    have: dict[str, frozenset[int] | None] = {}
    for name in ("a", "b", "c", "d")[: draw(st.integers(1, 4))]:
        full = draw(st.booleans())
        have[name] = None if full else frozenset(draw(st.sets(st.integers(0, n - 1))))
    config = SchedulerConfig(
        max_inflight=draw(st.integers(1, 6)),
        per_source_inflight=draw(st.integers(1, 3)),
        explore=draw(st.sampled_from([0.0, 0.3, 1.0])),
        penalty_s=1.0,
        max_corrupt=draw(st.integers(1, 3)),
        endgame_duplicates=draw(st.integers(0, 2)),
        endgame_max_total=draw(st.integers(0, 3)),
        overdue_factor=draw(st.sampled_from([1.5, 4.0, math.inf])),
        overdue_min_s=draw(st.sampled_from([0.0, 1.0, 4.0])),
    )
    done = frozenset(draw(st.sets(st.integers(0, n - 1), max_size=n - 1)))
    measured = frozenset(draw(st.sets(st.sampled_from(sorted(have)))))
    return _World(lengths, have, done, config, measured)


def _check_invariants(
    sched: Scheduler, world: _World, flights: dict[int, Request], verified: set[int]
) -> None:
    assert sched.inflight() == len(flights)
    for src in sched.sources():
        mine = [r for r in flights.values() if r.source == src.source]
        assert src.inflight == len(mine) >= 0
        assert src.queued_bytes == sum(r.length for r in mine) >= 0
    not_done = [i for i in range(len(world.lengths)) if i not in verified]
    assert sched.missing == len(not_done)
    assert sched.done() == (not not_done)
    assert all(sched.is_done(i) == (i in verified) for i in range(len(world.lengths)))
    for i in not_done:
        assert 0 <= sched.resume_offset(i) < world.lengths[i]
    # white-box: the index of resumable shards matches the per-shard offsets
    assert sched._partial == {i for i in range(len(world.lengths)) if sched.resume_offset(i)}
    _check_rarity(sched, len(world.lengths))
    cfg = world.config
    per_shard = Counter(r.shard for r in flights.values())
    assert all(n <= 1 + cfg.endgame_duplicates for n in per_shard.values())
    assert sum(r.duplicate for r in flights.values()) <= cfg.endgame_max_total


def _check_rarity(sched: Scheduler, n_shards: int) -> None:
    """White-box: each shard's rarity count is the number of non-banned partial sources that
    hold it whole or a prefix of it."""
    for i in range(n_shards):
        holders = sum(
            1
            for src in sched.sources()
            if src.have is not None and not src.banned and (i in src.have or i in src.prefix)
        )
        assert sched._held[i] == holders, i


_SOURCE_OPS = st.lists(
    st.tuples(
        st.sampled_from(["add_have", "prefixes", "complete", "remove", "ban", "re_add"]),
        st.sampled_from("pqrs"),
        st.sets(st.integers(0, 5), max_size=4),
        st.integers(1, 99),
    ),
    max_size=30,
)


@settings(max_examples=300, deadline=None, derandomize=True, database=None)
@given(ops=_SOURCE_OPS)
def test_rarity_counts_follow_what_sources_hold(
    ops: list[tuple[str, str, set[int], int]],
) -> None:
    """Sources gain shards and prefixes, complete, leave, are banned and come back in any
    order: the rarity counts stay the number of holders (prefixes once counted their bytes)."""
    sched = Scheduler([100] * 6, random.Random(0), SchedulerConfig(explore=0.0))
    for name in "pqrs":
        sched.add_source(name, have=())
    for what, name, shards, nbytes in ops:
        if what == "add_have":
            sched.add_have(name, shards)
        elif what == "prefixes":
            sched.set_prefixes(name, dict.fromkeys(shards, nbytes))
        elif what == "complete":
            sched.add_source(name)
        elif what == "remove":
            sched.remove_source(name)
        elif what == "ban":
            sched.ban(name)
        else:
            sched.add_source(name, have=shards)
        _check_rarity(sched, 6)


@settings(max_examples=250, deadline=None, derandomize=True, database=None)
@given(world=_worlds(), seed=st.integers(0, 2**32 - 1), ops=st.lists(_ops, min_size=5, max_size=60))
def test_random_event_sequences_keep_the_invariants(
    world: _World, seed: int, ops: list[_Op]
) -> None:
    sched = Scheduler(world.lengths, random.Random(seed), world.config, have=world.initially_done)
    for name, hv in world.have.items():
        sched.add_source(name, hv)
        if name in world.measured:  # white-box: as if a transfer from it had ended
            state(sched, name).samples = 1
    flights: dict[int, Request] = {}
    got: dict[int, int] = {}  # bytes reported with on_progress, per request
    verified = set(world.initially_done)
    now = 0.0
    _check_invariants(sched, world, flights, verified)
    for op in ops:
        pending = sorted(flights)
        now += op.dt
        if op.what == "next":
            banned = set(sched.statistics().banned)
            blocked = {s.source for s in sched.sources() if s.blocked_until > now}
            offsets = {i: sched.resume_offset(i) for i in range(len(world.lengths))}
            for req in drain(sched, now):
                assert req.shard not in verified  # never a request for a done shard
                assert req.source not in banned | blocked
                hv = world.have[req.source]
                assert hv is None or req.shard in hv
                assert req.start == (0 if req.duplicate else offsets[req.shard])
                assert req.length == world.lengths[req.shard] - req.start > 0
                if req.duplicate:  # only in the endgame: every missing shard in flight
                    assert all(
                        any(f.shard == i for f in flights.values())
                        for i in range(len(world.lengths))
                        if i not in verified
                    )
                    assert all(
                        f.source != req.source for f in flights.values() if f.shard == req.shard
                    )
                flights[req.id] = req
                assert (
                    sum(1 for f in flights.values() if f.source == req.source)
                    <= world.config.per_source_inflight
                )
                assert len(flights) <= world.config.max_inflight
        elif pending:
            req = flights[pending[op.pick % len(pending)]]
            if op.what == "first_byte":
                sched.on_first_byte(req.id, now)
            elif op.what == "success":
                del flights[req.id]
                losers = sched.on_success(req.id, now)
                verified.add(req.shard)
                assert sorted(losers) == sorted(
                    f.id for f in flights.values() if f.shard == req.shard
                )
            elif op.what == "failure":
                keeps = op.kind.resumable
                received = int(op.frac * (req.length - 1)) if keeps else 0
                del flights[req.id]
                sched.on_failure(req.id, now, kind=op.kind, received=received)
            elif op.what == "progress":
                sched.on_first_byte(req.id, now - op.dt)
                got[req.id] = max(got.get(req.id, 0), int(op.frac * (req.length - 1)))
                sched.on_progress(req.id, got[req.id])
                handed = sched.overdue(now)
                assert len(set(handed)) == len(handed)
                assert set(handed) <= set(flights)
                assert sched.overdue(now) == []  # each once
                for rid in handed:
                    cut = flights.pop(rid)
                    assert not cut.duplicate
                    assert got.get(rid, 0) > 0
                    sched.on_failure(rid, now, kind=FailureKind.OVERDUE, received=got[rid])
                    assert sched.resume_offset(cut.shard) == cut.start + got[rid]
            else:
                del flights[req.id]
                sched.on_cancelled(req.id)
        _check_invariants(sched, world, flights, verified)


def test_first_proven_corrupt_bans_and_returns_its_other_flights() -> None:
    sched = Scheduler([10] * 4, random.Random(0), SchedulerConfig(explore=0.0, max_corrupt=1))
    sched.add_source("bad")
    sched.add_source("good", rate_bps=1.0)  # slower: the bad one gets the first requests
    reqs = [sched.next_request(0.0) for _ in range(4)]
    to_bad = [r.id for r in reqs if r is not None and r.source == "bad"]
    assert len(to_bad) >= 2
    cancel = sched.on_failure(to_bad[0], 1.0, kind=FailureKind.CORRUPT)
    assert sched.is_banned("bad")
    assert sorted(cancel) == sorted(to_bad[1:])
    assert sched.statistics().banned == ("bad",)
    # a second call for the same source bans nothing new
    assert sched.penalize_corrupt("bad", 2.0) == []


def test_source_bans_last_their_time_and_are_bounded() -> None:
    from shardcast.core.blame import SourceBans

    bans = SourceBans(ban_s=60, max_sources=2)
    bans.ban("a", now=0.0)
    assert bans.is_banned("a", now=59.9)
    assert not bans.is_banned("a", now=60.0)
    bans.ban("a", now=0.0)
    bans.ban("b", now=10.0)
    bans.ban("c", now=20.0)  # over the bound: the ban ending first ("a") is dropped
    assert bans.banned(now=30.0) == ["b", "c"]
    off = SourceBans(ban_s=0)
    off.ban("a", now=0.0)
    assert off.banned(now=0.0) == []


def test_refused_keeps_the_shard_off_that_source_for_refused_s_and_keeps_its_have() -> None:
    cfg = SchedulerConfig(penalty_s=4.0, refused_s=1.0, explore=0.0, endgame_duplicates=0)
    sched = Scheduler([100], random.Random(0), cfg)
    sched.add_source("a")
    sched.add_source("p", have={0})
    req = sched.next_request(0.0)
    assert req is not None
    assert req.source == "a"  # complete and unmeasured peers lose ties
    sched.on_failure(
        req.id, 0.0, kind=FailureKind.REFUSED
    )  # a 429: a's super-seeding served others
    a = state(sched, "a")
    assert (a.consecutive_failures, a.corrupt, a.blocked_until) == (0, 0, 0.0)
    again = sched.next_request(0.0)  # at once, from the source that has it for us
    assert again is not None
    assert again.source == "p"
    sched.on_failure(again.id, 0.0, kind=FailureKind.REFUSED)
    assert state(sched, "p").have == {0}  # it holds the shard: still counted as a holder
    assert sched.next_request(0.999) is None  # not 0.4 s (503's penalty_s / 10) ...
    last = sched.next_request(1.0)  # ... but refused_s
    assert last is not None


def test_shards_that_failed_go_behind_the_untried_ones() -> None:
    """A source that stalls on some shards only (two request slots, both stalled) is asked
    for the shards nobody tried yet once its block ends, not for the same two again: with
    the failed shards first each time, a download with one such source never progressed."""
    cfg = SchedulerConfig(explore=0.0, max_inflight=2, per_source_inflight=2, penalty_s=1.0)
    sched = Scheduler([MB] * 4, random.Random(3), cfg)
    sched.add_source("a")
    first = [sched.next_request(0.0), sched.next_request(0.0)]
    assert all(r is not None for r in first)
    tried = {r.shard for r in first if r is not None}
    for r in first:
        assert r is not None
        sched.on_failure(r.id, 5.0, kind=FailureKind.TIMEOUT)
    assert sched.next_request(5.5) is None  # blocked for penalty_s
    again = [sched.next_request(6.0), sched.next_request(6.0)]
    assert {r.shard for r in again if r is not None} == set(range(4)) - tried


def test_explain_names_what_each_source_waits_for() -> None:
    cfg = SchedulerConfig(max_inflight=4, per_source_inflight=1, penalty_s=2.0)
    sched = Scheduler([100] * 6, random.Random(0), cfg)
    sched.add_source("relay-a")
    sched.add_source("relay-b")
    sched.add_source("peer-c", have=[0])
    first = drain(sched, 0.0)
    assert len(first) == 3  # one per source: relay-a, relay-b, peer-c (shard 0)
    failed = next(r for r in first if r.source == "relay-b")
    sched.on_failure(failed.id, 1.0, kind=FailureKind.TIMEOUT)  # blocked for 2 s
    peer = next(r for r in first if r.source == "peer-c")
    sched.on_first_byte(peer.id, 1.0)
    line = sched.explain(2.5)
    assert line.startswith("missing=6 idle=4 unknown=0 inflight=2/4 ")
    assert f"req={peer.shard}@peer-c+0:2.5s:bytes" in line
    assert "src=relay-a:have=all:inflight=1:full" in line
    assert "src=relay-b:have=all:inflight=0:blocked=0.5s" in line
    assert "src=peer-c:have=1+0p:inflight=1:full,lacks=4" in line
    assert "blocked" not in sched.explain(3.5).split("src=relay-b")[1].split(" ")[0]
