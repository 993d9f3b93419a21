"""The rollout data plane shared by ``shardnet trainer`` and ``shardnet origin --rollouts-out``.

Theory of operation
-------------------
:class:`RolloutIntake` is the one place where the receiving side of the rollout exchange is
set up: a :class:`~trainer.oracle.TrainerOracle` that follows the published versions, the
:class:`~rollout.verify.Validator` with the run's rules, submitter
:class:`~rollout.reputation.Reputation`, and the :class:`~rollout.inbox.RolloutInbox` serving
the announce/fetch/status protocols on the publishing node. Whoever publishes a version
registers it with :meth:`RolloutIntake.add_version`, so rollouts are judged against the
versions peers can actually hold.

What happens to accepted batches differs:

* ``shardnet trainer`` takes them per optimizer step and runs its built-in GRPO step
  (:mod:`trainer.trainer`);
* ``shardnet origin --rollouts-out DIR`` hands them to :class:`ParquetSink`, which recomputes
  every reward with the oracle and writes each batch atomically as a Parquet file for an
  external trainer (:mod:`rollout.parquet_out`), which in turn writes the next version into
  the directory the origin watches.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import short_id
from p2p.lanes import Host
from p2p.trust import TrustList
from rollout.inbox import AcceptedBatch, InboxConfig, RolloutInbox
from rollout.parquet_out import batch_table, write_batch
from rollout.reputation import Reputation
from rollout.task import Task
from rollout.verify import Validator, ValidatorConfig
from trainer.oracle import TrainerOracle

if TYPE_CHECKING:
    from collections.abc import Callable

    from shardcast.store import VersionStore

log = logging.getLogger(__name__)


class RolloutIntake:
    """Oracle, validator, reputation and inbox of one publishing node (module docstring).

    Args:
        rules: the run's rules for rollouts (from the run card's settings).
        tokenizer: the run's tokenizer (each registered version's own is used for it).
        task: the run's task (prompts and rewards).
        vocab_size: the model's vocabulary size (token ids at or above it are refused).
        trust: allowed submitters (``trust.submitter_allowed``).
        inbox: exchange settings.
        session: this process's session id (peers notice a restart by it).
    """

    def __init__(
        self,
        rules: ValidatorConfig,
        tokenizer: Any,
        task: Task,
        vocab_size: int,
        trust: TrustList,
        inbox: InboxConfig | None = None,
        session: str = "",
    ) -> None:
        self.rules = rules
        self.inbox_config = inbox or InboxConfig()
        self.session = session
        # a LATE batch is judged against its own version: keep the grace steps' models too
        keep = rules.async_level + 1 + self.inbox_config.late_grace_steps
        self.oracle = TrainerOracle(tokenizer, task, keep=keep, engines=rules.engines)
        self.oracle.set_vocab_size(vocab_size)
        self.validator = Validator(rules, self.oracle, allowed=trust.submitter_allowed)
        self.reputation = Reputation()
        self.inbox: RolloutInbox | None = None

    def open_inbox(self, p2p: Host, current_step: Callable[[], int]) -> RolloutInbox:
        """The inbox on ``p2p``; start it with ``nursery.start(inbox.run)``."""
        self.inbox = RolloutInbox(
            p2p,
            self.rules.run_id,
            self.validator,
            self.reputation,
            current_step=current_step,
            config=self.inbox_config,
            session=self.session,
        )
        return self.inbox

    def close(self) -> None:
        """Free the validator paths' engines (the vLLM engine of a run accepting
        ``vllm-bf16``, if one was started); idempotent."""
        self.oracle.close()

    async def aclose(self) -> None:
        """:meth:`close`, for ``contextlib.aclosing`` (the trainer closes its intake when its
        node stops)."""
        self.close()

    async def add_version(self, step: int, digest: str, path: Path) -> None:
        """Register published version ``step`` (loads its model in a worker thread when the
        model checks are on).

        Raises:
            CheckpointMismatch: the version's model or tokenizer cannot be loaded.
        """
        preload = self.rules.check_model
        await trio.to_thread.run_sync(
            lambda: self.oracle.add_version(step, digest, path, preload=preload)
        )

    async def add_committed(self, store: VersionStore, trust: TrustList, newest: int) -> None:
        """Register the committed versions of the async window ending at ``newest``."""
        lo = max(0, newest - self.rules.async_level - self.inbox_config.late_grace_steps)
        for s in range(lo, newest + 1):
            if store.has(s):
                m = await trio.to_thread.run_sync(lambda s=s: store.load_manifest(s, trust))
                await self.add_version(s, m.digest, store.version_dir(s))

    def rewards(self, ab: AcceptedBatch) -> list[list[float]]:
        """The task's reward of every sample of ``ab``, recomputed (``[group][sample]``)."""
        b = ab.batch
        return [
            [
                self.oracle.reward(
                    s.completion_ids,
                    submitter=b.submitter,
                    step=b.policy_step,
                    prompt_index=g.prompt_index,
                    n_prompts=b.n_prompts,
                )
                for s in g.samples
            ]
            for g in b.groups
        ]

    def rejected_by_reason(self) -> dict[str, int]:
        """Rejected samples by reason since start."""
        return dict(self.validator.statistics().rejected_samples)


@dataclass
class SinkStats:
    """Counters of a :class:`ParquetSink`.

    Attributes:
        files: Parquet files written.
        rows_by_step: rows written per policy step.
        reward_sum_by_step: sum of the recomputed rewards per policy step.
    """

    files: int = 0
    rows_by_step: dict[int, int] = field(default_factory=dict)
    reward_sum_by_step: dict[int, float] = field(default_factory=dict)

    @property
    def rows(self) -> int:
        """Rows written over all policy steps."""
        return sum(self.rows_by_step.values())

    def mean_reward(self, step: int) -> float | None:
        """Mean recomputed reward of policy step ``step``'s rows, or None."""
        n = self.rows_by_step.get(step, 0)
        return self.reward_sum_by_step[step] / n if n else None


class ParquetSink:
    """Writes every accepted batch of ``intake`` under ``out_dir`` (see :mod:`rollout.parquet_out`).

    Args:
        intake: the data plane whose inbox is running.
        out_dir: the ``--rollouts-out`` directory.
        current_step: the newest published version.
    """

    def __init__(
        self, intake: RolloutIntake, out_dir: Path, current_step: Callable[[], int]
    ) -> None:
        self.intake = intake
        self.out_dir = out_dir
        self.current_step = current_step
        self.stats = SinkStats()

    async def run(self) -> None:
        """Drain the inbox into Parquet files until cancelled. Cancellation leaves only
        complete files behind (a file being written is finished in its thread or never
        renamed into place)."""
        inbox = self.intake.inbox
        assert inbox is not None, "open the intake's inbox first"
        while True:
            batches = await inbox.take(min_batches=1, step=self.current_step(), timeout_s=3600)
            for ab in batches:
                await self.write(ab)

    async def write(self, ab: AcceptedBatch) -> Path:
        """Recompute the rewards of ``ab`` and write its file (in a worker thread)."""
        b, batch_id = ab.batch, ab.announcement.batch_id
        now_ms = int(time.time() * 1000)

        def work() -> tuple[Path, float, int]:
            rewards = self.intake.rewards(ab)
            table = batch_table(b, batch_id, rewards, now_ms)
            path = write_batch(self.out_dir, table, b.policy_step, batch_id)
            return path, sum(sum(r) for r in rewards), table.num_rows

        path, reward_sum, rows = await trio.to_thread.run_sync(work)
        st = self.stats
        st.files += 1
        st.rows_by_step[b.policy_step] = st.rows_by_step.get(b.policy_step, 0) + rows
        st.reward_sum_by_step[b.policy_step] = (
            st.reward_sum_by_step.get(b.policy_step, 0.0) + reward_sum
        )
        log.info(
            "rollouts_written step=%d submitter=%s batch=%s rows=%d mean_reward=%.4f path=%s",
            b.policy_step,
            short_id(b.submitter),
            batch_id[:8],
            rows,
            reward_sum / rows if rows else 0.0,
            path,
        )
        return path


class OriginDataPlane:
    """The rollout side of ``shardnet origin --rollouts-out``: intake + :class:`ParquetSink`.

    It starts with the first version the origin publishes (or holds, after a restart): the
    run's tokenizer and vocabulary size come from that checkpoint directory.

    Args:
        rules: the run's rules (the run card's sampling, task and async level).
        task: the run's task.
        trust: the origin's trust list (allowed submitters).
        inbox: exchange settings.
        out_dir: where the Parquet files go.
        session: this origin process's session id.
    """

    def __init__(
        self,
        rules: ValidatorConfig,
        task: Task,
        trust: TrustList,
        inbox: InboxConfig,
        out_dir: Path,
        session: str,
    ) -> None:
        self.rules, self.task, self.trust = rules, task, trust
        self.inbox_config, self.out_dir, self.session = inbox, out_dir, session
        self.current = -1
        self.intake: RolloutIntake | None = None
        self.sink: ParquetSink | None = None

    async def start(self, nursery: trio.Nursery, p2p: Host, model_dir: Path) -> None:
        """Build the intake from ``model_dir``'s tokenizer and config, serve the exchange
        protocols on ``p2p`` and drain accepted batches into Parquet files (in ``nursery``).

        Raises:
            ConfigError: ``model_dir`` has no loadable tokenizer or ``config.json`` (field
                ``rollouts_out``: the origin cannot verify rollouts without them).
        """
        import json

        from p2p.errors import ConfigError, ShardnetError
        from rollout.model_dir import load_tokenizer

        try:
            tokenizer = await trio.to_thread.run_sync(load_tokenizer, model_dir)
            config = json.loads((model_dir / "config.json").read_text())
            vocab = int(config.get("vocab_size") or len(tokenizer))
        except (ShardnetError, OSError, ValueError, AttributeError) as exc:
            raise ConfigError(
                "rollouts_out",
                f"cannot verify rollouts of {model_dir}: {exc} (a version needs its config "
                "and tokenizer)",
            ) from exc
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.intake = RolloutIntake(
            self.rules,
            tokenizer,
            self.task,
            vocab,
            self.trust,
            inbox=self.inbox_config,
            session=self.session,
        )
        inbox = self.intake.open_inbox(p2p, lambda: self.current)
        await nursery.start(inbox.run)
        self.sink = ParquetSink(self.intake, self.out_dir, lambda: self.current)
        nursery.start_soon(self.sink.run)
        log.info("rollouts_out_ready dir=%s vocab_size=%d", self.out_dir, vocab)

    async def published(self, step: int, digest: str, path: Path) -> None:
        """Register a version the origin just published (or holds) as the current one."""
        assert self.intake is not None
        await self.intake.add_version(step, digest, path)
        self.current = max(self.current, step)

    def report(self) -> dict[str, Any]:
        """JSON-ready counters: files and rows written per step, rejections by reason."""
        if self.intake is None or self.sink is None:
            return {"dir": str(self.out_dir), "started": False}
        vs = self.intake.validator.statistics()
        st = self.sink.stats
        assert self.intake.inbox is not None
        return {
            "dir": str(self.out_dir),
            "started": True,
            "files": st.files,
            "rows_by_step": {str(k): v for k, v in sorted(st.rows_by_step.items())},
            "mean_reward_by_step": {str(k): st.mean_reward(k) for k in sorted(st.rows_by_step)},
            "accepted_samples": vs.accepted_samples,
            "rejected_samples": vs.rejected_samples,
            "answers": self.intake.inbox.statistics().answers,
        }
