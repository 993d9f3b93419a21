"""Delta blobs fetched several per request: the scheduler's light slots
(``shardcast.core.select``), the pure grouping (``shardcast.core.batch``), and the lane's batch
route (``shardcast.wire.lane_urls``)."""

from __future__ import annotations

import random

import pytest

from p2p.errors import LocalProtocolError
from shardcast.core import (
    MAX_BATCH_BLOBS,
    BlobBatcher,
    Fetch,
    Offer,
    Outcome,
    Session,
    SessionConfig,
    Verdict,
    cut_between_blobs,
    first_byte_times,
)
from shardcast.core.batch import BATCH_BYTES, MAX_BATCH_BYTES
from shardcast.core.select import Scheduler, SchedulerConfig
from shardcast.wire import ROUTE, blobs_url, codecs, parse_shards

MiB = 1 << 20
DIGEST = "ab" * 32


def fetch(
    req: int,
    source: str = "A",
    encoding: str = codecs.SPARSE,
    size: int = 250_000,
    start: int = 0,
) -> Fetch:
    return Fetch(req, req, source, encoding, start, size - start, size, duplicate=False)


# --- the scheduler: light requests share a slot ------------------------------------------------


def _drain(sched: Scheduler) -> list[int]:
    out = []
    while (r := sched.next_request(0.0)) is not None:
        out.append(r.shard)
    return out


def test_light_blobs_share_a_request_slot_and_heavy_shards_do_not() -> None:
    cfg = SchedulerConfig(max_inflight=4, per_source_inflight=2, light_slot_bytes=4 * MiB)
    sched = Scheduler([16 * MiB] * 100, random.Random(1), cfg, known=[])
    sched.add_source("A")
    for i in range(50):
        sched.mark_known(i, MiB // 4, light=True)  # 256 KiB blobs: 16 to a slot
    assert len(_drain(sched)) == 32  # two slots of source A
    heavy = Scheduler([16 * MiB] * 100, random.Random(1), cfg, known=[])
    heavy.add_source("A")
    for i in range(50):
        heavy.mark_known(i, MiB // 4)  # not light: one slot each
    assert len(_drain(heavy)) == 2


def test_a_light_request_never_takes_more_than_one_slot() -> None:
    cfg = SchedulerConfig(max_inflight=4, per_source_inflight=2, light_slot_bytes=MiB)
    sched = Scheduler([16 * MiB] * 10, random.Random(1), cfg, known=[])
    sched.add_source("A")
    for i in range(10):
        sched.mark_known(i, 8 * MiB, light=True)  # larger than a slot: one slot, not eight
    assert len(_drain(sched)) == 2


def test_finished_light_requests_free_their_share() -> None:
    cfg = SchedulerConfig(max_inflight=4, per_source_inflight=1, light_slot_bytes=MiB)
    sched = Scheduler([16 * MiB] * 20, random.Random(1), cfg, known=[])
    sched.add_source("A")
    for i in range(20):
        sched.mark_known(i, MiB // 2, light=True)
    first = []
    while (r := sched.next_request(0.0)) is not None:
        first.append(r)
    assert len(first) == 2
    sched.on_first_byte(first[0].id, 0.0)
    sched.on_success(first[0].id, 0.1)
    assert len(_drain(sched)) == 1  # exactly the freed half slot
    assert next(s for s in sched.sources() if s.source == "A").load == MiB


def test_light_slot_bytes_must_be_positive() -> None:
    with pytest.raises(LocalProtocolError, match="light_slot_bytes"):
        SchedulerConfig(light_slot_bytes=0)


def test_a_session_hands_out_many_delta_blobs_per_source_in_one_poll() -> None:
    offers = [Offer(i, 16 * MiB, {codecs.SPARSE: 250_000}) for i in range(40)]
    s = Session(
        1, [16 * MiB] * 40, 1, [0], offers, [], random.Random(1), SessionConfig(use_base=True), 0
    )
    s.add_source("A", True, 0.0)
    fetches = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
    assert len(fetches) > 16
    assert {f.encoding for f in fetches} == {codecs.SPARSE}
    raw = Session(1, [16 * MiB] * 40, 1, [0], offers, [], random.Random(1), SessionConfig(), 0)
    raw.add_source("A", True, 0.0)
    assert len([a for a in raw.poll(0.0) if isinstance(a, Fetch)]) == 2  # raw: one slot each


# --- grouping ----------------------------------------------------------------------------------


def test_whole_blobs_of_one_source_and_encoding_go_together_in_order() -> None:
    b = BlobBatcher()
    fs = [fetch(0, "A"), fetch(1, "B"), fetch(2, "A"), fetch(3, "A", codecs.XOR_ZSTD)]
    groups = b.plan(fs)
    assert sorted(groups, key=lambda g: g[0].req) == [
        (fs[0], fs[2]),
        (fs[1],),
        (fs[3],),
    ]


def test_raw_resumed_and_anonymous_fetches_go_alone() -> None:
    b = BlobBatcher()
    raw = fetch(0, encoding=codecs.RAW)
    resumed = fetch(1, start=1000)
    mirror = fetch(2, source="http://mirror")
    ok1, ok2 = fetch(3), fetch(4)
    groups = b.plan([raw, resumed, mirror, ok1, ok2], anonymous=frozenset({"http://mirror"}))
    assert (ok1, ok2) in groups
    for alone in (raw, resumed, mirror):
        assert (alone,) in groups
    assert not b.batchable(mirror, anonymous=True)


def test_a_source_without_the_route_is_asked_one_blob_at_a_time() -> None:
    b = BlobBatcher()
    b.unsupported("A")
    assert not b.batches_with("A")
    assert b.batches_with("B")
    groups = b.plan([fetch(0), fetch(1), fetch(2, "B"), fetch(3, "B")])
    assert sorted(len(g) for g in groups) == [1, 1, 2]


def test_batches_are_bounded_in_blobs_and_bytes() -> None:
    b = BlobBatcher(max_blobs=3, max_bytes=1000)
    groups = b.plan([fetch(i, size=300) for i in range(7)])
    assert [len(g) for g in groups] == [3, 3, 1]
    groups = b.plan([fetch(i, size=400) for i in range(5)])
    assert [len(g) for g in groups] == [2, 2, 1]
    assert BlobBatcher().plan([fetch(i, size=1000) for i in range(100)])[0] == tuple(
        fetch(i, size=1000) for i in range(MAX_BATCH_BLOBS)
    )
    with pytest.raises(ValueError, match="batch bounds"):
        BlobBatcher(max_blobs=MAX_BATCH_BLOBS + 1)


def test_a_batch_asks_for_a_mebibyte_by_default() -> None:
    """A batch is held at its source until every blob of it is there and handed out only
    whole, so it is the unit of forwarding through a relay: 250 KB blobs go four to a
    batch, not 32; the lane still accepts batches up to MAX_BATCH_BYTES."""
    assert BlobBatcher().max_bytes == BATCH_BYTES == 1 << 20 < MAX_BATCH_BYTES
    groups = BlobBatcher().plan([fetch(i, size=250_000) for i in range(32)])
    assert [len(g) for g in groups] == [4] * 8
    big = fetch(99, size=BATCH_BYTES + 1)  # a blob over the batch size is asked alone
    assert not BlobBatcher().batchable(big, anonymous=False)
    assert BlobBatcher(max_bytes=MAX_BATCH_BYTES).batchable(big, anonymous=False)


def test_every_fetch_is_in_exactly_one_group() -> None:
    rng = random.Random(7)
    b = BlobBatcher(max_blobs=5, max_bytes=2_000_000)
    fs = [
        fetch(
            i,
            rng.choice("ABC"),
            rng.choice([codecs.SPARSE, codecs.XOR_ZSTD, codecs.RAW]),
            rng.randrange(1, 900_000),
            rng.choice([0, 0, 0, 10]) if i % 3 else 0,
        )
        for i in range(200)
    ]
    groups = b.plan(fs)
    flat = [f for g in groups for f in g]
    assert sorted(f.req for f in flat) == list(range(200))
    for g in groups:
        assert len(g) <= 5
        assert len(g) == 1 or sum(f.size for f in g) <= 2_000_000
        assert len({(f.source, f.encoding) for f in g}) == 1


# --- the route ----------------------------------------------------------------------------------


def test_batch_url_parses_back_and_is_bounded() -> None:
    url = blobs_url("http://h:1", "run", 7, DIGEST, [5, 2, 9], codecs.SPARSE)
    path = url.removeprefix("http://h:1")
    m = ROUTE.match(path)
    assert m is not None
    assert (m["step"], m["digest"], m["benc"]) == ("7", DIGEST, codecs.SPARSE)
    assert parse_shards(m["shards"]) == [5, 2, 9]
    assert m["shard"] is None
    assert m["name"] is None
    with pytest.raises(ValueError, match="1-64 distinct"):
        blobs_url("http://h:1", "run", 7, DIGEST, [1, 1], codecs.SPARSE)
    with pytest.raises(ValueError, match="1-64 distinct"):
        blobs_url("http://h:1", "run", 7, DIGEST, list(range(65)), codecs.SPARSE)
    too_many = path.rsplit("/", 1)[0] + "/" + ",".join(str(i) for i in range(65))
    assert ROUTE.match(too_many) is None
    assert ROUTE.match(path.replace("sparse", "raw")) is None
    with pytest.raises(ValueError, match="twice"):
        parse_shards("3,4,3")


# --- measuring a batch -------------------------------------------------------------------------


def test_each_blob_of_a_batch_is_given_its_share_of_the_batch_time() -> None:
    sizes = [100, 300, 0, 600]
    firsts = first_byte_times(sizes, 10.0, 12.0)
    assert firsts == [pytest.approx(t) for t in (11.8, 11.4, 12.0, 10.8)]
    for n, t in zip(sizes, firsts, strict=True):
        if n:
            assert n / (12.0 - t) == pytest.approx(1000 / 2.0)  # the batch's bytes per second
    assert first_byte_times([0, 0], 1.0, 2.0) == [1.0, 1.0]
    with pytest.raises(LocalProtocolError, match="blob 0 has -1"):
        first_byte_times([-1], 0.0, 1.0)
    with pytest.raises(LocalProtocolError, match="before its request"):
        first_byte_times([1], 2.0, 1.0)


def test_a_body_is_cut_between_blobs_only_right_after_a_whole_blob_before_the_last() -> None:
    sizes = [100, 300, 50]
    assert [r for r in range(0, 451) if cut_between_blobs(r, sizes)] == [100, 400]
    assert not cut_between_blobs(450, sizes)  # the whole body: not a cut
    assert not cut_between_blobs(0, sizes)  # nothing arrived: the stream broke
    assert not cut_between_blobs(100, [100])  # a single blob is whole or broken
    assert not cut_between_blobs(0, [0, 5])  # an empty first blob: still nothing arrived


def _deliver_batches(s: Session, seconds_by_source: dict[str, float]) -> None:
    """One poll's fetches, each source's as one batch whose whole body took that many
    seconds from the request (reported as the driver reports a batch)."""
    fetches = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
    for source, seconds in seconds_by_source.items():
        mine = [f for f in fetches if f.source == source]
        assert mine
        firsts = first_byte_times((f.size for f in mine), 0.0, seconds)
        for f, first in zip(mine, firsts, strict=True):
            s.first_byte(f.req, seconds, measure_from=first)
            assert s.transfer_ended(f.req, Outcome.OK, f.size, seconds)
            s.shard_checked(f.req, Verdict.VERIFIED, seconds)


def test_a_batch_is_measured_at_its_throughput_so_a_slow_source_looks_slow() -> None:
    offers = [Offer(i, 16 * MiB, {codecs.SPARSE: 250_000}) for i in range(40)]
    s = Session(
        1, [16 * MiB] * 40, 1, [0], offers, [], random.Random(1), SessionConfig(use_base=True), 0
    )
    s.add_source("A", True, 0.0)
    s.add_source("B", True, 0.0)
    _deliver_batches(s, {"A": 0.1, "B": 2.0})
    rates = {st.source: st.rate_bps for st in s.sched.sources()}
    bytes_by = s.stats.bytes_by_source
    assert rates["A"] == pytest.approx(bytes_by["A"] / 0.1)
    assert rates["B"] == pytest.approx(bytes_by["B"] / 2.0)
    assert rates["A"] > 10 * rates["B"]
