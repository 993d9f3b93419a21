"""Realistic consecutive checkpoints: version N+1 from version N by a real optimizer step.

Benchmarks of delta encoding are only honest if consecutive versions differ the way RL
training makes them differ. Published RL runs change 0.6-3 % of bf16 elements per step: an
update of a few 1e-6 is below half an ulp for most bf16 weights and rounds away. This module
produces N+1 from N exactly as a trainer with fp32 master weights initialised from version N
would: one causal-LM loss on a seeded batch of task prompts (a real loss with real gradients),
backward through the bf16 model, then **Adam's first step** with bias correction, computed in
fp32 tensor by tensor (``m = (1-β1) g``, ``v = (1-β2) g²``, ``Δ = lr · m̂ / (√v̂ + ε)``), and the
result rounded to bf16 again. The first Adam step from fresh state is ``≈ lr · sign(g)``: every
weight receives an update of about ``lr``, so the share of bf16 elements that change is the
share of weights small enough for ``lr`` to cross a rounding boundary — the effect the
published figures describe. Memory stays at about two copies of the model in bf16 (weights and
gradients), so a 2 GiB model evolves on a small CPU machine.

Source: Kingma & Ba, "Adam" (arXiv 1412.6980), Algorithm 1; INTELLECT-2 and SparseRL-Sync
report the per-step change fractions quoted in DESIGN.md.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rollout.model import build_tokenizer, load_model
from rollout.task import DEFAULT_TASK
from trainer.checkpoint import save_checkpoint


@dataclass(frozen=True)
class EvolveStats:
    """What one evolution step did.

    Attributes:
        loss: the LM loss the gradients came from.
        elements: bf16 elements in the model.
        changed: elements whose bf16 bits changed.
        changed_fraction: ``changed / elements``.
    """

    loss: float
    elements: int
    changed: int

    @property
    def changed_fraction(self) -> float:
        """Share of bf16 elements that changed."""
        return self.changed / max(1, self.elements)


def _batch(tokenizer: Any, vocab: int, batch: int, seq_len: int, seed: int) -> torch.Tensor:
    rng = random.Random(seed)
    rows = []
    for i in range(batch):
        ids = list(tokenizer(DEFAULT_TASK.prompts_for(f"evolve-{seed}", i, 1)[0])["input_ids"])
        while len(ids) < seq_len:  # continue with digit tokens, the task's target behaviour
            ids.append(int(tokenizer.convert_tokens_to_ids(str(rng.randrange(10)))))
        rows.append([t % vocab for t in ids[:seq_len]])
    return torch.tensor(rows)


def evolve(
    src: Path,
    dst: Path,
    *,
    lr: float = 2e-6,
    seed: int = 0,
    batch: int = 2,
    seq_len: int = 32,
    max_shard_bytes: int = 1 << 30,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    threads: int | None = None,
) -> EvolveStats:
    """Write version N+1 of the checkpoint at ``src`` into ``dst`` (see module docstring).

    Args:
        src: a checkpoint directory (bf16 weights).
        dst: the new checkpoint directory (must not exist or be empty).
        lr: Adam learning rate (RL-like: 1e-6 .. 3e-6).
        seed: seeds the loss batch.
        batch, seq_len: loss batch shape, sequences x tokens.
        max_shard_bytes: safetensors file size cap (use the one ``src`` was written with to
            keep the same file layout, so deltas line up).
        betas, eps: Adam hyper-parameters.
        threads: torch CPU threads (None: leave as is).

    Returns:
        the loss and the number of changed bf16 elements.

    Raises:
        CheckpointMismatch: ``src`` is not a loadable checkpoint.
        LocalProtocolError: ``dst`` exists and is not empty.
    """
    if threads is not None:
        torch.set_num_threads(threads)
    tokenizer = build_tokenizer()
    model: Any = load_model(src, dtype=torch.bfloat16)
    model.train()
    ids = _batch(tokenizer, int(model.config.vocab_size), batch, seq_len, seed)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    b1, b2 = betas
    elements = changed = 0
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is None:
                continue
            g = p.grad.float()
            m_hat = ((1 - b1) * g) / (1 - b1)
            v_hat = ((1 - b2) * g * g) / (1 - b2)
            new = (p.float() - lr * m_hat / (v_hat.sqrt() + eps)).to(torch.bfloat16)
            elements += p.numel()
            changed += int((new.view(torch.int16) != p.view(torch.int16)).sum())
            p.copy_(new)
            p.grad = None
    model.eval()
    save_checkpoint(model, tokenizer, dst, max_shard_bytes)
    return EvolveStats(float(out.loss.detach()), elements, changed)


def changed_fraction(a: Path, b: Path) -> float:
    """Share of bytes-as-bf16 elements that differ between same-named weight files."""
    total = diff = 0
    for f in sorted(a.glob("*.safetensors")):
        x = np.fromfile(f, dtype=np.uint8)
        y = np.fromfile(b / f.name, dtype=np.uint8)
        n = min(len(x), len(y)) // 2 * 2
        xs, ys = x[:n].view(np.uint16), y[:n].view(np.uint16)
        total += xs.size
        diff += int(np.count_nonzero(xs != ys))
    return diff / max(1, total)
