"""Building a rollout batch: prompts, seeded sampling, TOPLOC proofs, peer-side rewards.

:func:`build_batch` is what an inference peer does for one policy step with the weights its
engine holds: take the prompts the task assigns to (this PeerID, step) — the validator
recomputes them —, sample ``group_size`` completions per prompt with seeded Gumbel-max noise
keyed by (run id, PeerID, step, prompt index, sample index) (:mod:`rollout.gumbel`: the
validator replays every draw), build the TOPLOC proofs from the hidden states the engine
captured (:mod:`rollout.toploc`), and pack one :class:`~rollout.schema.RolloutBatch`.
:func:`build_group` does one prompt and :func:`pack_batch` packs the groups, so a paced peer
(:mod:`rollout.pacing`) can stop between groups and hand over a partial batch.
Blocking and CPU-heavy: async callers run it in a worker thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2p.errors import ConfigError, LocalProtocolError
from rollout.engine import Engine, Generation
from rollout.gumbel import group_seed
from rollout.schema import DEFAULT_ENGINE_ID, Group, RolloutBatch, Sample
from rollout.task import Prompt, Task, encode_prompt, task_prompts
from rollout.toploc import ToplocConfig, build_proofs
from shardcast.wire import DEFAULT_SAMPLING

Forgery = Callable[[RolloutBatch], RolloutBatch]
"""A hook that rewrites a batch before it is signed (adversarial tests only)."""


@dataclass(frozen=True)
class SamplingConfig:
    """The run's sampling rules (must match the trainer's; the validator checks them).

    Attributes:
        n_prompts: prompts per peer per step.
        group_size: samples per prompt (the GRPO group).
        max_new_tokens: completion length cap.
        temperature: sampling temperature (> 0).
        toploc: proof parameters.
    """

    n_prompts: int = DEFAULT_SAMPLING.prompts_per_step
    group_size: int = DEFAULT_SAMPLING.group_size
    max_new_tokens: int = DEFAULT_SAMPLING.max_new_tokens
    temperature: float = DEFAULT_SAMPLING.temperature
    toploc: ToplocConfig = field(default_factory=ToplocConfig)

    def __post_init__(self) -> None:
        if self.n_prompts < 1 or self.group_size < 1 or self.max_new_tokens < 1:
            raise ConfigError("sampling", "n_prompts, group_size and max_new_tokens must be >= 1")
        if self.temperature <= 0:
            raise ConfigError("sampling.temperature", "must be > 0")


def sample_seed(peer_id: str, step: int, prompt_index: int) -> int:
    """A 63-bit hash of (PeerID, step, prompt index): the batch's informational ``seed``
    field (``prompt_index = -1``). The draws themselves use :func:`rollout.gumbel.group_seed`,
    which also binds the run id."""
    h = hashlib.sha256(f"{peer_id}\x1f{step}\x1f{prompt_index}".encode()).digest()
    return int.from_bytes(h[:8], "big") >> 1


def build_group(
    engine: Engine,
    tokenizer: Any,
    task: Task,
    prompt: Prompt,
    index: int,
    *,
    peer_id: str,
    run_id: str,
    step: int,
    cfg: SamplingConfig,
) -> Group:
    """Generate the group of prompt ``index`` (the ``index``-th of :func:`task_prompts` for
    (``peer_id``, ``step``)) with the engine's loaded weights: ``cfg.group_size`` seeded
    samples with their TOPLOC proofs and peer-computed rewards.

    Raises:
        LocalProtocolError: the engine has nothing loaded.
    """
    prompt_ids = encode_prompt(prompt, tokenizer)
    gens: list[Generation] = engine.generate(
        prompt_ids,
        cfg.group_size,
        cfg.max_new_tokens,
        cfg.temperature,
        group_seed(run_id, peer_id, step, index),
    )
    samples = []
    for g in gens:
        proofs = build_proofs(
            None if cfg.toploc.skip_prefill else g.prefill_bits, g.decode_bits, cfg.toploc
        )
        samples.append(
            Sample(
                tuple(g.completion_ids),
                tuple(g.logprobs),
                float(task.reward(g.completion_ids, tokenizer, prompt)),
                g.finish_reason,
                b"".join(proofs),
            )
        )
    return Group(index, tuple(prompt_ids), tuple(samples))


def pack_batch(
    groups: Sequence[Group],
    task: Task,
    *,
    peer_id: str,
    run_id: str,
    step: int,
    manifest_digest: str,
    cfg: SamplingConfig,
    engine_id: str = DEFAULT_ENGINE_ID,
) -> RolloutBatch:
    """The batch of ``groups``: all ``cfg.n_prompts`` of them, or a partial batch of the first
    ``k`` (``1 <= k <= n_prompts``, prompt indices ``0..k-1``, each once; the validator accepts
    nothing else, see :func:`rollout.verify._check_prompts`).

    Raises:
        LocalProtocolError: ``groups`` is not such a prefix.
    """
    indices = sorted(g.prompt_index for g in groups)
    if not 1 <= len(groups) <= cfg.n_prompts or indices != list(range(len(groups))):
        raise LocalProtocolError(
            f"a batch holds the first 1..{cfg.n_prompts} prompts in order, got indices "
            f"{[g.prompt_index for g in groups]}"
        )
    return RolloutBatch(
        run_id,
        peer_id,
        step,
        manifest_digest,
        task.name,
        cfg.n_prompts,
        sample_seed(peer_id, step, -1),
        cfg.temperature,
        cfg.max_new_tokens,
        tuple(groups),
        engine_id,
    )


def build_batch(
    engine: Engine,
    tokenizer: Any,
    task: Task,
    *,
    peer_id: str,
    run_id: str,
    step: int,
    manifest_digest: str,
    cfg: SamplingConfig,
    engine_id: str = DEFAULT_ENGINE_ID,
) -> RolloutBatch:
    """Generate one whole batch (``cfg.n_prompts`` groups) for ``step`` with the engine's
    loaded weights (:func:`build_group` per prompt, then :func:`pack_batch`).

    ``tokenizer`` must be the loaded checkpoint's own (``rollout.model_dir.load_tokenizer``);
    ``engine_id`` names ``engine``'s family and dtype as the run card does
    (``transformers-bf16``, ``vllm-bf16``), and goes into the batch.

    Returns:
        the batch, with a TOPLOC proof per sample and the peer-computed rewards.

    Raises:
        LocalProtocolError: the engine has nothing loaded.
    """
    groups = [
        build_group(
            engine, tokenizer, task, prompt, i, peer_id=peer_id, run_id=run_id, step=step, cfg=cfg
        )
        for i, prompt in enumerate(task_prompts(task, peer_id, step, cfg.n_prompts))
    ]
    return pack_batch(
        groups,
        task,
        peer_id=peer_id,
        run_id=run_id,
        step=step,
        manifest_digest=manifest_digest,
        cfg=cfg,
        engine_id=engine_id,
    )
