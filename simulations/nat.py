"""Peers behind NATs in the model: who can open a connection to whom, and hole punches.

Theory of operation
-------------------
A topology's peers may sit behind a NAT (``nat = "eim"`` or ``"symmetric"``, see
:mod:`simulations.topology`). No one outside a NATed node's network can open a connection to
it, so it is a source for another node only

- over its LAN, to a node behind the same ``router``: its advert, as that node hears it, names
  a LAN URL (the real follower's :func:`shardcast.core.scoped_lane` puts it in ``http_url``);
- over a connection it dialled itself: to each of its upstreams (relays; the origin), which
  then reach its stream lane (:attr:`shardcast.core.Lane.STREAM`);
- after a hole punch: a follower that hears its advert (a stream lane, the relays it holds a
  :class:`shardcast.core.Reservations` reservation on) and holds a connection to one of those
  relays may punch (:attr:`shardcast.core.Lane.PUNCH`); a real
  :class:`shardcast.core.PunchPlanner` per node, with :class:`shardcast.core.PunchConfig`'s
  defaults, admits each punch (concurrency cap, one per PeerID, backoff, yield, punching
  ahead with its seeded generator and the model's clock). A punch lasts
  :func:`punch_s`: it succeeds when neither end is behind a symmetric NAT (DCUtR's
  simultaneous open needs a mapping that does not change per destination; a public node
  punching to an EIM node succeeds), after which the pair holds a direct connection.

Which lane a follower uses is the real :class:`shardcast.download.discovery.SourceDirectory`'s
decision (:func:`shardcast.core.choose_lane`), given the adverts :meth:`NatModel.advert` makes
and the connections :meth:`NatModel.connected` lists. Whether a holder a super-seeding refusal
named is reachable is its :meth:`~shardcast.download.discovery.SourceDirectory.holder_reach`
too, with the node's punch failures (:meth:`NatModel.punch_failed`) and a real
:class:`shardcast.download.PunchRecord` per node (:attr:`NatModel.records`).

A download-only NATed node (``serve_behind_nat = false``) advertises no URL and no stream
lane (its LAN neighbours still hear its LAN URL), and the origin's super-seeding treats it by
rule 10 (:attr:`shardcast.serve.Requester.DOWNLOAD_ONLY`, as the real ``Follower._requester_kind``).

With no NATed node in the topology, :attr:`NatModel.active` is False and the model makes no
call here that changes what it does (its adverts and results are as before).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Callable, Sequence
from typing import Any

import base58

from shardcast.core import PunchConfig, PunchPlanner, PunchTarget, Reach, Reservations
from shardcast.download import NodeAdvert, PunchRecord
from shardcast.serve import Requester
from simulations.topology import Node

PUBLIC_URL = "http://sim"  # the URL public nodes advertise (never opened: the model serves)
LAN_URL = "http://lan"  # a NATed node's LAN URL, as a node behind its router hears it
PUNCH_ATTEMPTS = 3  # DCUtR attempts before a punch fails
PUNCH_ATTEMPT_S = 5.0  # each bounded by p2p.circuits.CircuitConfig.direct_timeout_s, seconds


def peer_id_of(name: str) -> str:
    """A NATed node's PeerID-like id: ``12D3KooW`` and ``name``'s bytes in base58 (a stream
    lane is named by a base58 PeerID, :func:`p2p.bytestream.stream_lane_url`; node names
    start with a letter, so no name equals one of these)."""
    return "12D3KooW" + base58.b58encode(name.encode()).decode("ascii")


PATHS = ("origin", "relay", "public_peer", "nat_lan", "nat_dialled", "nat_punched", "other")
"""Where the bytes peers receive come from (:meth:`NatModel.count`): the origin, relays,
public peers, and NATed peers over their LAN, over a connection they dialled, or over a
hole-punched one (``other``: none of these, which the model never does)."""


def punch_s(relayed_one_way_s: float, direct_one_way_s: float, ok: bool) -> float:
    """How long a hole punch lasts, seconds: a relayed dial (one relayed round trip), DCUtR's
    CONNECT exchange (another) and SYNC (half of one), then the direct handshake (one direct
    round trip): about 2.5 relayed RTTs plus one direct RTT. A punch that fails also waits
    out :data:`PUNCH_ATTEMPTS` attempts of :data:`PUNCH_ATTEMPT_S` each.

    Args:
        relayed_one_way_s: one-way delay through the relay (downloader -> relay -> target).
        direct_one_way_s: one-way delay of the direct path.
        ok: the punch succeeds.
    """
    t = 2.5 * 2 * relayed_one_way_s + 2 * direct_one_way_s
    return t if ok else t + PUNCH_ATTEMPTS * PUNCH_ATTEMPT_S


class NatModel:
    """The NAT side of one model run (see module docstring).

    Args:
        nodes: the topology's expanded nodes (index order).
        seed: the run's seed (each node's punch generator is seeded from it and its name).
        config: the punch settings (the real node's defaults unless given).
    """

    def __init__(self, nodes: Sequence[Node], seed: int, config: PunchConfig | None = None) -> None:
        self.nodes = nodes
        self.active = any(n.natted for n in nodes)
        self.config = config or PunchConfig()
        self.pids = [peer_id_of(n.name) if n.natted else n.name for n in nodes]
        self.by_name = {n.name: n.index for n in nodes} | {p: i for i, p in enumerate(self.pids)}
        self.conns: list[set[int]] = [set() for _ in nodes]  # direct connections held
        self.punched: set[frozenset[int]] = set()
        self.planners = [PunchPlanner(self.config) for _ in nodes] if self.active else []
        self.records = [PunchRecord() for _ in nodes]  # whether a node's punches keep failing
        self.rngs = [random.Random(f"{seed}:{n.name}:punch") for n in nodes]
        self.relays: list[tuple[str, ...]] = [() for _ in nodes]
        self.punches: Counter[str] = Counter()
        self.bytes: dict[str, float] = dict.fromkeys(PATHS, 0.0)
        for n in nodes:
            for u in n.upstreams:
                self._connect(n.index, self.by_name[u])
            if n.natted and n.serve_behind_nat:
                self.relays[n.index] = self._reserve(n)

    def _connect(self, a: int, b: int) -> None:
        self.conns[a].add(b)
        self.conns[b].add(a)

    def _reserve(self, n: Node) -> tuple[str, ...]:
        """The relays ``n`` holds a reservation on (real :class:`Reservations`: its relay
        upstreams, up to ``max_relays``; relays always grant in the model)."""
        res = Reservations(self.config)
        relays = [u for u in n.upstreams if self.nodes[self.by_name[u]].role == "relay"]
        for r in res.wanted(Reach.UNREACHABLE, relays, 0.0):
            res.reserved(r)
        return res.advertised(Reach.UNREACHABLE)

    # -- what a node hears and holds -----------------------------------------------------------

    def same_lan(self, a: int, b: int) -> bool:
        """``a`` and ``b`` are behind one router."""
        ra, rb = self.nodes[a].router, self.nodes[b].router
        return bool(ra) and ra == rb and self.nodes[a].natted and self.nodes[b].natted

    def advert(
        self, src: int, listener: int, committed: tuple[int, ...], filling: tuple[int, ...]
    ) -> NodeAdvert:
        """``src``'s advert as ``listener`` hears it (a public node's URL; a NATed node's LAN
        URL behind its router, else no URL, and a stream lane and relays if it serves)."""
        n = self.nodes[src]
        role = "relay" if n.role == "relay" else "peer"
        if not n.natted:
            return NodeAdvert(n.name, role, PUBLIC_URL, committed, filling)
        url = LAN_URL if self.same_lan(src, listener) else ""
        return NodeAdvert(
            self.pids[src],
            role,
            url,
            committed,
            filling,
            stream_lane=n.serve_behind_nat,
            relays=self.relays[src],
        )

    def connected(self, node: int) -> frozenset[str]:
        """Names of the nodes ``node`` holds a direct connection to."""
        return frozenset(self.pids[i] for i in self.conns[node])

    def requester_kind(self, node: int) -> Requester:
        """What a server knows of requester ``node`` for super-seeding (its advert offers no
        lane: download-only, rule 10; else serving)."""
        n = self.nodes[node]
        if n.natted and not n.serve_behind_nat:
            return Requester.DOWNLOAD_ONLY
        return Requester.SERVING

    def left(self, node: int) -> None:
        """``node`` left: its hole-punched connections are gone (it re-dials its upstreams)."""
        for pair in [p for p in self.punched if node in p]:
            self.punched.discard(pair)
            a, b = tuple(pair)
            self.conns[a].discard(b)
            self.conns[b].discard(a)

    # -- hole punches -------------------------------------------------------------------------

    def _yields(self, node: int, peer: str) -> bool:
        """``node`` names relays too (``peer`` may punch it) and waits (greater PeerID)."""
        return bool(self.relays[node]) and self.pids[node] > peer

    def to_punch(
        self, node: int, candidates: Sequence[NodeAdvert], now: float
    ) -> list[tuple[str, str]]:
        """The punches ``node``'s planner admits now to ``candidates`` (adverts of sources
        of its download reachable only by a punch): pairs ``(peer, relay)``."""
        planner, conn = self.planners[node], self.connected(node)
        out = []
        for a in candidates:
            relay = planner.start(
                a.peer_id,
                a.relays,
                conn,
                now,
                self.rngs[node],
                yield_to_peer=self._yields(node, a.peer_id),
            )
            if relay is not None:
                out.append((a.peer_id, relay))
        self.punches["started"] += len(out)
        return out

    def to_punch_ahead(
        self, node: int, adverts: Sequence[NodeAdvert], held: int, now: float
    ) -> list[tuple[str, str]]:
        """The punches ``node``'s planner starts ahead of need
        (:meth:`shardcast.core.PunchPlanner.ahead`) among ``adverts`` (reachable only by a
        punch), ``held`` stream-lane nodes being held directly."""
        targets = [
            PunchTarget(a.peer_id, a.relays, a.newest(), self._yields(node, a.peer_id))
            for a in adverts
        ]
        out = self.planners[node].ahead(targets, self.connected(node), held, now, self.rngs[node])
        self.punches["started"] += len(out)
        self.punches["ahead"] += len(out)
        return out

    def punch_failed(self, node: int) -> Callable[[str], bool]:
        """True for a PeerID whose last punch by ``node`` failed (its planner's
        :meth:`~shardcast.core.PunchPlanner.retry_at` is set; never without NATs)."""
        if not self.active:
            return lambda _: False
        planner = self.planners[node]
        return lambda peer: planner.retry_at(peer) is not None

    def succeeds(self, a: int, b: int) -> bool:
        """A punch between ``a`` and ``b`` opens a direct connection (neither NAT symmetric)."""
        return "symmetric" not in (self.nodes[a].nat, self.nodes[b].nat)

    def punch_ended(self, node: int, peer: int, ok: bool, now: float) -> None:
        """``node``'s punch to ``peer`` ended at ``now``: direct if ``ok``."""
        self.planners[node].done(self.pids[peer], direct=ok, now=now)
        self.records[node].done(ok)
        self.punches["direct" if ok else "failed"] += 1
        if ok:
            self._connect(node, peer)
            self.punched.add(frozenset((node, peer)))

    # -- accounting ---------------------------------------------------------------------------

    def path(self, src: int, dst: int) -> str:
        """Which of :data:`PATHS` bytes from ``src`` to ``dst`` take."""
        s = self.nodes[src]
        if s.role != "peer":
            return s.role
        if not s.natted:
            return "public_peer"
        if self.same_lan(src, dst):
            return "nat_lan"
        if frozenset((src, dst)) in self.punched:
            return "nat_punched"
        if dst in self.conns[src]:
            return "nat_dialled"
        return "other"

    def count(self, src: int, dst: int, moved: float) -> None:
        """``moved`` bytes went from ``src`` to ``dst`` (counted if ``dst`` is a peer)."""
        if self.active and self.nodes[dst].role == "peer":
            self.bytes[self.path(src, dst)] += moved

    def summary(self) -> dict[str, Any]:
        """Punches by outcome, the bytes peers received by :data:`PATHS`, and the share of the
        peer-to-peer bytes that NATed peers served."""
        p2p = sum(v for k, v in self.bytes.items() if k not in ("origin", "relay"))
        nat = sum(v for k, v in self.bytes.items() if k.startswith("nat_"))
        return {
            "punches": {k: self.punches[k] for k in ("started", "ahead", "direct", "failed")},
            "bytes_to_peers": {k: round(self.bytes[k]) for k in PATHS},
            "nat_share_of_p2p": round(nat / p2p, 4) if p2p else 0.0,
        }

    def note(self) -> str:
        """One line for the report: the NATed peers' share and the punches."""
        sm = self.summary()
        p = sm["punches"]
        return (
            f"NAT: NATed peers served {sm['nat_share_of_p2p']:.1%} of the bytes peers got from "
            f"peers; punches {p['started']} started ({p['ahead']} ahead), {p['direct']} direct, "
            f"{p['failed']} failed (policies: Reservations, PunchPlanner, choose_lane)"
        )
