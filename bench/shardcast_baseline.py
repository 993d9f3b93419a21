"""SHARDCAST 0.3.2 baseline: broadcast a checkpoint through PrimeIntellect's HTTP relay tree.

Runs the PyPI package ``shardcast==0.3.2`` (the relay tree of INTELLECT-2) as external programs
from its own virtual environment (default ``/var/tmp/shardnet-bench-cache/shardcast-venv``, or
``$SHARDCAST_VENV``), on 127.0.0.1 by default: one origin, ``middles`` middle nodes (relays) and
``clients`` clients, every port picked free. ``TreeConfig.hosts``/``exec_prefix`` place
processes elsewhere instead (``bench/broadcast.py --shaped``: each in a network namespace of its
own, created by that benchmark, at its namespace address, on a fixed port). Nothing here imports
SHARDCAST: this module needs only the standard library and trio, and SHARDCAST's own top-level
package is also called ``shardcast`` (as is ours), so it is kept in the other interpreter.

Usage::

    python bench/shardcast_baseline.py --size-mib 256 --versions 2
    python bench/shardcast_baseline.py --checkpoint /dev/shm/step_1 --checkpoint /dev/shm/step_2

or from Python (``bench/broadcast.py``)::

    from bench.shardcast_baseline import run_shardcast        # sync; arun_shardcast in trio
    result = run_shardcast(ckpt_dir, workdir, next_checkpoints=[ckpt_dir_2])

How SHARDCAST is driven (see ``_LAUNCHER``, a 40-line shim run by the other venv's python):

- origin: ``shardcast.origin_server.OriginServer`` kept in one process that reads one JSON
  request per stdin line and calls ``broadcast(path)`` (the CLI ``shardcast-origin`` only
  serves a directory; publishing is a library call, as in prime-rl's trainer).
- middle nodes and clients: the entry points of ``shardcast-middle`` and ``shardcast-client``
  (``middle_node.main`` / ``client_node.main``) with their normal arguments.
- the only change made to SHARDCAST: its HTTP servers bind ``127.0.0.1`` (or the process's
  host from ``TreeConfig.hosts``) instead of ``0.0.0.0`` and ``get_local_ip`` answers that
  address (``bind_loopback=True``).
- SHARDCAST broadcasts one file per version, so a checkpoint directory is packed into one
  uncompressed tar first (``pack_s`` reports the cost; prime-rl broadcast one
  ``model.safetensors``). A single file is broadcast as is.
- a SHARDCAST client downloads one version and exits; for each published version the
  harness starts one client process per client as soon as every middle node lists the
  version (``client_start="listed"``; ``"immediate"``: as soon as ``broadcast()`` returns)
  and restarts it after ``restart_delay_s`` whenever it exits without a verified copy.

Crashes and restarts (all reproduced here; counted per version in the result):

- every SHARDCAST process first downloads ``data1.bin`` from each of its servers into the
  fixed path ``/tmp/dummy.tmp`` and renames it to ``/tmp/dummy.bin``: a server without that
  file makes the process die (``Exception: Failed to download dummy file``), and processes
  probing at once on one machine race on those paths (the same exception, from a
  ``FileNotFoundError``). Clients also share ``site-packages/temp_distribution.txt``.
- the probe's size over its time seeds the weight of each server; a server whose probe read
  0 bytes (an empty ``data1.bin``, or one truncated by a concurrent prober) gets weight 0,
  and with every weight 0 the client dies (``ValueError: Total of weights must be greater
  than zero``) while a middle node keeps running but logs that error every check interval
  and never fetches again: after ``stuck_after`` such errors in a row the harness kills and
  restarts it (outcome ``stuck``).
- a client that finds the version unlisted exits 1 (``Version vN not found``), as it does
  when a download or the checksum fails; the harness classifies exits as ``crash`` (an
  uncaught exception) or ``failure`` (a logged error, exit 1) and restarts the client.
- ``isolate_scratch=True`` (root) gives each process its own ``/tmp`` (private mount
  namespace) and its own ``temp_distribution`` directory, as on separate machines.

Completion: a client holds a verified copy when it logs ``Checksum verification passed for
<file>`` (SHARDCAST's whole-file BLAKE3 check, after reassembly); the harness reads every
process's log through a pipe as it is written, so nothing polls, and takes the time from
SHARDCAST's own log timestamp (millisecond resolution). After the last client, the harness
checks each client's file against the SHA-256 of what was published (off the clock).

Bytes sent: SHARDCAST has no byte counters, but its HTTP servers (``http.server``) log
every request at DEBUG (path and status). Each server's payload bytes are the sizes, in
its served directory, of the files it answered 200 for (files are written once, renamed
into place, never changed). The log line is written before the body, so an aborted
transfer would count as whole (on loopback none were seen); headers are not counted.
This was chosen over ``/proc/<pid>/io`` (``wchar`` does not count ``send()``, which
``http.server`` uses, and counts file writes) and over a counting TCP proxy (an extra
loopback copy of every byte on a 2-core machine would slow what is being measured).
It was cross-checked against ``lo``'s tx_bytes in a private network namespace.

Teardown: each process runs in its own process group; groups get SIGTERM then SIGKILL, then
/proc is searched for anything left in those groups (reported, and killed). The launcher
also kills its own group if the harness dies. The CLI tears down on SIGTERM and SIGHUP.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import functools
import hashlib
import json
import math
import os
import random
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tarfile
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

# outside /tmp: with isolate_scratch every SHARDCAST process sees a private, empty /tmp
FALLBACK_VENV = "/var/tmp/shardnet-bench-cache/shardcast-venv"
DEFAULT_VENV = os.environ.get("SHARDCAST_VENV", FALLBACK_VENV)
EXPECTED_VERSION = "0.3.2"
LOOPBACK = "127.0.0.1"

# The shim run by SHARDCAST's interpreter (python -I, so neither PYTHONPATH nor the current
# directory can put shardnet's own ``shardcast`` package in front of SHARDCAST's).
_LAUNCHER = r"""
import json, os, sys, time
role, bind, site = sys.argv[1], sys.argv[2], sys.argv[3]
if site:  # a private directory whose "shardcast" links to the venv's package (see isolate_scratch)
    sys.path.insert(0, site)
del sys.argv[1:4]
import threading
def _orphan_watch(parent=os.getppid()):  # the harness died without cleanup: take our group down
    while os.getppid() == parent:
        time.sleep(1)
    os.killpg(os.getpgrp(), 9)
threading.Thread(target=_orphan_watch, daemon=True).start()
import shardcast
import shardcast.server as _server
if bind:
    _orig_init = _server.ShardcastServer.__init__
    def _init(self, address, *args, **kwargs):
        _orig_init(self, (bind, address[1]), *args, **kwargs)
    _server.ShardcastServer.__init__ = _init
    _server.get_local_ip = lambda: bind
print(json.dumps({"event": "launched", "role": role, "shardcast_version": shardcast.__version__,
                  "module": shardcast.__file__, "pid": os.getpid()}), flush=True)
if role == "origin":
    from shardcast.origin_server import OriginServer
    origin = OriginServer(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
    print(json.dumps({"event": "ready"}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        t0 = time.time()
        try:
            version = origin.broadcast(request["path"])
        except Exception as exc:
            print(json.dumps({"event": "error", "error": repr(exc)}), flush=True)
            continue
        print(json.dumps({"event": "broadcast", "version": version, "t0": t0,
                          "t1": time.time()}), flush=True)
    origin.shutdown()
else:
    sys.argv = ["shardcast-" + role] + sys.argv[1:]
    if role == "middle":
        from shardcast.middle_node import main
    else:
        from shardcast.client_node import main
    sys.exit(main())
"""

_LOG_RE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) - shardcast\.utils - (\w+) - (.*)$")
_REQ_RE = re.compile(r'"([A-Z]+) (\S+) [^"]*" (\d{3}) \S+$')
_LISTED_RE = re.compile(r"^Distribution file indicates (\d+) shards for version (\S+)$")
_FINISHED_RE = re.compile(r"^Finished downloading all (\d+) shards for version (\S+)$")
_GOT_RE = re.compile(r"^Downloaded (\S+) from (\S+) \(bandwidth: (\d+) MB/s\)$")
_FAILED_RE = re.compile(r"^Failed to download (\S+) from (\S+): (.*)$")
_RETRY_RE = re.compile(r"^(Fast|Slow) retrying download of (\S+) ")
_SHARD_PATH_RE = re.compile(r"^/?(v\d+)/shard_\d+\.bin$")
_CLIENT_ADDR_RE = re.compile(r"^\d{1,3}\.\d{1,3}\.\d{1,3}\.\d{1,3} ")  # http.server's log lines


def _log_time(stamp: str) -> float:
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def _proc_cpu_s(pid: int) -> float | None:
    """utime + stime of a live process and of its reaped children (wget), in seconds."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    ticks = sum(int(x) for x in fields[11:15])
    return ticks / os.sysconf("SC_CLK_TCK")


def _ancestors() -> set[int]:
    pids, pid = set(), os.getpid()
    while pid > 1:
        pids.add(pid)
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return pids


def _processes_of(pgids: set[int], marker: str) -> list[int]:
    """Live pids in one of our process groups or whose command line names our launcher."""
    found, skip = [], _ancestors()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) in skip:
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":
            continue
        if int(fields[2]) in pgids or marker in cmdline:
            found.append(int(entry.name))
    return found


class _HashingWriter:
    def __init__(self, sink: Any) -> None:
        self.sink = sink
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self.sha256.update(data)
        self.size += len(data)
        return int(self.sink.write(data))


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(16 << 20):
            digest.update(block)
    return digest.hexdigest()


def _pack(checkpoint: Path, dest: Path) -> tuple[Path, str, int, bool]:
    """One file for SHARDCAST: the file itself, or an uncompressed tar of a directory."""
    if checkpoint.is_file():
        return checkpoint, _sha256_file(checkpoint), checkpoint.stat().st_size, False
    dest.parent.mkdir(parents=True, exist_ok=True)
    with dest.open("wb") as f:
        writer = _HashingWriter(f)
        with tarfile.open(  # type: ignore[call-overload]
            fileobj=writer, mode="w|", bufsize=4 << 20, copybufsize=16 << 20
        ) as tar:
            for path in sorted(p for p in checkpoint.rglob("*") if p.is_file()):
                tar.add(path, arcname=str(path.relative_to(checkpoint)), recursive=False)
    return dest, writer.sha256.hexdigest(), writer.size, True


# --------------------------------------------------------------------------- test checkpoints


def make_test_checkpoint(
    path: Path,
    size_bytes: int,
    *,
    seed: int = 0,
    base: Path | None = None,
    changed_fraction: float = 0.02,
    file_bytes: int = 256 << 20,
) -> Path:
    """A Hugging Face-style checkpoint of random bf16 bytes: config.json, index, shards.

    With ``base``, the same layout with ``changed_fraction`` of its 64 KiB blocks rewritten
    (a "next" checkpoint; SHARDCAST sends it whole either way).
    """
    rng = random.Random(seed)
    path.mkdir(parents=True, exist_ok=True)
    n_files = max(2, math.ceil(size_bytes / file_bytes))
    per_file = (size_bytes // n_files) // 2 * 2
    weight_map = {}
    total = 0
    for k in range(n_files):
        name = f"model-{k + 1:05d}-of-{n_files:05d}.safetensors"
        tensor = f"model.layers.{k}.weight"
        header = json.dumps(
            {
                "__metadata__": {"format": "pt"},
                tensor: {"dtype": "BF16", "shape": [per_file // 2], "data_offsets": [0, per_file]},
            },
            separators=(",", ":"),
        ).encode()
        header += b" " * (-len(header) % 8)
        target = path / name
        if base is not None:
            shutil.copyfile(base / name, target)
            block = 64 << 10
            n_blocks = per_file // block
            with target.open("r+b") as f:
                for b in rng.sample(range(n_blocks), max(1, int(n_blocks * changed_fraction))):
                    f.seek(8 + len(header) + b * block)
                    f.write(rng.randbytes(block))
        else:
            with target.open("wb") as f:
                f.write(struct.pack("<Q", len(header)) + header)
                left = per_file
                while left:
                    n = min(left, 16 << 20)
                    f.write(rng.randbytes(n))
                    left -= n
        weight_map[tensor] = name
        total += per_file
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)
    )
    (path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "torch_dtype": "bfloat16",
                "hidden_size": 256,
                "num_hidden_layers": n_files,
                "vocab_size": 32000,
            },
            indent=2,
        )
    )
    return path


# --------------------------------------------------------------------------- processes


@dataclass
class TreeConfig:
    venv: str = DEFAULT_VENV
    middles: int = 2
    clients: int = 4
    check_interval_s: int = 1  # middle nodes' --check-interval
    client_servers: str = "all"  # "all": every client lists every middle; "one": i % m
    client_start: str = "listed"  # "listed" | "immediate"
    restart_delay_s: float = 1.0
    stuck_after: int = 3  # restart a middle node after this many monitor errors in a row
    max_attempts: int = 100  # per client per version
    probe_bytes: int = 1_000_000  # data1.bin on every server (empty => weight 0 crash)
    keep_versions: int = 5  # OriginServer(max_distribution_folders)
    shard_size: int | None = None  # SHARDCAST_SHARD_SIZE (default 50_000_000)
    bind_loopback: bool = True
    # Give every SHARDCAST process its own /tmp (a private mount namespace, needs root) and its
    # own site-packages scratch dir, as on separate machines: removes the co-location races on
    # /tmp/dummy.{tmp,bin} and site-packages/temp_distribution.{tmp,txt}.
    isolate_scratch: bool = False
    verify_sha256: bool = True
    keep_outputs: bool = False  # delete client copies after they were checked
    keep_packed: bool = False
    start_timeout_s: float = 60.0
    extra_env: dict[str, str] = field(default_factory=dict)
    # Placement, per process name ("origin", "middle0", "client3", ...): ``hosts`` is the address
    # its server binds and the others reach it at (default 127.0.0.1), ``exec_prefix`` an argv
    # prefix that runs it elsewhere (``ip netns exec NS``: a network namespace of its own, as in
    # ``bench/broadcast.py --shaped``). ``fixed_port``: every server listens on this port
    # (each host is its own namespace) instead of a free loopback port.
    hosts: dict[str, str] = field(default_factory=dict)
    exec_prefix: dict[str, list[str]] = field(default_factory=dict)
    fixed_port: int | None = None


@dataclass
class _ServerStats:
    bytes_by_kind: collections.Counter[str] = field(default_factory=collections.Counter)
    shard_bytes_by_version: collections.Counter[str] = field(default_factory=collections.Counter)
    shard_gets_by_version: collections.Counter[str] = field(default_factory=collections.Counter)
    responses: collections.Counter[str] = field(default_factory=collections.Counter)
    unknown_size: int = 0


@dataclass
class _Proc:
    name: str
    role: str
    log_path: Path
    data_dir: Path | None = None
    process: trio.Process | None = None
    started: float = 0.0
    ended: float | None = None
    rc: int | None = None
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=40))
    errors: list[str] = field(default_factory=list)
    stats: _ServerStats = field(default_factory=_ServerStats)
    size_cache: dict[str, int] = field(default_factory=dict)
    verified_at: float | None = None
    ready: bool = False
    listed: dict[str, float] = field(default_factory=dict)
    finished: dict[str, float] = field(default_factory=dict)
    got: collections.Counter[str] = field(default_factory=collections.Counter)
    failed: collections.Counter[str] = field(default_factory=collections.Counter)
    retries: collections.Counter[str] = field(default_factory=collections.Counter)
    monitor_errors: int = 0
    stuck: bool = False
    launched: dict[str, Any] = field(default_factory=dict)
    done: trio.Event = field(default_factory=trio.Event)


def _classify_exit(proc: _Proc) -> tuple[str, str]:
    """('ok'|'crash'|'failure'|'killed'|'stuck', reason) for a process that exited."""
    if proc.verified_at is not None and proc.rc == 0:
        return "ok", ""
    if proc.stuck:
        return "stuck", (proc.errors[-1] if proc.errors else "")[:300]
    if proc.rc is not None and proc.rc < 0:
        return "killed", f"signal {-proc.rc}"
    last = next((line for line in reversed(proc.tail) if line.strip()), "")
    if last and not _LOG_RE.match(last) and not last.startswith(" "):
        return "crash", last[:300]  # an uncaught exception's last line
    return "failure", (proc.errors[0] if proc.errors else last)[:300]  # the first is the cause


class ShardcastTree:
    """One SHARDCAST tree on loopback; use ``async with shardcast_tree(...) as tree``."""

    def __init__(self, nursery: trio.Nursery, workdir: Path, config: TreeConfig) -> None:
        self.nursery = nursery
        self.workdir = workdir
        self.cfg = config
        self.python = Path(config.venv) / "bin" / "python"
        self.launcher = workdir / "_shardcast_launch.py"
        self.site_packages = next(
            (self.python.parent.parent / "lib").glob("python3*/site-packages"), Path("/nonexistent")
        )
        self.origin: _Proc | None = None
        self.origin_port = 0
        self.middle_ports: list[int] = []
        self.middles: list[_Proc] = []
        self.middle_exits: list[dict[str, Any]] = []
        self.pgids: set[int] = set()
        self.all_procs: list[_Proc] = []
        self.responses: list[dict[str, Any]] = []
        self.closing = False
        self.changed = trio.Event()
        self.shardcast_version = ""
        self.started_wall = time.time()
        self.teardown: dict[str, Any] = {}

    # ---- plumbing

    def _host(self, name: str) -> str:
        return self.cfg.hosts.get(name, LOOPBACK)

    def _port(self) -> int:
        return self.cfg.fixed_port if self.cfg.fixed_port is not None else _free_port()

    def _notify(self) -> None:
        self.changed.set()
        self.changed = trio.Event()

    async def _wait_for(self, cond: Callable[[], bool]) -> None:
        while not cond():
            await self.changed.wait()

    def _env(self) -> dict[str, str]:
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PYTHON", "SHARDCAST_")) and k != "VIRTUAL_ENV"
        }
        env["PATH"] = f"{self.python.parent}:{env.get('PATH', '/usr/bin:/bin')}"
        env["SHARDCAST_LOG_LEVEL"] = "DEBUG"  # the handler's level; --log-level sets the logger
        if self.cfg.shard_size is not None:
            env["SHARDCAST_SHARD_SIZE"] = str(self.cfg.shard_size)
        env.update(self.cfg.extra_env)
        return env

    async def _spawn(self, proc: _Proc, args: Sequence[str], *, stdin: bool = False) -> None:
        bind = self._host(proc.name) if self.cfg.bind_loopback else ""
        site = ""
        prefix: list[str] = list(self.cfg.exec_prefix.get(proc.name, []))
        if self.cfg.isolate_scratch:
            scratch = self.workdir / "scratch" / proc.name
            (scratch / "tmp").mkdir(parents=True, exist_ok=True)
            (scratch / "site").mkdir(exist_ok=True)
            link = scratch / "site" / "shardcast"
            if not link.is_symlink():
                link.symlink_to(self.site_packages / "shardcast", target_is_directory=True)
            site = str(scratch / "site")
            prefix += [
                "unshare",
                "-m",
                "--propagation",
                "private",
                "sh",
                "-c",
                'mount --bind "$0" /tmp && exec "$@"',
                str(scratch / "tmp"),
            ]
        argv = [*prefix, str(self.python), "-I", str(self.launcher), proc.role, bind, site, *args]
        proc.started = time.time()
        proc.process = await trio.lowlevel.open_process(
            argv,
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE if proc.role == "origin" else subprocess.STDOUT,
            env=self._env(),
            cwd=str(self.workdir),
            start_new_session=True,
        )
        self.pgids.add(proc.process.pid)
        self.all_procs.append(proc)
        self.nursery.start_soon(self._pump, proc)

    async def _pump(self, proc: _Proc) -> None:
        assert proc.process is not None
        streams = [proc.process.stdout]
        if proc.process.stderr is not None:
            streams.append(proc.process.stderr)
        with proc.log_path.open("ab") as log:
            async with trio.open_nursery() as n:
                for stream in streams:
                    n.start_soon(self._read_lines, proc, stream, log)
        proc.rc = await proc.process.wait()
        proc.ended = time.time()
        proc.done.set()
        self._notify()

    async def _read_lines(self, proc: _Proc, stream: Any, log: Any) -> None:
        buf = b""
        while True:
            try:
                chunk = await stream.receive_some(1 << 16)
            except (trio.ClosedResourceError, trio.BrokenResourceError):
                chunk = b""
            if not chunk:
                break
            log.write(chunk)
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for raw in lines:
                self._on_line(proc, raw.decode(errors="replace"))
        if buf:
            self._on_line(proc, buf.decode(errors="replace"))
        log.flush()

    def _on_line(self, proc: _Proc, line: str) -> None:
        proc.tail.append(line)
        if line.startswith("{"):
            with contextlib.suppress(ValueError):
                msg = json.loads(line)
                if msg.get("event") == "launched":
                    proc.launched = msg
                    self.shardcast_version = msg.get("shardcast_version", "")
                elif proc.role == "origin":
                    if msg.get("event") == "ready":
                        proc.ready = True
                    else:
                        self.responses.append(msg)
                    self._notify()
            return
        m = _LOG_RE.match(line)
        if not m:
            return
        stamp, level, text = _log_time(m.group(1)), m.group(2), m.group(3)
        if level in ("ERROR", "CRITICAL"):
            proc.errors.append(text)
        if proc.role in ("origin", "middle"):
            req = _REQ_RE.search(text)
            if req and _CLIENT_ADDR_RE.match(text):
                self._count_request(proc, req.group(1), req.group(2), req.group(3))
                return
        if proc.role == "middle":
            if text.startswith("Error monitoring upstream servers"):
                # e.g. "Total of weights must be greater than zero": every upstream's probe
                # measured 0 bytes/s; the middle node never recovers from that by itself.
                proc.monitor_errors += 1
                if proc.monitor_errors >= self.cfg.stuck_after and not proc.stuck:
                    proc.stuck = True
                    if proc.process is not None:
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(proc.process.pid, signal.SIGKILL)
            elif text.startswith("Downloaded distribution.txt from"):
                proc.monitor_errors = 0
            elif text.startswith("Middle node running at"):
                proc.ready = True
                self._notify()
            elif mm := _LISTED_RE.match(text):
                proc.listed.setdefault(mm.group(2), stamp)
                self._notify()
            elif mm := _FINISHED_RE.match(text):
                proc.finished.setdefault(mm.group(2), stamp)
                self._notify()
        elif proc.role == "client":
            if text.startswith("Checksum verification passed for"):
                proc.verified_at = stamp
                self._notify()
            elif (mm := _GOT_RE.match(text)) and _SHARD_PATH_RE.match(mm.group(1)):
                proc.got[mm.group(2)] += 1
            elif (mm := _FAILED_RE.match(text)) and _SHARD_PATH_RE.match(mm.group(1)):
                proc.failed[mm.group(2)] += 1
            elif (mm := _RETRY_RE.match(text)) and _SHARD_PATH_RE.match(mm.group(2)):
                proc.retries[mm.group(1).lower()] += 1

    def _count_request(self, proc: _Proc, method: str, path: str, code: str) -> None:
        stats = proc.stats
        stats.responses[code] += 1
        if method != "GET" or code != "200" or proc.data_dir is None:
            return
        rel = path.split("?", 1)[0].lstrip("/")
        shard = _SHARD_PATH_RE.match(rel)
        size = proc.size_cache.get(rel) if shard else None
        if size is None:
            try:
                size = (proc.data_dir / rel).stat().st_size
            except OSError:
                stats.unknown_size += 1
                return
            if shard:
                proc.size_cache[rel] = size
        kind = (
            "shard"
            if shard
            else "probe"
            if rel == "data1.bin"
            else "distribution"
            if rel == "distribution.txt"
            else "other"
        )
        stats.bytes_by_kind[kind] += size
        if shard:
            stats.shard_bytes_by_version[shard.group(1)] += size
            stats.shard_gets_by_version[shard.group(1)] += 1

    # ---- lifecycle

    async def start(self) -> None:
        cfg = self.cfg
        if not self.python.exists():
            raise FileNotFoundError(
                f"no SHARDCAST venv at {cfg.venv}: python3 -m venv "
                f"{cfg.venv} && {cfg.venv}/bin/pip install "
                f"shardcast=={EXPECTED_VERSION}"
            )
        if cfg.isolate_scratch and (
            os.geteuid() != 0 or self.workdir.resolve().is_relative_to("/tmp")
        ):
            raise RuntimeError("isolate_scratch needs root and a workdir outside /tmp")
        (self.workdir / "logs").mkdir(parents=True, exist_ok=True)
        self.launcher.write_text(_LAUNCHER)
        probe = random.Random(1).randbytes(cfg.probe_bytes)
        origin_dir = self.workdir / "origin"
        origin_dir.mkdir(exist_ok=True)
        (origin_dir / "data1.bin").write_bytes(probe)
        self.origin_port = self._port()
        self.origin = _Proc("origin", "origin", self.workdir / "logs" / "origin.log", origin_dir)
        await self._spawn(
            self.origin,
            [str(origin_dir), str(self.origin_port), str(cfg.keep_versions)],
            stdin=True,
        )
        with trio.fail_after(cfg.start_timeout_s):
            await self._wait_for(
                lambda: self.origin is not None and (self.origin.ready or self.origin.done.is_set())
            )
        if not self.origin.ready:
            raise RuntimeError(f"origin did not start: {list(self.origin.tail)[-5:]}")
        if self.shardcast_version != EXPECTED_VERSION:
            raise RuntimeError(
                f"expected shardcast {EXPECTED_VERSION}, the venv has {self.shardcast_version!r}"
            )
        self.middle_ports = [self._port() for _ in range(cfg.middles)]
        self.middles = [
            _Proc(
                f"middle{j}",
                "middle",
                self.workdir / "logs" / f"middle{j}.log",
                self.workdir / f"middle{j}",
            )
            for j in range(cfg.middles)
        ]
        for m in self.middles:
            assert m.data_dir is not None
            m.data_dir.mkdir(exist_ok=True)
            (m.data_dir / "data1.bin").write_bytes(probe)
        for j in range(cfg.middles):
            self.nursery.start_soon(self._middle_job, j)
        with trio.fail_after(cfg.start_timeout_s):
            await self._wait_for(lambda: all(m.ready for m in self.middles))

    async def _middle_job(self, j: int) -> None:
        """Run middle node j; restart it (same data dir) if it exits while the tree runs."""
        upstream = f"http://{self._host('origin')}:{self.origin_port}"
        while not self.closing:
            old = self.middles[j]
            proc = _Proc(
                old.name,
                "middle",
                old.log_path,
                old.data_dir,
                listed=old.listed,
                finished=old.finished,
                stats=old.stats,
            )
            self.middles[j] = proc
            await self._spawn(
                proc,
                [
                    "--upstream",
                    upstream,
                    "--data-dir",
                    str(proc.data_dir),
                    "--port",
                    str(self.middle_ports[j]),
                    "--check-interval",
                    str(self.cfg.check_interval_s),
                    "--log-level",
                    "DEBUG",
                ],
            )
            await proc.done.wait()
            if self.closing:
                return
            outcome = _classify_exit(proc)
            self.middle_exits.append(
                {
                    "middle": j,
                    "rc": proc.rc,
                    "at": proc.ended,
                    "outcome": outcome[0],
                    "reason": outcome[1],
                }
            )
            await trio.sleep(self.cfg.restart_delay_s)

    def _client_servers(self, i: int) -> str:
        js = (
            range(len(self.middle_ports))
            if self.cfg.client_servers == "all"
            else [i % len(self.middle_ports)]
        )
        return ",".join(f"http://{self._host(f'middle{j}')}:{self.middle_ports[j]}" for j in js)

    async def _client_job(self, i: int, version: str, out: Path, record: dict[str, Any]) -> None:
        attempts: list[dict[str, Any]] = record["attempts"]
        while len(attempts) < self.cfg.max_attempts and not self.closing:
            proc = _Proc(
                f"client{i}",
                "client",
                self.workdir / "logs" / f"client{i}.{version}.a{len(attempts)}.log",
            )
            await self._spawn(
                proc,
                [
                    "--servers",
                    self._client_servers(i),
                    "--output-dir",
                    str(out.parent),
                    "--version",
                    version,
                    "--output-file",
                    str(out),
                    "--log-level",
                    "DEBUG",
                ],
            )
            try:
                await proc.done.wait()
            finally:
                if not proc.done.is_set():  # cancelled (publish timed out): stop this client
                    assert proc.process is not None
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.process.pid, signal.SIGKILL)
                    with trio.CancelScope(shield=True), trio.move_on_after(5):
                        await proc.done.wait()
            outcome, reason = _classify_exit(proc)
            attempts.append(
                {
                    "start": proc.started,
                    "end": proc.ended,
                    "rc": proc.rc,
                    "outcome": outcome,
                    "reason": reason,
                }
            )
            for server, n in proc.got.items():
                record["shards_from"][server] = record["shards_from"].get(server, 0) + n
            for server, n in proc.failed.items():
                record["failed_shard_gets"][server] = record["failed_shard_gets"].get(server, 0) + n
            for kind, n in proc.retries.items():
                record["shard_retries"][kind] = record["shard_retries"].get(kind, 0) + n
            if outcome == "ok":
                record["verified_at"] = proc.verified_at
                return
            await trio.sleep(self.cfg.restart_delay_s)

    async def publish(self, checkpoint: Path | str, *, timeout_s: float = 900.0) -> dict[str, Any]:
        """Broadcast one checkpoint (dir or file) as the next version; time it to every client."""
        assert self.origin is not None
        assert self.origin.process is not None
        checkpoint = Path(checkpoint)
        cfg = self.cfg
        t_publish = time.time()
        rusage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu0 = {
            p.name: _proc_cpu_s(p.process.pid)
            for p in [self.origin, *self.middles]
            if p.process is not None
        }
        bytes0 = {p.name: dict(p.stats.bytes_by_kind) for p in [self.origin, *self.middles]}
        codes0 = {p.name: dict(p.stats.responses) for p in [self.origin, *self.middles]}
        n_published = sum(1 for r in self.responses if r.get("event") == "broadcast")
        n_exits = len(self.middle_exits)
        packed, sha256, size, is_temp = await trio.to_thread.run_sync(
            _pack, checkpoint, self.workdir / "publish" / f"{n_published + 1}.tar"
        )
        t_packed = time.time()
        n_responses = len(self.responses)
        assert self.origin.process.stdin is not None
        await self.origin.process.stdin.send_all(json.dumps({"path": str(packed)}).encode() + b"\n")
        with trio.fail_after(timeout_s):
            await self._wait_for(
                lambda: (
                    len(self.responses) > n_responses
                    or self.origin is None
                    or self.origin.done.is_set()
                )
            )
        new = self.responses[n_responses:]
        if not new or new[0]["event"] != "broadcast":
            raise RuntimeError(
                f"origin broadcast failed: {self.responses[n_responses:]} "
                f"{list(self.origin.tail)[-5:]}"
            )
        resp = self.responses[n_responses]
        version, t0, t1 = resp["version"], resp["t0"], resp["t1"]
        if is_temp and not cfg.keep_packed:
            packed.unlink()
        records: list[dict[str, Any]] = [
            {
                "client": i,
                "attempts": [],
                "verified_at": None,
                "shards_from": {},
                "failed_shard_gets": {},
                "shard_retries": {},
            }
            for i in range(cfg.clients)
        ]
        outs = [self.workdir / f"client{i}" / f"{version}.bin" for i in range(cfg.clients)]
        timed_out = False
        t_clients: float | None = None
        with trio.move_on_after(max(1.0, timeout_s - (time.time() - t_publish))) as scope:
            if cfg.client_start == "listed":
                await self._wait_for(lambda: all(version in m.listed for m in self.middles))
            t_clients = time.time()
            async with trio.open_nursery() as n:
                for i in range(cfg.clients):
                    outs[i].parent.mkdir(parents=True, exist_ok=True)
                    n.start_soon(self._client_job, i, version, outs[i], records[i])
            await self._wait_for(lambda: all(version in m.finished for m in self.middles))
        timed_out = scope.cancelled_caught
        t_done = time.time()
        rusage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu: dict[str, float] = {}
        for p in [self.origin, *self.middles]:
            c0 = cpu0.get(p.name)
            c1 = _proc_cpu_s(p.process.pid) if p.process is not None else None
            if c0 is not None and c1 is not None:
                cpu[p.name] = round(c1 - c0, 2)
        cpu["clients_and_exited"] = round(
            rusage1.ru_utime + rusage1.ru_stime - rusage0.ru_utime - rusage0.ru_stime, 2
        )

        checks: list[bool | None] = [None] * cfg.clients
        if cfg.verify_sha256:
            for i, out in enumerate(outs):
                if records[i]["verified_at"] is not None:
                    checks[i] = (await trio.to_thread.run_sync(_sha256_file, out)) == sha256
        if not cfg.keep_outputs:
            for out in outs:
                out.unlink(missing_ok=True)

        def rel(t: float | None) -> float | None:
            return None if t is None else round(t - t0, 3)

        clients: list[dict[str, Any]] = []
        for i, rec in enumerate(records):
            outcomes = collections.Counter(a["outcome"] for a in rec["attempts"])
            clients.append(
                {
                    "client": i,
                    "verified_s": rel(rec["verified_at"]),
                    "sha256_ok": checks[i],
                    "attempts": len(rec["attempts"]),
                    "crashes": outcomes["crash"],
                    "failures": outcomes["failure"],
                    "restarts": max(0, len(rec["attempts"]) - 1),
                    "exit_reasons": [a["reason"] for a in rec["attempts"] if a["outcome"] != "ok"],
                    "shards_from": rec["shards_from"],
                    "failed_shard_gets": rec["failed_shard_gets"],
                    "shard_retries": rec["shard_retries"],
                    "attempt_log": [
                        {
                            "start_s": rel(a["start"]),
                            "end_s": rel(a["end"]),
                            "rc": a["rc"],
                            "outcome": a["outcome"],
                        }
                        for a in rec["attempts"]
                    ],
                }
            )
        done: list[float] = [c["verified_s"] for c in clients if c["verified_s"] is not None]
        servers = {}
        for p in [self.origin, *self.middles]:
            delta = {k: v - bytes0[p.name].get(k, 0) for k, v in p.stats.bytes_by_kind.items()}
            servers[p.name] = {
                "bytes_sent": sum(delta.values()),
                "bytes_by_kind": delta,
                "shard_bytes_this_version": p.stats.shard_bytes_by_version[version],
                "shard_gets_this_version": p.stats.shard_gets_by_version[version],
                "http_responses": {
                    k: n - codes0[p.name].get(k, 0) for k, n in p.stats.responses.items()
                },
            }
        return {
            "version": version,
            "checkpoint": str(checkpoint),
            "published_bytes": size,
            "sha256": sha256,
            "packed_as_tar": is_temp,
            "timed_out": timed_out,
            "pack_s": round(t_packed - t_publish, 3),
            "origin_broadcast_s": round(t1 - t0, 3),
            "clients_started_s": rel(t_clients),
            "middles": [
                {
                    "middle": j,
                    "listed_s": rel(m.listed.get(version)),
                    "finished_s": rel(m.finished.get(version)),
                }
                for j, m in enumerate(self.middles)
            ],
            "clients": clients,
            "clients_verified": len(done),
            "first_client_s": min(done) if done else None,
            "last_client_s": max(done) if len(done) == cfg.clients else None,
            "last_client_from_publish_s": (
                round(max(done) + t0 - t_publish, 3) if len(done) == cfg.clients else None
            ),
            "client_crashes": sum(c["crashes"] for c in clients),
            "client_failures": sum(c["failures"] for c in clients),
            "client_restarts": sum(c["restarts"] for c in clients),
            "middle_restarts": [{**e, "at": rel(e["at"])} for e in self.middle_exits[n_exits:]],
            "origin_bytes": servers["origin"]["bytes_sent"],
            "middle_bytes": [servers[m.name]["bytes_sent"] for m in self.middles],
            "bytes": servers,
            "bytes_ideal": {"origin": cfg.middles * size, "middles_total": cfg.clients * size},
            "cpu_s": cpu,
            "wall_s": round(t_done - t_publish, 3),
        }

    async def close(self) -> dict[str, Any]:
        """Stop every process we started (by process group), then look for leftovers."""
        self.closing = True
        live = [p for p in self.all_procs if p.process is not None and p.rc is None]
        cpu = {
            p.name: _proc_cpu_s(p.process.pid)
            for p in live
            if p.process is not None and p.role != "client"
        }
        for p in live:
            if p.role == "origin" and p.process is not None and p.process.stdin is not None:
                with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                    await p.process.stdin.aclose()
        for sig, grace in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            for pgid in self.pgids:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(pgid, sig)
            with trio.move_on_after(grace):
                for p in live:
                    await p.done.wait()
            if all(p.done.is_set() for p in live):
                break
        await trio.sleep(0.2)
        leftovers = _processes_of(self.pgids, str(self.launcher))
        for pid in leftovers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        # SHARDCAST's fixed scratch files (shared by every process on the machine).
        site = self.site_packages
        scratch = [Path("/tmp/dummy.bin"), Path("/tmp/dummy.tmp")]
        scratch += [site / "temp_distribution.txt", site / "temp_distribution.tmp"]
        for path in scratch:
            with contextlib.suppress(OSError):
                if path.stat().st_mtime >= self.started_wall - 1:
                    path.unlink()
        self.teardown = {
            "processes_started": len(self.all_procs),
            "leftover_pids_killed": leftovers,
            "server_cpu_s_total": {k: v for k, v in cpu.items() if v is not None},
            "middle_restarts": [
                {**e, "at": round(e["at"] - self.started_wall, 3)} for e in self.middle_exits
            ],  # "at": seconds since the tree started
            "server_errors_logged": {
                p.name: p.errors[-5:] for p in self.all_procs if p.role != "client" and p.errors
            },
        }
        return self.teardown


@contextlib.asynccontextmanager
async def shardcast_tree(
    workdir: Path | str,
    config: TreeConfig | None = None,
) -> AsyncIterator[ShardcastTree]:
    """Start origin and middle nodes in ``workdir``; stop everything on exit."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    async with trio.open_nursery() as nursery:
        tree = ShardcastTree(nursery, workdir, config or TreeConfig())
        try:
            await tree.start()
            yield tree
        finally:
            with trio.CancelScope(shield=True):
                await tree.close()
            nursery.cancel_scope.cancel()


def _remove_data(workdir: Path) -> None:
    for sub in workdir.iterdir():
        if sub.is_dir() and sub.name != "logs":
            shutil.rmtree(sub, ignore_errors=True)


async def arun_shardcast(
    checkpoint_dir: Path | str,
    workdir: Path | str,
    *,
    next_checkpoints: Sequence[Path | str] = (),
    timeout_s: float = 600.0,
    keep_data: bool = False,
    **config: Any,
) -> dict[str, Any]:
    """Start a tree, publish ``checkpoint_dir`` then each of ``next_checkpoints``, tear down.

    ``timeout_s`` bounds each version; ``config`` sets :class:`TreeConfig` fields. Unless
    ``keep_data``, the shard copies in ``workdir`` are removed at the end (logs are kept).
    """
    cfg = TreeConfig(**config)
    versions = []
    started = time.time()
    try:
        async with shardcast_tree(workdir, cfg) as tree:
            t_ready = time.time()
            for ckpt in [checkpoint_dir, *next_checkpoints]:
                versions.append(await tree.publish(ckpt, timeout_s=timeout_s))
    finally:
        if not keep_data:
            _remove_data(Path(workdir))
    teardown = tree.teardown
    return {
        "system": "shardcast",
        "shardcast_version": tree.shardcast_version,
        "host": cfg.hosts or LOOPBACK,
        "topology": {
            "origin": 1,
            "middles": cfg.middles,
            "clients": cfg.clients,
            "client_servers": cfg.client_servers,
        },
        "config": {k: v for k, v in cfg.__dict__.items() if k != "extra_env"},
        "byte_accounting": "payload bytes of 200 GET responses from each server's DEBUG "
        "request log, sized from the served files",
        "time_origin": "seconds from the start of SHARDCAST's broadcast() on the origin",
        "tree_start_s": round(t_ready - started, 3),
        "versions": versions,
        "teardown": teardown,
    }


def run_shardcast(checkpoint_dir: Path | str, workdir: Path | str, **kwargs: Any) -> dict[str, Any]:
    """Synchronous :func:`arun_shardcast` (not from inside a running trio loop)."""
    return trio.run(lambda: arun_shardcast(checkpoint_dir, workdir, **kwargs))


# --------------------------------------------------------------------------- CLI


async def _until_signal(*args: Any, **kwargs: Any) -> dict[str, Any] | None:
    """:func:`arun_shardcast`, cancelled (so that it tears down) on SIGTERM or SIGHUP."""
    result: dict[str, Any] | None = None
    async with trio.open_nursery() as nursery:

        async def watch() -> None:
            with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
                async for _ in signals:
                    nursery.cancel_scope.cancel()
                    return

        nursery.start_soon(watch)
        result = await arun_shardcast(*args, **kwargs)
        nursery.cancel_scope.cancel()
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--checkpoint",
        action="append",
        default=[],
        help="checkpoint dir or file; repeat for the next versions",
    )
    ap.add_argument("--size-mib", type=int, help="make test checkpoints of this size instead")
    ap.add_argument("--versions", type=int, default=2, help="test checkpoints to make")
    ap.add_argument(
        "--workdir",
        help="kept afterwards with the logs (default: a fresh dir in /dev/shm, removed)",
    )
    ap.add_argument("--keep-data", action="store_true", help="keep the shard copies too")
    ap.add_argument("--venv", default=DEFAULT_VENV)
    ap.add_argument("--middles", type=int, default=2)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--check-interval", type=int, default=1)
    ap.add_argument("--client-servers", choices=["all", "one"], default="all")
    ap.add_argument("--client-start", choices=["listed", "immediate"], default="listed")
    ap.add_argument("--restart-delay", type=float, default=1.0)
    ap.add_argument("--shard-size", type=int)
    ap.add_argument("--probe-bytes", type=int, default=1_000_000)
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument(
        "--isolate-scratch",
        action="store_true",
        help="private /tmp and scratch dir per process (root): no co-location races",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="per version, seconds")
    ap.add_argument("--report", help="also write the JSON result here")
    args = ap.parse_args(argv)
    if not args.checkpoint and not args.size_mib:
        ap.error("give --checkpoint or --size-mib")

    tmp_root = Path(f"/dev/shm/shardcast-bench-{os.getpid()}")
    workdir = Path(args.workdir) if args.workdir else tmp_root / "work"
    checkpoints = [Path(c) for c in args.checkpoint]
    try:
        if args.size_mib:
            base = None
            for k in range(args.versions):
                base = make_test_checkpoint(
                    tmp_root / f"ckpt_{k + 1}", args.size_mib << 20, seed=k, base=base
                )
                checkpoints.append(base)
        result = trio.run(
            functools.partial(
                _until_signal,
                checkpoints[0],
                workdir,
                next_checkpoints=checkpoints[1:],
                timeout_s=args.timeout,
                venv=args.venv,
                middles=args.middles,
                clients=args.clients,
                check_interval_s=args.check_interval,
                client_servers=args.client_servers,
                client_start=args.client_start,
                restart_delay_s=args.restart_delay,
                shard_size=args.shard_size,
                probe_bytes=args.probe_bytes,
                verify_sha256=not args.no_verify,
                isolate_scratch=args.isolate_scratch,
                keep_data=args.keep_data,
            )
        )
        if result is None:
            print("interrupted; every process stopped", file=sys.stderr)
            return 143
    finally:
        shutil.rmtree(tmp_root, ignore_errors=True)
    text = json.dumps(result, indent=2)
    print(text)
    if args.report:
        Path(args.report).write_text(text + "\n")
    ok = all(v["last_client_s"] is not None for v in result["versions"])
    return 0 if ok and not result["teardown"].get("leftover_pids_killed") else 1


if __name__ == "__main__":
    sys.exit(main())
