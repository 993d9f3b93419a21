"""The run summary both modes produce (the JSON a report is made from).

Schema (times in seconds from the start of the run unless named ``duration``)::

    {"mode": "model" | "emulate", "topology": str, "seed": int, "notes": [str],
     "checkpoint": {"size_bytes", "shard_size_bytes", "n_shards", "versions", "scale"},
     "run": {"time_to_last_peer_s": {step: s}, "mean_peer_s": {step: s},
             "time_to_last_peer_max_s", "origin_egress_bytes", "bound_s",
             "rollouts": {"sent", "accepted", "rejected"}, "wall_s", "virtual_s"},
     "nodes": {name: {"role", "group", "behavior", "up_bps", "down_bps", "bytes_up",
                      "bytes_down", "versions": {step: {"published_s", "learned_s",
                      "first_byte_s", "commit_s", "duration_s", "digest_ok",
                      "rollouts_sent_s"}}}},
     "tiers": {role: {"bytes_up", "bytes_down", "nodes"}},
     "progress": {name: [[t_s, fraction_of_shards], ...]}}

``time_to_last_peer_s[step]``: from the version's publication until the last honest peer that
committed it did so. ``bound_s``: S/B + (ceil(log2(N+1)) - 1) s/B (DESIGN.md), with B the
slowest honest peer's downlink, N the relays and peers, s the shard size.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from simulations.model import Model
    from simulations.topology import Topology

PROGRESS_NODES = 12
PROGRESS_POINTS = 60


def bound_s(topo: Topology) -> float:
    """The DESIGN.md lower bound for one full version to every relay and peer, seconds."""
    ck = topo.spec.checkpoint
    peers = [n for n in topo.nodes if n.role == "peer" and n.behavior == "honest"]
    followers = [n for n in topo.nodes if n.role != "origin"]
    b = min(n.down_bps for n in peers or followers)
    n = len(followers)
    return ck.size_bytes / b + (math.ceil(math.log2(n + 1)) - 1) * ck.shard_size_bytes / b


def progress_curve(times: list[float], t0: float, n_shards: int) -> list[list[float]]:
    """Fraction of shards verified over time, sampled at ``PROGRESS_POINTS`` points."""
    if not times:
        return []
    ts = sorted(times)
    step = max(1, len(ts) // PROGRESS_POINTS)
    out = [[0.0, 0.0]] + [
        [round(ts[k] - t0, 4), round((k + 1) / n_shards, 4)] for k in range(0, len(ts), step)
    ]
    out.append([round(ts[-1] - t0, 4), round(len(ts) / n_shards, 4)])
    return out


def finish(summary: dict[str, Any], topo: Topology) -> dict[str, Any]:
    """Fill the per-run aggregates from the per-node entries (shared by both modes)."""
    nodes = summary["nodes"]
    last: dict[str, float] = {}
    mean: dict[str, float] = {}
    committed: dict[str, int] = {}
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
        if ds:
            last[step] = round(max(ds), 3)
            mean[step] = round(sum(ds) / len(ds), 3)
            committed[step] = len(ds)
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
            "mean_peer_s": mean,
            "peers_committed": committed,
            "time_to_last_peer_max_s": max(last.values()) if last else None,
            "origin_egress_bytes": origin["bytes_up"],
            "bound_s": round(bound_s(topo), 3),
        }
    )
    return summary


def model_summary(m: Model) -> dict[str, Any]:
    """The summary of a finished :class:`~simulations.model.Model` run."""
    topo = m.topo
    ck = topo.spec.checkpoint
    nodes: dict[str, Any] = {}
    progress: dict[str, Any] = {}
    peers = [n for n in m.nodes if n.spec.role == "peer"]
    sample = {p.spec.name for p in peers[:: max(1, len(peers) // PROGRESS_NODES)]}
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
            versions[str(step)] = entry
            if n.spec.name in sample and ver is not None and step == 0:
                progress[n.spec.name] = progress_curve(rec["shards_s"], ver.t_pub, len(ver.lengths))
        nodes[n.spec.name] = {
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
    summary: dict[str, Any] = {
        "mode": "model",
        "topology": topo.name,
        "source": str(topo.source) if topo.source else None,
        "seed": m.seed,
        "notes": [
            f"flow model: weighted max-min, time step {m.dt:.4g} s; simulator: SimPy",
            "policies: shardcast.select.Scheduler, SourceDirectory, SuperSeeding, "
            "versions_to_prune, catchup.plan (the real code)",
        ],
        "checkpoint": {
            "size_bytes": ck.size_bytes,
            "shard_size_bytes": ck.shard_size_bytes,
            "n_shards": math.ceil(ck.size_bytes / ck.shard_size_bytes),
            "versions": ck.versions,
            "scale": 1.0,
        },
        "run": {
            "rollouts": dict(m.rollouts),
            "wall_s": round(m.wall_s, 3),
            "virtual_s": round(m.env.now, 3),
            "time_step_s": m.dt,
            "seeding_refused": m.seeding.refused,
        },
        "nodes": nodes,
        "progress": progress,
    }
    return finish(summary, topo)
