"""Six peers, four of them behind two home routers: one run of the README's commands, measured.

Theory of operation
-------------------
:func:`run_mode` builds the topology of issue 25's targets on hosts made of network namespaces
(tests/deploy/hosts.py): on the public bridge A runs the trainer, B a relay, C and G a peer each;
two home routers R and S (source NAT, no port forwarding) each have two peers on their LAN (D, E
behind R; F, H behind S; the second of each pair on its own libp2p port, 4013, as the README tells
operators of several peers behind one router). The relay's and the public peers' links are shaped
(tc tbf) so that the NATed peers' uplinks matter; the NATed peers' stay at the lab's 1 Gb/s. Each
:class:`Mode` changes one thing on the same hosts: no routers at all (every peer on the bridge: the
baseline), endpoint-independent routers (plain masquerade), symmetric ones (``masquerade fully-
random``), or endpoint-independent routers with the NATed peers started with ``--no-serve-behind-
nat`` (they only download; a LAN neighbour still uses their lane).

Every node runs the README's command with the options of tests/deploy/test_nat.py (its
:class:`~tests.deploy.test_nat.ShortRun`, :func:`~tests.deploy.test_nat.start_behind`, swarm
options), the trainer publishing ``steps + 1`` whole versions in 64 KiB shards. When the trainer
has finished, :func:`run_mode` reads back, from the nodes' own log lines, reports and /status:
per version the seconds from the trainer's ``version_published`` to the last peer's
``version_committed``; whether every peer committed every version with the trainer's digest;
rollouts accepted; bytes each receiver got by path (:func:`path_of`); punches made.

Nothing here asserts a time: the bench (bench/nat.py) prints them next to its targets.
"""

from __future__ import annotations

import dataclasses
import enum
import statistics
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.deploy.hosts import LINK_BYTES_PER_S, Host, Hosts, Node
from tests.deploy.test_nat import (
    PUBLISHED,
    SECOND_PORT,
    SWARM,
    ShortRun,
    start_behind,
    status,
    step_at,
)
from tests.deploy.test_operator_path import (
    COMMITTED,
    PROGRESS_S,
    committed,
    read_report,
    trainer_digests,
)

PEER_PATHS = ("public", "outbound", "punched", "lan")  # bytes peers got from peers (and relay)
NATED_PATHS = ("outbound", "punched", "lan")  # carried by a NATed peer's uplink
PUBLIC_PEERS = ("c-peer", "g-peer")
BEHIND = {"r-router": ("d-peer", "e-peer"), "s-router": ("f-peer", "h-peer")}


class Mode(enum.Enum):
    """What the four "NATed" hosts sit behind (value: the bench's name for it)."""

    PUBLIC = "all-public"
    EIM = "endpoint-independent"
    SYMMETRIC = "symmetric"
    DOWNLOAD_ONLY = "download-only"


class Path(enum.Enum):
    """How a receiver got bytes (value: the report's key)."""

    ORIGIN = "origin"  # from the trainer
    PUBLIC = "public"  # from a public node's TCP lane
    OUTBOUND = "outbound"  # from a NATed peer, over the connection it dialled (relay)
    PUNCHED = "punched"  # from a NATed peer, over a hole-punched connection
    LAN = "lan"  # from a NATed peer behind the receiver's own router


def path_of(
    source: str,
    *,
    trainer: str,
    receiver_router: str | None,
    source_router: str | None,
    receiver_is_relay: bool,
) -> Path:
    """The path bytes from ``source`` (a PeerID) took to a receiver (as
    :func:`tests.deploy.test_nat.bytes_by_path` reasons): ``*_router`` name the router a node
    sits behind (None: on the public bridge). The relay is the only node the NATed peers dialled
    here besides the trainer, so bytes a public peer got from a NATed one crossed a punched
    connection; two NATed peers behind different routers likewise; behind one router, their LAN
    (it has no hairpin NAT)."""
    if source == trainer:
        return Path.ORIGIN
    if source_router is None:
        return Path.PUBLIC
    if receiver_is_relay:
        return Path.OUTBOUND
    if receiver_router == source_router:
        return Path.LAN
    return Path.PUNCHED


@dataclasses.dataclass(frozen=True)
class ModeResult:
    """What one run measured (see the module docstring).

    Attributes:
        mode: the mode's name (:class:`Mode` value).
        version_s: per version 0..steps, seconds from publication to the last peer's commit
            (None: a peer never committed it).
        every_version: every peer committed every published version with its digest.
        accepted: rollouts the trainer accepted, summed over the peers' reports.
        bytes_by_path: bytes the relay and the peers received, by :class:`Path` value.
        punches: the peers' punch counters summed (started, ahead, direct, failed).
        phases_s: wall seconds of the run's phases: ``start`` (keys, every node ready),
            ``run`` (until the trainer exited), ``stop`` (measuring, stopping the nodes).
    """

    mode: str
    version_s: list[float | None]
    every_version: bool
    accepted: int
    bytes_by_path: dict[str, int]
    punches: dict[str, int]
    phases_s: dict[str, float] = dataclasses.field(default_factory=dict)

    def first_s(self) -> float | None:
        """Version 0's time, seconds."""
        return self.version_s[0] if self.version_s else None

    def later_median_s(self) -> float | None:
        """The median of the later versions' times, seconds (None if one is missing)."""
        later = self.version_s[1:]
        if not later or any(t is None for t in later):
            return None
        return statistics.median(t for t in later if t is not None)

    def shares(self) -> dict[str, float]:
        """Each peer path's share of the bytes received from peers and the relay (not the
        trainer), plus ``nated``: the NATed peers' uplinks' share."""
        total = sum(self.bytes_by_path.get(k, 0) for k in PEER_PATHS)
        out = {k: self.bytes_by_path.get(k, 0) / total if total else 0.0 for k in PEER_PATHS}
        out["nated"] = sum(out[k] for k in NATED_PATHS)
        return out


def _shape(hosts: Hosts, host: Host, rate_bytes_per_s: float) -> None:
    index = next(i for i, port in hosts.lab.ports.items() if port.ip == host.ip)
    hosts.lab.set_rate(index, rate_bytes_per_s / LINK_BYTES_PER_S)


def run_mode(hosts: Hosts, mode: Mode, *, steps: int, public_rate: float) -> ModeResult:
    """Deploy the module docstring's topology on ``hosts`` in ``mode``, run the trainer's
    ``steps`` steps (``public_rate``: the relay's and public peers' links, bytes per second
    each way) and measure it.

    Raises:
        AssertionError: a node did not start, exited badly, or the trainer did not finish
            within :data:`~tests.deploy.test_operator_path.PROGRESS_S` per version.
    """
    t0 = time.monotonic()
    dep = ShortRun(hosts, dict(SWARM), steps)
    a, b = hosts.add("a-trainer"), hosts.add("b-relay")
    public = [hosts.add(n) for n in PUBLIC_PEERS]
    for h in (b, *public):
        _shape(hosts, h, public_rate)
    router_of: dict[str, str | None] = {}  # host name -> its router's
    behind: list[tuple[Host, str]] = []  # (host, the --public-host its operator types)
    port_of: dict[str, int] = {}  # libp2p port of each peer behind a router but the first
    for rname, names in BEHIND.items():
        if mode is Mode.PUBLIC:
            for n in names:
                h = hosts.add(n)
                behind.append((h, h.ip))
                router_of[n] = None
            continue
        router = hosts.add_router(rname, symmetric=mode is Mode.SYMMETRIC)
        for i, n in enumerate(names):
            h = hosts.add_behind(router, n)
            behind.append((h, h.ip))  # its LAN address, as test_nat's D
            router_of[n] = rname
            if i:
                port_of[n] = SECOND_PORT + 10 * (i - 1)  # the README's 4013, 4023, ...
    dep.values.update(TRAINER_IP=a.ip, RELAY_IP=b.ip)
    peers: list[tuple[Host, str]] = [(h, h.ip) for h in public] + behind
    with ThreadPoolExecutor(len(peers) + 2) as pool:
        ids = list(
            pool.map(
                lambda hr: dep.keygen(*hr),
                [(a, "trainer"), (b, "relay"), *((h, "peer") for h, _ in peers)],
            )
        )
    dep.values.update(TRAINER_ID=ids[0], RELAY_ID=ids[1], PEER_ID=ids[2:])
    trainer = dep.start("trainer", a, "trainer")
    relay = dep.start("relay", b, "relay")
    nat_extra = ("--no-serve-behind-nat",) if mode is Mode.DOWNLOAD_ONLY else ()
    with ThreadPoolExecutor(len(peers)) as pool:
        nodes: list[Node] = list(
            pool.map(
                lambda hp: start_behind(
                    dep,
                    hp[0],
                    f"peer-{hp[0].name[0]}",
                    hp[1],
                    nat_extra if router_of.get(hp[0].name) else (),
                    port_of.get(hp[0].name),
                ),
                peers,
            )
        )
    t_ready = time.monotonic()
    try:
        code = trainer.wait(PROGRESS_S * (steps + 1))
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the trainer did not finish\n{hosts.logs()}") from exc
    assert code == 0, trainer.tail()
    t_done = time.monotonic()
    trainer_id = trainer.info["peer_id"]
    published = trainer_digests(a, trainer_id)

    version_s: list[float | None] = []
    for step in range(steps + 1):
        at = trainer.wait_line(step_at(PUBLISHED, step), 1.0)
        got = [p.wait_line(step_at(COMMITTED, step), 1.0) for p in nodes]
        if at is None or any(t is None for t in got):
            version_s.append(None)
            continue
        version_s.append(max((t - at).total_seconds() for t in got if t is not None))

    punches = {"started": 0, "ahead": 0, "direct": 0, "failed": 0}
    with ThreadPoolExecutor(len(nodes) + 1) as pool:
        for doc in pool.map(lambda n: status(dep, n), nodes):
            for k, v in doc["reachability"]["punches"].items():
                punches[k] = punches.get(k, 0) + int(v)
        codes = list(pool.map(lambda n: (n, n.stop()), (*nodes, relay)))
    for node, code in codes:
        assert code == 0, node.tail()

    pid_router = {n.info["peer_id"]: router_of.get(n.host.name) for n in nodes}
    by_path = dict.fromkeys((p.value for p in Path), 0)
    every_version, accepted = True, 0
    receivers: list[tuple[Node, str]] = [(relay, "relay-report.json")]
    receivers += [(n, "peer-report.json") for n in nodes]
    for node, name in receivers:
        rep: dict[str, Any] = read_report(node.host.workdir / name)
        is_relay = node is relay
        if not is_relay:
            every_version &= committed(rep) == published
            accepted += int(rep["exchange"]["acked"].get("accepted", 0))
        me = pid_router.get(node.info["peer_id"])
        for version in rep["versions"]:
            for source, n in version["bytes_by_source"].items():
                path = path_of(
                    source,
                    trainer=trainer_id,
                    receiver_router=me,
                    source_router=pid_router.get(source),
                    receiver_is_relay=is_relay,
                )
                by_path[path.value] += int(n)
    every_version &= sorted(published) == list(range(steps + 1))
    phases = {"start": t_ready - t0, "run": t_done - t_ready, "stop": time.monotonic() - t_done}
    return ModeResult(mode.value, version_s, every_version, accepted, by_path, punches, phases)
