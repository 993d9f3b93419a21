"""Topology files: the network, the nodes, the checkpoint and the timed events of a simulation.

A topology is one TOML file read by both simulation modes (``shardnet simulate model`` and
``shardnet simulate emulate``). Units are in the field names: ``_mbps`` is megabits per second
(10^6 bit/s), ``_ms`` milliseconds, ``_s`` seconds, ``_bytes`` bytes; ``loss`` is a fraction of
packets (0.01 = 1 %). Example (``simulations/topologies/*.toml`` hold complete ones)::

    name = "small"
    seed = 1

    [checkpoint]
    size_bytes = 1_073_741_824       # one version; --scale shrinks it for emulation
    versions = 1                     # versions 0 .. versions-1
    interval_s = 0                   # time between two publications
    shard_size_bytes = 33_554_432
    changed_fraction = 0.01          # optional: versions after an anchor are deltas changing
                                     # 1 % of the elements (or delta_ratio: blob/raw bytes)

    [costs]                          # optional: CPU, disk and engine costs (simulations/costs.py)
    commit = "chain"                 # chain or materialize: how a follower commits a delta

    [[nodes]]
    name = "origin"
    role = "origin"                  # origin (alias trainer), relay or peer
    up_mbps = 1000
    down_mbps = 1000

    [[nodes]]
    name = "relay"
    role = "relay"
    count = 2                        # expands to relay-0, relay-1
    upstreams = ["origin"]           # node or group names
    up_mbps = 1000

    [[nodes]]
    name = "peer"
    role = "peer"
    count = 6
    upstreams = ["relay"]
    up_mbps = [50, 100]              # [min, max]: spread evenly over the group's members
    down_mbps = [50, 100]
    latency_ms = 10                  # one-way delay of this node's access link
    loss = 0.0

    [[links]]                        # optional: a bottleneck between two nodes
    a = "relay-1"
    b = "peer-5"
    bandwidth_mbps = 20

    [[events]]
    at_s = 30
    node = "relay-1"                 # a node or a group
    action = "leave"                 # leave, join (first event join: starts offline), slow
    factor = 0.25                    # slow only: multiply the node's bandwidth

Adversaries: ``behavior = "corrupt"`` on a relay or peer (it serves bytes that fail their digest
for ``corrupt_fraction`` of the shards it sends), ``behavior = "forge"`` on a peer (its rollouts
fail verification). The path model: a flow a → b is limited by a's uplink, b's downlink and the
``[[links]]`` entry of the pair if any; its one-way delay is ``latency_ms(a) + latency_ms(b)``
(+ the link's), its loss ``1 - (1-loss_a)(1-loss_b)(1-loss_link)``.

NAT (model only; a peer group's keys): ``nat = "eim"`` puts each member behind a NAT with
endpoint-independent mapping (hole punches to it succeed), ``nat = "symmetric"`` behind one
that maps each destination to its own port (punches fail); ``router = "home1"`` puts every
node naming that router on one LAN (they reach each other directly; without it each node has
a router of its own); ``serve_behind_nat = false`` makes the members download-only (the
real node's ``--no-serve-behind-nat``). Relays and the origin are public; a NATed node is the
upstream of its LAN neighbours only. How the model uses them: :mod:`simulations.model`.

:func:`load` validates everything and raises :class:`TopologyError` naming the field
(``nodes[2].up_mbps: ...``).
"""

from __future__ import annotations

import dataclasses
import re
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from p2p.errors import ConfigError
from shardcast.core import SchedulerConfig
from shardcast.serve import SUPER_SEED_S
from simulations.costs import CommitMode, CostModel, OriginDigest

Role = Literal["origin", "trainer", "relay", "peer"]
Nat = Literal["none", "eim", "symmetric"]
Behavior = Literal["honest", "corrupt", "forge"]
Rate = float | tuple[float, float]


class TopologyError(ConfigError):
    """A topology file is unreadable or invalid (the message names the field, by its path
    in the file: ``nodes[1].up_mbps``)."""

    names_option = False


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckpointSpec(_Model):
    """What the origin publishes."""

    size_bytes: int = Field(..., gt=0, description="bytes of one full version")
    versions: int = Field(1, ge=1, description="versions published: 0 .. versions-1")
    interval_s: float = Field(0.0, ge=0, description="time between two publications")
    shard_size_bytes: int = Field(32 << 20, ge=4096, description="bytes per shard")
    shards_per_part: int = Field(16, ge=1, description="shards per signed manifest part")
    delta_ratio: float = Field(
        1.0, gt=0, le=1, description="encoded/raw bytes of a delta version (1: no deltas)"
    )
    changed_fraction: float | None = Field(
        None,
        gt=0,
        le=1,
        description="fraction of elements a delta version changes (sets the delta's bytes "
        "through costs.blob_bytes_per_change; instead of delta_ratio)",
    )
    anchor_every: int = Field(10, ge=1, description="a full version every N steps")
    hash_bytes_per_s: float = Field(2e9, gt=0, description="origin hashing speed (pipelining)")


class NodeSpec(_Model):
    """One node, or a group of ``count`` alike nodes named ``<name>-<i>``."""

    name: str = Field(..., pattern=r"^[A-Za-z][A-Za-z0-9_]{0,23}$")
    role: Role
    count: int | None = Field(None, ge=1, le=100_000)
    upstreams: tuple[str, ...] = ()
    up_mbps: Rate = 1000.0
    down_mbps: Rate = 1000.0
    latency_ms: float = Field(0.0, ge=0, le=10_000)
    loss: float = Field(0.0, ge=0, lt=1)
    behavior: Behavior = "honest"
    corrupt_fraction: float = Field(1.0, ge=0, le=1)
    nat: Nat = Field("none", description="none (public), eim or symmetric mapping (peers)")
    router: str | None = Field(
        None, pattern=r"^[A-Za-z0-9_.-]{1,64}$", description="nodes of one router share a LAN"
    )
    serve_behind_nat: bool = Field(True, description="False: a NATed peer is download-only")

    @model_validator(mode="after")
    def _check(self) -> NodeSpec:
        if self.nat != "none" and self.role != "peer":
            raise ValueError("nat: only a peer can be behind a NAT (relays are public)")
        if self.router is not None and self.nat == "none":
            raise ValueError("router: only a node behind a NAT has a router")
        for fld in ("up_mbps", "down_mbps"):
            v = getattr(self, fld)
            lo, hi = v if isinstance(v, tuple) else (v, v)
            if lo <= 0 or hi < lo:
                raise ValueError(f"{fld}: must be > 0 (or [min, max] with 0 < min <= max)")
        if self.role in ("origin", "trainer"):
            if self.upstreams:
                raise ValueError("upstreams: an origin has no upstreams")
            if self.count not in (None, 1):
                raise ValueError("count: there is exactly one origin")
        elif not self.upstreams:
            raise ValueError(f"upstreams: a {self.role} needs at least one upstream")
        if self.behavior == "forge" and self.role != "peer":
            raise ValueError("behavior: only a peer can forge rollouts")
        if self.behavior == "corrupt" and self.role not in ("relay", "peer"):
            raise ValueError("behavior: only a relay or a peer can corrupt shards")
        return self


class LinkSpec(_Model):
    """A bottleneck between two nodes (both directions, shared by all their flows)."""

    a: str
    b: str
    bandwidth_mbps: float | None = Field(None, gt=0)
    latency_ms: float = Field(0.0, ge=0, le=10_000)
    loss: float = Field(0.0, ge=0, lt=1)


class EventSpec(_Model):
    """A timed change of a node (or of every member of a group)."""

    at_s: float = Field(..., ge=0)
    node: str
    action: Literal["leave", "join", "slow"]
    factor: float = Field(1.0, gt=0, description="slow: multiply up and down bandwidth")


class RolloutSpec(_Model):
    """What a peer does after each committed version (model; emulation runs the real thing)."""

    load_s: float = Field(5.0, ge=0, description="load the weights into the engine")
    generate_s: float = Field(30.0, ge=0, description="generate one batch")
    batch_bytes: int = Field(1 << 20, ge=1, description="size of one rollout batch")


_SCHED = SchedulerConfig()


class ModelSpec(_Model):
    """Knobs of the virtual-time model (defaults mirror the real nodes')."""

    time_step_s: float | None = Field(None, gt=0, description="flow-model step (None: auto)")
    max_inflight: int = Field(_SCHED.max_inflight, ge=1)
    per_source_inflight: int = Field(_SCHED.per_source_inflight, ge=1)
    serve_wait_s: float = Field(10.0, gt=0)
    serve_once_s: float | None = Field(
        SUPER_SEED_S, gt=0, description="origin super-seeding window"
    )
    relay_serve_once_s: float = Field(
        SUPER_SEED_S,
        ge=0,
        description="relays' super-seeding window, seconds (shardnet relay's --serve-once-s "
        "and its default; 0: off, relays serve every requester)",
    )
    discovery: bool = True
    max_extra_sources: int = Field(16, ge=0)
    advert_interval_s: float = Field(2.0, gt=0)
    gossip_sample: int = Field(16, ge=1, description="adverts a node hears per interval")
    keep_last: int = Field(3, ge=1)
    window_bytes: int | None = Field(
        None, ge=1, description="TCP window cap per flow (rate <= window/RTT); None: off"
    )


_COSTS = CostModel()


class CostsSpec(_Model):
    """CPU, disk and engine costs of the model (:class:`simulations.costs.CostModel`, whose
    docstring cites the measurement behind each default)."""

    commit: CommitMode = Field(_COSTS.commit, description="how a follower commits a delta")
    origin_digest: OriginDigest = Field(
        _COSTS.origin_digest, description="what the origin hashes for a delta version"
    )
    check_workers: int = Field(_COSTS.check_workers, ge=1, description="shard checks at once")
    element_bytes: int = Field(_COSTS.element_bytes, ge=1, description="bytes per element")
    blob_bytes_per_change: float = Field(_COSTS.blob_bytes_per_change, gt=0)
    hash_cpu_s_per_gb: float = Field(_COSTS.hash_cpu_s_per_gb, ge=0)
    write_cpu_s_per_gb: float = Field(_COSTS.write_cpu_s_per_gb, ge=0)
    materialize_cpu_s_per_gb: float = Field(_COSTS.materialize_cpu_s_per_gb, ge=0)
    commit_cpu_s_per_gb: float = Field(_COSTS.commit_cpu_s_per_gb, ge=0)
    chain_commit_s: float = Field(_COSTS.chain_commit_s, ge=0)
    engine_update_s_per_mchange: float = Field(_COSTS.engine_update_s_per_mchange, ge=0)
    engine_reload_s_per_gb: float = Field(_COSTS.engine_reload_s_per_gb, ge=0)

    def cost_model(self) -> CostModel:
        """The :class:`~simulations.costs.CostModel` these fields describe."""
        return CostModel(**self.model_dump())


class EmulationSpec(_Model):
    """Defaults of ``simulate emulate`` (the command line wins)."""

    scale: float = Field(1.0, gt=0, le=1, description="checkpoint size factor")
    timeout_s: float = Field(1800.0, gt=0)


class TopologyFile(_Model):
    """The whole file."""

    name: str = Field(..., pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str = ""
    seed: int = 0
    checkpoint: CheckpointSpec
    nodes: tuple[NodeSpec, ...] = Field(..., min_length=2)
    links: tuple[LinkSpec, ...] = ()
    events: tuple[EventSpec, ...] = ()
    rollouts: RolloutSpec = Field(default_factory=lambda: RolloutSpec.model_validate({}))
    model: ModelSpec = Field(default_factory=lambda: ModelSpec.model_validate({}))
    costs: CostsSpec = Field(default_factory=lambda: CostsSpec.model_validate({}))
    emulation: EmulationSpec = Field(default_factory=lambda: EmulationSpec.model_validate({}))

    @model_validator(mode="after")
    def _one_delta_size(self) -> TopologyFile:
        ck = self.checkpoint
        if ck.changed_fraction is not None and ck.delta_ratio < 1:
            raise ValueError("checkpoint: set changed_fraction or delta_ratio, not both")
        return self

    @property
    def delta_ratio(self) -> float:
        """Blob bytes per raw byte of a delta version (1: versions are not deltas)."""
        ck = self.checkpoint
        if ck.changed_fraction is None:
            return ck.delta_ratio
        return self.costs.cost_model().delta_ratio(ck.changed_fraction)


@dataclass(frozen=True)
class Node:
    """One expanded node: bandwidths in bytes/s, latency in seconds."""

    index: int
    name: str
    group: str
    role: str  # origin, relay or peer
    upstreams: tuple[str, ...]
    up_bps: float
    down_bps: float
    latency_s: float
    loss: float
    behavior: str
    corrupt_fraction: float
    nat: str = "none"  # none (public), eim or symmetric
    router: str = ""  # nodes behind one router share a LAN ("": its own router)
    serve_behind_nat: bool = True

    @property
    def natted(self) -> bool:
        """Behind a NAT: no one outside its LAN can open a connection to it."""
        return self.nat != "none"


@dataclass(frozen=True)
class Link:
    """An expanded link between two node indices (bytes/s, seconds)."""

    a: int
    b: int
    bandwidth_bps: float | None
    latency_s: float
    loss: float


@dataclass(frozen=True)
class Event:
    """An expanded event on one node index."""

    at_s: float
    node: int
    action: str
    factor: float


@dataclass(frozen=True)
class Topology:
    """A validated, expanded topology (what both modes run)."""

    spec: TopologyFile
    nodes: tuple[Node, ...]
    links: tuple[Link, ...]
    events: tuple[Event, ...]
    source: Path | None = None
    scale: float = 1.0  # the checkpoint's size against the file's (:func:`scaled`)

    @property
    def name(self) -> str:
        """The topology's name."""
        return self.spec.name

    @property
    def origin(self) -> Node:
        """The origin node."""
        return next(n for n in self.nodes if n.role == "origin")

    def by_role(self, role: str) -> list[Node]:
        """Nodes of one role, in file order."""
        return [n for n in self.nodes if n.role == role]

    def index(self, name: str) -> int:
        """Index of the node called ``name``."""
        for n in self.nodes:
            if n.name == name:
                return n.index
        raise KeyError(name)


def _spread(v: Rate, i: int, count: int) -> float:
    if not isinstance(v, tuple):
        return float(v)
    lo, hi = v
    return lo if count == 1 else lo + (hi - lo) * i / (count - 1)


def _err(exc: ValidationError, path: Path | None) -> TopologyError:
    e = exc.errors()[0]
    loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in e["loc"]).lstrip(".")
    msg = e["msg"].removeprefix("Value error, ")
    sub = re.match(r"^(\w+): (.*)$", msg)
    if sub and e["type"] == "value_error":  # a model check naming its field: point at it
        loc, msg = f"{loc}.{sub.group(1)}".lstrip("."), sub.group(2)
    where = f"{path}: " if path else ""
    return TopologyError(loc or "topology", f"{where}{msg}")


def parse(data: dict[str, object], path: Path | None = None) -> Topology:
    """Validate and expand a topology given as a dict (see module docstring).

    Raises:
        TopologyError: naming the first invalid field.
    """
    try:
        spec = TopologyFile.model_validate(data)
    except ValidationError as exc:
        raise _err(exc, path) from exc
    where = f"{path}: " if path else ""
    nodes, groups = _expand_groups(spec, where)
    all_names = {n.name for n in nodes}
    if len(all_names) != len(nodes) or any(g in all_names and groups[g] != [g] for g in groups):
        raise TopologyError("nodes", f"{where}a node name collides with a group member name")
    if sum(n.role == "origin" for n in nodes) != 1:
        raise TopologyError("nodes", f"{where}exactly one node must have role origin (or trainer)")

    def resolve(ref: str, field: str) -> list[str]:
        if ref in groups:
            return groups[ref]
        if ref in all_names:
            return [ref]
        raise TopologyError(field, f"{where}unknown node or group {ref!r}")

    expanded = _with_upstreams(spec, nodes, resolve, where)
    idx = {n.name: n.index for n in expanded}
    _check_reachable(expanded, where)
    _check_nat_upstreams(expanded, where)
    links = _links(spec, resolve, idx, where)
    events = []
    for k, es in enumerate(spec.events):
        for x in resolve(es.node, f"events[{k}].node"):
            if expanded[idx[x]].role == "origin" and es.action != "slow":
                raise TopologyError(f"events[{k}].action", f"{where}the origin can only slow down")
            events.append(Event(es.at_s, idx[x], es.action, es.factor))
    events.sort(key=lambda e: e.at_s)
    return Topology(spec, tuple(expanded), tuple(links), tuple(events), path)


def _expand_groups(spec: TopologyFile, where: str) -> tuple[list[Node], dict[str, list[str]]]:
    """Every node of ``spec``, a group of ``count`` expanded to ``name-0`` .. ``name-(count-1)``
    with rates spread over its range (bytes/s, seconds), upstreams as written; and each
    entry's name -> its node names.

    Raises:
        TopologyError: two entries with the same name.
    """
    nodes: list[Node] = []
    groups: dict[str, list[str]] = {}
    for k, ns in enumerate(spec.nodes):
        if ns.name in groups:
            raise TopologyError(f"nodes[{k}].name", f"{where}duplicate name {ns.name!r}")
        count = ns.count or 1
        names = [ns.name] if ns.count is None else [f"{ns.name}-{i}" for i in range(count)]
        groups[ns.name] = names
        role = "origin" if ns.role == "trainer" else ns.role
        for i, name in enumerate(names):
            nodes.append(
                Node(
                    len(nodes),
                    name,
                    ns.name,
                    role,
                    ns.upstreams,
                    _spread(ns.up_mbps, i, count) * 1e6 / 8,
                    _spread(ns.down_mbps, i, count) * 1e6 / 8,
                    ns.latency_ms / 1e3,
                    ns.loss,
                    ns.behavior,
                    ns.corrupt_fraction,
                    ns.nat,
                    ns.router or "",
                    ns.serve_behind_nat,
                )
            )
    return nodes, groups


def _with_upstreams(
    spec: TopologyFile,
    nodes: list[Node],
    resolve: Callable[[str, str], list[str]],
    where: str,
) -> list[Node]:
    """``nodes`` with their upstream references (node or group names) resolved to node names.

    Raises:
        TopologyError: an unknown reference, or a node that is its own upstream.
    """
    expanded: list[Node] = []
    for k, ns in enumerate(spec.nodes):
        ups: list[str] = []
        for j, ref in enumerate(ns.upstreams):
            ups += resolve(ref, f"nodes[{k}].upstreams[{j}]")
        for n in (n for n in nodes if n.group == ns.name):
            if n.name in ups:
                raise TopologyError(f"nodes[{k}].upstreams", f"{where}{n.name} is its own upstream")
            expanded.append(Node(**{**vars(n), "upstreams": tuple(ups)}))
    return expanded


def _links(
    spec: TopologyFile,
    resolve: Callable[[str, str], list[str]],
    idx: dict[str, int],
    where: str,
) -> list[Link]:
    """The links of ``spec``, one per pair of nodes its two ends (node or group names) name.

    Raises:
        TopologyError: an unknown end, or a link from a node to itself.
    """
    links = []
    for k, ls in enumerate(spec.links):
        a = resolve(ls.a, f"links[{k}].a")
        b = resolve(ls.b, f"links[{k}].b")
        for x in a:
            for y in b:
                if x == y:
                    raise TopologyError(f"links[{k}]", f"{where}a link joins {x} to itself")
                links.append(
                    Link(idx[x], idx[y], _bps(ls.bandwidth_mbps), ls.latency_ms / 1e3, ls.loss)
                )
    return links


def _bps(mbps: float | None) -> float | None:
    return None if mbps is None else mbps * 1e6 / 8


def _check_reachable(nodes: list[Node], where: str) -> None:
    """Every node must reach the origin through its upstreams (no cycle without the origin)."""
    by_name = {n.name: n for n in nodes}
    ok = {n.name for n in nodes if n.role == "origin"}
    changed = True
    while changed:
        changed = False
        for n in nodes:
            if n.name not in ok and any(u in ok for u in n.upstreams):
                ok.add(n.name)
                changed = True
    bad = [n.name for n in nodes if n.name not in ok]
    if bad:
        raise TopologyError(
            "nodes.upstreams",
            f"{where}{', '.join(bad[:5])} cannot reach the origin through upstreams",
        )
    del by_name


def _check_nat_upstreams(nodes: list[Node], where: str) -> None:
    """A node behind a NAT is no one's upstream but its LAN neighbours' (no one else can open
    a connection to it).

    Raises:
        TopologyError: naming the first node with such an upstream.
    """
    by_name = {n.name: n for n in nodes}
    for n in nodes:
        for u in (by_name[x] for x in n.upstreams):
            if u.natted and not (n.natted and u.router and u.router == n.router):
                raise TopologyError(
                    "nodes.upstreams",
                    f"{where}{n.name}'s upstream {u.name} is behind a NAT (not on its LAN)",
                )


def load(path: Path) -> Topology:
    """Read, validate and expand a topology file.

    Raises:
        TopologyError: unreadable file, TOML syntax, or an invalid field (named).
    """
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise TopologyError("topology", f"{path}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise TopologyError("topology", f"{path}: TOML syntax: {exc}") from exc
    return parse(data, path)


def scaled(topo: Topology, scale: float) -> Topology:
    """The same topology with the checkpoint (and shard) size multiplied by ``scale``.

    Shards shrink with the checkpoint down to 64 KiB so a scaled run keeps about as many
    shards (pipelining depth) as the full one.

    Raises:
        ConfigError: ``scale`` not > 0 (named as ``--scale``).
    """
    if not scale > 0:
        raise ConfigError("scale", f"must be > 0, not {scale:g}")
    if scale == 1.0:
        return topo
    ck = topo.spec.checkpoint
    new_ck = ck.model_copy(
        update={
            "size_bytes": max(4096, int(ck.size_bytes * scale)),
            "shard_size_bytes": max(64 << 10, int(ck.shard_size_bytes * scale)),
        }
    )
    return dataclasses.replace(
        topo, spec=topo.spec.model_copy(update={"checkpoint": new_ck}), scale=topo.scale * scale
    )


def with_overrides(
    topo: Topology,
    *,
    peers: int | None = None,
    time_step_s: float | None = None,
    shard_size_bytes: int | None = None,
    commit: CommitMode | None = None,
) -> Topology:
    """The topology with the largest peer group resized to ``peers`` members, the model's time
    step, the shard size and/or how followers commit a delta set (``simulate model
    --peers/--time-step/--shard-size/--commit``).

    Raises:
        ConfigError: ``peers``, ``time_step_s`` or ``shard_size_bytes`` not positive (named as
            the command-line option, before the topology is touched).
        TopologyError: no peer group, or the result is invalid.
    """
    for option, value in (
        ("peers", peers),
        ("time-step", time_step_s),
        ("shard-size", shard_size_bytes),
    ):
        if value is not None and not value > 0:
            raise ConfigError(option, f"must be > 0, not {value:g}")
    if peers is None and time_step_s is None and shard_size_bytes is None and commit is None:
        return topo
    data = topo.spec.model_dump(mode="python", exclude_none=False)
    if peers is not None:
        groups = [g for g in data["nodes"] if g["role"] == "peer"]
        if not groups:
            raise TopologyError("nodes", "no peer group to resize")
        big = max(groups, key=lambda g: g["count"] or 1)
        big["count"] = peers
    if time_step_s is not None:
        data["model"]["time_step_s"] = time_step_s
    if shard_size_bytes is not None:
        data["checkpoint"]["shard_size_bytes"] = shard_size_bytes
    if commit is not None:
        data["costs"]["commit"] = commit
    return dataclasses.replace(parse(data, topo.source), scale=topo.scale)
