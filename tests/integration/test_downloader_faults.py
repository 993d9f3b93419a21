"""The downloader against faulty sources, over real sockets on 127.0.0.1.

The honest source is the real :class:`~shardcast.serve.server.VersionServer`; the faulty ones are
scripted HTTP/1.1 servers from :mod:`tests.faults` (corrupt bytes, a connection closed
mid-shard, stalls, 503s, a file of another length). Source ids sort in the order the tests
expect the scheduler to break ties in (``a-…`` before ``b-…``), and exploration is off, so
every decision is reproducible.

Tests whose outcome depends on a timeout run on a MockClock whose autojump threshold is small
but non-zero: virtual time jumps only once every task, and the kernel's side of the sockets,
has gone quiet. Tests that must finish *before* a timeout could fire use the real clock.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import random
from pathlib import Path

import pytest
import trio
import trio.testing

from p2p.http_client import HttpClient
from shardcast.core.liveness import Abandon
from shardcast.core.select import SchedulerConfig
from shardcast.download.downloader import Downloader
from shardcast.download.types import DownloadConfig, DownloadFailed, Source
from shardcast.node.metrics import DownloadMetrics, NodeMetrics
from shardcast.store import PartialVersion, VersionStore
from tests.faults import (
    RUN,
    TRICKLE_S,
    Ask,
    Fault,
    Version,
    fault_source,
    honest_source,
    make_version,
)
from tests.helpers import trust

SHARD = 16 * 1024
FILE = "model.safetensors"


@pytest.fixture
def jump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.05)


@pytest.fixture
def version(tmp_path: Path) -> Version:
    """One file of four shards."""
    return make_version(tmp_path, {FILE: 4 * SHARD}, SHARD)


@pytest.fixture
def one_shard(tmp_path: Path) -> Version:
    """One file of one shard: every request is for the same bytes."""
    return make_version(tmp_path, {FILE: SHARD}, SHARD)


def config(
    *,
    stall_timeout_s: float = 30.0,
    deadline_s: float = 60.0,
    no_source_grace_s: float = 30.0,
    penalty_s: float = 30.0,
    endgame_duplicates: int = 0,
) -> DownloadConfig:
    """Explore off; endgame off unless asked; penalties long enough that a failed source is
    not retried while a test runs (on either clock) unless the test shortens them; every shard
    of the 4-shard version in flight at once from one source (the tests count asks)."""
    sched = SchedulerConfig(
        explore=0.0,
        penalty_s=penalty_s,
        endgame_duplicates=endgame_duplicates,
        max_inflight=8,
        per_source_inflight=4,
    )
    return DownloadConfig(
        stall_timeout_s=stall_timeout_s,
        deadline_s=deadline_s,
        no_source_grace_s=no_source_grace_s,
        scheduler=sched,
    )


def target_store(tmp_path: Path) -> VersionStore:
    return VersionStore(tmp_path / "downloader", RUN, keep_last=2)


def assert_committed(store: VersionStore, version: Version, path: Path) -> None:
    assert path == store.version_dir(version.step)
    assert store.committed_steps() == [version.step]
    for name, data in version.files.items():
        assert (path / name).read_bytes() == data
    assert not store.partial_dir(version.step).exists()


def assert_nothing_left(store: VersionStore) -> None:
    """No ``step-N/`` and no ``.partial-step-N/``: the run directory is empty."""
    assert sorted(p.name for p in store.run_dir.iterdir()) == []


# --- bad bytes ---------------------------------------------------------------------------------


@pytest.mark.parametrize("fault", [Fault.CORRUPT, Fault.SHORT_FILE])
async def test_source_of_bad_bytes_is_banned_and_the_honest_one_is_not(
    tmp_path: Path, version: Version, fault: Fault
) -> None:
    # SHORT_FILE: the source's copy is shorter than one shard, so every range it is asked for
    # is answered with the wrong length (206 for a shorter range, or 416).
    store = target_store(tmp_path)
    async with (
        fault_source(version, fault, short_by=4 * SHARD - SHARD // 2) as bad,
        honest_source(version) as (honest, _),
        HttpClient() as client,
    ):
        sources = [Source("a-bad", bad.url), Source("b-honest", honest.url)]
        dl = Downloader(client, store, config(), random.Random(1), trust())
        path, stats = await dl.download(version.signed, sources)
    assert_committed(store, version, path)
    # four shards, explore off: two go to each source at once; both of the bad source's
    # copies are refused and it is banned (max_corrupt=2), so it is never asked again
    assert len(bad.asks) == 2
    assert stats.corrupt_by_source == {"a-bad": 2}
    assert stats.bytes_by_source["b-honest"] == 4 * SHARD  # every verified byte


async def test_only_the_source_of_the_bad_half_is_blamed(
    tmp_path: Path, one_shard: Version
) -> None:
    """The shard is assembled from a truncating source (good first half) and a corrupting one
    (bad second half); it fails its digest, and once the honest copy arrives blame() names
    only the corrupting source."""

    def corrupt_mid_shard(ask: Ask) -> Fault:  # full-shard requests: "not yet"
        return Fault.CORRUPT if ask.offset % SHARD else Fault.UNAVAILABLE

    store = target_store(tmp_path)
    async with (
        fault_source(one_shard, Fault.TRUNCATE) as trunc,
        fault_source(one_shard, corrupt_mid_shard) as corrupt,
        honest_source(one_shard) as (honest, honest_asks),
        HttpClient() as client,
    ):
        sources = [
            Source("a-trunc", trunc.url),
            Source("b-corrupt", corrupt.url),
            Source("c-honest", honest.url),
        ]
        dl = Downloader(client, store, config(), random.Random(1), trust())
        path, stats = await dl.download(one_shard.signed, sources)
    assert_committed(store, one_shard, path)
    # a: first half, then cut; b: resumed the second half (corrupt) -> suspect copy, nobody
    # penalized; b again from 0: 503; c: the whole shard, verified -> blame -> b only
    assert [a.offset for a in trunc.asks] == [0]
    assert [a.offset for a in corrupt.asks] == [SHARD // 2, 0]
    assert honest_asks == [0]
    assert stats.corrupt_by_source == {"b-corrupt": 1}


# --- broken and stalled transfers ----------------------------------------------------------------


async def test_truncated_transfers_resume_at_the_kept_prefix(
    tmp_path: Path, version: Version
) -> None:
    store = target_store(tmp_path)
    async with (
        fault_source(version, Fault.TRUNCATE) as trunc,
        honest_source(version) as (honest, honest_asks),
        HttpClient() as client,
    ):
        sources = [Source("a-trunc", trunc.url), Source("b-honest", honest.url)]
        dl = Downloader(client, store, config(), random.Random(1), trust())
        path, stats = await dl.download(version.signed, sources)
        honest_sent = honest.statistics().bytes_sent
    assert_committed(store, version, path)
    assert len(trunc.asks) == 2  # two shards at once; then it is blocked
    assert stats.failures == 2
    # each cut shard was resumed by the honest source at the byte where the cut happened
    cut = sorted(a.offset + a.length // 2 for a in trunc.asks)
    assert sorted(o for o in honest_asks if o % SHARD) == cut
    # no byte was downloaded twice: the kept prefixes plus the honest bytes are the version
    assert trunc.body_bytes_sent + honest_sent == 4 * SHARD
    assert stats.bytes_by_source == {"b-honest": 4 * SHARD - trunc.body_bytes_sent}
    assert stats.corrupt_by_source == {}


@pytest.mark.parametrize("fault", [Fault.STALL_AFTER_HEADERS, Fault.STALL_BEFORE_ANSWER])
async def test_stalled_source_costs_one_stall_timeout(
    tmp_path: Path, version: Version, fault: Fault, jump_clock: trio.testing.MockClock
) -> None:
    store = target_store(tmp_path)
    async with (
        fault_source(version, fault) as stall,
        honest_source(version) as (honest, _),
        HttpClient() as client,
    ):
        sources = [Source("a-stall", stall.url), Source("b-honest", honest.url)]
        dl = Downloader(client, store, config(stall_timeout_s=0.5), random.Random(1), trust())
        start = trio.current_time()
        path, stats = await dl.download(version.signed, sources)
        elapsed = trio.current_time() - start
    assert_committed(store, version, path)
    assert 0.5 <= elapsed < 1.0  # the two stalled shards waited one stall timeout, together
    assert len(stall.asks) == 2
    assert stats.failures == 2
    assert stats.corrupt_by_source == {}
    assert stats.bytes_by_source == {"b-honest": 4 * SHARD}


async def test_a_transfer_that_crawls_is_cut_and_resumed_from_a_faster_source(
    tmp_path: Path, jump_clock: trio.testing.MockClock
) -> None:
    """Two shards, one request per source: the honest source sends its shard at once (it is
    measured), the other sends 1 KiB a second (a congested home uplink). Once that transfer
    has run ``overdue_min_s`` the downloader cuts it and takes the rest from the honest source,
    instead of waiting the 16 s the crawl would take. Nobody is blamed; the slow source is
    asked once; the node's metrics count the cut against the slow source's kind."""
    two = make_version(tmp_path, {FILE: 2 * SHARD}, SHARD)
    store = target_store(tmp_path)
    cfg = config()
    cfg = dataclasses.replace(
        cfg, scheduler=dataclasses.replace(cfg.scheduler, per_source_inflight=1)
    )
    async with (
        fault_source(two, Fault.TRICKLE) as slow,
        honest_source(two) as (honest, _),
        HttpClient() as client,
    ):
        sources = [Source("a-honest", honest.url), Source("b-slow", slow.url)]
        metrics = NodeMetrics("peer", RUN, "12D3KooWtest", process=False)
        kinds = {"a-honest": "relay", "b-slow": "peer"}
        observer = DownloadMetrics(metrics, kinds.__getitem__)
        dl = Downloader(client, store, cfg, random.Random(1), trust(), observer)
        start = trio.current_time()
        path, stats = await dl.download(two.signed, sources)
        elapsed = trio.current_time() - start
    assert_committed(store, two, path)
    assert len(slow.asks) == 1
    assert (stats.overdue, stats.failures, stats.corrupt_by_source) == (1, 0, {})
    assert stats.bytes_by_source["a-honest"] > SHARD  # its shard, and the rest of the other
    min_s = cfg.scheduler.overdue_min_s
    assert min_s <= elapsed < min_s + 2 * TRICKLE_S  # cut at once, not after 16 s
    cut = {
        k: metrics.registry.get_sample_value("shardnet_transfers_cut_total", {"source_kind": k})
        for k in ("peer", "relay")
    }
    assert cut == {"peer": 1, "relay": 0}


async def test_a_download_that_waits_logs_what_it_waits_for(
    tmp_path: Path,
    version: Version,
    jump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing arrives for 10 s (two shards held by a source that stalls, the honest source
    blocked): the download logs ``download_idle`` with the requests it waits on, once per 10 s."""
    caplog.set_level(logging.INFO, logger="shardcast.download.downloader")
    store = target_store(tmp_path)
    async with (
        fault_source(version, Fault.STALL_AFTER_HEADERS) as stall,
        honest_source(version) as (honest, _),
        HttpClient() as client,
    ):
        sources = [Source("a-stall", stall.url), Source("b-honest", honest.url)]
        dl = Downloader(client, store, config(stall_timeout_s=25.0), random.Random(1), trust())
        path, _stats = await dl.download(version.signed, sources)
    assert_committed(store, version, path)
    idle = [r.getMessage() for r in caplog.records if r.getMessage().startswith("download_idle")]
    assert len(idle) == 2  # at 10 s and 20 s of the 25 s stall
    for line in idle:
        assert "inflight=2/8" in line
        assert line.count("@a-stall+0:") == 2  # both stalled requests, no byte yet
        assert ":bytes" not in line


async def test_endgame_duplicates_beat_a_stalled_source(tmp_path: Path, version: Version) -> None:
    """Real clock: the version commits long before the stall timeout could fire."""
    store = target_store(tmp_path)
    async with (
        fault_source(version, Fault.STALL_AFTER_HEADERS) as stall,
        honest_source(version) as (honest, _),
        HttpClient() as client,
    ):
        sources = [Source("a-stall", stall.url), Source("b-honest", honest.url)]
        cfg = config(stall_timeout_s=2.0, endgame_duplicates=1)
        dl = Downloader(client, store, cfg, random.Random(1), trust())
        start = trio.current_time()
        path, stats = await dl.download(version.signed, sources)
        elapsed = trio.current_time() - start
    assert_committed(store, version, path)
    assert elapsed < 2.0
    assert stats.failures == 0  # the stalled transfers were cancelled, not failed
    assert stats.bytes_by_source == {"b-honest": 4 * SHARD}


@pytest.mark.parametrize(
    "fault", [Fault.UNAVAILABLE, Fault.STALL_BEFORE_ANSWER, Fault.STALL_AFTER_HEADERS]
)
async def test_prefix_survives_a_failed_resumption(
    tmp_path: Path, one_shard: Version, fault: Fault, jump_clock: trio.testing.MockClock
) -> None:
    """A cut transfer keeps its first half; the first resumption fails without a byte (503,
    stall); the next one, from the honest source, must still start from the kept half and
    must not blame the honest source for bytes it never sent."""
    store = target_store(tmp_path)
    async with (
        fault_source(one_shard, Fault.TRUNCATE) as trunc,
        fault_source(one_shard, fault) as flaky,
        honest_source(one_shard) as (honest, honest_asks),
        HttpClient() as client,
    ):
        sources = [
            Source("a-trunc", trunc.url),
            Source("b-flaky", flaky.url),
            Source("c-honest", honest.url),
        ]
        cfg = config(stall_timeout_s=0.5, deadline_s=10.0)
        dl = Downloader(client, store, cfg, random.Random(1), trust())
        path, stats = await dl.download(one_shard.signed, sources)
    assert_committed(store, one_shard, path)
    assert [a.offset for a in trunc.asks] == [0]
    assert [a.offset for a in flaky.asks][:1] == [SHARD // 2]
    assert honest_asks[:1] == [SHARD // 2]
    assert stats.corrupt_by_source == {}
    assert stats.bytes_by_source == {"c-honest": SHARD // 2}


# --- giving up -----------------------------------------------------------------------------------


async def test_every_source_banned_fails_within_the_grace_period(
    tmp_path: Path, version: Version, jump_clock: trio.testing.MockClock
) -> None:
    store = target_store(tmp_path)
    async with (
        fault_source(version, Fault.CORRUPT) as corrupt,
        fault_source(version, Fault.SHORT_FILE, short_by=4 * SHARD - 1) as short,
        HttpClient() as client,
    ):
        sources = [Source("a-corrupt", corrupt.url), Source("b-short", short.url)]
        cfg = config(no_source_grace_s=1.0, penalty_s=1.0)
        dl = Downloader(client, store, cfg, random.Random(1), trust())
        start = trio.current_time()
        with pytest.raises(DownloadFailed, match="no usable source") as info:
            await dl.download(version.signed, sources)
        elapsed = trio.current_time() - start
    assert "banned: a-corrupt, b-short" in str(info.value)
    assert 1.0 < elapsed <= 1.0 + 1.0 / 4 + 0.01  # one grace period, polled every penalty/4
    assert min(len(corrupt.asks), len(short.asks)) >= 2  # max_corrupt
    assert_nothing_left(store)


async def test_sources_that_never_deliver_fail_at_the_deadline(
    tmp_path: Path, version: Version, jump_clock: trio.testing.MockClock
) -> None:
    """Cut, 503 and stalling sources are retried (they are never banned) until deadline_s."""
    store = target_store(tmp_path)
    async with (
        fault_source(version, Fault.TRUNCATE) as trunc,
        fault_source(version, Fault.UNAVAILABLE) as unavailable,
        fault_source(version, Fault.STALL_AFTER_HEADERS) as stall,
        HttpClient() as client,
    ):
        sources = [
            Source("a-trunc", trunc.url),
            Source("b-unavailable", unavailable.url),
            Source("c-stall", stall.url),
        ]
        cfg = config(stall_timeout_s=0.5, deadline_s=3.0, no_source_grace_s=1.0, penalty_s=1.0)
        dl = Downloader(client, store, cfg, random.Random(1), trust())
        start = trio.current_time()
        with pytest.raises(DownloadFailed, match=r"not complete after 3\.0s"):
            await dl.download(version.signed, sources)
        elapsed = trio.current_time() - start
    assert 3.0 <= elapsed < 3.1
    assert min(len(trunc.asks), len(unavailable.asks), len(stall.asks)) >= 2  # all retried
    assert_nothing_left(store)


# --- cancellation ------------------------------------------------------------------------------


async def test_cancel_after_the_first_verified_shard_leaves_nothing(
    tmp_path: Path, version: Version
) -> None:
    def first_shard_only(ask: Ask) -> Fault:
        return Fault.HONEST if ask.offset == 0 else Fault.STALL_AFTER_HEADERS

    store = target_store(tmp_path)
    seen: list[tuple[int, bool]] = []
    partial_dirs: list[Path] = []

    def on_partial(part: PartialVersion) -> None:
        partial_dirs.append(part.dir)

    async with fault_source(version, first_shard_only) as src, HttpClient() as client:
        dl = Downloader(client, store, config(), random.Random(1), trust())
        with trio.CancelScope() as scope:

            def on_shard(index: int) -> None:
                seen.append((index, partial_dirs[0].is_dir()))
                scope.cancel()  # three transfers are still stalled

            await dl.download(
                version.signed, [Source("a", src.url)], on_partial=on_partial, on_shard=on_shard
            )
    assert scope.cancelled_caught
    assert seen == [(0, True)]  # a partial directory existed, with shard 0 in it
    assert len(src.asks) == 4
    assert_nothing_left(store)


async def test_cancel_while_every_transfer_is_stalled_leaves_nothing(
    tmp_path: Path, version: Version, jump_clock: trio.testing.MockClock
) -> None:
    store = target_store(tmp_path)
    async with (
        fault_source(version, Fault.STALL_AFTER_HEADERS) as src,
        HttpClient() as client,
    ):
        dl = Downloader(client, store, config(), random.Random(1), trust())
        with trio.move_on_after(1.0) as scope:
            await dl.download(version.signed, [Source("a", src.url)])
    assert scope.cancelled_caught
    assert len(src.asks) == 4
    assert_nothing_left(store)


# --- discovered sources --------------------------------------------------------------------------


async def test_discovered_sources_are_bounded(
    tmp_path: Path, version: Version, caplog: pytest.LogCaptureFixture
) -> None:
    """However many nodes discovery returns, at most ``max_extra_sources`` join one download
    (each would cost a source slot and, for partial ones, a have-poll every 250 ms)."""
    store = target_store(tmp_path)
    async with honest_source(version) as (honest, _), HttpClient() as client:
        many = [Source(f"x-{k:02d}", honest.url) for k in range(12)]
        dl = Downloader(client, store, config(), random.Random(1), trust())
        with caplog.at_level("INFO", logger="shardcast.download.downloader"):
            path, _stats = await dl.download(
                version.signed,
                [Source("a-upstream", honest.url)],
                extra_sources=lambda: many,
                max_extra_sources=3,
            )
    assert_committed(store, version, path)
    added = [r.getMessage() for r in caplog.records if "source_added" in r.getMessage()]
    assert len(added) == 3


@pytest.mark.parametrize("woken", [True, False], ids=["sources_changed", "tick_only"])
async def test_discovery_runs_when_the_node_hears_of_a_source(
    tmp_path: Path, version: Version, jump_clock: trio.testing.MockClock, woken: bool
) -> None:
    """A source the node hears of while a download runs joins it as soon as the node says
    so (``sources_changed``), not at the next ``have_poll_s`` tick (5 s here); without the
    hook it waits for the tick. The upstream answers 503 to everything, so the download
    needs the discovered source."""
    store = target_store(tmp_path)
    heard, news = trio.Event(), trio.Event()
    HEARD_AT_S = 1.0
    joined_at: list[float] = []
    async with (
        fault_source(version, Fault.UNAVAILABLE) as upstream,
        honest_source(version) as (honest, _),
        HttpClient() as client,
    ):
        found = Source("b-found", honest.url)

        def extra() -> list[Source]:
            if not heard.is_set():
                return []
            joined_at.append(trio.current_time())
            return [found]

        async def hear_later() -> None:
            await trio.sleep(HEARD_AT_S)
            heard.set()
            news.set()

        cfg = dataclasses.replace(config(), have_poll_s=5.0)
        dl = Downloader(client, store, cfg, random.Random(1), trust())
        t0 = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(hear_later)
            path, stats = await dl.download(
                version.signed,
                [Source("a-upstream", upstream.url)],
                extra_sources=extra,
                sources_changed=news.wait if woken else None,
            )
    assert_committed(store, version, path)
    assert stats.bytes_by_source == {"b-found": 4 * SHARD}
    waited = joined_at[0] - t0 - HEARD_AT_S
    if woken:
        assert waited < 0.5
    else:
        assert waited >= 3.9  # the tick: 5 s after the start


async def test_ban_for_corrupt_bytes_carries_to_the_next_version(tmp_path: Path) -> None:
    v1 = make_version(tmp_path / "v1", {FILE: 4 * SHARD}, SHARD, step=1, seed=1)
    v2 = make_version(tmp_path / "v2", {FILE: 4 * SHARD}, SHARD, step=2, seed=2)
    store = target_store(tmp_path)
    async with HttpClient() as client:
        dl = Downloader(client, store, config(), random.Random(1), trust())
        async with (
            fault_source(v1, Fault.CORRUPT) as bad,
            honest_source(v1) as (honest, _),
        ):
            sources = [Source("a-bad", bad.url), Source("b-honest", honest.url)]
            _, stats = await dl.download(v1.signed, sources)
        assert stats.corrupt_by_source["a-bad"] >= 1  # banned at its first corrupt shard
        assert dl.bans.banned(trio.current_time()) == ["a-bad"]
        async with (
            fault_source(v2, Fault.HONEST) as bad2,
            honest_source(v2) as (honest2, _),
        ):
            sources = [Source("a-bad", bad2.url), Source("b-honest", honest2.url)]
            _, stats2 = await dl.download(v2.signed, sources)
        assert bad2.asks == []  # still banned: not asked at all for the next version
        assert set(stats2.bytes_by_source) == {"b-honest"}


async def test_a_source_holding_another_version_is_not_blamed(
    tmp_path: Path, version: Version
) -> None:
    """A ``409`` (the source holds another version under this step) is nobody's fault: the
    source is neither counted corrupt nor banned, and the version comes from the honest one."""
    store = target_store(tmp_path)
    async with (
        fault_source(version, Fault.WRONG_VERSION) as other,
        honest_source(version) as (honest, _),
        HttpClient() as client,
    ):
        sources = [Source("a-other", other.url), Source("b-honest", honest.url)]
        dl = Downloader(client, store, config(), random.Random(1), trust())
        path, stats = await dl.download(version.signed, sources)
    assert_committed(store, version, path)
    assert len(other.asks) >= 1
    assert stats.corrupt_by_source == {}
    assert stats.unavailable_by_source.get("a-other", 0) == len(other.asks)
    assert stats.other_digest_by_source == {"a-other": len(other.asks)}
    assert not dl.bans.banned(trio.current_time())


async def test_a_full_disk_fails_the_download_and_removes_its_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writing a verified chunk fails (ENOSPC): the download fails with ``store_lost`` (the
    node logs it and retries later) and its partial directory is removed, freeing the space;
    the error does not escape the driver as a crash."""
    version = make_version(tmp_path, {FILE: 4 * SHARD}, SHARD, chunk_bytes=SHARD // 4)
    store = target_store(tmp_path)

    def full(self: PartialVersion, index: int, start: int, data: memoryview) -> bool:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(PartialVersion, "write_prefix", full)
    async with honest_source(version) as (honest, _), HttpClient() as client:
        dl = Downloader(client, store, config(), random.Random(1), trust())
        with pytest.raises(DownloadFailed) as failed:
            await dl.download(version.signed, [Source("a-honest", honest.url)])
    assert failed.value.reason is Abandon.STORE_LOST
    assert "No space left on device" in str(failed.value)
    assert store.committed_steps() == []
    assert not store.partial_dir(version.step).exists()


async def test_shard_checks_run_at_most_one_per_core(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify/decode/write of complete shards is CPU work: with one core, one at a time,
    however many shards arrive together (each held pooled buffers; more checks than cores
    at once only made the pool allocate)."""
    import threading
    import time

    from shardcast.download import driver as download_driver

    version = make_version(tmp_path, {FILE: 8 * SHARD}, SHARD)
    monkeypatch.setattr(download_driver.os, "sched_getaffinity", lambda pid: {0})
    real = download_driver.verify_and_write
    lock = threading.Lock()
    running, most = 0, 0

    def counted(*args: object, **kwargs: object) -> bool:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        try:
            time.sleep(0.02)  # widen the window in which another check could overlap
            return real(*args, **kwargs)  # type: ignore[arg-type]
        finally:
            with lock:
                running -= 1

    monkeypatch.setattr(download_driver, "verify_and_write", counted)
    store = target_store(tmp_path)
    async with honest_source(version) as (honest, _), HttpClient() as client:
        dl = Downloader(client, store, config(), random.Random(1), trust())
        path, _stats = await dl.download(version.signed, [Source("b-honest", honest.url)])
        assert download_driver.check_limiter().total_tokens == 1
    assert_committed(store, version, path)
    assert most == 1
