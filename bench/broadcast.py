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
version: each peer is shown a quarter of their sum). Every namespace (and every process in
one) is removed on any exit, Ctrl-C and SIGTERM included; labs left by a killed run are
removed at the next start. ``--size-bytes`` cuts both versions to the same subset of weight
files (still a valid checkpoint); ``--quick`` here means 1 repeat of ``real-1b`` cut to
~240 MB (about 5 minutes for 200 Mb/s and 1 Gb/s).

Run (about 30-40 minutes with 3 repeats; ``--quick`` for a 1-repeat smoke run):

    .venv/bin/python bench/broadcast.py --json
    sudo .venv/bin/python bench/broadcast.py --shaped 200M,1G --repeats 3 --preset real-1b
    sudo .venv/bin/python bench/broadcast.py --shaped 200M,1G --quick --out shaped.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "bench"
# every node of the benchmark runs on this machine: loopback only, any free port
LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0", "--http-host", "127.0.0.1", "--http-port", "0"]
N_RELAYS, N_PEERS = 2, 4
DEFAULT_SYSTEMS = ["shardnet", "shardnet-nodelta", "shardcast", "floor"]


# ----------------------------------------------------------------------------- checkpoints


def prepare_checkpoints(
    cache: Path, preset: str, lr: float, max_shard_bytes: int
) -> tuple[Path, Path, dict[str, Any]]:
    """Version 0 (seeded random weights) and version 1 (one Adam step), cached on disk."""
    d = cache / f"{preset}-lr{lr:g}-shard{max_shard_bytes}"
    v0, v1, info_path = d / "v0", d / "v1", d / "info.json"
    if info_path.exists():
        return v0, v1, json.loads(info_path.read_text())
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
    info = {
        "preset": preset,
        "lr": lr,
        "generate_s": round(gen_s, 1),
        "evolve_s": round(time.monotonic() - t, 1),
        "changed_percent": float(m.group(1)) if m else None,
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


_SCRAPE = (
    "import sys, urllib.request; "
    "sys.stdout.write(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())"
)


async def _sent_bytes(client: Any, url: str, prefix: list[str] | None = None) -> int:
    """``shardnet_http_sent_bytes_total`` (lane body bytes sent so far) from a node's
    ``/metrics`` (with ``prefix``: fetched from inside the node's network namespace, where its
    address is reachable)."""
    if prefix:
        res = await trio.run_process(
            [*prefix, sys.executable, "-c", _SCRAPE, url + "/metrics"], capture_stdout=True
        )
        text = res.stdout.decode()
    else:
        text = (await client.get_bytes(url + "/metrics", max_bytes=1 << 20, timeout_s=10)).decode()
    m = re.search(r"^shardnet_http_sent_bytes_total (\S+)", text, re.MULTILINE)
    return int(float(m.group(1))) if m else 0


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
) -> dict[str, Any]:
    """One shardnet run: publish v0 then v1; returns per-version measurements.

    ``place(node_name)`` (``origin``, ``relay1``, ``peer3``...) runs that node in a network
    namespace at its address (``--shaped``); without it every node is on 127.0.0.1.
    ``relay_serve_once_s``: the two relays' super-seeding window (0: off; None: the relay
    default, on). The peers never super-seed.
    """
    from p2p.http_client import HttpClient
    from p2p.identity import Identity

    workdir.mkdir(parents=True)  # noqa: ASYNC240 - setup, before anything is timed
    trainer_key = workdir / "origin" / "node.key"
    trainer_id = Identity.load_or_create(trainer_key).peer_id
    publish = workdir / "publish"
    publish.mkdir()
    common = ["--run-id", RUN_ID, "--keep-last", "2", "--log-level", log_level]

    def net(name: str) -> list[str]:
        if place is None:
            return LOOPBACK
        ip = place(name).ip
        return ["--listen", f"/ip4/{ip}/tcp/4001", "--http-host", ip, "--http-port", "8001"]

    def prefix(name: str) -> list[str]:
        return [] if place is None else place(name).prefix

    procs: list[Proc] = []
    versions = []
    async with trio.open_nursery() as nursery, HttpClient() as client:
        try:
            origin = Proc(
                "origin",
                [
                    "origin",
                    "--key",
                    str(trainer_key),
                    "--data-dir",
                    str(workdir / "origin"),
                    "--watch",
                    str(publish),
                    "--shard-size-bytes",
                    str(shard_size),
                    "--deltas" if deltas else "--no-deltas",
                    *common,
                    *net("origin"),
                ],
                workdir,
                prefix("origin"),
            )
            procs.append(origin)
            oaddr = (await origin.start(nursery))["multiaddrs"][0]
            relay_addrs = []
            for i in range(1, N_RELAYS + 1):
                p = Proc(
                    f"relay{i}",
                    [
                        "relay",
                        "--upstream",
                        oaddr,
                        "--trainer-id",
                        trainer_id,
                        "--data-dir",
                        str(workdir / f"relay{i}"),
                        *(
                            ["--serve-once-s", f"{relay_serve_once_s:g}"]
                            if relay_serve_once_s is not None
                            else []
                        ),
                        *common,
                        *net(f"relay{i}"),
                    ],
                    workdir,
                    prefix(f"relay{i}"),
                )
                procs.append(p)
                relay_addrs.append((await p.start(nursery))["multiaddrs"][0])
            peers = []
            for i in range(1, N_PEERS + 1):
                p = Proc(
                    f"peer{i}",
                    [
                        "relay",
                        *[a for r in relay_addrs for a in ("--upstream", r)],
                        "--trainer-id",
                        trainer_id,
                        "--data-dir",
                        str(workdir / f"peer{i}"),
                        # download-only followers standing in for inference peers, which
                        # never super-seed
                        "--serve-once-s",
                        "0",
                        *common,
                        *net(f"peer{i}"),
                    ],
                    workdir,
                    prefix(f"peer{i}"),
                )
                procs.append(p)
                peers.append(p)
                await p.start(nursery)
            for step, src in enumerate((v0, v1)):
                staged = publish / f"step-{step}"
                staged.mkdir()
                for f in src.iterdir():
                    os.link(f, staged / f.name)
                sent0 = {
                    p.name: await _sent_bytes(client, p.ready["http_url"], p.prefix) for p in procs
                }
                cpu0 = {p.name: _cpu_s(p) for p in procs}
                sys0 = {p.name: _cpu_s(p, "sys") for p in procs}
                t0 = time.perf_counter()
                (staged / "DONE").touch()
                done: dict[str, float] = {}
                with trio.fail_after(timeout_s):
                    while len(done) < N_PEERS:
                        for p in peers:
                            mark = (
                                workdir
                                / p.name
                                / "versions"
                                / RUN_ID
                                / f"step-{step}"
                                / "manifest.json"
                            )
                            if p.name not in done and mark.exists():
                                done[p.name] = time.perf_counter() - t0
                        await trio.sleep(0.02)
                cpu = {p.name: round(_cpu_s(p) - cpu0[p.name], 2) for p in procs}
                cpu_sys = {p.name: round(_cpu_s(p, "sys") - sys0[p.name], 2) for p in procs}
                sent = {
                    p.name: await _sent_bytes(client, p.ready["http_url"], p.prefix) - sent0[p.name]
                    for p in procs
                }
                store = workdir / "origin" / "versions" / RUN_ID / f"step-{step}"
                min_bytes, n_shards = await trio.to_thread.run_sync(
                    least_bytes, store / "manifest.json", trainer_id
                )
                versions.append(
                    {
                        "step": step,
                        "first_s": round(min(done.values()), 3),
                        "last_s": round(max(done.values()), 3),
                        "peers_s": done,
                        "origin_bytes": sent["origin"],
                        "relay_bytes": {
                            f"relay{i}": sent[f"relay{i}"] for i in range(1, N_RELAYS + 1)
                        },
                        "peer_bytes": {p.name: sent[p.name] for p in peers},
                        "received_bytes": sum(sent.values()),
                        "least_bytes": min_bytes,
                        "shards": n_shards,
                        "cpu_s": cpu,
                        "cpu_sys_s": cpu_sys,
                    }
                )
        finally:
            with trio.CancelScope(shield=True):
                for p in reversed(procs):
                    await p.stop()
            nursery.cancel_scope.cancel()
    return {"system": "shardnet" if deltas else "shardnet-nodelta", "versions": versions}


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


def _baseline() -> Any:
    """The module ``bench/shardcast_baseline.py``."""
    _bench_path()
    import shardcast_baseline  # type: ignore[import-not-found]

    return shardcast_baseline


async def run_shardcast(
    v0: Path, v1: Path, workdir: Path, timeout_s: float, venv: Path, **config: Any
) -> dict[str, Any]:
    """One SHARDCAST run through bench/shardcast_baseline.py (1 origin, 2 middles with
    ``--check-interval 1``, 4 clients on 127.0.0.1, or placed by ``config``'s ``hosts`` and
    ``exec_prefix``; crashed clients restarted and counted)."""
    res = await _baseline().arun_shardcast(
        v0, workdir, next_checkpoints=[v1], timeout_s=timeout_s, venv=str(venv), **config
    )
    versions = []
    for step, v in enumerate(res["versions"]):
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
    return {"system": "shardcast", "versions": versions}


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
                [r["versions"][step] for r in rs if len(r["versions"]) > step],
                out["bounds"][step]["bound_s"],
            )
            for step in (0, 1)
        ]

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
        "origin_bytes": int(_median([v["origin_bytes"] or 0 for v in vs])),
        "bound_s": bound,
        "eta": round(bound / last, 3),
        "cpu_s": {
            k: round(_median([(v.get("cpu_s") or {}).get(k, 0.0) for v in vs]), 2) for k in nodes
        },
        "repeats": len(vs),
        "failed": len(vs) - len(lasts),
    }


def run_shaped(args: argparse.Namespace) -> dict[str, Any]:
    """The shaped-link benchmark (``--shaped``): one lab of 7 network namespaces per rate."""
    sys.path.insert(0, str(REPO))
    from simulations import netns

    cache = Path(args.cache)
    v0, v1, info = prepare_checkpoints(cache, args.preset, args.lr, args.max_shard_bytes)
    size = info["size_bytes"]
    if args.size_bytes:
        v0, v1, size = subset_versions(v0, v1, v0.parent, args.size_bytes)
        info = {**info, "subset_bytes": size, "subset_dir": str(v0.parent)}
    removed = netns.cleanup_stale()
    if removed:
        print(f"# removed stale labs {removed}", file=sys.stderr, flush=True)
    Path(args.workdir).mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="shardnet-shaped-", dir=args.workdir))
    out: dict[str, Any] = {"checkpoint": info, "rates": {}, "runs": {}}
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        for rate in args.shaped:
            label = rate_label(rate)
            with netns.Lab() as lab:  # teardown (every process, every namespace) on any exit
                for i in range(len(SHAPED_NODES)):
                    lab.add_node(i, rate / 8, rate / 8, 0.0, 0.0)
                runs = trio.run(_shaped_runs, lab, v0, v1, root, args, label)
            out["rates"][label] = summarize_shaped(runs, size, rate, args.shard_size)
            out["runs"][label] = runs
            out["netem"] = lab.netem
    finally:
        signal.signal(signal.SIGTERM, previous)
        if args.keep:
            print(f"# kept: {root}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return out


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def print_shaped_table(out: dict[str, Any]) -> None:
    print(f"checkpoint: {out['checkpoint']}")
    print(
        f"{'link':<11}{'system':<18}{'version':>8}{'first s':>9}{'last s':>9}{'bound s':>9}"
        f"{'eta':>7}{'origin MB':>11}  CPU-s per node"
    )
    for label, res in out["rates"].items():
        for system, per in res["systems"].items():
            for e in per:
                version = "full" if e["step"] == 0 else "next"
                if e.get("last_s") is None:
                    print(f"{label:<11}{system:<18}{version:>8}  (did not finish)")
                    continue
                cpu = " ".join(f"{k}={v:g}" for k, v in e["cpu_s"].items())
                print(
                    f"{label:<11}{system:<18}{version:>8}{e['first_s']:>9.2f}{e['last_s']:>9.2f}"
                    f"{e['bound_s']:>9.2f}{e['eta']:>7.3f}{e['origin_bytes'] / 1e6:>11.1f}  {cpu}"
                )
        print(
            f"{label}: full_ratio_vs_shardcast={res['full_ratio_vs_shardcast']} "
            f"delta_ratio_vs_shardcast={res['delta_ratio_vs_shardcast']}"
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
    out["runs"] = runs
    return out


def print_table(out: dict[str, Any]) -> None:
    print(f"checkpoint: {out['checkpoint']}")
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
    ap.add_argument("--preset", default="real-2b")
    ap.add_argument("--lr", type=float, default=1e-6, help="Adam lr of the next version")
    ap.add_argument(
        "--max-shard-bytes",
        type=int,
        default=512 << 20,
        help="safetensors file size cap of the generated checkpoints",
    )
    ap.add_argument("--shard-size", type=int, default=16 << 20, help="shardnet shard size")
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
    args = ap.parse_args(argv)
    unknown = sorted(set(args.systems) - set(DEFAULT_SYSTEMS))
    if unknown:
        print(
            f"broadcast: --systems {' '.join(unknown)}: unknown (choose from "
            f"{', '.join(DEFAULT_SYSTEMS)})",
            file=sys.stderr,
        )
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
    if args.quick:
        args.repeats, args.preset, args.max_shard_bytes = args.repeats or 1, "real-1b", 128 << 20
        args.size_bytes = args.size_bytes or 240_000_000
        args.timeout = min(args.timeout, 300.0)
    args.repeats = args.repeats or 3
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
