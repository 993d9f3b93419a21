"""download: discovering extra sources: nodes advertise which versions they hold on a gossip topic.

Every relay and peer publishes a small :class:`NodeAdvert` on ``shardnet/<run>/nodes/1``
every ``interval_s`` seconds and whenever it starts or commits a version: its PeerID, role,
HTTP lane URL, the versions it has committed and the ones it is filling, each as a step and
its manifest digest (a version is ``(step, digest)``: a node holding a step under another
digest is not offered as a source of it; adverts of older nodes, without digests, offer no
source for a given digest). Gossip origin is
authenticated by libp2p's message signatures, and an advert naming another PeerID than its
origin is dropped. A follower keeps the adverts it heard in a :class:`SourceDirectory`
(bounded, entries expire after ``ttl_s``) and adds, for a version it downloads, a few of the
nodes that hold it — complete ones as full sources, filling ones as partial sources whose
have-set it polls; a download asks for them again whenever the directory has news (an advert
whose content changed, a lane proven, a hole punched: :attr:`SourceDirectory.news`), so the
peers that start a version join each other's downloads as their adverts arrive. No trust is
needed for integrity: every byte is checked against the signed manifest. But adverts must not
steer the swarm's requests, so:

- **the URL is bound to the PeerID**: a follower uses an advertised URL only after the lane
  there answered a fresh challenge (``/shardnet/v1/whoami/<nonce>``, see
  :func:`shardcast.wire.lane_auth.whoami_body`) with the advertiser's signature
  (``require_verified``); a URL that fails is asked again after an exponential backoff
  (:class:`LaneBackoff`: 60 s, then 4x longer each time, so at most three attempts in the
  hour after the first failure) and dropped after
  :attr:`LaneBackoff.max_failures` failures in a row (not asked again for
  :attr:`LaneBackoff.drop_s`); the last result of each is a
  :class:`~shardcast.core.reachability.LaneCheck`. An advert
  with an empty URL is a download-only node (one that learned its lane is not reachable from
  outside, :mod:`shardcast.core.reachability`): it is never challenged, and offers a source
  only if it advertises a *stream lane* (``stream_lane``: its lane served over libp2p streams,
  :mod:`p2p.bytestream`), and then only to followers holding a libp2p connection to it (the
  PeerID is proven by that connection; :func:`shardcast.core.choose_lane` decides, and
  :meth:`SourceDirectory.sources_for` offers it as ``p2p://<PeerID>``). A node behind a NAT
  also names the relays it holds a circuit reservation on (``relays``); a follower connected
  to one of them may hole-punch to it (:meth:`SourceDirectory.punch_candidates`,
  :class:`shardcast.core.PunchPlanner`), after which the direct connection carries its
  stream lane;
- **advertisers are scored**, across versions: a source that delivered bytes gains, one that
  was used and delivered nothing (or kept answering 503) loses; those at or below
  ``MIN_SCORE`` are not offered (their score recovers by one point per ``ttl_s``);
- **slots are shared fairly**: one source per URL (many identities pointing at one server
  share one slot), best scored first within each class.

When a super-seeding source refuses a shard and names its holder (``X-Shardnet-Holder``,
:class:`shardcast.serve.superseeding.SuperSeeding` rule 11), :meth:`SourceDirectory.holder_reach`
says whether this node can fetch it from that holder (:class:`HolderReach`): a holder it has
no lane to and will not get one to soon is named back as unreachable, and the source serves
the shard at once instead of after its window. A holder reachable only by a punch not tried
yet is waited for, unless this node's own recent punches all failed (:class:`PunchRecord`: its
NAT or its network defeats hole punching, e.g. a symmetric NAT), since a punch takes seconds
to fail and would have to fail for every holder before the window had passed anyway.
"""

from __future__ import annotations

import enum
import logging
import random
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import trio

from p2p import wire
from p2p.bytestream import stream_lane_url
from p2p.errors import RemoteProtocolError, short_id
from p2p.keys import is_valid_peer_id
from shardcast.core import Lane, LaneCheck, choose_lane
from shardcast.download.types import Source
from shardcast.wire import DIGEST_RE

log = logging.getLogger(__name__)

MAX_ADVERT_BYTES = 4096
ROLES = ("relay", "peer")
MIN_SCORE = -3
MAX_SCORE = 8
MAX_LISTED = 16
"""Versions listed per advert, of each kind (the newest)."""


def nodes_topic(run_id: str) -> str:
    """Gossipsub topic of node adverts for ``run_id``."""
    return f"shardnet/{run_id}/nodes/1"


@dataclass(frozen=True)
class NodeAdvert:
    """What a node says about itself (see module docstring).

    Attributes:
        committed, filling: steps committed and being filled (at most :data:`MAX_LISTED`).
        committed_digests, filling_digests: the manifest digest of each of those steps, in
            the same order (empty: an advert of an older node, which names steps only).
        tier: hops from the origin (1: a relay fed by the origin; 2: a node fed by relays),
            or None (unknown: an older node). Relays of one tier do not super-seed to each
            other (:attr:`shardcast.serve.server.VersionServer.requester_kind`).
        stream_lane: its lane is served over libp2p streams on connections it holds (a node
            behind a NAT; wire key ``stream_lane``, absent when False).
        lan_url: a lane URL on a private, loopback or link-local address, for nodes on the
            advertiser's own network only (wire key ``lan_url``, absent when empty; see
            "LAN scope" in :mod:`shardcast.core.reachability`).
        relays: PeerIDs of relays it holds a circuit relay reservation on (at most
            :data:`MAX_RELAYS`; wire key ``relays``, absent when empty): a follower connected
            to one of them may reach it through that relay and hole-punch
            (:class:`shardcast.core.PunchPlanner`).
    """

    peer_id: str
    role: str
    http_url: str
    committed: tuple[int, ...]
    filling: tuple[int, ...]
    committed_digests: tuple[str, ...] = ()
    filling_digests: tuple[str, ...] = ()
    tier: int | None = None
    stream_lane: bool = False
    lan_url: str = ""
    relays: tuple[str, ...] = ()

    @classmethod
    def of(
        cls,
        peer_id: str,
        role: str,
        http_url: str,
        committed: Sequence[tuple[int, str]],
        filling: Sequence[tuple[int, str]],
        tier: int | None = None,
        *,
        stream_lane: bool = False,
        lan_url: str = "",
        relays: Sequence[str] = (),
    ) -> NodeAdvert:
        """An advert listing the newest :data:`MAX_LISTED` versions ``(step, digest)`` of
        each kind."""
        c, f = list(committed)[-MAX_LISTED:], list(filling)[-MAX_LISTED:]
        return cls(
            peer_id,
            role,
            http_url,
            tuple(s for s, _ in c),
            tuple(s for s, _ in f),
            tuple(d for _, d in c),
            tuple(d for _, d in f),
            tier,
            stream_lane,
            lan_url,
            tuple(relays)[:MAX_RELAYS],
        )

    def holds(self, step: int, digest: str | None = None) -> bool:
        """True if it says it committed ``step`` (under ``digest``, unless None)."""
        return _lists(self.committed, self.committed_digests, step, digest)

    def fills(self, step: int, digest: str | None = None) -> bool:
        """True if it says it is filling ``step`` (under ``digest``, unless None)."""
        return _lists(self.filling, self.filling_digests, step, digest)

    def newest(self) -> int:
        """The newest step it says it holds or fills (-1: none)."""
        return max((*self.committed, *self.filling), default=-1)

    def encode(self) -> bytes:
        """Canonical CBOR bytes."""
        obj: dict[str, Any] = {
            "v": 1,
            "peer_id": self.peer_id,
            "role": self.role,
            "http_url": self.http_url,
            "committed": list(self.committed[-MAX_LISTED:]),
            "filling": list(self.filling[-MAX_LISTED:]),
        }
        if self.committed_digests or self.filling_digests:
            obj["committed_digests"] = list(self.committed_digests[-MAX_LISTED:])
            obj["filling_digests"] = list(self.filling_digests[-MAX_LISTED:])
        if self.tier is not None:
            obj["tier"] = self.tier
        if self.stream_lane:
            obj["stream_lane"] = True
        if self.lan_url:
            obj["lan_url"] = self.lan_url
        if self.relays:
            obj["relays"] = list(self.relays[:MAX_RELAYS])
        return wire.encode(obj)

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
        lan_url = wire.need_str(obj, "lan_url", 256, origin) if "lan_url" in obj else ""
        if role not in ROLES or not all(_lane_url(u) for u in (url, lan_url)):
            raise RemoteProtocolError(origin, f"bad role {role!r} or url {url!r} {lan_url!r}")
        steps = []
        digests: list[tuple[str, ...]] = []
        for key in ("committed", "filling"):
            raw = wire.need_list(obj, key, MAX_LISTED, origin)
            if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in raw):
                raise RemoteProtocolError(origin, f"{key} must be non-negative integers")
            steps.append(tuple(raw))
            if "committed_digests" in obj or "filling_digests" in obj:
                named = wire.need_list(obj, f"{key}_digests", MAX_LISTED, origin)
                if len(named) != len(raw) or not all(
                    isinstance(d, str) and DIGEST_RE.match(d) for d in named
                ):
                    raise RemoteProtocolError(
                        origin, f"{key}_digests must be one 64-hex digest per {key} step"
                    )
                digests.append(tuple(named))
            else:
                digests.append(())
        tier = obj.get("tier")
        if tier is not None and not (
            isinstance(tier, int) and not isinstance(tier, bool) and 0 <= tier <= MAX_TIER
        ):
            raise RemoteProtocolError(origin, f"tier must be an integer 0..{MAX_TIER}")
        stream_lane, relays = _stream_lane_fields(obj, origin)
        return cls(
            peer_id,
            role,
            url,
            steps[0],
            steps[1],
            digests[0],
            digests[1],
            tier,
            stream_lane,
            lan_url,
            relays,
        )


def _lane_url(url: str) -> bool:
    """True for an empty URL or one like ``http://host:port`` (no path)."""
    return not url or (url.startswith("http://") and "/" not in url[7:])


def _stream_lane_fields(obj: dict[str, Any], origin: str) -> tuple[bool, tuple[str, ...]]:
    """An advert's ``stream_lane`` (False when absent) and ``relays`` (empty when absent).

    Raises:
        RemoteProtocolError: ``stream_lane`` is not a boolean, or ``relays`` is not a list of
            at most :data:`MAX_RELAYS` PeerIDs.
    """
    stream_lane = obj.get("stream_lane", False)
    if not isinstance(stream_lane, bool):
        raise RemoteProtocolError(origin, "stream_lane must be a boolean")
    relays = wire.need_list(obj, "relays", MAX_RELAYS, origin) if "relays" in obj else []
    if not all(isinstance(r, str) and len(r) <= 128 and is_valid_peer_id(r) for r in relays):
        raise RemoteProtocolError(origin, "relays must be base58 PeerIDs")
    return stream_lane, tuple(relays)


MAX_TIER = 64
"""Largest tier an advert may name."""

MAX_RELAYS = 4
"""Relays an advert may name."""


def check_advert_gossip(origin: str, data: bytes) -> None:
    """Gossip check of the nodes topic: a well-formed advert about its own origin.

    Raises:
        RemoteProtocolError: see :meth:`NodeAdvert.decode`.
    """
    NodeAdvert.decode(data, origin)


@dataclass(frozen=True)
class LaneBackoff:
    """When a failed URL is challenged again.

    The retry after ``n`` failures in a row waits ``min(first_s * factor**(n-1), max_s)``
    seconds: 60, 240, 960 (retries 1, 5 and 21 minutes after the first failure), so the hour
    after the first failure holds at most three attempts whatever ``max_s`` (which only
    matters with a larger ``max_failures``). After ``max_failures`` failures in a row the URL
    is dropped: not challenged again for ``drop_s`` seconds (then it starts over).
    """

    first_s: float = 60.0
    factor: float = 4.0
    max_s: float = 3600.0
    max_failures: int = 4
    drop_s: float = 6 * 3600.0

    def delay_s(self, failures: int) -> float:
        """Seconds to wait after ``failures`` (>= 1) failures in a row."""
        if failures >= self.max_failures:
            return self.drop_s
        return min(self.first_s * self.factor ** (failures - 1), self.max_s)


class HolderReach(enum.Enum):
    """Whether this node can fetch from a holder a super-seeding refusal named
    (:meth:`SourceDirectory.holder_reach`; value = metric label)."""

    USABLE = "usable"
    """A lane now (a proven URL, or its stream lane over a direct connection): fetch from
    it, the refusal's wait is short."""
    PENDING = "pending"
    """No lane yet, but one may open soon: a hole punch to it not failed yet, or its URL's
    first challenge still to come. Wait as before."""
    UNKNOWN = "unknown"
    """No advert of it heard (or forgotten): nothing known, so wait as before (naming every
    unknown holder would undo super-seeding wherever adverts are sampled)."""
    UNREACHABLE = "unreachable"
    """No lane and none coming: no URL in scope that proved itself (or it failed its
    challenge), no direct connection, and no shared relay or a punch to it that failed
    (backing off: both behind NATs, one of them symmetric); or it kept failing this node
    (scored out). Named back to the source, which then serves at once (rule 11)."""


class PunchRecord:
    """This node's last ``window`` hole-punch outcomes (pure, bounded): :meth:`failing` when
    each of them failed, whatever the peers, which says that its own NAT or network defeats
    hole punching (a symmetric NAT) and a punch to a holder not tried yet would fail too
    (:meth:`SourceDirectory.holder_reach`). One direct punch clears it.

    Args:
        window: outcomes kept (>= 1).

    Raises:
        ValueError: ``window`` < 1.
    """

    def __init__(self, window: int = 3) -> None:
        if window < 1:
            raise ValueError(f"PunchRecord window must be >= 1, got {window}")
        self._last: deque[bool] = deque(maxlen=window)

    def done(self, direct: bool) -> None:
        """A punch ended: ``direct`` if a direct connection came of it."""
        self._last.append(direct)

    def failing(self) -> bool:
        """True when the last ``window`` punches all failed."""
        return len(self._last) == self._last.maxlen and not any(self._last)


@dataclass(frozen=True)
class LaneStatus:
    """What this node knows of one advertised URL.

    Attributes:
        result: the last challenge's outcome.
        failures: failures in a row (0 once verified).
        at: when the last challenge ended (trio seconds).
        next_at: when it may be challenged again (trio seconds).
    """

    result: LaneCheck
    failures: int
    at: float
    next_at: float

    def dropped(self, backoff: LaneBackoff) -> bool:
        """True if the URL failed too often in a row and is no longer challenged."""
        return self.failures >= backoff.max_failures


class SourceDirectory:
    """Adverts heard recently, and the extra sources they offer for a version.

    Args:
        self_id: this node's PeerID (never a source of itself).
        exclude: PeerIDs already used as upstreams.
        ttl_s: an advert older than this is forgotten, seconds.
        max_entries: bound on remembered nodes.
        rng: seeded randomness to spread load over equivalent sources.
        backoff: when failed URLs are challenged again.

    Attributes:
        changed: set (and replaced) at every advert heard and every challenge recorded.
        news: set (and replaced) only when what :meth:`sources_for` can offer may have
            changed: an advert from a new node or one whose content differs from that node's
            last (not the periodic repeat of the same advert), or a challenge whose result
            differs from the URL's last. Downloads wake their discovery on it.
    """

    def __init__(
        self,
        self_id: str,
        exclude: set[str],
        ttl_s: float,
        max_entries: int,
        rng: random.Random,
        *,
        require_verified: bool = False,
        one_per_url: bool = False,
        backoff: LaneBackoff | None = None,
    ) -> None:
        self.self_id = self_id
        self.exclude = exclude
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.rng = rng
        self.require_verified = require_verified
        self.one_per_url = one_per_url
        self._adverts: dict[str, tuple[NodeAdvert, float]] = {}
        self._verified: dict[str, str] = {}  # PeerID -> URL its lane proved
        self.backoff = backoff or LaneBackoff()
        self._lanes: dict[tuple[str, str], LaneStatus] = {}  # (PeerID, URL) -> last challenge
        self._scores: dict[str, tuple[float, float]] = {}  # PeerID -> (score, when set)
        self.changed = trio.Event()
        self.news = trio.Event()

    def _pulse(self, news: bool) -> None:
        self.changed.set()
        self.changed = trio.Event()
        if news:
            self.news.set()
            self.news = trio.Event()

    def reach_changed(self) -> None:
        """This node's reach of an advertiser changed (a hole punch opened a direct
        connection): what :meth:`sources_for` offers may have changed; wakes :attr:`news`."""
        self._pulse(True)

    # -- verification and scores ----------------------------------------------------------

    def to_verify(self, now: float) -> list[NodeAdvert]:
        """Fresh adverts whose URL is not proven yet and is due for a challenge (never
        challenged, or its backoff has passed); adverts with no URL are left out."""
        out = []
        for a, t in self._adverts.values():
            if not a.http_url or now - t > self.ttl_s:
                continue
            if self._verified.get(a.peer_id) == a.http_url:
                continue
            lane = self._lanes.get((a.peer_id, a.http_url))
            if lane is None or now >= lane.next_at:
                out.append(a)
        return out

    def verified(self, peer_id: str, url: str, result: LaneCheck, now: float) -> LaneStatus:
        """Record the outcome of a whoami challenge of ``peer_id``'s lane at ``url``; the
        URL's state after it (see :class:`LaneBackoff`)."""
        old = self._lanes.pop((peer_id, url), None)
        if result is LaneCheck.VERIFIED:
            self._verified[peer_id] = url
            lane = LaneStatus(result, 0, now, now)
        else:
            if self._verified.get(peer_id) == url:
                del self._verified[peer_id]
            failures = (old.failures if old is not None else 0) % self.backoff.max_failures + 1
            lane = LaneStatus(result, failures, now, now + self.backoff.delay_s(failures))
            self.record(peer_id, delivered=False, now=now)
        self._lanes[(peer_id, url)] = lane
        self._pulse(old is None or old.result is not result)
        _bound(self._verified, self.max_entries)
        _bound(self._lanes, self.max_entries)
        return lane

    def lane_status(self, peer_id: str, url: str) -> LaneStatus | None:
        """The last challenge of ``peer_id``'s ``url`` (None: never challenged, or forgotten)."""
        return self._lanes.get((peer_id, url))

    def score(self, peer_id: str, now: float) -> float:
        """An advertiser's score now (0: unknown; recovers one point per ``ttl_s``)."""
        value, since = self._scores.get(peer_id, (0.0, now))
        if value < 0:
            value = min(0.0, value + (now - since) / self.ttl_s)
        return value

    def record(self, peer_id: str, *, delivered: bool, now: float) -> None:
        """A download used ``peer_id``: it delivered bytes, or it delivered nothing (or kept
        answering 503). Scores survive across versions (bounded memory)."""
        value = self.score(peer_id, now) + (1.0 if delivered else -1.0)
        self._scores.pop(peer_id, None)
        self._scores[peer_id] = (max(MIN_SCORE - 2.0, min(MAX_SCORE, value)), now)
        _bound(self._scores, self.max_entries)

    def offer(self, advert: NodeAdvert, now: float) -> None:
        """Remember an advert (bounded; the entry heard least recently is evicted).

        ``now`` must not decrease between calls (a monotonic clock): entries are kept in the
        order they were last heard, so the oldest is the first.
        """
        if advert.peer_id == self.self_id or advert.peer_id in self.exclude:
            return
        old = self._adverts.pop(advert.peer_id, None)
        self._adverts[advert.peer_id] = (advert, now)
        if len(self._adverts) > self.max_entries:
            del self._adverts[next(iter(self._adverts))]
        self._pulse(old is None or old[0] != advert or now - old[1] > self.ttl_s)

    def entries(self, now: float) -> list[tuple[NodeAdvert, float]]:
        """Adverts heard within ``ttl_s`` and when (``now``'s clock), oldest first."""
        return [(a, t) for a, t in self._adverts.values() if now - t <= self.ttl_s]

    def role_of(self, peer_id: str) -> str | None:
        """The role ``peer_id`` advertised (None: never heard or forgotten)."""
        entry = self._adverts.get(peer_id)
        return entry[0].role if entry is not None else None

    def download_only(self, peer_id: str) -> bool:
        """True if ``peer_id``'s last advert offers no lane outside its own network (no URL,
        no stream lane; a LAN URL serves only its neighbours); False also when no advert of
        it was heard or it was forgotten."""
        entry = self._adverts.get(peer_id)
        return entry is not None and not entry[0].http_url and not entry[0].stream_lane

    def tier_of(self, peer_id: str) -> int | None:
        """The tier ``peer_id`` advertised (None: never heard, forgotten, or not said)."""
        entry = self._adverts.get(peer_id)
        return entry[0].tier if entry is not None else None

    def lane(self, advert: NodeAdvert, connected: frozenset[str]) -> Lane:
        """How to reach ``advert``'s node (:func:`shardcast.core.choose_lane`), this node
        holding direct connections to the PeerIDs in ``connected``."""
        return choose_lane(
            http_url=advert.http_url,
            http_proven=not self.require_verified
            or self._verified.get(advert.peer_id) == advert.http_url,
            stream_lane=advert.stream_lane,
            connected=advert.peer_id in connected,
            relays=advert.relays,
            relays_connected=connected,
        )

    def base_url(self, advert: NodeAdvert, connected: frozenset[str]) -> str | None:
        """Where to fetch from ``advert``'s node (:meth:`lane`): its proven URL, its stream
        lane (``p2p://<PeerID>``) over a direct connection, or None (also while a hole punch
        is still to be made: :meth:`punch_candidates`)."""
        lane = self.lane(advert, connected)
        if lane is Lane.HTTP:
            return advert.http_url
        if lane is Lane.STREAM:
            return stream_lane_url(advert.peer_id)
        return None

    def sources_for(
        self,
        step: int,
        now: float,
        limit: int,
        *,
        digest: str | None = None,
        connected: frozenset[str] = frozenset(),
    ) -> list[Source]:
        """Up to ``limit`` sources holding (or filling) version ``(step, digest)`` (any digest
        of ``step`` if None), each at :meth:`base_url` (``connected``: the PeerIDs this node
        holds a direct libp2p connection to, which makes a stream lane usable), best first:
        complete ones, then relays still filling it, then peers still filling it (a relay's
        uplink exists to serve; a peer's is smaller and shared with its own work), shuffled
        within each class so that downloaders spread over different sources."""
        base = {
            a.peer_id: url
            for a, t in self._adverts.values()
            if now - t <= self.ttl_s
            and self.score(a.peer_id, now) > MIN_SCORE
            and (url := self.base_url(a, connected)) is not None
        }
        fresh = [a for a, _ in self._adverts.values() if a.peer_id in base]
        full = [a for a in fresh if a.holds(step, digest)]
        partial = [a for a in fresh if a.fills(step, digest) and not a.holds(step, digest)]
        self.rng.shuffle(full)
        self.rng.shuffle(partial)
        full.sort(key=lambda a: -self.score(a.peer_id, now))  # stable: shuffled among equals
        partial.sort(key=lambda a: (a.role != "relay", -self.score(a.peer_id, now)))
        out = [Source(a.peer_id, base[a.peer_id], complete=True) for a in full]
        out += [Source(a.peer_id, base[a.peer_id], complete=False) for a in partial]
        if self.one_per_url:
            seen: set[str] = set()
            kept = []
            for src in out:
                where = urlsplit(src.base_url).netloc
                if where not in seen:
                    seen.add(where)
                    kept.append(src)
            out = kept
        return out[:limit]

    def holder_reach(
        self,
        peer_id: str,
        now: float,
        *,
        connected: frozenset[str] = frozenset(),
        punch_failed: Callable[[str], bool] = lambda _: False,
        punching_fails: bool = False,
    ) -> HolderReach:
        """Whether this node can fetch from ``peer_id``, a holder a super-seeding refusal
        named (:class:`HolderReach`; pure: reads adverts, lane checks and scores).

        Args:
            peer_id: the holder.
            now: trio seconds.
            connected: PeerIDs this node holds a direct libp2p connection to.
            punch_failed: True for a PeerID whose last hole punch failed (its
                :meth:`shardcast.core.PunchPlanner.retry_at` is set).
            punching_fails: this node's recent punches all failed
                (:meth:`PunchRecord.failing`): a holder reachable only by a punch is
                unreachable even before a punch to it was tried.
        """
        entry = self._adverts.get(peer_id)
        if peer_id == self.self_id or entry is None or now - entry[1] > self.ttl_s:
            return HolderReach.UNKNOWN
        advert = entry[0]
        if self.score(peer_id, now) <= MIN_SCORE:
            return HolderReach.UNREACHABLE  # it kept failing here
        lane = self.lane(advert, connected)
        if lane in (Lane.HTTP, Lane.STREAM):
            return HolderReach.USABLE
        if lane is Lane.PUNCH:
            hopeless = punching_fails or punch_failed(peer_id)
            return HolderReach.UNREACHABLE if hopeless else HolderReach.PENDING
        if advert.http_url and self._lanes.get((peer_id, advert.http_url)) is None:
            return HolderReach.PENDING  # its URL is still to be challenged
        return HolderReach.UNREACHABLE

    def punch_candidates(
        self,
        step: int,
        now: float,
        *,
        digest: str | None = None,
        connected: frozenset[str] = frozenset(),
    ) -> list[NodeAdvert]:
        """Fresh, not down-scored adverts holding or filling ``(step, digest)`` that this node
        can reach only by a hole punch through a relay both are connected to
        (:attr:`shardcast.core.Lane.PUNCH`), complete ones first, best scored first; which of
        them to punch now is :class:`shardcast.core.PunchPlanner`'s decision."""
        fresh = [
            a
            for a, t in self._adverts.values()
            if now - t <= self.ttl_s
            and self.score(a.peer_id, now) > MIN_SCORE
            and (a.holds(step, digest) or a.fills(step, digest))
            and self.lane(a, connected) is Lane.PUNCH
        ]
        fresh.sort(key=lambda a: (not a.holds(step, digest), -self.score(a.peer_id, now)))
        return fresh

    def punch_ahead(
        self, now: float, *, connected: frozenset[str] = frozenset()
    ) -> tuple[list[NodeAdvert], int]:
        """Fresh, not down-scored adverts this node can reach only by a hole punch
        (:attr:`shardcast.core.Lane.PUNCH`), whatever they hold (every follower holds the
        next version soon), and how many stream-lane advertisers (nodes behind NATs) this
        node holds a direct connection to (``connected``): what
        :meth:`shardcast.core.PunchPlanner.ahead` weighs."""
        fresh = [
            a
            for a, t in self._adverts.values()
            if now - t <= self.ttl_s and self.score(a.peer_id, now) > MIN_SCORE
        ]
        held = sum(1 for a in fresh if a.stream_lane and a.peer_id in connected)
        return [a for a in fresh if self.lane(a, connected) is Lane.PUNCH], held


def _lists(steps: tuple[int, ...], digests: tuple[str, ...], step: int, digest: str | None) -> bool:
    if digest is None:
        return step in steps
    return any(s == step and d == digest for s, d in zip(steps, digests, strict=False))


def _bound(d: dict, limit: int) -> None:  # type: ignore[type-arg]
    while len(d) > limit:
        d.pop(next(iter(d)))
