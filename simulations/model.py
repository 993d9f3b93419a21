"""The model: thousands of nodes in virtual time, driven by the real sans-IO policies.

Theory of operation
-------------------
SimPy's :class:`simpy.Environment` owns virtual time: publications, the topology's events,
part hashing at the origin, serve-wait timeouts, discovery rounds and rollouts are SimPy
timeouts; one SimPy process advances the :class:`~simulations.flows.FlowNetwork` (max-min
sharing of uplinks, downlinks and declared links) in steps of ``time_step_s``.

Every decision a real node makes with a sans-IO policy is made here by that same code, with the
model's clock as ``now`` and a per-node seeded ``random.Random``:

- each download is a :class:`shardcast.core.session.Session`, the object the trio
  :class:`shardcast.download.downloader.Downloader` drives (its scheduler chooses shards and
  sources,
  explores, penalizes, resumes and runs the endgame; the session keeps resumable prefixes,
  falls back from deltas, blames and bans): parts arrive as the origin hashes them (the delta
  is offered when the base is held), and transfers end ``ok`` (then checked: corrupt when an
  adversary flips its coin), ``not_available`` (503 after ``serve_wait_s``, 404 from a node
  without the version), ``refused`` (super-seeding), ``broken`` (a source left; the bytes that
  arrived are kept for resuming) or ``cancelled`` (endgame losers, banned sources); the
  model answers the session's byte comparisons from its knowledge of who corrupted what.
  The session's own abandonment is not modelled (its grace periods are infinite);
- extra sources come from a real :class:`shardcast.download.discovery.SourceDirectory` fed with
  :class:`~shardcast.download.discovery.NodeAdvert`\\ s (a node hears ``gossip_sample`` random
  adverts per
  ``advert_interval_s`` instead of all N: that keeps a round O(1) per node);
- the origin refuses repeats with :class:`shardcast.serve.superseeding.SuperSeeding`, and so
  does each relay with ``relay_serve_once_s`` (``shardnet relay``'s default; relays never
  super-seed to each other, as to siblings of one tier); a refusal names the holder, and a
  requester whose :class:`~shardcast.download.discovery.SourceDirectory` finds it unreachable
  (:meth:`~shardcast.download.discovery.SourceDirectory.holder_reach`: e.g. its punch to it
  failed) names it back on the session's next request and is served at once (rule 11);
- relays and peers serve a shard's verified prefix while it arrives (cut-through, as
  :mod:`shardcast.serve.server` streams a held request): a raw transfer into a node, once its
  first byte arrived, leads the requests for that shard served from there, each a flow that
  never gets ahead of it (:meth:`~simulations.flows.FlowNetwork.add`'s ``follows``), and the
  node's watchers learn the prefix at their next ``/have`` poll, as a real node's
  ``/have?prefix=1`` tells them; a leader that stops short (cancelled, its source gone) or
  brings bad bytes ends the requests it fed as broken, keeping what arrived. A request for a
  shard the source will receive but does not yet, or for a delta blob, waits there for it
  (up to ``serve_wait_s``). Without cut-through, a relay whose uplink is the bottleneck sent
  1.8 copies and its peers took 1.9x as long (``tests/sim/test_model.py``); emulated, a
  40 Mb/s relay and six 100 Mb/s peers (512 MiB): 135.0 s, modelled 123.9 s, 149.3 s before
  (since overdue transfers are cut: emulated 119.4 s, modelled 123.9 s).
  Nodes keep versions by
  :func:`shardcast.core.retention.versions_to_prune` with served versions and delta bases pinned,
  and catch up with :func:`shardcast.core.catchup.plan`;
- what a node follows is decided by its :class:`shardcast.core.tracker.VersionTracker`, the object
  a real node's :class:`~shardcast.download.follower.Follower` drives: an announcement heard is
  offered
  to it (taken if newer), a download starts when it says the announced version is wanted, and
  a newer announcement abandons the version being downloaded when the tracker says it is
  superseded (it cannot be the base of the newer version's delta chain; the model decides
  when it hears the announcement, with complete stand-in manifests, where a real follower
  first fetches the newer manifest from an upstream). A node retries
  :data:`RETRY_S` after an abandoned or failed download, as the follower does.

Peers behind NATs (a topology's ``nat``, ``router`` and ``serve_behind_nat``;
:mod:`simulations.nat`): a NATed node is a source only to nodes behind its router (its LAN
URL), to those it dialled (its upstreams, which reach its stream lane), and to those that
hole-punched to it. The adverts a follower hears say so (no URL, a stream lane, the relays it
holds a real :class:`shardcast.core.Reservations` reservation on), and the real
:class:`~shardcast.download.discovery.SourceDirectory` picks the lane
(:func:`shardcast.core.choose_lane`) from them and the connections the follower holds. At each
discovery round a real :class:`shardcast.core.PunchPlanner` per node (its config's concurrency,
backoff and yield rules, its seeded generator, the model's clock) admits punches to sources of
the version being downloaded and ahead of need (:meth:`~shardcast.core.PunchPlanner.ahead`); a
punch takes about 2.5 round trips through the relay and one direct, and opens a direct
connection unless either end's NAT is symmetric (then it fails after three 5 s attempts and
backs off). A download-only NATed node advertises no lane (its LAN neighbours still use it), and
the origin's super-seeding serves it without holding a shard for it (rule 10). Without a NATed
node none of this changes a run. The summary's ``nat`` section counts punches and the bytes
peers received by path (origin, relays, public peers, NATed peers over LAN, dialled and
punched connections).

What a node spends besides the network comes from one
:class:`~simulations.costs.CostModel` (the topology's ``[costs]``; defaults measured, see
:mod:`simulations.costs`): a shard whose bytes arrived is checked on one of the node's
``check_workers`` (first free, first come) and counts as verified (served onward, told to the
session) when its check ends; a version commits ``commit_s`` after the session says
:class:`~shardcast.core.session.Commit` (still serving its shards meanwhile); a peer's engine
holds it ``engine_s`` after that (``ready_s``). The origin hashes the parts of a version at the
topology's ``hash_bytes_per_s``: the whole version, or only the change
(``costs.origin_digest``). A delta version is committed as a chain or materialized
(``costs.commit``), which is what a next version costs a follower.

Not modelled: CPU shared between nodes, disk bandwidth, TCP slow start, HTTP/libp2p control
traffic, gossip delays other than one RTT, the chunk a cut-through source verifies before it
serves the first byte (1 MiB; a prefix is advertised from the leader's first byte), a broken
leader's requests following its resumed transfer (they end and resume elsewhere), a corrupt
leader's requests keeping only the prefix before its first bad chunk (they keep all they
received), a held request cut after the server's hold when its prefix stops growing; rollouts
start ``rollouts.load_s`` after a commit (not at ``ready_s``). Of NATs: reachability checks (a
NATed node knows it is unreachable from the start), reservations that fail or expire, a relay's
circuit limits, connections a NATed node dials to sources (only its upstreams count as dialled),
LAN links other than the two nodes' access links, connection reversal to a public node (a punch
with a symmetric NAT at either end fails), connections that die silently, punches ahead between
downloads (a node punches only at its discovery rounds, which run while it downloads), a punched
source joining a download before the next discovery round, and NATed relays or origins.
"""

from __future__ import annotations

import math
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, cast

import simpy

from shardcast.core import (
    MANIFEST_RETRY_MAX_S,
    Action,
    Cancel,
    Check,
    Commit,
    Compare,
    End,
    Fail,
    Fetch,
    Held,
    KeepSuspect,
    Offer,
    Outcome,
    PollHave,
    SchedulerConfig,
    Session,
    SessionConfig,
    Verdict,
    VersionTracker,
    Via,
    abandons,
    catchup,
    versions_to_prune,
)
from shardcast.download import HolderReach, SourceDirectory
from shardcast.serve import SUPER_SEED_MIN_BYTES, Requester, SuperSeeding
from shardcast.wire import RAW, XOR_ZSTD, Manifest
from simulations.costs import GB, CostModel
from simulations.flows import FlowNetwork
from simulations.nat import NatModel, punch_s
from simulations.progress import SimProgress, Snapshot
from simulations.summary import finish, progress_bands
from simulations.topology import Node, Topology
from simulations.versions import SimVersion, announcement_stub, manifest_stub

UNREACHABLE_S = 1.0  # time to notice a departed source (connect failure), seconds
MSS = 1448.0  # TCP payload bytes per segment, for the Mathis loss bound
RETRY_S = 1.0  # wait after an abandoned or failed download (the follower's poll_interval_s), s
HAVE_POLL_S = 0.25  # watchers learn a partial source's new shards this often (the downloader's
# ``have_poll_s``): new shards are batched per source and delivered at the next poll


@dataclass
class _Flight:
    req: Fetch
    src: int
    fid: int | None = None
    waiting: bool = False
    done: bool = False
    reported: int = 0  # bytes told to the session (Session.progress)


@dataclass
class _Download:
    node: int
    ver: SimVersion
    session: Session
    use_base: bool
    started: float
    flights: dict[int, _Flight] = field(default_factory=dict)
    sources: set[int] = field(default_factory=set)
    corrupt: dict[int, str] = field(default_factory=dict)  # req -> the adversary that sent it
    bad_copies: dict[int, set[str]] = field(default_factory=dict)  # kept copy -> who corrupted
    known_parts: int = 0
    pump_due: bool = False
    alive: bool = True
    committing: bool = False  # the session said Commit; the commit takes costs.commit_s
    arrived: set[int] = field(default_factory=set)  # shards whose raw bytes all arrived

    @property
    def delta(self) -> bool:
        """The version arrives as delta blobs applied to the held base."""
        return self.use_base and self.ver.base is not None and self.ver.delta_ratio < 1


@dataclass
class _NodeState:
    spec: Node
    rng: random.Random
    tracker: VersionTracker
    alive: bool = True
    committed: list[int] = field(default_factory=list)
    have: dict[int, set[int]] = field(default_factory=dict)  # step -> verified shards (filling)
    download: _Download | None = None
    plan: list[int] = field(default_factory=list)
    waiters: dict[tuple[int, int], list[Any]] = field(default_factory=dict)
    # (step, shard) -> (flow id, start byte) of the raw transfer bringing it in (cut-through)
    filling: dict[tuple[int, int], tuple[int, int]] = field(default_factory=dict)
    watchers: dict[int, list[_Download]] = field(default_factory=dict)
    unpolled: dict[int, list[int]] = field(default_factory=dict)  # step -> shards since poll
    poll_due: bool = False
    serving: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    out: dict[int, tuple[_Download, int]] = field(default_factory=dict)  # fid -> (dl, req id)
    directory: SourceDirectory | None = None
    bytes_up: float = 0.0
    bytes_down: float = 0.0
    records: dict[int, dict[str, Any]] = field(default_factory=dict)
    generating: bool = False
    done_step: int = -1
    cpu_free: list[float] = field(default_factory=list)  # per check worker: free from, s


@dataclass(frozen=True)
class _Held:
    """A node's committed steps (ascending) as a tracker reads them
    (:class:`shardcast.core.tracker.Held`)."""

    committed: list[int]
    versions: dict[int, SimVersion]

    def latest(self) -> int | None:
        return self.committed[-1] if self.committed else None

    def digest_of(self, step: int) -> str | None:
        return self.versions[step].digest if step in self.committed else None


class Model:
    """One model run of a topology (see module docstring).

    Args:
        topo: the topology.
        seed: overrides the topology's seed.
        until_s: stop the virtual clock here, seconds (default: generous bound).
    """

    def __init__(self, topo: Topology, seed: int | None = None, until_s: float | None = None):
        self.topo = topo
        self.spec = topo.spec
        ms = self.spec.model
        self.seed = topo.spec.seed if seed is None else seed
        self.env = simpy.Environment()
        ck = self.spec.checkpoint
        n_nodes = len(topo.nodes)
        caps = [n.up_bps for n in topo.nodes] + [n.down_bps for n in topo.nodes]
        self._link_res: dict[tuple[int, int], int] = {}
        self._link_extra: dict[tuple[int, int], tuple[float, float]] = {}
        for ln in topo.links:
            key = (min(ln.a, ln.b), max(ln.a, ln.b))
            if ln.bandwidth_bps is not None:
                self._link_res[key] = len(caps)
                caps.append(ln.bandwidth_bps)
            self._link_extra[key] = (ln.latency_s, ln.loss)
        self.net = FlowNetwork(caps)
        self.sched_cfg = SchedulerConfig(
            max_inflight=ms.max_inflight, per_source_inflight=ms.per_source_inflight
        )
        self.costs: CostModel = self.spec.costs.cost_model()
        self.delta_ratio = self.spec.delta_ratio
        self.nodes = [
            _NodeState(
                n,
                random.Random(f"{self.seed}:{n.name}"),
                VersionTracker(self.spec.name),
                cpu_free=[0.0] * self.costs.check_workers,
            )
            for n in topo.nodes
        ]
        for ev in topo.events:  # a node whose first event is a join starts offline
            first = next(e for e in topo.events if e.node == ev.node)
            self.nodes[ev.node].alive = first.action != "join"
        self.by_name = {n.name: n.index for n in topo.nodes}
        self.origin = topo.origin.index
        self.seeding = SuperSeeding(  # the origin's, as ShardcastNode gives it (rule 13 on)
            ms.serve_once_s, small_version_bytes=SUPER_SEED_MIN_BYTES, first_copies_first=True
        )
        self.seedings = {self.origin: self.seeding}  # node -> its super-seeding, if any
        if ms.relay_serve_once_s > 0:
            for n in topo.nodes:
                if n.role == "relay":
                    self.seedings[n.index] = SuperSeeding(
                        ms.relay_serve_once_s, small_version_bytes=SUPER_SEED_MIN_BYTES
                    )
        self.nat = NatModel(topo.nodes, self.seed)
        self.pid = self.nat.pids  # the id a node goes by as a source (its name if public)
        self.by_name.update({p: i for i, p in enumerate(self.pid)})
        self.versions: dict[int, SimVersion] = {}
        self.board: dict[int, list[int]] = defaultdict(list)  # step -> nodes holding/filling
        self._followers: dict[int, list[tuple[_Download, _Flight]]] = {}  # leader fid -> served
        self.rollouts = {"sent": 0, "accepted": 0, "rejected": 0}
        followers = [n for n in topo.nodes if n.role != "origin"]
        slowest = min(n.down_bps for n in followers) if followers else 1e9
        self._share_bps = slowest / ms.max_inflight  # one transfer's share of the slowest link
        self.dt = ms.time_step_s or self._auto_step(ck.shard_size_bytes)
        total = ck.size_bytes * max(1, n_nodes) / max(1.0, sum(n.up_bps for n in topo.nodes))
        self.until_s = until_s or (
            ck.versions * ck.interval_s + 50 * total + 20 * ck.size_bytes / slowest + 600
        )
        self._wake: simpy.Event | None = None
        self._n_shards = math.ceil(ck.size_bytes / ck.shard_size_bytes)
        self.wall_s = 0.0

    # -- helpers ------------------------------------------------------------------------------

    def _path(self, a: int, b: int) -> tuple[float, float, tuple[int, ...]]:
        """(one-way delay s, loss, resources) of the path a -> b."""
        na, nb = self.topo.nodes[a], self.topo.nodes[b]
        key = (min(a, b), max(a, b))
        lat, loss = self._link_extra.get(key, (0.0, 0.0))
        delay = na.latency_s + nb.latency_s + lat
        p = 1 - (1 - na.loss) * (1 - nb.loss) * (1 - loss)
        res = (a, len(self.nodes) + b) + ((self._link_res[key],) if key in self._link_res else ())
        return delay, p, res

    def _flow_cap(self, rtt: float, loss: float) -> float:
        cap = math.inf
        if loss > 0 and rtt > 0:
            cap = MSS / rtt * math.sqrt(1.5 / loss)  # Mathis et al. 1997
        w = self.spec.model.window_bytes
        if w is not None and rtt > 0:
            cap = min(cap, w / rtt)
        return cap

    def _at(self, t: float, fn: Any, *args: Any) -> None:
        ev = self.env.timeout(max(0.0, t - self.env.now))
        ev.callbacks.append(lambda _e: fn(*args))

    def _add_flow(
        self,
        src: int,
        dst: int,
        size: float,
        start: float,
        done: Any,
        first: Any,
        follows: tuple[int, float] | None = None,
    ) -> int:
        """A flow ``src -> dst``; ``follows``: (leader flow id, slack bytes) when ``src``
        serves a prefix it is still receiving (:meth:`FlowNetwork.add`)."""
        delay, loss, res = self._path(src, dst)
        lead, slack = follows if follows is not None else (None, 0.0)
        cap = self._flow_cap(2 * delay, loss)
        fid = self.net.add(res, size, start, done, first, cap, follows=lead, slack=slack)
        if self._wake is not None and not self._wake.triggered:
            self._wake.succeed()
        return fid

    def _record(self, node: int, step: int) -> dict[str, Any]:
        return self.nodes[node].records.setdefault(
            step,
            {"learned_s": None, "first_byte_s": None, "commit_s": None, "shards_s": [], "acc": 0},
        )

    # -- network process ---------------------------------------------------------------------

    def _auto_step(self, size_bytes: float) -> float:
        """A flow-model step about 1/100 of a ``size_bytes`` transfer's time at its share of
        the slowest downlink, within [2 ms, 250 ms]."""
        return min(0.25, max(0.002, size_bytes / self._share_bps / 100))

    def _network(self) -> Any:
        """Advance the flows; without a topology's ``time_step_s`` the step follows the
        smallest flow in the network (a delta's blobs are ~100x smaller than shards: at the
        shards' step each of its transfers would last at least a step)."""
        fixed = self.spec.model.time_step_s is not None
        while True:
            if self.net.idle():
                self._wake = self.env.event()
                yield self._wake
                self._wake = None
                continue
            dt = self.dt if fixed else min(self.dt, self._auto_step(self.net.smallest_size()))
            yield self.env.timeout(dt)
            self.net.advance(self.env.now - dt, dt)

    # -- publication --------------------------------------------------------------------------

    def _publish(self, step: int) -> None:
        ck = self.spec.checkpoint
        now = self.env.now
        base = None if step % ck.anchor_every == 0 or self.delta_ratio >= 1 else step - 1
        ver = SimVersion.make(self.spec.name, step, ck, base, now, self.delta_ratio)
        self.versions[step] = ver
        o = self.nodes[self.origin]
        o.have[step] = set()
        self._record(self.origin, step)["learned_s"] = now
        part_bytes = ck.shards_per_part * ck.shard_size_bytes
        hashed = self.costs.origin_hash_bytes(
            ck.size_bytes, ck.size_bytes * ver.delta_ratio, base is not None
        )
        for k in range(ver.n_parts):
            done = min((k + 1) * part_bytes, ck.size_bytes) / ck.size_bytes
            t = now + done * hashed / ck.hash_bytes_per_s
            ver.part_time.append(t)
            self._at(t, self._part_hashed, step, k)
        for n in self.nodes:
            if n.spec.role != "origin" and n.alive:
                delay, _, _ = self._path(n.spec.index, self.origin)
                self._at(now + 2 * delay, self._learn, n.spec.index, step)

    def _part_hashed(self, step: int, k: int) -> None:
        ver = self.versions[step]
        o = self.nodes[self.origin]
        for i in ver.part_range(k):
            o.have[step].add(i)
            self._shard_ready(self.origin, step, i)
        for dl in list(ver.listeners):
            self._part_known(dl, k)
        if k == ver.n_parts - 1:
            o.committed.append(step)
            del o.have[step]
            self._record(self.origin, step)["commit_s"] = self.env.now
            self._prune(self.origin)

    # -- learning and planning ----------------------------------------------------------------

    def _learn(self, node: int, step: int) -> None:
        """``node`` hears the trainer's announcement of ``step`` (through gossip)."""
        n = self.nodes[node]
        if not n.alive:
            return
        ann = announcement_stub(self.versions[step])
        if not n.tracker.offer(ann, Via.GOSSIP, self.env.now, self.topo.origin.name).taken:
            return
        rec = self._record(node, step)
        if rec["learned_s"] is None:
            rec["learned_s"] = self.env.now
        self._abandon_superseded(node)
        self._maybe_start(node)

    def _abandon_superseded(self, node: int) -> None:
        """Abandon ``node``'s download if the newest announcement superseded it and it cannot
        be the base of that version's delta chain (the follower's ``_watch_superseded``)."""
        n = self.nodes[node]
        dl, ann = n.download, n.tracker.announcement
        if dl is None or dl.committing or ann is None or not n.tracker.superseded(dl.ver.step):
            return
        step = dl.ver.step
        chain = {s: self._stub(s) for s in range(max(step + 1, ann.step - 32), ann.step)}
        if abandons(step, dl.ver.digest, self._stub(ann.step), chain) is None:
            return
        self._drop_download(dl)
        n.plan = []
        self._at(self.env.now + RETRY_S, self._maybe_start, node)

    def _maybe_start(self, node: int) -> None:
        n = self.nodes[node]
        if not n.alive or n.download is not None:
            return
        latest = n.committed[-1] if n.committed else None
        if not n.plan:
            ann = n.tracker.announcement
            if ann is None or not n.tracker.wanted(self._held(node)).fetch:
                return
            n.plan = list(self._plan(latest, ann.step))
        step = n.plan[0]
        ups = [u for u in (self.by_name[x] for x in n.spec.upstreams) if self._knows(u, step)]
        if not ups:  # the manifest is not upstream yet: retry at fetch_manifest's capped wait
            self._at(self.env.now + MANIFEST_RETRY_MAX_S, self._maybe_start, node)
            return
        delay, _, _ = self._path(node, ups[0])
        self._start_download(node, step, self.env.now + 2 * delay)

    def _plan(self, have: int | None, target: int) -> tuple[int, ...]:
        """The real catch-up planner over stand-in manifests of the published versions."""
        if have is None or have >= target - 1:
            return (target,)
        chain = {s: self._stub(s) for s in range(have + 1, target)}
        p = catchup.plan(have, self.versions[have].digest, self._stub(target), chain)
        return p.steps

    def _stub(self, step: int) -> Manifest:
        """A stand-in manifest of published version ``step`` (complete)."""
        v = self.versions[step]
        base = None if v.base is None else self.versions[v.base].digest
        return cast(Manifest, manifest_stub(v, base))

    def _held(self, node: int) -> Held:
        """``node``'s committed versions as its tracker asks about them."""
        return _Held(self.nodes[node].committed, self.versions)

    def _knows(self, node: int, step: int) -> bool:
        n = self.nodes[node]
        return n.alive and (step in n.committed or step in n.have)

    # -- downloads ----------------------------------------------------------------------------

    def _start_download(self, node: int, step: int, at: float) -> None:
        n = self.nodes[node]
        ver = self.versions[step]
        use_base = ver.base is not None and ver.base in n.committed
        ms = self.spec.model
        cfg = SessionConfig(
            self.sched_cfg,
            use_base=use_base,
            max_extra_sources=ms.max_extra_sources,
            no_source_grace_s=math.inf,
            gone_grace_s=math.inf,
            no_progress_s=math.inf,
        )
        session = Session(step, ver.lengths, ver.n_parts, (), (), (), n.rng, cfg, self.env.now)
        dl = _Download(node, ver, session, use_base, at)
        n.download = dl
        n.have[step] = set()
        self.board[step].append(node)
        ver.listeners.append(dl)
        for u in n.spec.upstreams:
            ui = self.by_name[u]
            if self.nodes[ui].alive:
                dl.session.add_source(u, True, self.env.now)
                dl.sources.add(ui)
        if n.directory is None and self.spec.model.discovery:
            ms = self.spec.model
            n.directory = SourceDirectory(
                self.pid[node],
                set(n.spec.upstreams),
                5 * ms.advert_interval_s,
                5 * ms.gossip_sample,
                n.rng,
            )
        for k, t in enumerate(ver.part_time):
            if t <= self.env.now:
                self._part_known(dl, k)
        if self.spec.model.discovery and self.spec.model.max_extra_sources:
            self._at(at, self._discover, dl)
        self._at(at, self._pump, dl)

    def _part_known(self, dl: _Download, k: int) -> None:
        if not dl.alive or k < dl.known_parts:
            return
        ver = dl.ver
        delta = ver.base is not None and ver.delta_ratio < 1
        for kk in range(dl.known_parts, k + 1):
            offers = [
                Offer(i, ver.lengths[i], {XOR_ZSTD: ver.enc_len(i, True)} if delta else {})
                for i in ver.part_range(kk)
            ]
            dl.session.part_arrived(kk, offers, self.env.now)
        dl.known_parts = k + 1
        self._pump(dl)

    def _discover(self, dl: _Download) -> None:
        if not dl.alive:
            return
        n = self.nodes[dl.node]
        ms = self.spec.model
        step = dl.ver.step
        cands = [c for c in self.board[step] if c != dl.node and self.nodes[c].alive]
        now = self.env.now
        assert n.directory is not None
        for c in n.rng.sample(cands, min(len(cands), ms.gossip_sample)):
            cn = self.nodes[c]
            filling = (step,) if step in cn.have else ()
            n.directory.offer(self.nat.advert(c, dl.node, tuple(cn.committed[-16:]), filling), now)
        conn = self.nat.connected(dl.node)
        room = dl.session.extra_room()  # the session's bound on discovered sources
        found = (  # only with room: sources_for draws from the node's generator
            n.directory.sources_for(step, now, ms.max_extra_sources, connected=conn)
            if room > 0
            else []
        )
        for src in found:
            si = self.by_name[src.id]
            if si in dl.sources or room <= 0:
                continue
            room -= 1
            dl.sources.add(si)
            self._apply(dl, dl.session.add_source(src.id, src.complete, now, extra=True))
        if self.nat.active:
            self._start_punches(dl, conn)
        self._pump(dl)
        self._at(now + ms.advert_interval_s, self._discover, dl)

    def _start_punches(self, dl: _Download, conn: frozenset[str]) -> None:
        """The hole punches ``dl``'s node starts now (:mod:`simulations.nat`): ahead of need
        on the adverts it just heard, then to sources of its version reachable only by a
        punch (the follower's ``_punch_ahead`` and ``_start_punches``, run here at each
        discovery round)."""
        node, now = dl.node, self.env.now
        directory = self.nodes[node].directory
        assert directory is not None
        ahead, held = directory.punch_ahead(now, connected=conn)  # on the adverts just heard
        pairs = self.nat.to_punch_ahead(node, ahead, held, now)
        cands = directory.punch_candidates(dl.ver.step, now, connected=conn)
        pairs += self.nat.to_punch(node, cands, now)
        for peer, relay in pairs:
            pi, ri = self.by_name[peer], self.by_name[relay]
            ok = self.nat.succeeds(node, pi)
            relayed = self._path(node, ri)[0] + self._path(ri, pi)[0]
            end = now + punch_s(relayed, self._path(node, pi)[0], ok)
            self._at(end, self._punch_ended, node, pi, ok)

    def _punch_ended(self, node: int, peer: int, ok: bool) -> None:
        """``node``'s punch to ``peer`` ended: direct if ``ok`` and both are still up (the
        next discovery round offers ``peer``'s stream lane)."""
        alive = self.nodes[node].alive and self.nodes[peer].alive
        self.nat.punch_ended(node, peer, ok and alive, self.env.now)

    def _apply(
        self, dl: _Download, actions: list[Action] | list[Action | End], t: float | None = None
    ) -> None:
        """Do what the session decided (the model's stand-in for the trio driver); ``t``: the
        time of the event that led to it (a flow's exact end), if not now."""
        now = self.env.now
        for a in actions:
            if isinstance(a, Fetch):
                self._request(dl, a, now)
            elif isinstance(a, Cancel):  # an endgame loser, a ban's, or an overdue transfer
                loser = dl.flights.pop(a.req, None)
                moved = 0.0
                if loser is not None:
                    if loser.fid is not None:
                        self._end_leader(dl, loser)  # what it fed resumes elsewhere
                        moved = self.net.cancel(loser.fid)
                        self._account(dl, loser, moved)
                    loser.done = True
                ended = dl.session.transfer_ended(a.req, Outcome.CANCELLED, int(moved), now)
                self._apply(dl, ended)
            elif isinstance(a, KeepSuspect):
                bad = dl.corrupt.get(a.req)
                dl.bad_copies[a.copy] = {bad} if bad is not None else set()
            elif isinstance(a, Compare):
                culprits = dl.bad_copies.pop(a.copy, set())
                self._apply(dl, dl.session.compared(a.copy, a.shard, culprits, now))
            elif isinstance(a, PollHave):  # a partial source: its have-set, then its polls
                si = self.by_name[a.source]
                sn, step = self.nodes[si], dl.ver.step
                dl.session.have_changed(
                    a.source, sn.have.get(step, ()), now, self._prefixes(si, step)
                )
                sn.watchers.setdefault(step, []).append(dl)
            elif isinstance(a, Commit):
                at = now if t is None else t
                commit_s = self.costs.commit_s(dl.ver.total_bytes, dl.delta)
                if commit_s <= 0:
                    self._commit(dl, at)
                else:  # the session is done: no more pumps; its shards are still served
                    dl.alive = False
                    dl.committing = True
                    self._at(at + commit_s, self._commit, dl, at + commit_s)
            elif isinstance(a, Fail):  # not with infinite grace periods; start over if so
                self._drop_download(dl)
                self._at(now + RETRY_S, self._maybe_start, dl.node)
            # Keep, Drop, Check, Blame, Ban, Probe: no bytes or bans to keep in the model

    def _pump(self, dl: _Download, t: float | None = None) -> None:
        if not dl.alive or self.env.now < dl.started:
            return
        now = self.env.now
        for fl in dl.flights.values():  # what the driver reports per piece (overdue rule)
            if fl.fid is not None and not fl.done:
                moved = int(self.net.moved(fl.fid))
                if moved > fl.reported:
                    fl.reported = moved
                    dl.session.progress(now, fl.req.req, moved)
        self._apply(dl, dl.session.poll(now), t)
        if not dl.alive:
            return
        if not dl.flights and not dl.session.finished:  # blocked sources: retry like the driver
            if not dl.pump_due:
                dl.pump_due = True
                self._at(now + self.sched_cfg.penalty_s / 4, self._repump, dl)

    def _repump(self, dl: _Download) -> None:
        dl.pump_due = False
        self._pump(dl)

    def _request(self, dl: _Download, req: Fetch, now: float) -> None:
        si = self.by_name[req.source]
        src = self.nodes[si]
        fl = _Flight(req, si)
        dl.flights[req.req] = fl
        delay, _, _ = self._path(si, dl.node)
        step, i = dl.ver.step, req.shard
        if not src.alive:
            self._at(now + UNREACHABLE_S, self._fail, dl, fl, Outcome.BROKEN)
        elif step in src.committed or i in src.have.get(step, ()) or self._leader(si, step, fl):
            self._serve(dl, fl, now + 2 * delay)
        elif step in src.have:  # filling: the request waits there (pipelining)
            fl.waiting = True
            src.waiters.setdefault((step, i), []).append((dl, fl))
            self._at(now + self.spec.model.serve_wait_s, self._wait_expired, dl, fl)
        else:
            self._at(now + 2 * delay, self._fail, dl, fl, Outcome.NOT_AVAILABLE)

    def _serve(self, dl: _Download, fl: _Flight, start: float) -> None:
        if fl.done or not dl.alive:
            return
        fl.waiting = False
        step = dl.ver.step
        seeding = self.seedings.get(fl.src)
        if seeding is not None:
            decision = seeding.decide(
                self.pid[dl.node],
                step,
                (fl.req.shard,),
                self.env.now,
                self._n_shards,
                kind=self._requester_kind(fl.src, dl.node),
                unreachable=fl.req.unreachable,
                version_bytes=dl.ver.offered_bytes,
            )
            if not decision.allowed:
                unreached = self._unreachable(dl.node, decision.holders)
                self._at(start, self._fail, dl, fl, Outcome.REFUSED, 0, unreached)
                return
        src = self.nodes[fl.src]
        src.serving[step] += 1
        lead = self._leader(fl.src, step, fl)
        fl.fid = self._add_flow(
            fl.src,
            dl.node,
            fl.req.length,
            start,
            lambda fid, t: self._complete(dl, fl, t),
            lambda fid, t: self._first_byte(dl, fl, t),
            (lead[0], lead[1] - fl.req.start) if lead is not None else None,
        )
        src.out[fl.fid] = (dl, fl.req.req)
        if lead is not None:
            self._followers.setdefault(lead[0], []).append((dl, fl))
        if not math.isinf(self.sched_cfg.overdue_factor):
            self._at(start + self.sched_cfg.overdue_min_s, self._judge, dl, fl)

    def _judge(self, dl: _Download, fl: _Flight) -> None:
        """While ``fl`` runs, poll its session every ``overdue_min_s``, so a slow transfer is
        judged overdue without waiting for another event of its download (the driver's loop
        polls every quarter of that, :meth:`~shardcast.core.session.Session.next_wake`: the
        model's coarser tick cuts at most ``overdue_min_s`` later and keeps it fast)."""
        if fl.done or not dl.alive:
            return
        self._pump(dl)
        if not fl.done:
            self._at(self.env.now + self.sched_cfg.overdue_min_s, self._judge, dl, fl)

    def _leader(self, src: int, step: int, fl: _Flight) -> tuple[int, int] | None:
        """(flow id, start byte) of the raw transfer bringing ``fl``'s shard into ``src``, if
        ``src`` is receiving it and ``fl`` asks for raw bytes: ``src`` serves the verified
        prefix as it grows (cut-through, as :mod:`shardcast.serve.server` does)."""
        if fl.req.encoding != RAW:
            return None
        return self.nodes[src].filling.get((step, fl.req.shard))

    def _requester_kind(self, server: int, node: int) -> Requester:
        """What super-seeding ``server`` knows of requester ``node``: relays are siblings of
        each other (the model has one relay tier), else :meth:`NatModel.requester_kind`."""
        relays = self.topo.nodes[server].role == self.topo.nodes[node].role == "relay"
        return Requester.SIBLING if relays else self.nat.requester_kind(node)

    def _unreachable(self, node: int, holders: tuple[str, ...]) -> tuple[str, ...]:
        """Of the ``holders`` a refusal named, those ``node`` cannot reach (the follower's
        ``_unreachable_holders``: its directory's
        :meth:`~shardcast.download.discovery.SourceDirectory.holder_reach`, with its
        connections, its punch planner's failures and its
        :class:`~shardcast.download.PunchRecord`)."""
        directory = self.nodes[node].directory
        if directory is None or not holders:
            return ()
        conn, now = self.nat.connected(node), self.env.now
        failed, failing = self.nat.punch_failed(node), self.nat.records[node].failing()
        return tuple(
            h
            for h in holders
            if directory.holder_reach(
                h, now, connected=conn, punch_failed=failed, punching_fails=failing
            )
            is HolderReach.UNREACHABLE
        )

    def _wait_expired(self, dl: _Download, fl: _Flight) -> None:
        if fl.waiting and not fl.done:
            self._fail(dl, fl, Outcome.NOT_AVAILABLE)

    def _first_byte(self, dl: _Download, fl: _Flight, t: float) -> None:
        if dl.alive:
            dl.session.first_byte(fl.req.req, t)
            if fl.req.encoding == RAW:  # after the flow network's step (it calls us mid-step)
                self._at(self.env.now, self._filling_started, dl, fl)
        rec = self._record(dl.node, dl.ver.step)
        if rec["first_byte_s"] is None:
            rec["first_byte_s"] = t

    def _filling_started(self, dl: _Download, fl: _Flight) -> None:
        """``fl``'s raw bytes started arriving at ``dl``'s node: the node serves the shard's
        verified prefix from now on (to the requests waiting for it, and to its watchers,
        which learn the prefix at their next poll)."""
        n, step, i = self.nodes[dl.node], dl.ver.step, fl.req.shard
        key = (step, i)
        if (
            fl.done
            or fl.fid is None
            or not dl.alive
            or key in n.filling
            or i in n.have.get(step, ())
            or i in dl.arrived  # being checked: an endgame duplicate leads nothing
        ):
            return
        n.filling[key] = (fl.fid, fl.req.start)
        waiting = n.waiters.pop(key, [])
        for wdl, wfl in waiting:
            if wfl.req.encoding == RAW:
                self._serve(wdl, wfl, self.env.now + 2 * self._path(dl.node, wdl.node)[0])
        if rest := [(w, f) for w, f in waiting if f.req.encoding != RAW]:
            n.waiters[key] = rest
        self._poll_soon(dl.node, step)

    def _end_leader(self, dl: _Download, fl: _Flight) -> None:
        """``fl``'s flow ended without its whole shard (cancelled, its source gone) or with
        bad bytes, which a node never serves (it verifies each chunk first): if it led the
        shard into ``dl``'s node, the requests it was feeding follow an endgame duplicate
        still under way, or end broken, keeping what arrived (the session resumes them
        elsewhere). A shard that arrived whole is :meth:`_arrived`."""
        n, key = self.nodes[dl.node], (dl.ver.step, fl.req.shard)
        if fl.fid is None or n.filling.get(key, (None, 0))[0] != fl.fid:
            return
        del n.filling[key]
        fed = [(fdl, ffl) for fdl, ffl in self._followers.pop(fl.fid, []) if not ffl.done]
        other = self._other_leader(dl, fl) if dl.alive else None
        if other is not None:
            # an endgame duplicate still brings the shard in: the node's verified prefix
            # keeps growing through it, and so do the responses that followed this one
            n.filling[key] = other
            stuck = []  # those the duplicate itself waits for (a cycle): cut, as below
            for fdl, ffl in fed:
                slack = other[1] - ffl.req.start
                if ffl.fid is not None and self.net.refollow(ffl.fid, other[0], slack):
                    self._followers.setdefault(other[0], []).append((fdl, ffl))
                else:
                    stuck.append((fdl, ffl))
            fed = stuck
        for fdl, ffl in fed:
            if ffl.fid is not None:
                moved = self.net.cancel(ffl.fid)
                self._account(fdl, ffl, moved)
                self._fail(fdl, ffl, Outcome.BROKEN, int(moved))

    def _other_leader(self, dl: _Download, fl: _Flight) -> tuple[int, int] | None:
        """(flow id, start byte) of another raw transfer of ``fl``'s shard into ``dl``'s
        node (an endgame duplicate), if one is under way."""
        for o in dl.flights.values():
            same = o is not fl and o.req.shard == fl.req.shard and o.req.encoding == RAW
            if same and o.fid is not None and not o.done:
                return o.fid, o.req.start
        return None

    def _arrived(self, dl: _Download, fl: _Flight) -> None:
        """``fl`` brought its whole shard into ``dl``'s node: the responses that followed it,
        or another transfer of it (an endgame duplicate, about to be cancelled), may finish."""
        n, key = self.nodes[dl.node], (dl.ver.step, fl.req.shard)
        dl.arrived.add(fl.req.shard)
        lead = n.filling.pop(key, None)
        if lead is None:
            return
        for _, ffl in self._followers.pop(lead[0], []):
            if not ffl.done and ffl.fid is not None:
                self.net.refollow(ffl.fid, None)

    def _prefixes(self, node: int, step: int) -> dict[int, int]:
        """The verified prefix (bytes, > 0) of each shard of ``step`` that ``node`` is
        receiving raw, as its ``/have?prefix=1`` reports them."""
        return {
            i: max(1, start + int(self.net.moved(fid)))
            for (s, i), (fid, start) in self.nodes[node].filling.items()
            if s == step
        }

    def _fail(
        self,
        dl: _Download,
        fl: _Flight,
        outcome: Outcome,
        received: int = 0,
        unreachable: tuple[str, ...] = (),
    ) -> None:
        if fl.done:
            return
        fl.done = True
        dl.flights.pop(fl.req.req, None)
        if dl.alive:
            now = self.env.now
            ended = dl.session.transfer_ended(
                fl.req.req, outcome, received, now, unreachable=unreachable
            )
            self._apply(dl, ended)
            self._pump(dl)

    def _complete(self, dl: _Download, fl: _Flight, t: float) -> None:
        if fl.done:
            return
        fl.done = True
        dl.flights.pop(fl.req.req, None)
        if not dl.alive:
            self._account(dl, fl, float(fl.req.length))
            return
        req, i = fl.req, fl.req.shard
        src = self.nodes[fl.src]
        corrupt = src.spec.behavior == "corrupt" and src.rng.random() < src.spec.corrupt_fraction
        if corrupt:
            self._end_leader(dl, fl)
        else:
            self._arrived(dl, fl)
        self._account(dl, fl, float(fl.req.length))
        if corrupt:
            dl.corrupt[req.req] = self.pid[fl.src]
        actions = dl.session.transfer_ended(req.req, Outcome.OK, req.length, t)
        self._apply(dl, actions)
        if not any(isinstance(a, Check) for a in actions):
            dl.corrupt.pop(req.req, None)
            self._pump(dl, t)
            return
        check_s = self.costs.check_s(req.size, dl.ver.lengths[i], req.encoding != RAW)
        if check_s <= 0:
            self._checked(dl, req, corrupt, t)
            return
        end = self._cpu(dl.node, t, check_s)
        self._at(end, self._checked, dl, req, corrupt, end)
        self._pump(dl, t)

    def _cpu(self, node: int, ready: float, work_s: float) -> float:
        """Run ``work_s`` seconds of work on ``node``'s first free check worker from ``ready``
        on; returns when it ends, seconds."""
        free = self.nodes[node].cpu_free
        k = min(range(len(free)), key=free.__getitem__)
        free[k] = max(ready, free[k]) + work_s
        return free[k]

    def _checked(self, dl: _Download, req: Fetch, corrupt: bool, t: float) -> None:
        """The check of ``req``'s bytes ended at ``t``: tell the session its verdict."""
        if not dl.alive:
            dl.corrupt.pop(req.req, None)
            return
        verdict = Verdict.CORRUPT if corrupt else Verdict.VERIFIED
        self._apply(dl, dl.session.shard_checked(req.req, verdict, t), t)
        dl.corrupt.pop(req.req, None)
        i = req.shard
        if not corrupt and dl.alive and i not in self.nodes[dl.node].have[dl.ver.step]:
            self._shard_verified(dl, i, t)
        self._pump(dl, t)

    def _shard_verified(self, dl: _Download, i: int, t: float) -> None:
        n = self.nodes[dl.node]
        n.have[dl.ver.step].add(i)
        rec = self._record(dl.node, dl.ver.step)
        rec["shards_s"].append(t)
        rec["acc"] ^= dl.ver.tokens[i]
        self._shard_ready(dl.node, dl.ver.step, i)

    def _account(self, dl: _Download, fl: _Flight, moved: float) -> None:
        if fl.fid is None:
            return
        self._end_leader(dl, fl)  # a no-op after a complete transfer (_complete)
        src = self.nodes[fl.src]
        src.out.pop(fl.fid, None)
        src.serving[dl.ver.step] -= 1
        src.bytes_up += moved
        self.nodes[dl.node].bytes_down += moved
        self.nat.count(fl.src, dl.node, moved)

    def _shard_ready(self, node: int, step: int, i: int) -> None:
        n = self.nodes[node]
        for dl, fl in n.waiters.pop((step, i), ()):
            self._serve(dl, fl, self.env.now + 2 * self._path(node, dl.node)[0])
        self._poll_soon(node, step, i)

    def _poll_soon(self, node: int, step: int, shard: int | None = None) -> None:
        """``node``'s have-set of ``step`` gained ``shard`` (None: a prefix began): its
        watchers learn it at their next poll, :data:`HAVE_POLL_S` from now at the latest."""
        n = self.nodes[node]
        if n.watchers.get(step):
            news = n.unpolled.setdefault(step, [])
            if shard is not None:
                news.append(shard)
            if not n.poll_due:
                n.poll_due = True
                self._at(self.env.now + HAVE_POLL_S, self._have_poll, node)

    def _have_poll(self, node: int) -> None:
        """Watchers of ``node`` poll its have-bitmap: they learn the shards it verified since."""
        n = self.nodes[node]
        n.poll_due = False
        unpolled, n.unpolled = n.unpolled, {}
        for step, shards in unpolled.items():
            prefixes = self._prefixes(node, step)
            for w in n.watchers.get(step, ()):
                if w.alive:
                    w.session.have_changed(self.pid[node], shards, self.env.now, prefixes)
                    self._pump(w)

    def _commit(self, dl: _Download, t: float) -> None:
        n = self.nodes[dl.node]
        if n.download is not dl:  # dropped while committing (its node left)
            return
        step = dl.ver.step
        dl.alive = False
        dl.ver.listeners.remove(dl)
        n.download = None
        n.committed.append(step)
        n.committed.sort()
        del n.have[step]
        for w in n.watchers.pop(step, ()):
            if w.alive:
                w.session.have_changed(self.pid[dl.node], None, self.env.now)
                self._pump(w)
        rec = self._record(dl.node, step)
        rec["commit_s"] = t
        rec["digest"] = f"{rec['acc']:016x}"
        if n.spec.role == "peer":
            size = dl.ver.total_bytes
            changed = self.costs.changed_elements(size, dl.ver.delta_ratio)
            rec["ready_s"] = t + self.costs.engine_s(size, changed, dl.delta)
        self._prune(dl.node)
        if n.plan and n.plan[0] == step:
            n.plan.pop(0)
        if n.spec.role == "peer":
            self._generate(dl.node)
        self._maybe_start(dl.node)

    def _drop_download(self, dl: _Download) -> None:
        """End ``dl`` without a commit (its node left, or the session failed)."""
        n = self.nodes[dl.node]
        dl.alive = False
        dl.ver.listeners.remove(dl)
        for fl in list(dl.flights.values()):
            fl.done = True
            if fl.fid is not None:
                self._account(dl, fl, self.net.cancel(fl.fid))
        n.have.pop(dl.ver.step, None)
        n.download = None

    def _prune(self, node: int) -> None:
        n = self.nodes[node]
        pinned = {s for s, c in n.serving.items() if c > 0}
        if n.download is not None and n.download.use_base and n.download.ver.base is not None:
            pinned.add(n.download.ver.base)
        for s in versions_to_prune(n.committed, self.spec.model.keep_last, pinned):
            n.committed.remove(s)

    # -- rollouts -----------------------------------------------------------------------------

    def _generate(self, node: int) -> None:
        n = self.nodes[node]
        if n.generating or not n.alive or not n.committed or n.committed[-1] <= n.done_step:
            return
        n.generating = True
        step = n.committed[-1]
        ro = self.spec.rollouts
        self._at(self.env.now + ro.load_s + ro.generate_s, self._submit, node, step)

    def _submit(self, node: int, step: int) -> None:
        n = self.nodes[node]
        if not n.alive:
            n.generating = False
            return
        self.rollouts["sent"] += 1
        self._record(node, step)["rollouts_sent_s"] = self.env.now
        size = self.spec.rollouts.batch_bytes

        def done(_fid: int, t: float) -> None:
            n.bytes_up += size
            self.nodes[self.origin].bytes_down += size
            self.rollouts["rejected" if n.spec.behavior == "forge" else "accepted"] += 1
            n.generating = False
            n.done_step = step
            self._generate(node)

        self._add_flow(node, self.origin, size, self.env.now, done, None)

    # -- events -------------------------------------------------------------------------------

    def _event(self, node: int, action: str, factor: float) -> None:
        n = self.nodes[node]
        nn = len(self.nodes)
        if action == "slow":
            self.net.set_capacity(node, float(self.net.capacity[node]) * factor)
            self.net.set_capacity(nn + node, float(self.net.capacity[nn + node]) * factor)
        elif action == "leave" and n.alive:
            n.alive = False
            self.nat.left(node)
            for fid, (dl, rid) in list(n.out.items()):
                fl = dl.flights.get(rid)
                moved = self.net.cancel(fid)
                if fl is not None:
                    self._account(dl, fl, moved)
                    self._fail(dl, fl, Outcome.BROKEN, int(moved))  # the session keeps them
            for waits in n.waiters.values():
                for dl, fl in waits:
                    self._at(self.env.now + UNREACHABLE_S, self._fail, dl, fl, Outcome.BROKEN)
            n.waiters.clear()
            if n.download is not None:
                self._drop_download(n.download)
                n.plan = []
        elif action == "join" and not n.alive:
            n.alive = True
            if self.versions:
                delay, _, _ = self._path(node, self.origin)
                self._at(self.env.now + 2 * delay, self._learn, node, max(self.versions))

    # -- run ----------------------------------------------------------------------------------

    def run(self, progress: SimProgress | None = None) -> dict[str, Any]:
        """Run to completion (or ``until_s``); returns the summary (see :mod:`report`).

        ``progress`` (optional) is shown a :meth:`snapshot` whenever it is due; it is asked
        every 64 SimPy events (one clock read), so it costs nothing measurable.
        """
        t0 = time.perf_counter()
        ck = self.spec.checkpoint
        self.env.process(self._network())
        for step in range(ck.versions):
            self._at(step * ck.interval_s, self._publish, step)
        for ev in self.topo.events:
            self._at(ev.at_s, self._event, ev.node, ev.action, ev.factor)
        last = ck.versions - 1
        events = 0
        while self.env.peek() < self.until_s:
            self.env.step()
            events += 1
            if progress is not None and not events & 63 and progress.due():
                progress.update(self.snapshot())
            if self.env.now >= last * ck.interval_s and self._finished(last):
                break
        self.wall_s = time.perf_counter() - t0
        return model_summary(self)

    def snapshot(self) -> Snapshot:
        """Where the run stands (O(nodes)): virtual time, versions, peers holding the latest."""
        latest = max(self.versions) if self.versions else -1
        peers = [n for n in self.nodes if n.spec.role == "peer" and n.alive]
        at = sum(1 for n in peers if n.committed and n.committed[-1] >= latest >= 0)
        return Snapshot(
            float(self.env.now),
            len(self.versions),
            self.spec.checkpoint.versions,
            latest,
            at,
            len(peers),
        )

    def _finished(self, last: int) -> bool:
        if last not in self.versions:
            return False
        for n in self.nodes:
            if n.spec.role == "origin" or not n.alive:
                continue
            if last not in n.committed and not any(s > last for s in n.committed):
                return False
            if n.spec.role == "peer" and (n.generating or n.done_step < last):
                return False
        return True


def _costs_note(m: Model) -> str:
    c = m.costs
    ck = m.spec.checkpoint
    ratio = m.delta_ratio
    note = (
        f"costs: deltas {c.commit.value}, origin digest {c.origin_digest.value}, "
        f"{c.check_workers} check worker(s) per node"
    )
    if ratio < 1:
        changed = c.changed_elements(ck.size_bytes, ratio)
        note += (
            f"; a delta moves {ratio:.4%} of the checkpoint "
            f"({ck.size_bytes * ratio / GB:.3f} GB, {changed / 1e6:,.0f} M elements changed)"
        )
    return note


def _node_entry(n: _NodeState, versions: dict[str, Any], nat: bool) -> dict[str, Any]:
    """A node's summary entry; its ``nat`` (none, eim, symmetric) when ``nat``."""
    entry = {
        "role": n.spec.role,
        "group": n.spec.group,
        "behavior": n.spec.behavior,
        "up_bps": n.spec.up_bps,
        "down_bps": n.spec.down_bps,
        "bytes_up": round(n.bytes_up),
        "bytes_down": round(n.bytes_down),
        "alive_at_end": n.alive,
        "committed_at_end": list(n.committed),
        "versions": versions,
    }
    if nat:
        entry["nat"] = n.spec.nat
    return entry


def model_summary(m: Model) -> dict[str, Any]:
    """The summary of a finished :class:`~simulations.model.Model` run."""
    topo = m.topo
    ck = topo.spec.checkpoint
    nodes: dict[str, Any] = {}
    shard_times: list[list[float]] = []
    for n in m.nodes:
        versions = {}
        for step, rec in sorted(n.records.items()):
            ver = m.versions.get(step)
            pub = ver.t_pub if ver else None
            commit = rec["commit_s"]
            entry = {
                "published_s": pub,
                "learned_s": rec["learned_s"],
                "first_byte_s": rec["first_byte_s"],
                "commit_s": commit,
                "duration_s": None if commit is None or pub is None else round(commit - pub, 4),
                "shards": len(rec["shards_s"]),
            }
            if "digest" in rec and ver is not None:
                entry["digest_ok"] = rec["digest"] == ver.digest
            if "rollouts_sent_s" in rec:
                entry["rollouts_sent_s"] = rec["rollouts_sent_s"]
            if "ready_s" in rec and pub is not None:
                entry["ready_s"] = rec["ready_s"]
                entry["ready_duration_s"] = round(rec["ready_s"] - pub, 4)
            versions[str(step)] = entry
            if step == 0 and n.spec.role == "peer" and n.spec.behavior == "honest":
                shard_times.append(rec["shards_s"])
        nodes[n.spec.name] = _node_entry(n, versions, m.nat.active)
    summary: dict[str, Any] = {
        "mode": "model",
        "topology": topo.name,
        "source": str(topo.source) if topo.source else None,
        "seed": m.seed,
        "notes": [
            f"flow model: weighted max-min, time step {m.dt:.4g} s"
            + ("" if m.spec.model.time_step_s else " (down to 2 ms while smaller flows run)")
            + "; simulator: SimPy",
            "policies: shardcast.core.select.Scheduler, SourceDirectory, SuperSeeding, "
            "versions_to_prune, catchup.plan (the real code)",
            _costs_note(m),
        ],
        "checkpoint": {
            "size_bytes": ck.size_bytes,
            "shard_size_bytes": ck.shard_size_bytes,
            "n_shards": math.ceil(ck.size_bytes / ck.shard_size_bytes),
            "versions": ck.versions,
            "scale": m.topo.scale,
        },
        "run": {
            "rollouts": dict(m.rollouts),
            "wall_s": round(m.wall_s, 3),
            "virtual_s": round(m.env.now, 3),
            "time_step_s": m.dt,
            "seeding_refused": m.seeding.refused,
            "relay_seeding_refused": sum(v.refused for k, v in m.seedings.items() if k != m.origin),
            "unreachable_served": sum(v.unreachable_served for v in m.seedings.values()),
            "spread_refused": sum(v.spread_refused for v in m.seedings.values()),
        },
        "nodes": nodes,
        "progress": progress_bands(
            shard_times,
            m.versions[0].t_pub if 0 in m.versions else 0.0,
            len(m.versions[0].lengths) if 0 in m.versions else 0,
        ),
    }
    if m.nat.active:
        summary["nat"] = m.nat.summary()
        summary["notes"].append(m.nat.note())
    return finish(summary, topo)
