"""GRPO: advantages, batch packing, the clipped loss, and a short end-to-end learning run."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from p2p.errors import LocalProtocolError
from rollout.engine import TransformersEngine
from rollout.model import build_model, build_tokenizer
from rollout.task import prompts_for, reward
from trainer.checkpoint import save_checkpoint
from trainer.grpo import (
    DEFAULT_LR,
    Rollout,
    collate,
    group_advantages,
    grpo_loss,
    make_optimizer,
    train_step,
)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_group_advantages_standardizes() -> None:
    adv = group_advantages(torch.tensor([0.0, 1.0, 0.5, 0.5]))
    assert adv.dtype == torch.float32
    assert adv.mean().item() == pytest.approx(0.0, abs=1e-6)
    assert adv.std().item() == pytest.approx(1.0, abs=1e-4)
    assert adv.tolist() == pytest.approx([-1.2247, 1.2247, 0.0, 0.0], abs=1e-3)
    assert torch.equal(group_advantages(torch.tensor([0.1] * 8)), torch.zeros(8))
    assert torch.equal(group_advantages(torch.tensor([0.7])), torch.zeros(1))
    assert group_advantages(torch.tensor([0.0, 1.0])).tolist() == pytest.approx(
        [-1 / math.sqrt(2), 1 / math.sqrt(2)], abs=1e-5
    )


@pytest.mark.parametrize(
    "rewards", [torch.zeros(0), torch.zeros(2, 2), torch.tensor([0.0, float("nan")])]
)
def test_group_advantages_rejects(rewards: torch.Tensor) -> None:
    with pytest.raises(LocalProtocolError):
        group_advantages(rewards)


def test_collate_aligns_targets() -> None:
    a = Rollout([1, 10, 11], [20, 21], [-0.5, -0.25], 1.0)
    b = Rollout([1, 12], [22, 23, 24, 2], [-1.0, -2.0, -3.0, -4.0], -1.0)
    batch = collate([a, b], pad_id=0, temperature=0.9)
    assert batch.input_ids.tolist() == [[1, 10, 11, 20, 21, 0], [1, 12, 22, 23, 24, 2]]
    assert batch.attention_mask.tolist() == [[1, 1, 1, 1, 1, 0], [1] * 6]
    # logits at position t predict input_ids[t + 1]
    assert batch.loss_mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 1, 1, 1]]
    assert batch.old_logprobs.tolist() == [[0, 0, -0.5, -0.25, 0], [0, -1, -2, -3, -4]]
    assert batch.advantages.tolist() == [1.0, -1.0]
    assert batch.temperature == 0.9
    with pytest.raises(LocalProtocolError):
        collate([Rollout([1], [5, 6], [-1.0], 0.0)], pad_id=0)
    with pytest.raises(LocalProtocolError):
        collate([], pad_id=0)


def _policy_rollouts(model: torch.nn.Module, advantages: list[float]) -> list[Rollout]:
    """Rollouts whose old logprobs are the model's own (ratio 1 before any step)."""
    out = []
    with torch.no_grad():
        for i, adv in enumerate(advantages):
            prompt, completion = [1, 10 + i, 11], [20 + i, 21, 22 + i]
            ids = torch.tensor([prompt + completion])
            logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1].float(), dim=-1)
            old = logp[len(prompt) - 1 :].gather(1, torch.tensor(completion)[:, None])[:, 0]
            out.append(Rollout(prompt, completion, old.tolist(), adv))
    return out


def test_loss_on_policy_and_step_direction() -> None:
    model = build_model("tiny", seed=0, dtype=torch.float32)
    rollouts = _policy_rollouts(model, [1.0, -1.0])
    batch = collate(rollouts, pad_id=0)
    loss, stats = grpo_loss(model, batch)
    assert stats.ratio_mean == pytest.approx(1.0, abs=1e-5)
    assert stats.clip_fraction == 0.0
    assert stats.approx_kl == pytest.approx(0.0, abs=1e-6)
    assert stats.tokens == 6
    assert loss.item() == pytest.approx(0.0, abs=1e-6)  # mean advantage over tokens is 0
    step = train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), batch)
    assert step.grad_norm is not None
    assert step.grad_norm > 0
    _, after = grpo_loss(model, batch)
    new = collate(_policy_rollouts(model, [1.0, -1.0]), pad_id=0).old_logprobs
    gained = ((new - batch.old_logprobs) * batch.loss_mask).sum(dim=1)
    assert gained[0] > 0 > gained[1]  # positive advantage up, negative down
    assert after.loss < 0


def test_clipping_both_sides() -> None:
    model = build_model("tiny", seed=0, dtype=torch.float32)
    good, bad = _policy_rollouts(model, [1.0, -1.0])
    # old logprobs far below the current ones: ratio ≈ e^5 ≈ 148 on every token
    far = [
        Rollout(r.prompt_ids, r.completion_ids, [x - 5.0 for x in r.logprobs], r.advantage)
        for r in (good, bad)
    ]
    loss, stats = grpo_loss(model, collate(far[:1], pad_id=0), clip_eps=0.2)
    assert loss.item() == pytest.approx(-1.2, abs=1e-5)
    assert stats.clip_fraction == 1.0
    loss.backward()  # type: ignore[no-untyped-call]
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # clipped: no grad
    loss, stats = grpo_loss(model, collate(far[1:], pad_id=0), clip_delta=4.0)
    assert loss.item() == pytest.approx(4.0, abs=1e-5)
    assert stats.clip_fraction == 1.0
    with pytest.raises(LocalProtocolError):
        grpo_loss(model, collate(far, pad_id=0), clip_eps=0.2, clip_delta=1.1)


def test_train_step_needs_fp32_master() -> None:
    model = build_model("tiny", seed=0)  # bf16
    batch = collate([Rollout([1, 5], [6], [-1.0], 1.0)], pad_id=0)
    with pytest.raises(LocalProtocolError):
        train_step(model, make_optimizer(model), batch)


def _run(root: Path, steps: int, follow: bool) -> list[float]:
    """Trainer ⇄ engine loop: rollouts of step k come from checkpoint k (or always 0)."""
    peers, prompts, group, new_tokens = 2, 4, 8, 16
    tok = build_tokenizer()
    model = build_model("tiny", seed=0, dtype=torch.float32)
    optimizer = make_optimizer(model, DEFAULT_LR)
    save_checkpoint(model, tok, root / "0", 1 << 30)
    engine = TransformersEngine()
    curve = []
    for step in range(steps):
        engine.load(root / str(step if follow else 0))
        rollouts, rewards = [], []
        for p in range(peers):
            for k, text in enumerate(prompts_for(f"peer-{p}", step, prompts)):
                gens = engine.generate(
                    tok(text)["input_ids"], group, new_tokens, 1.0, 100 * step + k
                )
                r = torch.tensor([reward(g.completion_ids, tok) for g in gens])
                rewards.append(r)
                rollouts += [
                    Rollout(g.prompt_ids, g.completion_ids, g.logprobs, float(a))
                    for g, a in zip(gens, group_advantages(r), strict=True)
                ]
        train_step(model, optimizer, collate(rollouts, tok.pad_token_id))
        save_checkpoint(model, tok, root / str(step + 1), 1 << 30)
        curve.append(round(torch.cat(rewards).mean().item(), 3))
    return curve


def test_reward_rises_when_peers_follow_the_trainer(tmp_path: Path) -> None:
    """Measured (seeded, 1 thread): [0.072, 0.1, 0.129, 0.18, 0.212, 0.253, 0.349, 0.464]."""
    curve = _run(tmp_path, steps=8, follow=True)
    print("follow", curve)
    assert curve[0] < 0.12
    assert curve[-1] > curve[0] + 0.25
    assert curve[-1] > max(curve[:-1])


def test_reward_flat_when_peers_keep_old_weights(tmp_path: Path) -> None:
    """Control: the trainer learns, but rollouts never see it.

    Measured: [0.072, 0.061, 0.088, 0.09, 0.07, 0.066].
    """
    curve = _run(tmp_path, steps=6, follow=False)
    print("stale", curve)
    assert max(curve) - min(curve) < 0.06
    assert curve[-1] < 0.12
