"""The trainer: collect verified rollouts, take GRPO steps, publish each version via the origin.

Theory of operation
-------------------
The trainer runs a shardcast node whose identity is the pinned trainer key, so its origin
signs every manifest and announcement. At start it issues the run card (the rules below, the
task's digest and the architecture digest of the model's ``config.json``; a new card version
only if the rules differ from the card stored in its data directory). It publishes version 0
(the seeded initial weights), then for each optimizer step ``k = 1..steps``:

1. take the verified batches usable at step ``k-1`` from the rollout inbox: policy step in
   ``[k-1-async_level, k-1]``; wait until :mod:`trainer.readiness` says the step is ready
   (``min_batches``, by default one per known peer; or every known peer delivered; or
   ``step_timeout_s``), logging what it waits for every ``wait_log_interval_s``, so peers
   that lag up to ``async_level`` versions still contribute (asynchronous RL, INTELLECT-2 §2);
2. recompute every reward (the peer's own number is never used), compute GRPO group
   advantages and take one AdamW step on the fp32 master weights (:mod:`trainer.grpo`);
3. save the fp32 master weights and optimizer state for version ``k`` in the data directory
   (:mod:`trainer.resume`), write version ``k`` as bf16 safetensors into a staging directory
   and publish it.

After the last step (and the wait for the last broadcast) it signs and sends the run's end
(:class:`~shardcast.wire.finish.RunFinished`) and lingers ``finish_linger_s`` so that followers
polling it learn of it.

Restart: started on a data directory that holds versions, the trainer resumes
(:func:`trainer.resume.plan_resume`): it loads the saved state of its newest version ``L``,
announces ``L`` again at once and trains ``L+1`` next; it never commits a step number twice.
Each trainer process has a random session id, sent in its answers to peers' hellos, so
running peers notice the restart and re-introduce themselves. Restarted on a finished run with
a larger ``steps``, it first signs that the run continues
(:class:`~shardcast.wire.finish.RunContinued`): peers holding the run's end send no hello and
no rollouts until that lifts it.

The step counter seen by the inbox (``current_step``) is the newest *published* version, so
rollouts are judged against the versions peers can actually hold. Every figure of the per-step
table comes from counters, not from logs: broadcast time from the peers' commit reports, origin
bytes from the HTTP lane, accepted/rejected samples from the validator.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import random
import shutil
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import trio

from p2p.errors import ConfigError, short_id
from p2p.identity import Identity
from p2p.trust import TrustList
from rollout.calibrate import card_profile
from rollout.inbox import AcceptedBatch, RolloutInbox
from rollout.model_dir import load_trainable, pad_token_id
from rollout.reputation import Reputation
from rollout.task import Task, load_task, task_spec
from rollout.verify import DEFAULT_PROFILES, EngineProfile, Validator, ValidatorConfig
from shardcast.node import ShardcastNode, iso, wall_of
from shardcast.publish import Origin, PreEncoded
from shardcast.store import latest_committed
from shardcast.wire import (
    RunCard,
    SamplingRules,
    TaskSpec,
    architecture_digest,
    next_card,
)
from trainer.checkpoint import (
    config_json,
    file_bytes,
    save_checkpoint,
    weight_files,
    write_preset_dir,
)
from trainer.config import TrainerConfig
from trainer.dataplane import RolloutIntake
from trainer.encode import Layouts, TensorEncoder, usable
from trainer.grpo import Rollout, collate, group_advantages, make_optimizer, train_step
from trainer.oracle import TrainerOracle
from trainer.readiness import (
    Every,
    StepReadiness,
    StepSnapshot,
    decide,
    known_peers,
    need_batches,
)
from trainer.resume import (
    ResumeKind,
    ResumePlan,
    check_state,
    load_state,
    plan_resume,
    prune_states,
    save_state,
    saved_steps,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from trio_typing import TaskStatus

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """One row of the trainer's report (version ``step`` and the optimizer step before it)."""

    step: int
    published_at: float
    manifest_digest: str
    size_bytes: int
    rollouts_accepted: int = 0
    rollouts_rejected: int = 0
    rejected_by_reason: dict[str, int] = field(default_factory=dict)
    mean_reward: float | None = None
    policy_steps_used: list[int] = field(default_factory=list)
    origin_bytes: int = 0
    train_stats: dict[str, float] = field(default_factory=dict)
    encoded_from_memory: int = 0  #: weight files hashed and encoded from the tensors held


class Trainer:
    """Runs the training loop (see module docstring).

    Raises:
        ConfigError: (at construction) not the pinned trainer key, or a data directory the
            trainer cannot resume from (field ``data_dir``).
    """

    def __init__(self, identity: Identity, trust: TrustList, config: TrainerConfig) -> None:
        if identity.peer_id != trust.trainer:
            raise ConfigError("trust.trainer", "the trainer must run with the pinned trainer key")
        self.identity = identity
        self.trust = trust
        self.config = config
        self.records: list[StepRecord] = []
        self.published = -1
        self.node: ShardcastNode | None = None
        self.inbox: RolloutInbox | None = None
        self.validator: Validator | None = None
        self.intake: RolloutIntake | None = None
        self.reputation = Reputation()
        self.trained_samples = 0
        self.trained_verified_samples = 0
        self._rejected_mark: dict[str, int] = {}
        self.model_dir = config.model
        self.on_optimizer_step: Callable[[float], None] | None = None  # seconds (metrics)
        self.session = os.urandom(8).hex()
        self.encoder = TensorEncoder()
        self.plan = self._plan_start()

    def _plan_start(self) -> ResumePlan:
        """How this trainer starts from its data directory (see :mod:`trainer.resume`).

        Raises:
            ConfigError: the data directory cannot be resumed from (field ``data_dir``).
        """
        node = self.config.node
        plan = plan_resume(
            latest_committed(node.data_dir / "versions", node.run_id), saved_steps(node.data_dir)
        )
        if plan.kind is ResumeKind.INCONSISTENT:
            raise ConfigError(
                "data_dir",
                f"{node.data_dir}: {plan.detail}; the trainer cannot resume from it "
                "(use a fresh --data-dir, or restore its trainer-state/)",
            )
        if plan.kind is not ResumeKind.FRESH:
            check_state(node.data_dir, plan.step, self._state_meta())
        return plan

    def _state_meta(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "run_id": cfg.node.run_id,
            "preset": cfg.preset,
            "seed": cfg.seed,
            "optimizer": cfg.optimizer,
        }

    async def run(
        self, *, task_status: TaskStatus[ShardcastNode] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run every step, wait for the last broadcast, and return."""
        cfg = self.config
        torch.manual_seed(cfg.seed)
        self.model_dir = cfg.model or write_preset_dir(
            cfg.preset, cfg.seed, cfg.node.data_dir / "models" / f"{cfg.preset}-seed{cfg.seed}"
        )
        model, tokenizer = load_trainable(self.model_dir)
        task = load_task(cfg.task, cfg.task_reward)
        optimizer = (
            make_optimizer(model, cfg.lr)
            if cfg.optimizer == "adamw"
            else torch.optim.SGD(model.parameters(), lr=cfg.lr)
        )
        rules = self.card_rules(model, task)
        profiles = self.validator_profiles(rules.architecture_digest)
        if profiles and cfg.validator_profile is not None:
            card = card_profile(cfg.validator_profile, profiles)
            rules = replace(rules, validator_profile=card)
        self.intake = intake = self._intake(model, tokenizer, task, profiles)
        oracle = intake.oracle
        self.validator = intake.validator
        self.reputation = intake.reputation
        staging = cfg.node.data_dir / "staging"
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        async with (
            contextlib.aclosing(intake),
            ShardcastNode.open(self.identity, self.trust, cfg.node) as node,
            trio.open_nursery() as nursery,
        ):
            self.node = node
            node.set_card(next_card(rules, node.card, self.identity))
            origin = Origin(node, cfg.origin)
            self.inbox = intake.open_inbox(node.p2p, lambda: self.published)
            await nursery.start(self.inbox.run)
            plan = self.plan
            if plan.kind is not ResumeKind.FRESH:
                await self._load_resumed_state(plan, model, optimizer)
            task_status.started(node)
            start = await self._start(
                plan, origin, oracle, model, optimizer, tokenizer, staging, nursery
            )
            for k in range(start, cfg.steps + 1):
                batches = await self._collect(k)
                stats = await self._train(model, optimizer, tokenizer, oracle, batches, k)
                await self._publish(origin, oracle, model, tokenizer, staging, k, optimizer)
                self.records[-1].train_stats = stats
            if start <= cfg.steps:
                await self._wait_final_broadcast()
            finished = await origin.announce_finished()
            if finished is not None:
                log.info(
                    "run_finished_announced step=%d linger_s=%.1f",
                    finished.step,
                    cfg.finish_linger_s,
                )
                await trio.sleep(cfg.finish_linger_s)
            self._close_rejections()
            nursery.cancel_scope.cancel()

    def _intake(
        self, model: Any, tokenizer: Any, task: Task, profiles: dict[str, EngineProfile]
    ) -> RolloutIntake:
        """The rollout intake (validator, reputation, oracle) of this run's settings."""
        cfg = self.config
        vcfg = ValidatorConfig(
            run_id=cfg.node.run_id,
            task=task.name,
            n_prompts=cfg.n_prompts,
            group_size=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            async_level=cfg.async_level,
            check_model=cfg.check_model,
            engines=tuple(e.id for e in cfg.engines),
            profiles={**DEFAULT_PROFILES, **profiles},
        )
        return RolloutIntake(
            vcfg,
            tokenizer,
            task,
            int(cast(Any, model).config.vocab_size),
            self.trust,
            inbox=cfg.inbox,
            session=self.session,
        )

    async def _load_resumed_state(self, plan: ResumePlan, model: Any, optimizer: Any) -> None:
        """Load the model and optimizer state saved at ``plan.step`` (a resumed run)."""
        meta = self._state_meta()
        data_dir = self.config.node.data_dir
        await trio.to_thread.run_sync(
            lambda: load_state(data_dir, plan.step, model, optimizer, meta)
        )
        log.info(
            "trainer_resumed plan=%s step=%d published=%s session=%s",
            plan.kind.value,
            plan.step,
            plan.published,
            self.session,
        )

    def validator_profiles(self, arch_digest: str) -> dict[str, EngineProfile]:
        """The engine profiles of ``validator_profile`` for the run's engines (empty without
        one), after checking it was calibrated on the model of ``arch_digest``.

        Raises:
            ConfigError: on ``validator_profile``: another architecture, or none of the run's
                engines.
        """
        cfg = self.config
        if cfg.validator_profile is None:
            return {}
        cfg.validator_profile.check_architecture(arch_digest)
        profiles = cfg.validator_profile.for_engines(tuple(e.id for e in cfg.engines))
        log.info(
            "validator_profile digest=%s engines=%s model=%s honest_rollouts=%d",
            cfg.validator_profile.digest(),
            ",".join(sorted(profiles)),
            cfg.validator_profile.provenance.model,
            cfg.validator_profile.provenance.honest_rollouts,
        )
        return profiles

    def card_rules(self, model: Any, task: Task) -> RunCard:
        """The run card this trainer publishes for ``model`` and ``task`` (version 1, issued
        now; see :func:`shardcast.wire.runcard.next_card` for versions after a change of rules)."""
        cfg = self.config
        return RunCard(
            card_version=1,
            run_id=cfg.node.run_id,
            trainer=self.identity.peer_id,
            task=TaskSpec(*task_spec(task)),
            sampling=SamplingRules(
                cfg.n_prompts, cfg.group_size, cfg.max_new_tokens, cfg.temperature
            ),
            engines=cfg.engines,
            async_level=cfg.async_level,
            architecture_digest=architecture_digest(json.loads(config_json(model))),
            issued_at_ms=int(time.time() * 1000),
            mirrors=cfg.card_mirrors,
        )

    async def _start(
        self,
        plan: ResumePlan,
        origin: Origin,
        oracle: TrainerOracle,
        model: Any,
        optimizer: Any,
        tokenizer: Any,
        staging: Path,
        nursery: trio.Nursery,
    ) -> int:
        """Publish (or re-announce) the version training starts from; returns the next step.

        On a finished run with more steps to go, the continuation is sent again in the
        background (``nursery``) until the next version is out (:meth:`Origin.continue_run`).
        """
        if plan.kind is ResumeKind.RESUME:
            await self._resume(origin, oracle, plan.step)
            if plan.step >= self.config.steps:
                # Restarted after the last step: announce the end again at once. Waiting for
                # the expected peers would take start_wait_s + final_wait_s for nothing, since
                # peers that saw the signed run end no longer say hello.
                log.log(
                    logging.WARNING if plan.step > self.config.steps else logging.INFO,
                    "run_already_complete step=%d steps=%d%s",
                    plan.step,
                    self.config.steps,
                    " hint=--steps is below the newest published step; to go on with the run, "
                    f"give --steps above {plan.step}"
                    if plan.step > self.config.steps
                    else "",
                )
            else:
                # Followers may hold this run's signed end (an earlier process finished it):
                # peers that hold it say no hello and send no rollouts, so lift it first.
                await origin.continue_run(nursery)  # resent until the next version is out
                await self._wait_joined()
            return plan.step + 1
        step = 0 if plan.kind is ResumeKind.FRESH else plan.step
        if step > 0:  # REPUBLISH: rollouts may still be judged against the versions before
            await self._register_versions(oracle, step - 1)
        await self._wait_joined()
        await self._publish(origin, oracle, model, tokenizer, staging, step, optimizer)
        return step + 1

    async def _register_versions(self, oracle: TrainerOracle, newest: int) -> None:
        """Give the validator the committed versions of the async window ending at ``newest``."""
        assert self.node is not None
        assert self.intake is not None
        await self.intake.add_committed(self.node.store, self.trust, newest)

    async def _resume(self, origin: Origin, oracle: TrainerOracle, step: int) -> None:
        """Serve and re-announce committed version ``step`` as the current one."""
        assert self.node is not None
        await self._register_versions(oracle, step)
        ann = await origin.reannounce()
        assert ann is not None
        store = self.node.store
        m = await trio.to_thread.run_sync(lambda: store.load_manifest(step, self.trust))
        self.published = step
        self.records.append(
            StepRecord(step, trio.current_time(), ann.manifest_digest, m.total_bytes)
        )

    async def _publish(
        self,
        origin: Origin,
        oracle: TrainerOracle,
        model: Any,
        tokenizer: Any,
        staging: Path,
        step: int,
        optimizer: Any,
    ) -> None:
        """Save the trainer state of ``step`` (unless saved already) and write its checkpoint
        while another thread hashes and encodes it from the tensors, then publish it."""
        directory = staging / f"step-{step}"
        pre_encoded, layouts = await self._write_and_encode(
            origin, model, tokenizer, optimizer, directory, step
        )
        try:
            result = await origin.publish(directory, step, pre_encoded=pre_encoded)
        finally:
            await trio.to_thread.run_sync(
                functools.partial(shutil.rmtree, _cache_dir(directory), ignore_errors=True)
            )
        self.encoder.published(layouts)
        await trio.to_thread.run_sync(prune_states, self.config.node.data_dir, step)
        assert self.intake is not None
        await self.intake.add_version(step, result.manifest.digest, result.path)
        self._close_rejections()
        self.published = step
        self.records.append(
            StepRecord(
                step,
                result.announced_at,
                result.manifest.digest,
                result.manifest.total_bytes,
                encoded_from_memory=len(pre_encoded),
            )
        )

    async def _write_and_encode(
        self,
        origin: Origin,
        model: Any,
        tokenizer: Any,
        optimizer: Any,
        directory: Path,
        step: int,
    ) -> tuple[dict[str, PreEncoded], Layouts]:
        """Save the trainer state of ``step`` (unless saved already) and write the version into
        ``directory`` while another thread hashes and delta-encodes its weight files from the
        tensors (:mod:`trainer.encode`); returns the results whose files are as predicted, and
        the version's layouts (the next version's base)."""
        cfg = self.config
        data_dir = cfg.node.data_dir
        weights = await trio.to_thread.run_sync(
            lambda: weight_files(model, cfg.max_shard_bytes, copy=True)
        )
        predicted = {w.name: file_bytes(w) for w in weights}
        layouts = Layouts(
            step,
            {n: fb[0] for n, fb in predicted.items() if fb is not None},
            {n: fb[1] for n, fb in predicted.items() if fb is not None},
        )
        plan = origin.encode_plan(step, previous_pending=False)
        assert plan is not None  # decided: nothing of ours is pending
        settings, base = plan
        results: dict[str, PreEncoded] = {}

        async def encode() -> None:
            results.update(
                await trio.to_thread.run_sync(
                    self.encoder.encode, layouts, settings, base, _cache_dir(directory)
                )
            )

        async with trio.open_nursery() as nursery:
            nursery.start_soon(encode)
            if step not in await trio.to_thread.run_sync(saved_steps, data_dir):
                meta = self._state_meta()
                await trio.to_thread.run_sync(
                    lambda: save_state(data_dir, step, model, optimizer, meta)
                )
            await trio.to_thread.run_sync(
                lambda: save_checkpoint(
                    model,
                    tokenizer,
                    directory,
                    cfg.max_shard_bytes,
                    assets_from=self.model_dir,
                    weights=weights,
                )
            )
        ok = await trio.to_thread.run_sync(usable, directory, layouts, results)
        return ok, layouts

    async def _train(
        self,
        model: Any,
        optimizer: Any,
        tokenizer: Any,
        oracle: TrainerOracle,
        batches: list[AcceptedBatch],
        k: int,
    ) -> dict[str, float]:
        assert self.validator is not None
        rollouts: list[Rollout] = []
        rewards: list[float] = []
        assert self.intake is not None
        for ab in batches:
            for g, group_rewards in zip(ab.batch.groups, self.intake.rewards(ab), strict=True):
                r = torch.tensor(group_rewards)
                rewards.extend(r.tolist())
                for s, a in zip(g.samples, group_advantages(r), strict=True):
                    rollouts.append(Rollout(g.prompt_ids, s.completion_ids, s.logprobs, float(a)))
        self.trained_samples += len(rollouts)
        self.trained_verified_samples += sum(ab.batch.n_samples for ab in batches)
        out: dict[str, float] = {}
        if rollouts:
            batch = collate(rollouts, pad_token_id(tokenizer), self.config.temperature)
            t0 = time.perf_counter()
            st = await trio.to_thread.run_sync(train_step, model, optimizer, batch)
            if self.on_optimizer_step is not None:
                self.on_optimizer_step(time.perf_counter() - t0)
            out = {
                "loss": st.loss,
                "approx_kl": st.approx_kl,
                "clip_fraction": st.clip_fraction,
                "grad_norm": st.grad_norm or 0.0,
            }
        else:
            log.warning("train_step_skipped step=%d reason=no_rollouts", k)
        rec = self.records[-1]  # the version these rollouts were judged against
        rec.rollouts_accepted = len(rollouts)
        rec.mean_reward = sum(rewards) / len(rewards) if rewards else None
        rec.policy_steps_used = sorted({ab.batch.policy_step for ab in batches})
        log.info(
            "train_step step=%d samples=%d mean_reward=%s policy_steps=%s",
            k,
            len(rollouts),
            f"{rec.mean_reward:.4f}" if rec.mean_reward is not None else "n/a",
            rec.policy_steps_used,
        )
        return out

    def _close_rejections(self) -> None:
        """Attribute the rejections since the last publish to the version then current."""
        assert self.validator is not None
        now = dict(self.validator.statistics().rejected_samples)
        if self.records:
            rec = self.records[-1]
            rec.rejected_by_reason = {
                r: n - self._rejected_mark.get(r, 0)
                for r, n in now.items()
                if n - self._rejected_mark.get(r, 0)
            }
            rec.rollouts_rejected = sum(rec.rejected_by_reason.values())
        self._rejected_mark = now

    def committed(self, step: int) -> dict[str, float]:
        """PeerID -> seconds from publish to its commit report, for version ``step``."""
        assert self.inbox is not None
        rec = next(r for r in self.records if r.step == step)
        out = {}
        for peer, versions in self.inbox.statuses.items():
            got = versions.get(step)
            if got is not None and got[0] == rec.manifest_digest:
                out[peer] = got[1] - rec.published_at
        return out

    def known_peers(self) -> frozenset[str]:
        """Peers the run can count on now (said hello, heard from within peer_timeout_s)."""
        assert self.inbox is not None
        return known_peers(
            self.inbox.joined,
            self.inbox.last_seen,
            trio.current_time(),
            self.config.peer_timeout_s,
            allowed=self.trust.submitters or None,
        )

    async def _collect(self, k: int) -> list[AcceptedBatch]:
        """Wait until step ``k`` is ready (:func:`trainer.readiness.decide`), logging what it
        waits for every ``wait_log_interval_s``; then take the usable batches."""
        assert self.inbox is not None
        cfg, inbox = self.config, self.inbox
        t0 = trio.current_time()
        every = Every(cfg.wait_log_interval_s, t0)
        while True:
            now = trio.current_time()
            known = self.known_peers()
            have, delivered = inbox.usable(k - 1)
            snap = StepSnapshot(
                have,
                need_batches(cfg.min_batches, len(known)),
                known,
                delivered,
                now - t0,
                cfg.step_timeout_s,
                inbox.rejected_within(k - 1),
            )
            verdict = decide(snap)
            if verdict is not StepReadiness.WAIT:
                log.info(
                    "step_ready step=%d reason=%s have_batches=%d need_batches=%d "
                    "waited_s=%.1f peers_known=%d peers_delivered=%d",
                    k,
                    verdict.value,
                    have,
                    snap.need_batches,
                    snap.waited_s,
                    len(known),
                    len(delivered & known),
                )
                return await inbox.take(min_batches=0, step=k - 1, timeout_s=0)
            if every.due(now):
                log.info(
                    "waiting_for_rollouts step=%d have_batches=%d need_batches=%d waited_s=%.1f "
                    "timeout_s=%.0f peers_known=%d peers_delivered=%d waiting_on=%s",
                    k,
                    have,
                    snap.need_batches,
                    snap.waited_s,
                    cfg.step_timeout_s,
                    len(known),
                    len(delivered & known),
                    ",".join(sorted(short_id(p) for p in known - delivered)) or "-",
                )
            left = t0 + cfg.step_timeout_s - now
            with trio.move_on_after(max(0.0, min(every.wait_s(now), left))):
                await inbox.wait_change()

    async def _wait_joined(self) -> None:
        assert self.inbox is not None
        expected = set(self.config.expected_peers)
        if not expected:
            return
        t0 = trio.current_time()
        every = Every(self.config.wait_log_interval_s, t0)
        with trio.move_on_after(self.config.start_wait_s):
            while not expected <= set(self.inbox.joined):
                now = trio.current_time()
                if every.due(now):
                    missing = expected - set(self.inbox.joined)
                    log.info(
                        "waiting_for_peers joined=%d missing=%d waited_s=%.1f timeout_s=%.0f "
                        "missing_ids=%s",
                        len(expected) - len(missing),
                        len(missing),
                        now - t0,
                        self.config.start_wait_s,
                        ",".join(sorted(short_id(p) for p in missing)),
                    )
                with trio.move_on_after(every.wait_s(now)):
                    await self.inbox.wait_status_change()
        missing = expected - set(self.inbox.joined)
        if missing:
            log.warning("peers_missing_at_start count=%d", len(missing))
        else:
            log.info("peers_joined count=%d", len(expected))

    async def _wait_final_broadcast(self) -> None:
        assert self.inbox is not None
        expected = set(self.config.expected_peers)
        if not expected:
            return
        t0 = trio.current_time()
        every = Every(self.config.wait_log_interval_s, t0)
        with trio.move_on_after(self.config.final_wait_s):
            while not expected <= set(self.committed(self.published)):
                now = trio.current_time()
                if every.due(now):
                    log.info(
                        "waiting_for_final_broadcast step=%d committed=%d expected=%d "
                        "waited_s=%.1f timeout_s=%.0f",
                        self.published,
                        len(expected & set(self.committed(self.published))),
                        len(expected),
                        now - t0,
                        self.config.final_wait_s,
                    )
                with trio.move_on_after(every.wait_s(now)):
                    await self.inbox.wait_status_change()

    def report(self) -> dict[str, Any]:
        """The per-step report (JSON-ready; times as wall-clock ISO 8601; call in trio)."""
        assert self.node is not None
        assert self.validator is not None
        assert self.inbox is not None
        steps = []
        expected = set(self.config.expected_peers)
        for rec in self.records:
            done = self.committed(rec.step)
            complete = bool(expected) and expected <= set(done)
            steps.append(
                {
                    "step": rec.step,
                    "manifest_digest": rec.manifest_digest,
                    "published_at": iso(
                        wall_of(rec.published_at, trio.current_time(), time.time())
                    ),
                    "size_bytes": rec.size_bytes,
                    "broadcast_s": max(done[p] for p in expected) if complete else None,
                    "origin_bytes": self.node.server.bytes_by_step.get(rec.step, 0),
                    "peers_committed": sorted(done),
                    "rollouts_accepted": rec.rollouts_accepted,
                    "rollouts_rejected": rec.rollouts_rejected,
                    "rejected_by_reason": rec.rejected_by_reason,
                    "mean_reward": rec.mean_reward,
                    "policy_steps_used": rec.policy_steps_used,
                    "train": rec.train_stats,
                    "encoded_from_memory": rec.encoded_from_memory,
                }
            )
        vs = self.validator.statistics()
        rs = self.reputation.statistics()
        return {
            "trainer": self.identity.peer_id,
            "session": self.session,
            "start": {"plan": self.plan.kind.value, "step": self.plan.step},
            "steps": steps,
            "validator": {
                "accepted_samples": vs.accepted_samples,
                "rejected_samples": vs.rejected_samples,
            },
            "reputation": {
                "scores": rs.scores,
                "refused": list(rs.refused),
                "refused_announcements": rs.refused_announcements,
                "rate_limited": rs.rate_limited,
            },
            "inbox": vars(self.inbox.statistics()),
            "trained_samples": self.trained_samples,
            "trained_verified_samples": self.trained_verified_samples,
            "origin_bytes_total": self.node.http.statistics().bytes_sent,
        }


def _cache_dir(directory: Path) -> Path:
    """Where the in-memory encoder puts the blobs of the version written to ``directory``."""
    return directory.with_name(f"{directory.name}.encoded")


def seeded_rng(seed: int, label: str) -> random.Random:
    """A ``random.Random`` seeded from ``(seed, label)`` (never the global RNG)."""
    return random.Random(f"{seed}:{label}")
