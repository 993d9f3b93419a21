"""Sub-shard chunks over the HTTP lane on 127.0.0.1 (issue 16, "a swarm that swarms"): a node
serves verified chunks of a shard it is still receiving, and a downloader checks chunks as
they arrive and blames exactly the source of a bad one."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio

from p2p.errors import StreamBroken
from p2p.http_body import FileSlice
from p2p.http_client import HttpClient
from p2p.http_errors import NotAvailable
from p2p.http_range import ByteRange
from p2p.http_server import Handler, HttpRequest, HttpResponse, open_http_server
from shardcast.core import DownloadStats
from shardcast.download.downloader import Downloader
from shardcast.download.types import DownloadConfig, Source
from shardcast.serve.server import VersionServer
from shardcast.store.partial import PartialVersion
from shardcast.store.store import VersionStore
from shardcast.wire import Manifest
from shardcast.wire.have import HOLD_HEADER, decode_have
from shardcast.wire.lane_urls import file_url, have_url
from tests.faults import RUN, Fault, Version, fault_source, honest_source, make_version
from tests.helpers import trust
from tests.integration.test_downloader_faults import assert_committed, config

SHARD = 16 * 1024
CHUNK = 4096
FILE = "model.safetensors"


def _version(tmp_path: Path) -> Version:
    return make_version(tmp_path, {FILE: 2 * SHARD}, SHARD, chunk_bytes=CHUNK)


def _filling(tmp_path: Path, wait_s: float) -> tuple[Version, PartialVersion, VersionServer]:
    """:func:`_version`, being received by a node that serves it live (``part``, empty) with
    a hold of ``wait_s`` seconds."""
    version = _version(tmp_path)
    store = VersionStore(tmp_path / "filling", RUN, keep_last=2)
    part = store.begin(version.signed)
    server = VersionServer(store, trust(), wait_s=wait_s)
    server.add_live(part)
    return version, part, server


async def _download_beside(
    handler: Handler,
    fill: Callable[[], Awaitable[None]],
    store: VersionStore,
    cfg: DownloadConfig,
    m: Manifest,
) -> tuple[Path, DownloadStats]:
    """Download ``m`` into ``store`` from one peer (``handler``, asked with held requests)
    while ``fill`` runs beside it (the peer's own download); fails after 8 s."""
    async with (
        open_http_server(handler) as http,
        HttpClient(headers={HOLD_HEADER: "5"}) as client,
        trio.open_nursery() as nursery,
    ):
        nursery.start_soon(fill)
        dl = Downloader(client, store, cfg, random.Random(1), trust())
        with trio.fail_after(8):
            return await dl.download(m, [Source("a-peer", http.url, complete=False)])


async def test_a_shard_still_arriving_is_served_chunk_by_chunk(tmp_path: Path) -> None:
    version, part, server = _filling(tmp_path, 5.0)  # a node still receiving the version
    m = version.signed
    data = version.files[FILE]
    got = bytearray()
    async with (
        open_http_server(server.handle) as http,
        HttpClient(headers={HOLD_HEADER: "5"}) as held,
        HttpClient() as plain,
    ):
        base = http.url
        url = file_url(base, RUN, m.step, m.digest, FILE)
        part.write_prefix(1, 0, data[SHARD : SHARD + CHUNK])  # one chunk of shard 1 verified
        server.progress(m.step)
        have = await plain.get_bytes(
            have_url(base, RUN, m.step, m.digest) + "?prefix=1", max_bytes=64, timeout_s=5
        )
        assert decode_have(have, 2) == ([], {1: CHUNK})
        # a client that is not held still waits for whole shards: 503 at once
        with pytest.raises(NotAvailable) as answer:
            await plain.get_bytes(url, max_bytes=SHARD, timeout_s=5)
        assert answer.value.status == 503

        async def receive() -> None:
            async for chunk in held.stream_range(url, SHARD, SHARD, timeout_s=5):
                got.extend(chunk)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(receive)
            await trio.testing.wait_all_tasks_blocked()
            assert bytes(got) == data[SHARD : SHARD + CHUNK]  # the verified chunk, at once
            for start in range(CHUNK, SHARD, CHUNK):  # the rest verifies chunk by chunk
                part.write_prefix(1, start, data[SHARD + start : SHARD + start + CHUNK])
                server.progress(m.step)
                await trio.testing.wait_all_tasks_blocked()
                assert bytes(got) == data[SHARD : SHARD + start + CHUNK]
    assert bytes(got) == data[SHARD:]
    part.abort()


async def test_a_stalled_prefix_cuts_the_response_short(tmp_path: Path) -> None:
    version, part, server = _filling(tmp_path, 0.2)
    m = version.signed
    data = version.files[FILE]
    part.write_prefix(0, 0, data[: 2 * CHUNK])
    got = bytearray()
    async with (
        open_http_server(server.handle) as http,
        HttpClient(headers={HOLD_HEADER: "5"}) as held,
    ):
        url = file_url(http.url, RUN, m.step, m.digest, FILE)

        async def receive() -> None:
            async for chunk in held.stream_range(url, 0, SHARD, timeout_s=5):
                got.extend(chunk)

        with pytest.raises(StreamBroken):
            await receive()
    assert bytes(got) == data[: 2 * CHUNK]  # only verified bytes, then the cut
    part.abort()


async def test_a_corrupt_chunk_blames_its_one_sender_and_keeps_the_chunks_before_it(
    tmp_path: Path,
) -> None:
    """a-trunc sends two chunks and half a third, then closes: the sink keeps the two whole
    chunks. b-corrupt resumes there and flips the first byte: that chunk fails at once and
    b alone is blamed, with no assembled copy to compare. c-honest resumes at the same byte."""
    version = make_version(tmp_path, {FILE: SHARD}, SHARD, chunk_bytes=CHUNK)
    store = VersionStore(tmp_path / "downloader", RUN, keep_last=2)
    async with (
        fault_source(version, Fault.TRUNCATE) as trunc,
        fault_source(version, Fault.CORRUPT) as corrupt,
        honest_source(version) as (honest, honest_asks),
        HttpClient() as client,
    ):
        sources = [
            Source("a-trunc", trunc.url),
            Source("b-corrupt", corrupt.url),
            Source("c-honest", honest.url),
        ]
        dl = Downloader(client, store, config(), random.Random(1), trust())
        path, stats = await dl.download(version.signed, sources)
    assert_committed(store, version, path)
    assert [a.offset for a in trunc.asks] == [0]
    assert [a.offset for a in corrupt.asks] == [SHARD // 2]
    assert honest_asks == [SHARD // 2]
    assert stats.corrupt_by_source == {"b-corrupt": 1}
    assert stats.bytes_by_source == {"c-honest": SHARD // 2}  # (broken transfers: uncounted)


async def test_a_downloader_takes_a_shard_from_a_peer_that_is_still_receiving_it(
    tmp_path: Path,
) -> None:
    """The only source is a peer whose shards are still arriving chunk by chunk: the
    downloader learns its verified prefixes from ``/have?prefix=1``, asks it for the shards,
    is streamed each chunk as it verifies there, and commits."""
    version, part, server = _filling(tmp_path, 5.0)
    m = version.signed
    data = version.files[FILE]
    store = VersionStore(tmp_path / "downloader", RUN, keep_last=2)
    cfg = dataclasses.replace(config(), have_poll_s=0.05)

    async def fill() -> None:  # the peer's own download, one chunk at a time
        for shard in range(2):
            for start in range(0, SHARD, CHUNK):
                off = shard * SHARD + start
                part.write_prefix(shard, start, data[off : off + CHUNK])
                server.progress(m.step)
                await trio.sleep(0.02)

    asked_at: list[int] = []  # verified bytes of the asked shard there when it was asked

    async def handler(req: HttpRequest) -> HttpResponse:
        if isinstance(req.range, ByteRange):
            asked_at.append(part.prefix(req.range.first // SHARD))
        return await server.handle(req)

    path, stats = await _download_beside(handler, fill, store, cfg, m)
    assert_committed(store, version, path)
    assert stats.bytes_by_source == {"a-peer": 2 * SHARD}
    assert stats.asked_by_source == {"a-peer": 2}  # one streamed request per shard
    assert min(asked_at) < SHARD  # asked while the peer was still receiving that shard
    part.abort()


async def test_a_range_cut_at_its_sources_hold_keeps_its_bytes_and_counts_no_failure(
    tmp_path: Path,
) -> None:
    """The only source is a peer whose shard 0 stalls after two verified chunks: the held
    request is streamed those two chunks and cut when the hold (0.2 s) runs out, right where
    the peer's verified prefix ends. The downloader keeps the two chunks and takes the cut as
    the peer's late 503 (``HOLD_ENDED``): no failure, the peer not blocked (a ``BROKEN``
    would block it for the whole ``penalty_s``). Once the rest of shard 0 verifies there, it
    is asked again from the kept byte and the version commits."""
    version, part, server = _filling(tmp_path, 0.2)
    m = version.signed
    data = version.files[FILE]
    for start in range(0, SHARD, CHUNK):  # shard 1 whole, shard 0 two chunks
        part.write_prefix(1, start, data[SHARD + start : SHARD + start + CHUNK])
    part.write_prefix(0, 0, data[:CHUNK])
    part.write_prefix(0, CHUNK, data[CHUNK : 2 * CHUNK])
    store = VersionStore(tmp_path / "downloader", RUN, keep_last=2)
    cfg = dataclasses.replace(config(penalty_s=60.0), have_poll_s=0.05)
    asks: list[int] = []
    sent: list[int] = []
    cut = trio.Event()

    async def handler(req: HttpRequest) -> HttpResponse:
        response = await server.handle(req)
        body = response.body
        if isinstance(req.range, ByteRange) and req.range.first < SHARD:
            asks.append(req.range.first)
            if len(asks) == 1 and isinstance(body, FileSlice) and body.on_sent is not None:
                served = body.on_sent  # the server's own count, still called

                def first_sent(n: int) -> None:
                    served(n)
                    sent.append(n)
                    cut.set()

                response = dataclasses.replace(
                    response, body=dataclasses.replace(body, on_sent=first_sent)
                )
        return response

    async def fill() -> None:  # the rest of shard 0 verifies there once the hold cut it
        await cut.wait()
        for start in range(2 * CHUNK, SHARD, CHUNK):
            part.write_prefix(0, start, data[start : start + CHUNK])
        server.progress(m.step)

    # within _download_beside's 8 s: a BROKEN cut would wait out penalty_s = 60 s here
    path, stats = await _download_beside(handler, fill, store, cfg, m)
    assert_committed(store, version, path)
    assert sent == [2 * CHUNK]  # the cut: where the peer's verified prefix ended
    assert asks == [0, 2 * CHUNK]  # resumed at the kept byte, from the same peer
    assert stats.failures == 0
    assert stats.unavailable_by_source == {"a-peer": 1}
    part.abort()
