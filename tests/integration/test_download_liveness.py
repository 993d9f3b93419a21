"""Downloads that always end, and restarts that keep verified work (real HTTP on 127.0.0.1).

Timeout-driven outcomes run on a MockClock with a small non-zero autojump threshold (see
tests/integration/test_downloader_faults.py); every bound asserted here is reached by the test.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio
import trio.testing

from p2p.http_client import HttpClient
from p2p.http_server import HttpRequest, HttpResponse, HttpServerConfig, open_http_server
from shardcast.core.liveness import Abandon
from shardcast.core.select import SchedulerConfig
from shardcast.download.downloader import Downloader
from shardcast.download.types import DownloadConfig, DownloadFailed, Source
from shardcast.serve.server import VersionServer
from shardcast.store.store import VersionStore
from tests.faults import RUN, Ask, Fault, Version, fault_source, honest_source, make_version
from tests.helpers import trust

if TYPE_CHECKING:
    from trio_typing import TaskStatus

SHARD = 16 * 1024
FILE = "model.safetensors"
DEAD = "http://127.0.0.1:9"  # discard port: nothing listens there


@pytest.fixture
def jump_clock() -> trio.testing.MockClock:
    return trio.testing.MockClock(autojump_threshold=0.05)


@pytest.fixture
def version(tmp_path: Path) -> Version:
    return make_version(tmp_path, {FILE: 4 * SHARD}, SHARD)


def config(**kw: float | bool) -> DownloadConfig:
    sched = SchedulerConfig(explore=0.0, penalty_s=1.0, endgame_duplicates=0)
    base: dict[str, float | bool] = {
        "stall_timeout_s": 5.0,
        "deadline_s": 600.0,
        "no_source_grace_s": 60.0,
        "gone_grace_s": 2.0,
        "no_progress_s": 120.0,
    }
    base.update(kw)
    return DownloadConfig(scheduler=sched, **base)  # type: ignore[arg-type]


def store_at(tmp_path: Path) -> VersionStore:
    return VersionStore(tmp_path / "downloader", RUN, keep_last=2, durable=False)


async def test_version_gone_from_every_source_ends_within_the_gone_grace(
    tmp_path: Path, version: Version, jump_clock: trio.testing.MockClock
) -> None:
    """Sources that answer 404 (they pruned the version) end the download after
    gone_grace_s, not at the no-source grace or the deadline."""
    pruned = make_version(tmp_path / "other", {FILE: 4 * SHARD}, SHARD, step=2)
    store = store_at(tmp_path)
    async with (
        honest_source(version) as (a, _),
        honest_source(version) as (b, _),
        HttpClient() as client,
    ):
        sources = [Source("a", a.url), Source("b", b.url)]  # they hold step 1, not step 2
        dl = Downloader(client, store, config(), random.Random(1), trust())
        start = trio.current_time()
        with pytest.raises(DownloadFailed, match="gone from every source") as info:
            await dl.download(pruned.signed, sources)
        elapsed = trio.current_time() - start
    assert info.value.reason is Abandon.GONE
    assert 2.0 <= elapsed < 3.0
    assert not store.partial_dir(2).exists()


async def test_a_source_that_only_answers_503_ends_at_no_progress(
    tmp_path: Path, version: Version, jump_clock: trio.testing.MockClock
) -> None:
    store = store_at(tmp_path)
    async with fault_source(version, Fault.UNAVAILABLE) as busy, HttpClient() as client:
        dl = Downloader(client, store, config(no_progress_s=10.0), random.Random(1), trust())
        start = trio.current_time()
        with pytest.raises(DownloadFailed, match="no byte received") as info:
            await dl.download(version.signed, [Source("a", busy.url)])
        elapsed = trio.current_time() - start
    assert info.value.reason is Abandon.NO_PROGRESS
    assert 10.0 <= elapsed < 10.5
    assert len(busy.asks) > 4  # it was asked again and again: 503 is not the end


async def test_an_upstream_that_recovers_during_a_download_is_used(
    tmp_path: Path, version: Version
) -> None:
    store = store_at(tmp_path)
    async with honest_source(version) as (honest, _), HttpClient() as client:
        reachable: list[Source] = []
        dl = Downloader(client, store, config(), random.Random(1), trust())
        async with trio.open_nursery() as nursery:

            async def recover() -> None:
                await trio.sleep(0.3)
                reachable.append(Source("b-upstream", honest.url))

            nursery.start_soon(recover)
            path, stats = await dl.download(
                version.signed, [Source("a-dead", DEAD)], upstreams=lambda: list(reachable)
            )
    assert path == store.version_dir(1)
    assert stats.bytes_by_source == {"b-upstream": 4 * SHARD}


async def test_an_upstream_restarted_at_another_url_is_used_there(
    tmp_path: Path, version: Version
) -> None:
    store = store_at(tmp_path)
    async with honest_source(version) as (honest, _), HttpClient() as client:
        dl = Downloader(client, store, config(), random.Random(1), trust())
        path, stats = await dl.download(
            version.signed,
            [Source("a", DEAD)],
            upstreams=lambda: [Source("a", honest.url)],
        )
    assert path == store.version_dir(1)
    assert stats.bytes_by_source == {"a": 4 * SHARD}


async def test_data_directory_vanishing_mid_download_is_a_typed_failure_then_starts_over(
    tmp_path: Path, version: Version
) -> None:
    store = store_at(tmp_path)
    async with honest_source(version) as (honest, _), HttpClient() as client:
        dl = Downloader(client, store, config(), random.Random(1), trust())
        wiped: list[int] = []

        def wipe(index: int) -> None:
            if not wiped:
                wiped.append(index)
                shutil.rmtree(tmp_path / "downloader")

        with pytest.raises(DownloadFailed) as info:
            await dl.download(version.signed, [Source("a", honest.url)], on_shard=wipe)
        assert info.value.reason is Abandon.STORE_LOST
        path, _ = await dl.download(version.signed, [Source("a", honest.url)])
    assert (path / FILE).read_bytes() == version.files[FILE]


async def test_restarted_download_fetches_only_the_shards_it_had_not_verified(
    tmp_path: Path, version: Version
) -> None:
    def half(ask: Ask) -> Fault:
        return Fault.HONEST if ask.offset < 2 * SHARD else Fault.STALL_AFTER_HEADERS

    cfg = config(keep_partial=True)
    async with fault_source(version, half) as first, HttpClient() as client:
        seen: list[int] = []
        with trio.CancelScope() as scope:

            def on_shard(index: int) -> None:
                seen.append(index)
                if len(seen) == 2:
                    scope.cancel()  # the node is stopped with two shards verified

            dl = Downloader(client, store_at(tmp_path), cfg, random.Random(1), trust())
            await dl.download(version.signed, [Source("a", first.url)], on_shard=on_shard)
    assert sorted(seen) == [0, 1]
    store = store_at(tmp_path)  # the restarted node
    assert store.partial_dir(1).is_dir()
    async with honest_source(version) as (honest, asked), HttpClient() as client:
        dl = Downloader(client, store, cfg, random.Random(1), trust())
        path, stats = await dl.download(version.signed, [Source("a", honest.url)])
    assert (path / FILE).read_bytes() == version.files[FILE]
    assert stats.restored == 2
    assert sorted(asked) == [2 * SHARD, 3 * SHARD]
    assert stats.bytes_fetched == 2 * SHARD


STALL_S = 3.0


class _Restartable:
    """The real lane over the honest store on one fixed port, stopped and restarted at will
    (a node SIGKILLed and restarted on the same ports); each answer is held ``hold_s`` so that
    requests are in flight when it stops."""

    def __init__(self, version: Version, hold_s: float) -> None:
        self.server = VersionServer(version.store, trust())
        self.hold_s = hold_s
        self.port = 0
        self.up = False
        self._scope: trio.CancelScope | None = None

    async def _handle(self, request: HttpRequest) -> HttpResponse:
        await trio.sleep(self.hold_s)
        return await self.server.handle(request)

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        with trio.CancelScope() as self._scope:
            async with open_http_server(self._handle, HttpServerConfig(port=self.port)) as http:
                self.port, self.up = http.port, True
                task_status.started()
                await trio.sleep_forever()
        self.up = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        assert self._scope is not None
        self._scope.cancel()


async def _outage(tmp_path: Path, down_s: float, with_upstreams: bool) -> tuple[float, float, int]:
    """Download 16 shards from one source that is stopped once 2 shards verified (4 requests
    in flight) and restarted on the same port ``down_s`` later. Returns (seconds from the
    restart to the next verified shard, to the commit, failures)."""
    version = make_version(tmp_path / "v", {FILE: 16 * SHARD}, SHARD)
    lane = _Restartable(version, hold_s=0.2)
    cfg = config(stall_timeout_s=STALL_S)
    verified: list[int] = []
    restarted: list[float] = []
    resumed: list[float] = []
    stopped = trio.Event()

    def on_shard(index: int) -> None:
        verified.append(index)
        if len(verified) == 2:
            lane.stop()
            stopped.set()
        if restarted and not resumed:
            resumed.append(trio.current_time())

    async with HttpClient() as client, trio.open_nursery() as nursery:
        await nursery.start(lane.run)
        dl = Downloader(client, store_at(tmp_path), cfg, random.Random(1), trust())

        async def fault() -> None:
            await stopped.wait()
            await trio.sleep(down_s)
            await nursery.start(lane.run)
            restarted.append(trio.current_time())

        nursery.start_soon(fault)
        ups = (lambda: [Source("a", lane.url)] if lane.up else []) if with_upstreams else None
        path, stats = await dl.download(
            version.signed, [Source("a", lane.url)], on_shard=on_shard, upstreams=ups
        )
        done = trio.current_time()
        lane.stop()
    assert (path / FILE).read_bytes() == version.files[FILE]
    return resumed[0] - restarted[0], done - restarted[0], stats.failures


async def test_a_source_restarted_on_its_ports_is_resumed_well_within_the_stall_timeout(
    tmp_path: Path, jump_clock: trio.testing.MockClock
) -> None:
    """The requests in flight when the source dies (usually 3 or 4) fail together: one outage, one
    penalty_s (1 s), not a block doubled per request (4-8 s, beyond the stall timeout)."""
    resume_s, commit_s, failures = await _outage(tmp_path, down_s=0.3, with_upstreams=False)
    seen = (resume_s, commit_s, failures)
    assert failures >= 2, seen
    assert resume_s < STALL_S / 2, seen
    assert commit_s < STALL_S, seen


async def test_an_upstream_that_answers_again_is_asked_at_once(
    tmp_path: Path, jump_clock: trio.testing.MockClock
) -> None:
    """A longer outage grows the source's block (1 s, then 2 s, ...); the upstream answering
    again (``upstreams`` lists it again) lifts it at the next poll instead."""
    resume_s, commit_s, failures = await _outage(tmp_path, down_s=1.5, with_upstreams=True)
    seen = (resume_s, commit_s, failures)
    # one have_poll_s and one held answer, with slack; the block alone would last until
    # 3 s after the stop (1.5 s after the restart)
    assert resume_s < 1.0, seen
    assert commit_s < 2.5, seen
