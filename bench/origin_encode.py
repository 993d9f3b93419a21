"""The origin's cost of a next version: diffing the written files against encoding from tensors.

Builds (or reuses, cached like ``bench/deltas.py``) a ``real-1b`` checkpoint and its next
version after one Adam step at lr 1e-6, loads both versions' bf16 tensors (what a trainer holds
after its step) and prepares version 1 for publishing twice, in one run, alternating:

* ``file_diff`` (before): write the files, then ``hash_parts`` reads them and the base's files
  and hashes and delta-encodes every shard (``sparse``, ``xor-zstd`` where denser), as the
  trainer's publish did;
* ``from_tensors`` (after): write the files while a worker thread hashes and encodes them from
  the tensors (:mod:`trainer.encode`, shards on ``--workers`` threads), then ``hash_parts``
  links those results and reads only the small files.

Two scenarios: ``origin_only`` (the files are on disk already: what the origin itself spends
to hash and encode) and ``with_write`` (writing the bf16 files included; the trainer also
writes its fp32 state and optimizer state first, which the encoding overlaps too and which
this leaves out). Reports per mode the wall time and the process CPU-seconds (every thread,
blake3's and zstd's included), the medians over ``--repeat`` runs, and the ratios; both modes
must give identical parts. The machine is shared, so absolute figures move with load; the
modes alternate so both see the same.

    .venv/bin/python bench/origin_encode.py --json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from safetensors import safe_open
from safetensors.torch import save_file

from bench.broadcast import prepare_checkpoints
from shardcast.publish import Base, EncodeSettings, hash_parts, header_matches, make_header
from shardcast.wire import Part, codecs
from trainer.checkpoint import METADATA, WeightFile, file_bytes
from trainer.encode import ENCODE_WORKERS, Layouts, TensorEncoder, usable

ENCODINGS = (codecs.SPARSE, codecs.XOR_ZSTD)  # the origin's for a delta version


def load(directory: Path) -> list[WeightFile]:
    """The weight files of ``directory`` as the trainer holds them (tensors in file order)."""
    out = []
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), "pt") as fh:
            out.append(WeightFile(path.name, {k: fh.get_tensor(k) for k in fh.keys()}))
    return out


def layouts(weights: list[WeightFile], step: int) -> Layouts:
    """The in-memory layouts of ``weights``."""
    made = {w.name: file_bytes(w) for w in weights}
    files = {n: m[0] for n, m in made.items() if m is not None}
    headers = {n: m[1] for n, m in made.items() if m is not None}
    return Layouts(step, files, headers)


def _write(weights: list[WeightFile], src: Path, out: Path) -> None:
    out.mkdir(parents=True)
    for w in weights:
        save_file(w.tensors, str(out / w.name), metadata=METADATA)
    for p in src.iterdir():
        if not p.name.endswith(".safetensors"):
            shutil.copyfile(p, out / p.name)


def prepare(
    mode: str,
    write: bool,
    v0: Path,
    v1: Path,
    weights: list[WeightFile],
    old: Layouts,
    shard_size: int,
    work: Path,
    workers: int,
) -> tuple[dict[str, float], list[Part]]:
    """Hash and encode version 1 in ``mode`` (``file_diff`` or ``from_tensors``), either
    writing it into ``work`` first (``write``: encoding from tensors side by side) or with
    its files already on disk (``v1``: what the origin itself spends); returns the timings
    (seconds) and the parts."""
    out = work / "step-1" if write else v1
    cache, blob_dir = work / "step-1.encoded", work / "blobs"
    base = Base(0, "ab" * 32, v0)
    settings = EncodeSettings(shard_size, ENCODINGS, (0, base.digest), codecs.DEFAULT_LEVEL)
    t_wall, t_cpu = time.perf_counter(), time.process_time()
    pre = None
    if mode == "from_tensors":
        new = layouts(weights, 1)
        enc = TensorEncoder(workers)
        enc.published(old)
        found: dict[str, Any] = {}
        worker = threading.Thread(
            target=lambda: found.update(enc.encode(new, settings, base, cache))
        )
        worker.start()
        if write:
            _write(weights, v1, out)
        worker.join()
        pre = usable(out, new, found)
        assert set(pre) == set(new.files), "predicted headers differ from the written files"
    elif write:
        _write(weights, v1, out)
    t_hash, c_hash = time.perf_counter(), time.process_time()
    header = dataclasses.replace(
        make_header(out, "bench", 1, shard_size, 16, base), nonce="00" * 16
    )
    parts = hash_parts(
        out,
        header,
        header.digest(),
        encodings=ENCODINGS,
        base=base,
        blob_dir=blob_dir,
        on_part=lambda p: None,
        pre_encoded=pre,
    )
    end_wall, end_cpu = time.perf_counter(), time.process_time()
    row = {
        "wall_s": end_wall - t_wall,
        "cpu_s": end_cpu - t_cpu,
        "before_hash_parts_wall_s": t_hash - t_wall,  # write and/or encode from tensors
        "hash_parts_wall_s": end_wall - t_hash,  # what is left once the files are written
        "hash_parts_cpu_s": end_cpu - c_hash,
    }
    if write:
        shutil.rmtree(out)
    shutil.rmtree(cache, ignore_errors=True)
    shutil.rmtree(blob_dir, ignore_errors=True)
    return row, parts


def _scenario(
    write: bool, a: argparse.Namespace, v0: Path, v1: Path, w1: list[WeightFile], old: Layouts
) -> dict[str, Any]:
    """Both modes ``--repeat`` times, alternating; medians and ratios."""
    rows: dict[str, list[dict[str, float]]] = {"file_diff": [], "from_tensors": []}
    parts: dict[str, list[Part]] = {}
    with tempfile.TemporaryDirectory(prefix="origin-encode-", dir=a.cache) as tmp:
        for k in range(a.repeat):
            order = ("file_diff", "from_tensors") if k % 2 == 0 else ("from_tensors", "file_diff")
            for mode in order:
                work = Path(tmp) / mode
                work.mkdir(exist_ok=True)
                row, parts[mode] = prepare(
                    mode, write, v0, v1, w1, old, a.shard_size, work, a.workers
                )
                rows[mode].append({k: round(v, 3) for k, v in row.items()})
    if parts["file_diff"] != parts["from_tensors"]:
        raise SystemExit("the two modes gave different parts")
    med = {
        m: {k: round(statistics.median(r[k] for r in rs), 3) for k in rs[0]}
        for m, rs in rows.items()
    }
    before, after = med["file_diff"], med["from_tensors"]
    return {
        "runs": rows,
        "median": med,
        "after_over_before": {
            "wall": round(after["wall_s"] / before["wall_s"], 3),
            "cpu": round(after["cpu_s"] / before["cpu_s"], 3),
        },
        "identical_parts": True,
    }


def main() -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="real-1b")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--shard-size", type=int, default=32 << 20, help="bytes")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--workers", type=int, default=ENCODE_WORKERS, help="encoder threads")
    ap.add_argument("--cache", type=Path, default=Path("/tmp/shardnet-bench-cache"))
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    v0, v1, info = prepare_checkpoints(a.cache, a.preset, a.lr, 1 << 30)
    w0, w1 = load(v0), load(v1)
    old = layouts(w0, 0)
    for name, head in old.headers.items():  # the layout held is the base's on disk
        assert header_matches(v0 / name, head), name
    for p in [*v0.iterdir(), *v1.iterdir()]:  # warm: the base and new files were just written
        p.read_bytes()
    report = {
        "checkpoint": info,
        "shard_size": a.shard_size,
        "repeat": a.repeat,
        "workers": a.workers,
        "origin_only": _scenario(False, a, v0, v1, w1, old),
        "with_write": _scenario(True, a, v0, v1, w1, old),
    }
    if a.json:
        print(json.dumps(report, indent=2))
        return
    for name in ("origin_only", "with_write"):
        sc: Any = report[name]
        for mode, r in sc["median"].items():
            print(f"{name:12} {mode:12} {r}")
        print(f"{name:12} after / before: {sc['after_over_before']}")


if __name__ == "__main__":
    main()
