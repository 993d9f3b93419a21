"""The validation pipeline: every check passes an honest batch and rejects a tampered one."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from p2p.identity import Identity
from rollout.batch import SamplingConfig, build_batch
from rollout.engine import TransformersEngine
from rollout.model import build_model, build_tokenizer
from rollout.schema import RolloutBatch, Sample
from rollout.task import DEFAULT_TASK
from rollout.verify import Validator, ValidatorConfig
from trainer.checkpoint import save_checkpoint
from trainer.oracle import TrainerOracle

PEER = Identity.from_seed("verify-peer")
SAMPLING = SamplingConfig(n_prompts=2, group_size=3, max_new_tokens=40)
DIGEST = "ab" * 32


@pytest.fixture(scope="module")
def world(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[TrainerOracle, RolloutBatch, Path]]:
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("verify")
    tok = build_tokenizer()
    save_checkpoint(build_model("tiny", seed=0), tok, root / "v0", 1 << 30)
    save_checkpoint(build_model("tiny", seed=1), tok, root / "other", 1 << 30)
    oracle = TrainerOracle(tok, DEFAULT_TASK, keep=3)
    oracle.add_version(0, DIGEST, root / "v0")
    engine = TransformersEngine()
    engine.load(root / "v0")
    batch = build_batch(
        engine,
        tok,
        DEFAULT_TASK,
        peer_id=PEER.peer_id,
        run_id="r",
        step=0,
        manifest_digest=DIGEST,
        cfg=SAMPLING,
    )
    return oracle, batch, root


def _validator(oracle: TrainerOracle, **kw: object) -> Validator:
    cfg = ValidatorConfig(
        run_id="r",
        task=DEFAULT_TASK.name,
        n_prompts=SAMPLING.n_prompts,
        group_size=SAMPLING.group_size,
        max_new_tokens=SAMPLING.max_new_tokens,
        temperature=SAMPLING.temperature,
        **kw,
    )  # type: ignore[arg-type]
    return Validator(cfg, oracle)


def _map_samples(batch: RolloutBatch, fn: object) -> RolloutBatch:
    groups = tuple(
        dataclasses.replace(g, samples=tuple(fn(s) for s in g.samples))  # type: ignore[operator]
        for g in batch.groups
    )
    return dataclasses.replace(batch, groups=groups)


def test_honest_batch_passes_every_check(world: tuple[TrainerOracle, RolloutBatch, Path]) -> None:
    oracle, batch, _ = world
    v = _validator(oracle)
    verdict = v.check(
        RolloutBatch.decode(batch.encode(), vocab_size=oracle.vocab_size),
        sender=PEER.peer_id,
        current_step=0,
    )
    assert verdict.accepted, verdict
    assert v.statistics().accepted_samples == batch.n_samples
    # async window: still fine two steps later, not three
    v2 = _validator(oracle)
    assert v2.check(batch, sender=PEER.peer_id, current_step=2).accepted
    assert (
        _validator(oracle).check(batch, sender=PEER.peer_id, current_step=3).reason == "stale_step"
    )


def _reason(
    oracle: TrainerOracle,
    batch: RolloutBatch,
    sender: str = PEER.peer_id,
    step: int = 0,
    **kw: object,
) -> str:
    v = _validator(oracle, **kw)
    verdict = v.check(batch, sender=sender, current_step=step)
    assert not verdict.accepted
    assert v.statistics().rejected_samples == {verdict.reason: batch.n_samples}
    return verdict.reason


def test_each_check_rejects(world: tuple[TrainerOracle, RolloutBatch, Path]) -> None:
    oracle, batch, _ = world
    other = Identity.from_seed("someone-else").peer_id
    assert _reason(oracle, batch, sender=other) == "untrusted"
    v = Validator(_validator(oracle).config, oracle, allowed=lambda p: False)
    assert v.check(batch, sender=PEER.peer_id, current_step=0).reason == "untrusted"
    assert _reason(oracle, dataclasses.replace(batch, run_id="x")) == "wrong_run"
    assert _reason(oracle, dataclasses.replace(batch, temperature=0.7)) == "wrong_run"
    assert _reason(oracle, dataclasses.replace(batch, policy_step=1), step=5) == "stale_step"
    assert (
        _reason(oracle, dataclasses.replace(batch, manifest_digest="cd" * 32)) == "unknown_weights"
    )
    # prompts: swapped group order keeps indices but changes which prompt is where
    g0, g1 = batch.groups
    swapped = dataclasses.replace(
        batch, groups=(dataclasses.replace(g0, prompt_ids=g1.prompt_ids), g1)
    )
    assert _reason(oracle, swapped) == "prompt"
    assert _reason(oracle, dataclasses.replace(batch, groups=(g0,))) == "prompt"

    # termination: drop the EOS of a "stop" sample, or claim "stop" for a capped one
    def cut(s: Sample) -> Sample:
        if s.finish_reason == "stop":
            return dataclasses.replace(s, completion_ids=(*s.completion_ids[:-1], 5))
        return dataclasses.replace(s, finish_reason="stop")

    assert _reason(oracle, _map_samples(batch, cut)) == "termination"
    # inflated rewards
    assert (
        _reason(oracle, _map_samples(batch, lambda s: dataclasses.replace(s, reward=1.0)))
        == "reward"
    )


def test_duplicate_batch_rejected(world: tuple[TrainerOracle, RolloutBatch, Path]) -> None:
    oracle, batch, _ = world
    v = _validator(oracle)
    assert v.check(batch, sender=PEER.peer_id, current_step=0).accepted
    assert v.check(batch, sender=PEER.peer_id, current_step=0).reason == "duplicate"


def test_toploc_rejects_other_model_and_bad_proofs(
    world: tuple[TrainerOracle, RolloutBatch, Path],
) -> None:
    oracle, batch, root = world
    # the same completions, proven with another model's activations
    tok = build_tokenizer()
    engine = TransformersEngine()
    engine.load(root / "other")
    forged = build_batch(
        engine,
        tok,
        DEFAULT_TASK,
        peer_id=PEER.peer_id,
        run_id="r",
        step=0,
        manifest_digest=DIGEST,
        cfg=SAMPLING,
    )
    assert _reason(oracle, forged) == "toploc"

    # corrupted and truncated proofs
    def flip(s: Sample) -> Sample:
        p = bytearray(s.proof)
        p[10] ^= 0xFF
        return dataclasses.replace(s, proof=bytes(p))

    assert _reason(oracle, _map_samples(batch, flip)) == "toploc"
    assert (
        _reason(oracle, _map_samples(batch, lambda s: dataclasses.replace(s, proof=s.proof[:-1])))
        == "toploc"
    )
    assert (
        _reason(oracle, _map_samples(batch, lambda s: dataclasses.replace(s, proof=s.proof[:258])))
        == "toploc"
    )
    assert (
        _reason(oracle, _map_samples(batch, lambda s: dataclasses.replace(s, proof=b"")))
        == "toploc"
    )


def test_sampling_check(world: tuple[TrainerOracle, RolloutBatch, Path]) -> None:
    oracle, batch, _ = world
    shifted = _map_samples(
        batch,
        lambda s: dataclasses.replace(s, logprobs=tuple(min(0.0, x + 0.5) for x in s.logprobs)),
    )
    assert _reason(oracle, shifted) == "sampling"


def test_crashing_check_is_a_rejection(world: tuple[TrainerOracle, RolloutBatch, Path]) -> None:
    oracle, batch, _ = world
    v = _validator(oracle)

    def boom(*_a: object) -> None:
        raise RuntimeError("bug in a check")

    v.checks.insert(0, ("boom", boom))  # type: ignore[arg-type]
    verdict = v.check(batch, sender=PEER.peer_id, current_step=0)
    assert (verdict.accepted, verdict.reason) == (False, "check_error")
