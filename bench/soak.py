"""Soak: one version every ``--interval-s`` for ``--duration-s`` on real processes; RSS and fds.

The cluster of ``bench/chaos.py`` (an origin publishing through ``--watch``, relays, download-only
followers, every node on 127.0.0.1) receives a new version every interval (the previous one
with a few bytes changed, so every version after the first is a delta). After each version
has reached every follower, each node's RSS and open file descriptors are sampled (psutil).

Target of the issue "No packet crashes a node…": over the last two thirds of the run (the last
20 minutes of the default 30), the least-squares trend of each node's RSS and fd count changes
by at most 10 % of its mean. A warm-up third is left out (caches, first allocations).

    .venv/bin/python bench/soak.py --json                      # 30 minutes
    .venv/bin/python bench/soak.py --duration-s 120 --json     # a short check
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.chaos import Cluster, Node, Settings, make_checkpoint, next_version

MB = 1 << 20
TARGET_TREND = 0.10


def _sample(node: Node) -> tuple[int, int] | None:
    """(RSS bytes, open fds) of a live node, else None."""
    if node.proc is None or node.proc.poll() is not None:
        return None
    try:
        p = psutil.Process(node.proc.pid)
        return int(p.memory_info().rss), int(p.num_fds())
    except psutil.Error:
        return None


def trend(ts: list[float], values: list[float]) -> float | None:
    """Change of the least-squares line over ``ts``'s span, relative to the mean of ``values``.

    Returns:
        ``slope * (t_last - t_first) / mean``, or None with fewer than 3 samples.
    """
    if len(ts) < 3 or not np.mean(values):
        return None
    slope = float(np.polyfit(np.asarray(ts), np.asarray(values, dtype=float), 1)[0])
    return slope * (ts[-1] - ts[0]) / float(np.mean(values))


async def soak(root: Path, s: Settings, duration_s: float, interval_s: float) -> dict[str, Any]:
    """Run the soak in ``root``; returns the report (see the module docstring)."""
    cluster = Cluster(root / "soak", s, keep_last=3)
    ckpts = root / "ckpts"
    samples: dict[str, list[tuple[float, int, int]]] = {}
    latencies: list[float] = []
    missed: list[int] = []
    prev = make_checkpoint(ckpts / "v0", s)
    await cluster.start()
    t_start = time.perf_counter()
    step = 0
    try:
        while time.perf_counter() - t_start < duration_s:
            tick = time.perf_counter()
            if step:
                prev = next_version(prev, ckpts / f"v{step}", seed=step)
            t0 = cluster.publish(step, prev)
            done = await cluster.wait_commits(step, cluster.followers, t0, 5 * interval_s)
            if any(v is None for v in done.values()):
                missed.append(step)
            else:
                latencies.append(max(v for v in done.values() if v is not None))
            now = time.perf_counter() - t_start
            for n in cluster.nodes:
                got = _sample(n)
                if got is not None:
                    samples.setdefault(n.name, []).append((now, *got))
            for old in (step - 2,):  # bound the disk: the origin has hard links of what it keeps
                if old >= 0:
                    shutil.rmtree(ckpts / f"v{old}", ignore_errors=True)
                    shutil.rmtree(cluster.publish_dir / f"step-{old}", ignore_errors=True)
            step += 1
            await trio.sleep(max(0.0, interval_s - (time.perf_counter() - tick)))
    finally:
        alive = {n.name: n.alive() for n in cluster.nodes}
        await cluster.stop()
    warm = duration_s / 3
    nodes: dict[str, Any] = {}
    ok = not missed and all(alive.values())
    for name, rows in samples.items():
        exit_code = next(n.exit_code for n in cluster.nodes if n.name == name)
        nodes[name], steady = _node_report(rows, warm, alive.get(name), exit_code)
        ok = ok and steady
    return {
        "settings": {
            "size_bytes": s.size_bytes,
            "shard_size": s.shard_size,
            "relays": s.relays,
            "followers": s.followers,
            "duration_s": duration_s,
            "interval_s": interval_s,
        },
        "versions": step,
        "versions_missed": missed,
        "commit_latency_s": {
            "median": round(float(np.median(latencies)), 3) if latencies else None,
            "max": round(max(latencies), 3) if latencies else None,
        },
        "nodes": nodes,
        "target_trend": TARGET_TREND,
        "meets_targets": ok,
        "note": "trends over the last two thirds; single shared machine",
    }


def _node_report(
    rows: list[tuple[float, int, int]], warm: float, alive: bool | None, exit_code: int | None
) -> tuple[dict[str, Any], bool]:
    """One node's report from its ``rows`` of (seconds since start, RSS bytes, open fds), with
    trends over the rows from ``warm`` seconds on; and whether both trends were measured and
    lie within :data:`TARGET_TREND`."""
    late = [r for r in rows if r[0] >= warm]
    ts = [r[0] for r in late]
    rss_trend = trend(ts, [r[1] for r in late])
    fd_trend = trend(ts, [r[2] for r in late])
    report = {
        "alive_at_end": alive,
        "exit_code": exit_code,
        "rss_mb_first": round(rows[0][1] / MB, 1),
        "rss_mb_last": round(rows[-1][1] / MB, 1),
        "rss_mb_max": round(max(r[1] for r in rows) / MB, 1),
        "fds_first": rows[0][2],
        "fds_last": rows[-1][2],
        "rss_trend": None if rss_trend is None else round(rss_trend, 4),
        "fd_trend": None if fd_trend is None else round(fd_trend, 4),
    }
    steady = all(t is not None and abs(t) <= TARGET_TREND for t in (rss_trend, fd_trend))
    return report, steady


def main() -> int:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--duration-s", type=float, default=1800.0)
    ap.add_argument("--interval-s", type=float, default=10.0)
    ap.add_argument("--size-bytes", type=int, default=64 << 20)
    ap.add_argument("--shard-size", type=int, default=1 << 20)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    s = Settings(size_bytes=a.size_bytes, files=2, shard_size=a.shard_size)
    with tempfile.TemporaryDirectory(prefix="shardnet-soak-") as tmp:
        report = trio.run(soak, Path(tmp), s, a.duration_s, a.interval_s)
    print(json.dumps(report, indent=2) if a.json else json.dumps(report))
    return 0 if report["meets_targets"] else 1


if __name__ == "__main__":
    sys.exit(main())
