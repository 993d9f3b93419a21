"""A follower on real hosts on 127.0.0.1 abandons a download that a newer version made
useless, instead of waiting on it."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import trio

from shardcast.download.follower import FollowConfig, Follower, VersionRecord
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.publish.plan import build_manifest
from shardcast.store import BLOB_DIR, BlobRef, find_blob
from shardcast.wire.manifest import Manifest
from shardcast.wire.messages import VersionAnnouncement, versions_topic
from tests.helpers import TRAINER, make_checkpoint, trust
from tests.integration.test_deltas import _node

SIZES = {"model-00001-of-00001.safetensors": 200_000}


class _Stuck:
    """A live version whose shards never become available (an origin that hangs)."""

    def __init__(self, manifest: Manifest, directory: Path) -> None:
        self.manifest = manifest
        self.dir = directory
        self.asked = trio.Event()

    def has(self, index: int) -> bool:
        self.asked.set()  # a follower is downloading it
        return False

    def blob_ref(self, index: int, encoding: str) -> BlobRef | None:
        return find_blob(self.dir / BLOB_DIR, index, encoding)


async def test_a_download_superseded_by_an_anchor_is_abandoned(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    commits: list[int] = []
    done = trio.Event()

    async def on_commit(m: Manifest, path: Path, rec: VersionRecord) -> None:
        commits.append(m.step)
        done.set()

    ck1 = make_checkpoint(tmp_path / "ck1", SIZES, seed=1)
    ck2 = make_checkpoint(tmp_path / "ck2", SIZES, seed=2)
    stuck = build_manifest(ck1, "run", 1, TRAINER, shard_size=64 * 1024)
    cfg = NodeConfig("trainer", "run", tmp_path / "o")
    with caplog.at_level(logging.INFO, logger="shardcast"):
        async with ShardcastNode.open(TRAINER, trust(), cfg) as o, trio.open_nursery() as nursery:
            origin = Origin(o, OriginConfig(shard_size=64 * 1024, anchor_every=2))
            peer = await nursery.start(_node, "p1", tmp_path / "p1")
            follow = FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), poll_interval_s=0.1)
            await nursery.start(Follower(peer, follow, random.Random(1), on_commit).run)
            # step 1 is announced and then hangs: every request for its bytes waits, then 503
            hung = _Stuck(stuck, ck1)
            o.server.add_live(hung)
            ann = VersionAnnouncement.create(TRAINER, "run", 1, stuck.digest, ())
            o.set_announcement(ann)
            await o.p2p.publish(versions_topic("run"), ann.encode())
            with trio.fail_after(10):
                await hung.asked.wait()
            assert peer.server.in_progress() == [1]
            # step 2 is an anchor: step 1 can be the base of nothing the peer will fetch
            await origin.publish(ck2, 2)
            with trio.fail_after(20):
                await done.wait()
            nursery.cancel_scope.cancel()
    assert commits == [2]
    assert not peer.store.partial_dir(1).exists()
    assert any(
        "download_abandoned step=1 reason=superseded" in r.getMessage() for r in caplog.records
    )


async def test_adverts_are_used_only_once_their_lane_proves_the_peer_id(tmp_path: Path) -> None:
    """A follower challenges the lane behind each advert: a node advertising its own lane is
    used; an identity advertising someone else's lane (here the origin's) never is."""
    from p2p.identity import Identity
    from shardcast.download.discovery import NodeAdvert

    cfg = NodeConfig("trainer", "run", tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o, trio.open_nursery() as nursery:
        p1 = await nursery.start(_node, "p1", tmp_path / "p1")
        p2 = await nursery.start(_node, "p2", tmp_path / "p2")
        follow = FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), poll_interval_s=0.1)
        f = Follower(p2, follow, random.Random(1))
        await nursery.start(f.run)
        liar = Identity.from_seed("liar").peer_id
        now = trio.current_time()
        f.directory.offer(NodeAdvert(p1.identity.peer_id, "peer", p1.http_url, (1,), ()), now)
        f.directory.offer(NodeAdvert(liar, "peer", o.http_url, (1,), ()), now)
        with trio.fail_after(10):
            while f.directory.to_verify(trio.current_time()):
                await f.directory.changed.wait()
        assert [s.id for s in f.directory.sources_for(1, trio.current_time(), 10)] == [
            p1.identity.peer_id
        ]
        assert f.directory.score(liar, trio.current_time()) < 0
        nursery.cancel_scope.cancel()
