"""Discovering extra sources: nodes advertise which versions they hold on a gossip topic.

Every relay and peer publishes a small :class:`NodeAdvert` on ``shardnet/<run>/nodes/1``
every ``interval_s`` seconds and whenever it starts or commits a version: its PeerID, role,
HTTP lane URL, the steps it has committed and the ones it is filling. Gossip origin is
authenticated by libp2p's message signatures, and an advert naming another PeerID than its
origin is dropped. A follower keeps the adverts it heard in a :class:`SourceDirectory`
(bounded, entries expire after ``ttl_s``) and adds, for a version it downloads, a few of the
nodes that hold it — complete ones as full sources, filling ones as partial sources whose
have-set it polls. No trust is needed: every byte is checked against the signed manifest.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import trio

from p2p import wire
from p2p.errors import RemoteProtocolError, short_id
from shardcast.downloader import Source

log = logging.getLogger(__name__)

MAX_ADVERT_BYTES = 4096
ROLES = ("relay", "peer")


def nodes_topic(run_id: str) -> str:
    """Gossipsub topic of node adverts for ``run_id``."""
    return f"shardnet/{run_id}/nodes/1"


@dataclass(frozen=True)
class NodeAdvert:
    """What a node says about itself (see module docstring)."""

    peer_id: str
    role: str
    http_url: str
    committed: tuple[int, ...]
    filling: tuple[int, ...]

    def encode(self) -> bytes:
        """Canonical CBOR bytes."""
        return wire.encode(
            {
                "v": 1,
                "peer_id": self.peer_id,
                "role": self.role,
                "http_url": self.http_url,
                "committed": list(self.committed[-16:]),
                "filling": list(self.filling[-16:]),
            }
        )

    @classmethod
    def decode(cls, data: bytes, origin: str) -> NodeAdvert:
        """Parse an advert received from gossip ``origin``.

        Raises:
            RemoteProtocolError: malformed, or it names another PeerID than ``origin``.
        """
        obj = wire.decode(data, max_bytes=MAX_ADVERT_BYTES, sender=origin)
        wire.need_version(obj, 1, "node advert", origin)
        peer_id = wire.need_str(obj, "peer_id", 128, origin)
        if peer_id != origin:
            raise RemoteProtocolError(origin, f"advert claims to be {short_id(peer_id)}")
        role = wire.need_str(obj, "role", 16, origin)
        url = wire.need_str(obj, "http_url", 256, origin)
        if role not in ROLES or not url.startswith("http://") or "/" in url[7:]:
            raise RemoteProtocolError(origin, f"bad role {role!r} or url {url!r}")
        steps = []
        for key in ("committed", "filling"):
            raw = wire.need_list(obj, key, 16, origin)
            if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in raw):
                raise RemoteProtocolError(origin, f"{key} must be non-negative integers")
            steps.append(tuple(raw))
        return cls(peer_id, role, url, steps[0], steps[1])


def check_advert_gossip(origin: str, data: bytes) -> None:
    """Gossip check of the nodes topic: a well-formed advert about its own origin.

    Raises:
        RemoteProtocolError: see :meth:`NodeAdvert.decode`.
    """
    NodeAdvert.decode(data, origin)


class SourceDirectory:
    """Adverts heard recently, and the extra sources they offer for a version.

    Args:
        self_id: this node's PeerID (never a source of itself).
        exclude: PeerIDs already used as upstreams.
        ttl_s: an advert older than this is forgotten, seconds.
        max_entries: bound on remembered nodes.
        rng: seeded randomness to spread load over equivalent sources.
    """

    def __init__(
        self, self_id: str, exclude: set[str], ttl_s: float, max_entries: int, rng: random.Random
    ) -> None:
        self.self_id = self_id
        self.exclude = exclude
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.rng = rng
        self._adverts: dict[str, tuple[NodeAdvert, float]] = {}
        self.changed = trio.Event()

    def offer(self, advert: NodeAdvert, now: float) -> None:
        """Remember an advert (bounded; the entry heard least recently is evicted).

        ``now`` must not decrease between calls (a monotonic clock): entries are kept in the
        order they were last heard, so the oldest is the first.
        """
        if advert.peer_id == self.self_id or advert.peer_id in self.exclude:
            return
        self._adverts.pop(advert.peer_id, None)
        self._adverts[advert.peer_id] = (advert, now)
        if len(self._adverts) > self.max_entries:
            del self._adverts[next(iter(self._adverts))]
        self.changed.set()
        self.changed = trio.Event()

    def entries(self, now: float) -> list[tuple[NodeAdvert, float]]:
        """Adverts heard within ``ttl_s`` and when (``now``'s clock), oldest first."""
        return [(a, t) for a, t in self._adverts.values() if now - t <= self.ttl_s]

    def role_of(self, peer_id: str) -> str | None:
        """The role ``peer_id`` advertised (None: never heard or forgotten)."""
        entry = self._adverts.get(peer_id)
        return entry[0].role if entry is not None else None

    def sources_for(self, step: int, now: float, limit: int) -> list[Source]:
        """Up to ``limit`` sources holding (or filling) ``step``, best first: complete ones,
        then relays still filling it, then peers still filling it (a relay's uplink exists to
        serve; a peer's is smaller and shared with its own work), shuffled within each class
        so that downloaders spread over different sources."""
        fresh = [(a, t) for a, t in self._adverts.values() if now - t <= self.ttl_s]
        full = [a for a, _ in fresh if step in a.committed]
        partial = [a for a, _ in fresh if step in a.filling and step not in a.committed]
        self.rng.shuffle(full)
        self.rng.shuffle(partial)
        partial.sort(key=lambda a: a.role != "relay")  # stable: shuffled within each role
        out = [Source(a.peer_id, a.http_url, complete=True) for a in full]
        out += [Source(a.peer_id, a.http_url, complete=False) for a in partial]
        return out[:limit]
