"""Where a broadcast's seconds went, from the nodes' DEBUG logs: per-link rates and the tail.

Reads the logs a ``bench/broadcast.py --shaped ... --log-level DEBUG --keep`` run kept (one
``<node>.log`` per node in ``<run dir>/logs``) and prints, for one step:

* per follower, the MB/s (1e6 bytes) it received in each ``--bin-s`` window after the
  origin's ``version_announced``, its commit time, bytes by source and transfer outcomes;
* per source, the MB/s it sent (taken from the receivers' events), so a saturated uplink (the
  origin's, ~23.9 MB/s of payload on a ``tc tbf`` 200 Mb/s link) and idle ones show;
* the mean number of transfers in flight per follower;
* with ``--tail S``, every transfer of ``--tail-node`` ending after S seconds, with the first
  holders of its shard and when they completed it (shards fetched late that others held long
  before, slow last transfers).

Each ``transfer_ended`` event (:mod:`shardcast.download.downloader`, DEBUG) gives the bytes and
duration of one request; its bytes are spread evenly over its duration. Times are the log
lines' wall-clock times (ms), so the nodes must share a clock (one machine, namespaces).

Usage::

    python bench/transfers.py RUN_DIR/logs [--step 0] [--bin-s 5] [--tail 52 --tail-node peer4]
"""

from __future__ import annotations

import argparse
import collections
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

_TRANSFER = re.compile(
    r"transfer_ended step=(\d+) shard=(\d+) encoding=\S+ source=(\S+) start=(\d+) "
    r"length=(\d+) outcome=(\S+) bytes=(\d+) s=([\d.]+)"
)
_HOST = re.compile(r"host_started peer_id=(\S+)")


@dataclass(frozen=True)
class Transfer:
    """One request as its receiver logged it; times in seconds after the announcement."""

    receiver: str
    source: str
    shard: int
    start: int
    length: int
    outcome: str
    bytes: int
    t0: float
    t1: float


def _time(line: str) -> float:
    """Wall-clock time (s since the epoch) of a log line starting ``YYYY-mm-ddTHH:MM:SS.mmm``."""
    return datetime.strptime(line[:23], "%Y-%m-%dT%H:%M:%S.%f").timestamp()


def _lines(path: Path) -> Iterator[str]:
    with path.open() as fh:
        yield from fh


def load(logs: Path, step: int) -> tuple[list[Transfer], dict[str, float]]:
    """Every ``transfer_ended`` of ``step`` in ``logs/*.log`` and each follower's commit time.

    Raises:
        ValueError: ``origin.log`` has no ``version_announced`` of ``step``.
    """
    t0 = None
    for line in _lines(logs / "origin.log"):
        if "version_announced" in line and f" step={step} " in line:
            t0 = _time(line)
            break
    if t0 is None:
        raise ValueError(f"{logs / 'origin.log'}: no version_announced step={step}")
    names: dict[str, str] = {}  # short id as logged (*<last 8>) -> node name
    for f in logs.glob("*.log"):
        for line in _lines(f):
            m = _HOST.search(line)
            if m:
                names["*" + m.group(1)[-8:]] = f.stem
                break
    out: list[Transfer] = []
    commits: dict[str, float] = {}
    for f in sorted(logs.glob("*.log")):
        for line in _lines(f):
            m = _TRANSFER.search(line)
            if m and int(m.group(1)) == step:
                end = _time(line) - t0
                out.append(
                    Transfer(
                        f.stem,
                        names.get(m.group(3), m.group(3)),
                        int(m.group(2)),
                        int(m.group(4)),
                        int(m.group(5)),
                        m.group(6),
                        int(m.group(7)),
                        end - float(m.group(8)),
                        end,
                    )
                )
            elif "version_committed" in line and f" step={step} " in line and f.stem not in commits:
                commits[f.stem] = _time(line) - t0
    return out, commits


def binned(transfers: list[Transfer], bin_s: float) -> dict[int, float]:
    """Bytes per ``bin_s`` window, each transfer's bytes spread evenly over its duration."""
    bins: dict[int, float] = collections.defaultdict(float)
    for t in transfers:
        if t.bytes <= 0 or t.t1 <= t.t0:
            continue
        rate, at = t.bytes / (t.t1 - t.t0), t.t0
        while at < t.t1:
            nxt = min(t.t1, (int(at // bin_s) + 1) * bin_s)
            bins[int(at // bin_s)] += rate * (nxt - at)
            at = nxt
    return bins


def report(transfers: list[Transfer], commits: dict[str, float], bin_s: float) -> list[str]:
    """The rate tables (see module docstring) as lines."""
    n_bins = int(max((t.t1 for t in transfers), default=0) // bin_s) + 1

    def row(bins: dict[int, float]) -> str:
        return " ".join(f"{bins.get(i, 0.0) / bin_s / 1e6:5.1f}" for i in range(n_bins))

    lines = [f"received MB/s per {bin_s:g} s after the announcement"]
    by_rcv = collections.defaultdict(list)
    by_src = collections.defaultdict(list)
    for t in transfers:
        by_rcv[t.receiver].append(t)
        by_src[t.source].append(t)
    for name, ts in sorted(by_rcv.items()):
        commit = commits.get(name)
        lines.append(
            f"{name:8s} commit={'-' if commit is None else f'{commit:.2f}'} "
            f"{row(binned(ts, bin_s))}"
        )
        src = collections.Counter({t.source: 0 for t in ts})
        for t in ts:
            src[t.source] += t.bytes
        outcomes = collections.Counter(t.outcome for t in ts)
        lines.append(
            "         MB by source "
            + ", ".join(f"{k}={v / 1e6:.0f}" for k, v in sorted(src.items()))
            + "; outcomes "
            + ", ".join(f"{k}={v}" for k, v in sorted(outcomes.items()))
        )
    lines.append(f"sent MB/s per {bin_s:g} s (by source, from the receivers' events)")
    for name, ts in sorted(by_src.items()):
        total = sum(t.bytes for t in ts) / 1e6
        lines.append(f"{name:8s} total={total:6.0f} MB {row(binned(ts, bin_s))}")
    for name, ts in sorted(by_rcv.items()):
        span = max(t.t1 for t in ts) - min(t.t0 for t in ts)
        busy = sum(t.t1 - t.t0 for t in ts)
        lines.append(f"{name:8s} transfers in flight, mean {busy / span:.2f}")
    return lines


def tail(transfers: list[Transfer], node: str, after_s: float) -> list[str]:
    """``node``'s transfers ending after ``after_s``, with the shard's first other holders."""
    done: dict[str, dict[int, float]] = collections.defaultdict(dict)
    for t in transfers:
        if t.outcome == "OK" and t.bytes:
            done[t.receiver][t.shard] = max(done[t.receiver].get(t.shard, 0.0), t.t1)
    lines = [
        f"{node}: transfers ending after {after_s:g} s (holders: who completed the shard, when)"
    ]
    for t in sorted(
        (t for t in transfers if t.receiver == node and t.t1 > after_s), key=lambda t: t.t0
    ):
        holders = sorted(
            (round(v[t.shard], 1), k) for k, v in done.items() if t.shard in v and k != node
        )
        lines.append(
            f"{t.t0:6.2f}-{t.t1:6.2f} shard={t.shard:3d} src={t.source:7s} "
            f"from={t.start >> 20:3d}MiB got={t.bytes >> 20:3d}MiB {t.outcome:9s} "
            f"holders={holders[:3]}"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("logs", type=Path, help="a kept run's logs directory")
    ap.add_argument("--step", type=int, default=0)
    ap.add_argument("--bin-s", type=float, default=5.0)
    ap.add_argument("--tail", type=float, default=None, help="seconds: list later transfers")
    ap.add_argument("--tail-node", default="peer4")
    args = ap.parse_args()
    transfers, commits = load(args.logs, args.step)
    print("\n".join(report(transfers, commits, args.bin_s)))
    if args.tail is not None:
        print("\n".join(tail(transfers, args.tail_node, args.tail)))


if __name__ == "__main__":
    main()
