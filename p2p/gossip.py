"""GossipSub configured for small announcements, and a bounded, counted subscription.

Theory of operation
-------------------
py-libp2p 0.8.1's GossipSub defaults silently lose bursts: a 120 s heartbeat (meshes form
slowly), a 10 messages/s/topic/peer spam limit, 32-message per-peer outbound queues and a
32-message subscription channel, and ``publish()`` never raises. shardnet uses gossip only for
small announcements (a new checkpoint version, a rollout batch id), and every announcement is
backed by a reliable path (the version is also learnt by polling the upstream's info
protocol, a rollout batch is also announced over a direct stream that is acknowledged), so a
dropped gossip message costs latency, never data. Still, drops should be rare and visible:

- every connection is an explicit (direct) gossip peer (:class:`DirectPeering`), so a message
  reaches every connected subscriber even before the mesh has formed;
- heartbeat every ``heartbeat_interval_s`` (1 s) so meshes form within a second or two;
- the library's per-peer spam limiter is off: rate limiting is done per *submitter* by the
  application (the rollout inbox), which knows who the submitter is; the library only sees the
  forwarder, which for a relay aggregating many peers would throttle honest traffic;
- outbound queues and the subscription channel are raised to ``queue_size`` messages;
- the subscription is drained at once into our own bounded deque; when it is full the oldest
  message is dropped and counted (``statistics().dropped``) instead of a silent loss.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import libp2p.pubsub.pubsub as _pubsub_mod
import trio
from libp2p.abc import INetConn, INetStream, INetwork, INotifee
from libp2p.custom_types import TProtocol
from libp2p.peer.id import ID
from libp2p.peer.peerinfo import PeerInfo
from libp2p.pubsub.gossipsub import GossipSub
from libp2p.pubsub.pubsub import Pubsub
from multiaddr import Multiaddr

from p2p.errors import ConfigError

log = logging.getLogger(__name__)

GOSSIPSUB_PROTOCOLS = (TProtocol("/meshsub/1.1.0"), TProtocol("/meshsub/1.0.0"))


@dataclass(frozen=True)
class GossipConfig:
    """GossipSub settings.

    Attributes:
        heartbeat_interval_s: mesh maintenance period, seconds (library default 120).
        degree, degree_low, degree_high: mesh degree D, D_lo, D_hi.
        queue_size: messages buffered per outbound peer queue and per subscription.
        max_message_bytes: largest announcement we publish or accept, bytes.
    """

    heartbeat_interval_s: int = 1
    degree: int = 6
    degree_low: int = 4
    degree_high: int = 12
    queue_size: int = 1024
    max_message_bytes: int = 64 * 1024

    def __post_init__(self) -> None:
        if self.heartbeat_interval_s < 1:
            raise ConfigError("gossip.heartbeat_interval_s", "must be >= 1 (integer seconds)")
        if not 1 <= self.degree_low <= self.degree <= self.degree_high:
            raise ConfigError("gossip.degree", "need 1 <= degree_low <= degree <= degree_high")
        if self.queue_size < 1 or self.max_message_bytes < 1:
            raise ConfigError("gossip.queue_size", "bounds must be positive")


def make_router(cfg: GossipConfig) -> GossipSub:
    """Build a GossipSub router with the settings above (see module docstring)."""
    return GossipSub(
        protocols=list(GOSSIPSUB_PROTOCOLS),
        degree=cfg.degree,
        degree_low=cfg.degree_low,
        degree_high=cfg.degree_high,
        heartbeat_initial_delay=0.1,
        heartbeat_interval=cfg.heartbeat_interval_s,
        spam_protection_enabled=False,
        max_messages_per_topic_per_second=1e9,
        eclipse_protection_enabled=False,
    )


class DirectPeering(INotifee):
    """Make every connected peer a GossipSub *direct peer* (explicit peering, GossipSub v1.1).

    A shardnet node only holds connections it chose (upstreams, bootstrap relays, the trainer)
    or that downstream nodes opened to it, so its connections *are* its gossip topology.
    Direct peers receive every message on the topics they subscribe to, without waiting for
    the mesh to form (py-libp2p 0.8.1 sends nothing to a joined topic whose mesh is still
    empty, which silently drops announcements published in the first heartbeats). The cost is
    flooding announcements to every connection, which is right for small, rare messages.
    Addresses are left empty: the router never re-dials a direct peer on its own.
    """

    def __init__(self, router: GossipSub) -> None:
        self.router = router
        #: called with the base58 PeerID of a peer whose last connection closed
        self.on_peer_gone: list[Callable[[str], None]] = []

    async def connected(self, network: INetwork, conn: INetConn) -> None:
        """Add the peer as a direct gossip peer."""
        pid = conn.muxed_conn.peer_id
        self.router.direct_peers[pid] = PeerInfo(pid, [])

    async def disconnected(self, network: INetwork, conn: INetConn) -> None:
        """Forget the peer when its last connection closed."""
        pid = conn.muxed_conn.peer_id
        if not network.get_connections(pid):
            self.router.direct_peers.pop(pid, None)
            for callback in self.on_peer_gone:
                callback(pid.to_base58())

    async def opened_stream(self, network: INetwork, stream: INetStream) -> None:
        """Unused."""

    async def closed_stream(self, network: INetwork, stream: INetStream) -> None:
        """Unused."""

    async def listen(self, network: INetwork, multiaddr: Multiaddr) -> None:
        """Unused."""

    async def listen_close(self, network: INetwork, multiaddr: Multiaddr) -> None:
        """Unused."""


def prepare_subscription(pubsub: Pubsub, cfg: GossipConfig) -> None:
    """Raise the library's per-peer outbound queue bounds to ``cfg.queue_size``.

    py-libp2p 0.8.1 creates each peer's ``RpcQueue`` with a fixed bound of 32 and offers no
    parameter; the bound is the ``max_size`` of its inner priority queue, so we raise it on
    every existing queue before publishing. Idempotent and cheap (one pass over peers). If a
    later py-libp2p changes that layout, this does nothing and the library default applies.
    """
    for queue in pubsub.peer_queues.values():
        inner = getattr(queue, "_queue", None)
        if inner is not None and getattr(inner, "max_size", cfg.queue_size) < cfg.queue_size:
            inner.max_size = cfg.queue_size


@dataclass(frozen=True)
class GossipMessage:
    """One received gossip message.

    Attributes:
        origin: PeerID of the message's original publisher (signed by the library).
        data: the payload bytes.
    """

    origin: str
    data: bytes


@dataclass(frozen=True)
class SubscriptionStats:
    """Counters of one subscription: received, delivered, dropped (queue full)."""

    received: int
    delivered: int
    dropped: int


class Subscription:
    """A topic subscription drained into a bounded deque; iterate with ``async for``.

    When more than ``queue_size`` messages are pending, the oldest is dropped and counted.
    """

    def __init__(self, topic: str, cfg: GossipConfig) -> None:
        self.topic = topic
        self._cfg = cfg
        self._pending: deque[GossipMessage] = deque()
        self._wake = trio.Event()
        self._received = 0
        self._delivered = 0
        self._dropped = 0

    @classmethod
    async def start(
        cls, pubsub: Pubsub, topic: str, cfg: GossipConfig, nursery: trio.Nursery
    ) -> Subscription:
        """Subscribe and start the drain task in ``nursery``."""
        sub = cls(topic, cfg)
        # The library reads this module constant at subscribe time for its channel size.
        _pubsub_mod.SUBSCRIPTION_CHANNEL_SIZE = max(
            _pubsub_mod.SUBSCRIPTION_CHANNEL_SIZE, cfg.queue_size
        )
        lib_sub = await pubsub.subscribe(topic)
        my_id = pubsub.my_id

        async def drain() -> None:
            async for msg in lib_sub:
                if ID(msg.from_id) == my_id:
                    continue
                sub._push(GossipMessage(origin=ID(msg.from_id).to_base58(), data=bytes(msg.data)))

        nursery.start_soon(drain)
        return sub

    def _push(self, msg: GossipMessage) -> None:
        self._received += 1
        if len(msg.data) > self._cfg.max_message_bytes:
            self._dropped += 1
            log.warning(
                "gossip_dropped topic=%s reason=oversize size_bytes=%d", self.topic, len(msg.data)
            )
            return
        if len(self._pending) >= self._cfg.queue_size:
            self._pending.popleft()
            self._dropped += 1
            log.warning("gossip_dropped topic=%s reason=queue_full", self.topic)
        self._pending.append(msg)
        self._wake.set()

    async def receive(self) -> GossipMessage:
        """Wait for and return the next message (oldest first)."""
        while not self._pending:
            self._wake = trio.Event()
            await self._wake.wait()
        self._delivered += 1
        return self._pending.popleft()

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> GossipMessage:
        return await self.receive()

    def statistics(self) -> SubscriptionStats:
        """Current counters."""
        return SubscriptionStats(self._received, self._delivered, self._dropped)
