"""A trainer outside shardnet, driven by ``shardnet origin --watch W --rollouts-out R``.

The loop an external trainer (prime-rl, verl, TRL, your own) runs against the data plane:

1. write version 0 (an ordinary Hugging Face model directory plus an empty ``DONE`` file) as
   ``W/step-0/``; the origin publishes it, relays and peers fetch it, peers generate rollouts
   and send them to the origin, which verifies them and writes the accepted ones as Parquet
   files under ``R/step-0/`` (schema: ``rollout/parquet_out.py``);
2. for ``k = 1..steps``: wait until ``R/step-<k-1>/`` holds ``--min-batches`` files (one per
   peer, say) or ``--wait-s`` passes; read them, compute GRPO group advantages from the
   rewards, take one plain PyTorch optimizer step (the clipped GRPO loss of
   ``trainer/grpo.py``), and write ``W/step-<k>/`` (renamed into place, then ``DONE``);
3. after the last step, wait for the last version's rollouts as for the others (nobody trains
   on them: they show where the reward got to), then write ``W/FINISHED``: the origin signs
   the run's end (peers stop generating, ``--exit-on-finish`` ones exit). Started again, it
   removes ``W/FINISHED`` first, which continues the run: it resumes from the newest complete
   ``W/step-<N>/`` (its weights; the optimizer state starts afresh, as this example does not
   save it) and trains steps ``N+1..--steps``; a step number the origin published is never
   written again (the origin would not publish it twice).

The rewards are the trainer's own: every row is scored again with ``--task``/``--task-reward``
(the same specs the origin and the peers were given; the prompt is recomputed from the row's
submitter, step and prompt index, as the validator does), and rows where that differs from the
validator's ``reward`` column are counted (``reward_mismatches``; 0 when both sides agree).

``--model DIR`` starts from a Hugging Face model directory (any causal LM): its tokenizer, chat
template and generation config are copied verbatim into every version, so peers load that
tokenizer from the checkpoint. Without it, a demo preset is built (``--preset``).

Run beside an origin, e.g.::

    python docs/external_trainer.py --watch ckpts --rollouts rollouts --steps 10 \
        --model my-model --task tasks/arithmetic.jsonl --task-reward 'numeric'

It prints one JSON line per step on stdout: ``{"step": k, "rows": n, "batches": b,
"mean_reward": r, "reward_mismatches": m, "loss": ...}`` (the reward is that of the rollouts
trained on, i.e. of version ``k-1``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from rollout.model_dir import load_trainable, pad_token_id
from rollout.parquet_out import read_rollouts
from rollout.task import Task, load_task, task_prompts
from trainer.checkpoint import save_checkpoint, write_preset_dir
from trainer.grpo import Rollout, collate, group_advantages, make_optimizer, train_step

STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")


def publish(model: torch.nn.Module, tokenizer: object, assets: Path, watch: Path, k: int) -> None:
    """Write ``watch/step-<k>/`` (bf16, HF layout) atomically, then its ``DONE`` marker."""
    final = watch / f"step-{k}"
    tmp = watch / f".step-{k}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    save_checkpoint(model, tokenizer, tmp, 1 << 30, assets_from=assets)  # type: ignore[arg-type]
    os.replace(tmp, final)
    (final / "DONE").write_text("")


def newest_step(watch: Path) -> int | None:
    """The newest ``watch/step-<N>/`` holding its ``DONE`` marker (``N`` without leading
    zeros, as the origin reads them), or None."""
    names = (STEP_DIR.fullmatch(d.name) for d in watch.iterdir())
    return max((int(m[1]) for m in names if m and (watch / m[0] / "DONE").exists()), default=None)


def wait_rollouts(rollouts: Path, step: int, min_batches: int, wait_s: float) -> None:
    """Wait until ``rollouts/step-<step>/`` holds ``min_batches`` files, or ``wait_s``."""
    directory = rollouts / f"step-{step}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if directory.is_dir():
            files = [n for n in os.listdir(directory) if n.endswith(".parquet")]
            if len(files) >= min_batches:
                return
        time.sleep(0.5)


def rescore(rows: list[dict[str, Any]], task: Task, tokenizer: Any) -> int:
    """Score every row with ``task`` (its prompt recomputed from submitter, step and index);
    the row's ``reward`` becomes that score. Returns how many differed from the validator's."""
    prompts: dict[tuple[str, int], list[Any]] = {}
    for key in {(r["submitter"], r["policy_step"]) for r in rows}:
        n = 1 + max(r["prompt_index"] for r in rows if (r["submitter"], r["policy_step"]) == key)
        prompts[key] = task_prompts(task, key[0], key[1], n)
    mismatches = 0
    for r in rows:
        prompt = prompts[(r["submitter"], r["policy_step"])][r["prompt_index"]]
        mine = float(task.reward(r["completion_ids"], tokenizer, prompt))
        mismatches += abs(mine - float(r["reward"])) > 1e-9
        r["reward"] = mine
    return mismatches


def to_rollouts(rows: list[dict[str, Any]]) -> tuple[list[Rollout], list[float], float]:
    """GRPO rollouts (advantages within each ``group_id``), rewards, temperature."""
    groups: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        groups[str(row["group_id"])].append(row)
    out: list[Rollout] = []
    for members in groups.values():
        rewards = torch.tensor([float(m["reward"]) for m in members])
        for m, a in zip(members, group_advantages(rewards), strict=True):
            out.append(Rollout(m["prompt_ids"], m["completion_ids"], m["logprobs"], float(a)))
    temperature = float(rows[0]["temperature"]) if rows else 1.0
    return out, [float(r["reward"]) for r in rows], temperature


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--watch", type=Path, required=True, help="directory the origin watches")
    ap.add_argument("--rollouts", type=Path, required=True, help="the origin's --rollouts-out")
    ap.add_argument(
        "--steps", type=int, default=5, help="optimizer steps in all (a restart continues)"
    )
    ap.add_argument(
        "--model", type=Path, help="HF model directory to start from (its tokenizer is kept)"
    )
    ap.add_argument("--preset", default="tiny", help="demo model when --model is unset")
    ap.add_argument("--task", default="digits", help="task spec (as the origin's --task)")
    ap.add_argument("--task-reward", default="exact", help="as the origin's --task-reward")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-batches", type=int, default=1, help="batch files to wait for")
    ap.add_argument("--wait-s", type=float, default=300.0, help="longest wait per step, s")
    args = ap.parse_args(argv)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    args.watch.mkdir(parents=True, exist_ok=True)
    model_dir = args.model or write_preset_dir(
        args.preset, args.seed, args.watch.parent / f".{args.preset}-seed{args.seed}"
    )
    done = newest_step(args.watch)  # started again: go on from the newest version written
    model, tokenizer = load_trainable(model_dir if done is None else args.watch / f"step-{done}")
    task = load_task(args.task, args.task_reward)
    optimizer = make_optimizer(model, args.lr)
    (args.watch / "FINISHED").unlink(missing_ok=True)  # the run goes on (again)
    if done is None:
        publish(model, tokenizer, model_dir, args.watch, 0)
    for k in range((done or 0) + 1, args.steps + 1):
        wait_rollouts(args.rollouts, k - 1, args.min_batches, args.wait_s)
        rows = read_rollouts(args.rollouts, step=k - 1).to_pylist()
        report: dict[str, object] = {"step": k, "rows": len(rows)}
        report["batches"] = len({r["batch_id"] for r in rows})
        if rows:
            report["reward_mismatches"] = rescore(rows, task, tokenizer)
            batch, rewards, temperature = to_rollouts(rows)
            stats = train_step(
                model, optimizer, collate(batch, pad_token_id(tokenizer), temperature)
            )
            report |= {"mean_reward": sum(rewards) / len(rewards), "loss": stats.loss}
        publish(model, tokenizer, model_dir, args.watch, k)
        print(json.dumps(report), flush=True)
    wait_rollouts(args.rollouts, args.steps, args.min_batches, args.wait_s)  # the last ones
    (args.watch / "FINISHED").write_text("")  # the origin signs the run's end
    return 0


if __name__ == "__main__":
    sys.exit(main())
