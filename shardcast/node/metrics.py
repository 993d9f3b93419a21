"""node: Prometheus metrics of a shardcast node, served at ``/metrics`` on its HTTP lane.

Conventions: ``shardnet_`` prefix, base units (bytes, seconds), ``_total`` for counters,
bounded label sets only (never a step, a PeerID or a path as a label value). Each node has its
own registry (no process-wide state). Two kinds of families:

- *read at scrape time* from the statistics objects the node already keeps (HTTP lane, store,
  libp2p host): there is no second bookkeeping to drift;
- *event families* (counters and histograms of things that happen inside a download or a
  publish) incremented by :class:`NodeMetrics`'s methods as they happen.

Roles add their own families with :meth:`NodeMetrics.add_collector` (the trainer's rollouts,
a peer's submissions: see :mod:`shardnet.observe`).

Families every node exports (besides ``process_*`` and ``python_info``):

==============================================  ==========================================
``shardnet_build_info{version,role,run_id,peer_id}``  always 1
``shardnet_http_requests_total{route,code}``    lane responses by route (``have``,
                                                ``blobs``…: :class:`LaneRoute`) and status
                                                class (``2xx``…), excluding ``/metrics``
                                                and ``/status``
``shardnet_http_client_errors_total{code}``     of those, the ``4xx`` by exact code (``404``
                                                not held, ``429`` sent to another holder…)
``shardnet_http_sent_bytes_total``              lane body bytes sent, excluding scrapes
``shardnet_sent_bytes_total{codec}``            shard bytes actually sent (``raw`` file
                                                ranges, ``zstd``, ``xor-zstd`` blobs)
``shardnet_http_received_bytes_total``          body bytes this node's HTTP client received
``shardnet_http_open_connections``              lane connections open now
``shardnet_http_errors_total{kind}``            abnormal lane connection ends by kind
``shardnet_versions_held``                      committed versions kept on disk
``shardnet_versions_in_progress``               versions being filled or hashed now
``shardnet_versions_committed_total``           versions committed (downloaded or published)
``shardnet_latest_step``                        newest committed step (-1: none)
``shardnet_announced_step``                     newest announced step known (-1: none)
``shardnet_libp2p_connected_peers``             peers with an open libp2p connection
``shardnet_gossip_mesh_peers{topic}``           peers sent each gossip message, per topic kind
``shardnet_event_loop_lag_seconds_total``       summed lateness of the event loop (0.1 s
                                                samples; rate() > 0.2: overloaded host)
``shardnet_event_loop_lag_max_seconds``         worst lateness over the last 10 s
``shardnet_peer_offences_total{offence}``       offences charged to remote peers
                                                (:class:`p2p.limits.Offence` values)
``shardnet_banned_peers``                       remote peers banned now
``shardnet_dead_connections_total{reason}``     libp2p connections closed as dead, by the
                                                :class:`p2p.keepalive.Outcome` that decided
``shardnet_redials_total{result}``              re-dials of kept libp2p peers (``ok``,
                                                ``failed``)
``shardnet_stage_cpu_seconds_total{stage}``     CPU-seconds of the node's data path by
                                                stage (:class:`~shardcast.core.Stage`
                                                values: ``receive``, ``verify``,
                                                ``apply``, ``write``, ``materialize``,
                                                ``engine_update``), from
                                                :attr:`NodeMetrics.stage_cpu`
==============================================  ==========================================

``shardnet_stage_cpu_seconds_total`` is the thread CPU time (user + system) of the sections
each stage names (:mod:`shardcast.core.stagecpu` says what is and is not counted); its
difference over a version, node by node, is what that version cost each node by stage
(``bench/broadcast.py`` reports it). Every stage is exported from the start, at 0.

Origin (roles ``origin``/``trainer``): ``shardnet_superseeding_refusals_total`` (requests the
origin answered with 429 under super-seeding) and ``shardnet_publish_hash_seconds``.

Followers (``relay``/``peer``): ``shardnet_received_bytes_total{source_kind,codec}``,
``shardnet_shards_verified_total{source_kind}``, ``shardnet_shards_corrupt_total{source_kind}``,
``shardnet_superseeding_refusals_seen_total{source_kind}``,
``shardnet_version_commit_latency_seconds`` (from hearing the announcement to commit),
``shardnet_version_download_seconds``, ``shardnet_shard_fetch_seconds``,
``shardnet_shard_verify_write_seconds``, ``shardnet_upstreams{state}``,
``shardnet_known_nodes{role}``, and reachability (:mod:`shardcast.core.reachability`):
``shardnet_lane_reachability{state}`` (1 for this node's lane's current dial-back verdict:
``unknown``, ``reachable``, ``unreachable``), ``shardnet_dialback_answers_total{result}``
(answers to its dial-back asks: ``reached``, ``not_reached``, ``mismatch``, ``refused``,
``failed``), ``shardnet_advert_checks_total{result}`` (its whoami challenges of other nodes'
advertised URLs: ``verified``, ``unreachable``, ``bad_answer``) and
``shardnet_adverts_out_of_scope_total`` (adverts whose URL is a private address of another
network, not tried), ``shardnet_refusal_holders_total{reach}`` (holders super-seeding
refusals named: ``usable``, ``pending``, ``unknown``, ``unreachable``; the unreachable ones are
named back and served at once).

``source_kind`` is ``origin``, ``relay``, ``peer``, ``mirror`` (a static mirror) or
``unknown``; ``codec`` is ``raw``, ``zstd`` or ``xor-zstd``; ``code`` is ``1xx``…``5xx``.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterable, Iterator
from importlib import metadata

import trio
from prometheus_client import (
    GC_COLLECTOR,
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from p2p.errors import short_id
from p2p.keepalive import Outcome
from p2p.limits import Offence
from shardcast.core import Stage, StageCpu
from shardcast.node.view import NodeView
from shardcast.wire import LaneRoute, codecs

log = logging.getLogger(__name__)

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

SOURCE_KINDS = ("origin", "relay", "peer", "mirror", "unknown")
CODECS = codecs.ENCODINGS
CODE_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
TOPIC_KINDS = ("versions", "nodes", "rollouts")
ORIGIN_ROLES = ("origin", "trainer")
FOLLOWER_ROLES = ("relay", "peer")

LAG_WINDOW_S = 10.0
"""Window of ``shardnet_event_loop_lag_max_seconds``, seconds."""

_SHARD_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
_VERSION_BUCKETS_S = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 3600)


def source_kind(role: str | None) -> str:
    """The ``source_kind`` label value for a node of ``role`` (None: not known)."""
    if role in ORIGIN_ROLES:
        return "origin"
    if role in ("relay", "peer", "mirror"):
        return role
    return "unknown"


def code_class(status: int) -> str:
    """``2xx`` for 200..299 and so on (``5xx`` for anything out of range)."""
    return f"{status // 100}xx" if 100 <= status < 600 else "5xx"


@functools.cache
def package_version() -> str:
    """The installed shardnet version, or ``unknown`` when run from a bare source tree.

    Read once per process: ``importlib.metadata`` scans the installed distributions on each
    call (~0.5 ms here), which every ``/metrics`` scrape and ``/status`` request paid."""
    try:
        return metadata.version("shardnet")
    except metadata.PackageNotFoundError:
        return "unknown"


class _FnCollector(Collector):
    def __init__(self, fn: Callable[[], Iterable[Metric]]) -> None:
        self.fn = fn

    def collect(self) -> Iterator[Metric]:
        yield from self.fn()


class NodeMetrics:
    """A node's registry plus its event families (see module docstring).

    Args:
        role: the node's role (selects the role's families).
        run_id: the run (``shardnet_build_info``).
        peer_id: the node's PeerID (``shardnet_build_info``).
        process: add the process and platform collectors (off for several nodes in one
            process, where they would describe the same process several times).
        stage_cpu: the node's CPU account by stage (a fresh one by default); exported as
            ``shardnet_stage_cpu_seconds_total``.

    Attributes:
        stage_cpu: the account the node's data path charges (handed down to the downloader
            and, on a peer, the engine swap).

    Methods are cheap and safe to call from any task of the node's trio run; the registry
    is read by the HTTP handler (same thread).
    """

    def __init__(
        self,
        role: str,
        run_id: str,
        peer_id: str,
        process: bool = True,
        stage_cpu: StageCpu | None = None,
    ) -> None:
        self.role = role
        self.run_id = run_id
        self.peer_id = peer_id
        reg = self.registry = CollectorRegistry(auto_describe=True)
        if process:
            ProcessCollector(registry=reg)
            PlatformCollector(registry=reg)
            reg.register(GC_COLLECTOR)
        self.stage_cpu = stage_cpu if stage_cpu is not None else StageCpu()
        self.add_collector(lambda: [stage_cpu_family(self.stage_cpu)])
        self.versions_committed = Counter(
            "shardnet_versions_committed",
            "versions committed on this node (downloaded and verified, or published)",
            registry=reg,
        )
        self.requests: dict[tuple[LaneRoute, str], int] = {
            (r, c): 0 for r in LaneRoute for c in CODE_CLASSES
        }
        """HTTP lane responses by route and status class, excluding ``/metrics`` and
        ``/status``."""
        self.client_errors: dict[int, int] = {}
        """Of those, the ``4xx`` answers by exact code (at most 100 keys)."""
        self.observability_bytes = 0
        """Body bytes of ``/metrics`` and ``/status`` responses (not lane traffic)."""
        self.follower = role in FOLLOWER_ROLES
        self.origin = role in ORIGIN_ROLES
        if self.origin:
            self.publish_hash = Histogram(
                "shardnet_publish_hash_seconds",
                "time to hash, encode and sign one published version, seconds",
                buckets=_VERSION_BUCKETS_S,
                registry=reg,
            )
        if self.follower:
            self._follower_families(reg)

    def _follower_families(self, reg: CollectorRegistry) -> None:
        self.received_bytes = Counter(
            "shardnet_received_bytes",
            "shard bytes received, by the kind of node they came from and their codec",
            ["source_kind", "codec"],
            registry=reg,
        )
        self.shards_verified = Counter(
            "shardnet_shards_verified",
            "shards verified and stored, by the kind of node that sent them",
            ["source_kind"],
            registry=reg,
        )
        self.shards_corrupt = Counter(
            "shardnet_shards_corrupt",
            "shards that failed verification, by the kind of node blamed",
            ["source_kind"],
            registry=reg,
        )
        self.refusals_seen = Counter(
            "shardnet_superseeding_refusals_seen",
            "requests a source refused under super-seeding (HTTP 429), by its kind",
            ["source_kind"],
            registry=reg,
        )
        self.transfers_cut = Counter(
            "shardnet_transfers_cut",
            "transfers cut as overdue and resumed from a source expected to be much faster, "
            "by the kind of node that was slow",
            ["source_kind"],
            registry=reg,
        )
        for k in SOURCE_KINDS:
            self.shards_verified.labels(k)
            self.shards_corrupt.labels(k)
            self.refusals_seen.labels(k)
            self.transfers_cut.labels(k)
            for c in CODECS:
                self.received_bytes.labels(k, c)
        self.commit_latency = Histogram(
            "shardnet_version_commit_latency_seconds",
            "from hearing a version's announcement to committing it, seconds",
            buckets=_VERSION_BUCKETS_S,
            registry=reg,
        )
        self.version_download = Histogram(
            "shardnet_version_download_seconds",
            "duration of one version's download (first request to commit), seconds",
            buckets=_VERSION_BUCKETS_S,
            registry=reg,
        )
        self.shard_fetch = Histogram(
            "shardnet_shard_fetch_seconds",
            "duration of one shard request that delivered its bytes, seconds",
            buckets=_SHARD_BUCKETS_S,
            registry=reg,
        )
        self.shard_verify = Histogram(
            "shardnet_shard_verify_write_seconds",
            "time to decode, hash-check and write one shard, seconds",
            buckets=_SHARD_BUCKETS_S,
            registry=reg,
        )

    @property
    def requests_by_class(self) -> dict[str, int]:
        """HTTP lane responses by status class (every route)."""
        out = dict.fromkeys(CODE_CLASSES, 0)
        for (_, c), n in self.requests.items():
            out[c] += n
        return out

    def count_request(self, status: int, route: LaneRoute) -> None:
        """One lane response with ``status`` was produced for a request on ``route``."""
        self.requests[route, code_class(status)] += 1
        if 400 <= status < 500:
            self.client_errors[status] = self.client_errors.get(status, 0) + 1

    def bind(self, node: NodeView) -> None:
        """Add the families read from ``node`` at scrape time."""
        self.registry.register(_FnCollector(lambda: _node_families(node, self)))

    def add_collector(self, fn: Callable[[], Iterable[Metric]]) -> None:
        """Add families produced by ``fn`` at every scrape (a role's own statistics)."""
        self.registry.register(_FnCollector(fn))

    def render(self) -> bytes:
        """The text exposition of every family."""
        return generate_latest(self.registry)


def stage_cpu_family(cpu: StageCpu) -> Metric:
    """``shardnet_stage_cpu_seconds_total{stage}``: every :class:`~shardcast.core.Stage`."""
    family = CounterMetricFamily(
        "shardnet_stage_cpu_seconds",
        "CPU-seconds (thread user + system time) of the node's data path, by stage",
        labels=["stage"],
    )
    seconds = cpu.statistics().seconds
    for stage in Stage:
        family.add_metric([stage.value], seconds[stage])
    return family


def _node_families(node: NodeView, m: NodeMetrics) -> Iterator[Metric]:
    """Every family read from the node at scrape time: build, HTTP lane, versions, libp2p."""
    info = GaugeMetricFamily(
        "shardnet_build_info",
        "always 1; labels say which build, role, run and node this is",
        labels=["version", "role", "run_id", "peer_id"],
    )
    info.add_metric([package_version(), m.role, m.run_id, m.peer_id], 1)
    yield info
    yield from _http_families(node, m)
    yield from _version_families(node)
    yield from _p2p_families(node)
    if m.origin:
        yield CounterMetricFamily(
            "shardnet_superseeding_refusals",
            "requests refused under origin super-seeding (HTTP 429)",
            value=node.server.refused_once,
        )


def _http_families(node: NodeView, m: NodeMetrics) -> Iterator[Metric]:
    """The HTTP lane: responses, bytes by direction and codec, connections, errors."""
    http = node.http.statistics()
    client = node.client.statistics()
    requests = CounterMetricFamily(
        "shardnet_http_requests",
        "HTTP lane responses by route and status class, excluding /metrics and /status",
        labels=["route", "code"],
    )
    for (route, c), n in m.requests.items():
        requests.add_metric([route.value, c], n)
    yield requests
    client_errors = CounterMetricFamily(
        "shardnet_http_client_errors",
        "HTTP lane 4xx responses by exact code (404 not held, 429 sent to another holder, ...)",
        labels=["code"],
    )
    for code, n in sorted(m.client_errors.items()):
        client_errors.add_metric([str(code)], n)
    yield client_errors
    yield CounterMetricFamily(
        "shardnet_http_sent_bytes",
        "HTTP lane body bytes sent, excluding /metrics and /status",
        value=max(0, http.bytes_sent - m.observability_bytes),
    )
    sent = CounterMetricFamily(
        "shardnet_sent_bytes", "shard bytes sent over the HTTP lane, by codec", labels=["codec"]
    )
    by_codec = node.server.sent_by_codec
    for c in CODECS:
        sent.add_metric([c], by_codec.get(c, 0))
    yield sent
    yield GaugeMetricFamily(
        "shardnet_http_open_connections", "open HTTP lane connections", value=http.open_connections
    )
    errors = CounterMetricFamily(
        "shardnet_http_errors", "abnormal HTTP lane connection ends, by kind", labels=["kind"]
    )
    for kind, n in sorted(http.errors.items()):
        errors.add_metric([kind], n)
    yield errors
    yield CounterMetricFamily(
        "shardnet_http_received_bytes",
        "HTTP body bytes this node's client received",
        value=client.bytes_received,
    )


def _version_families(node: NodeView) -> Iterator[Metric]:
    """Versions held, the newest committed and announced, those in progress."""
    steps = node.store.committed_steps()
    yield GaugeMetricFamily(
        "shardnet_versions_held", "committed versions kept on disk", value=len(steps)
    )
    yield GaugeMetricFamily(
        "shardnet_latest_step", "newest committed step (-1: none)", value=steps[-1] if steps else -1
    )
    ann = node.announcement
    yield GaugeMetricFamily(
        "shardnet_announced_step",
        "newest announced step this node knows (-1: none)",
        value=ann.step if ann is not None else -1,
    )
    yield GaugeMetricFamily(
        "shardnet_versions_in_progress",
        "versions being downloaded or hashed now",
        value=len(node.server.in_progress()),
    )


def _p2p_families(node: NodeView) -> Iterator[Metric]:
    """libp2p: connected peers, event-loop lag, offences and bans, gossip mesh sizes."""
    yield GaugeMetricFamily(
        "shardnet_libp2p_connected_peers",
        "peers with an open libp2p connection",
        value=len(node.p2p.connected_peers()),
    )
    lag = node.p2p.loop_lag
    yield CounterMetricFamily(
        "shardnet_event_loop_lag_seconds",
        "how late the node's event loop ran, summed over its 0.1 s samples "
        "(rate() is the share of time it was late: an overloaded host)",
        value=lag.total_s,
    )
    yield GaugeMetricFamily(
        "shardnet_event_loop_lag_max_seconds",
        "the event loop's worst lateness over the last 10 s",
        value=lag.worst(trio.current_time(), LAG_WINDOW_S),
    )
    boundary = node.p2p.boundary_statistics()
    offences = CounterMetricFamily(
        "shardnet_peer_offences",
        "misbehaviour charged to remote peers at the libp2p boundary, by offence",
        labels=["offence"],
    )
    for offence in Offence:
        offences.add_metric([offence.value], boundary.peers.offences.get(offence.value, 0))
    yield offences
    yield GaugeMetricFamily(
        "shardnet_banned_peers", "remote peers banned now", value=len(boundary.peers.banned)
    )
    ka = node.p2p.keepalive_statistics()
    dead = CounterMetricFamily(
        "shardnet_dead_connections",
        "libp2p connections closed as dead (pings and requests unanswered), by what decided",
        labels=["reason"],
    )
    for outcome in Outcome:
        if outcome.failed:
            dead.add_metric([outcome.value], ka.closed_dead.get(outcome.value, 0))
    yield dead
    redials = CounterMetricFamily(
        "shardnet_redials",
        "re-dials of lost peers this node stays connected to (trainer, upstreams, bootstrap)",
        labels=["result"],
    )
    redials.add_metric(["ok"], ka.redials_ok)
    redials.add_metric(["failed"], ka.redials_failed)
    yield redials
    mesh = GaugeMetricFamily(
        "shardnet_gossip_mesh_peers",
        "peers sent each gossip message (gossipsub mesh and direct peers), by topic kind",
        labels=["topic"],
    )
    sizes = node.p2p.mesh_sizes()
    for kind in TOPIC_KINDS:
        mesh.add_metric(
            [kind], sum(n for t, n in sizes.items() if t.rsplit("/", 2)[-2:-1] == [kind])
        )
    yield mesh


class DownloadMetrics:
    """A :class:`~shardcast.download.types.DownloadObserver` feeding a follower's event families.

    Args:
        metrics: the node's metrics (role ``relay`` or ``peer``).
        kind_of: the ``source_kind`` of a source id (see :func:`source_kind`).
    """

    def __init__(self, metrics: NodeMetrics, kind_of: Callable[[str], str]) -> None:
        if not metrics.follower:
            raise ValueError(f"role {metrics.role!r} has no download families")
        self.m = metrics
        self.kind_of = kind_of

    def shard_received(self, source: str, codec: str, size_bytes: int, fetch_s: float) -> None:
        """Count the bytes and the request's duration."""
        codec = codec if codec in CODECS else "raw"
        self.m.received_bytes.labels(self.kind_of(source), codec).inc(size_bytes)
        self.m.shard_fetch.observe(fetch_s)
        log.debug(
            "shard_fetched source=%s codec=%s size_bytes=%d fetch_s=%.3f",
            short_id(source),
            codec,
            size_bytes,
            fetch_s,
        )

    def shard_verified(self, source: str, verify_s: float) -> None:
        """Count the shard and the verification's duration."""
        self.m.shards_verified.labels(self.kind_of(source)).inc()
        self.m.shard_verify.observe(verify_s)
        log.debug("shard_checked source=%s verify_s=%.3f", short_id(source), verify_s)

    def shard_corrupt(self, source: str) -> None:
        """Count a corrupt shard against its source's kind."""
        self.m.shards_corrupt.labels(self.kind_of(source)).inc()

    def refused(self, source: str) -> None:
        """Count a super-seeding refusal."""
        self.m.refusals_seen.labels(self.kind_of(source)).inc()

    def transfer_cut(self, source: str) -> None:
        """Count a transfer cut as overdue against its source's kind."""
        self.m.transfers_cut.labels(self.kind_of(source)).inc()

    def committed(self, heard_s: float, download_s: float) -> None:
        """A version was committed ``heard_s`` after its announcement was heard, after a
        download of ``download_s`` seconds."""
        self.m.versions_committed.inc()
        self.m.commit_latency.observe(heard_s)
        self.m.version_download.observe(download_s)
