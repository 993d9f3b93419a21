"""Deltas on real hosts on 127.0.0.1: delta versions (sparse or xor-zstd), catch-up chains, late
joiners, a corrupted base that falls back to raw, and anchors."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import trio

from p2p.identity import Identity
from shardcast.core import Stage
from shardcast.download import DownloadConfig
from shardcast.download.follower import FollowConfig, Follower, VersionRecord
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish import encode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.store import VersionStore, file_matches
from shardcast.store.chains import ChainBroken, read_record
from shardcast.wire import codecs
from shardcast.wire.codecs import DELTAS
from shardcast.wire.manifest import Manifest
from tests.helpers import TRAINER, make_checkpoint, trust

SIZES = {"model-00001-of-00002.safetensors": 400_000, "model-00002-of-00002.safetensors": 300_000}


def evolve_bytes(src: Path, dst: Path, fraction: float, seed: int) -> Path:
    """Copy a checkpoint, flipping the low bit of ``fraction`` of the weight bytes."""
    rng = random.Random(seed)
    dst.mkdir(parents=True)
    for f in src.iterdir():
        data = bytearray(f.read_bytes())
        if f.name.endswith(".safetensors"):
            for i in rng.sample(range(len(data)), int(len(data) * fraction)):
                data[i] ^= 1
        (dst / f.name).write_bytes(data)
    return dst


class Watch:
    """Collects commits of followers and wakes waiters."""

    def __init__(self) -> None:
        self.commits: dict[str, list[VersionRecord]] = {}
        self.changed = trio.Event()

    def hook(self, name: str, store: VersionStore | None = None):  # type: ignore[no-untyped-def]
        async def on_commit(m: Manifest, path: Path, rec: VersionRecord) -> None:
            chain = read_record(path)
            chained = chain.files if chain is not None else frozenset()
            for f in m.header.files:
                if f.name not in chained:
                    assert file_matches(path / f.name, m, f.name)
            for ref in m.header.shards:
                if store is not None and ref.file in chained:  # built and verified
                    store.read_shard(m.step, ref.index)
            self.commits.setdefault(name, []).append(rec)
            self.changed.set()
            self.changed = trio.Event()

        return on_commit

    async def until(self, name: str, step: int, nth: int = 1) -> VersionRecord:
        with trio.fail_after(60):
            while True:
                seen = [r for r in self.commits.get(name, []) if r.step == step]
                if len(seen) >= nth:
                    return seen[nth - 1]
                await self.changed.wait()


def _read_all(store: VersionStore, m: Manifest) -> None:
    for ref in m.header.shards:
        store.read_shard(m.step, ref.index)


async def _node(
    name: str, data: Path, *, task_status: trio.TaskStatus[ShardcastNode] = trio.TASK_STATUS_IGNORED
) -> None:
    async with ShardcastNode.open(
        Identity.from_seed(name), trust(), NodeConfig("peer", "run", data)
    ) as node:
        task_status.started(node)
        await trio.sleep_forever()


@pytest.mark.parametrize("keep_chains", [True, False])
async def test_delta_versions_move_few_bytes_and_late_joiners_catch_up(
    tmp_path: Path, keep_chains: bool
) -> None:
    w = Watch()
    download = DownloadConfig(keep_chains=keep_chains)
    ck0 = make_checkpoint(tmp_path / "ck0", SIZES, seed=0)
    ck1 = evolve_bytes(ck0, tmp_path / "ck1", 0.01, 1)
    ck2 = evolve_bytes(ck1, tmp_path / "ck2", 0.01, 2)
    cfg = NodeConfig("trainer", "run", tmp_path / "o", serve_once_s=5.0)
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o, trio.open_nursery() as nursery:
        origin = Origin(o, OriginConfig(shard_size=64 * 1024, shards_per_part=3, anchor_every=100))
        relay = await nursery.start(_node, "relay", tmp_path / "relay")
        follow = FollowConfig(
            upstreams=(o.p2p.multiaddrs()[0],), poll_interval_s=0.1, download=download
        )
        await nursery.start(
            Follower(relay, follow, random.Random(1), w.hook("relay", relay.store)).run
        )
        p1 = await nursery.start(_node, "p1", tmp_path / "p1")
        pfollow = FollowConfig(
            upstreams=(relay.p2p.multiaddrs()[0],), poll_interval_s=0.1, download=download
        )
        await nursery.start(Follower(p1, pfollow, random.Random(2), w.hook("p1", p1.store)).run)

        r0 = await origin.publish(ck0, 0)
        await w.until("p1", 0)
        r1 = await origin.publish(ck1, 1)
        rec1 = await w.until("p1", 1)
        assert r1.manifest.header.base_step == 0
        assert rec1.stats is not None
        delta_bytes = sum(rec1.stats.bytes_by_encoding.get(e, 0) for e in DELTAS)
        assert 0 < rec1.stats.bytes_fetched < r1.manifest.total_bytes / 4
        assert delta_bytes > 0
        # the origin sent each delta blob once (to the relay)
        assert o.server.bytes_by_step.get(1, 0) <= 1.1 * rec1.stats.bytes_fetched + 4096
        # each follower's CPU account charged the stages of a delta version, on /metrics too
        for node in (relay, p1):
            cpu = node.metrics.stage_cpu.statistics().seconds
            assert cpu[Stage.RECEIVE] > 0
            assert (cpu[Stage.APPLY] > 0) is not keep_chains  # a chain decodes nothing
            assert cpu[Stage.VERIFY] > 0
            assert cpu[Stage.ENGINE_UPDATE] == 0  # no engine here
            text = node.metrics.render().decode()
            assert 'shardnet_stage_cpu_seconds_total{stage="verify"} 0.0\n' not in text
        assert o.metrics.stage_cpu is not relay.metrics.stage_cpu
        # kept as chains (no full file written) or, eager, as full files
        assert (relay.store.chain_of(1) is not None) is keep_chains
        assert (p1.store.chain_of(1) is not None) is keep_chains

        # a late joiner holding version 0 when version 2 is out: chain of deltas 1, 2
        late = await nursery.start(_node, "late", tmp_path / "late")
        r2 = await origin.publish(ck2, 2)
        await w.until("p1", 2)
        # seed the late node with version 0 (as if it had been offline since)
        part = late.store.begin(r0.manifest)
        for s in r0.manifest.header.shards:
            part.write_shard(
                s.index, (r0.path / s.file).read_bytes()[s.offset : s.offset + s.length]
            )
        part.commit()
        await nursery.start(
            Follower(late, pfollow, random.Random(3), w.hook("late", late.store)).run
        )
        got1 = await w.until("late", 1)
        got2 = await w.until("late", 2)
        assert got1.stats is not None
        assert got2.stats is not None
        assert (
            set(got1.stats.bytes_by_encoding) <= set(DELTAS)
            or got1.stats.bytes_by_encoding.get("raw", 0) < r1.manifest.total_bytes / 10
        )
        assert got1.stats.bytes_fetched + got2.stats.bytes_fetched < r2.manifest.total_bytes / 2

        if keep_chains:  # a chain on a chain: 2 is built from 1's blobs over 0
            assert late.store.chain_depth(2) == 2
        # a fresh node with nothing gets version 2 in full (no base): from a relay that
        # keeps it as a chain, each range is built and verified before it is sent
        fresh = await nursery.start(_node, "fresh", tmp_path / "fresh")
        await nursery.start(
            Follower(fresh, pfollow, random.Random(4), w.hook("fresh", fresh.store)).run
        )
        got = await w.until("fresh", 2)
        assert got.stats is not None
        assert not set(DELTAS) & set(got.stats.bytes_by_encoding)
        assert [r.step for r in w.commits["fresh"]] == [2]
        nursery.cancel_scope.cancel()


async def test_corrupted_base_falls_back_to_raw_without_blame(tmp_path: Path) -> None:
    w = Watch()
    ck0 = make_checkpoint(tmp_path / "ck0", SIZES, seed=0)
    ck1 = evolve_bytes(ck0, tmp_path / "ck1", 0.01, 1)
    async with (
        ShardcastNode.open(TRAINER, trust(), NodeConfig("trainer", "run", tmp_path / "o")) as o,
        trio.open_nursery() as nursery,
    ):
        origin = Origin(o, OriginConfig(shard_size=64 * 1024, anchor_every=100))
        p = await nursery.start(_node, "p", tmp_path / "p")
        follow = FollowConfig(
            upstreams=(o.p2p.multiaddrs()[0],),
            poll_interval_s=0.1,
            download=DownloadConfig(keep_chains=False),  # the eager receive path
        )
        await nursery.start(Follower(p, follow, random.Random(1), w.hook("p")).run)
        await origin.publish(ck0, 0)
        await w.until("p", 0)
        # bit rot in the peer's copy of version 0 after it was committed
        victim = p.store.version_dir(0) / "model-00001-of-00002.safetensors"
        data = bytearray(victim.read_bytes())
        data[1000] ^= 0xFF
        victim.write_bytes(data)
        r1 = await origin.publish(ck1, 1)
        rec = await w.until("p", 1)
        assert rec.stats is not None
        assert rec.stats.delta_fallbacks >= 1  # the wrong base was caught by the digest
        assert rec.stats.corrupt_by_source == {}  # and the honest origin was not blamed
        assert rec.stats.bytes_by_encoding.get("raw", 0) > 0
        for f in r1.manifest.header.files:
            assert file_matches(rec.path / f.name, r1.manifest, f.name)  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()


async def test_anchor_versions_carry_no_delta(tmp_path: Path) -> None:
    ck0 = make_checkpoint(tmp_path / "ck0", SIZES, seed=0)
    ck1 = evolve_bytes(ck0, tmp_path / "ck1", 0.01, 1)
    ck2 = evolve_bytes(ck1, tmp_path / "ck2", 0.01, 2)
    async with ShardcastNode.open(
        TRAINER, trust(), NodeConfig("trainer", "run", tmp_path / "o")
    ) as o:
        origin = Origin(o, OriginConfig(shard_size=64 * 1024, anchor_every=2))
        r0 = await origin.publish(ck0, 0)
        r1 = await origin.publish(ck1, 1)
        r2 = await origin.publish(ck2, 2)
        assert r0.manifest.header.base_step is None
        assert r1.manifest.header.base_step == 0
        assert sum(r1.encoded_bytes.get(e, 0) for e in DELTAS) > 0
        assert r2.manifest.header.base_step is None
        assert r2.encoded_bytes == {}


@pytest.mark.parametrize("keep_chains", [False, True])
async def test_blob_the_origin_encoded_badly_falls_back_without_blame(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keep_chains: bool
) -> None:
    """A delta blob that matches its signed digest but does not decode (the origin's encoder
    wrote a truncated frame) is fetched raw instead, and the origin is not blamed. Kept as a
    chain, it is committed unread; the first verified read finds it (no byte leaves), the
    version is dropped and fetched again, eagerly: then raw."""
    w = Watch()
    ck0 = make_checkpoint(tmp_path / "ck0", SIZES, seed=0)
    ck1 = evolve_bytes(ck0, tmp_path / "ck1", 0.01, 1)
    async with (
        ShardcastNode.open(TRAINER, trust(), NodeConfig("trainer", "run", tmp_path / "o")) as o,
        trio.open_nursery() as nursery,
    ):
        origin = Origin(o, OriginConfig(shard_size=64 * 1024, anchor_every=100))
        p = await nursery.start(_node, "p", tmp_path / "p")
        follow = FollowConfig(
            upstreams=(o.p2p.multiaddrs()[0],),
            poll_interval_s=0.1,
            download=DownloadConfig(keep_chains=keep_chains),
        )
        await nursery.start(Follower(p, follow, random.Random(1), w.hook("p")).run)
        await origin.publish(ck0, 0)
        await w.until("p", 0)
        real, real_sparse = codecs.encode, encode.encode_changes  # sparse: from a shard's scan
        monkeypatch.setattr(codecs, "encode", lambda *a, **kw: real(*a, **kw)[:-3])
        monkeypatch.setattr(encode, "encode_changes", lambda *a, **kw: real_sparse(*a, **kw)[:-3])
        r1 = await origin.publish(ck1, 1)
        rec = await w.until("p", 1)
        if keep_chains:
            assert p.store.chain_of(1) is not None
            with pytest.raises(ChainBroken):  # every delta shard is broken: any will do
                _read_all(p.store, r1.manifest)
            assert p.store.committed_steps() == [0]  # 1 dropped; its sound base stays
            rec = await w.until("p", 1, nth=2)  # fetched again, eagerly
            assert p.store.chain_of(1) is None
        assert rec.stats is not None
        assert rec.stats.delta_fallbacks >= 1
        assert rec.stats.corrupt_by_source == {}
        assert rec.stats.bytes_by_encoding.get("raw", 0) > 0
        for f in r1.manifest.header.files:
            assert file_matches(rec.path / f.name, r1.manifest, f.name)  # type: ignore[arg-type]
        nursery.cancel_scope.cancel()
