"""The whole loop in one process over real libp2p hosts and HTTP lanes on 127.0.0.1:
trainer (origin) -> relay -> 2 inference peers -> verified rollouts -> trainer."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch
import trio

from p2p.identity import Identity
from p2p.trust import TrustList
from rollout.batch import SamplingConfig
from rollout.schema import RolloutBatch
from shardcast.download.follower import FollowConfig, Follower
from shardcast.node.cardsync import bootstrap_card
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish import plan
from shardcast.publish.origin import OriginConfig
from shardnet.peer import InferencePeer, PeerConfig
from trainer.config import TrainerConfig
from trainer.trainer import Trainer

if TYPE_CHECKING:
    from trio_typing import TaskStatus

SAMPLING = SamplingConfig(n_prompts=2, group_size=4, max_new_tokens=8)


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


async def _run_loop(
    tmp: Path,
    steps: int,
    forger: bool = False,
    model: Path | None = None,
    task: str = "digits",
    task_reward: str = "exact",
) -> tuple[Trainer, list[InferencePeer]]:
    trainer_id = Identity.from_seed("loop-trainer")
    names = ["p1", "p2"] + (["forger"] if forger else [])
    peer_ids = [Identity.from_seed(f"loop-{n}") for n in names]
    honest = [p.peer_id for p in peer_ids[:2]]
    tl_trainer = TrustList(trainer=trainer_id.peer_id)
    tl = TrustList(trainer=trainer_id.peer_id)
    cfg = TrainerConfig(
        node=NodeConfig("trainer", "loop", tmp / "trainer"),
        steps=steps,
        model=model,
        task=task,
        task_reward=task_reward,
        n_prompts=SAMPLING.n_prompts,
        group_size=SAMPLING.group_size,
        max_new_tokens=SAMPLING.max_new_tokens,
        min_batches=2,
        expected_peers=tuple(honest),
        origin=OriginConfig(shard_size=128 * 1024, shards_per_part=4),
        max_shard_bytes=1 << 20,
        final_wait_s=60,
        start_wait_s=60,
    )
    trainer = Trainer(trainer_id, tl_trainer, cfg)
    peers: list[InferencePeer] = []
    finished = trio.Event()

    async def run_trainer(task_status: TaskStatus[ShardcastNode]) -> None:
        await trainer.run(task_status=task_status)
        finished.set()

    with trio.fail_after(240):
        async with trio.open_nursery() as nursery:
            tnode = await nursery.start(run_trainer)
            taddr = tnode.p2p.multiaddrs()[0]
            relay = await nursery.start(_relay, tl, taddr, tmp / "relay")
            for ident, name in zip(peer_ids, names, strict=True):
                forgery = _inflate_rewards if name == "forger" else None
                # a peer knows the trainer's PeerID and one relay; run id and rules: the card
                card = await bootstrap_card(ident, (relay,), trainer_id.peer_id, retry_s=0.1)
                peer = InferencePeer(
                    ident,
                    tl,
                    PeerConfig(
                        node=NodeConfig("peer", card.card.run_id, tmp / name),
                        follow=FollowConfig(upstreams=(relay,), poll_interval_s=0.2),
                        card=card,
                        trainer_addrs=(taddr,),
                        task=task,
                        task_reward=task_reward,
                    ),
                    forgery=forgery,
                )
                peers.append(peer)
                await nursery.start(peer.run)
            await finished.wait()
            nursery.cancel_scope.cancel()
    return trainer, peers


def _inflate_rewards(batch: RolloutBatch) -> RolloutBatch:
    import dataclasses

    groups = tuple(
        dataclasses.replace(g, samples=tuple(dataclasses.replace(s, reward=1.0) for s in g.samples))
        for g in batch.groups
    )
    return dataclasses.replace(batch, groups=groups)


async def _relay(
    tl: TrustList,
    upstream: str,
    data: Path,
    *,
    task_status: TaskStatus[str] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with ShardcastNode.open(
        Identity.from_seed("loop-relay"), tl, NodeConfig("relay", "loop", data)
    ) as node:
        follower = Follower(
            node, FollowConfig(upstreams=(upstream,), poll_interval_s=0.2), random.Random(3)
        )
        async with trio.open_nursery() as nursery:
            await nursery.start(follower.run)
            task_status.started(node.p2p.multiaddrs()[0])


async def test_whole_loop_two_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    read: list[str] = []  # files the origin hashed from disk
    from_disk = plan.encode_file

    def spy(path: Path, *args: Any, **kwargs: Any) -> Any:
        read.append(path.name)
        return from_disk(path, *args, **kwargs)

    monkeypatch.setattr(plan, "encode_file", spy)
    trainer, peers = await _run_loop(tmp_path, steps=2)
    report = trainer.report()
    assert [r["step"] for r in report["steps"]] == [0, 1, 2]
    digests = {r["step"]: r["manifest_digest"] for r in report["steps"]}
    for peer in peers:
        got = {r.step: r.manifest_digest for r in peer.records}
        assert got == digests  # every version, verified, with the trainer's digest
        assert peer.config.sampling is None  # the rules came from the run card only
        assert peer.card_versions_used
        assert set(peer.card_versions_used) == {1}
        assert all(r["broadcast_s"] is not None for r in report["steps"])
    # every version's weight files were hashed and encoded from the tensors the trainer held
    # (versions 1 and 2 as deltas against the one before), none read back from disk, and
    # every peer verified them
    assert all(r["encoded_from_memory"] >= 1 for r in report["steps"])
    assert read
    assert not [n for n in read if n.endswith(".safetensors")]
    # every trained sample came from a verified batch; nothing was rejected
    assert report["trained_samples"] > 0
    assert report["trained_samples"] == report["trained_verified_samples"]
    assert report["validator"]["rejected_samples"] == {}
    for row in report["steps"][:-1]:
        assert row["rollouts_accepted"] >= 2 * SAMPLING.n_prompts * SAMPLING.group_size
        assert row["mean_reward"] is not None


async def test_whole_loop_own_qwen2_model_and_dataset_task(tmp_path: Path) -> None:
    """--model PATH (Qwen2, trained BPE tokenizer, chat template) and a dataset task: peers
    and the validator use the checkpoint's tokenizer; every batch verifies."""
    from rollout.model_dir import TOKENIZER_NAME, load_tokenizer
    from rollout.tasks.arithmetic import DATASET
    from tests.byo_models import write_model_dir

    src = write_model_dir(tmp_path / "qwen2", "qwen2")
    trainer, peers = await _run_loop(
        tmp_path, steps=1, model=src, task=str(DATASET), task_reward="numeric"
    )
    report = trainer.report()
    assert report["validator"]["rejected_samples"] == {}
    assert report["trained_samples"] == report["trained_verified_samples"] > 0
    for peer in peers:
        assert peer.node is not None
        path = peer.node.store.version_dir(1)
        assert (path / TOKENIZER_NAME).read_bytes() == (src / TOKENIZER_NAME).read_bytes()
        assert len(load_tokenizer(path)) > 128
        # a batch for every version trained on (the final one's is dropped if the run's end
        # comes first: the trainer trains on no more rollouts)
        assert all(r.generated for r in peer.records if r.step < 1)


async def test_forged_rewards_rejected_honest_peers_continue(tmp_path: Path) -> None:
    trainer, peers = await _run_loop(tmp_path, steps=3, forger=True)
    report = trainer.report()
    forger = peers[-1].identity.peer_id
    assert report["validator"]["rejected_samples"].get("reward", 0) > 0
    # two forged batches take the forger below the threshold: it is refused from then on
    assert report["reputation"]["scores"][forger] < 0.01
    assert forger in report["reputation"]["refused"]
    # honest peers kept contributing at every optimizer step
    for honest in peers[:2]:
        assert report["reputation"]["scores"].get(honest.identity.peer_id, 1.0) == 1.0
    assert all(row["rollouts_accepted"] > 0 for row in report["steps"][:-1])
    assert report["trained_samples"] == report["trained_verified_samples"] > 0
