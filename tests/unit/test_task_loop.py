"""A dataset task through the real peer and validator code: the reward rises.

A locally built Qwen2-architecture model with a trained BPE tokenizer and a chat template
(``tests/byo_models.py``) learns on the shipped arithmetic dataset; every step publishes a
checkpoint directory the way the trainer does (assets copied verbatim), a peer generates a batch
from it with the checkpoint's own tokenizer (:func:`rollout.batch.build_batch`), the validator
accepts it (TOPLOC, sampling, prompts and rewards recomputed), and one GRPO step is taken on
the rewards the oracle recomputes. The reward is ``regex:^\\s*\\d`` (the answer starts with a
digit), a format reward dense enough for a random 2-layer model to learn in a few steps; the
exact-answer rewards (``numeric``) are checked in ``test_tasks.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from rollout.batch import SamplingConfig, build_batch
from rollout.engine import TransformersEngine
from rollout.model_dir import load_tokenizer, load_trainable, pad_token_id
from rollout.task import load_task
from rollout.tasks.arithmetic import DATASET
from rollout.verify import Validator, ValidatorConfig
from tests.byo_models import write_model_dir
from trainer.checkpoint import save_checkpoint
from trainer.grpo import Rollout, collate, group_advantages, make_optimizer, train_step
from trainer.oracle import TrainerOracle

SAMPLING = SamplingConfig(n_prompts=4, group_size=8, max_new_tokens=4)
PEERS = ("peer-a", "peer-b")


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def test_reward_rises_on_a_dataset_task_with_a_qwen2_model(tmp_path: Path) -> None:
    src = write_model_dir(tmp_path / "qwen2", "qwen2", seed=0)
    model, tok = load_trainable(src)
    task = load_task(str(DATASET), r"regex:^\s*\d")
    optimizer = make_optimizer(model, 1e-2)
    oracle = TrainerOracle(tok, task, keep=2)
    oracle.set_vocab_size(int(model.config.vocab_size))
    validator = Validator(
        ValidatorConfig(
            run_id="r",
            task=task.name,
            n_prompts=SAMPLING.n_prompts,
            group_size=SAMPLING.group_size,
            max_new_tokens=SAMPLING.max_new_tokens,
            temperature=SAMPLING.temperature,
            async_level=0,
        ),
        oracle,
    )
    engine = TransformersEngine()
    curve = []
    for step in range(STEPS):
        version = tmp_path / f"step-{step}"
        save_checkpoint(model, tok, version, 1 << 30, assets_from=src)
        digest = f"{step:064x}"
        oracle.add_version(step, digest, version)
        engine.load(version)
        peer_tok = load_tokenizer(version)
        rollouts, rewards = [], []
        for peer in PEERS:
            batch = build_batch(
                engine,
                peer_tok,
                task,
                peer_id=peer,
                run_id="r",
                step=step,
                manifest_digest=digest,
                cfg=SAMPLING,
            )
            verdict = validator.check(batch, sender=peer, current_step=step)
            assert verdict.accepted, verdict
            for g in batch.groups:
                r = torch.tensor(
                    [
                        oracle.reward(
                            s.completion_ids,
                            submitter=peer,
                            step=step,
                            prompt_index=g.prompt_index,
                            n_prompts=SAMPLING.n_prompts,
                        )
                        for s in g.samples
                    ]
                )
                assert r.tolist() == [s.reward for s in g.samples]
                rewards.append(r)
                rollouts += [
                    Rollout(g.prompt_ids, s.completion_ids, s.logprobs, float(a))
                    for s, a in zip(g.samples, group_advantages(r), strict=True)
                ]
        train_step(model, optimizer, collate(rollouts, pad_token_id(tok)))
        curve.append(round(torch.cat(rewards).mean().item(), 3))
    print("dataset task reward", curve)
    # measured (seeded, 1 thread): [0.156, 0.25, 0.219, 0.328, 0.703, 0.672, 0.812, 0.859]
    assert sum(curve[-2:]) / 2 > sum(curve[:2]) / 2 + 0.25


STEPS = 8
