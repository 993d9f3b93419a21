"""The validation pipeline: every check passes an honest batch and rejects a tampered one."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from p2p.errors import ConfigError
from p2p.identity import Identity
from rollout.batch import SamplingConfig, build_batch
from rollout.engine import (
    TeacherForced,
    TransformersEngine,
    prefill_activations_batch,
    sample_group,
)
from rollout.gumbel import NoiseKey, group_seed
from rollout.model import build_model, build_tokenizer, load_model
from rollout.schema import RolloutBatch, Sample
from rollout.task import DEFAULT_TASK
from rollout.toploc import build_proofs
from rollout.validator_engines import ValidatorEngineUnavailable, require_validator_engines
from rollout.verify import VLLM_BF16_PROFILE, Validator, ValidatorConfig
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
    # a partial batch (the first k prompts, rollout.pacing) passes every check too
    partial = dataclasses.replace(batch, groups=batch.groups[:1])
    assert _validator(oracle).check(partial, sender=PEER.peer_id, current_step=0).accepted


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
    assert _reason(oracle, dataclasses.replace(batch, groups=(g1,))) == "prompt"  # not a prefix

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


def test_duplicate_batch_rejected(
    world: tuple[TrainerOracle, RolloutBatch, Path], caplog: pytest.LogCaptureFixture
) -> None:
    oracle, batch, _ = world
    v = _validator(oracle)
    assert v.check(batch, sender=PEER.peer_id, current_step=0).accepted
    with caplog.at_level(logging.INFO, logger="rollout.verify"):
        assert v.check(batch, sender=PEER.peer_id, current_step=0).reason == "duplicate"
        bad = dataclasses.replace(batch, policy_step=7)
        assert not v.check(bad, sender=PEER.peer_id, current_step=0).accepted
    # a duplicate is routine (INFO); any other rejection is a WARNING
    levels = [(r.levelno, "reason=duplicate" in r.getMessage()) for r in caplog.records]
    assert levels == [(logging.INFO, True), (logging.WARNING, False)]


def test_partial_batch_twice_for_one_step_is_a_duplicate(
    world: tuple[TrainerOracle, RolloutBatch, Path],
) -> None:
    """Exactly once per (submitter, step), whatever k: a partial batch sent twice, or followed
    by the rest of its prompts or by the whole batch, is never trained on twice."""
    oracle, batch, _ = world
    partial = dataclasses.replace(batch, groups=batch.groups[:1])
    v = _validator(oracle)
    assert v.check(partial, sender=PEER.peer_id, current_step=0).accepted
    assert v.check(partial, sender=PEER.peer_id, current_step=0).reason == "duplicate"
    assert v.check(batch, sender=PEER.peer_id, current_step=0).reason == "duplicate"
    rest = dataclasses.replace(batch, groups=batch.groups[1:])  # prompt 1 without prompt 0
    assert v.check(rest, sender=PEER.peer_id, current_step=0).reason in ("duplicate", "prompt")
    stats = v.statistics()
    assert stats.accepted_samples == partial.n_samples
    assert sum(stats.rejected_samples.values()) == 2 * batch.n_samples


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


def _rebuilt(
    oracle: TrainerOracle, batch: RolloutBatch, ids: dict[tuple[int, int], tuple[int, ...]]
) -> RolloutBatch:
    """The strongest forger: replace some completions (``(group, sample) -> ids``) and
    recompute everything else with the right model: TOPLOC proofs, logprobs, rewards."""
    groups = []
    for gi, g in enumerate(batch.groups):
        comps = [ids.get((gi, si), s.completion_ids) for si, s in enumerate(g.samples)]
        tfs = oracle.prefill_group(0, g.prompt_ids, comps, batch.temperature)
        samples = []
        for _s, c, tf in zip(g.samples, comps, tfs, strict=True):
            proof = b"".join(build_proofs(tf.prefill_bits, tf.decode_bits, SAMPLING.toploc))
            reward = oracle.reward(
                c, submitter=batch.submitter, step=0, prompt_index=g.prompt_index, n_prompts=2
            )
            fin = "stop" if c[-1] == oracle.eos_id else "length"
            samples.append(Sample(tuple(c), tuple(tf.logprobs), reward, fin, proof))
        groups.append(dataclasses.replace(g, samples=tuple(samples)))
    return dataclasses.replace(batch, groups=tuple(groups))


class _StandInTeacher:
    """A ``vllm-bf16`` validator path that runs the transformers pass (no vLLM here)."""

    def __init__(self) -> None:
        self.calls = 0

    def prefill_batch(
        self,
        checkpoint_dir: str | Path,
        items: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float,
        keys: Sequence[NoiseKey] | None = None,
    ) -> list[TeacherForced]:
        self.calls += 1
        model = load_model(Path(checkpoint_dir))
        return prefill_activations_batch(model, items, temperature, keys)

    def close(self) -> None:
        pass


def _with_teacher(oracle: TrainerOracle, root: Path) -> TrainerOracle:
    both = ("transformers-bf16", "vllm-bf16")
    out = TrainerOracle(oracle.tokenizer, DEFAULT_TASK, 3, both, vllm_teacher=_StandInTeacher())
    out.add_version(0, DIGEST, root / "v0")
    return out


def test_vllm_path_required(world: tuple[TrainerOracle, RolloutBatch, Path]) -> None:
    """A run accepting vllm-bf16 on a node without vLLM is a configuration error (field
    ``engines``), never a silent fallback to the transformers numerics."""
    require_validator_engines(["transformers-bf16"], vllm_installed=lambda: False)
    with pytest.raises(ValidatorEngineUnavailable, match="vLLM is not installed"):
        require_validator_engines(["vllm-bf16"], vllm_installed=lambda: False)
    with pytest.raises(ValidatorEngineUnavailable, match="no validator path"):
        require_validator_engines(["sglang-bf16"], vllm_installed=lambda: True)
    assert issubclass(ValidatorEngineUnavailable, ConfigError)


def test_engine_id_must_be_the_runs(world: tuple[TrainerOracle, RolloutBatch, Path]) -> None:
    oracle, batch, root = world
    assert batch.engine == "transformers-bf16"
    assert _reason(oracle, dataclasses.replace(batch, engine="vllm-bf16")) == "wrong_run"
    assert _reason(oracle, dataclasses.replace(batch, engine="")) == "wrong_run"  # schema 1
    both = ("transformers-bf16", "vllm-bf16")
    relabelled = dataclasses.replace(batch, engine="vllm-bf16")
    # the oracle reproduces a vllm-bf16 batch on its vLLM path only: without one it refuses
    assert _reason(oracle, relabelled, engines=both) == "check_error"
    # a stand-in vLLM path (the transformers pass) shows each engine's routing and profile
    oracle = _with_teacher(oracle, root)
    v = _validator(oracle, engines=both)
    assert v.check(relabelled, sender=PEER.peer_id, current_step=0).accepted
    # each engine is judged with its own profile
    base = v.config.default_profile()
    strict = dataclasses.replace(base, eos_min_prob=0.5)
    assert (
        _reason(oracle, relabelled, engines=both, profiles={"vllm-bf16": strict}) == "termination"
    )
    assert (
        _validator(oracle, engines=both, profiles={"vllm-bf16": strict})
        .check(batch, sender=PEER.peer_id, current_step=0)
        .accepted
    )
    teacher = oracle.vllm_teacher
    assert isinstance(teacher, _StandInTeacher)
    assert teacher.calls == 2
    assert v.config.profile("vllm-bf16") == VLLM_BF16_PROFILE  # the calibrated default


def test_eos_probability_floor(world: tuple[TrainerOracle, RolloutBatch, Path]) -> None:
    oracle, batch, _ = world
    assert any(s.finish_reason == "stop" for g in batch.groups for s in g.samples)
    assert _reason(oracle, batch, eos_min_prob=0.5) == "termination"


def _tampered(batch: RolloutBatch, where: str) -> tuple[tuple[int, int], tuple[int, ...]]:
    for gi, g in enumerate(batch.groups):
        for si, s in enumerate(g.samples):
            ids = list(s.completion_ids)
            if len(ids) < 5 or (where == "last" and s.finish_reason != "length"):
                continue
            j = {"first": 0, "middle": len(ids) // 2, "last": len(ids) - 1}[where]
            if where != "last" and ids[j] == 2:
                continue
            ids[j] = 40 + (ids[j] + 7) % 60  # a printable character, never EOS
            return (gi, si), tuple(ids)
    raise AssertionError(f"no sample to tamper at the {where} position")


@pytest.mark.parametrize("where", ["first", "middle", "last"])
def test_replay_rejects_a_tampered_token(
    world: tuple[TrainerOracle, RolloutBatch, Path], where: str
) -> None:
    oracle, batch, _ = world
    key, ids = _tampered(batch, where)
    forged = _rebuilt(oracle, batch, {key: ids})
    assert _reason(oracle, forged) == "replay"
    # the rest of the forgery is perfect: without the replay check it would pass
    assert (
        _validator(oracle, replay_margin=1e9)
        .check(forged, sender=PEER.peer_id, current_step=0)
        .accepted
    )


@pytest.mark.parametrize(
    ("temperature", "margin"), [(1e-4, None), (0.5, None), (2.0, 0.05), (0.8, 0.02)]
)
def test_replay_rejects_greedy_and_other_temperatures(
    world: tuple[TrainerOracle, RolloutBatch, Path], temperature: float, margin: float | None
) -> None:
    """Right noise keys, wrong temperature (1e-4 is greedy decoding); every proof, logprob
    and reward recomputed at the run's temperature. The untrained test model's logits are
    nearly flat, so a hotter (or slightly colder) sampler with the right noise stays within
    the transformers profile's replay margin (worst gap 0.40 at T = 2, 0.11 at T = 0.8); a margin
    fitted to this model's honest gaps (max 0.0027) catches it."""
    oracle, batch, _ = world
    model = oracle._model(0)
    ids = {}
    for gi, g in enumerate(batch.groups):
        seed = group_seed("r", PEER.peer_id, 0, g.prompt_index)
        gens = sample_group(
            model, g.prompt_ids, len(g.samples), 40, temperature, seed, oracle.eos_id
        )
        for si, gen in enumerate(gens):
            ids[(gi, si)] = tuple(gen.completion_ids)
    forged = _rebuilt(oracle, batch, ids)
    if margin is None:
        assert _reason(oracle, forged) == "replay"
    else:
        assert _reason(oracle, forged, replay_margin=margin) == "replay"


def test_a_loaded_profile_judges_its_engine(
    world: tuple[TrainerOracle, RolloutBatch, Path], tmp_path: Path
) -> None:
    """A calibrated profile file (``--validator-profile``) overrides the built-in thresholds
    of its engine: an honest statistic between the two limits (here the EOS probability of a
    ``stop`` ending, above the default floor 1e-6 and below the profile's) flips the verdict."""
    from rollout.calibrate import Provenance, ValidatorProfile, load_profile, write_profile

    oracle, batch, _ = world
    assert any(s.finish_reason == "stop" for g in batch.groups for s in g.samples)
    default = _validator(oracle)
    assert default.config.profile("transformers-bf16").eos_min_prob == 1e-6
    assert default.check(batch, sender=PEER.peer_id, current_step=0).accepted
    calibrated = dataclasses.replace(default.config.default_profile(), eos_min_prob=0.5)
    path = tmp_path / "profile.json"
    write_profile(
        path,
        ValidatorProfile(
            "cd" * 32,
            {"transformers-bf16": calibrated, "vllm-bf16": VLLM_BF16_PROFILE},
            Provenance("tiny", 18, 0, "2026-12-01T20:00:00Z"),
        ),
    )
    profiles = load_profile(path).for_engines(("transformers-bf16",))
    assert _reason(oracle, batch, profiles=profiles) == "termination"
    # the other way: a profile looser than the defaults accepts what they reject
    strict = dataclasses.replace(calibrated, eos_min_prob=0.0)
    assert _reason(oracle, batch, eos_min_prob=0.5) == "termination"
    assert (
        _validator(oracle, eos_min_prob=0.5, profiles={"transformers-bf16": strict})
        .check(batch, sender=PEER.peer_id, current_step=0)
        .accepted
    )
