"""download: a follower's half of NAT traversal: reservations on relays and hole punches.

Theory of operation
-------------------
A follower whose lane its dial-backs found unreachable (behind a NAT) holds circuit relay
reservations on up to two relays it is connected to and names them in its advert
(:class:`shardcast.core.Reservations`): other nodes can then reach it through a relay's
circuit, which is used only to coordinate a hole punch (DCUtR), never to carry shards.

Each time a download polls for extra sources, :meth:`Punching.start` starts the punches
:class:`shardcast.core.PunchPlanner` admits to nodes that hold or fill the version and are
reachable only through such a relay; a punched node joins the download at the next poll, over
the direct connection. A punch takes longer than a small version's download, so
:meth:`Punching.ahead` also punches before a download needs it: on each advert heard, and every
:attr:`shardcast.core.PunchConfig.ahead_interval_s`, so that the direct connections exist
when the next version is announced (:mod:`shardcast.core.reachability`, "Punching ahead").

What to punch, when to retry and who waits for whom is decided by the sans-IO
:class:`~shardcast.core.Reservations` and :class:`~shardcast.core.PunchPlanner` (shared with
the simulator); :class:`~shardcast.download.discovery.PunchRecord` tells whether this node's
punches keep failing (a symmetric NAT, say), which
:meth:`~shardcast.download.discovery.SourceDirectory.holder_reach` reads. This module does the
I/O: reservations and punches through the host (:class:`p2p.lanes.Host`: libp2p, or the
in-memory network), in the follower's nursery, each failure logged with the short PeerID and
retried by the planner's backoff.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import trio

from p2p.errors import ShardnetError, short_id
from p2p.lanes import Host
from shardcast.core import PunchConfig, PunchPlanner, PunchTarget, Reachability, Reservations
from shardcast.download.discovery import PunchRecord, SourceDirectory

log = logging.getLogger(__name__)

__all__ = ["Punching"]


class Punching:
    """A follower's relay reservations and hole punches (see the module docstring).

    Args:
        p2p: the node's host (direct peers, ``reserve``, ``punch``).
        own_id: this node's PeerID (of two nodes punching each other, the greater waits).
        config: reservation and punch settings.
        directory: the follower's directory of advertised nodes (punch candidates).
        reachability: this node's own lane reachability (reservations only while it is
            unreachable).
        rng: seeded randomness for the choice of relay.
        readvertise: called when the reservations this node advertises change.
        relay_upstreams: the follower's upstreams that are relays (tried first for a
            reservation).

    Attributes:
        reservations: relays this node holds, or wants, a reservation on.
        planner: which punches to start, and their backoff.
        record: whether this node's punches keep failing.
        counts: punches by outcome: ``started``, ``ahead`` (of those, started ahead),
            ``direct``, ``failed`` and ``no_circuit`` (failed ones whose relayed dial failed:
            the NATs were not tried).
    """

    def __init__(
        self,
        p2p: Host,
        own_id: str,
        config: PunchConfig,
        directory: SourceDirectory,
        reachability: Reachability,
        rng: random.Random,
        readvertise: Callable[[], None],
        relay_upstreams: Callable[[], list[str]],
    ) -> None:
        self.p2p = p2p
        self.own_id = own_id
        self.config = config
        self.directory = directory
        self.reachability = reachability
        self.rng = rng
        self.readvertise = readvertise
        self.relay_upstreams = relay_upstreams
        self.reservations = Reservations(config)
        self.planner = PunchPlanner(config)
        self.record = PunchRecord()
        self.counts = {"started": 0, "ahead": 0, "direct": 0, "failed": 0, "no_circuit": 0}
        self._reach_changed = trio.Event()

    def reach_changed(self) -> None:
        """This node's reachability changed: revisit the reservations now. Never blocks."""
        self._reach_changed.set()
        self._reach_changed = trio.Event()

    def advertised_relays(self) -> tuple[str, ...]:
        """The relays to name in this node's advert (none while its lane is reachable)."""
        return self.reservations.advertised(self.reachability.state)

    def failed(self, peer_id: str) -> bool:
        """True if the last hole punch to ``peer_id`` failed (it backs off, or did)."""
        return self.planner.retry_at(peer_id) is not None

    def status(self) -> dict[str, object]:
        """``relays`` (reservations held) and ``punches`` (:attr:`counts`) for ``/status``."""
        return {"relays": list(self.reservations.held), "punches": dict(self.counts)}

    def relay_candidates(self, direct: frozenset[str]) -> list[str]:
        """Relays this node holds a direct connection to (``direct``: PeerIDs): its relay
        upstreams first, then other nodes that advertised the relay role."""
        ups = self.relay_upstreams()
        known = [a.peer_id for a, _ in self.directory.entries(trio.current_time())]
        others = [p for p in known if self.directory.role_of(p) == "relay" and p not in ups]
        return [p for p in ups + others if p in direct]

    async def keep_reservations(self) -> None:
        """Run until cancelled: while this node's lane is unreachable, hold reservations on
        relays (:class:`shardcast.core.Reservations`) and have them advertised; revisited
        every :attr:`~shardcast.core.PunchConfig.reserve_interval_s` and at each change of
        reachability. A failed reservation is logged and backed off, never raised."""
        while True:
            direct = frozenset(self.p2p.direct_peers())
            if self.reservations.keep_connected(direct):
                self.readvertise()
            now = trio.current_time()
            for relay in self.reservations.wanted(
                self.reachability.state, self.relay_candidates(direct), now
            ):
                try:
                    await self.p2p.reserve(relay)
                except ShardnetError as exc:
                    self.reservations.failed(relay, trio.current_time())
                    log.info("reservation_failed relay=%s error=%s", short_id(relay), exc)
                    continue
                self.reservations.reserved(relay)
                log.info("reservation relay=%s", short_id(relay))
                self.readvertise()
            with trio.move_on_after(self.config.reserve_interval_s):
                await self._reach_changed.wait()

    def yields_to(self, peer_id: str) -> bool:
        """True if ``peer_id`` may be punching this node (this node names relays too) and
        this node is the one that waits (:attr:`shardcast.core.PunchConfig.yield_s`)."""
        return bool(self.advertised_relays()) and self.own_id > peer_id

    def start(self, step: int, digest: str, direct: frozenset[str], nursery: trio.Nursery) -> None:
        """Start, in ``nursery``, the hole punches :class:`shardcast.core.PunchPlanner` admits
        to sources of ``(step, digest)`` reachable only that way (``direct``: the PeerIDs
        this node holds direct connections to); each joins the download once direct."""
        now = trio.current_time()
        for advert in self.directory.punch_candidates(step, now, digest=digest, connected=direct):
            relay = self.planner.start(
                advert.peer_id,
                advert.relays,
                direct,
                now,
                self.rng,
                yield_to_peer=self.yields_to(advert.peer_id),
            )
            if relay is not None:
                self.counts["started"] += 1
                nursery.start_soon(self._punch, advert.peer_id, relay)

    async def ahead(self, nursery: trio.Nursery) -> None:
        """Run until cancelled: punch to nodes behind NATs before a download needs them, on
        each advert heard and every :attr:`shardcast.core.PunchConfig.ahead_interval_s`;
        the punches run in ``nursery``."""
        while True:
            direct = frozenset(self.p2p.direct_peers())
            now = trio.current_time()
            adverts, held = self.directory.punch_ahead(now, connected=direct)
            targets = [
                PunchTarget(a.peer_id, a.relays, a.newest(), self.yields_to(a.peer_id))
                for a in adverts
            ]
            for peer_id, relay in self.planner.ahead(targets, direct, held, now, self.rng):
                self.counts["started"] += 1
                self.counts["ahead"] += 1
                nursery.start_soon(self._punch, peer_id, relay)
            with trio.move_on_after(self.config.ahead_interval_s):
                await self.directory.changed.wait()

    async def _punch(self, peer_id: str, relay: str) -> None:
        direct, circuit = False, True
        try:
            direct = await self.p2p.punch(peer_id, relay)
        except ShardnetError as exc:  # no circuit: the NATs were not tried
            circuit = False
            log.info(
                "punch_failed peer=%s relay=%s error=%s", short_id(peer_id), short_id(relay), exc
            )
        finally:
            self.planner.done(peer_id, direct=direct, now=trio.current_time(), circuit=circuit)
        self.counts["direct" if direct else "failed"] += 1
        if direct:  # a stream-lane source for the downloads now: they need not wait a poll
            self.directory.reach_changed()
        if circuit:  # the NATs were tried: evidence of whether this node's punches work
            self.record.done(direct)
        else:
            self.counts["no_circuit"] += 1
        log.info("punch peer=%s relay=%s direct=%s", short_id(peer_id), short_id(relay), direct)
