"""``/status``, ``/metrics`` and ``shardnet status`` against a live trainer, a relay and two
inference peers on 127.0.0.1 (the loop of test_whole_loop, scraped while it runs)."""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import trio

from p2p.http_client import HttpClient
from p2p.identity import Identity
from p2p.trust import TrustList
from rollout.batch import SamplingConfig
from shardcast.download.follower import FollowConfig, Follower
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import OriginConfig
from shardcast.wire import LaneRoute
from shardnet.observe import attach_peer, attach_trainer
from shardnet.peer import InferencePeer, PeerConfig
from shardnet.status import fetch_status
from tests.observability import BY_ROLE, families, promtool, promtool_check_metrics
from trainer.config import TrainerConfig
from trainer.trainer import Trainer

if TYPE_CHECKING:
    from trio_typing import TaskStatus

SAMPLING = SamplingConfig(n_prompts=2, group_size=4, max_new_tokens=8)
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


async def _relay(
    tl: TrustList, upstream: str, data: Path, *, task_status: TaskStatus[ShardcastNode]
) -> None:
    async with ShardcastNode.open(
        Identity.from_seed("obs-relay"), tl, NodeConfig("relay", "obs", data)
    ) as node:
        follower = Follower(
            node, FollowConfig(upstreams=(upstream,), poll_interval_s=0.2), random.Random(3)
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(follower.run)
            task_status.started(node)


async def _scrape(nodes: dict[str, ShardcastNode]) -> dict[str, tuple[dict[str, Any], str]]:
    out = {}
    async with HttpClient() as client:
        for name, node in nodes.items():
            doc = await fetch_status(node.http.url)
            text = await client.get_bytes(
                node.http.url + "/metrics", max_bytes=4 << 20, timeout_s=10
            )
            out[name] = (doc, text.decode())
    return out


async def _cli(*args: str) -> tuple[int, str, str]:
    proc = await trio.run_process(
        [sys.executable, "-m", "shardnet.cli", "status", *args],
        capture_stdout=True,
        capture_stderr=True,
        check=False,
        env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
    )
    return proc.returncode, proc.stdout.decode(), proc.stderr.decode()


@pytest.mark.slow  # 0.4-2 min of node processes: outside the 15-minute default run
async def test_status_and_metrics_of_every_role(tmp_path: Path) -> None:
    trainer_id = Identity.from_seed("obs-trainer")
    peer_ids = [Identity.from_seed(f"obs-{n}") for n in ("p1", "p2")]
    tl = TrustList(trainer=trainer_id.peer_id)
    trainer = Trainer(
        trainer_id,
        TrustList(trainer=trainer_id.peer_id),
        TrainerConfig(
            node=NodeConfig("trainer", "obs", tmp_path / "trainer"),
            steps=50,  # more than the test waits for: the nodes are scraped while running
            n_prompts=SAMPLING.n_prompts,
            group_size=SAMPLING.group_size,
            max_new_tokens=SAMPLING.max_new_tokens,
            min_batches=2,
            expected_peers=tuple(p.peer_id for p in peer_ids),
            origin=OriginConfig(shard_size=128 * 1024, shards_per_part=4),
            max_shard_bytes=1 << 20,
            start_wait_s=60,
        ),
    )
    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            tnode = await nursery.start(trainer.run)
            attach_trainer(trainer, tnode)
            taddr = tnode.p2p.multiaddrs()[0]
            rnode = await nursery.start(_relay, tl, taddr, tmp_path / "relay")
            nodes: dict[str, ShardcastNode] = {"trainer": tnode, "relay": rnode}
            for ident, name in zip(peer_ids, ("p1", "p2"), strict=True):
                peer = InferencePeer(
                    ident,
                    tl,
                    PeerConfig(
                        node=NodeConfig("peer", "obs", tmp_path / name),
                        follow=FollowConfig(
                            upstreams=(rnode.p2p.multiaddrs()[0],), poll_interval_s=0.2
                        ),
                        sampling=SAMPLING,
                        trainer_addrs=(taddr,),
                    ),
                )
                nodes[name] = await nursery.start(peer.run)
                attach_peer(peer, nodes[name])
            assert trainer.inbox is not None
            # both peers committed version 1: rollouts of version 0 were accepted and trained
            while not all(
                max(trainer.inbox.statuses.get(p.peer_id, {0: None}), default=0) >= 1
                for p in peer_ids
            ):
                await trainer.inbox.wait_status_change()
            scraped = await _scrape(nodes)
            # `shardnet status --json` against every node, as an operator would
            for name, node in nodes.items():
                code, out, err = await _cli("--json", node.http.url)
                assert code == 0, (name, err)
                doc = json.loads(out)
                assert doc["role"] == ("peer" if name.startswith("p") else name)
                assert doc["peer_id"] == node.identity.peer_id
                assert doc["run_id"] == "obs"
                assert doc["versions"]["latest"] >= 1
            code, out, err = await _cli("--json", taddr)  # over libp2p, then the lane
            assert code == 0, err
            assert json.loads(out)["peer_id"] == trainer_id.peer_id
            code, out, err = await _cli(rnode.http.url)  # the tables
            assert code == 0, err
            assert "upstreams" in out
            assert "relay" in out
            nursery.cancel_scope.cancel()

    for name, (doc, text) in scraped.items():
        role = "peer" if name.startswith("p") else name
        node = nodes[name]
        assert doc["schema"] == 1
        assert doc["role"] == role
        assert doc["peer_id"] == node.identity.peer_id
        assert doc["run_id"] == "obs"
        assert doc["time"].endswith("Z")
        assert doc["started_at"].endswith("Z")
        assert doc["versions"]["latest"] >= 1
        assert doc["http"]["requests"]["2xx"] >= 0
        fams = families(text)
        for fam, kind in BY_ROLE[role].items():
            assert fams.get(fam) == kind, (name, fam, fams.get(fam))
        ours = {f for f in fams if f.startswith("shardnet_") and not f.endswith("_created")}
        assert ours == {f for f in BY_ROLE[role] if f.startswith("shardnet_")}, name
        assert f'role="{role}"' in text
        assert f'peer_id="{node.identity.peer_id}"' in text
        assert 'step="' not in text  # no per-version series
        if promtool() is not None:
            await trio.to_thread.run_sync(promtool_check_metrics, text)

    trainer_doc, trainer_text = scraped["trainer"]
    network = {p["peer_id"]: p for p in trainer_doc["network"]}
    assert set(network) == {p.peer_id for p in peer_ids}
    assert all(p["latest_step"] >= 1 and p["last_heard"].endswith("Z") for p in network.values())
    assert trainer_doc["rollouts"]["accepted_samples"] > 0
    assert trainer_doc["trainer"]["async_window_versions"] == trainer.config.async_level
    # version 1 exists, so one optimizer step ran on batches fetched from both peers
    assert _value(trainer_text, "shardnet_trainer_optimizer_step_seconds_count") >= 1
    assert _value(trainer_text, "shardnet_trainer_optimizer_step_seconds_sum") > 0
    assert _value(trainer_text, "shardnet_rollout_batches_fetched_total") >= 2
    # acceptance per submitter (status) and per rollout length (status and metrics)
    acceptance = trainer_doc["rollouts"]["acceptance"]
    assert set(acceptance["by_submitter"]) == {p.peer_id for p in peer_ids}
    assert all(0 <= a["acceptance_rate"] <= 1 for a in acceptance["by_submitter"].values())
    assert sum(a["trained"] for a in acceptance["by_length"].values()) >= 2
    assert "shardnet_rollout_batches_trained_total{length=" in trainer_text
    relay_doc, relay_text = scraped["relay"]
    (up,) = relay_doc["upstreams"]
    assert up["peer_id"] == trainer_id.peer_id
    assert up["state"] == "ready"
    assert up["role"] == "trainer"
    assert 'shardnet_upstreams{state="ready"} 1.0' in relay_text
    # the relay got its shards from the origin; the peers from the relay (or each other)
    assert 'shardnet_shards_verified_total{source_kind="origin"}' in relay_text
    assert _value(relay_text, 'shardnet_shards_verified_total{source_kind="origin"}') > 0
    assert _value(relay_text, "shardnet_versions_committed_total") >= 2
    assert _value(relay_text, 'shardnet_sent_bytes_total{codec="raw"}') > 0
    for name in ("p1", "p2"):
        doc, text = scraped[name]
        assert doc["upstreams"][0]["role"] == "relay"
        assert doc["rollouts"]["submitted"] >= 1
        assert _value(text, "shardnet_rollout_batches_submitted_total") >= 1
        assert _value(text, "shardnet_peer_weight_swap_seconds_count") >= 1
        assert _value(text, "shardnet_peer_generation_seconds_count") >= 1
        assert _value(text, "shardnet_peer_generated_tokens_total") >= 1
        assert _value(text, "shardnet_peer_generation_tokens_per_second") > 0
        got = sum(
            _value(text, f'shardnet_shards_verified_total{{source_kind="{k}"}}')
            for k in ("relay", "peer")
        )
        assert got > 0
    # the origin's lane counts only lane traffic, not these scrapes
    served = {
        r: _value(trainer_text, f'shardnet_http_requests_total{{code="2xx",route="{r.value}"}}')
        for r in LaneRoute
    }
    assert served[LaneRoute.MANIFEST] + served[LaneRoute.PART] > 0  # the relays asked it
    assert served[LaneRoute.OTHER] == 0
    if promtool() is None:
        pytest.skip("promtool not installed (Debian package prometheus): lint not run")


def _value(text: str, series: str) -> float:
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{series} not exported")
