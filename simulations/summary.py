"""The run summary both modes produce (the JSON a report is made from).

Schema (times in seconds from the start of the run unless named ``duration``)::

    {"mode": "model" | "emulate", "topology": str, "seed": int, "notes": [str],
     "checkpoint": {"size_bytes", "shard_size_bytes", "n_shards", "versions", "scale"},
     "run": {"time_to_last_peer_s": {step: s}, "mean_peer_s": {step: s},
             "time_to_last_ready_s": {step: s},
             "time_to_last_peer_max_s", "origin_egress_bytes", "bound_s",
             "peer_percentiles_s": {step: {"p50", "p90", "p99", "max"}},
             "rollouts": {"sent", "accepted", "rejected"}, "wall_s", "virtual_s"},
     "nodes": {name: {"role", "group", "behavior", "up_bps", "down_bps", "bytes_up",
                      "bytes_down", "versions": {step: {"published_s", "learned_s",
                      "first_byte_s", "commit_s", "duration_s", "digest_ok",
                      "rollouts_sent_s", "ready_s", "ready_duration_s"}}}},
     "tiers": {role: {"bytes_up", "bytes_down", "nodes"}},
     "progress": {"step": "0", "peers": int, "t_s": [t, ...],
                  "quantiles": {"0" | "10" | "50" | "90" | "100": [fraction, ...]}}}

``time_to_last_peer_s[step]``: from the version's publication until the last honest peer that
committed it did so. ``time_to_last_ready_s[step]``: the same until the last honest peer's
engine held it (model only: ``ready_s``, after the engine update or reload of
:mod:`simulations.costs`). ``bound_s``: S/B + (ceil(log2(N+1)) - 1) s/B (DESIGN.md), with B the
slowest honest peer's downlink, N the relays and peers, s the shard size.
``peer_percentiles_s[step]``: percentiles of honest peers' durations (publication to commit).
``progress``: across honest peers, percentiles of the fraction of version 0's shards verified
(never above 1), at ``PROGRESS_POINTS + 1`` times from version 0's publication until the last
peer's last shard; the report draws them as bands, which stays readable at 1,000 peers.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from simulations.topology import Topology

PROGRESS_POINTS = 100
PROGRESS_QUANTILES = (0, 10, 50, 90, 100)


def bound_s(topo: Topology) -> float:
    """The DESIGN.md lower bound for one full version to every relay and peer, seconds."""
    ck = topo.spec.checkpoint
    peers = [n for n in topo.nodes if n.role == "peer" and n.behavior == "honest"]
    followers = [n for n in topo.nodes if n.role != "origin"]
    b = min(n.down_bps for n in peers or followers)
    n = len(followers)
    return ck.size_bytes / b + (math.ceil(math.log2(n + 1)) - 1) * ck.shard_size_bytes / b


def progress_bands(shard_times: list[list[float]], t0: float, n_shards: int) -> dict[str, Any]:
    """Percentiles across peers of the fraction of shards verified over time (the schema's
    ``progress``).

    Args:
        shard_times: per peer, the times its shards of the version were verified, seconds.
        t0: the version's publication time, seconds (same clock).
        n_shards: shards in the version; a peer's fraction is capped at 1 (a shard verified
            twice, e.g. after a resumed download, does not count twice).

    Returns:
        ``{}`` when no peer verified anything.
    """
    curves = [np.sort(np.asarray(ts, dtype=float)) - t0 for ts in shard_times if ts]
    if not curves or n_shards <= 0:
        return {}
    end = max(float(c[-1]) for c in curves)
    grid = np.linspace(0.0, max(end, 1e-9), PROGRESS_POINTS + 1)
    frac = np.stack([np.searchsorted(c, grid, side="right") for c in curves]) / n_shards
    frac = np.minimum(frac, 1.0)
    q = np.percentile(frac, PROGRESS_QUANTILES, axis=0)
    return {
        "step": "0",
        "peers": len(curves),
        "t_s": [round(float(t), 4) for t in grid],
        "quantiles": {
            str(p): [round(float(x), 4) for x in row]
            for p, row in zip(PROGRESS_QUANTILES, q, strict=True)
        },
    }


def finish(summary: dict[str, Any], topo: Topology) -> dict[str, Any]:
    """Fill the per-run aggregates from the per-node entries (shared by both modes)."""
    nodes = summary["nodes"]
    last: dict[str, float] = {}
    mean: dict[str, float] = {}
    committed: dict[str, int] = {}
    pct: dict[str, dict[str, float]] = {}
    ready: dict[str, float] = {}
    steps = sorted({s for n in nodes.values() for s in n["versions"]}, key=int)
    for step in steps:
        ds = [
            n["versions"][step]["duration_s"]
            for n in nodes.values()
            if n["role"] == "peer"
            and n["behavior"] == "honest"
            and step in n["versions"]
            and n["versions"][step].get("duration_s") is not None
        ]
        rs = [
            n["versions"][step]["ready_duration_s"]
            for n in nodes.values()
            if n["role"] == "peer"
            and n["behavior"] == "honest"
            and "ready_duration_s" in n["versions"].get(step, {})
        ]
        if rs:
            ready[step] = round(max(rs), 3)
        if ds:
            last[step] = round(max(ds), 3)
            mean[step] = round(sum(ds) / len(ds), 3)
            committed[step] = len(ds)
            p50, p90, p99 = np.percentile(ds, (50, 90, 99))
            pct[step] = {
                "p50": round(float(p50), 3),
                "p90": round(float(p90), 3),
                "p99": round(float(p99), 3),
                "max": round(max(ds), 3),
            }
    tiers: dict[str, dict[str, float]] = defaultdict(lambda: {"bytes_up": 0, "bytes_down": 0})
    for n in nodes.values():
        t = tiers[n["role"]]
        t["bytes_up"] += n["bytes_up"]
        t["bytes_down"] += n["bytes_down"]
        t["nodes"] = t.get("nodes", 0) + 1
    origin = next(n for n in nodes.values() if n["role"] == "origin")
    summary["tiers"] = dict(tiers)
    run = summary.setdefault("run", {})
    run.update(
        {
            "time_to_last_peer_s": last,
            "time_to_last_ready_s": ready,
            "mean_peer_s": mean,
            "peers_committed": committed,
            "peer_percentiles_s": pct,
            "time_to_last_peer_max_s": max(last.values()) if last else None,
            "origin_egress_bytes": origin["bytes_up"],
            "bound_s": round(bound_s(topo), 3),
        }
    )
    return summary
