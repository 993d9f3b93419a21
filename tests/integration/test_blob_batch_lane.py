"""A next version's delta blobs fetched several per request on real HTTP on 127.0.0.1: a
batch with a corrupted blob blames exactly its source, the other blobs of the version still
verify, and a node without the batch route (an older release) is asked one blob at a time."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import trio

from p2p.http_client import HttpClient
from p2p.http_server import HttpRequest, HttpResponse, open_http_server
from shardcast.download import DownloadConfig, Downloader, Source
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.serve.server import VersionServer
from shardcast.store.store import VersionStore
from shardcast.wire import codecs
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
        if batch and self.corrupt and resp.status == 200 and isinstance(resp.body, bytes):
            body = bytearray(resp.body)
            body[3] ^= 0xFF
            return HttpResponse(resp.status, resp.headers, bytes(body))
        return resp

    def count(self, word: str) -> int:
        return sum(1 for p in self.paths if f"/{word}/" in p)


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


class Blamed:
    """A :class:`~shardcast.download.types.DownloadObserver` that sets ``event`` when a
    source is first blamed for a corrupt shard."""

    def __init__(self) -> None:
        self.event = trio.Event()

    def shard_received(self, source: str, codec: str, size_bytes: int, fetch_s: float) -> None:
        pass

    def shard_verified(self, source: str, verify_s: float) -> None:
        pass

    def shard_corrupt(self, source: str) -> None:
        self.event.set()

    def refused(self, source: str) -> None:
        pass

    def transfer_cut(self, source: str) -> None:
        pass


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
