"""Per-stage timeline of one broadcast: where the seconds between the trainer's ``DONE`` and
the last peer's commit go.

Runs the loopback topology of :mod:`bench.broadcast` (1 origin, 2 relays, 4 peers on
127.0.0.1) on two checkpoint versions with the nodes' logs at DEBUG, keeps their logs, and
reads each node's wall-clock log times (ISO 8601, ms) for the events of one step:

==================  ========================================================================
stage               log event (node)
==================  ========================================================================
announced           ``version_announced`` (origin: header signed, gossip sent)
published           ``version_published`` (origin: every part hashed, signed)
learned             first ``announcement_received`` (relay/peer: gossip or info poll)
started             ``download_started`` (relay/peer: manifest fetched, download begins)
first_source        first ``source_added`` (relay/peer: a discovered node joined)
first_byte          ``first_byte`` (relay/peer)
first_shard         first ``shard_verified``
last_shard          last ``shard_verified``
committed           ``version_committed`` (relay/peer: files re-hashed, renamed)
detected            the benchmark saw the peer's ``step-N/manifest.json`` (its own 20 ms poll)
==================  ========================================================================

Every time is seconds after the ``DONE`` marker was written (its mtime). Prints one row per
node and stage, and the medians over the peers; then per node, over the same window (DONE to
the last peer's commit): CPU-seconds, thread-seconds spent runnable but waiting for a CPU and
of those the event loop thread's (``/proc/PID/task/*/schedstat``: on a shared machine these
say whether a node waited for timers and peers or for a CPU), and the sums of its
``shard_fetched``/``shard_checked`` debug events. ``--repeats N`` shows medians over N runs,
``--out FILE`` keeps every run, ``--json`` prints the medians.

    .venv/bin/python bench/timeline.py --v0 DIR --v1 DIR [--repeats 3] [--json] [--keep]

(or ``--preset real-1b --size-bytes 60000000`` to cut the benchmark's cached checkpoints).
"""

from __future__ import annotations

import argparse
import datetime
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parent))
import broadcast  # bench/ is not a package

RUN_ID = broadcast.RUN_ID
STAGES = (
    "announced",
    "published",
    "learned",
    "started",
    "first_source",
    "first_byte",
    "first_shard",
    "last_shard",
    "committed",
    "detected",
)


Samples = list[tuple[float, dict[str, tuple[int, int, int]]]]
"""``(unix time, {node: (ns on a CPU, ns waiting for one, of which the main thread's)})``."""


def _ts(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def parse_log(text: str, step: int) -> dict[str, float]:
    """Wall-clock Unix times of the first (``last_shard``: last) of each stage's event for
    ``step`` in one node's log text (lines ``<ISO> <LEVEL> <logger> <event> k=v ...``)."""
    out: dict[str, float] = {}
    events = {
        "version_announced": "announced",
        "version_published": "published",
        "announcement_received": "learned",
        "source_added": "first_source",
        "first_byte": "first_byte",
        "shard_verified": "first_shard",
        "version_committed": "committed",
        "download_started": "started",
    }
    for line in text.splitlines():
        tokens = line.split(" ")
        if len(tokens) < 4 or not tokens[0].endswith("Z"):
            continue
        # ``<ISO> <LEVEL> [<node name>] <logger> <event> k=v ...``
        event = next((t for t in tokens[2:5] if t in events), None)
        if event is None or f"step={step}" not in tokens:
            continue
        try:
            t = _ts(tokens[0])
        except ValueError:
            continue
        out.setdefault(events[event], t)
        if event == "shard_verified":
            out["last_shard"] = t
    return out


def timeline(workdir: Path, step: int, detected: dict[str, float]) -> dict[str, dict[str, float]]:
    """Per node, seconds after ``DONE`` of each stage of ``step`` (from the kept logs)."""
    t0 = (workdir / "publish" / f"step-{step}" / "DONE").stat().st_mtime
    rows: dict[str, dict[str, float]] = {}
    for log in sorted((workdir / "logs").glob("*.log")):
        times = parse_log(log.read_text(errors="replace"), step)
        row = {k: round(v - t0, 3) for k, v in times.items()}
        if log.stem in detected:
            row["detected"] = round(detected[log.stem], 3)
        rows[log.stem] = row
    return rows


def shard_costs(text: str, start: float, end: float) -> dict[str, float]:
    """Sums of the ``shard_fetched`` (``fetch_s``: request to last byte) and ``shard_checked``
    (``verify_s``: decode, hash and write in a worker thread, queueing included) debug events
    logged between Unix times ``start`` and ``end``."""
    out = {"fetches": 0.0, "fetch_s": 0.0, "checks": 0.0, "verify_s": 0.0, "max_verify_s": 0.0}
    for line in text.splitlines():
        tokens = line.split(" ")
        if len(tokens) < 4 or not tokens[0].endswith("Z"):
            continue
        event = next((t for t in tokens[2:5] if t in ("shard_fetched", "shard_checked")), None)
        if event is None:
            continue
        try:
            t = _ts(tokens[0])
        except ValueError:
            continue
        if not start <= t <= end:
            continue
        kv = dict(x.split("=", 1) for x in tokens if "=" in x)
        if event == "shard_fetched":
            out["fetches"] += 1
            out["fetch_s"] += float(kv.get("fetch_s", 0))
        else:
            out["checks"] += 1
            v = float(kv.get("verify_s", 0))
            out["verify_s"] += v
            out["max_verify_s"] = max(out["max_verify_s"], v)
    return {k: round(v, 3) for k, v in out.items()}


def node_pids(marker: str) -> dict[str, int]:
    """``{node name: pid}`` of the benchmark's node processes (their command line names
    ``marker``, the run directory; the node is the last part of its ``--data-dir``)."""
    out: dict[str, int] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            argv = (d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        args = [a.decode(errors="replace") for a in argv]
        if "shardnet.cli" not in args or "--data-dir" not in args:
            continue
        data_dir = args[args.index("--data-dir") + 1]
        if data_dir.startswith(marker):
            out[Path(data_dir).name] = int(d.name)
    return out


def schedstat(pid: int) -> tuple[int, int, int]:
    """(ns on a CPU, ns runnable but waiting for a CPU) summed over the process's threads
    (``/proc/PID/task/*/schedstat``; threads that exited are not counted), and the ns its
    main thread (the trio event loop) waited for a CPU."""
    run = wait = main = 0
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:
        return 0, 0, 0
    for t in tasks:
        try:
            fields = (t / "schedstat").read_text().split()
        except OSError:
            continue
        run += int(fields[0])
        wait += int(fields[1])
        if t.name == str(pid):
            main = int(fields[1])
    return run, wait, main


async def sample_sched(marker: str, samples: Samples) -> None:
    """Append ``(unix time, {node: schedstat})`` every 50 ms until cancelled."""
    while True:
        pids = node_pids(marker)
        samples.append((time.time(), {n: schedstat(p) for n, p in pids.items()}))
        await trio.sleep(0.05)


def cpu_window(samples: Samples, start: float, end: float) -> dict[str, dict[str, float]]:
    """Per node, seconds on a CPU and seconds runnable-but-waiting between the samples
    nearest ``start`` (at or before) and ``end`` (at or after)."""
    before = [s for s in samples if s[0] <= start]
    after = [s for s in samples if s[0] >= end]
    if not before or not after:
        return {}
    a, b = before[-1][1], after[0][1]
    return {
        n: {
            "on_cpu_s": round((b[n][0] - a[n][0]) / 1e9, 3),
            "runq_wait_s": round((b[n][1] - a[n][1]) / 1e9, 3),
            "loop_runq_s": round((b[n][2] - a[n][2]) / 1e9, 3),
        }
        for n in sorted(a)
        if n in b
    }


def print_timeline(rows: dict[str, dict[str, float]]) -> None:
    names = list(rows)
    head = "".join(f"{n:>9}" for n in names)
    print(f"{'stage (s after DONE)':<22}{head}{'peers med':>11}")
    for stage in STAGES:
        vals = [rows[n].get(stage) for n in names]
        if all(v is None for v in vals):
            continue
        peers = [rows[n][stage] for n in names if n.startswith("peer") and stage in rows[n]]
        med = f"{statistics.median(peers):>11.3f}" if peers else f"{'':>11}"
        print(
            f"{stage:<22}"
            + "".join(f"{v:>9.3f}" if v is not None else f"{'-':>9}" for v in vals)
            + med
        )


def print_costs(sched: dict[str, dict[str, float]], shards: dict[str, dict[str, float]]) -> None:
    """Per node: CPU seconds, seconds waiting for a CPU, shard requests and checks."""
    print(
        f"{'node':<8}{'on-cpu s':>10}{'runq s':>9}{'loop rq s':>10}{'fetches':>9}{'fetch s':>9}"
        f"{'checks':>8}{'verify s':>10}{'max ver s':>11}"
    )
    for n in sorted(set(sched) | set(shards)):
        c, k = sched.get(n, {}), shards.get(n, {})
        print(
            f"{n:<8}{c.get('on_cpu_s', 0):>10.2f}{c.get('runq_wait_s', 0):>9.2f}"
            f"{c.get('loop_runq_s', 0):>10.2f}"
            f"{k.get('fetches', 0):>9.0f}{k.get('fetch_s', 0):>9.2f}{k.get('checks', 0):>8.0f}"
            f"{k.get('verify_s', 0):>10.2f}{k.get('max_verify_s', 0):>11.3f}"
        )


async def one_run(v0: Path, v1: Path, wd: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One broadcast of both versions in ``wd``; the per-step timeline, CPU and shard costs."""
    samples: Samples = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sample_sched, str(wd), samples)
        res = await broadcast.run_shardnet(
            v0,
            v1,
            wd,
            deltas=True,
            shard_size=args.shard_size,
            timeout_s=args.timeout,
            log_level="DEBUG",
        )
        nursery.cancel_scope.cancel()
    out: dict[str, Any] = {"versions": res["versions"]}
    out.update(timeline={}, sched={}, shards={})
    for v in res["versions"]:
        step = v["step"]
        out["timeline"][step] = timeline(wd, step, v["peers_s"])
        t0 = (wd / "publish" / f"step-{step}" / "DONE").stat().st_mtime
        out["sched"][step] = cpu_window(samples, t0, t0 + v["last_s"])
        out["shards"][step] = {
            log.stem: shard_costs(log.read_text(errors="replace"), t0, t0 + v["last_s"])
            for log in sorted((wd / "logs").glob("*.log"))
        }
    return out


def median_of(runs: list[dict[str, Any]], key: str, step: int) -> dict[str, dict[str, float]]:
    """``runs[*][key][step][node][field]`` -> the median over the runs that have it."""
    nodes = sorted({n for r in runs for n in r[key][step]})
    out: dict[str, dict[str, float]] = {}
    for n in nodes:
        fields = sorted({f for r in runs for f in r[key][step].get(n, {})})
        out[n] = {
            f: round(statistics.median(vals), 3)
            for f in fields
            if (vals := [r[key][step][n][f] for r in runs if f in r[key][step].get(n, {})])
        }
    return out


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    if args.v0 and args.v1:
        v0, v1 = Path(args.v0), Path(args.v1)
    else:
        v0, v1, _ = broadcast.prepare_checkpoints(
            Path(args.cache), args.preset, args.lr, args.max_shard_bytes
        )
        if args.size_bytes:
            v0, v1, _ = broadcast.subset_versions(v0, v1, v0.parent, args.size_bytes)
    root = Path(tempfile.mkdtemp(prefix="shardnet-timeline-", dir=args.workdir))
    runs = []
    try:
        for rep in range(args.repeats):
            print(f"# run {rep + 1}/{args.repeats}", file=sys.stderr, flush=True)
            runs.append(await one_run(v0, v1, root / f"run-{rep}", args))
    finally:
        if args.keep:
            print(f"# kept: {root}", file=sys.stderr)
        else:
            shutil.rmtree(root, ignore_errors=True)
    steps = [v["step"] for v in runs[0]["versions"]]
    return {
        "repeats": len(runs),
        "last_s": {s: [r["versions"][s]["last_s"] for r in runs] for s in steps},
        "timeline": {s: median_of(runs, "timeline", s) for s in steps},
        "sched": {s: median_of(runs, "sched", s) for s in steps},
        "shards": {s: median_of(runs, "shards", s) for s in steps},
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--v0", default=None, help="first version's checkpoint directory")
    ap.add_argument("--v1", default=None, help="next version's checkpoint directory")
    ap.add_argument("--preset", default="real-1b")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--max-shard-bytes", type=int, default=128 << 20)
    ap.add_argument("--size-bytes", type=int, default=60_000_000)
    ap.add_argument("--cache", default="/tmp/shardnet-bench-cache")
    ap.add_argument("--shard-size", type=int, default=16 << 20, help="shardnet shard size")
    ap.add_argument("--timeout", type=float, default=300.0, help="per version, seconds")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--keep", action="store_true", help="keep the run directory and logs")
    ap.add_argument("--repeats", type=int, default=1, help="runs; tables show medians")
    ap.add_argument("--out", default=None, help="also write everything (every run) here")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = trio.run(amain, args)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "runs"}, default=str))
        return 0
    for step, last in out["last_s"].items():
        print(f"# step {step}: last peer s per run {last}; medians over {out['repeats']} runs:")
        print_timeline(out["timeline"][step])
        print_costs(out["sched"][step], out["shards"][step])
    return 0


if __name__ == "__main__":
    sys.exit(main())
