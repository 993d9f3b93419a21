"""A peer's in-engine update of a next version: in place from sparse deltas vs a full reload.

Builds, under ``--cache`` (a tmpfs by default; removed afterwards), a ``real-1b``
checkpoint, version 0 with seeded random weights, and version 1: version 0 with
``--changed-percent`` of its bf16 elements moved by one unit in the last place at uniformly
random positions (one RL step at lr 1e-6 changes ~1.6 %, issue 24; what an in-place update
costs depends on how many words change and where, not on their values, so no Adam step is
run: it needs ~10 GB of memory). Both are committed into a
:class:`~shardcast.store.store.VersionStore` with ``sparse`` deltas offered against version 0 and
their blobs kept as a follower keeps them. Then, on one ``TransformersEngine`` (bf16):

1. full load of version 0 (the first load);
2. **in place** to version 1 (:func:`shardnet.engine_update.swap_weights`: blob checks, plan,
   apply), timed as a whole; the weights are then compared bit for bit with a fresh load of
   version 1;
3. ``--repeat`` rounds, each from version 0 again (full reload, untimed): the in-place update
   as a whole, then stage by stage, then the **full reload** of version 1 into the engine
   holding version 0 (``engine.load``: today's path; the files are in the page cache, so this
   is a lower bound for a peer); medians are reported (the first in-place update, which pays
   for first-call warm-ups, separately).

The issue's target: in-engine update of ``real-1b`` <= 0.5 s.

    PYTHONPATH=. .venv/bin/python bench/engine_update.py --cache /dev/shm/engine-bench --json
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2p.identity import Identity
from rollout.delta_plan import UPDATE_THREADS, plan_update, read_layout
from rollout.model import tensor_files
from shardcast.publish import Base, build_manifest
from shardcast.store import BLOB_DIR, VersionStore
from shardcast.wire import Manifest, codecs

TARGET_S = 0.5
RUN = "bench-engine-update"
TRAINER = Identity.from_seed("bench-trainer")


def prepare(cache: Path, preset: str, percent: float, seed: int) -> tuple[Path, Path]:
    """Version 0 and 1 source directories (consumed by :func:`publish`)."""
    import torch

    from rollout.model import build_model, build_tokenizer
    from trainer.checkpoint import save_checkpoint

    d = cache / f"{preset}-{percent:g}pct-seed{seed}"
    v0, v1 = d / "v0", d / "v1"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    save_checkpoint(build_model(preset, seed, torch.bfloat16), build_tokenizer(), v0, 1 << 30)
    shutil.copytree(v0, v1)
    rng = np.random.default_rng(seed)
    for path in tensor_files(v1):
        data = bytearray(path.read_bytes())
        words = np.frombuffer(data, dtype="<u2")
        for t in read_layout(path).tensors:
            lo, hi = t.start // 2, t.end // 2
            n = int((hi - lo) * percent / 100)
            idx = lo + rng.choice(hi - lo, size=n, replace=False)
            words[idx] += rng.choice(np.array([1, 0xFFFF], np.uint16), size=n)  # +-1 ulp
        path.write_bytes(data)
    return v0, v1


def publish(store: VersionStore, src: Path, step: int, base: Manifest | None) -> Manifest:
    """Commit ``src`` (moved into the store) as ``step`` (sparse deltas against ``base``,
    blobs kept)."""
    work = store.run_dir.parent / f"work-{step}"
    src.rename(work)
    m = build_manifest(
        work,
        RUN,
        step,
        TRAINER,
        encodings=(codecs.SPARSE,) if base else (),
        base=Base(base.step, base.digest, store.version_dir(base.step)) if base else None,
        blob_dir=work / BLOB_DIR,
    )
    store.adopt(work, m, rehash=False)
    return m


def timed(fn: Any, *args: Any) -> tuple[Any, float, float]:
    """(result, wall seconds, CPU seconds of this process)."""
    w, c = time.perf_counter(), time.process_time()
    out = fn(*args)
    return out, time.perf_counter() - w, time.process_time() - c


def _rounds(
    engine: Any, store: VersionStore, m1: Any, d0: Path, d1: Path, held: Any, repeat: int
) -> tuple[dict[str, list[float]], Any]:
    """``repeat`` rounds, each from version 0 again: the in-place update whole (wall, process
    CPU, the ``engine_update`` stage CPU), stage by stage, then the full reload; returns the
    times by key and the last plan."""
    from shardcast.core import Stage, StageCpu
    from shardnet.engine_update import gather_changes, swap_weights

    keys = (
        "in_place",
        "in_place_cpu",
        "in_place_stage_cpu",
        "full",
        "full_cpu",
        "gather",
        "plan",
        "apply",
    )
    rounds: dict[str, list[float]] = {k: [] for k in keys}
    for _ in range(repeat):  # each from version 0 again: whole, stage by stage, full reload
        engine.load(d0)
        account = StageCpu()  # what a peer's /metrics charges to engine_update
        _, wall, cpu = timed(swap_weights, engine, store, m1, d1, held, account)
        rounds["in_place"].append(wall)
        rounds["in_place_cpu"].append(cpu)
        rounds["in_place_stage_cpu"].append(account.statistics().seconds[Stage.ENGINE_UPDATE])
        engine.load(d0)
        changes, wall, _ = timed(gather_changes, store, m1, held)
        rounds["gather"].append(wall)
        plan, wall, _ = timed(plan_update, held.layouts, changes, engine.weight_specs())
        rounds["plan"].append(wall)
        _, wall, _ = timed(engine.apply_update, plan, d1)
        rounds["apply"].append(wall)
        engine.load(d0)
        _, wall, cpu = timed(engine.load, d1)  # today's path: reload N+1 holding N
        rounds["full"].append(wall)
        rounds["full_cpu"].append(cpu)
    return rounds, plan


def run(
    cache: Path, preset: str, percent: float, seed: int, threads: int, repeat: int
) -> dict[str, Any]:
    """The measurement (see module docstring)."""
    import torch

    from rollout.engine import TransformersEngine
    from rollout.model import load_model, stored_state
    from shardnet.engine_update import SwapPath, swap_weights

    torch.set_num_threads(threads)
    src0, src1 = prepare(cache, preset, percent, seed)
    root = cache / "store"
    shutil.rmtree(root, ignore_errors=True)
    store = VersionStore(root, RUN, keep_last=4, durable=False)
    m0 = publish(store, src0, 0, None)
    m1 = publish(store, src1, 1, m0)
    d0, d1 = store.version_dir(0), store.version_dir(1)
    blobs = sum(p.stat().st_size for p in (d1 / BLOB_DIR).glob("*.sparse"))
    size = sum(f.size for f in m1.header.files)

    engine = TransformersEngine()
    first, first_s, _ = timed(swap_weights, engine, store, m0, d0, None)
    held = first.held
    inplace, inplace_s, _ = timed(swap_weights, engine, store, m1, d1, held)
    if inplace.path is not SwapPath.IN_PLACE:
        raise SystemExit(f"in-place update refused: {inplace.fallback}")
    want = load_model(d1)
    got_state, want_state = stored_state(engine.model), stored_state(want)
    exact = all(
        torch.equal(got_state[n].view(torch.int16), want_state[n].view(torch.int16))
        for n in want_state
    )
    del want, got_state, want_state

    assert held is not None
    rounds, plan = _rounds(engine, store, m1, d0, d1, held, repeat)
    med = {k: round(statistics.median(v), 3) for k, v in rounds.items()}
    return {
        "preset": preset,
        "checkpoint_bytes": size,
        "sparse_blob_bytes": blobs,
        "changed_words": plan.changed_words,
        "changed_percent": round(100 * plan.changed_words / (size // 2), 3),
        "threads": threads,
        "update_threads": UPDATE_THREADS,
        "repeat": repeat,
        "first_load_s": round(first_s, 3),
        "first_in_place_s": round(inplace_s, 3),
        "in_place_s": med["in_place"],
        "in_place_cpu_s": med["in_place_cpu"],
        # the peer's engine_update stage (shardnet_stage_cpu_seconds_total) for the same swap:
        # per-thread CPU; the engine's patch pool and torch's own threads are not in it
        "in_place_stage_cpu_s": med["in_place_stage_cpu"],
        "in_place_stages_s": {
            "gather_blobs_check_decode": med["gather"],
            "plan": med["plan"],
            "apply": med["apply"],
        },
        "full_reload_s": med["full"],
        "full_reload_cpu_s": med["full_cpu"],
        "rounds_s": {k: [round(x, 3) for x in v] for k, v in rounds.items()},
        "bit_identical_to_loading_v1": exact,
        "target_s": TARGET_S,
        "meets_target": med["in_place"] <= TARGET_S and exact,
    }


def main() -> None:
    """Command line: see the module docstring."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="real-1b")
    ap.add_argument("--changed-percent", type=float, default=1.6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads")
    ap.add_argument("--repeat", type=int, default=3, help="rounds (medians are reported)")
    ap.add_argument("--cache", type=Path, default=Path("/dev/shm/shardnet-engine-bench"),
                    help="work directory (removed afterwards)")  # fmt: skip
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        out = run(a.cache, a.preset, a.changed_percent, a.seed, a.threads, a.repeat)
    finally:
        shutil.rmtree(a.cache, ignore_errors=True)
    if a.json:
        print(json.dumps(out, indent=2))
        return
    print(
        f"{out['preset']} ({out['checkpoint_bytes'] / 1e9:.2f} GB, {out['changed_percent']} % "
        f"words changed, {out['sparse_blob_bytes'] / 1e6:.1f} MB of sparse blobs)\n"
        f"  in place     {out['in_place_s']:.3f} s, {out['in_place_cpu_s']:.3f} CPU-s "
        f"(stages {out['in_place_stages_s']}; engine_update on /metrics "
        f"{out['in_place_stage_cpu_s']:.3f} CPU-s)\n"
        f"  full reload  {out['full_reload_s']:.3f} s, {out['full_reload_cpu_s']:.3f} CPU-s\n"
        f"  bit-identical: {out['bit_identical_to_loading_v1']}; target <= {TARGET_S} s: "
        f"{'met' if out['meets_target'] else 'missed'}"
    )


if __name__ == "__main__":
    main()
