"""The standalone origin's cost of a next version: ``hash_parts`` diffing the files on disk.

What ``shardnet origin --watch`` spends once a trainer's step directory is complete (no
pre-encoding): read every file of version 1 and its base (version 0), hash each shard (BLAKE3
digest and 1 MiB chunk list), delta-encode it (``sparse``, ``xor-zstd`` where denser), write
the blobs. Builds (or reuses, cached like ``bench/broadcast.py``) a ``real-1b`` checkpoint and
its next version after one Adam step at lr 1e-6.

Each measurement runs in a fresh process (``--one``) so the variants do not share caches of
Python objects; the files stay in the page cache (warmed first). Variants, alternating over
``--repeat`` rounds: ``old`` (``--old-tree``, a checkout of an earlier commit, e.g.
``git archive <commit> | tar -x -C /tmp/old``), and this tree with ``workers=1`` and with
``--workers`` threads. Reports per variant the median wall time and process CPU-seconds
(every thread's), the ratios against the first variant, and checks that all variants give
identical parts. The machine may be shared: the ratios, taken side by side, are what to read.
``--old-workers`` sets the old variant's threads; ``--v0``/``--v1`` measure two directories
prepared elsewhere instead of ``--preset``'s.

    .venv/bin/python bench/origin_delta.py --old-tree /tmp/old --cache /dev/shm/bench

Measured (2026-12-03, 2 cores, 16 MiB shards, sparse + xor-zstd offered, 3 alternating rounds,
medians; the machine shared with another helper's follower benchmark, 1-min load 5-7, so
CPU-seconds are inflated and noisy), ``old`` = commit 5470a70 (whole 16 MiB shards read with
``preadv``, then hashed, chunk-hashed and compared each in its own pass), ``this`` = shards
read, hashed (shard and 1 MiB chunk) and compared 1 MiB piece by piece while the piece is in
cache (``plan.scan_shard``), the shard's BLAKE3 on one thread:

============================  ==================  ==================  ==================
checkpoint (changed words)    old, 2 threads      this, 2 threads     this, 1 thread
============================  ==================  ==================  ==================
real-1b, 1.32 GB (1.75 %)     2.73 CPU-s, 5.1 s   2.50 CPU-s, 4.5 s   2.37 CPU-s, 3.5 s
  same, another run, load 5.7 2.89 CPU-s, 3.5 s   2.40 CPU-s, 2.7 s   2.43 CPU-s, 2.8 s
real-6b, 6.03 GB (0.38 %)     8.82 CPU-s, 15.7 s  5.94 CPU-s, 8.0 s   5.70 CPU-s, 10.4 s
============================  ==================  ==================  ==================

(real-6b: the same number of changed elements as real-1b, ``bench/scaled.py``, 512 MB files.)
Parts and blobs identical in every run. Where the time goes now (real-1b, one thread,
cProfile, load 6: 2.87 s wall, 2.36 CPU-s): ``preadv`` of both versions 0.72 s, the
changed-word scan 0.77 s (``nonzero`` 0.28 s of it), BLAKE3 of shards 0.28 s and of chunks
0.28 s, zstd of the sparse planes 0.27 s, the planes' gaps (``np.diff``) 0.15 s.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def one(v0: Path, v1: Path, shard_size: int, workers: int, scratch: Path) -> dict[str, Any]:
    """One ``hash_parts`` of ``v1`` against ``v0`` in this process (its code from
    ``sys.path``); returns the timings and a digest of the parts."""
    from shardcast.publish import Base, hash_parts, make_header
    from shardcast.wire import codecs

    base = Base(0, "ab" * 32, v0)
    header = dataclasses.replace(make_header(v1, "bench", 1, shard_size, 16, base), nonce="00" * 16)
    blob_dir = Path(tempfile.mkdtemp(prefix="origin-delta-", dir=scratch))
    extra: dict[str, Any] = (
        {"workers": workers} if workers > 1 else {}
    )  # an old tree has no such argument
    wall, cpu = time.perf_counter(), time.process_time()
    parts = hash_parts(
        v1,
        header,
        header.digest(),
        encodings=(codecs.SPARSE, codecs.XOR_ZSTD),
        base=base,
        blob_dir=blob_dir,
        on_part=lambda p: None,
        **extra,
    )
    row: dict[str, Any] = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}
    blobs = hashlib.sha256()
    for p in sorted(blob_dir.iterdir(), key=lambda p: p.name):
        blobs.update(p.name.encode() + p.read_bytes())
    shutil.rmtree(blob_dir)
    row["parts"] = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    row["blobs"] = blobs.hexdigest()[:16]
    row["shards"] = len(header.shards)
    return row


def _run(tree: Path, a: argparse.Namespace, v0: Path, v1: Path, workers: int) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, str(ROOT / "bench" / "origin_delta.py"), "--one", "--v0", str(v0)]
    cmd += ["--v1", str(v1), "--workers", str(workers), "--shard-size", str(a.shard_size)]
    cmd += ["--cache", str(a.cache)]
    out = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="real-1b")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--shard-size", type=int, default=16 << 20, help="bytes")
    ap.add_argument("--workers", type=int, default=2, help="threads of the last variant")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--old-tree", type=Path, help="a checkout of the code to compare with")
    ap.add_argument("--old-workers", type=int, default=1, help="threads of the old variant")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/shardnet-bench-cache"))
    ap.add_argument("--one", action="store_true", help="(internal) one measurement")
    ap.add_argument("--v0", type=Path, help="a base version to use instead of --preset's")
    ap.add_argument("--v1", type=Path, help="its next version")
    a = ap.parse_args()
    if a.one:
        sys.path.insert(0, os.environ.get("PYTHONPATH", str(ROOT)))
        print(json.dumps(one(a.v0, a.v1, a.shard_size, a.workers, a.cache)))
        return
    sys.path.insert(0, str(ROOT))
    from bench.broadcast import prepare_checkpoints

    if a.v0 and a.v1:  # directories prepared elsewhere (e.g. a real-6b cache already made)
        v0, v1, info = a.v0, a.v1, {"v0": str(a.v0), "v1": str(a.v1)}
    else:
        v0, v1, info = prepare_checkpoints(a.cache, a.preset, a.lr, 1 << 30)
    for p in [*v0.iterdir(), *v1.iterdir()]:  # warm the page cache
        p.read_bytes()
    variants = [(f"this_w{a.workers}", ROOT, a.workers), ("this_w1", ROOT, 1)]
    if a.old_tree:
        variants.insert(0, (f"old_w{a.old_workers}", a.old_tree, a.old_workers))
    rows: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in variants}
    for k in range(a.repeat):
        for name, tree, workers in variants if k % 2 == 0 else variants[::-1]:
            rows[name].append(_run(tree, a, v0, v1, workers))
    if len({(r["parts"], r["blobs"]) for rs in rows.values() for r in rs}) != 1:
        raise SystemExit(f"variants gave different parts or blobs: {rows}")
    med = {
        n: {k: round(statistics.median(r[k] for r in rs), 3) for k in ("wall_s", "cpu_s")}
        for n, rs in rows.items()
    }
    first = med[variants[0][0]]
    report = {
        "checkpoint": info,
        "shards": rows[variants[0][0]][0]["shards"],
        "shard_size": a.shard_size,
        "repeat": a.repeat,
        "load_avg_1min": round(os.getloadavg()[0], 2),
        "median": med,
        "over_first": {
            n: {k: round(m[k] / first[k], 3) for k in ("wall_s", "cpu_s")} for n, m in med.items()
        },
        "runs": {
            n: [{k: round(r[k], 3) for k in ("wall_s", "cpu_s")} for r in rs]
            for n, rs in rows.items()
        },
        "identical_parts_and_blobs": True,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
