"""Rollout exchange, peer side: announce, serve the payload once, retry until acknowledged.

Protocols (libp2p, length-prefixed request/response, bounded and timed):

=================================  ===================================================
``/shardnet/rollout/announce/1.0.0``  peer -> trainer: a signed RolloutAnnouncement; the
                                      response is an :class:`Ack` sent after the trainer
                                      fetched, checked and ingested (or refused) the batch
``/shardnet/rollout/fetch/1.0.0``     trainer -> peer: ``{"batch_id"}``; the response is the
                                      payload bytes (served to the pinned trainer only)
``/shardnet/status/1.0.0``            peer -> trainer: "I committed version N (digest D)"
=================================  ===================================================

Theory of operation
-------------------
:meth:`RolloutSender.submit` keeps the encoded batch in a bounded table, publishes the
announcement on the run's rollouts gossip topic (best effort) and sends it on the announce
stream to the trainer. The batch is dropped from the table only when an :class:`Ack` says
the trainer decided (accepted, rejected or ignored); an ``Ack`` with ``retry`` (busy, rate
limited, fetch failed) or a transport failure re-sends the announcement after an exponential
backoff with jitter, until ``give_up_s`` (then it is dropped and counted). A batch that became
too stale is answered by the trainer with a final ``rejected``/``stale_step`` ack. So a batch
is never silently lost: it ends acknowledged, or counted as given up, and the table
(at most ``max_pending`` batches) bounds the memory it can hold. ``submit`` waits for room
when the table is full, which slows generation down instead of dropping work.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import trio

from p2p import wire
from p2p.errors import (
    ConfigError,
    NotHeld,
    RemoteProtocolError,
    ShardnetError,
    TransportError,
    short_id,
)
from p2p.identity import Identity
from p2p.lanes import Host
from rollout.reasons import AckStatus
from rollout.schema import MAX_BATCH_BYTES, RolloutAnnouncement, rollouts_topic

log = logging.getLogger(__name__)

ANNOUNCE_PROTOCOL = "/shardnet/rollout/announce/1.0.0"
FETCH_PROTOCOL = "/shardnet/rollout/fetch/1.0.0"
STATUS_PROTOCOL = "/shardnet/status/1.0.0"
MAX_ACK_BYTES = 4096
DROPPED_KEPT = 1024
"""Ids of delivered batches a sender remembers (32 bytes each), so that a fetch of one of them
by a restarted trainer is answered "no longer held" rather than charged as a bad request."""


@dataclass(frozen=True)
class Ack:
    """The trainer's answer to an announcement.

    Attributes:
        batch_id: the batch.
        status: ``ACCEPTED``, ``REJECTED``, ``IGNORED`` (final) or ``RETRY``.
        reason: why: a :class:`~rollout.reasons.RejectReason` for ``REJECTED``, an
            :class:`~rollout.reasons.AckReason` otherwise (from the wire: any string of at
            most 64 characters, so that an ack from a newer trainer still decodes).
        accepted, rejected: samples accepted / rejected.
    """

    batch_id: str
    status: AckStatus
    reason: str
    accepted: int = 0
    rejected: int = 0

    @property
    def final(self) -> bool:
        """True unless the peer should retry."""
        return self.status != AckStatus.RETRY  # a plain "retry" too (StrEnum)

    def encode(self) -> bytes:
        """Canonical CBOR bytes."""
        return wire.encode(
            {
                "v": 1,
                "batch_id": self.batch_id,
                "status": self.status,
                "reason": self.reason,
                "accepted": self.accepted,
                "rejected": self.rejected,
            }
        )

    @classmethod
    def decode(cls, data: bytes, sender: str = "") -> Ack:
        """Parse an ack. Raises RemoteProtocolError if malformed."""
        obj = wire.decode(data, max_bytes=MAX_ACK_BYTES, sender=sender)
        wire.need_version(obj, 1, "ack", sender)
        raw = wire.need_str(obj, "status", 16, sender)
        try:
            status = AckStatus(raw)
        except ValueError:
            raise RemoteProtocolError(sender, f"ack status {raw!r}") from None
        return cls(
            wire.need_str(obj, "batch_id", 32, sender),
            status,
            wire.need_str(obj, "reason", 64, sender),
            wire.need_int(obj, "accepted", 0, 1 << 30, sender),
            wire.need_int(obj, "rejected", 0, 1 << 30, sender),
        )


@dataclass(frozen=True)
class SenderConfig:
    """Peer-side exchange settings.

    Attributes:
        max_pending: batches held until acknowledged (memory bound).
        ack_timeout_s: wait for an ack on one announce stream, seconds.
        backoff_initial_s, backoff_max_s: retry backoff bounds, seconds.
        give_up_s: drop a batch not acknowledged after this long, seconds.
    """

    max_pending: int = 8
    ack_timeout_s: float = 180.0
    backoff_initial_s: float = 0.5
    backoff_max_s: float = 15.0
    give_up_s: float = 900.0

    def __post_init__(self) -> None:
        if self.max_pending < 1:
            raise ConfigError("exchange.max_pending", "must be >= 1")


@dataclass(frozen=True)
class SenderStats:
    """Counters of a sender."""

    submitted: int
    acked: dict[str, int]
    retries: int
    given_up: int
    pending: int
    fetches_served: int


class RolloutSender:
    """The peer side of the exchange (see module docstring).

    Args:
        node: the peer's libp2p node.
        identity: the peer's key (signs announcements).
        run_id: the run.
        trainer: the pinned trainer PeerID (the only one allowed to fetch payloads).
        config: settings.
        rng: seeded randomness for backoff jitter.
    """

    def __init__(
        self,
        node: Host,
        identity: Identity,
        run_id: str,
        trainer: str,
        config: SenderConfig,
        rng: random.Random,
    ) -> None:
        self.node = node
        self.identity = identity
        self.run_id = run_id
        self.trainer = trainer
        self.config = config
        self.rng = rng
        self._pending: dict[str, bytes] = {}
        self._room = trio.Semaphore(config.max_pending)
        self._idle = trio.Event()
        self._idle.set()
        self._submitted = self._retries = self._given_up = self._served = 0
        self._acked: dict[str, int] = {}
        # ids of batches handed over and dropped, newest last (bounded): a restarted trainer
        # that heard an old announcement again asks for them; that is no offence
        self._dropped: dict[str, None] = {}
        self.acks: list[Ack] = []
        node.serve(
            FETCH_PROTOCOL,
            self._on_fetch,
            max_request_bytes=256,
            max_response_bytes=MAX_BATCH_BYTES,
            timeout_s=120.0,
        )

    async def _on_fetch(self, sender: str, request: bytes) -> bytes:
        if sender != self.trainer:
            raise RemoteProtocolError(sender, "only the trainer may fetch rollout payloads")
        req = wire.decode(request, max_bytes=256, sender=sender)
        batch_id = wire.need_str(req, "batch_id", 32, sender)
        payload = self._pending.get(batch_id)
        if payload is None:
            if batch_id in self._dropped:
                raise NotHeld(f"batch {batch_id[:8]} was delivered and is no longer held")
            # the trainer may ask for a batch announced before this peer restarted (or by
            # another node with this peer's key): not held, and no offence
            raise NotHeld(f"batch {batch_id[:8]} is not held here")
        self._served += 1
        return payload

    async def submit(self, payload: bytes, step: int, nursery: trio.Nursery) -> RolloutAnnouncement:
        """Hand a batch over: returns once it is held for delivery (waits if the table is full).

        Delivery (announce, retries, ack) continues in ``nursery``.

        Raises:
            MessageTooLarge-free: ConfigError if the payload exceeds the batch bound.
        """
        if len(payload) > MAX_BATCH_BYTES:
            raise ConfigError("rollout batch", f"{len(payload)} bytes over {MAX_BATCH_BYTES}")
        await self._room.acquire()
        if self._idle.is_set():
            self._idle = trio.Event()
        ann = RolloutAnnouncement.for_payload(self.identity, self.run_id, step, payload)
        self._pending[ann.batch_id] = payload
        self._submitted += 1
        nursery.start_soon(self._deliver, ann)
        return ann

    async def _deliver(self, ann: RolloutAnnouncement) -> None:
        data = ann.encode()
        try:
            try:
                await self.node.publish(rollouts_topic(self.run_id), data)
            except ShardnetError as exc:
                log.info("rollout_gossip_failed batch=%s error=%s", ann.batch_id[:8], exc)
            deadline = trio.current_time() + self.config.give_up_s
            backoff = self.config.backoff_initial_s
            while True:
                ack = await self._announce_once(ann, data)
                if ack is not None and ack.final:
                    self._acked[ack.status] = self._acked.get(ack.status, 0) + 1
                    self.acks.append(ack)
                    log.info(
                        "rollout_acked batch=%s status=%s reason=%s accepted=%d",
                        ann.batch_id[:8],
                        ack.status,
                        ack.reason,
                        ack.accepted,
                    )
                    return
                if trio.current_time() + backoff > deadline:
                    self._given_up += 1
                    log.warning("rollout_given_up batch=%s step=%d", ann.batch_id[:8], ann.step)
                    return
                self._retries += 1
                await trio.sleep(backoff * (0.5 + self.rng.random()))
                backoff = min(backoff * 2, self.config.backoff_max_s)
        finally:
            self._pending.pop(ann.batch_id, None)
            self._dropped[ann.batch_id] = None
            if len(self._dropped) > DROPPED_KEPT:
                del self._dropped[next(iter(self._dropped))]
            self._room.release()
            if not self._pending:
                self._idle.set()

    async def _announce_once(self, ann: RolloutAnnouncement, data: bytes) -> Ack | None:
        try:
            resp = await self.node.request(
                self.trainer,
                ANNOUNCE_PROTOCOL,
                data,
                max_response_bytes=MAX_ACK_BYTES,
                timeout_s=self.config.ack_timeout_s,
            )
            ack = Ack.decode(resp, sender=self.trainer)
        except (TransportError, RemoteProtocolError) as exc:
            log.info(
                "rollout_announce_failed batch=%s trainer=%s error=%s",
                ann.batch_id[:8],
                short_id(self.trainer),
                exc,
            )
            return None
        if ack.batch_id != ann.batch_id:
            log.warning("rollout_ack_mismatch batch=%s", ann.batch_id[:8])
            return None
        return ack

    async def wait_idle(self) -> None:
        """Wait until every submitted batch ended (acknowledged or given up)."""
        await self._idle.wait()

    def statistics(self) -> SenderStats:
        """Current counters."""
        return SenderStats(
            self._submitted,
            dict(self._acked),
            self._retries,
            self._given_up,
            len(self._pending),
            self._served,
        )


async def report_status(
    node: Host, trainer: str, step: int | None, manifest_digest: str = "", attempts: int = 5
) -> str | None:
    """Tell the trainer this node committed version ``step`` (best effort, bounded retries).

    With ``step=None`` it is a hello: "this peer has joined the run". Every status message
    counts as a hello.

    Returns:
        the trainer's session id (``""`` if it sent none) if it acknowledged, else None. A
        new session id means the trainer process was restarted.
    """
    msg = wire.encode(
        {"v": 1} if step is None else {"v": 1, "step": step, "manifest_digest": manifest_digest}
    )
    delay = 0.2
    for _ in range(attempts):
        try:
            resp = await node.request(
                trainer, STATUS_PROTOCOL, msg, max_response_bytes=256, timeout_s=10.0
            )
            reply = wire.decode(resp, max_bytes=256, sender=trainer)
            session = reply.get("session", "")
            return session if isinstance(session, str) else ""
        except (TransportError, RemoteProtocolError) as exc:
            log.info("status_report_failed step=%s error=%s", step, exc)
            await trio.sleep(delay)
            delay *= 2
    return None
