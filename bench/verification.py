"""Adversarial corpus for the rollout validator: false rejections, misses and TOPLOC statistics.

Usage::

    python bench/verification.py [--json] [--seed 0] [--honest 500] [--quick]
                                 [--models tiny,h512] [--profile default] [--max-new-tokens 128]

Theory of operation
-------------------
A world holds one published policy version (step 0): a float32 master built from ``--seed``,
written as a bf16 checkpoint (``trainer.checkpoint``), loaded by an honest
:class:`~rollout.engine.TransformersEngine` and registered with a real
:class:`~trainer.oracle.TrainerOracle`. Every submission goes the way a trainer receives it
(``rollout.inbox``): payload encoded, announcement signed and decoded, payload checked against
it and decoded, then :meth:`rollout.verify.Validator.check` with the shipped
:class:`~rollout.verify.ValidatorConfig` defaults (``--profile default``) or a profile of
:data:`PROFILES`.

**Honest corpus.** Round ``r`` takes peer ``r``'s assigned prompts at step 0 and produces one
batch per layout, all from the same prompts, because batching changes the numerics: ``g8``
(engine, 8 samples per prompt), ``g4-shuffled`` (4 per prompt, prompts generated in a seeded
random order and packed in another), ``g1`` (1 per prompt), ``multi`` (all 4 prompts × 8
samples in ONE left-padded forward batch, :func:`sample_prompts`, as a server batching
requests would) and ``g8-run16`` (the run's configured 16-token cap). Each batch goes to a
fresh validator configured for its layout. 116 rollouts per round.

**Attacks** use peer ``r``'s prompt 0 (the same prompts) and are judged one forged rollout per
batch (a 1-prompt × 1-sample validator), so each verdict is about exactly one rollout; the
batch-level classes use whole ``g8`` batches and count their rollouts:

* ``other_model_seed``: the same architecture initialized with ``seed + 1``.
* ``finetuned_copy``: the fp32 master after ``finetune_steps`` AdamW steps
  (``trainer.grpo.make_optimizer``) of plain next-token loss on honest completions, at each
  learning rate of ``finetune_lrs``, then published to bf16 like a real checkpoint
  (``details.finetune_bf16_weights_changed`` is the share of bf16 weights that moved).
* ``precision``: the published bf16 weights run in float32 (``TransformersEngine(dtype=
  torch.float32)``); the proof is built from the fp32 last hidden state rounded to bf16
  (round-to-nearest-even, ``rollout.engine.bf16_bits``), what that engine, or an attacker
  reusing it, naturally does; logprobs come from the fp32 logits.
* ``tampered_prompt``: completion and proof generated for another prompt, claimed for the
  assigned one: one digit of the prompt changed (same length), or the peer's own prompt 1.
* ``tampered_completion``: up to 3 completion tokens (never a final ``eos``) replaced by digits
  after generation; the reward is recomputed truthfully, logprobs and proof are kept.
* ``inflated_reward``: reported reward + 0.5.
* ``replayed_batch``: an accepted batch sent again to the validator that accepted it, at the
  same and at the next trainer step.
* ``stale_step``: an honest step-0 batch submitted when the trainer is at step 3 or 4.
* ``wrong_signer``: A's payload announced by B; A's batch relabelled with B's PeerID and signed
  by B; an announcement naming A but signed by B (refused while decoding it, since the batch
  id binds the submitter: ``schema``).
* ``truncated_proof``: last chunk's proof dropped, 1–257 trailing bytes cut, or no proof.
* ``corrupted_proof``: one coefficient bit flipped, a decode chunk's proof taken from a sibling
  sample of the same prompt, random coefficients, or a null proof (TOPLOC.md §7).

**Probes** (``details.probes``; expected to pass, they document limits): ``modulus_malleability``
(every proof's ``m`` set to 65496: an equivalent proof, chunks have fewer values than ``m``);
``last_token_swap`` (the final token, whose hidden state is never computed (TOPLOC.md §2),
replaced, logprob kept) and ``last_token_swap_logprob`` (with the logprob recomputed by the
attacker, who holds the weights).

**Statistics.** The validator's teacher-forced activations are recorded (a
:class:`TrainerOracle` subclass that keeps what ``prefill_batch`` returned), and the per-chunk
TOPLOC results (TOPLOC.md §6) and logprob differences are summarized per class, prefill chunk and
decode chunks apart. ``details.profiles`` re-judges these same statistics under every profile
of :data:`PROFILES` (rollouts refused by a check that does not depend on the model stay
refused).

**Timing** (wall clock, ``torch.set_num_threads(1)``): ``generate_s_per_rollout`` is the honest
corpus's engine time (sampling, proof building, reward) per rollout; ``verify_s_per_rollout``
is ``Validator.check`` time per honest rollout, the teacher-forced forward pass included.
Everything else is seeded: two runs give the same verdicts.
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
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TextIO

import numpy as np
import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

from p2p.errors import IntegrityError, RemoteProtocolError, VerificationError
from p2p.identity import Identity
from rollout.batch import sample_seed
from rollout.engine import (
    Generation,
    TransformersEngine,
    bf16_bits,
    prefill_activations,
    prefill_activations_batch,
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
from trainer.checkpoint import save_checkpoint
from trainer.grpo import make_optimizer
from trainer.oracle import Bits, TrainerOracle

RUN_ID = "verification-bench"
DIGEST = "ab" * 32
ATTACKS = (
    "other_model_seed",
    "finetuned_copy",
    "precision",
    "tampered_prompt",
    "tampered_completion",
    "inflated_reward",
    "replayed_batch",
    "stale_step",
    "wrong_signer",
    "truncated_proof",
    "corrupted_proof",
)
PROBES = ("modulus_malleability", "last_token_swap", "last_token_swap_logprob")
MODEL_CHECKED = ("accepted", "toploc", "sampling")
"""Outcomes that the model-dependent checks decided (or would have): profiles can change them."""

MODELS: dict[str, dict[str, int]] = {
    "tiny": {},  # the preset: hidden 128, 4 layers, 0.8 M parameters
    "h512": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
    },
}
"""Model configurations: ``LlamaConfig`` fields changed from the ``tiny`` preset."""

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
tolerances (mean 0.05, max 1.0 nats). ``strict_hf``: only for runs whose provers all use
``TransformersEngine``; calibrated with this bench on ``tiny`` and ``h512`` (honest maxima per
chunk: prefill 2 exponent mismatches / mantissa mean 0.13 / median 0, decode 6 / 1.42 / 1). It
rejected all 408 vLLM-CPU rollouts measured (prefill mantissa mean up to 0.56 on ``tiny``,
0.66 on ``h512``) and would reject ``real-1b`` rollouts of 40 tokens (prefill mean 0.23–0.38);
see ``rollout.verify.ValidatorConfig`` for the shipped defaults' calibration."""


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
            samples in one left-padded batch, :func:`sample_prompts`).
    """

    name: str
    n_prompts: int
    group_size: int
    max_new_tokens: int
    mode: str = "group"


def default_layouts(max_new_tokens: int = 128) -> tuple[Layout, ...]:
    """The honest layouts (116 rollouts per round); the first is the attacks' base layout."""
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
            ``n_prompts >= 2``: its batches and prompt-0 rollouts seed the attacks.
        attacks_per_round: per-rollout attack instances per class per round.
        probes_per_round: instances per probe per round.
        finetune_lrs: AdamW learning rates of the ``finetuned_copy`` variants.
        finetune_steps: optimizer steps per fine-tuned copy.
        temperature: sampling temperature.
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
    temperature: float = 1.0


class RecordingOracle(TrainerOracle):
    """A :class:`TrainerOracle` that also keeps what each ``prefill_batch`` returned (per
    rollout), and the seconds spent in it (the teacher-forced forward passes)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorded: dict[tuple[tuple[int, ...], tuple[int, ...]], tuple[Bits, Bits, list[float]]]
        self.recorded = {}
        self.forward_s = 0.0

    def prefill_batch(
        self,
        step: int,
        items: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float,
    ) -> list[tuple[Bits, Bits, list[float]]]:
        start = time.perf_counter()
        outs = super().prefill_batch(step, items, temperature)
        self.forward_s += time.perf_counter() - start
        for (prompt, c), out in zip(items, outs, strict=True):
            self.recorded[(tuple(prompt), tuple(c))] = out
        return outs


def validator_config(layout: Layout, profile: str, temperature: float) -> ValidatorConfig:
    """The validator configuration of ``layout`` under ``profile``."""
    base = ValidatorConfig(
        run_id=RUN_ID,
        task=DEFAULT_TASK.name,
        n_prompts=layout.n_prompts,
        group_size=layout.group_size,
        max_new_tokens=layout.max_new_tokens,
        temperature=temperature,
    )
    return dataclasses.replace(base, **PROFILES[profile])


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

    @property
    def toploc(self) -> ToplocConfig:
        return validator_config(self.unit, self.cfg.profile, self.cfg.temperature).toploc

    def validator(self, layout: Layout) -> Validator:
        """A fresh validator for ``layout`` under the run's profile."""
        return Validator(
            validator_config(layout, self.cfg.profile, self.cfg.temperature), self.oracle
        )


def master_model(model: str, seed: int) -> torch.nn.Module:
    """The float32 master of a :data:`MODELS` configuration, initialized from ``seed``."""
    if not MODELS[model]:
        return build_model("tiny", seed, torch.float32)
    params = preset_config("tiny").to_dict()
    params.update(MODELS[model])
    params.pop("head_dim", None)  # recomputed from hidden_size / num_attention_heads
    factory: Any = AutoModelForCausalLM  # untyped
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        built = factory.from_config(LlamaConfig(**params), dtype=torch.float32)
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
    oracle = RecordingOracle(tokenizer, DEFAULT_TASK, keep=3)
    oracle.add_version(0, DIGEST, policy_dir)
    engine = TransformersEngine()
    engine.load(policy_dir)
    peers = [Identity.from_seed(f"{RUN_ID}/{cfg.seed}/peer-{i}") for i in range(cfg.rounds + 1)]
    unit = Layout("unit", 1, 1, cfg.layouts[0].max_new_tokens)
    return World(cfg, root, tokenizer, oracle, policy_dir, engine, peers, unit)


# --- generation -------------------------------------------------------------------------------


@torch.inference_mode()
def sample_prompts(
    model: Any,
    prompts: Sequence[Sequence[int]],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seeds: Sequence[int],
    eos_token_id: int,
) -> list[list[Generation]]:
    """Sample ``n`` completions of *every* prompt in one left-padded batch with a KV cache.

    Bench-only sibling of :func:`rollout.engine.sample_group` (same sampling rule, one seeded
    ``torch.Generator`` per prompt): rows are padded on the left with id 0 and masked, and
    position ids count from each row's first real token, so every row is mathematically the
    batch-1 computation while the float operations run on ``[len(prompts)·n, ·]`` tensors.

    Returns:
        ``groups[i]``: the ``n`` generations of ``prompts[i]``.
    """
    rows = [list(p) for p in prompts for _ in range(n)]
    width = max(len(p) for p in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    mask = torch.zeros((len(rows), width), dtype=torch.int64)
    for r, p in enumerate(rows):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    cache = DynamicCache(config=model.config)
    out = model.model(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    )
    hidden = out.last_hidden_state  # [B, width, H]
    generators = [torch.Generator().manual_seed(s) for s in seeds]
    last, next_pos = hidden[:, -1], positions[:, -1:] + 1
    tokens, logprobs, decode = [], [], []
    done = torch.zeros(len(rows), dtype=torch.bool)
    for step in range(max_new_tokens):
        logp = torch.log_softmax(model.lm_head(last).float() / temperature, dim=-1)
        token = torch.cat(
            [
                torch.multinomial(logp[i * n : (i + 1) * n].exp(), 1, generator=g)
                for i, g in enumerate(generators)
            ]
        )
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
    groups: list[list[Generation]] = [[] for _ in prompts]
    for r, p in enumerate(rows):
        row = all_tokens[r].tolist()
        stop = row.index(eos_token_id) + 1 if eos_token_id in row else len(row)
        dec = (
            bf16_bits(torch.stack([d[r] for d in decode[: stop - 1]]))
            if stop > 1
            else np.zeros((0, hidden.shape[-1]), dtype=np.uint16)
        )
        finish: Literal["stop", "length"] = "stop" if row[stop - 1] == eos_token_id else "length"
        pre = bf16_bits(hidden[r, width - len(p) :])
        groups[r // n].append(
            Generation(p, row[:stop], all_lps[r, :stop].tolist(), finish, pre, dec)
        )
    return groups


def to_sample(w: World, g: Generation) -> Sample:
    """Pack a generation as a peer does (``rollout.batch.build_batch``): proofs and reward."""
    proofs = build_proofs(g.prefill_bits, g.decode_bits, w.toploc)
    reward = float(DEFAULT_TASK.reward(g.completion_ids, w.tokenizer))
    return Sample(
        tuple(g.completion_ids), tuple(g.logprobs), reward, g.finish_reason, b"".join(proofs)
    )


def generate_batch(w: World, layout: Layout, r: int) -> tuple[RolloutBatch, float]:
    """Peer ``r``'s honest batch at step 0 in ``layout``, and the seconds spent generating,
    proving and scoring it."""
    peer = w.peers[r].peer_id
    n, cap, temp = layout.group_size, layout.max_new_tokens, w.cfg.temperature
    prompts = w.oracle.prompt_ids(peer, 0, layout.n_prompts)
    seeds = [sample_seed(peer, 0, i) for i in range(layout.n_prompts)]
    rng = random.Random(f"{w.cfg.seed}/{layout.name}/{r}")
    start = time.perf_counter()
    if layout.mode == "multi":
        gens = dict(enumerate(sample_prompts(w.engine.model, prompts, n, cap, temp, seeds, w.eos)))
    else:
        order = list(range(layout.n_prompts))
        if layout.mode == "shuffled":
            rng.shuffle(order)
        gens = {i: w.engine.generate(prompts[i], n, cap, temp, seeds[i]) for i in order}
    groups = [
        Group(i, tuple(prompts[i]), tuple(to_sample(w, g) for g in gens[i]))
        for i in range(layout.n_prompts)
    ]
    if layout.mode == "shuffled":
        rng.shuffle(groups)
    elapsed = time.perf_counter() - start
    seed = sample_seed(peer, 0, -1)
    batch = RolloutBatch(
        RUN_ID, peer, 0, DIGEST, DEFAULT_TASK.name, layout.n_prompts, seed, temp, cap, tuple(groups)
    )
    return batch, elapsed


def unit_batch(w: World, peer: Identity, prompt: Sequence[int], sample: Sample) -> RolloutBatch:
    """One rollout as a whole batch of the 1-prompt × 1-sample layout (prompt index 0)."""
    group = Group(0, tuple(prompt), (sample,))
    seed = sample_seed(peer.peer_id, 0, -1)
    cap, temp = w.unit.max_new_tokens, w.cfg.temperature
    return RolloutBatch(
        RUN_ID, peer.peer_id, 0, DIGEST, DEFAULT_TASK.name, 1, seed, temp, cap, (group,)
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
    start = time.perf_counter()
    verdict = validator.check(decoded, sender=got.submitter, current_step=current_step)
    return Outcome(verdict.accepted, verdict.reason, time.perf_counter() - start)


@dataclass(frozen=True)
class RolloutStats:
    """TOPLOC results and logprob differences of one rollout against the validator's pass.

    Attributes:
        prefill: chunk 0's result (``None`` when the prefill is skipped or proofs malformed).
        decode: the decode chunks' results.
        proofs_ok: the proofs parsed and their count matched the chunks.
        lp_mean, lp_max: mean and largest ``|reported - recomputed|`` logprob, nats.
    """

    prefill: ChunkResult | None
    decode: tuple[ChunkResult, ...]
    proofs_ok: bool
    lp_mean: float
    lp_max: float

    def passes(self, cfg: ValidatorConfig) -> bool:
        """Whether the toploc and sampling checks of ``cfg`` pass (as ``rollout.verify``
        applies them: prefill chunk and decode chunks under their own thresholds)."""
        if not self.proofs_ok:
            return False
        if self.prefill is None:  # skip_prefill: no chunk at all is a rejection
            ok = judge(self.decode, cfg.toploc_thresholds).passed
        else:
            ok = judge([self.prefill], cfg.toploc_prefill_thresholds).passed and (
                not self.decode or judge(self.decode, cfg.toploc_thresholds).passed
            )
        lp_ok = self.lp_mean <= cfg.logprob_tolerance and self.lp_max <= cfg.logprob_max_tolerance
        return ok and lp_ok


def rollout_stats(
    w: World, prompt: Sequence[int], s: Sample, acts: tuple[Bits, Bits, list[float]] | None = None
) -> RolloutStats:
    """Statistics of ``s`` claimed for ``prompt``, from ``acts``, else the validator's recorded
    pass, else a fresh (unrecorded, untimed) one when the validator stopped earlier."""
    if acts is None:
        acts = w.oracle.recorded.get((tuple(prompt), s.completion_ids))
    if acts is None:
        acts = w.oracle.prefill(0, prompt, s.completion_ids, w.cfg.temperature)
    pre, dec, lps = acts
    diffs = np.abs(np.subtract(s.logprobs, lps))
    lp_mean, lp_max = float(diffs.mean()), float(diffs.max())
    psize, skip = proof_size_bytes(w.toploc.topk), w.toploc.skip_prefill
    proofs = [s.proof[i : i + psize] for i in range(0, len(s.proof), psize)]
    try:
        results = verify_proofs(None if skip else pre, dec, proofs, w.toploc)
    except VerificationError:
        return RolloutStats(None, (), False, lp_mean, lp_max)
    first = None if skip else results[0]
    return RolloutStats(first, tuple(results[0 if skip else 1 :]), True, lp_mean, lp_max)


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
        self.honest = {layout.name: Tally() for layout in w.cfg.layouts}
        self.attacks = {name: Tally() for name in ATTACKS}
        self.probes = {name: Tally() for name in PROBES}
        self.base: list[tuple[RolloutBatch, Validator]] = []
        self.weights_changed: dict[str, float] = {}
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
    ) -> None:
        w = self.w
        w.oracle.recorded.clear()
        forward_before = w.oracle.forward_s
        outcome = submit(w, validator, batch, signer, current_step, claim)
        tally.forward_s += w.oracle.forward_s - forward_before
        key = tally.add(variant, outcome, batch.n_samples)
        if stats:
            tally.stats.extend(
                (key, rollout_stats(w, g.prompt_ids, s)) for g in batch.groups for s in g.samples
            )
        w.oracle.recorded.clear()

    def _unit(
        self,
        tally: Tally,
        variant: str,
        peer: Identity,
        prompt: Sequence[int],
        sample: Sample,
        stats: bool = True,
    ) -> None:
        batch = unit_batch(self.w, peer, prompt, sample)
        self._judge(tally, variant, self.w.validator(self.w.unit), batch, peer, stats=stats)

    def attacker_engines(self) -> dict[str, list[tuple[str, TransformersEngine]]]:
        """Engines of the model-level attacks, by class: ``(variant, engine)`` pairs."""
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
            finetuned.append((f"lr={lr:g}", engine))
        return {
            "other_model_seed": [(f"seed={w.cfg.seed + 1}", other)],
            "finetuned_copy": finetuned,
            "precision": [("fp32_compute", fp32)],
        }

    def _finetune(self, lr: float) -> torch.nn.Module:
        """The fp32 master after ``finetune_steps`` AdamW steps of next-token loss on the first
        base batch's prompts + completions; records the share of bf16 weights that moved."""
        w = self.w
        master = master_model(w.cfg.model, w.cfg.seed)
        before = {k: t.to(torch.bfloat16) for k, t in master.state_dict().items()}
        texts = [
            [*g.prompt_ids, *s.completion_ids] for g in self.base[0][0].groups for s in g.samples
        ]
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
        """Every attack class and probe on every base batch (after :meth:`run_honest`)."""
        w, k = self.w, self.w.cfg.attacks_per_round
        engines = self.attacker_engines()
        cap, temp = w.unit.max_new_tokens, w.cfg.temperature
        for r, (batch, accepted_by) in enumerate(self.base):
            peer = w.peers[r]
            g0, g1 = (next(g for g in batch.groups if g.prompt_index == i) for i in (0, 1))
            prompt, seed = g0.prompt_ids, sample_seed(peer.peer_id, 0, 0)
            for cls, variants in engines.items():
                for v, (variant, engine) in enumerate(variants):
                    count = len(range(v, k, len(variants)))
                    for g in engine.generate(prompt, count, cap, temp, seed) if count else []:
                        self._unit(self.attacks[cls], variant, peer, prompt, to_sample(w, g))
            edits = (k + 1) // 2
            tampered = self.attacks["tampered_prompt"]
            edited = self._edit_prompt(prompt)
            for g in w.engine.generate(edited, edits, cap, temp, seed) if edits else []:
                self._unit(tampered, "one_digit_changed", peer, prompt, to_sample(w, g))
            for s in self._cycle(g1.samples, k - edits):
                self._unit(tampered, "other_assigned_prompt", peer, prompt, s)
            for i, s in enumerate(self._cycle(g0.samples, k)):
                self._per_sample_attacks(i, peer, prompt, s, g0.samples)
            self._probes(peer, prompt, g0.samples)
            self._batch_attacks(r, batch, accepted_by)

    @staticmethod
    def _cycle(samples: Sequence[Sample], count: int) -> list[Sample]:
        return [samples[i % len(samples)] for i in range(count)] if samples else []

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
        siblings: Sequence[Sample],
    ) -> None:
        rng, psize, a = self.rng, self.psize, self.attacks
        where = [j for j, t in enumerate(s.completion_ids) if t != self.w.eos]
        if where:
            forged = self._digit_swap(s, rng.sample(where, min(3, len(where))))
            self._unit(a["tampered_completion"], "3_tokens_to_digits", peer, prompt, forged)
        inflated = dataclasses.replace(s, reward=s.reward + 0.5)
        self._unit(a["inflated_reward"], "plus_0.5", peer, prompt, inflated, stats=False)
        cut = ("drop_last_chunk", "cut_bytes", "empty")[i % 3]
        if cut == "cut_bytes":
            keep = len(s.proof) - rng.randint(1, psize - 1)
        else:
            keep = len(s.proof) - psize if cut == "drop_last_chunk" else 0
        truncated = dataclasses.replace(s, proof=s.proof[:keep])
        self._unit(a["truncated_proof"], cut, peer, prompt, truncated, stats=False)
        variant, corrupted = self._corrupt(i, s, siblings)
        self._unit(
            a["corrupted_proof"], variant, peer, prompt, dataclasses.replace(s, proof=corrupted)
        )

    def _corrupt(self, i: int, s: Sample, siblings: Sequence[Sample]) -> tuple[str, bytes]:
        rng, psize = self.rng, self.psize
        variant = ("coefficient_bit_flip", "sibling_chunk", "random_coefficients", "null_proof")[
            i % 4
        ]
        proof, chunks = bytearray(s.proof), len(s.proof) // psize
        c = rng.randrange(chunks)
        if variant == "sibling_chunk":
            span = [(d, slice(d * psize, (d + 1) * psize)) for d in range(1, chunks)]
            donors = [
                (d, o) for o in siblings for d, at in span if o.proof[at] not in (b"", s.proof[at])
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

    def _probes(self, peer: Identity, prompt: Sequence[int], samples: Sequence[Sample]) -> None:
        w, p = self.w, self.probes
        for s in self._cycle(samples, w.cfg.probes_per_round):
            proof = bytearray(s.proof)
            for c in range(0, len(proof), self.psize):
                proof[c : c + 2] = (65496).to_bytes(2, "big")
            forged = dataclasses.replace(s, proof=bytes(proof))
            self._unit(p["modulus_malleability"], "m=65496", peer, prompt, forged)
        capped = [s for s in samples if s.finish_reason == "length"]
        for s in self._cycle(capped, w.cfg.probes_per_round):
            naive = self._digit_swap(s, [len(s.completion_ids) - 1])
            self._unit(p["last_token_swap"], "logprob_kept", peer, prompt, naive)
            lps = prefill_activations(
                w.engine.model, prompt, naive.completion_ids, w.cfg.temperature
            )[2]
            fixed = dataclasses.replace(naive, logprobs=(*s.logprobs[:-1], lps[-1]))
            self._unit(p["last_token_swap_logprob"], "logprob_recomputed", peer, prompt, fixed)

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
    per rollout of each path."""
    cfg = w.validator(w.cfg.layouts[0]).config
    model = w.oracle._model(0)
    items = [(g.prompt_ids, s.completion_ids) for b in batches for g in b.groups for s in g.samples]
    start = time.perf_counter()
    batched = prefill_activations_batch(model, items, w.cfg.temperature)
    batched_s = time.perf_counter() - start
    start = time.perf_counter()
    alone = [prefill_activations(model, p, c, w.cfg.temperature) for p, c in items]
    alone_s = time.perf_counter() - start
    rows = same = agree = 0
    lp_diff = 0.0
    samples = [(g.prompt_ids, s) for b in batches for g in b.groups for s in g.samples]
    for (prompt, s), x, y in zip(samples, batched, alone, strict=True):
        for a, b in ((x[0], y[0]), (x[1], y[1])):
            rows += a.shape[0]
            same += int((a == b).all(axis=1).sum()) if a.size else a.shape[0]
        lp_diff = max(lp_diff, float(np.abs(np.subtract(x[2], y[2])).max()))
        agree += rollout_stats(w, prompt, s, x).passes(cfg) == rollout_stats(
            w, prompt, s, y
        ).passes(cfg)
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
    """``n``, ``min``, ``p50``, ``p99`` and ``max`` of ``values`` (nearest-rank quantiles)."""
    if not values:
        return {"n": 0}
    arr = np.asarray(values, dtype=np.float64)
    p50, p99 = np.quantile(arr, [0.5, 0.99], method="nearest")
    return {
        "n": int(arr.size),
        "min": float(arr.min()),
        "p50": float(p50),
        "p99": float(p99),
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


def tally_details(t: Tally, temperature: float, unit: Layout) -> dict[str, Any]:
    """One class's outcomes, variants, statistics and its counts under every profile."""
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
        out["accepted_under_profile"] = {
            name: sum(
                key in MODEL_CHECKED and s.passes(validator_config(unit, name, temperature))
                for key, s in t.stats
            )
            for name in PROFILES
        }
    return out


def run(cfg: BenchConfig) -> dict[str, Any]:
    """Build a world, run the corpus and return the report (see the module docstring).

    Blocking, CPU-heavy; writes checkpoints to a temporary directory it removes. Timings
    assume the caller fixed torch's thread count (``main`` sets 1).
    """
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="verification-bench-") as tmp:
        w = make_world(cfg, Path(tmp))
        corpus = Corpus(w)
        corpus.run_honest()
        corpus.run_attacks()
        batching = batching_effect(w, [b for b, _ in corpus.base])
    vcfg = w.validator(cfg.layouts[0]).config
    honest = list(corpus.honest.values())
    total = sum(t.total for t in honest)
    generate_s = sum(t.generate_s for t in honest) / total
    verify_s = sum(t.check_s for t in honest) / total
    forward_s = sum(t.forward_s for t in honest) / total

    def details(t: Tally) -> dict[str, Any]:
        return tally_details(t, cfg.temperature, w.unit)

    pooled = Tally(total=total, stats=[x for t in honest for x in t.stats])
    pooled.accepted = sum(t.accepted for t in honest)
    pooled.reasons = sum((t.reasons for t in honest), Counter())
    mcfg = w.engine.model.config
    report: dict[str, Any] = {
        "honest_total": total,
        "false_rejects": total - pooled.accepted,
        "attacks": {n: {"total": t.total, "missed": t.accepted} for n, t in corpus.attacks.items()},
        "verify_s_per_rollout": verify_s,
        "generate_s_per_rollout": generate_s,
        "details": {
            "units": "rollouts; batch-level classes count every rollout of the refused batch",
            "model": {
                "name": cfg.model,
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
                "validator": {
                    "toploc_thresholds": dataclasses.asdict(vcfg.toploc_thresholds),
                    "toploc_prefill_thresholds": dataclasses.asdict(vcfg.toploc_prefill_thresholds),
                    "logprob_tolerance": vcfg.logprob_tolerance,
                    "logprob_max_tolerance": vcfg.logprob_max_tolerance,
                },
            },
            "speedup": generate_s / verify_s,
            "timing": {
                "verify_forward_s_per_rollout": forward_s,
                "verify_rest_s_per_rollout": verify_s - forward_s,
                "batching": batching,
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


def _fmt(stats: dict[str, float], key: str) -> str:
    value = stats.get(key)
    if value is None:
        return "-"
    return "inf" if value >= 2.0**64 else f"{value:.3g}"


def print_table(report: dict[str, Any], out: TextIO = sys.stdout) -> None:
    """A readable table of one model's report."""
    d = report["details"]
    m, profiles = d["model"], list(PROFILES)

    def say(line: str) -> None:
        print(line, file=out)

    say(
        f"\n== model {m['name']}: hidden {m['hidden_size']}, {m['layers']} layers, "
        f"{m['parameters']:,} parameters; seed {d['config']['seed']}; validator profile "
        f"{d['config']['profile']}; {d['runtime_s']:.0f} s =="
    )
    head = "".join(f"{p:>10}" for p in profiles)
    say(f"{'class':<24}{'total':>7}{'missed':>7}  {'missed under profile':^30}  outcomes")
    say(f"{'':<38}{head}")

    def row(name: str, total: int, missed: int, t: dict[str, Any], honest: bool = False) -> None:
        under = t.get("accepted_under_profile")
        cells = "".join(
            f"{(total - under[p] if honest else under[p]) if under else '-':>10}" for p in profiles
        )
        say(f"{name:<24}{total:>7}{missed:>7}{cells}  {t['outcomes']}")

    row(
        "honest (false rejects)", report["honest_total"], report["false_rejects"], d["honest"], True
    )
    for name, a in report["attacks"].items():
        row(name, a["total"], a["missed"], d["attacks"][name])
    for name, p in d["probes"].items():
        row(f"probe {name}", p["total"], p["accepted"], p)
    t = d["timing"]
    say(
        f"timing: generate {report['generate_s_per_rollout'] * 1e3:.1f} ms/rollout, verify "
        f"{report['verify_s_per_rollout'] * 1e3:.1f} ms/rollout (forward "
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
        say(
            f"  layout {name:<12} {h['total']:>4} rollouts  generate "
            f"{h['generate_s_per_rollout'] * 1e3:6.1f} ms  verify "
            f"{h['verify_s_per_rollout'] * 1e3:5.1f} ms  "
            f"({h['generate_s_per_rollout'] / h['verify_s_per_rollout']:.1f}x)"
        )
    say("TOPLOC per chunk (exp mismatches / mantissa mean / median): honest max, attacks min")
    rows = [("honest", d["honest"], "max")]
    rows += [(n, a, "min") for n, a in d["attacks"].items() if "toploc" in a]
    for name, a, key in rows:
        cells = [
            "/".join(
                _fmt(c[s], key) for s in ("exp_mismatches", "mant_err_mean", "mant_err_median")
            )
            if c["chunks"]
            else "-"
            for c in (a["toploc"]["prefill"], a["toploc"]["decode"])
        ]
        lp = a["logprob_abs_diff"]["max"]
        say(
            f"  {name:<20} {key}  prefill {cells[0]:<16} decode {cells[1]:<16} "
            f"max |dlogp| {_fmt(lp, key)}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n", 1)[0])
    parser.add_argument("--json", action="store_true", help="print the JSON report only")
    parser.add_argument("--seed", type=int, default=0, help="policy init and attack seed")
    parser.add_argument("--honest", type=int, default=500, help="at least this many honest")
    parser.add_argument("--quick", action="store_true", help="one round, tiny model (~20 s)")
    parser.add_argument("--models", default="tiny,h512", help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--profile", default="default", choices=list(PROFILES))
    parser.add_argument("--max-new-tokens", type=int, default=128, help="completion cap")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.ERROR)  # rejections are counted, not logged
    torch.set_num_threads(1)
    layouts = default_layouts(args.max_new_tokens)
    per_round = sum(layout.n_prompts * layout.group_size for layout in layouts)
    models = ["tiny"] if args.quick else args.models.split(",")
    if any(m not in MODELS for m in models):
        parser.error(f"unknown model in {args.models!r}; known: {list(MODELS)}")
    rounds = 1 if args.quick else max(1, math.ceil(args.honest / per_round))
    reports = {
        m: run(
            BenchConfig(
                seed=args.seed,
                model=m,
                profile=args.profile,
                rounds=rounds if i == 0 else max(1, rounds // 2),  # larger models: half
                layouts=layouts,
            )
        )
        for i, m in enumerate(models)
    }
    report = reports[models[0]]
    if len(models) > 1:
        report["details"]["models"] = {m: reports[m] for m in models[1:]}
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        for m in models:
            print_table(reports[m])
    return 0


if __name__ == "__main__":
    sys.exit(main())
