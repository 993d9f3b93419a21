"""Where one follower's CPU goes for a next version, on loopback: an origin process publishes
version 0 alone, version 0 is placed into the follower's store (hard links), then the origin
publishes version 1 (a delta) and the follower, run in this process exactly as ``shardnet
relay`` runs it, downloads and commits it.

Theory of operation
-------------------
The follower's process CPU (``getrusage``: every thread) is read over the next version,
from the moment version 1 is marked ``DONE`` at the origin until the follower's commit,
and, as a baseline, over an idle spell of the same follower before it (polls, adverts,
keep-alives: what it costs to wait). ``--profile PATH`` also runs :mod:`cProfile` over the
next version (the event-loop thread only; worker threads' checks are in the stage CPU)
and prints its top functions. Checkpoints come from :mod:`bench.scaled` (any preset, with
``changed`` elements flipped), written once under ``--cache`` (use ``/dev/shm`` and delete
it after).

Measured here (2 shared cores, load 1.8-3.4; ~11.6 M changed bf16 elements, 16 MiB shards;
CPU-s of the follower process for the next version, base = one blob per request, then one
batch per part; medians of 3 runs, alternated):

=========  ============  ======================  =====================  ===========
preset     requests      base CPU-s              batched CPU-s          per GB
=========  ============  ======================  =====================  ===========
real-1b    131 -> 68     0.394 (0.38-0.44)       0.299 (0.25-0.33)      0.23
real-6b    441 -> 98     1.161 (1.11-1.27)       0.557 (0.45-0.62)      0.09
=========  ============  ======================  =====================  ===========

A waiting follower costs ~0.017 CPU-s per second (polls, adverts): over a window that the
origin's encode sets (2.6-10 s here), that is 0.05-0.19 CPU-s of the figures above.

Then (issue 24, per-part and idle overhead; real-1b, 6 runs each, base and new alternated,
load 4-9 on the 2 cores, medians): the origin as a source needs no ``/have`` long-poll (it
serves a part only once it serves the part's shards), so a version's requests went from 68
(``have`` 23, ``part`` 22, ``blobs`` 21, manifest, shard) to 46 (one ``/versions`` long-poll
instead of the have-polls); a waiting follower long-polls its upstream's ``/versions`` and
polls its info record every 10 s instead of every second: idle 0.0168 -> 0.0114 CPU-s per
second. The next version's CPU did not move measurably (0.283 -> 0.290 CPU-s, runs spread
0.22-0.35 either way): what the two save, ~0.03 CPU-s, is inside the noise of this machine.
Of the rest, ~80 % is the event-loop thread (``time.thread_time``: 0.22 of 0.27 CPU-s),
spread thin over trio scheduling, the HTTP client and libp2p keep-alives; the checks in
worker threads are ~0.05 CPU-s. Parts arrive ~75 ms apart while the origin encodes (22
over 1.6 s), so a route fetching several parts per request would carry one part per answer;
decoding and verifying a part costs 0.3 ms (7 ms per version).

Then (issue 24, copies and per-shard work; base = 5470a70, new = this branch, alternated run
by run, 3 runs per variant and preset, load 4.9-8.5 on the 2 cores from another session's
measurements; medians, ranges in brackets; ``excess`` = next CPU-s minus the run's own idle
rate times its ``next_s``, which the origin's encode sets and the load stretches): a blob
batch is received straight into one buffer (``HttpClient.receive_into``: ``recv_into`` past h11;
the ``get_bytes`` path copied each byte 4-5 times between socket, h11, the body and the
sinks), each blob's sink is a view of its slice and is kept as it is (no ``bytes`` copy
before the store writes it); the scheduler counts the shards whose part has not arrived
instead of scanning every shard at each poll that finds nothing idle; a signed part or
header keeps its envelope bytes (the verified ones, or encoded once) instead of encoding its
whole chunk list again for each ``/part`` or manifest served and at each commit.

=========  =================  =================  =================  =================
preset     base CPU-s         new CPU-s          base excess        new excess
=========  =================  =================  =================  =================
real-1b    0.360 (0.20-0.43)  0.199 (0.16-0.20)  0.278 (0.17-0.29)  0.155 (0.14-0.16)
real-6b    0.688 (0.53-0.84)  0.512 (0.48-0.60)  0.502 (0.39-0.53)  0.362 (0.35-0.41)
=========  =================  =================  =================  =================

The ``receive`` stage went 0.109 (0.055-0.124) -> 0.029 (0.027-0.032) CPU-s at real-1b and
0.100 (0.083-0.103) -> 0.055 (0.049-0.055) at real-6b; ``write`` 0.035 -> 0.030 and 0.096
-> 0.084. An earlier round of the same comparison without the part bytes kept (load
1.4-9.7) gave 0.295 -> 0.227 and 0.704 -> 0.590 CPU-s. Per GB of checkpoint (excess):
real-1b 0.21 -> 0.12, real-6b 0.08 -> 0.06.

What is left grows with the blob count (every shard of both presets changes: 85 blobs at
real-1b, 374 at real-6b), spread thin over the event loop (cProfile of real-6b: trio
scheduling ~0.5 of ~2.2 profiled s; per blob the session's bookkeeping, the scheduler,
metrics and debug logs, ~1 ms profiled each; per part its decode and checks, ~4 ms
profiled), and the ``write`` stage, ~0.2 ms per kept blob. Of ``write`` at real-6b, the
commit decodes the base version's manifest once (~0.05 CPU-s) because the bench seeds the
follower's store with hard links: a follower that committed the base itself has it cached.

Then (issue 24, session 49; real-1b, this bench alone on the machine): 0.117-0.141 CPU-s per
next version in five runs (idle 0.008 CPU-s per second), 0.146 in two runs with two busy
loops taking both cores. The peers of the shaped bench (``bench/broadcast.py --shaped``,
seeded) took 0.33-0.49 CPU-s for the same version: contention explains ~20 % of the gap; the
rest is their requests to two relays that are still receiving the version (have long-polls
and part asks, ~215 requests per peer against this follower's ~46, plus ~115 have answers
served), which a follower fed by the origin alone does not make. So this bench's figure is a
floor for a follower in a tree, not its cost.

Then (session 50, real-6b, yappi's CPU clock over the next version, one run): the ``write``
stage (0.45 CPU-s in that run) was mostly creating one file per kept delta blob
(``PartialVersion._mark``: 374 ``open`` calls, 0.155 CPU-s). Creating a file on this
machine's ext4 cost 0.29-0.51 ms of CPU in the minutes after that run and the shaped
benches before it, whatever the file's size (374 files of 50 KB, or empty); the same bytes
appended to one file took 0.008-0.016 CPU-s. Half an hour later the same measurement gave
0.01-0.11 ms, and writing, syncing or deleting 2 GB just before did not bring the high
figure back. So the per-blob files cost between ~0.02 and ~0.17 CPU-s per real-6b next
version per follower, depending on a state of the machine I did not pin down; the shaped
bench's ``write`` stage varied as much (0.07-0.36 CPU-s per real-6b follower in one run).
One pack file per version or batch would make it small either way. Not done: blob paths are
read by the server, the chains, materialization and the journal.

Then (session 51): much of the state is where the files go. On the same ext4 filesystem,
measured side by side (374 files, empty or 110 KB each, CPU per file): ``/var/tmp``
0.21-0.82 ms, ``/tmp`` 0.015-0.34 ms, ``/work`` 0.015-0.052 ms, tmpfs 0.006-0.17 ms;
``/var/tmp`` was the slowest in every pairing, and ``/tmp`` and ``/var/tmp`` moved 10x over
an hour while ``/work`` did not. ext4 allocates a new inode near its directory's block group;
``/tmp`` and ``/var/tmp`` sit where this machine's benchmark caches and work directories
(tens of GB) have been written and deleted for weeks, ``/work`` far from them. The shaped
benchmark puts its nodes under ``/var/tmp`` by default (``--workdir``). With ``--workdir
/tmp/...`` in a fast spell the real-6b followers' ``write`` stage was 0.09 CPU-s per next
version against 0.24-0.36 under ``/var/tmp`` in earlier sessions
(``bench/results/issue24-shaped-200M-s51-peer-asks.txt``). The benchmark's machine line now
prints what creating a file in its work directory cost. A pack file would make the count of
files, not this state, what a version costs.

Then (session 56): the follower appends its kept blobs to one pack file per version
(:mod:`shardcast.store.blobpack`) instead of one file each. Alternated with the code before
(abb369b, from a worktree), run alone, real-1b (1.32 GB):

=========================  ===========================  ===========================
shards                     next CPU-s, files -> pack    ``write`` CPU-s
=========================  ===========================  ===========================
85 (16 MiB), 6 runs each   0.340 (0.25-0.42) -> 0.242   0.112 (0.04-0.18) -> 0.033
                           (0.20-0.25)                  (0.026-0.035)
1,266 (1 MiB), 3 runs      1.20-2.52 -> 0.55-0.68       0.60-1.83 -> 0.12-0.15
=========================  ===========================  ===========================

Medians, ranges in brackets (``bench/results/issue24-follower-cpu-pack-s56.txt``). The pack
took out both the cost and its spread: at 85 shards a next version now costs 0.15-0.19
CPU-s per GB (0.15 per GB is the target), of which ~0.025 is what waiting costs over its
~1.6 s; the stages (receive 0.03, verify 0.007, write 0.03) are ~0.07, the rest is the
event-loop thread's HTTP client, trio and libp2p keep-alives.

Then (session 57): what was left was per request (the profile: trio's scheduling, the HTTP
client and the driver, ~4 ms of the event loop per request, spread thin), and a next version
cost a part long-poll and a blob batch per part of 4 shards. A delta version's parts now cover
``delta_shards_per_part`` (16) shards: 46 -> 14 requests. Alternated, 4 runs each, run alone
(``--origin-args '--delta-shards-per-part 4'`` for the code before; a slow day):

=========================  ===========================  ===========================
parts of a delta version   next CPU-s                   next version, s
=========================  ===========================  ===========================
4 shards (22 parts)        0.303 (0.275-0.329)          1.95 (1.60-2.11)
16 shards (6 parts)        0.190 (0.179-0.212)          1.57 (1.54-1.80)
=========================  ===========================  ===========================

0.144 CPU-s per GB (0.136-0.161); the ``receive`` stage went 0.051 -> 0.020. The wall time
fell too: the last part goes out when the last shard is encoded whatever the part size
(``bench/results/issue24-delta-parts-s57.txt``).

Then the downloader's blob batches went from up to 8 MiB to 1 MiB
(:data:`shardcast.core.batch.BATCH_BYTES`: in a tree, a batch is what a relay forwards as a
unit, and the next version behind a trainer's save is complete at once). Here, with the
origin alone and parts arriving one by one, that costs requests: 27 instead of 14, and
0.248-0.263 CPU-s instead of 0.190-0.223 (3 runs each, alternated): 0.19-0.20 CPU-s per GB,
over the 0.15 target again. Streaming a batch's blobs out as they arrive (the requester) and
in as they are verified (the source) would let batches grow again without the wait.

``--origin-args`` adds options to the origin's command line (a setting tried against the
default without editing the bench).

Usage::

    python bench/follower_cpu.py --cache /dev/shm/b24 --preset real-1b --profile out.prof
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import random
import resource
import shlex
import shutil
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import trio

# the repository this file is in, then its bench/: a worktree of another revision runs its
# own code, not the editable install's (an A/B against old code would be new against new)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import broadcast
import scaled

CHANGED = 11_575_479
"""bf16 elements changed by one Adam step of ``real-1b`` at lr 1e-6 (1.75 %, measured by
``bench/broadcast.py``); every preset's next version changes as many."""


def checkpoints(cache: Path, preset: str, changed: int) -> tuple[Path, Path]:
    """Version 0 and its next version of ``preset`` under ``cache`` (written once)."""
    d = cache / f"{preset}-{changed}"
    v0, v1 = d / "v0", d / "v1"
    if not (d / "done").exists():
        shutil.rmtree(d, ignore_errors=True)
        scaled.write_checkpoint(preset, v0, 512 << 20, seed=0)
        scaled.write_next(v0, v1, changed, seed=1)
        (d / "done").touch()
    return v0, v1


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


ROUTES = ("part", "have", "shard", "blobs", "files", "manifest")


class RequestCount:
    """Counts this process's lane requests by route while ``on`` (wraps the HTTP client's
    request sender; a bench's patch, undone by :meth:`close`)."""

    def __init__(self) -> None:
        from p2p.http_client import HttpClient

        self.by_route: Counter[str] = Counter()
        self.on = False
        self._cls = HttpClient
        self._real = HttpClient._send
        real, me = self._real, self

        async def send(client: Any, conn: Any, target: str, *a: Any, **k: Any) -> Any:
            if me.on:
                words = target.split("?")[0].split("/")
                me.by_route[next((w for w in ROUTES if w in words), "other")] += 1
            return await real(client, conn, target, *a, **k)

        HttpClient._send = send  # type: ignore[method-assign]

    def close(self) -> None:
        self._cls._send = self._real  # type: ignore[method-assign]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    """Publish version 0 alone, seed the follower with it, measure the next version."""
    from p2p.identity import Identity

    v0, v1 = checkpoints(Path(args.cache), args.preset, args.changed)
    workdir = Path(args.cache) / "run"
    shutil.rmtree(workdir, ignore_errors=True)
    workdir.mkdir(parents=True)
    trainer_key = workdir / "origin" / "node.key"
    trainer_id = Identity.load_or_create(trainer_key).peer_id
    (workdir / "publish").mkdir()
    common = ["--run-id", broadcast.RUN_ID, "--keep-last", "2", "--log-level", "WARNING"]
    nodes = broadcast._ShardnetRun(workdir, trainer_id, common, None)
    async with trio.open_nursery() as nursery:
        try:
            oaddr = await nodes.start(
                nursery,
                "origin",
                [
                    *broadcast.origin_args(workdir, trainer_key, args.shard_size, deltas=True),
                    *shlex.split(args.origin_args),
                ],
            )
            await nodes.publish_alone(0, v0, args.timeout)
            fdir = workdir / "follower"
            broadcast.seed_store(nodes.committed(0), fdir, 0)
            out = await _follow(args, nodes, v1, fdir, oaddr, trainer_id)
            nursery.cancel_scope.cancel()
        finally:
            with trio.CancelScope(shield=True):
                for p in reversed(nodes.procs):
                    await p.stop()
    return {
        "preset": args.preset,
        "changed": args.changed,
        "origin_args": args.origin_args,
        **out,
    }


async def _follow(
    args: argparse.Namespace, nodes: Any, v1: Path, fdir: Path, oaddr: str, trainer_id: str
) -> dict[str, Any]:
    """Run the follower (as ``shardnet relay`` does) and measure the next version."""
    from shardcast.download import Follower
    from shardcast.node import ShardcastNode
    from shardnet.config import RelaySettings

    s = RelaySettings(
        upstream=[oaddr],
        trainer_id=trainer_id,
        data_dir=fdir,
        run_id=broadcast.RUN_ID,
        keep_last=2,
        listen=["/ip4/127.0.0.1/tcp/0"],
        http_host="127.0.0.1",
        http_port=0,
        serve_once_s=0,
    )
    out: dict[str, Any] = {}
    count = RequestCount()
    async with (
        ShardcastNode.open(s.identity(), s.trust(), s.node_config(broadcast.RUN_ID)) as node,
        trio.open_nursery() as nursery,
    ):
        follower = Follower(node, s.follow_config(s.upstream), random.Random(1))
        nursery.start_soon(follower.run)
        await trio.sleep(args.idle_s)  # settle: connect, first polls
        c0, t0 = _cpu_s(), time.perf_counter()
        await trio.sleep(args.idle_s)
        out["idle_cpu_s_per_s"] = round((_cpu_s() - c0) / (time.perf_counter() - t0), 4)
        staged = nodes.stage(1, v1)
        stage0 = node.metrics.stage_cpu.statistics().seconds
        prof = cProfile.Profile(time.thread_time) if args.profile else None
        c0, t0 = _cpu_s(), time.perf_counter()
        count.on = True
        if prof is not None:
            prof.enable()
        (staged / "DONE").touch()
        mark = fdir / "versions" / broadcast.RUN_ID / "step-1" / "manifest.json"
        with trio.fail_after(args.timeout):
            while not mark.exists():  # noqa: ASYNC110 - a bench's wait
                await trio.sleep(0.05)
        if prof is not None:
            prof.disable()
        count.on = False
        out["next_s"] = round(time.perf_counter() - t0, 3)
        out["next_cpu_s"] = round(_cpu_s() - c0, 3)
        out["requests_by_route"] = dict(count.by_route)
        stage1 = node.metrics.stage_cpu.statistics().seconds
        out["stage_cpu_s"] = {str(k): round(v - stage0[k], 3) for k, v in stage1.items()}
        count.close()
        if prof is not None:
            prof.dump_stats(args.profile)
            pstats.Stats(prof).sort_stats("tottime").print_stats(30)
        nursery.cancel_scope.cancel()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cache", required=True, help="where checkpoints are written (/dev/shm)")
    ap.add_argument("--preset", default="real-1b")
    ap.add_argument("--changed", type=int, default=CHANGED)
    ap.add_argument("--shard-size", type=int, default=16 << 20)
    ap.add_argument("--idle-s", type=float, default=3.0)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--profile", default=None, help="cProfile output path")
    ap.add_argument(
        "--origin-args",
        default="",
        metavar="OPTIONS",
        help="options added to the origin's command line (e.g. '--delta-shards-per-part 4')",
    )
    args = ap.parse_args()
    print(json.dumps(trio.run(run, args), indent=1))


if __name__ == "__main__":
    main()
