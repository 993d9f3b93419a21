"""The machine's floor for the loopback broadcast: only the work no system can skip.

``bench/broadcast.py`` compares shardnet with SHARDCAST on one machine, where all 7 nodes share
the same CPUs, memory and disk. Part of each version's cost is the same for any system that
delivers verified files, and on a small machine it can dominate: every receiver must get every
byte over a socket, hash it, and write it into a new file (allocating page cache for it); every
byte must be sent by someone. This module runs exactly that and nothing else, as separate
processes like the nodes, so the benchmark can say how fast any system could be on this
machine, and whether a target ratio against SHARDCAST is reachable at all.

- **full version**: one sender process serves the version's files from the page cache with
  ``sendfile`` over 127.0.0.1; 6 receiver processes (2 relays + 4 peers) at once each
  ``recv_into`` a reused 16 MiB buffer, BLAKE3-hash every byte and write it into a new file in
  its own directory with the store's own write (:func:`shardcast.store.files.pwrite_all`), so the
  floor writes no dearer than the nodes do. No tree (every receiver pulls from the one sender,
  so nothing waits on a hop), no shards, manifest, signatures, control messages or fsync.
- **next version**: each receiver builds the new version's files from its copy of the previous
  version with ``copy_file_range`` (an in-kernel copy; a reflink where the filesystem shares
  extents, free of copying there) and nothing else: no delta received, decoded, applied or
  hashed. Any system that writes the new version as separate files does at least this.

Both are lower bounds: a real system also moves manifests and deltas, verifies shards and
signatures and relays through a tree. ``last_s`` is the time until the last receiver finished,
from the moment the first process was told to start (processes are started and warmed before).

Run alone: ``python bench/floor.py V0_DIR V1_DIR WORKDIR`` prints one JSON object;
``bench/broadcast.py`` runs it as the ``floor`` system beside the others.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import blake3

from shardcast.store import copy_range, pwrite_all

BUF_BYTES = 16 << 20
N_RECEIVERS = 6
IO_TIMEOUT_S = 120.0  # a socket read or write that stalls this long fails the floor run


def version_files(src: Path) -> list[Path]:
    """The files of a checkpoint directory in a fixed order (name), regular files only."""
    return sorted(p for p in src.iterdir() if p.is_file())


def _cpu() -> tuple[float, float]:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime, r.ru_stime


def serve(src: Path, n: int) -> None:
    """Sender: accept ``n`` connections, ``sendfile`` every file of ``src`` to each (threads).

    Prints the listening port on stdout; after the last send (and the receiver's one-byte
    acknowledgement) prints ``{"cpu_s": ..., "cpu_sys_s": ...}`` (CPU-seconds) and returns.
    """
    files = version_files(src)
    lsock = socket.create_server(("127.0.0.1", 0), backlog=n)
    print(lsock.getsockname()[1], flush=True)

    def send(conn: socket.socket) -> None:
        conn.settimeout(IO_TIMEOUT_S)
        with conn:
            for f in files:
                with f.open("rb") as fh:
                    conn.sendfile(fh)
            conn.shutdown(socket.SHUT_WR)
            conn.recv(1)

    threads = []
    for _ in range(n):
        conn, _addr = lsock.accept()
        t = threading.Thread(target=send, args=(conn,))
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    cpu, sys_ = _cpu()
    print(json.dumps({"cpu_s": cpu, "cpu_sys_s": sys_}), flush=True)


def receive(port: int, sizes: list[tuple[str, int]], dst: Path) -> None:
    """Receiver: read the files in order into ``dst``, hashing each; waits for ``go`` on stdin."""
    dst.mkdir(parents=True, exist_ok=True)
    buf = bytearray(BUF_BYTES)
    view = memoryview(buf)
    digests: dict[str, Any] = {}
    print("ready", flush=True)
    sys.stdin.readline()
    c0 = _cpu()
    t0 = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=IO_TIMEOUT_S) as sock:
        for name, size in sizes:
            h = digests[name] = blake3.blake3()
            fd = os.open(dst / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                off = 0
                while off < size:
                    want = min(BUF_BYTES, size - off)
                    got = 0
                    while got < want:
                        k = sock.recv_into(view[got:want])
                        if not k:
                            raise ConnectionError(f"sender closed at {off + got} of {name}")
                        h.update(view[got : got + k])  # while the bytes are in the CPU cache
                        got += k
                    pwrite_all(fd, view[:got], off)  # the store's own write (1 MiB calls)
                    off += got
            finally:
                os.close(fd)
        sock.sendall(b"x")
    c1 = _cpu()
    s = time.perf_counter() - t0
    hexes = {n: h.hexdigest() for n, h in digests.items()}
    print(
        json.dumps({"s": s, "cpu_s": c1[0] - c0[0], "cpu_sys_s": c1[1] - c0[1], "blake3": hexes}),
        flush=True,
    )


def rebuild(base: Path, names: list[str], dst: Path) -> None:
    """Next version: copy each base file into ``dst`` (:func:`shardcast.store.files.copy_range`, the
    store's own in-kernel copy); waits for ``go``."""
    dst.mkdir(parents=True, exist_ok=True)
    print("ready", flush=True)
    sys.stdin.readline()
    c0 = _cpu()
    t0 = time.perf_counter()
    for name in names:
        src_fd = os.open(base / name, os.O_RDONLY)
        dst_fd = os.open(dst / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            copy_range(src_fd, dst_fd, 0, os.fstat(src_fd).st_size)
        finally:
            os.close(src_fd)
            os.close(dst_fd)
    c1 = _cpu()
    print(
        json.dumps(
            {"s": time.perf_counter() - t0, "cpu_s": c1[0] - c0[0], "cpu_sys_s": c1[1] - c0[1]}
        ),
        flush=True,
    )


def _spawn(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, __file__, *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def _finish(procs: list[subprocess.Popen[str]], timeout_s: float) -> list[dict[str, Any]]:
    out = []
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        p.wait(timeout=timeout_s)
        if p.returncode != 0 or not line:
            raise RuntimeError(f"floor process {p.args} exited {p.returncode}")
        out.append(json.loads(line))
    return out


def run_floor(v0: Path, v1: Path, workdir: Path, timeout_s: float = 900.0) -> dict[str, Any]:
    """Both versions' floors; returns ``{"system": "floor", "versions": [full, next]}``.

    Each version entry: ``last_s``/``first_s`` (seconds, slowest/fastest receiver, from the
    common start), ``peers_s`` per receiver, ``cpu_s``/``cpu_sys_s`` per process (CPU-seconds).
    The receivers' BLAKE3 digests are compared with the files' (hashed before the clock starts).
    Raises :class:`RuntimeError` if a process fails or a receiver's digest differs,
    :class:`subprocess.TimeoutExpired` past ``timeout_s``.
    """
    names = ["relay1", "relay2"] + [f"peer{i}" for i in range(1, N_RECEIVERS - 1)]
    files = version_files(v0)
    sizes = [(f.name, f.stat().st_size) for f in files]
    expected = {f.name: blake3.blake3().update_mmap(f).hexdigest() for f in files}
    workdir.mkdir(parents=True)
    versions = []
    spawned: list[subprocess.Popen[str]] = []

    def spawn(*args: str) -> subprocess.Popen[str]:
        spawned.append(_spawn(*args))
        return spawned[-1]

    def start(procs: list[subprocess.Popen[str]]) -> float:
        for p in procs:
            assert p.stdout is not None
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError(f"floor process {p.args} did not start")
        t0 = time.perf_counter()
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        return t0

    try:
        # full version: every receiver pulls every byte from the one sender
        sender = spawn("serve", str(v0), str(N_RECEIVERS))
        assert sender.stdout is not None
        port = sender.stdout.readline().strip()
        spec = json.dumps(sizes)
        recvs = [spawn("receive", port, spec, str(workdir / n / "step-0")) for n in names]
        t0 = start(recvs)
        got = _finish(recvs, timeout_s)
        wall = time.perf_counter() - t0
        sent = _finish([sender], timeout_s)[0]
        for name, g in zip(names, got, strict=True):
            if g["blake3"] != expected:
                raise RuntimeError(f"floor: {name} received other bytes than were sent")
        versions.append(_entry(0, names, got, wall, sent, sum(s for _, s in sizes)))
        # next version: new files from each receiver's copy of the previous one
        next_names = json.dumps([f.name for f in version_files(v1)])
        rebs = [
            spawn("rebuild", str(workdir / n / "step-0"), next_names, str(workdir / n / "step-1"))
            for n in names
        ]
        t0 = start(rebs)
        got = _finish(rebs, timeout_s)
        versions.append(_entry(1, names, got, time.perf_counter() - t0, None, 0))
    finally:
        for p in spawned:
            if p.poll() is None:
                p.kill()
            p.wait()
            for pipe in (p.stdin, p.stdout):
                if pipe is not None:
                    pipe.close()
    return {"system": "floor", "versions": versions}


def _entry(
    step: int,
    names: list[str],
    got: list[dict[str, Any]],
    wall: float,
    sent: dict[str, Any] | None,
    origin_bytes: int,
) -> dict[str, Any]:
    cpu = {n: round(g["cpu_s"], 2) for n, g in zip(names, got, strict=True)}
    cpu_sys = {n: round(g["cpu_sys_s"], 2) for n, g in zip(names, got, strict=True)}
    if sent is not None:
        cpu["origin"], cpu_sys["origin"] = round(sent["cpu_s"], 2), round(sent["cpu_sys_s"], 2)
    peers_s = {n: round(g["s"], 3) for n, g in zip(names, got, strict=True)}
    return {
        "step": step,
        "first_s": round(min(peers_s.values()), 3),
        "last_s": round(wall, 3),
        "peers_s": peers_s,
        "origin_bytes": origin_bytes,
        "relay_bytes": None,
        "cpu_s": cpu,
        "cpu_sys_s": cpu_sys,
    }


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "serve":
        serve(Path(argv[1]), int(argv[2]))
        return 0
    if argv and argv[0] == "receive":
        receive(int(argv[1]), [tuple(x) for x in json.loads(argv[2])], Path(argv[3]))
        return 0
    if argv and argv[0] == "rebuild":
        rebuild(Path(argv[1]), json.loads(argv[2]), Path(argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("v0", type=Path)
    ap.add_argument("v1", type=Path)
    ap.add_argument("workdir", type=Path, help="a new directory (removed afterwards)")
    args = ap.parse_args(argv)
    import shutil

    for name, d in (("v0", args.v0), ("v1", args.v1)):
        if not d.is_dir():
            print(f"floor: {name} {d}: not a directory", file=sys.stderr)
            return 2
    if args.workdir.exists():
        print(f"floor: workdir {args.workdir} exists (it is removed afterwards)", file=sys.stderr)
        return 2

    try:
        print(json.dumps(run_floor(args.v0, args.v1, args.workdir)))
    finally:
        shutil.rmtree(args.workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
