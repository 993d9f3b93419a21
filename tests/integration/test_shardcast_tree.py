"""Real libp2p hosts and HTTP lanes on 127.0.0.1: origin -> relay -> 2 peers."""

from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from p2p.identity import Identity
from shardcast.download.follower import FollowConfig, Follower, VersionRecord
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.wire.manifest import Manifest
from tests.helpers import TRAINER, check_committed, make_checkpoint, trust

if TYPE_CHECKING:
    from trio_typing import TaskStatus

SIZES = {
    "model-00001-of-00003.safetensors": 300_000,
    "model-00002-of-00003.safetensors": 200_000,
    "model-00003-of-00003.safetensors": 50_001,
}


async def test_version_flows_through_relay_to_peers(tmp_path: Path) -> None:
    tl = trust()
    commits: dict[str, list[tuple[int, str]]] = {}
    done = trio.Event()

    def hook(name: str):  # type: ignore[no-untyped-def]
        async def on_commit(m: Manifest, path: Path, rec: VersionRecord) -> None:
            check_committed(path, m)  # every file (or chained shard) matches the manifest
            commits.setdefault(name, []).append((m.step, m.digest))
            if all(len(commits.get(p, [])) == 2 for p in ("p1", "p2")):
                done.set()

        return on_commit

    async with ShardcastNode.open(TRAINER, tl, NodeConfig("trainer", "run", tmp_path / "o")) as o:
        origin = Origin(o, OriginConfig(shard_size=64 * 1024, shards_per_part=2))
        relay_id = Identity.from_seed("relay")
        async with (
            ShardcastNode.open(relay_id, tl, NodeConfig("relay", "run", tmp_path / "r")) as r,
            trio.open_nursery() as nursery,
        ):
            fr = Follower(
                r,
                FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), poll_interval_s=0.2),
                random.Random(1),
                on_commit=hook("relay"),
            )
            await nursery.start(fr.run)
            peers = []
            for name in ("p1", "p2"):
                node = await nursery.start(_open_node, Identity.from_seed(name), tmp_path / name)
                fp = Follower(
                    node,
                    FollowConfig(upstreams=(r.p2p.multiaddrs()[0],), poll_interval_s=0.2),
                    random.Random(2),
                    on_commit=hook(name),
                )
                await nursery.start(fp.run)
                peers.append((node, fp))
            for step in (0, 1):
                ck = make_checkpoint(tmp_path / f"ck{step}", SIZES, seed=step)
                await origin.publish(ck, step)
            with trio.fail_after(60):
                await done.wait()
            digests = {s: d for s, d in commits["p1"]}
            assert commits["p1"] == commits["p2"]
            assert sorted(digests) == [0, 1]
            peer_ids = {Identity.from_seed(n).peer_id for n in ("p1", "p2")}
            for node, fp in peers:
                assert node.store.committed_steps() == [0, 1]
                # the peers downloaded from the relay (and each other), never from the origin
                for rec in fp.records:
                    assert rec.stats is not None
                    assert set(rec.stats.bytes_by_source) <= {relay_id.peer_id} | peer_ids
                    assert rec.stats.bytes_by_source.get(relay_id.peer_id, 0) > 0
            # origin egress: each version crossed the origin->relay link once
            sizes = sum(o.store.load_manifest(s, tl).total_bytes for s in (0, 1))
            assert o.http.statistics().bytes_sent <= 1.1 * sizes
            nursery.cancel_scope.cancel()


async def _open_node(
    ident: Identity,
    data: Path,
    *,
    task_status: TaskStatus[ShardcastNode] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with ShardcastNode.open(ident, trust(), NodeConfig("peer", "run", data)) as node:
        task_status.started(node)
        await trio.sleep_forever()


async def test_metrics_endpoint(tmp_path: Path) -> None:
    from p2p.http_client import HttpClient

    async with (
        ShardcastNode.open(TRAINER, trust(), NodeConfig("trainer", "run", tmp_path)) as o,
        HttpClient() as client,
    ):
        await Origin(o, OriginConfig(shard_size=64 * 1024)).publish(
            make_checkpoint(tmp_path / "ck", SIZES), 0
        )
        text = (
            await client.get_bytes(o.http.url + "/metrics", max_bytes=1 << 20, timeout_s=5)
        ).decode()
        assert "shardnet_http_sent_bytes_total" in text
        assert "shardnet_latest_step 0.0" in text
