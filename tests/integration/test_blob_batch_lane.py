"""A next version's delta blobs fetched several per request on real HTTP on 127.0.0.1: a
batch with a corrupted blob blames exactly its source, the other blobs of the version still
verify, a node without the batch route (an older release) is asked one blob at a time, a
source still receiving the version streams each blob of a batch the moment it holds it, and a
downloader checks each blob of a batch as soon as it is whole; a batch body its source ends
right after a whole blob (its hold ran out) is not counted against it, a body cut inside a
blob is."""

from __future__ import annotations

import dataclasses
import random
import shutil
from collections.abc import AsyncGenerator
from contextlib import aclosing
from pathlib import Path

import pytest
import trio

from p2p.http_client import HttpClient
from p2p.http_server import HttpRequest, HttpResponse, StreamedBody, open_http_server
from shardcast.download import DownloadConfig, Downloader, Source
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.serve.server import VersionServer
from shardcast.store import BlobRef
from shardcast.store.store import VersionStore
from shardcast.wire import HOLD_HEADER, ROUTE, codecs, parse_shards
from shardcast.wire.lane_urls import blobs_url
from shardcast.wire.manifest import Manifest
from tests.helpers import TRAINER, check_committed, make_checkpoint, trust
from tests.integration.test_deltas import SIZES, evolve_bytes

RUN = "run"


class Lane:
    """A lane in front of the origin's real :class:`VersionServer` that records the paths it
    is asked for and misbehaves as told: ``corrupt`` flips a byte of the first blob of every
    batch body, ``old`` answers the batch route ``404`` as a node of an older release does,
    and with ``gate`` it holds every blob request until the gate is set."""

    def __init__(
        self,
        server: VersionServer,
        corrupt: bool = False,
        old: bool = False,
        gate: trio.Event | None = None,
    ) -> None:
        self.server = server
        self.corrupt = corrupt
        self.old = old
        self.gate = gate
        self.paths: list[str] = []

    async def handle(self, req: HttpRequest) -> HttpResponse:
        self.paths.append(req.path)
        batch = "/blobs/" in req.path
        if self.gate is not None and (batch or "/shard/" in req.path):
            await self.gate.wait()
        if batch and self.old:
            return HttpResponse(404)
        resp = await self.server.handle(req)
        if batch and self.corrupt and resp.status == 200:
            assert isinstance(resp.body, StreamedBody)  # each blob sent once verified here
            return _with_pieces(resp, _flip_first(resp.body.pieces))
        return resp

    def count(self, word: str) -> int:
        return sum(1 for p in self.paths if f"/{word}/" in p)


def _with_pieces(resp: HttpResponse, pieces: AsyncGenerator[bytes, None]) -> HttpResponse:
    """``resp`` (a streamed body) with its pieces replaced by ``pieces``."""
    assert isinstance(resp.body, StreamedBody)
    return HttpResponse(resp.status, resp.headers, dataclasses.replace(resp.body, pieces=pieces))


def _batch(path: str) -> tuple[str, list[int]] | None:
    """The encoding and shards a batch route names, parsed as the server parses them (None
    for any other route)."""
    match = ROUTE.match(path)
    if match is None or match["benc"] is None:
        return None
    return match["benc"], parse_shards(match["shards"])


def _first_blob_size(m: Manifest, batch: tuple[str, list[int]]) -> int:
    """The signed size of the first blob of ``batch`` (:func:`_batch`)."""
    enc, shards = batch
    offered = m.shard(shards[0]).offered(enc)
    assert offered is not None
    return offered.size


async def _flip_first(pieces: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
    """``pieces`` with byte 3 of the first flipped (a byte of the batch's first blob)."""
    async with aclosing(pieces):
        first = True
        async for piece in pieces:
            if first:
                flipped = bytearray(piece)
                flipped[3] ^= 0xFF
                piece, first = bytes(flipped), False
            yield piece


async def _two_versions(tmp_path: Path, o: ShardcastNode) -> tuple[Manifest, Manifest, Path]:
    """Publish a version and its delta on ``o``; returns both manifests and a copy of the
    first version's files."""
    ck0 = make_checkpoint(tmp_path / "ck0", SIZES, seed=0)
    ck1 = evolve_bytes(ck0, tmp_path / "ck1", 0.01, 1)
    seed = tmp_path / "seed0"
    shutil.copytree(ck0, seed)
    origin = Origin(o, OriginConfig(shard_size=64 * 1024, shards_per_part=3, anchor_every=100))
    r0 = await origin.publish(ck0, 0)
    r1 = await origin.publish(ck1, 1)
    assert r1.manifest.header.base_step == 0
    return r0.manifest, r1.manifest, seed


def _store(tmp_path: Path, m0: Manifest, seed: Path) -> VersionStore:
    """A follower's store holding version 0 (the delta base)."""
    store = VersionStore(tmp_path / "follower" / "versions", RUN, keep_last=3)
    store.adopt(seed, Manifest.decode(m0.encode(), trust=trust()))
    return store


class Watch:
    """A :class:`~shardcast.download.types.DownloadObserver` that notes nothing; subclasses
    set ``event`` at the first event of their kind."""

    def __init__(self) -> None:
        self.event = trio.Event()

    def shard_received(self, source: str, codec: str, size_bytes: int, fetch_s: float) -> None:
        pass

    def shard_verified(self, source: str, verify_s: float) -> None:
        pass

    def shard_corrupt(self, source: str) -> None:
        pass

    def refused(self, source: str) -> None:
        pass

    def transfer_cut(self, source: str) -> None:
        pass


class Blamed(Watch):
    """Sets ``event`` when a source is first blamed for a corrupt shard."""

    def shard_corrupt(self, source: str) -> None:
        self.event.set()


async def test_a_corrupt_blob_in_a_batch_blames_only_its_source(tmp_path: Path) -> None:
    cfg = NodeConfig("trainer", RUN, tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o:
        m0, m1, seed = await _two_versions(tmp_path, o)
        store = _store(tmp_path, m0, seed)
        # the good source answers blobs only once the bad one was blamed: otherwise, on a
        # loaded machine, the good copy of the corrupted blob can arrive first and the bad
        # one is cancelled (endgame) before it is checked, blaming nobody
        blamed = Blamed()
        bad, good = Lane(o.server, corrupt=True), Lane(o.server, gate=blamed.event)
        async with (
            open_http_server(bad.handle) as bad_http,
            open_http_server(good.handle) as good_http,
            HttpClient() as client,
        ):
            dl = Downloader(
                client, store, DownloadConfig(), random.Random(1), trust(), observer=blamed
            )
            sources = [Source("a-bad", bad_http.url), Source("b-good", good_http.url)]
            with trio.fail_after(60):
                m = Manifest.decode(m1.encode(), trust=trust())
                path, stats = await dl.download(m, sources)
    check_committed(path, m1)
    assert bad.count("blobs") >= 1  # it was asked for a batch, and failed one blob of it
    assert set(stats.corrupt_by_source) == {"a-bad"}
    assert stats.bytes_by_encoding.get(codecs.RAW, 0) == 0  # every shard came as its delta
    assert good.count("blobs") + good.count("shard") >= 1


async def test_a_node_without_the_batch_route_is_asked_one_blob_at_a_time(
    tmp_path: Path,
) -> None:
    cfg = NodeConfig("trainer", RUN, tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o:
        m0, m1, seed = await _two_versions(tmp_path, o)
        store = _store(tmp_path, m0, seed)
        old = Lane(o.server, old=True)
        async with open_http_server(old.handle) as http, HttpClient() as client:
            dl = Downloader(client, store, DownloadConfig(), random.Random(1), trust())
            with trio.fail_after(60):
                path, stats = await dl.download(
                    Manifest.decode(m1.encode(), trust=trust()), [Source("old", http.url)]
                )
    check_committed(path, m1)
    assert old.count("blobs") == 1  # once: then the source is known to lack the route
    assert old.count("shard") == len(m1.header.shards)
    assert not dl.batcher.batches_with("old")
    assert stats.corrupt_by_source == {}
    assert stats.failures == 0


class _Filling:
    """Version ``m`` as a relay still receiving it: shard ``i`` servable once in ``held``,
    its blobs where ``store`` (the origin's, which committed it) keeps them."""

    def __init__(self, m: Manifest, store: VersionStore, held: set[int]) -> None:
        self.manifest, self.store, self.held = m, store, held
        self.dir = store.version_dir(m.step)

    def has(self, index: int) -> bool:
        return index in self.held

    def blob_ref(self, index: int, encoding: str) -> BlobRef | None:
        if index not in self.held:
            return None
        return self.store.blob_ref(self.manifest.step, index, encoding)


def _delta_shards(m: Manifest, count: int) -> tuple[str, list[int]]:
    """An encoding and ``count`` shards of ``m`` that offer it."""
    for enc in (codecs.SPARSE, codecs.XOR_ZSTD, codecs.ZSTD):
        shards = [i for i in range(len(m.header.shards)) if m.shard(i).offered(enc)]
        if len(shards) >= count:
            return enc, shards[:count]
    raise AssertionError("no encoding offered for enough shards")


@pytest.mark.parametrize("arrives", [True, False])
async def test_a_source_streams_each_blob_of_a_batch_the_moment_it_holds_it(
    tmp_path: Path, arrives: bool
) -> None:
    """A relay holding the first blob of a batch answers at once and sends the first blob;
    the second goes out when the relay has verified it, or, if that does not happen within
    the request's hold, the body ends there (the lane then cuts it short)."""
    cfg = NodeConfig("trainer", RUN, tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o:
        _, m1, _ = await _two_versions(tmp_path, o)
        enc, (a, b) = _delta_shards(m1, 2)
        blob = {i: o.store.blob_ref(1, i, enc).read() for i in (a, b)}  # type: ignore[union-attr]
        held = {a}
        relay = VersionServer(o.store, trust(), wait_s=10.0)
        relay.add_live(_Filling(Manifest.decode(m1.encode(), trust=trust()), o.store, held))
        url = blobs_url("", RUN, 1, m1.digest, [a, b], enc)
        hold = "10" if arrives else "0.2"
        with trio.fail_after(30):
            resp = await relay.handle(HttpRequest("GET", url, {}, {HOLD_HEADER: hold}, None))
            assert resp.status == 200
            assert b not in held  # answered before b was there
            assert isinstance(resp.body, StreamedBody)
            assert resp.body.length == len(blob[a]) + len(blob[b])
            async with aclosing(resp.body.pieces) as pieces:
                assert await anext(pieces) == blob[a]
                if arrives:
                    held.add(b)
                    relay.progress(1, b)
                    assert await anext(pieces) == blob[b]
                with pytest.raises(StopAsyncIteration):  # done, or b not there in time
                    await anext(pieces)


class Verified(Watch):
    """Sets ``event`` when the first shard is verified."""

    def shard_verified(self, source: str, verify_s: float) -> None:
        self.event.set()


class FirstBlobFirst(Lane):
    """A lane that sends the first blob of the first batch, then the rest of that batch
    only once ``gate`` is set; every other blob request waits for ``gate`` before it is
    answered. So nothing can be verified before ``gate`` but that first blob."""

    def __init__(self, server: VersionServer, m: Manifest, gate: trio.Event) -> None:
        super().__init__(server)
        self.m, self.gate_set, self.first = m, gate, True

    async def handle(self, req: HttpRequest) -> HttpResponse:
        self.paths.append(req.path)
        if "/blobs/" not in req.path and "/shard/" not in req.path:
            return await self.server.handle(req)
        if not (self.first and "/blobs/" in req.path):
            await self.gate_set.wait()
            return await self.server.handle(req)
        self.first = False
        resp = await self.server.handle(req)
        batch = _batch(req.path)
        assert isinstance(resp.body, StreamedBody)
        assert batch is not None
        size = _first_blob_size(self.m, batch)
        return _with_pieces(resp, _split(resp.body.pieces, size, self.gate_set))


async def _split(
    pieces: AsyncGenerator[bytes, None], size: int, gate: trio.Event | None
) -> AsyncGenerator[bytes, None]:
    """``pieces``' bytes: the first ``size``, then the rest once ``gate`` is set; without a
    ``gate``, only the first ``size`` (the body then ends short of its declared length)."""
    async with aclosing(pieces):
        data = b"".join([p async for p in pieces])
    yield data[:size]
    if gate is not None:
        await gate.wait()
        yield data[size:]


async def test_a_downloader_checks_each_blob_of_a_batch_as_soon_as_it_is_whole(
    tmp_path: Path,
) -> None:
    """The rest of the first batch is sent only after a blob was verified, and only its first
    blob can be: a downloader that waited for the whole body before checking any blob of it
    would wait forever."""
    cfg = NodeConfig("trainer", RUN, tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o:
        m0, m1, seed = await _two_versions(tmp_path, o)
        store = _store(tmp_path, m0, seed)
        verified = Verified()
        lane = FirstBlobFirst(o.server, m1, verified.event)
        async with open_http_server(lane.handle) as http, HttpClient() as client:
            dl = Downloader(
                client, store, DownloadConfig(), random.Random(1), trust(), observer=verified
            )
            with trio.fail_after(60):
                m = Manifest.decode(m1.encode(), trust=trust())
                path, stats = await dl.download(m, [Source("relay", http.url)])
    check_committed(path, m1)
    assert not lane.first  # a batch was asked for
    assert stats.failures == 0
    assert stats.bytes_by_encoding.get(codecs.RAW, 0) == 0


class CutFirstBatch(Lane):
    """A lane whose first body of a batch of two or more blobs ends after its first blob
    (``inside``: 7 bytes into the second blob), as a source ends it when its hold runs out
    (the server then closes the connection); every other request goes through."""

    def __init__(self, server: VersionServer, m: Manifest, inside: bool) -> None:
        super().__init__(server)
        self.m, self.inside, self.first = m, inside, True

    async def handle(self, req: HttpRequest) -> HttpResponse:
        self.paths.append(req.path)
        resp = await self.server.handle(req)
        batch = _batch(req.path)
        if not (self.first and batch is not None and len(batch[1]) > 1 and resp.status == 200):
            return resp
        self.first = False
        assert isinstance(resp.body, StreamedBody)
        size = _first_blob_size(self.m, batch)
        keep = size + 7 if self.inside else size
        return _with_pieces(resp, _split(resp.body.pieces, keep, None))


@pytest.mark.parametrize("inside", [False, True])
async def test_a_batch_cut_right_after_a_blob_is_not_counted_against_its_source(
    tmp_path: Path, inside: bool
) -> None:
    """Cut right after its first blob, a batch body is its source's late ``503`` for the
    rest: no failure; cut inside the second blob, it is a broken stream: one failure per
    blob it did not bring. Either way the first blob stands and the version completes."""
    cfg = NodeConfig("trainer", RUN, tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o:
        m0, m1, seed = await _two_versions(tmp_path, o)
        store = _store(tmp_path, m0, seed)
        lane = CutFirstBatch(o.server, m1, inside)
        async with open_http_server(lane.handle) as http, HttpClient() as client:
            dl = Downloader(client, store, DownloadConfig(), random.Random(1), trust())
            with trio.fail_after(60):
                m = Manifest.decode(m1.encode(), trust=trust())
                path, stats = await dl.download(m, [Source("relay", http.url)])
    check_committed(path, m1)
    assert not lane.first  # a batch of two or more blobs was asked for, and cut
    cut = next(b for p in lane.paths if (b := _batch(p)) is not None and len(b[1]) > 1)
    assert stats.failures == (len(cut[1]) - 1 if inside else 0)
    assert stats.corrupt_by_source == {}
