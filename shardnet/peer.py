"""The inference peer: follow versions, load each into the engine, generate, submit rollouts.

Theory of operation
-------------------
A peer runs a shardcast node and a :class:`~shardcast.follower.Follower` on its relays. Each
committed version is reported to the trainer (``/shardnet/status/1.0.0``) and wakes the
generation loop, which always works on the newest committed version: load it into the engine
(the version directory is pinned against retention meanwhile), build one batch with
:func:`rollout.batch.build_batch` in a worker thread, and hand it to the
:class:`~rollout.exchange.RolloutSender`, which announces it and retries until the trainer
acknowledges. The network keeps running while the CPU generates.

Restarts: a peer started on a data directory keeps its committed versions and generates for
the newest at once. It says hello to the trainer every ``hello_interval_s`` (with its newest
committed version); the trainer's answer carries its session id, so when the trainer comes
back under a new session the peer re-introduces itself and, unless a batch is still on its
way, generates again for its newest version (the batches the old trainer process held were
lost with it). Once the trainer's signed run end is known the peer stops generating and
saying hello, keeps serving, and with ``exit_on_finish`` returns once it holds the final
version.

A forged peer for tests and benchmarks is this class with a ``forgery`` hook that tampers
with the batch before it is signed.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import ShardnetError, TransportError, short_id
from p2p.identity import Identity
from p2p.trust import TrustList
from rollout.batch import Forgery, SamplingConfig, build_batch
from rollout.engine import Engine, TransformersEngine
from rollout.exchange import RolloutSender, SenderConfig, report_status
from rollout.task import DEFAULT_TASK
from shardcast.follower import FollowConfig, Follower, VersionRecord
from shardcast.manifest import Manifest
from shardcast.node import NodeConfig, ShardcastNode

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PeerConfig:
    """Inference-peer settings.

    Attributes:
        node: shardcast node settings (role ``peer``).
        follow: upstream relays and download settings.
        sampling: the run's sampling rules.
        exchange: rollout exchange settings.
        max_versions: stop generating after this many versions (None: run forever).
        trainer_addrs: multiaddrs of the trainer, to say hello before any version exists
            (otherwise learnt from the first announcement).
        hello_interval_s: period of the hello to the trainer, seconds.
        exit_on_finish: return from :meth:`InferencePeer.run` once the run finished and its
            final version is committed here.
    """

    node: NodeConfig
    follow: FollowConfig
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    exchange: SenderConfig = field(default_factory=SenderConfig)
    max_versions: int | None = None
    trainer_addrs: tuple[str, ...] = ()
    hello_interval_s: float = 10.0
    exit_on_finish: bool = False


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
        self.task = DEFAULT_TASK
        self.records: list[PeerRecord] = []
        self.node: ShardcastNode | None = None
        self.sender: RolloutSender | None = None
        self._latest: tuple[Manifest, Path] | None = None
        self._new_version = trio.Event()
        self._trainer_session: str | None = None
        self._restart_seen_at = -math.inf  # when a restarted trainer was last noticed
        self.done = trio.Event()

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
            await self._generate_loop(nursery)
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
        self._wake_generation()
        await self._ensure_trainer()
        session = await report_status(self.node.p2p, self.trust.trainer, m.step, m.digest)
        if session is not None:
            self._note_session(session)

    async def _generate_loop(self, nursery: trio.Nursery) -> None:
        assert self.node is not None
        assert self.sender is not None
        from rollout.model import build_tokenizer

        tokenizer = build_tokenizer()
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
            store = self.node.store
            try:
                with store.pinned(step):
                    if not store.has(step):
                        continue  # pruned before we got to it; a newer one exists
                    await trio.to_thread.run_sync(self.engine.load, path)
                batch = await trio.to_thread.run_sync(
                    functools.partial(
                        build_batch,
                        self.engine,
                        tokenizer,
                        self.task,
                        peer_id=self.identity.peer_id,
                        run_id=self.config.node.run_id,
                        step=step,
                        manifest_digest=signed.digest,
                        cfg=self.config.sampling,
                    )
                )
            except ShardnetError as exc:
                log.error("generation_failed step=%d error=%s", step, exc)
                done_step, done_at = step, trio.current_time()
                continue
            if self.forgery is not None:
                batch = self.forgery(batch)
            await self._ensure_trainer()
            ann = await self.sender.submit(batch.encode(), batch.policy_step, nursery)
            rewards = [s.reward for g in batch.groups for s in g.samples]
            for r in self.records:
                if r.step == step:
                    r.generated, r.batch_id = True, ann.batch_id
                    r.mean_reward = sum(rewards) / len(rewards)
            log.info(
                "rollouts_submitted step=%d batch=%s samples=%d mean_reward=%.4f trainer=%s",
                step,
                ann.batch_id[:8],
                batch.n_samples,
                sum(rewards) / len(rewards),
                short_id(self.trust.trainer),
            )
            done_step = step
            done_at = trio.current_time()
            generated += 1

    def report(self) -> dict[str, Any]:
        """JSON-ready summary of this peer."""
        sender = self.sender.statistics() if self.sender else None
        return {
            "peer_id": self.identity.peer_id,
            "versions": [vars(r) for r in self.records],
            "exchange": vars(sender) if sender else None,
        }
