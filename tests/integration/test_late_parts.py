"""A manifest part that its origin signs late (pipelined publish: the trainer was still writing
the last file) on 127.0.0.1, in virtual time: the downloader gets it the moment a source has
it, however many other sources lack it and hold the request meanwhile.

The bug this pins (issue 16, the next-version stall): parts were asked of one source after
another, each holding the request up to its ``wait_s`` (10 s) while it lacked the part itself;
a relay waited on the origin, then on each peer in turn, and every node of the benchmark sat
idle for 40-50 s on one part of a version the origin had published long before.

Also when a download asks discovered peers for parts while its upstreams feed it: only if the
upstreams do not give them, and at once after a peer gave one.
"""

from __future__ import annotations

import logging
import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.testing

from p2p.http_client import HttpClient
from p2p.http_server import HttpRequest, HttpResponse, open_http_server
from shardcast.download.downloader import Downloader
from shardcast.download.parts import PART_PEERS_AFTER_S, PARTS_IN_FLIGHT
from shardcast.download.types import Source
from shardcast.serve.server import VersionServer
from shardcast.store.store import VersionStore
from shardcast.wire.have import HOLD_HEADER
from shardcast.wire.manifest import Manifest
from tests.faults import RUN, Version, make_version
from tests.helpers import trust
from tests.integration.procs import free_port
from tests.integration.test_downloader_faults import assert_committed, config

SHARD = 16 * 1024
FILE = "model.safetensors"
PART_AT_S = 15.0  # when the origin signs the version's parts (after its sources' 10 s holds)
WAIT_S = 10.0  # every server's longest hold, as a node's default


@pytest.fixture
def jump_clock() -> trio.testing.MockClock:
    """Virtual time that jumps only after 50 ms of real idleness, as in
    ``test_downloader_faults``: the downloader verifies shards in worker threads, which
    trio cannot see, and with a threshold of 0 the clock ran through every held request's
    and idle timer's deadline up to the download's 60 s while one thread hashed a shard
    (1 run in 20-30 failed with ``TooSlowError``, before and after the ``want`` change)."""
    return trio.testing.MockClock(autojump_threshold=0.05)


class _Live:
    """A version still being published (origin) or received (peer): shards servable once the
    part that lists them is signed."""

    def __init__(self, manifest: Manifest, directory: Path) -> None:
        self.manifest = manifest
        self.dir = directory

    def has(self, index: int) -> bool:
        return any(index in self.manifest.header.part_range(k) for k in self.manifest.parts)

    def blob_ref(self, index: int, encoding: str) -> None:
        return None


@asynccontextmanager
async def _server(
    store: VersionStore, live: _Live, holds: list[str], asked: trio.Event
) -> AsyncIterator[tuple[str, VersionServer]]:
    """A lane serving ``live``; ``holds`` gets the hold header of every part request, and
    ``asked`` is set at the first."""
    server = VersionServer(store, trust(), wait_s=WAIT_S)
    server.add_live(live)

    async def handle(req: HttpRequest) -> HttpResponse:
        if "/manifest/part/" in req.path:
            holds.append(req.headers.get(HOLD_HEADER, "none"))
            asked.set()
        return await server.handle(req)

    async with open_http_server(handle) as http:
        yield http.url, server


def _header_only(version: Version) -> Manifest:
    return Manifest(version.signed.signed_header)


@pytest.mark.parametrize("part_at_s", [PART_AT_S, 1.0])
@pytest.mark.parametrize("discovered", [False, True])
async def test_a_late_part_arrives_the_moment_its_origin_signs_it(
    tmp_path: Path,
    jump_clock: trio.testing.MockClock,
    discovered: bool,
    part_at_s: float,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An origin still hashing (the part comes at 15 s) and a peer that lacks the part too
    (it would hold a request 10 s): the download has the part at 15 s, not after a hold at
    the origin (10 s) plus one at the peer (10 s). A peer found by discovery is asked not to
    hold at all: a part no peer has costs no held request per peer. A source that cannot be
    reached is asked every round but logged once. A part the origin signs within
    ``PART_PEERS_AFTER_S`` (1 s) is never asked of the discovered peer: the origin holds the
    ask and gives it."""
    caplog.set_level(logging.DEBUG, logger="shardcast.download.downloader")
    version = make_version(tmp_path, {FILE: 4 * SHARD}, SHARD)
    step = version.step
    origin_m, peer_m = _header_only(version), _header_only(version)
    asked, first_ask = trio.Event(), list[float]()
    origin_holds: list[str] = []
    peer_holds: list[str] = []
    empty = VersionStore(tmp_path / "peer-store", RUN, keep_last=2)
    target = VersionStore(tmp_path / "downloader", RUN, keep_last=2)
    async with (
        _server(
            version.store, _Live(origin_m, version.store.version_dir(step)), origin_holds, asked
        ) as (origin_url, origin),
        _server(empty, _Live(peer_m, tmp_path), peer_holds, trio.Event()) as (peer_url, _),
        HttpClient(headers={HOLD_HEADER: f"{WAIT_S:g}"}) as client,
        trio.open_nursery() as nursery,
    ):

        async def publish() -> None:  # the origin signs its parts, then commits
            await asked.wait()  # (the clock jumps while the downloader sets up in a thread)
            first_ask.append(trio.current_time())
            await trio.sleep(part_at_s)
            for part in version.signed.parts.values():
                origin_m.add_part(part)
            origin.progress(step)
            origin.live_done(step)

        nursery.start_soon(publish)
        peer = Source("b-peer", peer_url, complete=False)
        dead = Source("c-dead", f"http://127.0.0.1:{free_port()}", complete=False)
        sources = [Source("a-origin", origin_url, complete=False), dead]
        dl = Downloader(client, target, config(), random.Random(1), trust())
        part_at: list[float] = []

        def on_shard(index: int) -> None:  # -1: a manifest part arrived
            if index < 0:
                part_at.append(trio.current_time() - first_ask[0])

        extra = (lambda: [peer]) if discovered else None
        path, _ = await dl.download(
            _header_only(version),
            sources if discovered else [*sources, peer],
            extra_sources=extra,
            on_shard=on_shard,
        )
    assert_committed(target, version, path)
    # (the time of the part, not of the commit: the mock clock jumps while worker threads
    # verify shards, to the next deadline of the servers' held requests)
    assert part_at == [pytest.approx(part_at_s)]
    failed = [r for r in caplog.records if r.getMessage().startswith("part_fetch_failed")]
    assert len(failed) >= (2 if part_at_s > WAIT_S else 1)  # asked in each round
    assert [r.levelno for r in failed].count(logging.INFO) == 1  # and said so once
    assert set(origin_holds) == {f"{WAIT_S:g}"}  # held where the part comes from
    if not discovered:  # an upstream: asked at once, held
        assert set(peer_holds) == {f"{WAIT_S:g}"}
    elif part_at_s > PART_PEERS_AFTER_S:  # asked once the origin had not given it
        assert set(peer_holds) == {"0"}
    else:
        assert peer_holds == []


async def test_parts_are_asked_in_order_a_few_at_a_time_and_a_late_answer_keeps_its_connection(
    tmp_path: Path, jump_clock: trio.testing.MockClock
) -> None:
    """Two upstreams that sign a version's 12 parts one per second, the second 0.1 s after
    the first (as two relays that get them from one origin): the downloader asks for at
    most ``PARTS_IN_FLIGHT`` parts at once, in part order, and the slower upstream's held
    ask ends on its own after the race is won, so its connection is reused instead of a new
    one per part."""
    n = 12
    assert n > PARTS_IN_FLIGHT
    version = make_version(tmp_path, {FILE: n * SHARD}, SHARD, shards_per_part=1)
    step = version.step
    held: dict[str, set[int]] = {"a": set(), "b": set()}
    most_held = {"a": 0, "b": 0}
    first_asked: dict[int, float] = {}  # part -> when it was first asked
    asked = trio.Event()  # the parts are signed from the first ask on

    @asynccontextmanager
    async def upstream(name: str, lag_s: float) -> AsyncIterator[tuple[str, Any]]:
        m = _header_only(version)
        server = VersionServer(version.store, trust(), wait_s=WAIT_S)
        server.add_live(_Live(m, version.store.version_dir(step)))

        async def handle(req: HttpRequest) -> HttpResponse:
            if "/manifest/part/" not in req.path:
                return await server.handle(req)
            k = int(req.path.rsplit("/", 1)[1])
            first_asked.setdefault(k, trio.current_time())
            asked.set()
            held[name].add(k)
            most_held[name] = max(most_held[name], len(held[name]))
            try:
                return await server.handle(req)
            finally:
                held[name].discard(k)

        async def publish() -> None:
            await asked.wait()
            await trio.sleep(lag_s)
            for k in range(n):
                await trio.sleep(1.0)
                m.add_part(version.signed.parts[k])
                server.progress(step)

        async with open_http_server(handle) as http, trio.open_nursery() as nursery:
            nursery.start_soon(publish)
            yield http.url, http
            nursery.cancel_scope.cancel()

    target = VersionStore(tmp_path / "downloader", RUN, keep_last=2)
    async with (
        upstream("a", 0.0) as (url_a, _),
        upstream("b", 0.1) as (url_b, http_b),
        HttpClient(headers={HOLD_HEADER: f"{WAIT_S:g}"}) as client,
    ):
        dl = Downloader(client, target, config(), random.Random(1), trust())
        path, _ = await dl.download(
            _header_only(version),
            [Source("a", url_a, complete=False), Source("b", url_b, complete=False)],
        )
        connections_b = http_b.statistics().connections_total
    assert_committed(target, version, path)
    assert sorted(first_asked) == list(range(n))
    start = min(first_asked.values())
    for k in range(PARTS_IN_FLIGHT, n):  # asked only once part k - PARTS_IN_FLIGHT came (at
        # 1 s per part after the first ask): in order, a few at a time
        assert first_asked[k] - start >= k - PARTS_IN_FLIGHT + 1
    assert most_held["a"] <= PARTS_IN_FLIGHT
    assert most_held["b"] <= PARTS_IN_FLIGHT + 1  # and the one ask still in its grace
    # one connection per part ask held at once, reused as each ask ends; cancelling the
    # slower upstream's ask at once closed it, and the next part needed a new connection
    assert connections_b <= PARTS_IN_FLIGHT + 2


async def test_an_upstream_that_lags_behind_the_peers_costs_one_wait_not_one_per_part(
    tmp_path: Path, jump_clock: trio.testing.MockClock
) -> None:
    """An upstream that holds every part ask and never has the part (its own upstream is
    gone), and a discovered peer that holds the whole version: the first parts come from
    the peer after ``PART_PEERS_AFTER_S``, and every later part is asked of the peer at
    once (``Session.part_given``), so the 12 parts are in by then plus a little, not after
    one wait per ``PARTS_IN_FLIGHT`` parts."""
    n = 12
    assert n > PARTS_IN_FLIGHT
    version = make_version(tmp_path, {FILE: n * SHARD}, SHARD, shards_per_part=1)
    peer_server = VersionServer(version.store, trust(), wait_s=WAIT_S)

    async def stalled(req: HttpRequest) -> HttpResponse:
        if "/manifest/part/" in req.path:
            await trio.sleep_forever()
        return HttpResponse(503, [("retry-after", "1")])

    part_at: list[float] = []

    def on_shard(index: int) -> None:  # -1: a manifest part arrived
        if index < 0:
            part_at.append(trio.current_time())

    target = VersionStore(tmp_path / "downloader", RUN, keep_last=2)
    async with (
        open_http_server(stalled) as up,
        open_http_server(peer_server.handle) as p,
        HttpClient(headers={HOLD_HEADER: f"{WAIT_S:g}"}) as client,
    ):
        start = trio.current_time()
        dl = Downloader(client, target, config(), random.Random(1), trust())
        path, _ = await dl.download(
            _header_only(version),
            [Source("a-relay", up.url, complete=False)],
            extra_sources=lambda: [Source("b-peer", p.url, complete=True)],
            on_shard=on_shard,
        )
    assert_committed(target, version, path)
    assert len(part_at) == n
    assert min(part_at) - start >= PART_PEERS_AFTER_S  # the relay was waited for, once
    assert max(part_at) - start < PART_PEERS_AFTER_S + 1.0
