"""Broadcast benchmark: shardnet vs SHARDCAST 0.3.2 on the same checkpoints and topology.

Topology, on 127.0.0.1 (or on shaped links, see below): 1 origin, 2 relays, 4 peers
(SHARDCAST: its origin, 2 middle nodes with ``--check-interval 1``, 4 clients). Checkpoints:
a generated real-architecture bf16 checkpoint (``real-2b`` preset: 2.05 GiB,
Llama/TinyLlama-1.1B shape, several safetensors files with an index), then the next version
made from it by one real Adam step at an RL learning rate (``trainer/evolve.py``).
Four systems in one run:

- ``shardnet``: ``shardnet origin`` (deltas on), 2 ``shardnet relay``, 4 leaf followers (the
  download half of ``shardnet peer``, run as ``shardnet relay`` processes whose upstreams are
  both relays; they discover and re-serve to each other);
- ``shardnet-nodelta``: the same with ``--no-deltas``;
- ``shardcast``: SHARDCAST 0.3.2 from PyPI in its own virtual environment
  (``bench/shardcast_baseline.py`` drives it; see its docstring for how completion and bytes
  are measured and how client crashes are restarted and counted);
- ``floor`` (loopback only): the work no system can skip, as plain processes
  (``bench/floor.py``): 6 receivers each receive, BLAKE3-hash and write every byte of the full
  version, sent with ``sendfile`` from one sender; for the next version each receiver only
  copies its previous version into new files (``copy_file_range``). Its time divided by
  SHARDCAST's (``floor_full_ratio_vs_shardcast``, ``floor_delta_ratio_vs_shardcast``) is the
  lowest ratio any system could reach on this machine in this run: a ratio target below it
  is out of reach here.

For each system and version it measures the time from handing the version to the origin until
the last peer holds a verified copy (shardnet: the peer's ``step-N/`` directory exists, which
happens only after every digest matched), bytes sent by the origin and by each relay (shardnet:
the change of ``shardnet_http_sent_bytes_total`` on each node's ``/metrics`` over the version),
CPU-seconds per node, repeats everything ``--repeats`` times and reports medians and the
ratios against SHARDCAST. ``--json`` prints one JSON object with ``full_ratio_vs_shardcast``,
``delta_ratio_vs_shardcast`` (shardnet time / SHARDCAST time) and ``delta_bytes_ratio`` (bytes
of the delta version / bytes of the full one); ``--out FILE`` writes everything, every run
included.

η = bound / measured, where bound = (bytes that must reach every relay and peer) / (plain-socket
loopback throughput measured in this run): a single machine's loopback and CPUs are shared by
all transfers, so the total bytes received is what has to move.

Shaped links (``--shaped RATE``, as root; repeat or comma-separate rates: ``--shaped 200M,1G``):
each of the 7 nodes runs in a network namespace of its own (:mod:`simulations.netns`: a
bridge namespace, one veth per node, addresses ``10.211.K.x`` that exist only inside these
namespaces), its uplink and downlink shaped with ``tc tbf`` at RATE (no ``netem``: latency and
loss are not emulated). shardnet and SHARDCAST run on the same namespaces (SHARDCAST's
processes with a private ``/tmp`` each, as on separate machines), one after the other, on the
same checkpoint and next version. Per rate, system and version it reports the first and last
peer times, the origin's bytes, the bound ``S/B + (ceil(log2(N+1)) - 1) * s/B`` (``S``: bytes
of the smallest offered form of every shard, from shardnet's manifest — the full size, or the
delta's for the next version; ``s`` their mean per shard; ``B`` the rate; ``N`` = 6 receivers)
and η = bound / last-peer time, and CPU-seconds per node (SHARDCAST's clients exit after each
version: each peer is shown a quarter of their sum). Per shardnet node it also reports the
next version's CPU-seconds by stage (``receive``, ``verify``, ``apply``, ``write``,
``materialize``, ``engine_update``: the change of ``shardnet_stage_cpu_seconds_total`` on
the node's ``/metrics`` over the version; the followers here are ``shardnet relay``
processes, so ``engine_update`` stays 0), and the lane requests each node served over the
version by route (``shardnet_http_requests_total{route}``: ``have``, ``blobs``, ``part``...).
Every namespace (and every process in one) is
removed on any exit, Ctrl-C and SIGTERM included; labs left by a killed run are removed at
the next start.

Checkpoints in shaped mode: the whole ``real-1b`` (1.32 GB) by default; ``--preset`` takes a
comma-separated list, run one after the other on the same lab, e.g. ``real-1b,real-6b``:
``real-6b`` (6.03 GB, 4.6x, ``bench/scaled.py``) gets a next version with exactly as many
changed bf16 elements as ``real-1b``'s (about 11.5 M, 1.75 %: the same change, not the same
fraction), and the table adds, per system, the ratio of the next versions' last-peer times
(last preset over first). ``--seed-base`` runs only the next version: the origin publishes
version 0 alone, and each follower's store gets it hard-linked from the origin's verified
copy before the follower starts (SHARDCAST, which has no deltas, publishes the next version
alone); the output says so. ``--save-mb-s RATE`` writes shardnet's next version into the
origin's watched directory at RATE MB/s, file by file, each synced, before the ready marker,
as a careful trainer's save does (:func:`save_paced`), instead of hard-linking it there at
once: the origin's pre-encoder (``--pre-encode-settle-s``) then hashes and encodes each file
once it has been quiet, while the later ones are written, and only what was not done ahead is
left after the marker. The times still count from the marker, so they leave the save itself
out: that is the trainer's cost, whichever system publishes. ``--size-bytes`` cuts both
versions of each preset to the same subset of weight files (still a valid checkpoint);
``--quick`` here means 1 repeat of ``real-1b`` cut to ~240 MB (about 5 minutes for 200 Mb/s
and 1 Gb/s).
``--origin-args`` and ``--relay-args`` append options to the shardnet origin's and relays'
command lines (e.g. ``--origin-args '--shards-per-part 8'``), so a setting can be tried
side by side with the defaults without editing the bench; the output names them.

Disk: checkpoints are cached under ``--cache`` (``/tmp/shardnet-bench-cache``: ``real-6b``
takes 12 GB there; remove it when done); each node writes its own copy of every version it
downloads under ``--workdir`` (``/var/tmp``), removed after each run: a ``real-6b`` run
needs about 6 x 6 GB per version there. Before a version is handed to either system's
origin, the bench reads it and its base once, untimed (:func:`warm_page_cache`): the origin
then reads them from the page cache, as it would a checkpoint its trainer has just written.

The machine. Every node of the shaped lab runs on this machine's cores. The output starts
with what they had (:func:`machine_probe`: the cores, what writing 1 GiB into the page
cache cost, on the VMs this was developed on 0.26-8.7 CPU-s from one try to the next, and
what creating a file in the work directory cost) and gives, per version, every node's
CPU-seconds together and the least time that is on those cores, beside the last peer's
time. Where the two are close (a real-1b next version on 2 cores: ~6 CPU-s over 7 nodes),
the run measured the machine, not the link or the protocol; one node per machine would not
be bound by it.

Run (about 30-40 minutes with 3 repeats; ``--quick`` for a 1-repeat smoke run):

    .venv/bin/python bench/broadcast.py --json
    sudo .venv/bin/python bench/broadcast.py --shaped 200M --repeats 3
    sudo .venv/bin/python bench/broadcast.py --shaped 200M --repeats 1 --preset real-6b \\
        --seed-base --timeout 2400
    sudo .venv/bin/python bench/broadcast.py --shaped 200M,1G --quick --out shaped.json
"""

from __future__ import annotations

import argparse
import errno
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "bench"
# every node of the benchmark runs on this machine: loopback only, any free port
LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0", "--http-host", "127.0.0.1", "--http-port", "0"]
N_RELAYS, N_PEERS = 2, 4

IDLE_S = 2.0
"""Seconds each version's measurement first waits with every node idle, to read each node's
CPU rate while it waits (``idle_cpu_s_per_s``: keep-alives, gossip heartbeats, adverts); the
stage table's ``excess`` is a node's CPU over the version minus that rate times the version's
duration."""
DEFAULT_SYSTEMS = ["shardnet", "shardnet-nodelta", "shardcast", "floor"]


# ----------------------------------------------------------------------------- checkpoints


REFERENCE_PRESET = "real-1b"
"""The preset whose next version's changed-element count the scaled presets copy."""


def prepare_checkpoints(
    cache: Path, preset: str, lr: float, max_shard_bytes: int
) -> tuple[Path, Path, dict[str, Any]]:
    """Version 0 (seeded random weights) and version 1, cached on disk: one Adam step
    (``trainer/evolve.py``), or for a scaled preset (``bench/scaled.py``, e.g. ``real-6b``)
    exactly as many changed bf16 elements as :data:`REFERENCE_PRESET`'s next version has
    (which is prepared first). ``info["changed_elements"]``: elements changed."""
    if preset in _scaled().SCALED_PRESETS:
        ref = prepare_checkpoints(cache, REFERENCE_PRESET, lr, max_shard_bytes)[2]
        return _prepare_scaled(cache, preset, max_shard_bytes, ref["changed_elements"])
    d = cache / f"{preset}-lr{lr:g}-shard{max_shard_bytes}"
    v0, v1, info_path = d / "v0", d / "v1", d / "info.json"
    if info_path.exists():
        info = json.loads(info_path.read_text())
        if "changed_elements" not in info:  # cached by an older version of this script
            info["changed_elements"] = _scaled().changed_elements(v0, v1)
            info_path.write_text(json.dumps(info))
        return v0, v1, info
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    t = time.monotonic()
    _shardnet(
        "checkpoint",
        "generate",
        "--out",
        str(v0),
        "--preset",
        preset,
        "--max-shard-bytes",
        str(max_shard_bytes),
    )
    gen_s = time.monotonic() - t
    t = time.monotonic()
    out = _shardnet(
        "checkpoint",
        "evolve",
        str(v0),
        str(v1),
        "--lr",
        str(lr),
        "--max-shard-bytes",
        str(max_shard_bytes),
    )
    m = re.search(r"\((\d+\.\d+) %\)", out)
    count = re.search(r"(\d+)/\d+ bf16 elements changed", out)
    info = {
        "preset": preset,
        "lr": lr,
        "generate_s": round(gen_s, 1),
        "evolve_s": round(time.monotonic() - t, 1),
        "changed_percent": float(m.group(1)) if m else None,
        "changed_elements": (int(count.group(1)) if count else _scaled().changed_elements(v0, v1)),
        "size_bytes": sum(p.stat().st_size for p in v0.iterdir()),
    }
    info_path.write_text(json.dumps(info))
    return v0, v1, info


def _prepare_scaled(
    cache: Path, preset: str, max_shard_bytes: int, changed: int
) -> tuple[Path, Path, dict[str, Any]]:
    """A scaled preset's version 0 and its next version with ``changed`` elements, cached."""
    scaled = _scaled()
    d = cache / f"{preset}-same{changed}-shard{max_shard_bytes}"
    v0, v1, info_path = d / "v0", d / "v1", d / "info.json"
    if info_path.exists():
        return v0, v1, json.loads(info_path.read_text())
    shutil.rmtree(d, ignore_errors=True)
    print(f"# writing {preset} into {d} (once; remove it when done)", file=sys.stderr, flush=True)
    t = time.monotonic()
    scaled.write_checkpoint(preset, v0, max_shard_bytes, seed=0)
    gen_s = time.monotonic() - t
    t = time.monotonic()
    scaled.write_next(v0, v1, changed, seed=1)
    elements = scaled.preset_bytes(preset) // 2
    info = {
        "preset": preset,
        "generate_s": round(gen_s, 1),
        "next_s": round(time.monotonic() - t, 1),
        "next_version": f"the same number of changed bf16 elements as {REFERENCE_PRESET}'s",
        "changed_elements": changed,
        "changed_percent": round(100 * changed / elements, 3),
        "size_bytes": sum(p.stat().st_size for p in v0.iterdir()),
    }
    info_path.write_text(json.dumps(info))
    return v0, v1, info


def _shardnet(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "shardnet.cli", *args],
        check=True,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    return out.stdout


def least_bytes(manifest_path: Path, trainer_id: str) -> tuple[int, int]:
    """(bytes of the smallest offered form of every shard, shards) of a committed version:
    what must cross the origin's uplink at least once (the bound's ``S``)."""
    from p2p.trust import TrustList
    from shardcast.wire import Manifest

    m = Manifest.decode(manifest_path.read_bytes(), trust=TrustList(trainer_id))
    total = 0
    for i in range(len(m.header.shards)):
        e = m.shard(i)
        total += min([e.length, *(x.size for x in e.encodings)])
    return total, len(m.header.shards)


def subset_checkpoint(src: Path, dst: Path, names: list[str]) -> None:
    """``dst``: hard links of ``src``'s non-weight files and of the safetensors ``names``, with
    an index that maps only their tensors (a smaller, still valid checkpoint of real bytes)."""
    index_name = "model.safetensors.index.json"
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.name == index_name or (f.name.endswith(".safetensors") and f.name not in names):
            continue
        os.link(f, dst / f.name)
    index = json.loads((src / index_name).read_text())
    index["weight_map"] = {t: n for t, n in index["weight_map"].items() if n in names}
    index["metadata"] = {"total_size": sum((src / n).stat().st_size for n in names)}
    (dst / index_name).write_text(json.dumps(index, indent=2))


def subset_versions(v0: Path, v1: Path, cache: Path, size_bytes: int) -> tuple[Path, Path, int]:
    """Both versions cut to the same weight files, about ``size_bytes`` of them (layer files
    first: the embedding file, ``00001``, changes least), cached; returns (v0, v1, bytes)."""
    weights = sorted(f.name for f in v0.iterdir() if f.name.endswith(".safetensors"))
    order = weights[1:] + weights[:1]
    names: list[str] = []
    for n in order:
        if sum((v0 / x).stat().st_size for x in names) >= size_bytes:
            break
        names.append(n)
    d = cache / f"subset-{size_bytes}"
    if not (d / "done").exists():
        shutil.rmtree(d, ignore_errors=True)
        subset_checkpoint(v0, d / "v0", names)
        subset_checkpoint(v1, d / "v1", names)
        (d / "done").touch()
    size = sum(f.stat().st_size for f in (d / "v0").iterdir())
    return d / "v0", d / "v1", size


# ----------------------------------------------------------------------------- loopback


async def loopback_throughput(total_bytes: int = 1 << 30) -> float:
    """Bytes/s of one plain TCP stream over 127.0.0.1 (trio sockets, 1 MiB sends)."""
    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listeners[0].socket.getsockname()[1]
    chunk = b"\0" * (1 << 20)
    got = 0
    all_in = trio.Event()

    async def sink(stream: trio.SocketStream) -> None:
        nonlocal got
        async with stream:
            while data := await stream.receive_some(1 << 20):
                got += len(data)
                if got >= total_bytes:
                    all_in.set()

    async with trio.open_nursery() as nursery:
        await nursery.start(trio.serve_listeners, sink, listeners)
        t = time.perf_counter()
        async with await trio.open_tcp_stream("127.0.0.1", port) as s:
            for _ in range(total_bytes // len(chunk)):
                await s.send_all(chunk)
        await all_in.wait()
        elapsed = time.perf_counter() - t
        nursery.cancel_scope.cancel()
    return total_bytes / elapsed


# ----------------------------------------------------------------------------- shardnet


@dataclass(frozen=True)
class Place:
    """Where a node runs: argv prefix (``ip netns exec NS``) and its address there."""

    prefix: list[str]
    ip: str


class Proc:
    """A node process with its ready record."""

    def __init__(
        self, name: str, args: list[str], workdir: Path, prefix: list[str] | None = None
    ) -> None:
        self.name = name
        self.args = args
        self.prefix = prefix or []  # e.g. ``ip netns exec NS`` (exec: the pid stays the node's)
        self.log = workdir / "logs" / f"{name}.log"
        self.proc: trio.Process | None = None
        self.ready: dict[str, Any] = {}

    async def start(self, nursery: trio.Nursery) -> dict[str, Any]:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        ready_file = self.log.with_suffix(".ready.json")
        with open(self.log, "wb") as logf:  # noqa: ASYNC230 - once per process start
            self.proc = await trio.lowlevel.open_process(
                [
                    *self.prefix,
                    sys.executable,
                    "-m",
                    "shardnet.cli",
                    *self.args,
                    "--ready-file",
                    str(ready_file),
                ],
                stdout=logf,
                stderr=logf,
                stdin=subprocess.DEVNULL,
                cwd=REPO,
                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            )
        with trio.fail_after(120):
            while not ready_file.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited; see {self.log}")
                await trio.sleep(0.05)
        self.ready = json.loads(ready_file.read_text())
        return self.ready

    async def stop(self) -> None:
        if self.proc is None or self.proc.returncode is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        with trio.move_on_after(20):
            await self.proc.wait()
        if self.proc.returncode is None:
            self.proc.kill()
            await self.proc.wait()


def rotated(systems: list[str], rep: int) -> list[str]:
    """The systems in the order repeat ``rep`` runs them: each goes first in turn. The first
    run after the checkpoints are made pays for memory the VM has not backed yet (page cache
    of new files: 3 vs 0.2 kernel CPU-s per GB written, measured on this machine), so a fixed
    order charged it to the same system every repeat."""
    k = rep % len(systems) if systems else 0
    return systems[k:] + systems[:k]


def _cpu_s(proc: Proc, which: str = "all") -> float:
    """CPU seconds of a node process so far (0 if it is gone): user + system (``all``), or
    only the kernel's share (``sys``: syscalls, and the network stack work done on the
    process's behalf, shaping included)."""
    try:
        assert proc.proc is not None
        fields = Path(f"/proc/{proc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, AssertionError):
        return 0.0
    ticks = int(fields[12]) if which == "sys" else int(fields[11]) + int(fields[12])
    return ticks / os.sysconf("SC_CLK_TCK")


async def _idle_rates(procs: Sequence[Proc]) -> dict[str, float]:
    """Each node's CPU-seconds per second over :data:`IDLE_S` seconds of waiting."""
    cpu0, t0 = {p.name: _cpu_s(p) for p in procs}, time.perf_counter()
    await trio.sleep(IDLE_S)
    spell = time.perf_counter() - t0
    return {p.name: round((_cpu_s(p) - cpu0[p.name]) / spell, 4) for p in procs}


_SCRAPE = (
    "import sys, urllib.request; "
    "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
)


@dataclass(frozen=True)
class Scrape:
    """What the benchmark reads off a node's ``/metrics`` at one moment."""

    sent_bytes: int
    """``shardnet_http_sent_bytes_total``: lane body bytes sent so far."""
    stage_cpu_s: dict[str, float]
    """``shardnet_stage_cpu_seconds_total`` by stage: CPU-seconds of the data path so far."""
    served: dict[str, int]
    """``shardnet_http_requests_total`` by route, every status class: lane requests served."""

    @classmethod
    def parse(cls, text: str) -> Scrape:
        m = re.search(r"^shardnet_http_sent_bytes_total (\S+)", text, re.MULTILINE)
        stages = re.findall(
            r'^shardnet_stage_cpu_seconds_total\{stage="(\w+)"\} (\S+)', text, re.MULTILINE
        )
        served: dict[str, int] = {}
        for route, n in re.findall(
            r'^shardnet_http_requests_total\{code="\w+",route="(\w+)"\} (\S+)', text, re.MULTILINE
        ):
            served[route] = served.get(route, 0) + int(float(n))
        return cls(int(float(m.group(1))) if m else 0, {k: float(v) for k, v in stages}, served)

    def served_delta(self, before: Scrape) -> dict[str, int]:
        """Lane requests served by route since ``before`` (routes with none left out)."""
        got = {k: v - before.served.get(k, 0) for k, v in self.served.items()}
        return {k: v for k, v in got.items() if v}

    def stage_delta(self, before: Scrape) -> dict[str, float]:
        """CPU-seconds by stage since ``before``."""
        return {
            k: round(v - before.stage_cpu_s.get(k, 0.0), 3) for k, v in self.stage_cpu_s.items()
        }


def _scrape_deltas(before: dict[str, Scrape], after: dict[str, Scrape]) -> dict[str, Any]:
    """Per node (the keys of ``before``), what changed between two scrapes: CPU-seconds by
    stage (``stage_cpu_s``) and lane requests served by route (``served``)."""
    return {
        "stage_cpu_s": {n: after[n].stage_delta(b) for n, b in before.items()},
        "served": {n: after[n].served_delta(b) for n, b in before.items()},
    }


async def _scrape(client: Any, url: str, prefix: list[str] | None = None) -> Scrape:
    """A node's ``/metrics`` (with ``prefix``: fetched from inside the node's network
    namespace, where its address is reachable)."""
    if prefix:
        res = await trio.run_process(
            [*prefix, sys.executable, "-c", _SCRAPE, url + "/metrics"], capture_stdout=True
        )
        text = res.stdout.decode()
    else:
        text = (await client.get_bytes(url + "/metrics", max_bytes=1 << 20, timeout_s=10)).decode()
    return Scrape.parse(text)


def seed_store(origin_version: Path, data_dir: Path, step: int) -> None:
    """Place ``origin_version`` (the origin's committed, verified ``step-N`` directory) into
    the store of the node with ``data_dir`` as its committed version ``step``, as hard links
    (no byte copied: a 6 GB base costs nothing per node), before that node starts."""
    dst = data_dir / "versions" / RUN_ID / f"step-{step}"
    for dirpath, _dirs, files in os.walk(origin_version):
        rel = Path(dirpath).relative_to(origin_version)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for f in files:
            os.link(Path(dirpath) / f, dst / rel / f)


def warm_page_cache(directories: list[Path], block: int = 16 << 20) -> None:
    """Read every file of ``directories`` once (``block`` bytes at a time, discarded), so that
    the version about to be published and its delta base are in the page cache, as a
    checkpoint a trainer has just written (and the base it published one step earlier) is:
    the origin's reads then cost what they cost on a trainer's machine, not whatever part of
    a checkpoint generated minutes ago the kernel has since evicted (measured after a seeded
    ``real-1b,real-6b`` run: 1-36 % of each ``real-6b`` file was out of the cache, and the
    origin's encode threads were in ``preadv`` in 30 % of py-spy's samples of its next
    version). Untimed: it runs before the version is handed over."""
    buf = bytearray(block)
    for directory in directories:
        for path in sorted(directory.rglob("*")):
            if path.is_file():
                with open(path, "rb", buffering=0) as fh:
                    while fh.readinto(buf):
                        pass


def machine_probe(
    directory: Path, size: int = 1 << 30, block: int = 16 << 20, files: int = 200
) -> dict[str, Any]:
    """What this machine charges for what every shardnet node does, measured once per run
    and printed beside the results, so that a reader can tell the machine's spread from
    shardnet's: the cores this process may run on, the cost of writing ``size`` bytes into
    the page cache (a temporary file in ``directory``, written ``block`` bytes at a time, not
    synced, then deleted), and the CPU cost of creating one file there (``files`` files of
    100 KB in a new subdirectory, as a follower keeps one file per delta blob; removed). On
    the machine this was developed on, the last moved from 0.02 to 0.8 ms with the
    directory and the hour, on one filesystem (``bench/follower_cpu.py``).

    Returns:
        ``{"cores": int, "write_bytes": size, "write_s": wall seconds, "write_cpu_s":
        this process's CPU-seconds (user + system) for the write, "create_ms": CPU
        milliseconds per file created}``.

    Raises:
        OSError: ``directory`` is not writable or lacks ``size`` bytes of space.
    """
    buf = b"\x5a" * block
    fd, name = tempfile.mkstemp(prefix="probe-", dir=directory)
    try:
        t, c = time.perf_counter(), time.process_time()
        for _ in range(0, size, block):
            os.write(fd, buf)
        wall, cpu = time.perf_counter() - t, time.process_time() - c
    finally:
        os.close(fd)
        os.unlink(name)
    small = buf[: 100 * 1000]
    sub = Path(tempfile.mkdtemp(prefix="probe-", dir=directory))
    try:
        c = time.process_time()
        for i in range(files):
            (sub / f"{i}.blob").write_bytes(small)
        create = time.process_time() - c
    finally:
        shutil.rmtree(sub)
    return {
        "cores": len(os.sched_getaffinity(0)),
        "write_bytes": size,
        "write_s": round(wall, 3),
        "write_cpu_s": round(cpu, 3),
        "create_ms": round(1000 * create / files, 3),
    }


def save_paced(src: Path, dst: Path, bytes_per_s: float, block: int = 16 << 20) -> float:
    """Write a copy of every file of ``src`` into the existing directory ``dst`` as a
    careful trainer's save does: file by file in name order, each under its final name,
    ``block`` bytes at a time, no faster than ``bytes_per_s`` bytes per second over the whole
    save (a block waits until its scheduled time), each file synced (``fsync``) once written,
    so that its ready marker never names data still in memory only. Returns the seconds it
    took. (Unsynced, the origin's commit, which syncs the version's files, waited on the
    save's dirty pages, and so did every follower's sync on this one shared disk: measured,
    up to 1.7 GB dirty at the marker of a ``real-6b`` save.)

    Raises:
        OSError: a file cannot be read or written."""
    start, written = time.monotonic(), 0
    buf = bytearray(block)
    for path in sorted(src.iterdir()):
        if not path.is_file():
            continue
        with path.open("rb") as fin, (dst / path.name).open("wb") as fout:
            while n := fin.readinto(buf):
                fout.write(memoryview(buf)[:n])
                written += n
                ahead = start + written / bytes_per_s - time.monotonic()
                if ahead > 0:
                    time.sleep(ahead)
            fout.flush()
            os.fsync(fout.fileno())
    return time.monotonic() - start


async def run_shardnet(
    v0: Path,
    v1: Path,
    workdir: Path,
    *,
    deltas: bool,
    shard_size: int,
    timeout_s: float,
    log_level: str = "WARNING",
    place: Callable[[str], Place] | None = None,
    relay_serve_once_s: float | None = None,
    seed_base: bool = False,
    save_bytes_per_s: float | None = None,
    origin_extra: Sequence[str] = (),
    relay_extra: Sequence[str] = (),
) -> dict[str, Any]:
    """One shardnet run: publish v0 then v1; returns per-version measurements.

    ``place(node_name)`` (``origin``, ``relay1``, ``peer3``...) runs that node in a network
    namespace at its address (``--shaped``); without it every node is on 127.0.0.1.
    ``relay_serve_once_s``: the two relays' super-seeding window (0: off; None: the relay
    default, on). The peers never super-seed. ``seed_base``: the origin alone publishes v0,
    which is then placed into every follower's store before the followers start
    (:func:`seed_store`); only v1 is measured (the run's ``seeded`` is True).
    ``save_bytes_per_s``: v1 is written into the watched directory at this rate
    (:func:`save_paced`) instead of hard-linked there at once, so the origin's pre-encoder
    works while it is written; its times still count from the ready marker.
    ``origin_extra``, ``relay_extra``: options appended to the origin's and the two relays'
    command lines (``--origin-args``, ``--relay-args``: a setting tried without editing the
    bench, e.g. ``--shards-per-part 8``).
    """
    from p2p.http_client import HttpClient
    from p2p.identity import Identity

    workdir.mkdir(parents=True)  # noqa: ASYNC240 - setup, before anything is timed
    trainer_key = workdir / "origin" / "node.key"
    trainer_id = Identity.load_or_create(trainer_key).peer_id
    (workdir / "publish").mkdir()
    common = ["--run-id", RUN_ID, "--keep-last", "2", "--log-level", log_level]
    run = _ShardnetRun(workdir, trainer_id, common, place)
    versions = []
    async with trio.open_nursery() as nursery, HttpClient() as client:
        try:
            oaddr = await run.start(
                nursery,
                "origin",
                [*origin_args(workdir, trainer_key, shard_size, deltas), *origin_extra],
            )
            todo = [(0, v0), (1, v1)]
            if seed_base:
                await run.publish_alone(0, v0, timeout_s)
                for name in run.followers():
                    seed_store(run.committed(0), workdir / name, 0)
                todo = todo[1:]
            await _start_followers(run, nursery, oaddr, relay_serve_once_s, relay_extra)
            for step, src in todo:
                await trio.to_thread.run_sync(warm_page_cache, [v0, v1][: step + 1])
                rate = save_bytes_per_s if step == 1 else None
                versions.append(await run.measure(client, step, src, timeout_s, rate))
        finally:
            with trio.CancelScope(shield=True):
                for p in reversed(run.procs):
                    await p.stop()
            nursery.cancel_scope.cancel()
    system = "shardnet" if deltas else "shardnet-nodelta"
    return {
        "system": system,
        "versions": versions,
        "seeded": seed_base,
        "save_bytes_per_s": save_bytes_per_s,
    }


def origin_args(workdir: Path, key: Path, shard_size: int, deltas: bool) -> list[str]:
    """The bench origin's command line: it watches ``workdir/publish`` (``--watch``)."""
    return [
        "origin",
        "--key",
        str(key),
        "--data-dir",
        str(workdir / "origin"),
        "--watch",
        str(workdir / "publish"),
        "--shard-size-bytes",
        str(shard_size),
        "--deltas" if deltas else "--no-deltas",
    ]


async def _start_followers(
    run: _ShardnetRun,
    nursery: trio.Nursery,
    origin_addr: str,
    relay_serve_once_s: float | None,
    relay_extra: Sequence[str] = (),
) -> None:
    """Start the relays (following the origin at ``origin_addr``), then the peers (following
    the relays). ``relay_serve_once_s``: the relays' super-seeding window (None: the default);
    ``relay_extra``: more options of the relays' command line."""
    extra = [] if relay_serve_once_s is None else ["--serve-once-s", f"{relay_serve_once_s:g}"]
    extra += relay_extra
    relay_addrs = [
        await run.follower(nursery, f"relay{i}", [origin_addr], extra)
        for i in range(1, N_RELAYS + 1)
    ]
    for i in range(1, N_PEERS + 1):
        # download-only followers standing in for inference peers, which never super-seed
        await run.follower(nursery, f"peer{i}", relay_addrs, ["--serve-once-s", "0"])


class _ShardnetRun:
    """The nodes of one :func:`run_shardnet` and the measurement of one version."""

    def __init__(
        self,
        workdir: Path,
        trainer_id: str,
        common: list[str],
        place: Callable[[str], Place] | None,
    ) -> None:
        self.workdir = workdir
        self.trainer_id = trainer_id
        self.common = common
        self.place = place
        self.procs: list[Proc] = []

    def net(self, name: str) -> list[str]:
        if self.place is None:
            return LOOPBACK
        ip = self.place(name).ip
        return ["--listen", f"/ip4/{ip}/tcp/4001", "--http-host", ip, "--http-port", "8001"]

    def prefix(self, name: str) -> list[str]:
        return [] if self.place is None else self.place(name).prefix

    @staticmethod
    def followers() -> list[str]:
        return [f"relay{i}" for i in range(1, N_RELAYS + 1)] + [
            f"peer{i}" for i in range(1, N_PEERS + 1)
        ]

    def committed(self, step: int, name: str = "origin") -> Path:
        return self.workdir / name / "versions" / RUN_ID / f"step-{step}"

    async def start(self, nursery: trio.Nursery, name: str, args: list[str]) -> str:
        """Start node ``name``; returns its first multiaddr."""
        p = Proc(name, [*args, *self.common, *self.net(name)], self.workdir, self.prefix(name))
        self.procs.append(p)
        return str((await p.start(nursery))["multiaddrs"][0])

    async def follower(
        self, nursery: trio.Nursery, name: str, upstreams: list[str], extra: list[str]
    ) -> str:
        """Start a ``shardnet relay`` process following ``upstreams``."""
        return await self.start(
            nursery,
            name,
            [
                "relay",
                *[a for u in upstreams for a in ("--upstream", u)],
                "--trainer-id",
                self.trainer_id,
                "--data-dir",
                str(self.workdir / name),
                *extra,
            ],
        )

    def stage(self, step: int, src: Path) -> Path:
        """Hard-link ``src`` into the origin's watched directory as ``step-N`` (not yet
        ``DONE``); copy where the cache is on another filesystem than the work directory
        (``--cache`` on /dev/shm, the work directory in /tmp), before any timing starts."""
        staged = self.workdir / "publish" / f"step-{step}"
        staged.mkdir()
        for f in src.iterdir():
            try:
                os.link(f, staged / f.name)
            except OSError as exc:
                if exc.errno != errno.EXDEV:
                    raise
                shutil.copyfile(f, staged / f.name)
        return staged

    async def publish_alone(self, step: int, src: Path, timeout_s: float) -> None:
        """Publish ``src`` before any follower runs; wait for the origin's commit."""
        (self.stage(step, src) / "DONE").touch()
        with trio.fail_after(timeout_s):
            while not (self.committed(step) / "manifest.json").exists():  # noqa: ASYNC110
                await trio.sleep(0.1)

    async def measure(
        self,
        client: Any,
        step: int,
        src: Path,
        timeout_s: float,
        save_bytes_per_s: float | None = None,
    ) -> dict[str, Any]:
        """Publish ``src`` as version ``step`` and measure it until every peer holds it.

        Without ``save_bytes_per_s`` the files are hard-linked into the watched directory at
        once; with it they are written there at that rate (:func:`save_paced`, the
        ``save_s`` of the result) before the ready marker. Times count from the marker; CPU
        (and ``origin_save_cpu_s``, the origin's CPU-seconds during the save: its
        pre-encoding) from before the first file; before any file, :data:`IDLE_S` seconds
        of waiting nodes give each one's ``idle_cpu_s_per_s``."""
        procs = self.procs
        peers = [p for p in procs if p.name.startswith("peer")]
        idle = await _idle_rates(procs)
        if save_bytes_per_s is None:
            staged = self.stage(step, src)
        else:
            staged = self.workdir / "publish" / f"step-{step}"
            staged.mkdir()
        before = {p.name: await _scrape(client, p.ready["http_url"], p.prefix) for p in procs}
        cpu0 = {p.name: _cpu_s(p) for p in procs}
        sys0 = {p.name: _cpu_s(p, "sys") for p in procs}
        save_s: float | None = None
        origin_save_cpu: float | None = None
        if save_bytes_per_s is not None:
            save_s = await trio.to_thread.run_sync(save_paced, src, staged, save_bytes_per_s)
            origin = next(p for p in procs if p.name == "origin")
            origin_save_cpu = round(_cpu_s(origin) - cpu0["origin"], 2)
        t0 = time.perf_counter()
        (staged / "DONE").touch()
        done: dict[str, float] = {}
        origin_s: float | None = None  # the origin committed the version: every part signed
        with trio.fail_after(timeout_s):
            while len(done) < len(peers) or origin_s is None:
                now = time.perf_counter() - t0
                if origin_s is None and (self.committed(step) / "manifest.json").exists():
                    origin_s = now
                for p in peers:
                    mark = self.committed(step, p.name) / "manifest.json"
                    if p.name not in done and mark.exists():
                        done[p.name] = now
                await trio.sleep(0.02)
        cpu = {p.name: round(_cpu_s(p) - cpu0[p.name], 2) for p in procs}
        cpu_sys = {p.name: round(_cpu_s(p, "sys") - sys0[p.name], 2) for p in procs}
        after = {p.name: await _scrape(client, p.ready["http_url"], p.prefix) for p in procs}
        sent = {p.name: after[p.name].sent_bytes - before[p.name].sent_bytes for p in procs}
        min_bytes, n_shards = await trio.to_thread.run_sync(
            least_bytes, self.committed(step) / "manifest.json", self.trainer_id
        )
        return {
            "step": step,
            "save_s": None if save_s is None else round(save_s, 3),
            "origin_save_cpu_s": origin_save_cpu,
            "first_s": round(min(done.values()), 3),
            "last_s": round(max(done.values()), 3),
            "origin_s": round(origin_s, 3),
            "peers_s": done,
            "origin_bytes": sent["origin"],
            "relay_bytes": {f"relay{i}": sent[f"relay{i}"] for i in range(1, N_RELAYS + 1)},
            "peer_bytes": {p.name: sent[p.name] for p in peers},
            "received_bytes": sum(sent.values()),
            "least_bytes": min_bytes,
            "shards": n_shards,
            "cpu_s": cpu,
            "cpu_sys_s": cpu_sys,
            "idle_cpu_s_per_s": idle,
            **_scrape_deltas(before, after),
        }


# ----------------------------------------------------------------------------- SHARDCAST


def ensure_shardcast_venv(path: Path) -> Path:
    """A virtual environment with SHARDCAST 0.3.2 (created on first use)."""
    if not (path / "bin" / "python").exists():
        print(f"# installing SHARDCAST 0.3.2 into {path}", file=sys.stderr, flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
        subprocess.run([str(path / "bin" / "pip"), "install", "-q", "shardcast==0.3.2"], check=True)
    return path


def _bench_path() -> None:
    """``bench/`` joins ``sys.path`` once, whether this file runs as a script or is imported as
    ``bench.broadcast``, so its sibling scripts import as modules."""
    bench = str(REPO / "bench")
    if bench not in sys.path:
        sys.path.insert(0, bench)


def _floor() -> Any:
    """The module ``bench/floor.py``."""
    _bench_path()
    import floor  # type: ignore[import-not-found]

    return floor


def _scaled() -> Any:
    """The module ``bench/scaled.py``."""
    _bench_path()
    import scaled  # type: ignore[import-not-found]

    return scaled


def _baseline() -> Any:
    """The module ``bench/shardcast_baseline.py``."""
    _bench_path()
    import shardcast_baseline  # type: ignore[import-not-found]

    return shardcast_baseline


async def run_shardcast(
    v0: Path,
    v1: Path,
    workdir: Path,
    timeout_s: float,
    venv: Path,
    only_next: bool = False,
    **config: Any,
) -> dict[str, Any]:
    """One SHARDCAST run through bench/shardcast_baseline.py (1 origin, 2 middles with
    ``--check-interval 1``, 4 clients on 127.0.0.1, or placed by ``config``'s ``hosts`` and
    ``exec_prefix``; crashed clients restarted and counted). ``only_next``: publish v1 alone
    (SHARDCAST moves whole files for every version, so its next version is a full transfer
    whatever its nodes held before), reported as version 1."""
    first, nexts = (v1, []) if only_next else (v0, [v1])
    await trio.to_thread.run_sync(warm_page_cache, [first, *nexts])  # as for shardnet
    res = await _baseline().arun_shardcast(
        first, workdir, next_checkpoints=nexts, timeout_s=timeout_s, venv=str(venv), **config
    )
    versions = []
    for step, v in enumerate(res["versions"], start=1 if only_next else 0):
        versions.append(
            {
                "step": step,
                "first_s": v.get("first_client_s"),
                "last_s": v.get("last_client_s"),
                "origin_bytes": v.get("origin_bytes"),
                "relay_bytes": v.get("middle_bytes"),
                "client_crashes": v.get("client_crashes"),
                "cpu_s": _shardcast_cpu(v.get("cpu_s") or {}),
                "raw": v,
            }
        )
    return {"system": "shardcast", "versions": versions, "seeded": only_next}


def _shardcast_cpu(cpu: dict[str, float]) -> dict[str, float]:
    """SHARDCAST's CPU-seconds in shardnet's node names; clients exit after each version, so
    only their sum is known (``clients_and_exited``): each peer gets a quarter of it."""
    out = {"origin": cpu.get("origin", 0.0)}
    for j in range(N_RELAYS):
        out[f"relay{j + 1}"] = cpu.get(f"middle{j}", 0.0)
    each = cpu.get("clients_and_exited", 0.0) / N_PEERS
    for i in range(N_PEERS):
        out[f"peer{i + 1}"] = round(each, 2)
    return out


# ----------------------------------------------------------------------------- shaped links

# node index in the lab (its address is 10.211.K.(index+2)) per shardnet node name
SHAPED_NODES = ["origin", *(f"relay{i}" for i in range(1, N_RELAYS + 1))] + [
    f"peer{i}" for i in range(1, N_PEERS + 1)
]
# the same places for SHARDCAST's processes
SHARDCAST_NAMES = ["origin", *(f"middle{j}" for j in range(N_RELAYS))] + [
    f"client{i}" for i in range(N_PEERS)
]


def parse_rate(text: str) -> float:
    """``200M``/``200mbit``/``1G``/``1gbit``/``5e8`` -> bits per second.

    Raises:
        ValueError: not a positive rate.
    """
    t = text.strip().lower().removesuffix("bit").removesuffix("b/s").removesuffix("bps")
    mult = {"k": 1e3, "m": 1e6, "g": 1e9}.get(t[-1:], 1.0)
    value = float(t[:-1] if t[-1:] in "kmg" else t) * mult
    if not value > 0:
        raise ValueError(f"not a positive rate: {text!r}")
    return value


def rate_label(bits_per_s: float) -> str:
    if bits_per_s >= 1e9 and bits_per_s % 1e9 == 0:
        return f"{bits_per_s / 1e9:g} Gb/s"
    return f"{bits_per_s / 1e6:g} Mb/s"


def tree_depth(n_receivers: int) -> int:
    """``ceil(log2(N+1)) - 1``: store-and-forward hops after the first in a binary tree."""
    return max(0, math.ceil(math.log2(n_receivers + 1)) - 1)


def shaped_bound_s(size: int, shard: float, rate_bytes_per_s: float, receivers: int) -> float:
    """``S/B + (ceil(log2(N+1)) - 1) * s/B``: the origin's uplink sends every byte once, and a
    shard needs that many more shard-times to reach the last of ``N`` receivers."""
    return size / rate_bytes_per_s + tree_depth(receivers) * shard / rate_bytes_per_s


async def _shaped_runs(
    lab: Any, v0: Path, v1: Path, root: Path, args: argparse.Namespace, label: str
) -> dict[str, list[dict[str, Any]]]:
    """Every system ``--repeats`` times on the lab's 7 namespaces."""
    ports = [lab.ports[i] for i in range(len(SHAPED_NODES))]
    places = {n: Place(lab.exec_prefix(i), ports[i].ip) for i, n in enumerate(SHAPED_NODES)}
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    for rep in range(args.repeats):
        for system in rotated(args.systems, rep):
            wd = root / f"{label.replace(' ', '').replace('/', '')}-{system}-{rep}"
            print(f"# {label} run {rep + 1}/{args.repeats}: {system}", file=sys.stderr, flush=True)
            try:
                r = await _shaped_run(lab, v0, v1, wd, args, system, places)
            except (RuntimeError, OSError, trio.TooSlowError) as exc:  # this run only: go on
                print(f"# {label} {system} failed: {exc!r}", file=sys.stderr, flush=True)
                r = {"system": system, "versions": [], "error": repr(exc)}
            runs[system].append(r)
            print(json.dumps(r["versions"], default=str)[:1500], file=sys.stderr, flush=True)
            if not args.keep:
                shutil.rmtree(wd, ignore_errors=True)
    return runs


async def _shaped_run(
    lab: Any,
    v0: Path,
    v1: Path,
    wd: Path,
    args: argparse.Namespace,
    system: str,
    places: dict[str, Place],
) -> dict[str, Any]:
    """One run of ``system`` on the lab (every process it started is stopped on return)."""
    ports = [lab.ports[i] for i in range(len(SHAPED_NODES))]
    if system == "shardcast":
        venv = ensure_shardcast_venv(Path(args.shardcast_venv))
        return await run_shardcast(
            v0,
            v1,
            wd,
            args.timeout,
            venv,
            hosts={n: ports[i].ip for i, n in enumerate(SHARDCAST_NAMES)},
            exec_prefix={n: lab.exec_prefix(i) for i, n in enumerate(SHARDCAST_NAMES)},
            fixed_port=8000,
            isolate_scratch=True,  # as on separate machines: no shared /tmp scratch
            only_next=args.seed_base,
        )
    return await run_shardnet(
        v0,
        v1,
        wd,
        deltas=system == "shardnet",
        shard_size=args.shard_size,
        timeout_s=args.timeout,
        log_level=args.log_level,
        place=places.__getitem__,
        relay_serve_once_s=args.relay_serve_once_s,
        seed_base=args.seed_base,
        save_bytes_per_s=None if args.save_mb_s is None else args.save_mb_s * 1e6,
        origin_extra=shlex.split(args.origin_args),
        relay_extra=shlex.split(args.relay_args),
    )


def summarize_shaped(
    runs: dict[str, list[dict[str, Any]]], size: int, rate_bits: float, shard_size: int
) -> dict[str, Any]:
    """Medians per system and version; the bound and η = bound / last-peer time.

    The bound's ``S`` is the bytes of the smallest offered form of every shard of the version
    (shardnet's manifest: the full size for version 0, the delta's for the next), ``s`` the
    mean of those per shard, ``B`` the link rate; one bound per version, for both systems.
    """
    rate = rate_bits / 8
    receivers = N_RELAYS + N_PEERS
    least: dict[int, tuple[int, int]] = {}
    for r in runs.get("shardnet", []) + runs.get("shardnet-nodelta", []):
        for v in r["versions"]:
            if v.get("least_bytes") and (v["step"] not in least or r["system"] == "shardnet"):
                least[v["step"]] = (v["least_bytes"], v["shards"])
    out: dict[str, Any] = {"rate_bits_per_s": rate_bits, "bounds": {}, "systems": {}}
    for step in (0, 1):
        s_bytes, n = least.get(step, (size, max(1, math.ceil(size / shard_size))))
        out["bounds"][step] = {
            "bytes": s_bytes,
            "shard_bytes": round(s_bytes / n),
            "bound_s": round(shaped_bound_s(s_bytes, s_bytes / n, rate, receivers), 3),
        }
    for system, rs in runs.items():
        out["systems"][system] = [
            _shaped_version(
                step,
                [v for r in rs for v in r["versions"] if v["step"] == step],
                out["bounds"][step]["bound_s"],
            )
            for step in (0, 1)
        ]
    out["seeded"] = any(r.get("seeded") for rs in runs.values() for r in rs)

    def t(system: str, step: int) -> float | None:
        vs = out["systems"].get(system, [])
        return vs[step]["last_s"] if len(vs) > step else None

    for step, key in ((0, "full_ratio_vs_shardcast"), (1, "delta_ratio_vs_shardcast")):
        a, b = t("shardnet", step), t("shardcast", step)
        out[key] = round(a / b, 4) if a and b else None
    return out


def _shaped_version(step: int, vs: list[dict[str, Any]], bound: float) -> dict[str, Any]:
    """One system's summary of version ``step`` over its repeats ``vs``: medians of the
    first and last peer's times (s), origin bytes and CPU seconds per node, and η against
    ``bound`` (s); only the repeat count when no repeat finished."""
    lasts = [v["last_s"] for v in vs if v.get("last_s") is not None]
    if not lasts:
        return {"step": step, "last_s": None, "repeats": len(vs)}
    last = _median(lasts)
    nodes = sorted({k for v in vs for k in (v.get("cpu_s") or {})})
    return {
        "step": step,
        "first_s": round(_median([v["first_s"] for v in vs if v["first_s"]] or [0]), 3),
        "last_s": round(last, 3),
        "last_s_all": lasts,
        # DONE to the origin's commit (every part hashed, encoded, signed); SHARDCAST: None
        "origin_s": _median_or_none([v.get("origin_s") for v in vs]),
        # --save-mb-s: the paced save before the marker, and the origin's CPU during it
        "save_s": _median_or_none([v.get("save_s") for v in vs]),
        "origin_save_cpu_s": _median_or_none([v.get("origin_save_cpu_s") for v in vs]),
        "origin_bytes": int(_median([v["origin_bytes"] or 0 for v in vs])),
        "bound_s": bound,
        "eta": round(bound / last, 3),
        "cpu_s": {
            k: round(_median([(v.get("cpu_s") or {}).get(k, 0.0) for v in vs]), 2) for k in nodes
        },
        # every node's CPU together: on a machine of C cores the version cannot finish in
        # less than cpu_total_s / C (print_shaped_table prints that floor)
        "cpu_total_s": round(_median([sum((v.get("cpu_s") or {}).values()) for v in vs]), 2),
        "idle_cpu_s_per_s": {
            k: round(_median([(v.get("idle_cpu_s_per_s") or {}).get(k, 0.0) for v in vs]), 4)
            for k in nodes
        },
        "stage_cpu_s": _median_per_node(vs, "stage_cpu_s"),
        "served": _median_per_node(vs, "served"),
        "repeats": len(vs),
        "failed": len(vs) - len(lasts),
    }


def _median_per_node(vs: list[dict[str, Any]], key: str) -> dict[str, dict[str, float]]:
    """Per node and column, the median over the repeats ``vs`` of ``v[key][node][column]``:
    CPU-seconds by stage (``stage_cpu_s``), lane requests served by route (``served``)."""
    nodes = sorted({k for v in vs for k in (v.get(key) or {})})
    cols = sorted({c for v in vs for per in (v.get(key) or {}).values() for c in per})
    return {
        k: {c: round(_median([v[key].get(k, {}).get(c, 0.0) for v in vs]), 3) for c in cols}
        for k in nodes
    }


def _median_or_none(xs: list[float | None]) -> float | None:
    """The median of the values that are not None, rounded to ms; None if there is none."""
    got = [x for x in xs if x is not None]
    return round(_median(got), 3) if got else None


def shaped_checkpoints(args: argparse.Namespace) -> dict[str, tuple[Path, Path, dict[str, Any]]]:
    """Each ``--preset``'s (v0, v1, info), prepared (and cut to ``--size-bytes``) once."""
    cache = Path(args.cache)
    out = {}
    for preset in args.presets:
        v0, v1, info = prepare_checkpoints(cache, preset, args.lr, args.max_shard_bytes)
        if args.size_bytes:
            v0, v1, size = subset_versions(v0, v1, v0.parent, args.size_bytes)
            info = {**info, "subset_bytes": size, "subset_dir": str(v0.parent)}
        out[preset] = (v0, v1, info)
    return out


def _size(info: dict[str, Any]) -> int:
    return int(info.get("subset_bytes") or info["size_bytes"])


def run_shaped(args: argparse.Namespace) -> dict[str, Any]:
    """The shaped-link benchmark (``--shaped``): one lab of 7 network namespaces per rate,
    every ``--preset`` on it in turn."""
    sys.path.insert(0, str(REPO))
    from simulations import netns

    checkpoints = shaped_checkpoints(args)
    removed = netns.cleanup_stale()
    if removed:
        print(f"# removed stale labs {removed}", file=sys.stderr, flush=True)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="shardnet-shaped-", dir=args.workdir))
    out: dict[str, Any] = {
        "checkpoints": {p: info for p, (_, _, info) in checkpoints.items()},
        "machine": machine_probe(root),
        "seed_base": args.seed_base,
        "save_mb_s": args.save_mb_s,
        "origin_args": args.origin_args,
        "relay_args": args.relay_args,
        "rates": {},
        "runs": {},
        "scaling": {},
    }
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for rate in args.shaped:
            label = rate_label(rate)
            out["rates"][label], out["runs"][label] = {}, {}
            with netns.Lab() as lab:  # teardown (every process, every namespace) on any exit
                for i in range(len(SHAPED_NODES)):
                    lab.add_node(i, rate / 8, rate / 8, 0.0, 0.0)
                for preset, (v0, v1, info) in checkpoints.items():
                    runs = trio.run(_shaped_runs, lab, v0, v1, root, args, f"{label} {preset}")
                    summary = summarize_shaped(runs, _size(info), rate, args.shard_size)
                    out["rates"][label][preset] = summary
                    out["runs"][label][preset] = runs
            out["netem"] = lab.netem
            out["scaling"][label] = scaling(out["rates"][label], out["checkpoints"])
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.keep:
            print(f"# kept: {root}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return out


def scaling(
    by_preset: dict[str, dict[str, Any]], infos: dict[str, dict[str, Any]]
) -> dict[str, Any]:
    """Per system, the next version's last-peer time of each preset and the ratio of the
    last preset's to the first's (``next(4x)/next(1x)`` when run with ``real-1b,real-6b``);
    None where either did not finish or only one preset ran."""
    presets = list(by_preset)
    systems = sorted({sy for summary in by_preset.values() for sy in summary["systems"]})
    out: dict[str, Any] = {}
    for system in systems:
        nxt = {}
        for p in presets:
            vs = by_preset[p]["systems"].get(system, [])
            nxt[p] = vs[1]["last_s"] if len(vs) > 1 else None
        a, b = nxt[presets[0]], nxt[presets[-1]]
        ratio = round(b / a, 3) if len(presets) > 1 and a and b else None
        out[system] = {"next_s": nxt, "ratio_last_over_first": ratio}
    if len(presets) > 1:
        out["size_ratio"] = round(_size(infos[presets[-1]]) / _size(infos[presets[0]]), 3)
        out["changed_elements"] = {p: infos[p].get("changed_elements") for p in presets}
    return out


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


STAGE_COLUMNS = ("receive", "verify", "apply", "write", "materialize", "engine_update")


def print_shaped_table(out: dict[str, Any]) -> None:
    """The shaped run's tables: per rate and checkpoint, each system's full and next version;
    per node, the next version's CPU-seconds by stage; the next versions' scaling."""
    for preset, info in out["checkpoints"].items():
        print(f"checkpoint {preset}: {info}")
    machine = out.get("machine")
    if machine:
        print(
            f"machine: {machine['cores']} cores for all nodes; writing "
            f"{machine['write_bytes'] / 2**30:g} GiB into the page cache took "
            f"{machine['write_s']:.2f} s and {machine['write_cpu_s']:.2f} CPU-s"
            + (
                f"; creating a 100 KB file there {machine['create_ms']:.3f} ms of CPU"
                if "create_ms" in machine
                else ""
            )
        )
    _print_added_options(out)
    if out.get("seed_base"):
        print(
            "base seeded (--seed-base): the full version was not run; before the followers "
            "started, each one's store got version 0 hard-linked from the origin's verified "
            "copy; SHARDCAST (no deltas) published the next version alone"
        )
    if out.get("save_mb_s"):
        print(
            f"next version saved (--save-mb-s): written into shardnet's watched directory at "
            f"{out['save_mb_s']:g} MB/s before its ready marker (the origin pre-encodes each "
            "file once it is quiet); its times count from the marker, the save_s and the "
            "origin's CPU during it are in the stage table"
        )
    print(
        f"{'link':<11}{'checkpoint':<11}{'system':<18}{'version':>8}{'origin s':>9}"
        f"{'first s':>9}{'last s':>9}{'bound s':>9}{'eta':>7}{'origin MB':>11}  CPU-s per node"
    )
    for label, by_preset in out["rates"].items():
        for preset, res in by_preset.items():
            for system, per in res["systems"].items():
                for e in per:
                    print(_version_row(label, preset, system, e, res.get("seeded", False)))
            print(
                f"{label} {preset}: full_ratio_vs_shardcast={res['full_ratio_vs_shardcast']} "
                f"delta_ratio_vs_shardcast={res['delta_ratio_vs_shardcast']}"
            )
        _print_stage_table(label, by_preset)
        if machine:
            _print_cpu_floor(label, by_preset, machine["cores"])
        _print_scaling(label, out["scaling"].get(label, {}))


def _print_cpu_floor(label: str, by_preset: dict[str, Any], cores: int) -> None:
    """Per version, every node's CPU-seconds together and the least wall time that is on
    ``cores`` cores shared by all nodes, beside the last peer's time: where the two are
    close, the run measured this machine's cores more than the network or the protocol."""
    for preset, res in by_preset.items():
        for system, per in res["systems"].items():
            for e in per:
                if e.get("last_s") is None or e.get("cpu_total_s") is None:
                    continue
                version = "full" if e["step"] == 0 else "next"
                floor = e["cpu_total_s"] / cores
                print(
                    f"{label} {preset} {system} {version}: all nodes {e['cpu_total_s']:.2f} "
                    f"CPU-s, at least {floor:.2f} s on {cores} cores; last peer "
                    f"{e['last_s']:.2f} s ({floor / e['last_s']:.0%} of it)"
                )


def _version_row(label: str, preset: str, system: str, e: dict[str, Any], seeded: bool) -> str:
    version = "full" if e["step"] == 0 else "next"
    head = f"{label:<11}{preset:<11}{system:<18}{version:>8}"
    if e.get("last_s") is None:
        why = "not run: base seeded" if seeded and e["step"] == 0 else "did not finish"
        return f"{head}  ({why})"
    cpu = " ".join(f"{k}={v:g}" for k, v in e["cpu_s"].items())
    origin = "-" if e.get("origin_s") is None else f"{e['origin_s']:.2f}"
    return (
        f"{head}{origin:>9}{e['first_s']:>9.2f}{e['last_s']:>9.2f}{e['bound_s']:>9.2f}"
        f"{e['eta']:>7.3f}"
        f"{e['origin_bytes'] / 1e6:>11.1f}  {cpu}"
    )


def _print_stage_table(label: str, by_preset: dict[str, Any]) -> None:
    """Per node, the next version's CPU-seconds by stage (``shardnet_stage_cpu_seconds_total``
    before and after the version; SHARDCAST exports none), the process's, its idle rate
    (CPU-s per s, :data:`IDLE_S` before the version) and ``excess``: the process's CPU-s
    minus that rate times the last peer's time."""
    cols = (*STAGE_COLUMNS, "stages", "process", "idle/s", "excess")
    head = "".join(f"{c:>14}" for c in cols)
    for preset, res in by_preset.items():
        for system, per in res["systems"].items():
            e = per[1] if len(per) > 1 else {}
            if not e.get("stage_cpu_s"):
                continue
            saved = ""
            if e.get("save_s") is not None:
                saved = (
                    f"; saved in {e['save_s']:.2f} s before the marker, origin CPU-s during the "
                    f"save {e['origin_save_cpu_s']}"
                )
            print(f"{label} {preset} {system}: next version, CPU-s by stage (medians){saved}")
            print(f"  {'node':<8}{head}")
            for node, stages in e["stage_cpu_s"].items():
                cells = [stages.get(c, 0.0) for c in STAGE_COLUMNS]
                process = e["cpu_s"].get(node, float("nan"))
                idle = (e.get("idle_cpu_s_per_s") or {}).get(node, float("nan"))
                cells += [sum(stages.values()), process, idle, process - idle * e["last_s"]]
                print(f"  {node:<8}" + "".join(f"{x:>14.3f}" for x in cells))
            served = e.get("served") or {}
            routes = sorted({r for per_node in served.values() for r in per_node})
            if routes:
                print(f"{label} {preset} {system}: next version, lane requests served by route")
                print(f"  {'node':<8}" + "".join(f"{r:>10}" for r in (*routes, "all")))
                for node, per_node in served.items():
                    cells = [per_node.get(r, 0) for r in routes]
                    print(f"  {node:<8}" + "".join(f"{x:>10.0f}" for x in (*cells, sum(cells))))


def _print_scaling(label: str, sc: dict[str, Any]) -> None:
    if "size_ratio" not in sc:
        return
    for system, row in sc.items():
        if not isinstance(row, dict) or "next_s" not in row:
            continue
        times = " ".join(f"{p}={t}" for p, t in row["next_s"].items())
        print(
            f"{label} {system}: next version last peer s {times}; "
            f"next(last)/next(first)={row['ratio_last_over_first']} "
            f"(checkpoint size ratio {sc['size_ratio']}, changed elements "
            f"{sc['changed_elements']})"
        )


# ----------------------------------------------------------------------------- report


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs))


def summarize(
    runs: dict[str, list[dict[str, Any]]], size: int, loopback_bps: float
) -> dict[str, Any]:
    """Medians per system and version, ratios, η."""
    out: dict[str, Any] = {"systems": {}, "loopback_bytes_per_s": round(loopback_bps)}
    for system, rs in runs.items():
        per = []
        for step in (0, 1):
            vs = [r["versions"][step] for r in rs if len(r["versions"]) > step]
            if not vs:
                continue
            last = _median([v["last_s"] for v in vs])
            entry = {
                "step": step,
                "last_s": round(last, 3),
                "first_s": round(_median([v["first_s"] for v in vs]), 3),
                "origin_bytes": int(_median([v["origin_bytes"] or 0 for v in vs])),
                "relay_bytes": vs[len(vs) // 2]["relay_bytes"],
                "repeats": len(vs),
            }
            if "received_bytes" in vs[0]:
                moved = _median([v["received_bytes"] for v in vs])
                entry["bytes_moved"] = int(moved)
                # every relay and peer must receive the version's bytes (as sent)
                must = (N_RELAYS + N_PEERS) * (entry["origin_bytes"] or size)
                entry["eta"] = round(must / loopback_bps / last, 3)
            per.append(entry)
        out["systems"][system] = per

    def t(system: str, step: int) -> float | None:
        vs = out["systems"].get(system, [])
        return vs[step]["last_s"] if len(vs) > step else None

    sc0, sc1, sn0, sn1 = t("shardcast", 0), t("shardcast", 1), t("shardnet", 0), t("shardnet", 1)
    fl0, fl1 = t("floor", 0), t("floor", 1)
    out["full_ratio_vs_shardcast"] = round(sn0 / sc0, 4) if sn0 and sc0 else None
    out["delta_ratio_vs_shardcast"] = round(sn1 / sc1, 4) if sn1 and sc1 else None
    out["floor_full_ratio_vs_shardcast"] = round(fl0 / sc0, 4) if fl0 and sc0 else None
    out["floor_delta_ratio_vs_shardcast"] = round(fl1 / sc1, 4) if fl1 and sc1 else None
    sn = out["systems"].get("shardnet", [])
    if len(sn) > 1 and sn[0]["origin_bytes"]:
        out["delta_bytes_ratio"] = round(sn[1]["origin_bytes"] / sn[0]["origin_bytes"], 4)
    else:
        out["delta_bytes_ratio"] = None
    return out


async def amain(args: argparse.Namespace) -> dict[str, Any]:
    cache = Path(args.cache)
    v0, v1, info = prepare_checkpoints(cache, args.preset, args.lr, args.max_shard_bytes)
    size = info["size_bytes"]
    if args.size_bytes:
        v0, v1, size = subset_versions(v0, v1, v0.parent, args.size_bytes)
        info = {**info, "subset_bytes": size}
    loopback = await loopback_throughput()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    root = Path(tempfile.mkdtemp(prefix="shardnet-bench-", dir=args.workdir))
    try:
        for rep in range(args.repeats):
            for system in rotated(args.systems, rep):
                wd = root / f"{system}-{rep}"
                print(f"# run {rep + 1}/{args.repeats}: {system}", file=sys.stderr, flush=True)
                if system == "shardcast":
                    venv = ensure_shardcast_venv(Path(args.shardcast_venv))
                    r = await run_shardcast(v0, v1, wd, args.timeout, venv)
                elif system == "floor":
                    r = await trio.to_thread.run_sync(_floor().run_floor, v0, v1, wd, args.timeout)
                else:
                    r = await run_shardnet(
                        v0,
                        v1,
                        wd,
                        deltas=system == "shardnet",
                        shard_size=args.shard_size,
                        timeout_s=args.timeout,
                        log_level=args.log_level,
                        relay_serve_once_s=args.relay_serve_once_s,
                        origin_extra=shlex.split(args.origin_args),
                        relay_extra=shlex.split(args.relay_args),
                    )
                runs[system].append(r)
                print(json.dumps(r["versions"], default=str)[:2000], file=sys.stderr, flush=True)
                if not args.keep:
                    shutil.rmtree(wd, ignore_errors=True)
    finally:
        if args.keep:
            print(f"# kept: {root}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    out = summarize(runs, size, loopback)
    out["checkpoint"] = info
    out["origin_args"], out["relay_args"] = args.origin_args, args.relay_args
    out["runs"] = runs
    return out


def _print_added_options(out: dict[str, Any]) -> None:
    """Say which options ``--origin-args``/``--relay-args`` added to the shardnet nodes."""
    for role in ("origin", "relay"):
        if out.get(f"{role}_args"):
            print(f"shardnet {role} options added (--{role}-args): {out[f'{role}_args']}")


def print_table(out: dict[str, Any]) -> None:
    print(f"checkpoint: {out['checkpoint']}")
    _print_added_options(out)
    print(f"loopback plain-socket throughput: {out['loopback_bytes_per_s'] / 1e9:.2f} GB/s")
    print(
        f"{'system':<18}{'version':>8}{'last peer s':>13}{'first s':>9}{'origin bytes':>16}"
        f"{'relay bytes':>28}{'eta':>7}"
    )
    for system, per in out["systems"].items():
        for e in per:
            rb = (
                ",".join(f"{v / 1e6:.0f}M" for v in (e["relay_bytes"] or {}).values())
                if isinstance(e["relay_bytes"], dict)
                else str(e["relay_bytes"])
            )
            print(
                f"{system:<18}{'full' if e['step'] == 0 else 'next':>8}{e['last_s']:>13.2f}"
                f"{e['first_s']:>9.2f}{e['origin_bytes']:>16,}{rb:>28}"
                f"{e.get('eta', float('nan')):>7.2f}"
            )
    print(
        f"full_ratio_vs_shardcast={out['full_ratio_vs_shardcast']} "
        f"delta_ratio_vs_shardcast={out['delta_ratio_vs_shardcast']} "
        f"delta_bytes_ratio={out['delta_bytes_ratio']}"
    )
    if out.get("floor_full_ratio_vs_shardcast") is not None:
        print(
            f"floor_full_ratio_vs_shardcast={out['floor_full_ratio_vs_shardcast']} "
            f"floor_delta_ratio_vs_shardcast={out['floor_delta_ratio_vs_shardcast']} "
            "(no system can go below these ratios on this machine in this run)"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeats", type=int, default=None, help="default 3 (1 with --quick)")
    ap.add_argument("--quick", action="store_true", help="1 repeat, real-1b checkpoint")
    ap.add_argument(
        "--preset",
        default=None,
        help="checkpoint preset (default real-2b; with --shaped real-1b, whole; --shaped "
        "takes a comma-separated list, e.g. real-1b,real-6b: each on the same lab, and the "
        "next versions' time ratio)",
    )
    ap.add_argument(
        "--seed-base",
        action="store_true",
        help="--shaped: run only the next version; every follower's store gets version 0 "
        "hard-linked from the origin's verified copy before it starts",
    )
    ap.add_argument("--lr", type=float, default=1e-6, help="Adam lr of the next version")
    ap.add_argument(
        "--max-shard-bytes",
        type=int,
        default=512 << 20,
        help="safetensors file size cap of the generated checkpoints",
    )
    ap.add_argument("--shard-size", type=int, default=16 << 20, help="shardnet shard size")
    ap.add_argument(
        "--save-mb-s",
        type=float,
        help="--shaped: write shardnet's next version into the origin's watched directory at "
        "this many MB/s (1e6 bytes), file by file, before its ready marker, as a trainer's "
        "save does, instead of hard-linking it there at once (times still count from the "
        "marker; SHARDCAST, which encodes nothing ahead, is unchanged)",
    )
    ap.add_argument(
        "--systems",
        nargs="+",
        default=DEFAULT_SYSTEMS,
        help="default: all four; with --shaped: shardnet shardcast (floor is loopback only)",
    )
    ap.add_argument("--cache", default="/tmp/shardnet-bench-cache")
    ap.add_argument(
        "--shardcast-venv",
        default=None,
        help="venv with SHARDCAST 0.3.2, created if missing (default: $SHARDCAST_VENV, else "
        "/var/tmp/shardnet-bench-cache/shardcast-venv)",
    )
    ap.add_argument("--workdir", default=None, help="parent of the run directories")
    ap.add_argument("--timeout", type=float, default=900.0, help="per version, seconds")
    ap.add_argument(
        "--keep", action="store_true", help="keep the run directories (node data and logs)"
    )
    ap.add_argument("--log-level", default="WARNING", help="shardnet nodes' log level")
    ap.add_argument(
        "--shaped",
        action="append",
        default=[],
        metavar="RATE",
        help="shaped-link mode (root): each node in its own network namespace, links shaped "
        "with tc tbf at RATE (200M, 1G; repeat or comma-separate for several rates)",
    )
    ap.add_argument(
        "--size-bytes",
        type=int,
        default=None,
        help="use only about this many bytes of weight files of the checkpoints",
    )
    ap.add_argument("--out", default=None, help="also write the full JSON result here")
    ap.add_argument(
        "--relay-serve-once-s",
        type=float,
        default=None,
        help="shardnet relays' super-seeding window, seconds (0: off; default: the relay "
        "role's default, 5 s)",
    )
    ap.add_argument(
        "--origin-args",
        default="",
        metavar="OPTIONS",
        help="options appended to the shardnet origin's command line (shell-quoted, e.g. "
        "'--shards-per-part 8'); recorded in the JSON",
    )
    ap.add_argument(
        "--relay-args",
        default="",
        metavar="OPTIONS",
        help="options appended to both shardnet relays' command lines (e.g. "
        "'--serve-once-min-bytes 0'); recorded in the JSON",
    )
    args = ap.parse_args(argv)
    unknown = sorted(set(args.systems) - set(DEFAULT_SYSTEMS))
    if unknown:
        print(
            f"broadcast: --systems {' '.join(unknown)}: unknown (choose from "
            f"{', '.join(DEFAULT_SYSTEMS)})",
            file=sys.stderr,
        )
        return 2
    for role in ("origin", "relay"):
        try:
            shlex.split(getattr(args, f"{role}_args"))
        except ValueError as exc:
            print(f"broadcast: --{role}-args: {exc}", file=sys.stderr)
            return 2
    if args.shardcast_venv is None:
        args.shardcast_venv = _baseline().DEFAULT_VENV
    if args.workdir is not None:
        try:
            Path(args.workdir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            print(f"broadcast: --workdir {args.workdir}: {exc.strerror}", file=sys.stderr)
            return 2
    try:
        args.shaped = [parse_rate(r) for x in args.shaped for r in x.split(",") if r.strip()]
    except ValueError as exc:
        print(f"broadcast: --shaped: {exc}", file=sys.stderr)
        return 2
    if args.shaped:
        return shaped_main(args)
    if args.seed_base or args.save_mb_s is not None:
        print("broadcast: --seed-base and --save-mb-s need --shaped", file=sys.stderr)
        return 2
    args.preset = args.preset or "real-2b"
    if args.quick:
        args.repeats, args.preset = args.repeats or 1, "real-1b"
    args.repeats = args.repeats or 3
    out = trio.run(amain, args)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "runs"}, default=str))
    else:
        print_table(out)
    return 0


def shaped_main(args: argparse.Namespace) -> int:
    """``--shaped``: check root and iproute2, apply the quick/shaped defaults, run, report."""
    if args.systems == DEFAULT_SYSTEMS:
        args.systems = ["shardnet", "shardcast"]
    if "floor" in args.systems:
        print(
            "broadcast: --systems floor runs on loopback only, not with --shaped", file=sys.stderr
        )
        return 2
    sys.path.insert(0, str(REPO))
    from simulations import netns

    ok, why = netns.available()
    if not ok:
        print(f"broadcast: --shaped needs network namespaces: {why}", file=sys.stderr)
        return 2
    if args.workdir is None:
        args.workdir = "/var/tmp"  # SHARDCAST's private /tmp per process needs a dir outside /tmp
    if "shardcast" in args.systems and Path(args.shardcast_venv).resolve().is_relative_to("/tmp"):
        print(
            f"broadcast: --shardcast-venv {args.shardcast_venv}: --shaped gives each SHARDCAST "
            "process a private /tmp, where this venv does not exist; choose a path outside /tmp",
            file=sys.stderr,
        )
        return 2
    if args.save_mb_s is not None and not args.save_mb_s > 0:
        print(f"broadcast: --save-mb-s {args.save_mb_s}: not a positive rate", file=sys.stderr)
        return 2
    args.presets = [p.strip() for p in (args.preset or "real-1b").split(",") if p.strip()]
    if args.quick:
        args.repeats, args.presets, args.max_shard_bytes = args.repeats or 1, ["real-1b"], 128 << 20
        args.size_bytes = args.size_bytes or 240_000_000
        args.timeout = min(args.timeout, 300.0)
    args.repeats = args.repeats or 3
    from rollout.model import PRESETS

    unknown = [p for p in args.presets if p not in PRESETS]
    if unknown or not args.presets:
        print(
            f"broadcast: --preset {args.preset}: unknown preset {unknown} (known: "
            f"{', '.join(PRESETS)})",
            file=sys.stderr,
        )
        return 2
    try:
        out = run_shaped(args)
    except KeyboardInterrupt:
        print(
            "broadcast: interrupted; every node stopped, every namespace removed", file=sys.stderr
        )
        return 130
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str) + "\n")
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "runs"}, default=str))
    else:
        print_shaped_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
