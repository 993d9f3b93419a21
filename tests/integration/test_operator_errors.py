"""A valid but wrong trainer id or run id is reported once, with the upstream's own id."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import trio

from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.download.follower import FollowConfig, Follower
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from tests.helpers import TRAINER, make_checkpoint, trust


@pytest.mark.parametrize("mistake", ["trainer_id", "run_id"])
async def test_wrong_ids_are_reported_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mistake: str
) -> None:
    caplog.set_level(logging.INFO)
    other = Identity.from_seed("someone-else")
    follower_trust = TrustList(trainer=other.peer_id) if mistake == "trainer_id" else trust()
    follower_run = "other-run" if mistake == "run_id" else "run"
    async with ShardcastNode.open(
        TRAINER, trust(), NodeConfig("trainer", "run", tmp_path / "o")
    ) as o:
        await Origin(o, OriginConfig(shard_size=64 * 1024)).publish(
            make_checkpoint(tmp_path / "ck", {"model.safetensors": 100_000}, seed=0), 0
        )
        async with ShardcastNode.open(
            Identity.from_seed("relay"),
            follower_trust,
            NodeConfig("relay", follower_run, tmp_path / "r"),
        ) as r:
            follower = Follower(
                r,
                FollowConfig(upstreams=(o.p2p.multiaddrs()[0],), poll_interval_s=0.05),
                random.Random(1),
            )
            with trio.move_on_after(1.5):  # ~30 polls of the upstream's info
                await follower.run()
            assert r.store.committed_steps() == []
    if mistake == "trainer_id":
        records = [m for m in caplog.messages if m.startswith("trainer_id_mismatch")]
        assert len(records) == 1, caplog.messages
        assert f"signed_by={TRAINER.peer_id}" in records[0]
        assert f"expected={other.peer_id}" in records[0]
    else:
        records = [m for m in caplog.messages if m.startswith("upstream_wrong_run")]
        assert len(records) == 1, caplog.messages
        assert "upstream_run_id=run run_id=other-run" in records[0]
        # what to do, for a node that took its run from a card stored by an earlier run
        assert f"run card stored in {tmp_path / 'r'}" in records[0]
        assert "to follow run run start it with another --data-dir" in records[0]
