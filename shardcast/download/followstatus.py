"""download: what a follower shows: its ``/status`` sections and its metric families.

Views only: each function is given the parts of a running follower's state it shows (its
upstreams, the downloads it fills, its directory of advertised nodes, its own lane's
reachability and punches) and returns JSON-ready dicts (times as ISO 8601 UTC strings) or
Prometheus metric families; nothing here changes them. The follower
(:class:`~shardcast.download.follower.Follower`) registers them with its node (``/status``
sections, the metrics collector).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from enum import Enum
from typing import Any

import trio
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from p2p.host import peer_id_of
from shardcast.core import (
    DialbackResult,
    DownloadStats,
    LaneCheck,
    MirrorPoll,
    Reach,
    Reachability,
)
from shardcast.download.adverts import AdvertIntake
from shardcast.download.discovery import HolderReach, SourceDirectory
from shardcast.download.punching import Punching
from shardcast.node import iso, wall_of
from shardcast.wire import NodeInfo

__all__ = ["downloads", "families", "known_nodes", "mirrors", "reachability", "upstreams"]


def downloads(
    progress: Mapping[int, tuple[int, int, float]],
    current: DownloadStats | None,
    kind_of: Callable[[str], str],
) -> list[dict[str, Any]]:
    """The ``downloads`` section of ``/status``: versions in progress, with progress.

    Args:
        progress: step -> (verified bytes, total bytes, ``trio.current_time()`` it started).
        current: the statistics of the download running now (None: none).
        kind_of: the kind of a source id (``relay``, ``peer``, ``mirror``, ...).
    """
    now = trio.current_time()
    out = []
    for step, (done, total, started) in sorted(progress.items()):
        elapsed = now - started
        rate = done / elapsed if elapsed > 0 else 0.0
        stats = current if current is not None and current.step == step else None
        sources = stats.bytes_by_source if stats is not None else {}
        out.append(
            {
                "step": step,
                "verified_bytes": done,
                "total_bytes": total,
                "percent": round(100.0 * done / total, 2) if total else 100.0,
                "rate_bytes_per_s": round(rate, 1),
                "eta_s": round((total - done) / rate, 1) if rate > 0 else None,
                "elapsed_s": round(elapsed, 3),
                "corrupt_shards": sum(stats.corrupt_by_source.values()) if stats else 0,
                "sources": [
                    {"peer_id": pid, "kind": kind_of(pid), "bytes": n}
                    for pid, n in sorted(sources.items(), key=lambda kv: -kv[1])
                ],
            }
        )
    return out


def upstreams(
    addrs: Sequence[str],
    infos: Mapping[str, NodeInfo],
    heard: Mapping[str, float],
    errors: Mapping[str, str],
    finished: bool,
) -> list[dict[str, Any]]:
    """The ``upstreams`` section of ``/status``: each configured upstream's state
    (``ready`` or ``unreachable``), and ``expected`` (``"run_finished"``: the run's end
    is in force, so an upstream that left is no fault; else None).

    Args:
        addrs: the configured upstreams' multiaddrs.
        infos: PeerID -> its latest info record, for the upstreams ready now.
        heard: PeerID -> Unix time (s) of its last info answer.
        errors: PeerID -> its last error.
        finished: the run's end is in force.
    """
    out = []
    expected = "run_finished" if finished else None
    for addr in addrs:
        pid = peer_id_of(addr)
        info = infos.get(pid)
        last = heard.get(pid)
        out.append(
            {
                "peer_id": pid,
                "addr": addr,
                "state": "ready" if info is not None else "unreachable",
                "role": info.role if info is not None else None,
                "http_url": info.http_url if info is not None else None,
                "latest_step": info.committed[-1] if info and info.committed else None,
                "last_heard": iso(last) if last is not None else None,
                "error": errors.get(pid),
                "expected": expected,
            }
        )
    return out


def mirrors(polls: Mapping[str, MirrorPoll]) -> list[dict[str, Any]]:
    """The ``mirrors`` section of ``/status``: each static mirror's state (``polls``: base
    URL -> what its polls found)."""
    return [
        {
            "url": url,
            "state": "unreachable" if poll.error is not None or poll.heard is None else "ready",
            "committed": sorted(poll.steps),
            "last_heard": iso(poll.heard) if poll.heard is not None else None,
            "error": poll.error,
        }
        for url, poll in sorted(polls.items())
    ]


def reachability(reach: Reachability, punching: Punching) -> dict[str, Any]:
    """The ``reachability`` section of ``/status``: this node's own lane (``reach``), the
    relays it holds reservations on and its hole punches (``punching``)."""
    now, wall = trio.current_time(), time.time()
    out = reach.status(lambda t: iso(wall_of(t, now, wall)))
    out.update(punching.status())
    return out


def known_nodes(directory: SourceDirectory) -> list[dict[str, Any]]:
    """The ``known_nodes`` section of ``/status``: nodes heard through adverts, with what
    this node's challenges of their lanes gave (``lane``: ``verified``, ``unreachable``,
    ``bad_answer``, ``untried``, or ``none`` for a node with no URL; ``stream_lane``: it
    serves over libp2p streams on connections it holds)."""
    now, wall = trio.current_time(), time.time()
    out = []
    for a, t in reversed(directory.entries(now)):
        lane = directory.lane_status(a.peer_id, a.http_url) if a.http_url else None
        out.append(
            {
                "peer_id": a.peer_id,
                "role": a.role,
                "http_url": a.http_url,
                "latest_step": max(a.committed) if a.committed else None,
                "filling": list(a.filling),
                "last_heard": iso(wall_of(t, now, wall)),
                "lane": (
                    lane.result.value if lane is not None else ("untried" if a.http_url else "none")
                ),
                "lane_failures": lane.failures if lane is not None else 0,
                "lane_dropped": lane.dropped(directory.backoff) if lane else False,
                "lane_checked": iso(wall_of(lane.at, now, wall)) if lane else None,
                "stream_lane": a.stream_lane,
                "relays": list(a.relays),
            }
        )
    return out


def families(
    addrs: Sequence[str],
    infos: Mapping[str, NodeInfo],
    directory: SourceDirectory,
    reach: Reachability,
    intake: AdvertIntake,
    holders_named: Counter[HolderReach],
) -> list[Metric]:
    """The follower's metric families: configured upstreams (``addrs``; ready: those in
    ``infos``) by state, nodes heard through adverts (``directory``) by role, and its lane's
    reachability (``reach``: dial-back answers; ``intake``: advert checks, adverts out of
    scope; holders named by refusals); the names and types are listed in
    :mod:`shardcast.node.metrics`."""
    ready = GaugeMetricFamily(
        "shardnet_upstreams", "configured upstreams by state", labels=["state"]
    )
    n_ready = sum(1 for a in addrs if peer_id_of(a) in infos)
    ready.add_metric(["ready"], n_ready)
    ready.add_metric(["unreachable"], len(addrs) - n_ready)
    known = GaugeMetricFamily(
        "shardnet_known_nodes", "nodes heard through adverts, by role", labels=["role"]
    )
    entries = directory.entries(trio.current_time())
    for role in ("relay", "peer"):
        known.add_metric([role], sum(1 for a, _ in entries if a.role == role))
    return [ready, known, *_reachability_families(reach, intake, holders_named)]


def _by_enum(
    name: str, doc: str, label: str, members: Iterable[Enum], counts: Mapping[Any, int]
) -> CounterMetricFamily:
    """A counter family with one sample per member of an enum (its value as the label)."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for m in members:
        family.add_metric([m.value], counts.get(m, 0))
    return family


def _reachability_families(
    reach: Reachability, intake: AdvertIntake, holders_named: Counter[HolderReach]
) -> list[Metric]:
    state = GaugeMetricFamily(
        "shardnet_lane_reachability",
        "this node's lane as its dial-back checks found it: 1 for the current state",
        labels=["state"],
    )
    for r in Reach:
        state.add_metric([r.value], 1.0 if reach.state is r else 0.0)
    answers = _by_enum(
        "shardnet_dialback_answers",
        "answers to this node's dial-back asks, by result",
        "result",
        DialbackResult,
        reach.answers_total,
    )
    checks = _by_enum(
        "shardnet_advert_checks",
        "whoami challenges of other nodes' advertised lane URLs, by result",
        "result",
        LaneCheck,
        intake.checks,
    )
    scope = CounterMetricFamily(
        "shardnet_adverts_out_of_scope",
        "adverts heard whose URL is a private address of another network (not tried)",
    )
    scope.add_metric([], intake.out_of_scope)
    named = _by_enum(
        "shardnet_refusal_holders",
        "holders super-seeding refusals named, by whether this node could reach them "
        "(unreachable ones are named back and served at once)",
        "reach",
        HolderReach,
        holders_named,
    )
    return [state, answers, checks, scope, named]
