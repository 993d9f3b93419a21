"""The inference peer: follow versions, load each into the engine, generate, submit rollouts.

Theory of operation
-------------------
A peer runs a shardcast node and a :class:`~shardcast.download.follower.Follower` on its
relays. Each committed version is reported to the trainer (``/shardnet/status/1.0.0``) and
wakes the generation loop, which always works on the newest committed version: load it into
the engine (the version directory is pinned against retention meanwhile), build one batch, one
group at a time (:func:`rollout.batch.build_group`) in a worker thread, and hand it to the
:class:`~rollout.exchange.RolloutSender`, which announces it and retries until the trainer
acknowledges. The network keeps running while the CPU generates.

Pacing (:mod:`rollout.pacing`): before each group after the first the peer asks its
:class:`~rollout.pacing.PaceMeter`; when a newer verified version is committed, or the next
group would likely end after the batch's time budget (from the trainer's cadence seen here and
the run card's async level), it hands over the groups done so far as a partial batch (the first
``k`` prompts) and moves on. A slow peer thus sends smaller batches that still arrive fresh
instead of whole batches the trainer refuses as stale.

Restarts: a peer started on a data directory keeps its committed versions and generates for
the newest at once. It says hello to the trainer every ``hello_interval_s`` (with its newest
committed version); the trainer's answer carries its session id, so when the trainer comes
back under a new session the peer re-introduces itself and, unless a batch is still on its
way, generates again for its newest version (the batches the old trainer process held were
lost with it). Once the trainer's signed run end is known the peer stops generating and
saying hello, keeps serving, and with ``exit_on_finish`` returns once it holds the final
version.

Stopping (SIGTERM, issue 25: a peer with dead connections took 72 s to exit): the worker
threads that generate, load weights or read the task are abandoned when the peer is cancelled
(``abandon_on_cancel``), so a stop does not wait for the group under way; the engine is then
interrupted (:class:`~rollout.engine.Interruptible`), so the abandoned thread ends at its next
token instead of running on while the process shuts down. vLLM's ``generate`` is one call that
cannot be stopped midway: the role runner then waits at most
:data:`shardnet.roles.ENGINE_CLOSE_WAIT_S` to close that engine and leaves the rest to the
process exit.

A forged peer for tests and benchmarks is this class with a ``forgery`` hook that tampers
with the batch before it is signed.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import trio

from p2p.errors import ConfigError, IntegrityError, ShardnetError, TransportError, short_id
from p2p.identity import Identity
from p2p.trust import TrustList
from rollout.batch import Forgery, SamplingConfig, build_group, pack_batch
from rollout.engine import Engine, Interruptible, TransformersEngine
from rollout.exchange import RolloutSender, SenderConfig, report_status
from rollout.model_dir import load_tokenizer
from rollout.pacing import Pace, PaceMeter, PacingConfig
from rollout.schema import Group, RolloutBatch
from rollout.task import (
    DEFAULT_REWARD_SPEC,
    DEFAULT_TASK_SPEC,
    Task,
    load_task,
    task_prompts,
    task_spec,
)
from shardcast.download import FollowConfig, Follower, VersionRecord
from shardcast.node import NodeConfig, ShardcastNode, iso, wall_of
from shardcast.wire import (
    DEFAULT_ENGINE,
    EngineSpec,
    Manifest,
    RunCard,
    SignedRunCard,
    UnsupportedEngine,
    architecture_digest,
)
from shardnet.engine_update import HeldVersion, swap_weights

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class PeerConfig:
    """Inference-peer settings.

    Attributes:
        node: shardcast node settings (role ``peer``).
        follow: upstream relays and download settings.
        sampling: None (the default): the run card's sampling rules, followed as the card
            changes. Given: they must equal the card's, else the peer stops with a
            ``ConfigError``.
        engine_spec: the engine family and dtype ``engine`` runs; it must be one the card
            accepts.
        card: a card fetched before the node opened (bootstrap), adopted at start.
        exchange: rollout exchange settings.
        max_versions: stop generating after this many versions (None: run forever).
        trainer_addrs: multiaddrs of the trainer, to say hello before any version exists
            (otherwise learnt from the first announcement).
        task, task_reward: the run's task spec and dataset reward (``rollout.task.load_task``).
        hello_interval_s: period of the hello to the trainer, seconds.
        exit_on_finish: return from :meth:`InferencePeer.run` once the run finished and its
            final version is committed here.
        pacing: when to cut a batch short (:mod:`rollout.pacing`).
    """

    node: NodeConfig
    follow: FollowConfig
    sampling: SamplingConfig | None = None
    engine_spec: EngineSpec = DEFAULT_ENGINE
    card: SignedRunCard | None = None
    exchange: SenderConfig = field(default_factory=SenderConfig)
    max_versions: int | None = None
    trainer_addrs: tuple[str, ...] = ()
    task: str = DEFAULT_TASK_SPEC
    task_reward: str = DEFAULT_REWARD_SPEC
    hello_interval_s: float = 10.0
    exit_on_finish: bool = False
    pacing: PacingConfig = field(default_factory=PacingConfig)


@dataclass
class PeerRecord:
    """What the peer did with one version."""

    step: int
    manifest_digest: str
    committed_at: float
    download_s: float
    bytes_by_source: dict[str, int]
    generated: bool = False
    batch_id: str = ""
    mean_reward: float | None = None
    groups: int = 0
    pace: str = ""


class InferencePeer:
    """Runs an inference peer (see module docstring).

    Args:
        identity: the peer's key.
        trust: trust list (pins the trainer).
        config: settings.
        engine: the inference engine (a fresh :class:`TransformersEngine` by default).
        forgery: adversarial hook (tests/benchmarks only).
    """

    def __init__(
        self,
        identity: Identity,
        trust: TrustList,
        config: PeerConfig,
        engine: Engine | None = None,
        forgery: Forgery | None = None,
        progress: Callable[[int, int, int], None] | None = None,
    ) -> None:
        self.identity = identity
        self.trust = trust
        self.config = config
        self.engine = engine or TransformersEngine()
        self.forgery = forgery
        self.progress = progress
        self.task = load_task(config.task, config.task_reward)
        self.on_weight_swap: Callable[[float], None] | None = None  # seconds (metrics)
        self.on_generation: Callable[[int, float], None] | None = None  # tokens, seconds
        self.records: list[PeerRecord] = []
        self.node: ShardcastNode | None = None
        self.sender: RolloutSender | None = None
        self._latest: tuple[Manifest, Path] | None = None
        self._held: HeldVersion | None = None  # what the engine holds (in-place updates)
        self._new_version = trio.Event()
        self._trainer_session: str | None = None
        self._restart_seen_at = -math.inf  # when a restarted trainer was last noticed
        self.done = trio.Event()
        self.fatal: ShardnetError | None = None
        """Why the peer stopped on its own (a run card it cannot follow), or None."""
        self.card_versions_used: list[int] = []
        self.pace = PaceMeter(config.pacing)
        self.batches_by_pace: Counter[str] = Counter()
        """Handed-over batches by how they ended (:class:`~rollout.pacing.Pace` value)."""
        self.swaps_by_path: Counter[str] = Counter()
        """Weight swaps by path (:class:`~shardnet.engine_update.SwapPath` value)."""

    async def run(
        self, *, task_status: TaskStatus[ShardcastNode] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Run until cancelled (or until ``max_versions`` batches were handed over)."""
        rng = random.Random(f"peer:{self.identity.peer_id}")
        async with (
            ShardcastNode.open(self.identity, self.trust, self.config.node) as node,
            trio.open_nursery() as nursery,
        ):
            self.node = node
            if self.config.card is not None:
                node.set_card(self.config.card)
            self.sender = RolloutSender(
                node.p2p,
                self.identity,
                self.config.node.run_id,
                self.trust.trainer,
                self.config.exchange,
                rng,
            )
            follower = Follower(
                node, self.config.follow, rng, on_commit=self._on_commit, progress=self.progress
            )
            await nursery.start(follower.run)
            self._resume_latest(node)
            nursery.start_soon(self._hello)
            if self.config.exit_on_finish:
                nursery.start_soon(self._exit_when_settled, follower, nursery.cancel_scope)
            task_status.started(node)
            try:
                await self._generate_loop(nursery)
            except trio.Cancelled:
                if isinstance(self.engine, Interruptible):  # its abandoned thread stops too
                    self.engine.interrupt()
                raise
            except ShardnetError as exc:  # a card this peer cannot follow: stop, say why
                if not isinstance(exc, ConfigError):
                    raise
                log.error("runcard_unfollowable error=%s", exc)
                self.fatal = exc
                self.done.set()
                nursery.cancel_scope.cancel()
                return
            self.done.set()
            await trio.sleep_forever()

    def _resume_latest(self, node: ShardcastNode) -> None:
        """Start from the newest version committed before a restart, if any."""
        step = node.store.latest()
        if step is None:
            return
        try:
            m = node.store.load_manifest(step, self.trust)
        except (OSError, ShardnetError) as exc:
            log.warning("resume_version_unreadable step=%d error=%s", step, exc)
            return
        self._latest = (m, node.store.version_dir(step))
        self.pace.version_seen(step, time.monotonic())
        log.info("peer_resumed step=%d digest=%s", step, m.digest[:16])

    async def _exit_when_settled(self, follower: Follower, scope: trio.CancelScope) -> None:
        await follower.wait_settled()
        log.info("peer_exiting reason=run_finished")
        scope.cancel()

    async def _hello(self) -> None:
        """Say hello (with the newest committed version) every ``hello_interval_s``."""
        assert self.node is not None
        node, interval = self.node, self.config.hello_interval_s
        delay = min(0.5, interval)
        while True:
            if node.finished is not None:
                await node.wait_change()
                if node.finished is None:  # the run goes on (continued, or a newer step)
                    self._trainer_resumed()
                continue
            await self._ensure_trainer()
            latest = self._latest
            session = await report_status(
                node.p2p,
                self.trust.trainer,
                latest[0].step if latest else None,
                latest[0].digest if latest else "",
                attempts=1,
            )
            if session is None:
                delay = min(2 * delay, interval)
            else:
                self._note_session(session)
                delay = interval
            await trio.sleep(delay)

    def _note_session(self, session: str) -> None:
        """Notice a restarted trainer (new session id): re-introduce, regenerate."""
        old, self._trainer_session = self._trainer_session, session
        if old is None:
            log.info("trainer_hello trainer=%s", short_id(self.trust.trainer))
        elif old != session:
            pending = self.sender.statistics().pending if self.sender else 0
            log.info(
                "trainer_restarted trainer=%s pending_batches=%d",
                short_id(self.trust.trainer),
                pending,
            )
            if not pending:  # what the old process accepted but never trained on is lost
                self._restart_seen_at = trio.current_time()
                self._trainer_resumed()

    def _trainer_resumed(self) -> None:
        """The trainer takes rollouts again after a pause (a restart, a continued run): the
        newest version's batch budget counts from now, not from its commit, and generation
        wakes up."""
        if self._latest is not None:
            self.pace.trainer_resumed(self._latest[0].step, time.monotonic())
        self._wake_generation()

    def _wake_generation(self) -> None:
        self._new_version.set()
        self._new_version = trio.Event()

    async def _ensure_trainer(self) -> None:
        """Connect to the trainer (configured addresses, then the newest announcement's)."""
        assert self.node is not None
        if self.trust.trainer in self.node.p2p.connected_peers():
            return
        ann = self.node.announcement
        for addr in dict.fromkeys(
            (*self.config.trainer_addrs, *(ann.trainer_addrs if ann else ()))
        ):
            try:
                await self.node.p2p.connect(addr)
                return
            except (TransportError, ShardnetError) as exc:
                log.info("trainer_unreachable addr=%s error=%s", addr, exc)

    async def _on_commit(self, m: Manifest, path: Path, rec: VersionRecord) -> None:
        assert self.node is not None
        stats = rec.stats
        self.records.append(
            PeerRecord(
                m.step,
                m.digest,
                rec.committed_at,
                stats.elapsed_s if stats else 0.0,
                dict(stats.bytes_by_source) if stats else {},
            )
        )
        self._latest = (m, path)
        self.pace.version_seen(m.step, time.monotonic())
        self._wake_generation()
        await self._ensure_trainer()
        session = await report_status(self.node.p2p, self.trust.trainer, m.step, m.digest)
        if session is not None:
            self._note_session(session)

    async def _generate_loop(self, nursery: trio.Nursery) -> None:
        assert self.node is not None
        assert self.sender is not None
        node = self.node
        done_step = -1
        done_at = -math.inf  # when the batch of done_step was handed over
        generated = 0
        while self.config.max_versions is None or generated < self.config.max_versions:
            while (
                self._latest is None
                or node.finished is not None  # the trainer takes no more rollouts
                # again for the same version only if it went to a trainer since restarted
                or (self._latest[0].step <= done_step and done_at >= self._restart_seen_at)
            ):
                await self._new_version.wait()
            signed, path = self._latest
            step = signed.step
            card = await self.node.wait_card()
            sampling = self._sampling(card)
            try:
                tokenizer = await self._swap_in(signed, path, card)
                if tokenizer is None:
                    continue  # pruned before we got to it; a newer one exists
                t0 = time.perf_counter()
                batch, pace = await self._generate(
                    step, signed.digest, tokenizer, sampling, card.card.async_level
                )
            except ShardnetError as exc:
                log.error("generation_failed step=%d error=%s", step, exc)
                done_step, done_at = step, trio.current_time()
                continue
            if batch is None:  # the run ended meanwhile; a continuation generates again
                continue
            if self.on_generation is not None:
                tokens = sum(len(x.completion_ids) for g in batch.groups for x in g.samples)
                self.on_generation(tokens, time.perf_counter() - t0)
            if self.forgery is not None:
                batch = self.forgery(batch)
            await self._submit(step, batch, pace, card.version, nursery)
            done_step = step
            done_at = trio.current_time()
            generated += 1

    async def _swap_in(
        self, signed: Manifest, path: Path, card: SignedRunCard
    ) -> PreTrainedTokenizerFast | None:
        """Swap the engine's weights to the held version ``signed`` (at ``path``) and load its
        tokenizer; None if the version was pruned meanwhile (a newer one exists).

        A version kept as a chain whose config or tokenizer files are chained is
        materialized first; its weights are too if the engine cannot update in place
        (:func:`swap_weights`).

        Raises:
            IntegrityError: its ``config.json`` is not the architecture of ``card``; or
                (``ChainBroken``) a chain version's shard did not verify: nothing is loaded.
            ShardnetError: the swap failed (see :func:`swap_weights`).
        """
        assert self.node is not None
        store = self.node.store
        step = signed.step
        with store.pinned(step):
            if not store.has(step):
                return None
            chained = await trio.to_thread.run_sync(store.chained_files, step)
            # threads abandoned on cancel (module docstring, "Stopping"): a stop leaves the
            # engine holding an unknown version, and the process is on its way out; an
            # abandoned materialize is crash-safe (store/chains.py)
            if any(not name.endswith(".safetensors") for name in chained):  # config, tokenizer
                await _abandoned_on_cancel(store.materialize, step)  # raises ChainBroken
            if not await _abandoned_on_cancel(_architecture_matches, card, path):
                raise IntegrityError(
                    f"config.json of version {step} is not the architecture of run "
                    f"card v{card.version}"
                )
            held = self._held
            if held is not None and held.manifest.digest == signed.digest:
                # the same version again (regenerating for a restarted or continued trainer)
                log.info("engine_weights_kept step=%d reason=already_loaded", step)
                return await _abandoned_on_cancel(load_tokenizer, path)
            self._held = None  # unknown until the swap returns
            swap = await _abandoned_on_cancel(
                swap_weights, self.engine, store, signed, path, held, self.node.metrics.stage_cpu
            )
            self._held = swap.held
            self.swaps_by_path[swap.path.value] += 1
            log.info(
                "engine_weights_swapped step=%d path=%s duration_s=%.3f fallback=%s "
                "changed_words=%d",
                step,
                swap.path.value,
                swap.duration_s,
                swap.fallback.value if swap.fallback else "none",
                swap.changed_words,
            )
            if self.on_weight_swap is not None:
                self.on_weight_swap(swap.duration_s)
            return await _abandoned_on_cancel(load_tokenizer, path)

    async def _submit(
        self, step: int, batch: RolloutBatch, pace: Pace, card_version: int, nursery: trio.Nursery
    ) -> None:
        """Send ``batch`` (the rollouts of ``step``, generated under run card ``card_version``)
        to the trainer and record it."""
        assert self.sender is not None
        await self._ensure_trainer()
        ann = await self.sender.submit(batch.encode(), batch.policy_step, nursery)
        rewards = [s.reward for g in batch.groups for s in g.samples]
        for r in self.records:
            if r.step == step:
                r.generated, r.batch_id = True, ann.batch_id
                r.mean_reward = sum(rewards) / len(rewards)
                r.groups, r.pace = len(batch.groups), pace.value
        self.batches_by_pace[pace.value] += 1
        self.card_versions_used.append(card_version)
        log.info(
            "rollouts_submitted step=%d batch=%s groups=%d pace=%s samples=%d "
            "mean_reward=%.4f trainer=%s card_version=%d",
            step,
            ann.batch_id[:8],
            len(batch.groups),
            pace.value,
            batch.n_samples,
            sum(rewards) / len(rewards),
            short_id(self.trust.trainer),
            card_version,
        )

    async def _generate(
        self,
        step: int,
        digest: str,
        tokenizer: Any,
        cfg: SamplingConfig,
        async_level: int,
    ) -> tuple[RolloutBatch | None, Pace]:
        """Generate the batch of ``step`` group by group, in worker threads, until the pace
        meter cuts it or it is complete (:mod:`rollout.pacing`). Cancelled, it returns at once
        and abandons the thread of the group under way.

        Returns:
            the batch (the first ``k >= 1`` prompts' groups) and why it ended; None for the
            batch if the run's end arrived before it was done (``Pace.RUN_FINISHED``: the
            trainer trains on no more rollouts, so nothing is sent; logged here).

        Raises:
            LocalProtocolError: the engine has nothing loaded, or the task's prompts are bad.
        """
        peer_id, run_id = self.identity.peer_id, self.config.node.run_id
        prompts = await _abandoned_on_cancel(task_prompts, self.task, peer_id, step, cfg.n_prompts)
        groups: list[Group] = []
        while True:
            newest = self._latest[0].step if self._latest is not None else step
            pace = self.pace.decide(
                len(groups),
                cfg.n_prompts,
                step=step,
                newest=newest,
                now_s=time.monotonic(),
                async_level=async_level,
                run_finished=self.node is not None and self.node.finished is not None,
            )
            if pace is not Pace.GENERATE:
                break
            i = len(groups)
            t0 = time.monotonic()
            groups.append(
                await _abandoned_on_cancel(
                    functools.partial(
                        build_group,
                        self.engine,
                        tokenizer,
                        self.task,
                        prompts[i],
                        i,
                        peer_id=peer_id,
                        run_id=run_id,
                        step=step,
                        cfg=cfg,
                    )
                )
            )
            self.pace.group_done(time.monotonic() - t0)
        self._log_batch_end(step, len(groups), cfg.n_prompts, pace, newest)
        if pace is Pace.RUN_FINISHED:
            self.batches_by_pace[pace.value] += 1
            return None, pace
        batch = pack_batch(
            groups,
            self.task,
            peer_id=peer_id,
            run_id=run_id,
            step=step,
            manifest_digest=digest,
            cfg=cfg,
            engine_id=self.config.engine_spec.id,
        )
        return batch, pace

    def _log_batch_end(self, step: int, groups: int, of: int, pace: Pace, newest: int) -> None:
        """Say why a batch of ``step`` ended short of ``of`` groups (nothing if complete)."""
        if pace is Pace.RUN_FINISHED:
            log.info("batch_dropped step=%d groups=%d of=%d reason=run_finished", step, groups, of)
        elif pace is not Pace.COMPLETE:
            log.info(
                "batch_cut step=%d groups=%d of=%d pace=%s newest=%d group_s=%.2f",
                step,
                groups,
                of,
                pace.value,
                newest,
                self.pace.group_estimate_s or 0.0,
            )

    def _sampling(self, card: SignedRunCard) -> SamplingConfig:
        """The sampling rules of ``card``, after checking this peer can follow it.

        Raises:
            ConfigError: the card's task or engines are not this peer's, or configured
                sampling rules differ from the card's.
        """
        check_followable(card.card, self.task, self.config.engine_spec)
        r = card.card.sampling
        rules = SamplingConfig(r.prompts_per_step, r.group_size, r.max_new_tokens, r.temperature)
        mine = self.config.sampling
        if mine is not None and mine != dataclasses.replace(rules, toploc=mine.toploc):
            raise ConfigError(
                "sampling", f"configured {mine} differs from run card v{card.version}'s {r}"
            )
        return rules if mine is None else mine

    def report(self) -> dict[str, Any]:
        """JSON-ready summary of this peer (times as wall-clock ISO 8601; call in trio)."""
        sender = self.sender.statistics() if self.sender else None
        card = self.node.card if self.node is not None else None
        return {
            "peer_id": self.identity.peer_id,
            "run_card": {"version": card.version, "digest": card.digest} if card else None,
            "versions": [
                vars(r) | {"committed_at": _wall_iso(r.committed_at)} for r in self.records
            ],
            "exchange": vars(sender) if sender else None,
            "batches_by_pace": dict(self.batches_by_pace),
            "weight_swaps": dict(self.swaps_by_path),
        }


async def _abandoned_on_cancel(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in a worker thread that a cancellation abandons (module docstring,
    "Stopping"): cancelled, this returns at once and the thread runs on, its result dropped."""
    # trio-stubs (trio-typing 0.10) predate the keyword that trio 0.35 has
    return await trio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)  # type: ignore[call-arg]


def _wall_iso(clock_s: float) -> str:
    """A ``trio.current_time()`` reading as wall-clock ISO 8601 (in a trio run)."""
    return iso(wall_of(clock_s, trio.current_time(), time.time()))


def check_followable(card: RunCard, task: Task, engine: EngineSpec) -> None:
    """Raise unless a peer with ``task`` and ``engine`` can follow ``card``.

    Raises:
        ConfigError: the card's task (name/version or data digest) is not ``task`` (field
            ``task``).
        UnsupportedEngine: ``engine`` is not among the card's engines (field ``engine``).
    """
    name, version, digest = task_spec(task)
    if (card.task.name, card.task.version, card.task.digest) != (name, version, digest):
        raise ConfigError(
            "task",
            f"run card v{card.card_version} asks for task {card.task.id} "
            f"(data {card.task.digest[:16]}); this peer has {name}/{version} "
            f"(data {digest[:16]}): give the run's task with --task (and --task-reward), "
            "or upgrade shardnet",
        )
    if engine not in card.engines:
        raise UnsupportedEngine(
            f"run card v{card.card_version} accepts {', '.join(e.id for e in card.engines)}; "
            f"this peer runs {engine.id}: restart it to pick another engine"
        )


def _architecture_matches(card: SignedRunCard, path: Path) -> bool:
    """Whether the version at ``path`` has the card's model architecture (its config.json)."""
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and (
        architecture_digest(config) == card.card.architecture_digest
    )
