"""The sparse delta encoder's cost per shard: today's encoder against the straightforward one.

``reference`` is the encoder as it was before the 64-bit pre-scan (compare every 16-bit word,
``np.concatenate`` the planes, copy them to bytes); ``current`` is
:func:`shardcast.wire.sparse.encode_sparse`. Both run on the same shards, alternating, and
must give the same bytes. Shards are either an RL-like bf16 update generated here
(``--changed`` of the elements moved by +-1 ulp, seeded) or, with ``--v0``/``--v1``, the
first ``--shards`` shards of two versions of a checkpoint file. Also reports the zstd level
and thread count of the planes (``--levels``), the blob size for each, and the time of
compressing the planes alone. Medians over ``--repeat`` runs; the machine is shared, so the
ratios, taken in one run, are what to read.

    .venv/bin/python bench/sparse_encode.py --shard-mib 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np
import zstandard

from shardcast.wire import changed_words, encode_sparse, encode_sparse_reference


def rl_shards(n: int, shard_bytes: int, changed: float, seed: int) -> list[tuple[bytes, bytes]]:
    """``n`` pairs (new, base) of bf16 bytes, ``changed`` of the elements moved +-1 ulp."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        f32 = rng.standard_normal(shard_bytes // 2).astype(np.float32) * 0.02
        base = (f32.view(np.uint32) >> 16).astype(np.uint16)
        new = base.copy()
        moved = rng.random(len(new)) < changed
        new[moved] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), int(moved.sum()))
        out.append((new.tobytes(), base.tobytes()))
    return out


def file_shards(v0: Path, v1: Path, n: int, shard_bytes: int) -> list[tuple[bytes, bytes]]:
    """The first ``n`` shards of the largest ``*.safetensors`` of ``v1`` and its base."""
    name = max(v1.glob("*.safetensors"), key=lambda p: p.stat().st_size).name
    a, b = (v1 / name).read_bytes(), (v0 / name).read_bytes()
    return [
        (a[o : o + shard_bytes], b[o : o + shard_bytes])
        for o in range(0, min(len(a), n * shard_bytes), shard_bytes)
    ]


def _time(fn: Any, pairs: list[tuple[bytes, bytes]]) -> tuple[float, float]:
    """(wall s, CPU s) of ``fn`` over every pair."""
    w, c = time.perf_counter(), time.process_time()
    for raw, base in pairs:
        fn(raw, base)
    return time.perf_counter() - w, time.process_time() - c


def main() -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shard-mib", type=int, default=16)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--changed", type=float, default=0.016, help="fraction of bf16 elements")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--v0", type=Path)
    ap.add_argument("--v1", type=Path)
    ap.add_argument("--levels", default="1,3", help="zstd levels of the planes to compare")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    shard_bytes = a.shard_mib << 20
    if a.v0 and a.v1:
        pairs = file_shards(a.v0, a.v1, a.shards, shard_bytes)
    else:
        pairs = rl_shards(a.shards, shard_bytes, a.changed, seed=1)
    for raw, base in pairs:
        if encode_sparse_reference(raw, base) != encode_sparse(raw, base):
            raise SystemExit("current and reference encoders differ")
    per = 1e3 / len(pairs)
    runs: dict[str, list[tuple[float, float]]] = {"reference": [], "current": [], "scan": []}
    for _ in range(a.repeat):
        runs["reference"].append(_time(encode_sparse_reference, pairs))
        runs["current"].append(_time(encode_sparse, pairs))
        runs["scan"].append(_time(changed_words, pairs))
    med = {
        k: {
            "wall_ms_per_shard": round(statistics.median(r[0] for r in v) * per, 2),
            "cpu_ms_per_shard": round(statistics.median(r[1] for r in v) * per, 2),
        }
        for k, v in runs.items()
    }
    planes_zstd: dict[str, Any] = {}
    for level in (int(x) for x in a.levels.split(",")):
        for threads in (0, 2):
            key = f"level{level}_threads{threads}"
            cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, threads=threads)
            plain = [encode_sparse(r, b, level=level) for r, b in pairs]
            planes = [zstandard.ZstdDecompressor().decompress(p[18:]) for p in plain]
            ts = []
            for _ in range(a.repeat):
                t = time.perf_counter()
                blobs = [cctx.compress(p) for p in planes]
                ts.append(time.perf_counter() - t)
            planes_zstd[key] = {
                "ms_per_shard": round(statistics.median(ts) * per, 2),
                "blob_bytes_per_shard": sum(len(b) + 18 for b in blobs) // len(pairs),
            }
    changed = sum(len(changed_words(r, b)[0]) for r, b in pairs) / sum(
        len(r) // 2 for r, _ in pairs
    )
    report = {
        "shards": len(pairs),
        "shard_bytes": shard_bytes,
        "changed_fraction": round(changed, 5),
        "source": "files" if a.v0 else "generated",
        "median": med,
        "current_over_reference": {
            "wall": round(
                med["current"]["wall_ms_per_shard"] / med["reference"]["wall_ms_per_shard"], 3
            ),
            "cpu": round(
                med["current"]["cpu_ms_per_shard"] / med["reference"]["cpu_ms_per_shard"], 3
            ),
        },
        "planes_zstd": planes_zstd,
        "identical_bytes": True,
    }
    print(json.dumps(report, indent=None if not a.json else 2))


if __name__ == "__main__":
    main()
