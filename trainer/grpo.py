"""GRPO: group-relative advantages and the clipped token-level policy loss.

Theory of operation
-------------------
Group Relative Policy Optimization (Shao et al., DeepSeekMath, arXiv 2402.03300, §4.1)
drops PPO's value model: for each prompt a *group* of ``G`` completions is sampled, and each
completion's advantage is its reward standardized within the group,
``A_i = (r_i − mean(r)) / (std(r) + eps)`` (outcome supervision, §4.1.2), applied to every
token of that completion. The policy maximizes the PPO clipped surrogate per token,

    ``min(ρ_t · A, clip(ρ_t, 1 − ε, 1 + ε) · A)``,  ``ρ_t = π_θ(o_t | ·) / π_old(o_t | ·)``,

where ``π_old`` is the policy that *generated* the rollout; its log-probabilities come from
the inference peer (``Generation.logprobs``), which in asynchronous RL may be one or more
steps behind the trainer. Following INTELLECT-2 (arXiv 2505.07291, §3, "two-sided GRPO
clipping"), the ratio is additionally capped at ``δ`` for negative advantages, because the
``min`` alone leaves ``ρ_t · A`` unbounded below when ``ρ_t`` is large. There is no KL
penalty (β = 0). The loss is averaged over all completion tokens of the batch (token-level
normalization, so long completions are not down-weighted), and log-probabilities use the
same temperature as sampling (``log_softmax(logits / T)``).

The trainer keeps float32 master weights and an AdamW optimizer (:func:`make_optimizer`),
and publishes bf16 checkpoints (``trainer/checkpoint.py``). :data:`DEFAULT_LR` was chosen by
measurement on the ``tiny`` preset (see ``tests/unit/test_grpo.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from p2p.errors import LocalProtocolError
from trainer.config import DEFAULT_LR

__all__ = [
    "DEFAULT_LR",
    "GRPOBatch",
    "GRPOStats",
    "Rollout",
    "collate",
    "group_advantages",
    "grpo_loss",
    "make_optimizer",
    "train_step",
]


@dataclass(frozen=True)
class Rollout:
    """One completion as the trainer consumes it.

    Attributes:
        prompt_ids: ``L >= 1`` prompt token ids.
        completion_ids: ``N >= 1`` sampled ids.
        logprobs: ``N`` log-probabilities of the sampled ids under the sampling policy
            (``π_old``, at the batch temperature).
        advantage: the group-relative advantage of this completion.
    """

    prompt_ids: Sequence[int]
    completion_ids: Sequence[int]
    logprobs: Sequence[float]
    advantage: float


@dataclass(frozen=True)
class GRPOBatch:
    """Right-padded tensors for one optimizer step (``B`` rollouts, ``T`` = longest
    prompt + completion). Position ``t`` of the ``[B, T-1]`` tensors is about predicting
    ``input_ids[:, t+1]`` from the logits at ``t``.

    Attributes:
        input_ids: ``[B, T]`` int64, prompt then completion, padded with ``pad_id``.
        attention_mask: ``[B, T]`` int64, 1 on real tokens.
        loss_mask: ``[B, T-1]`` float32, 1 where ``input_ids[:, t+1]`` is a completion token.
        old_logprobs: ``[B, T-1]`` float32, the rollout's logprobs at those positions, 0
            elsewhere.
        advantages: ``[B]`` float32.
        temperature: sampling temperature ``T > 0`` of the rollouts.
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    loss_mask: torch.Tensor
    old_logprobs: torch.Tensor
    advantages: torch.Tensor
    temperature: float


@dataclass(frozen=True)
class GRPOStats:
    """Diagnostics of one loss evaluation (all over completion tokens).

    Attributes:
        loss: the scalar loss value.
        ratio_mean: mean of ``ρ_t``.
        clip_fraction: share of tokens where clipping changed the objective.
        approx_kl: mean of ``(ρ_t − 1) − log ρ_t`` (Schulman's k3 estimator of
            KL(π_old ‖ π_θ)), ≥ 0.
        tokens: number of completion tokens.
        grad_norm: total gradient norm before clipping (``train_step`` only).
    """

    loss: float
    ratio_mean: float
    clip_fraction: float
    approx_kl: float
    tokens: int
    grad_norm: float | None = None


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Group-relative advantages ``(r − mean) / (std + eps)`` (DeepSeekMath §4.1.2).

    ``std`` is the sample standard deviation (Bessel-corrected, as TRL's GRPO trainer).

    Args:
        rewards: ``[G]`` rewards of one prompt's group.
        eps: added to ``std``.

    Returns:
        ``[G]`` float32; all zeros when every reward is equal (no signal) or ``G == 1``.

    Raises:
        LocalProtocolError: ``rewards`` is not 1-D and non-empty, or holds a non-finite value.
    """
    if rewards.dim() != 1 or rewards.numel() == 0:
        raise LocalProtocolError(f"rewards must be a non-empty 1-D tensor, got {rewards.shape}")
    r = rewards.detach().to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise LocalProtocolError("non-finite reward")
    if r.numel() == 1 or bool((r == r[0]).all()):
        return torch.zeros_like(r, dtype=torch.float32)
    return ((r - r.mean()) / (r.std() + eps)).to(torch.float32)


def collate(rollouts: Sequence[Rollout], pad_id: int, temperature: float = 1.0) -> GRPOBatch:
    """Pack rollouts into a right-padded :class:`GRPOBatch`.

    Raises:
        LocalProtocolError: no rollouts, an empty prompt or completion, a logprob count
            that differs from the completion length, or ``temperature <= 0``.
    """
    if not rollouts:
        raise LocalProtocolError("empty batch")
    if not temperature > 0.0:
        raise LocalProtocolError(f"temperature must be > 0, got {temperature}")
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    batch = len(rollouts)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((batch, width), dtype=torch.int64)
    loss_mask = torch.zeros((batch, width - 1), dtype=torch.float32)
    old = torch.zeros((batch, width - 1), dtype=torch.float32)
    for i, r in enumerate(rollouts):
        length, count = len(r.prompt_ids), len(r.completion_ids)
        if length == 0 or count == 0 or len(r.logprobs) != count:
            raise LocalProtocolError(
                f"rollout {i}: prompt {length}, completion {count}, logprobs {len(r.logprobs)}"
            )
        input_ids[i, : length + count] = torch.tensor([*r.prompt_ids, *r.completion_ids])
        attention_mask[i, : length + count] = 1
        loss_mask[i, length - 1 : length - 1 + count] = 1.0
        old[i, length - 1 : length - 1 + count] = torch.tensor(list(r.logprobs))
    advantages = torch.tensor([float(r.advantage) for r in rollouts], dtype=torch.float32)
    return GRPOBatch(input_ids, attention_mask, loss_mask, old, advantages, temperature)


def grpo_loss(
    model: Any, batch: GRPOBatch, clip_eps: float = 0.2, clip_delta: float = 4.0
) -> tuple[torch.Tensor, GRPOStats]:
    """The clipped GRPO surrogate, negated (a loss to minimize).

    Args:
        model: a causal LM returning ``.logits [B, T, V]``; float32 for training.
        batch: see :class:`GRPOBatch`.
        clip_eps: PPO clip range ``ε``.
        clip_delta: upper bound ``δ > 1 + ε`` on ``ρ_t`` for negative advantages.

    Returns:
        ``(loss, stats)``: ``loss`` is a 0-d float32 tensor with a graph to the parameters.

    Raises:
        LocalProtocolError: the batch has no completion token, or ``clip_delta <= 1 + ε``.
    """
    if not clip_delta > 1.0 + clip_eps:
        raise LocalProtocolError(f"clip_delta {clip_delta} must exceed 1 + clip_eps")
    mask = batch.loss_mask
    tokens = int(mask.sum().item())
    if tokens == 0:
        raise LocalProtocolError("batch has no completion tokens")
    logits = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask).logits
    logp = torch.log_softmax(logits[:, :-1].float() / batch.temperature, dim=-1)
    new = logp.gather(2, batch.input_ids[:, 1:].unsqueeze(2)).squeeze(2)  # [B, T-1]
    log_ratio = (new - batch.old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = batch.advantages.unsqueeze(1)  # [B, 1]
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    objective = torch.minimum(unclipped, clipped)
    objective = torch.where(adv < 0, torch.maximum(objective, clip_delta * adv), objective)
    loss = -(objective * mask).sum() / tokens
    with torch.no_grad():
        changed = (objective != unclipped).float()
        stats = GRPOStats(
            loss=float(loss.item()),
            ratio_mean=float((ratio * mask).sum().item() / tokens),
            clip_fraction=float((changed * mask).sum().item() / tokens),
            approx_kl=float((((ratio - 1.0) - log_ratio) * mask).sum().item() / tokens),
            tokens=tokens,
        )
    return loss, stats


def make_optimizer(model: torch.nn.Module, lr: float = DEFAULT_LR) -> torch.optim.AdamW:
    """AdamW over the (float32) parameters: betas (0.9, 0.99), no weight decay."""
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.99), weight_decay=0.0)


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: GRPOBatch,
    clip_eps: float = 0.2,
    max_grad_norm: float = 1.0,
) -> GRPOStats:
    """One optimizer step on ``batch``: loss, backward, global-norm clip, step.

    Raises:
        LocalProtocolError: a parameter is not float32 (train on master weights), or see
            :func:`grpo_loss`.
    """
    for name, param in model.named_parameters():
        if param.dtype != torch.float32:
            raise LocalProtocolError(f"parameter {name} is {param.dtype}, want float32 master")
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss, stats = grpo_loss(model, batch, clip_eps)
    loss.backward()  # type: ignore[no-untyped-call]
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    model.eval()
    return dataclasses.replace(stats, grad_norm=float(grad_norm))
