"""Rollout exchange, trainer side: ingest each announced batch exactly once, verified.

Theory of operation
-------------------
Announcements reach the trainer by two routes: gossip (the run's rollouts topic, relayed by
the swarm) and the peer's direct announce stream, which waits for an :class:`Ack`. Both go
through :meth:`RolloutInbox.ingest`:

1. cheap refusals first, without fetching anything: bad signature or wrong run (dropped),
   submitter refused by reputation (``ignored``), announcement rate limit or a full buffer
   (``retry``: the peer backs off and re-announces), a policy step ahead of the trainer's
   (``retry``), or older than the async window plus its grace (``rejected``, counted, and no
   fault of the submitter's: see :mod:`rollout.intake`);
2. exactly-once *per submitter*: decisions are keyed by ``(submitter, payload digest)``
   (:data:`rollout.intake.BatchKey`); a batch already decided returns the stored ack; a batch
   being fetched is awaited, not fetched again (two routes or a repeated announcement collapse
   into one). Another submitter announcing the same bytes names another batch. Such a
   repeat is counted as ``redelivered`` when it comes by a route that had not yet carried
   this batch (an honest peer's gossip copy after its direct announce, or the reverse), and as
   a ``duplicate`` when the same route brings it again (a replay or a lost ack's retry);
3. the payload is fetched once from the submitter, checked against the announced size and
   digest, decoded with bounds, and run through the :class:`~rollout.verify.Validator` in a
   worker thread (model forward passes), one batch at a time;
4. the verdict updates the submitter's reputation; an accepted batch enters the bounded
   training buffer, and the ack is remembered (bounded table of recent ids).

:meth:`RolloutInbox.take` hands the trainer the accepted batches it may train on at a step;
:meth:`RolloutInbox.usable` says how many there are and from whom, without taking them.

Peers say hello (and report each committed version) on the status protocol; the inbox keeps
when each was first and last heard from (``joined``, ``last_seen``). Its answer carries the
trainer's ``session`` (random per trainer process), so a peer notices a restarted trainer and
re-introduces itself.
"""

from __future__ import annotations

import enum
import logging
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import trio

from p2p import wire
from p2p.errors import (
    IntegrityError,
    RemoteProtocolError,
    ShardnetError,
    TransportError,
    short_id,
)
from p2p.lanes import Host
from rollout.exchange import ANNOUNCE_PROTOCOL, FETCH_PROTOCOL, MAX_ACK_BYTES, STATUS_PROTOCOL, Ack
from rollout.intake import (
    UNFETCHED,
    Acceptance,
    BatchKey,
    IntakeLedger,
    Staleness,
    judge_staleness,
    length_bucket,
    oldest_trainable_step,
)
from rollout.reasons import AckReason, AckStatus, RejectReason
from rollout.reputation import Reputation
from rollout.schema import (
    MAX_ANNOUNCEMENT_BYTES,
    MAX_BATCH_BYTES,
    RolloutAnnouncement,
    RolloutBatch,
    rollouts_topic,
)
from rollout.verify import Validator

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

MAX_REJECTED_SUBMITTERS = 4096
"""Submitters remembered as having a rejected batch (readiness), oldest forgotten first."""


class AnnounceRoute(enum.StrEnum):
    """How an announcement reached the trainer (the value keys ``InboxStats.by_route``)."""

    DIRECT = "direct"  # the announce stream from the submitter (answered with its Ack)
    GOSSIP = "gossip"  # the run's rollouts gossipsub topic (no answer on that route)


@dataclass(frozen=True)
class InboxConfig:
    """Trainer-side exchange settings.

    Attributes:
        max_buffer_batches: accepted batches waiting for training (memory bound).
        max_concurrent_fetches: payload fetches at once.
        fetch_timeout_s: bound on one payload fetch, seconds.
        remember_batches: decided batch ids remembered for exactly-once.
        handler_timeout_s: bound on answering one direct announcement, seconds.
        late_grace_steps: steps of policy lag beyond the validator's ``async_level`` still
            admitted (and trained on) for rollouts already under way when the window moved.
    """

    max_buffer_batches: int = 64
    max_concurrent_fetches: int = 4
    fetch_timeout_s: float = 60.0
    remember_batches: int = 100_000
    handler_timeout_s: float = 170.0
    late_grace_steps: int = 1


@dataclass(frozen=True)
class AcceptedBatch:
    """A verified batch waiting for the optimizer."""

    batch: RolloutBatch
    announcement: RolloutAnnouncement
    received_at: float

    @property
    def length_bucket(self) -> str:
        """The batch's length bucket (mean completion tokens per sample)."""
        return _bucket(self.batch)


def _bucket(batch: RolloutBatch) -> str:
    n = batch.n_samples
    tokens = sum(len(s.completion_ids) for g in batch.groups for s in g.samples)
    return length_bucket(tokens / n if n else 0.0)


def _key(ann: RolloutAnnouncement) -> BatchKey:
    return (ann.submitter, ann.digest)


@dataclass(frozen=True)
class InboxStats:
    """Counters of the inbox."""

    announcements: int
    by_route: dict[str, int]
    duplicates: int
    fetched_bytes: int
    buffered: int
    expired_samples: int
    acks: dict[str, int]
    answers: dict[str, int]
    by_submitter: dict[str, Acceptance]
    by_length: dict[str, Acceptance]
    fetched_batches: int = 0
    redelivered: int = 0  #: repeats of a batch by a route that had not carried it before


class RolloutInbox:
    """The trainer side of the exchange (see module docstring).

    Args:
        node: the trainer's libp2p node.
        run_id: the run.
        validator: the validation pipeline.
        reputation: submitter scores and rate limits.
        current_step: returns the trainer's current policy step.
        config: settings.
        session: this trainer process's session id, sent in status answers.
    """

    def __init__(
        self,
        node: Host,
        run_id: str,
        validator: Validator,
        reputation: Reputation,
        current_step: Callable[[], int],
        config: InboxConfig | None = None,
        session: str = "",
    ) -> None:
        self.node = node
        self.session = session
        self.run_id = run_id
        self.validator = validator
        self.reputation = reputation
        self.current_step = current_step
        self.config = config or InboxConfig()
        self._buffer: deque[AcceptedBatch] = deque()
        # submitter -> newest policy step of a batch the validator rejected (readiness: that
        # peer has answered for the step and will not send another batch for it); bounded
        self._rejected: OrderedDict[str, int] = OrderedDict()
        self._buffer_changed = trio.Event()
        self.ledger = IntakeLedger(remember=self.config.remember_batches)
        self._inflight: dict[BatchKey, trio.Event] = {}
        self._fetch_slots = trio.Semaphore(self.config.max_concurrent_fetches)
        self._verify_lock = trio.Lock()
        self._announcements = self._duplicates = self._fetched = self._expired = 0
        self._fetched_batches = 0
        self._redelivered = 0
        # batch -> the routes that brought it; bounded like the ledger (remember_batches)
        self._routes: OrderedDict[BatchKey, frozenset[AnnounceRoute]] = OrderedDict()
        self._by_route: dict[str, int] = {}
        self._acks: dict[str, int] = {}
        self._answers: dict[str, int] = {}
        self._answered = trio.Event()
        self.statuses: dict[str, dict[int, tuple[str, float]]] = {}
        self.joined: dict[str, float] = {}
        self.last_seen: dict[str, float] = {}
        self._status_changed = trio.Event()
        self._changed = trio.Event()

    async def run(self, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the announce/status protocols and listen to gossip until cancelled."""
        self.node.serve(
            ANNOUNCE_PROTOCOL,
            self._on_direct,
            max_request_bytes=MAX_ANNOUNCEMENT_BYTES,
            max_response_bytes=MAX_ACK_BYTES,
            timeout_s=self.config.handler_timeout_s,
        )
        self.node.serve(
            STATUS_PROTOCOL,
            self._on_status,
            max_request_bytes=512,
            max_response_bytes=256,
            timeout_s=10.0,
        )
        sub = await self.node.subscribe(rollouts_topic(self.run_id), self._check_gossip)
        async with trio.open_nursery() as nursery:
            task_status.started()
            async for msg in sub:
                if self._fetch_slots.value == 0:
                    continue  # busy: the submitter's direct route will deliver it
                nursery.start_soon(self._on_gossip, msg.data, msg.origin)

    def _check_gossip(self, origin: str, data: bytes) -> None:
        """Runs before a rollout announcement is delivered or forwarded: well-formed, this
        run, signed by its submitter, and a submitter that reputation does not refuse."""
        ann = RolloutAnnouncement.decode(data, sender=origin)
        if ann.run_id != self.run_id:
            raise RemoteProtocolError(origin, f"rollout announcement of run {ann.run_id!r}")
        if self.reputation.refused(ann.submitter, trio.current_time()):
            raise RemoteProtocolError(origin, f"submitter {short_id(ann.submitter)} is refused")

    async def _on_direct(self, sender: str, request: bytes) -> bytes:
        ack = await self.ingest(request, sender, route=AnnounceRoute.DIRECT)
        if ack is None:
            raise RemoteProtocolError(sender, "invalid rollout announcement")
        return ack.encode()

    async def _on_gossip(self, data: bytes, origin: str) -> None:
        await self.ingest(data, origin, route=AnnounceRoute.GOSSIP)

    async def _on_status(self, sender: str, request: bytes) -> bytes:
        msg = wire.decode(request, max_bytes=512, sender=sender)
        wire.need_version(msg, 1, "status", sender)
        now = trio.current_time()
        if sender not in self.joined:
            log.info("peer_joined peer=%s", short_id(sender))
        self.joined.setdefault(sender, now)
        self.last_seen[sender] = now
        if "step" in msg:
            step = wire.need_int(msg, "step", 0, 1 << 62, sender)
            digest = wire.need_str(msg, "manifest_digest", 64, sender)
            known = self.statuses.setdefault(sender, {}).get(step)
            if known is None or known[0] != digest:  # the first report times the commit
                self.statuses[sender][step] = (digest, now)
        self._status_changed.set()
        self._status_changed = trio.Event()
        self._notify()
        return wire.encode({"v": 1, "session": self.session})

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def wait_change(self) -> None:
        """Wait until a batch is buffered or a peer says hello or reports a version."""
        await self._changed.wait()

    def usable(self, step: int) -> tuple[int, frozenset[str]]:
        """Buffered batches usable at ``step`` (count, submitters); takes nothing."""
        lo = step - self.validator.config.async_level
        ok = [b for b in self._buffer if lo <= b.batch.policy_step]
        return len(ok), frozenset(b.announcement.submitter for b in ok)

    def rejected_within(self, step: int) -> frozenset[str]:
        """Submitters whose batch of a policy step usable at ``step`` (inside the async
        window) was verified and rejected: they answered for this step and, being told
        ``rejected``, send no other batch for it (:mod:`trainer.readiness`)."""
        lo = step - self.validator.config.async_level
        return frozenset(p for p, st in self._rejected.items() if st >= lo)

    def _note_rejected(self, submitter: str, policy_step: int) -> None:
        self._rejected[submitter] = max(policy_step, self._rejected.get(submitter, policy_step))
        self._rejected.move_to_end(submitter)
        while len(self._rejected) > MAX_REJECTED_SUBMITTERS:
            self._rejected.popitem(last=False)

    async def wait_status_change(self) -> None:
        """Wait until some peer says hello or reports a newly committed version."""
        await self._status_changed.wait()

    def _remember(
        self,
        ann: RolloutAnnouncement,
        ack: Ack,
        bucket: str = UNFETCHED,
        *,
        late: bool = False,
    ) -> Ack:
        self.ledger.remember(_key(ann), ack)
        self.ledger.count(
            ann.submitter, bucket, accepted=ack.status is AckStatus.ACCEPTED, late=late
        )
        self._acks[ack.status] = self._acks.get(ack.status, 0) + 1
        return ack

    async def ingest(self, data: bytes, sender: str, *, route: AnnounceRoute) -> Ack | None:
        """Handle one announcement (see module docstring); returns the ack, or None if invalid.

        Every answer is counted by ``status:reason`` in ``statistics().answers``.
        """
        ack = await self._ingest(data, sender, route=route)
        if ack is not None:
            key = f"{ack.status}:{ack.reason}"
            self._answers[key] = self._answers.get(key, 0) + 1
            self._answered.set()
            self._answered = trio.Event()
        return ack

    async def wait_answers(self, key: str, count: int) -> None:
        """Wait until at least ``count`` answers ``status:reason`` (``retry:busy``) went out."""
        while self._answers.get(key, 0) < count:
            await self._answered.wait()

    async def _ingest(self, data: bytes, sender: str, *, route: AnnounceRoute) -> Ack | None:
        self._announcements += 1
        self._by_route[route] = self._by_route.get(route, 0) + 1
        try:
            ann = RolloutAnnouncement.decode(data, sender=sender)
        except ShardnetError as exc:
            log.warning(
                "rollout_announcement_invalid sender=%s route=%s error=%s",
                short_id(sender),
                route,
                exc,
            )
            return None
        if ann.run_id != self.run_id:
            return Ack(ann.batch_id, AckStatus.REJECTED, RejectReason.WRONG_RUN)
        if ann.submitter in self.joined:
            self.last_seen[ann.submitter] = trio.current_time()
        key = _key(ann)
        new_route = self._note_route(key, route)
        done = self.ledger.decision(key)
        if isinstance(done, Ack):
            self._count_repeat(new_route)
            return done
        event = self._inflight.get(key)
        if event is not None:
            self._count_repeat(new_route)
            await event.wait()
            done = self.ledger.decision(key)
            return (
                done
                if isinstance(done, Ack)
                else Ack(ann.batch_id, AckStatus.RETRY, AckReason.FETCH_FAILED)
            )
        if self.reputation.refused(ann.submitter, trio.current_time()):
            return Ack(ann.batch_id, AckStatus.IGNORED, AckReason.REFUSED)
        if not self.reputation.allow_announcement(ann.submitter, trio.current_time()):
            return Ack(ann.batch_id, AckStatus.RETRY, AckReason.RATE_LIMITED)
        staleness = self._staleness(ann.step)
        if staleness is Staleness.AHEAD:  # the trainer's clock has not caught up: not final
            return Ack(ann.batch_id, AckStatus.RETRY, AckReason.AHEAD)
        if staleness is Staleness.TOO_OLD:  # no fault: costs the submitter no reputation
            self.validator.reject_unchecked(RejectReason.STALE_STEP, 0)
            return self._remember(
                ann, Ack(ann.batch_id, AckStatus.REJECTED, RejectReason.STALE_STEP)
            )
        if len(self._buffer) >= self.config.max_buffer_batches:
            return Ack(ann.batch_id, AckStatus.RETRY, AckReason.BUSY)
        self._inflight[key] = trio.Event()
        try:
            return await self._fetch_and_check(ann)
        finally:
            self._inflight.pop(key).set()

    def _note_route(self, key: BatchKey, route: AnnounceRoute) -> bool:
        """Remember that ``route`` brought ``key``; True if it had not brought it before."""
        seen = self._routes.pop(key, frozenset())
        self._routes[key] = seen | {route}
        while len(self._routes) > self.config.remember_batches:
            self._routes.popitem(last=False)
        return route not in seen

    def _count_repeat(self, new_route: bool) -> None:
        if new_route:
            self._redelivered += 1
        else:
            self._duplicates += 1

    def _staleness(self, step: int) -> Staleness:
        return judge_staleness(
            step,
            self.current_step(),
            self.validator.config.async_level,
            self.config.late_grace_steps,
        )

    async def _fetch_and_check(self, ann: RolloutAnnouncement) -> Ack:
        try:
            async with self._fetch_slots:
                payload = await self.node.request(
                    ann.submitter,
                    FETCH_PROTOCOL,
                    wire.encode({"v": 1, "batch_id": ann.batch_id}),
                    max_response_bytes=min(ann.size, MAX_BATCH_BYTES),
                    timeout_s=self.config.fetch_timeout_s,
                )
        except TransportError as exc:
            log.info(
                "rollout_fetch_failed batch=%s submitter=%s error=%s",
                ann.batch_id[:8],
                short_id(ann.submitter),
                exc,
            )
            return Ack(ann.batch_id, AckStatus.RETRY, AckReason.FETCH_FAILED)
        except RemoteProtocolError as exc:
            return self._refuse(ann, RejectReason.INTEGRITY, f"fetch: {exc}")
        self._fetched += len(payload)
        self._fetched_batches += 1
        try:
            ann.check_payload(payload, ann.submitter)
            batch = RolloutBatch.decode(
                payload, vocab_size=self.validator.oracle.vocab_size, sender=ann.submitter
            )
        except IntegrityError as exc:
            return self._refuse(ann, RejectReason.INTEGRITY, str(exc))
        except RemoteProtocolError as exc:
            return self._refuse(ann, RejectReason.SCHEMA, str(exc))
        if batch.policy_step != ann.step:
            return self._refuse(
                ann, RejectReason.SCHEMA, "payload step differs from the announcement"
            )
        bucket = _bucket(batch)
        async with self._verify_lock:
            # The validator judges the step against the window it knows; a batch in the grace
            # window is presented as of the oldest step the window admits.
            late = self._staleness(batch.policy_step) is Staleness.LATE
            as_of = batch.policy_step + self.validator.config.async_level
            current = as_of if late else self.current_step()
            verdict = await trio.to_thread.run_sync(
                lambda: self.validator.check(batch, sender=ann.submitter, current_step=current)
            )
        self.reputation.record(ann.submitter, verdict.accepted, verdict.reason, trio.current_time())
        if verdict.accepted:
            self._buffer.append(AcceptedBatch(batch, ann, trio.current_time()))
            self._buffer_changed.set()
            self._buffer_changed = trio.Event()
            self._notify()
            return self._remember(
                ann,
                Ack(ann.batch_id, AckStatus.ACCEPTED, AckReason.OK, accepted=verdict.samples),
                bucket,
                late=late,
            )
        self._note_rejected(ann.submitter, batch.policy_step)
        self._notify()  # readiness: this submitter has answered for the step
        return self._remember(
            ann,
            Ack(ann.batch_id, AckStatus.REJECTED, verdict.reason, rejected=verdict.samples),
            bucket,
        )

    def _refuse(self, ann: RolloutAnnouncement, reason: RejectReason, detail: str) -> Ack:
        log.warning(
            "rollout_refused batch=%s submitter=%s reason=%s detail=%s",
            ann.batch_id[:8],
            short_id(ann.submitter),
            reason,
            detail,
        )
        self.validator.reject_unchecked(reason, 0)
        self.reputation.record(ann.submitter, False, reason, trio.current_time())
        return self._remember(ann, Ack(ann.batch_id, AckStatus.REJECTED, reason))

    async def take(self, *, min_batches: int, step: int, timeout_s: float) -> list[AcceptedBatch]:
        """Remove and return the buffered batches usable at ``step``.

        Waits until at least ``min_batches`` usable batches are buffered or ``timeout_s``
        passes (then returns what there is, possibly nothing). Batches that fell out of the
        async window meanwhile are dropped and counted (``expired_samples``): they were
        verified, but are too old to train on. The bound is the admission bound (async window
        plus ``late_grace_steps``), so a batch admitted late is not then dropped here.
        """
        lo = oldest_trainable_step(
            step, self.validator.config.async_level, self.config.late_grace_steps
        )
        with trio.move_on_after(timeout_s):
            while True:
                self._drop_stale(lo)
                if len(self._buffer) >= min_batches:
                    break
                await self._buffer_changed.wait()
        self._drop_stale(lo)
        out = list(self._buffer)
        self._buffer.clear()
        for b in out:
            self.ledger.count_trained(b.announcement.submitter, b.length_bucket)
        return out

    def _drop_stale(self, lo: int) -> None:
        keep = deque(b for b in self._buffer if b.batch.policy_step >= lo)
        self._expired += sum(b.batch.n_samples for b in self._buffer if b.batch.policy_step < lo)
        self._buffer = keep

    def statistics(self) -> InboxStats:
        """Current counters."""
        return InboxStats(
            self._announcements,
            dict(self._by_route),
            self._duplicates,
            self._fetched,
            len(self._buffer),
            self._expired,
            dict(self._acks),
            dict(self._answers),
            self.ledger.by_submitter(),
            self.ledger.by_length(),
            self._fetched_batches,
            self._redelivered,
        )
