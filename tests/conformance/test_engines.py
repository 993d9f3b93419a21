"""One conformance suite for every inference engine (``rollout.engine.Engine``), tiny preset.

Each test runs once per engine: ``transformers`` (always) and ``vllm`` (marked ``vllm``;
skipped when the optional extra is not installed). Run the vLLM cases with the vllm venv::

    /work/vllm-venv/bin/python -m pytest tests/conformance -m vllm -p no:cacheprovider

What every engine must do: shapes and determinism under a fixed seed; seeded Gumbel-max
sampling (every token is :func:`rollout.gumbel.gumbel_argmax` of the engine's logits with
``NoiseKey(seed, i)``, so a group's samples replay under the validator, and a vLLM sample's
tokens are the transformers engine's wherever the two engines' logits do not nearly tie);
after a swap to version B, the same outputs as a fresh engine started on B; honest rollouts
pass the validator's TOPLOC, replay and sampling checks with the default thresholds (and
fail them against another model); checkpoints with a missing or mis-shaped tensor are
rejected with ``CheckpointMismatch``.

After a rejected checkpoint both engines keep serving the old version (``KEEPS_SERVING``); an
engine whose swap failed half-way fails closed instead (see each engine's ``load``).
Only one vLLM engine may be live per process, so tests close engines they start themselves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from p2p.errors import LocalProtocolError
from p2p.identity import Identity
from rollout.batch import SamplingConfig, build_batch
from rollout.delta_plan import DeltaMismatch, MismatchReason, TensorPatch, UpdatePlan
from rollout.engine import Engine, Generation, InPlaceEngine, TransformersEngine
from rollout.engine_vllm import VllmEngine, vllm_available
from rollout.model import (
    INDEX_NAME,
    SINGLE_WEIGHTS_NAME,
    CheckpointMismatch,
    build_model,
    build_tokenizer,
    load_model,
    preset_config,
    stored_state,
)
from rollout.schema import RolloutBatch
from rollout.task import DEFAULT_TASK, prompts_for
from rollout.toploc import verify_proofs
from rollout.toploc_codec import proof_size_bytes
from rollout.validator_engines import VllmTeacher
from rollout.verify import Validator, ValidatorConfig
from shardnet.engine_update import SwapPath
from tests.delta_chain import Chain
from trainer.checkpoint import save_checkpoint
from trainer.oracle import TrainerOracle

H = 128  # tiny preset hidden size
PEER = Identity.from_seed("conformance-peer")
SAMPLING = SamplingConfig(n_prompts=2, group_size=4, max_new_tokens=40)
DIGEST = "ab" * 32
KEEPS_SERVING = {"transformers": True, "vllm": True}
AUTO_MODEL: Any = AutoModelForCausalLM  # untyped factory
ENGINES = ["transformers", pytest.param("vllm", marks=pytest.mark.vllm)]


@dataclass(frozen=True)
class Ckpts:
    a: Path  # seed 0, one model.safetensors
    b: Path  # seed 1, sharded with an index
    b_single: Path  # seed 1, one model.safetensors
    other_config: Path  # 2 layers instead of 4
    missing: Path  # B without one tensor
    wrong_shape: Path  # B with one tensor of another shape


def _strip(src: Path, dst: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    """Copy checkpoint ``src`` (single file) to ``dst`` with its tensors edited."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / SINGLE_WEIGHTS_NAME))
    edit(tensors)
    save_file(tensors, str(dst / SINGLE_WEIGHTS_NAME), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> Ckpts:
    root = tmp_path_factory.mktemp("engines")
    tok = build_tokenizer()
    save_checkpoint(build_model("tiny", 0, torch.float32), tok, root / "a", 1 << 30)
    save_checkpoint(build_model("tiny", 1, torch.float32), tok, root / "b", 256 << 10)
    assert (root / "b" / INDEX_NAME).is_file()
    save_checkpoint(build_model("tiny", 1, torch.float32), tok, root / "b1", 1 << 30)
    config = preset_config("tiny")
    config.num_hidden_layers = 2
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        small = AUTO_MODEL.from_config(config, dtype=torch.float32)
    save_checkpoint(small, tok, root / "other_config", 1 << 30)

    def drop(t: dict[str, torch.Tensor]) -> None:
        del t["model.layers.1.mlp.up_proj.weight"]

    def reshape(t: dict[str, torch.Tensor]) -> None:
        t["model.layers.2.self_attn.k_proj.weight"] = t[
            "model.layers.2.self_attn.q_proj.weight"
        ].clone()

    return Ckpts(
        root / "a",
        root / "b",
        root / "b1",
        root / "other_config",
        _strip(root / "b1", root / "missing", drop),
        _strip(root / "b1", root / "wrong_shape", reshape),
    )


def _new_engine(kind: str, in_place: bool = False) -> Engine:
    if kind == "vllm":  # tiny preset: read every column back
        return VllmEngine(verify_columns=4096, keep_host_copy=in_place)
    return TransformersEngine()


def _close(engine: Engine) -> None:
    close = getattr(engine, "close", None)
    if close is not None:
        close()


@pytest.fixture(scope="module", params=ENGINES)
def kind(request: pytest.FixtureRequest) -> str:
    name: str = request.param
    if name == "vllm" and not vllm_available():
        pytest.skip("vllm is not installed (install it with .ci/install-vllm)")
    return name


@pytest.fixture(scope="module")
def engine(kind: str, ckpts: Ckpts) -> Iterator[Engine]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    eng = _new_engine(kind)
    eng.load(ckpts.a)
    yield eng
    _close(eng)
    torch.set_num_threads(previous)


def _prompt(i: int = 0) -> list[int]:
    ids: list[int] = build_tokenizer()(prompts_for("conformance", 0, i + 1)[i])["input_ids"]
    return ids


def _same(a: list[Generation], b: list[Generation]) -> bool:
    return len(a) == len(b) and all(
        x.completion_ids == y.completion_ids
        and x.logprobs == y.logprobs
        and x.finish_reason == y.finish_reason
        and np.array_equal(x.prefill_bits, y.prefill_bits)
        and np.array_equal(x.decode_bits, y.decode_bits)
        for x, y in zip(a, b, strict=True)
    )


def _sample(engine: Engine) -> list[Generation]:
    return engine.generate(_prompt(), n=4, max_new_tokens=16, temperature=1.0, seed=11)


def test_shapes_and_stop_rules(engine: Engine) -> None:
    prompt = _prompt(1)
    gens = engine.generate(prompt, n=6, max_new_tokens=24, temperature=0.8, seed=3)
    assert len(gens) == 6
    for g in gens:
        n = len(g.completion_ids)
        assert g.prompt_ids == prompt
        assert 1 <= n <= 24
        assert len(g.logprobs) == n
        assert all(lp <= 0.0 for lp in g.logprobs)
        assert g.prefill_bits.shape == (len(prompt), H)
        assert g.decode_bits.shape == (n - 1, H)
        assert g.prefill_bits.dtype == np.uint16
        assert g.decode_bits.dtype == np.uint16
        assert all(0 <= t < 128 for t in g.completion_ids)
        assert 2 not in g.completion_ids[:-1]
        assert (g.finish_reason == "stop") == (g.completion_ids[-1] == 2)
        assert g.finish_reason == "stop" or n == 24


def test_deterministic_under_fixed_seed(engine: Engine) -> None:
    a, b = _sample(engine), _sample(engine)
    c = engine.generate(_prompt(), n=4, max_new_tokens=16, temperature=1.0, seed=12)
    assert _same(a, b)
    assert [g.completion_ids for g in a] != [g.completion_ids for g in c]
    assert len({tuple(g.completion_ids) for g in a}) > 1  # samples of a group differ


def test_swap_equals_fresh_engine(kind: str, engine: Engine, ckpts: Ckpts) -> None:
    on_a = _sample(engine)
    engine.load(ckpts.b)
    on_b = _sample(engine)
    assert [g.completion_ids for g in on_b] != [g.completion_ids for g in on_a]
    engine.load(ckpts.a)
    assert _same(_sample(engine), on_a)  # swapping back restores A exactly
    _close(engine)  # one vLLM engine per process
    fresh = _new_engine(kind)
    try:
        fresh.load(ckpts.b)
        assert _same(_sample(fresh), on_b)
    finally:
        _close(fresh)
        engine.load(ckpts.a)


def _assert_holds(kind: str, engine: Engine, directory: Path) -> None:
    """The engine's weights are bit for bit those of loading ``directory``."""
    if isinstance(engine, VllmEngine):  # every value, repacked linears through their kernel
        assert engine.verify(directory, columns=4096) > 0
        return
    assert isinstance(engine, TransformersEngine)
    want = stored_state(load_model(directory))
    got = stored_state(engine.model)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[n].view(torch.int16), want[n].view(torch.int16)) for n in want)


def test_in_place_update_is_bit_identical_to_loading(
    kind: str, engine: Engine, ckpts: Ckpts, tmp_path: Path
) -> None:
    """Next versions applied in place from their sparse deltas (shardnet.engine_update) leave
    the engine holding exactly the materialized version's weights and generating as a fresh
    engine started on it; a plan that does not fit raises and keeps the old weights."""
    chain = Chain(tmp_path, torch.bfloat16, steps=2, small=True)
    dirs = [chain.store.version_dir(s) for s in range(3)]
    _close(engine)  # one vLLM engine per process
    updating = _new_engine(kind, in_place=True)
    try:
        assert isinstance(updating, InPlaceEngine)
        held = chain.swap(updating, 0, None).held
        for step in (1, 2):
            result = chain.swap(updating, step, held)
            assert result.path is SwapPath.IN_PLACE, result.fallback
            _assert_holds(kind, updating, dirs[step])
            held = result.held
        on_2 = _sample(updating)
        one = (np.zeros(1, np.int64), np.ones(1, np.uint16), np.zeros(0, np.int64))
        good = TensorPatch(
            "model.embed_tokens.weight", "BF16", (128, 128), *one, np.zeros(0, np.uint8)
        )
        bad = TensorPatch("model.norm.weight", "BF16", (64,), *one, np.zeros(0, np.uint8))
        with pytest.raises(DeltaMismatch) as err:
            updating.apply_update(UpdatePlan((good, bad)), dirs[1])
        assert err.value.reason is MismatchReason.SHAPE
        _assert_holds(kind, updating, dirs[2])
        assert _same(_sample(updating), on_2)
    finally:
        _close(updating)
    fresh = _new_engine(kind)
    try:
        fresh.load(dirs[2])
        assert _same(_sample(fresh), on_2)
    finally:
        _close(fresh)
        engine.load(ckpts.a)


def test_config_change_restarts(engine: Engine, ckpts: Ckpts) -> None:
    on_a = _sample(engine)
    engine.load(ckpts.other_config)
    g = engine.generate(_prompt(), 2, 8, 1.0, 0)
    assert g[0].prefill_bits.shape == (len(_prompt()), H)
    engine.load(ckpts.a)
    assert _same(_sample(engine), on_a)


@pytest.mark.parametrize("bad", ["missing", "wrong_shape"])
def test_bad_checkpoint_rejected(kind: str, engine: Engine, ckpts: Ckpts, bad: str) -> None:
    on_a = _sample(engine)
    with pytest.raises(CheckpointMismatch):
        engine.load(getattr(ckpts, bad))
    if KEEPS_SERVING[kind]:
        assert _same(_sample(engine), on_a)  # the old version keeps serving, untouched
    else:
        with pytest.raises(LocalProtocolError):
            _sample(engine)  # fails closed until the next good load
        engine.load(ckpts.a)
        assert _same(_sample(engine), on_a)


def test_bad_arguments(engine: Engine) -> None:
    for args in [([], 1, 4, 1.0), (_prompt(), 0, 4, 1.0), (_prompt(), 1, 0, 1.0)]:
        with pytest.raises(LocalProtocolError):
            engine.generate(*args, seed=0)
    with pytest.raises(LocalProtocolError):
        engine.generate(_prompt(), 1, 4, 0.0, seed=0)
    with pytest.raises(LocalProtocolError):
        engine.generate([1, 500], 1, 4, 1.0, seed=0)


def _batch(engine: Engine, step: int = 0, kind: str = "transformers") -> RolloutBatch:
    return build_batch(
        engine,
        build_tokenizer(),
        DEFAULT_TASK,
        peer_id=PEER.peer_id,
        run_id="r",
        step=step,
        manifest_digest=DIGEST,
        cfg=SAMPLING,
        engine_id=f"{kind}-bf16",
    )


def _validator(oracle: TrainerOracle) -> Validator:
    cfg = ValidatorConfig(
        run_id="r",
        task=DEFAULT_TASK.name,
        n_prompts=SAMPLING.n_prompts,
        group_size=SAMPLING.group_size,
        max_new_tokens=SAMPLING.max_new_tokens,
        temperature=SAMPLING.temperature,
        engines=("transformers-bf16", "vllm-bf16"),
    )
    return Validator(cfg, oracle)


def _statistics(oracle: TrainerOracle, batch: RolloutBatch) -> dict[str, float]:
    """Worst TOPLOC chunk statistics and logprob differences of ``batch`` against the oracle."""
    psize = proof_size_bytes(SAMPLING.toploc.topk)
    worst = {"exp": 0.0, "mean": 0.0, "median": 0.0, "dlogp_mean": 0.0, "dlogp_max": 0.0}
    for g in batch.groups:
        for s in g.samples:
            pre, dec, logprobs = oracle.prefill(0, g.prompt_ids, s.completion_ids, 1.0)
            proofs = [s.proof[i : i + psize] for i in range(0, len(s.proof), psize)]
            for r in verify_proofs(pre, dec, proofs, SAMPLING.toploc):
                worst["exp"] = max(worst["exp"], r.exp_mismatches)
                worst["mean"] = max(worst["mean"], r.mant_err_mean)
                worst["median"] = max(worst["median"], r.mant_err_median)
            diffs = np.abs(np.subtract(s.logprobs, logprobs))
            worst["dlogp_mean"] = max(worst["dlogp_mean"], float(diffs.mean()))
            worst["dlogp_max"] = max(worst["dlogp_max"], float(diffs.max()))
    return worst


def test_honest_rollouts_pass_the_validator(kind: str, engine: Engine, ckpts: Ckpts) -> None:
    """Default thresholds (TOPLOC paper: 38 exponent mismatches, mantissa mean 10, median 8;
    logprobs mean 0.05, max 1.0). The same rollouts fail against another model's weights."""
    batch = _batch(engine, kind=kind)
    assert batch.engine == f"{kind}-bf16"
    oracle = _oracle(kind, engine, ckpts.a)
    verdict = _validator(oracle).check(batch, sender=PEER.peer_id, current_step=0)
    stats = _statistics(oracle, batch)
    print(f"engine={kind} worst chunk and logprob differences vs the validator: {stats}")
    assert verdict.accepted, (verdict, stats)
    wrong = _oracle(kind, engine, ckpts.b)
    try:
        assert _validator(wrong).check(batch, sender=PEER.peer_id, current_step=0).reason in (
            "toploc",
            "replay",
        )
    finally:
        engine.load(ckpts.a)  # the vLLM validator path shares (and swapped) the engine


def _oracle(kind: str, engine: Engine, version: Path) -> TrainerOracle:
    """The validator's oracle for ``kind``'s batches: transformers, or the vLLM validator path
    sharing the test's engine (one vLLM engine per process; the path loads ``version``)."""
    engines = (f"{kind}-bf16",)  # the transformers venv has no vLLM: no vllm-bf16 path there
    teacher = VllmTeacher(engine) if kind == "vllm" else None
    oracle = TrainerOracle(build_tokenizer(), DEFAULT_TASK, 3, engines, vllm_teacher=teacher)
    oracle.add_version(0, DIGEST, version)
    return oracle


def test_vllm_validator_path(kind: str, engine: Engine, ckpts: Ckpts) -> None:
    """vllm-bf16 batches are judged by vLLM's own teacher-forced pass (a second engine, as a
    trainer would run it) with the vllm-bf16 profile: honest rollouts pass with logprob
    differences near 0; a tampered token fails (the last one of a length-capped completion,
    which TOPLOC never commits, by ``replay``)."""
    if kind != "vllm":
        pytest.skip("vLLM only: the transformers path is covered by tests/unit/test_verify.py")
    batch = _batch(engine, kind="vllm")
    _close(engine)  # one vLLM engine per process: the validator starts its own
    oracle = TrainerOracle(
        build_tokenizer(), DEFAULT_TASK, 3, ("vllm-bf16",), vllm_teacher=VllmTeacher()
    )
    try:
        oracle.add_version(0, DIGEST, ckpts.a)
        verdict = _validator(oracle).check(batch, sender=PEER.peer_id, current_step=0)
        assert verdict.accepted, verdict
        g, i, s = next(
            (g, i, s)
            for g in batch.groups
            for i, s in enumerate(g.samples)
            if s.finish_reason == "length"
        )
        (tf,) = oracle.prefill_batch(0, [(g.prompt_ids, s.completion_ids)], 1.0, None, "vllm-bf16")
        assert np.abs(np.subtract(tf.logprobs, s.logprobs)).max() < 1e-3
        last = len(s.completion_ids) - 1
        for j, expected in ((last, {"replay"}), (last // 2, {"toploc", "replay"})):
            ids = list(s.completion_ids)
            ids[j] = next(t for t in range(3, 128) if t != ids[j])  # never EOS (2)
            reward = oracle.reward(
                ids,
                submitter=batch.submitter,
                step=0,
                prompt_index=g.prompt_index,
                n_prompts=SAMPLING.n_prompts,
            )
            forged = dataclasses.replace(s, completion_ids=tuple(ids), reward=reward)
            samples = list(g.samples)
            samples[i] = forged
            groups = [
                dataclasses.replace(x, samples=tuple(samples)) if x is g else x
                for x in batch.groups
            ]
            tampered = dataclasses.replace(batch, groups=tuple(groups))
            got = _validator(oracle).check(tampered, sender=PEER.peer_id, current_step=0)
            assert not got.accepted, (j, got)
            assert got.reason in expected, (j, got)
    finally:
        oracle.close()
        engine.load(ckpts.a)


def test_same_key_same_tokens_across_engines(kind: str, engine: Engine, ckpts: Ckpts) -> None:
    """Both engines sample with the same seeded Gumbel-max: on the same checkpoint, seed and
    prompt, the completions agree (the transformers engine is the reference; vLLM's CPU
    kernels round differently, so a near-tie may flip one token and what follows)."""
    reference = TransformersEngine()
    reference.load(ckpts.a)
    ours = engine.generate(_prompt(2), n=8, max_new_tokens=24, temperature=1.0, seed=99)
    ref = reference.generate(_prompt(2), n=8, max_new_tokens=24, temperature=1.0, seed=99)
    same = sum(a.completion_ids == b.completion_ids for a, b in zip(ours, ref, strict=True))
    print(f"engine={kind} completions equal to the transformers engine's: {same}/8")
    assert same >= (8 if kind == "transformers" else 6)
    for a, b in zip(ours, ref, strict=True):
        if a.completion_ids[:1] == b.completion_ids[:1]:
            assert a.logprobs[0] == pytest.approx(b.logprobs[0], abs=0.02)


def test_vllm_concurrent_swap_is_an_error(kind: str, engine: Engine, ckpts: Ckpts) -> None:
    if kind != "vllm":
        pytest.skip("vLLM only: TransformersEngine does not guard against overlapping loads")
    entered, release = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    class Gate(os.PathLike[str]):
        """A path whose resolution blocks: holds the first swap inside ``load``."""

        def __fspath__(self) -> str:
            entered.set()
            release.wait(30)
            return str(ckpts.b)

    def first() -> None:
        try:
            engine.load(Gate())  # type: ignore[arg-type]
        except BaseException as exc:
            errors.append(exc)

    thread = threading.Thread(target=first)
    thread.start()
    try:
        assert entered.wait(30)
        with pytest.raises(LocalProtocolError, match="already running"):
            engine.load(ckpts.a)
    finally:
        release.set()
        thread.join(60)
    assert not errors
    assert isinstance(engine, VllmEngine)
    assert engine.checkpoint_dir == ckpts.b
    engine.load(ckpts.a)


def test_vllm_failed_reload_rebuilds_last_good(
    kind: str, engine: Engine, ckpts: Ckpts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload that dies half way (half of B's tensors applied, then an error) leaves a
    half-reset engine: it must be rebuilt on A and serve A's outputs exactly."""
    if kind != "vllm":
        pytest.skip("vLLM only: TransformersEngine has no engine to rebuild")
    assert isinstance(engine, VllmEngine)
    on_a = _sample(engine)
    llm: Any = engine.llm
    real = llm.collective_rpc
    tensors = list(load_file(str(ckpts.b_single / SINGLE_WEIGHTS_NAME)).items())

    def dies_half_way(method: Any, *args: Any, **kwargs: Any) -> Any:
        if method == "reload_weights":
            real(method, kwargs={"weights_iterator": iter(tensors[: len(tensors) // 2])})
            raise RuntimeError("simulated I/O error during reload")
        return real(method, *args, **kwargs)

    monkeypatch.setattr(llm, "collective_rpc", dies_half_way)
    rebuilds = engine.statistics().rebuilds
    with pytest.raises(Exception, match="simulated I/O error") as info:
        engine.load(ckpts.b)
    assert type(info.value).__name__ == "VllmEngineError"
    assert engine.llm is not llm  # a new engine
    assert engine.checkpoint_dir == ckpts.a
    assert engine.statistics().rebuilds == rebuilds + 1
    assert _same(_sample(engine), on_a)


def test_checkpoint_layout_is_what_vllm_reads(ckpts: Ckpts) -> None:
    """The sharded checkpoint has an index naming every shard (vLLM filters files by it)."""
    index = json.loads((ckpts.b / INDEX_NAME).read_text())
    shards = {p.name for p in ckpts.b.glob("*.safetensors")}
    assert set(index["weight_map"].values()) == shards
