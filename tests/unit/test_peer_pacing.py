"""The peer's paced generation (:meth:`shardnet.peer.InferencePeer._generate`) with a tiny model:
a newer verified version arriving mid-batch cuts it, and the validator accepts the cut batch
with every check, model checks included."""

from __future__ import annotations

import logging
import types
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from p2p.identity import Identity
from p2p.trust import TrustList
from rollout.batch import SamplingConfig
from rollout.engine import Generation, TransformersEngine
from rollout.model import build_model, build_tokenizer
from rollout.pacing import Pace, PacingConfig
from rollout.task import DEFAULT_TASK
from rollout.verify import Validator, ValidatorConfig
from shardcast.download.follower import FollowConfig
from shardcast.node.node import NodeConfig
from shardnet.peer import InferencePeer, PeerConfig
from trainer.checkpoint import save_checkpoint
from trainer.oracle import TrainerOracle

PEER = Identity.from_seed("pacing-peer")
TRAINER = Identity.from_seed("pacing-trainer")
SAMPLING = SamplingConfig(n_prompts=4, group_size=2, max_new_tokens=8)
DIGEST = "cd" * 32


class NewVersionAfter(TransformersEngine):
    """A real engine that, while generating group ``after``, lets ``on_group`` run (the
    follower committing a newer version meanwhile)."""

    def __init__(self, after: int, on_group: Any) -> None:
        super().__init__()
        self.calls, self.after, self.on_group = 0, after, on_group

    def generate(self, *args: Any, **kwargs: Any) -> Sequence[Generation]:  # type: ignore[override]
        self.calls += 1
        if self.calls == self.after:
            self.on_group()
        return super().generate(*args, **kwargs)


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Any, Path, TrainerOracle]]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("pacing")
    tok = build_tokenizer()
    save_checkpoint(build_model("tiny", seed=0), tok, root / "v0", 1 << 30)
    oracle = TrainerOracle(tok, DEFAULT_TASK, keep=2)
    oracle.add_version(0, DIGEST, root / "v0")
    yield tok, root, oracle
    torch.set_num_threads(previous)


def _peer(root: Path, engine: TransformersEngine, pacing: PacingConfig) -> InferencePeer:
    cfg = PeerConfig(
        node=NodeConfig("peer", "r", root / "peer"),
        follow=FollowConfig((f"/ip4/127.0.0.1/tcp/1/p2p/{TRAINER.peer_id}",)),
        pacing=pacing,
    )
    peer = InferencePeer(PEER, TrustList(TRAINER.peer_id), cfg, engine=engine)
    peer._latest = (types.SimpleNamespace(step=0), root / "v0")  # type: ignore[assignment]
    peer.pace.version_seen(0, 0.0)
    return peer


def _validator(oracle: TrainerOracle) -> Validator:
    cfg = ValidatorConfig(
        run_id="r",
        task=DEFAULT_TASK.name,
        n_prompts=SAMPLING.n_prompts,
        group_size=SAMPLING.group_size,
        max_new_tokens=SAMPLING.max_new_tokens,
        temperature=SAMPLING.temperature,
    )
    return Validator(cfg, oracle)


@pytest.mark.parametrize("enabled", [True, False])
async def test_a_newer_version_cuts_the_batch(
    world: tuple[Any, Path, TrainerOracle], enabled: bool
) -> None:
    tok, root, oracle = world
    peer: InferencePeer | None = None

    def commit_v1() -> None:
        assert peer is not None
        peer._latest = (types.SimpleNamespace(step=1), root / "v1")  # type: ignore[assignment]

    engine = NewVersionAfter(2, commit_v1)
    engine.load(root / "v0")
    peer = _peer(root, engine, PacingConfig(enabled=enabled))
    batch, pace = await peer._generate(0, DIGEST, tok, SAMPLING, async_level=2)
    assert batch is not None
    if enabled:  # group 1 was under way when version 1 came: two groups, then the cut
        assert pace is Pace.NEWER_VERSION
        assert [g.prompt_index for g in batch.groups] == [0, 1]
    else:
        assert pace is Pace.COMPLETE
        assert len(batch.groups) == SAMPLING.n_prompts
    assert peer.pace.group_estimate_s is not None
    verdict = _validator(oracle).check(batch, sender=PEER.peer_id, current_step=1)
    assert verdict.accepted, verdict
    assert verdict.samples == len(batch.groups) * SAMPLING.group_size


async def test_no_newer_version_gives_a_whole_batch(
    world: tuple[Any, Path, TrainerOracle],
) -> None:
    tok, root, _ = world
    engine = TransformersEngine()
    engine.load(root / "v0")
    peer = _peer(root, engine, PacingConfig())
    batch, pace = await peer._generate(0, DIGEST, tok, SAMPLING, async_level=2)
    assert pace is Pace.COMPLETE
    assert batch is not None
    assert len(batch.groups) == SAMPLING.n_prompts


async def test_a_run_end_during_a_batch_drops_it(
    world: tuple[Any, Path, TrainerOracle], caplog: pytest.LogCaptureFixture
) -> None:
    """The trainer's run end arrives while group 1 is generated: no more groups, and the
    batch is not handed over (the trainer trains on no more rollouts)."""
    tok, root, _ = world
    node = types.SimpleNamespace(finished=None)

    def finish() -> None:
        node.finished = object()

    engine = NewVersionAfter(2, finish)
    engine.load(root / "v0")
    peer = _peer(root, engine, PacingConfig())
    peer.node = node  # type: ignore[assignment]
    caplog.set_level(logging.INFO, logger="shardnet.peer")
    batch, pace = await peer._generate(0, DIGEST, tok, SAMPLING, async_level=2)
    assert (batch, pace) == (None, Pace.RUN_FINISHED)
    assert engine.calls == 2  # the group under way was finished, no third one started
    assert peer.batches_by_pace == {"run_finished": 1}
    assert f"batch_dropped step=0 groups=2 of={SAMPLING.n_prompts} reason=run_finished" in (
        caplog.text
    )
