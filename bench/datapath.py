"""CPU cost of the receiving data path per stage: the old path against the new, in one run.

Usage::

    python bench/datapath.py [--size-mib 512] [--repeats 1] [--changed 0.02] [--json out.json]
                             [--dir /dev/shm]

Writes a synthetic checkpoint of ``--size-mib`` MiB (two files of random 16-bit words) and
its next version (``--changed`` of the words moved by one unit, as after a small Adam step)
to /dev/shm (or ``--dir``: the costs differ by filesystem), serves both from
:class:`p2p.http_server.HttpServer` in a child process over loopback, and receives them
shard by shard (32 MiB) in this process, measuring the CPU seconds per GB (10^9 bytes) of
checkpoint of each stage of the receiver only (the server's
CPU is not counted):

- ``old`` (the path before issue 16, reproduced here): ``HttpClient.stream_range`` chunks
  copied into a fresh shard buffer; BLAKE3 of the shard (``max_threads=AUTO``) then
  ``pwrite``; commit re-hashes every file (schema-2 manifest). Deltas: ``xor-zstd``
  (decompress a full-size XOR buffer, XOR into the base, hash, write).
- ``new``: ``HttpClient.receive_range_into`` straight into a pooled :class:`ShardSink`,
  hashed per piece while hot (:mod:`shardcast.download.receive`), one ``pwrite`` with the running
  digest, commit derives hash-list roots (schema 3). Deltas: ``sparse`` applied as
  :func:`shardcast.download.receive.verify_and_write` chooses (dense shards: base read once into a
  pooled buffer, patched, hashed, written; sparse ones: clone-and-patch).

Stages: ``receive`` (socket to buffer, event loop), ``hash`` (BLAKE3 of received bytes),
``write`` (``pwrite`` and journal), ``apply`` (delta: read base, decode, hash the result,
write), ``commit``; ``total`` is the process CPU of the whole receive (it also holds trio's
own overhead). Stages run one at a time (one shard after another, the event loop idle while
a worker thread writes), so the process CPU (``time.process_time``, every thread, including
BLAKE3's own worker threads in the old path) read around each stage is that stage's.

A ``floor`` receiver (full version only) is the least any receiver of this design can
spend: a blocking socket per shard with a hand-written request, ``recv_into`` one reused
shard buffer, BLAKE3 of it (one thread), one ``pwrite`` into a new file, ``fsync`` of each
file at the end (the ``commit`` stage: a commit must be durable): no HTTP parser, no event
loop, no journal, no manifest. Its ``total`` against ``new`` is what the
project's own code costs on top of the kernel and the hash; if the floor alone exceeds a
target on this machine, the target is out of reach here whatever the code does.

A third receiver, ``clone``, applies every ``sparse`` shard by clone-and-patch
(:meth:`PartialVersion.patch_shard`: ``copy_file_range`` of the base range, patch through a
memory map, hash there), which the new path keeps for shards with fewer changed words than
pages; it is only a measurement, for that choice (try ``--changed 0.0002``).

Every file and directory is deleted afterwards. The machine may be shared: take the ratios, not the
absolute numbers, and say so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import blake3
import numpy as np
import trio

from p2p.http_client import HttpClient
from p2p.http_server import HttpRequest, HttpResponse, HttpServer, file_response
from p2p.identity import Identity
from shardcast.download import BaseVersion, ShardSink, verify_and_write
from shardcast.publish import Base, build_manifest
from shardcast.store import BLOB_DIR
from shardcast.store.store import VersionStore
from shardcast.wire import Manifest, codecs

SHARD = 32 << 20
RUN = "bench"
GB = 1e9
T = TypeVar("T")


@dataclass
class Stages:
    """CPU seconds per stage of one receive."""

    cpu_s: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0

    def add(self, stage: str, seconds: float) -> None:
        self.cpu_s[stage] = self.cpu_s.get(stage, 0.0) + seconds


def timed(stages: Stages, stage: str, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
    t = time.process_time()  # stages run one at a time: the process's CPU is the stage's
    try:
        return fn(*args, **kw)
    finally:
        stages.add(stage, time.process_time() - t)


# -- the checkpoint and the server ----------------------------------------------------------


def make_versions(root: Path, size: int, changed: float, seed: int = 0) -> tuple[Path, Path]:
    """Two checkpoints (step 1 and step 2 = step 1 with ``changed`` of the words +-1)."""
    rng = np.random.default_rng(seed)
    v1, v2 = root / "src-1", root / "src-2"
    for d in (v1, v2):
        d.mkdir(parents=True)
    (v1 / "config.json").write_text("{}")
    (v2 / "config.json").write_text("{}")
    index = {
        "weight_map": {
            "a": "model-00001-of-00002.safetensors",
            "b": "model-00002-of-00002.safetensors",
        }
    }
    for d in (v1, v2):
        (d / "model.safetensors.index.json").write_text(json.dumps(index))
    half = size // 2 // 2 * 2
    for name in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        words = rng.integers(0, 1 << 16, half // 2, dtype=np.uint16)
        words.tofile(v1 / name)
        mask = rng.random(words.size) < changed
        words[mask] += rng.choice(np.array([1, 0xFFFF], dtype=np.uint16), int(mask.sum()))
        words.tofile(v2 / name)
    return v1, v2


async def serve(root: Path) -> None:
    async def handler(request: HttpRequest) -> HttpResponse:
        path = root / request.path.lstrip("/")
        return file_response(request, path, path.stat().st_size)

    server = HttpServer(handler)
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            print(server.port, flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


# -- the two receivers ----------------------------------------------------------------------


def url_of(base_url: str, m: Manifest, index: int, enc: str, origin: str) -> tuple[str, int, int]:
    entry = m.shard(index)
    if enc == codecs.RAW:
        return f"{base_url}/{origin}/{entry.file}", entry.offset, entry.length
    offered = entry.offered(enc)
    assert offered is not None
    return f"{base_url}/{origin}/{BLOB_DIR}/{index}.{enc}", 0, offered.size


async def receive_old(
    client: HttpClient, base_url: str, m: Manifest, store: VersionStore, origin: str, enc: str
) -> Stages:
    """The path before issue 16 (see module docstring)."""
    st = Stages()
    part = store.begin(m)
    base = BaseVersion(store, m.header.base_step) if m.header.base_step is not None else None
    t_all, w0 = time.process_time(), time.perf_counter()
    for index in range(len(m.header.shards)):
        entry = m.shard(index)
        e = enc if entry.offered(enc) is not None else codecs.RAW
        url, offset, length = url_of(base_url, m, index, e, origin)
        t = time.process_time()
        data, pos = bytearray(length), 0
        async for chunk in client.stream_range(url, offset, length, timeout_s=30):
            data[pos : pos + len(chunk)] = chunk
            pos += len(chunk)
        st.add("receive", time.process_time() - t)

        def write(entry: Any = entry, e: str = e, data: bytearray = data) -> None:
            if e == codecs.RAW:
                digest = timed(st, "hash", lambda: blake3.blake3(data, max_threads=-1).hexdigest())
                timed(st, "write", part.write_shard, entry.index, data, hashed=digest)
                return
            t = time.process_time()  # old delta path: blob hash, read base, decode, hash, write
            assert base is not None
            blake3.blake3(data).hexdigest()
            held = bytearray(entry.length)
            base_bytes = base.read_into(entry.file, entry.offset, entry.length, held)
            raw = codecs.decode(e, data, entry.length, base_bytes, out=base_bytes)
            part.write_shard(entry.index, raw, blobs={e: bytes(data)})
            st.add("apply", time.process_time() - t)

        await trio.to_thread.run_sync(write)
    await trio.to_thread.run_sync(lambda: timed(st, "commit", part.commit))
    if base is not None:
        base.close()
    st.add("total", time.process_time() - t_all)
    st.wall_s = time.perf_counter() - w0
    return st


async def receive_new(
    client: HttpClient, base_url: str, m: Manifest, store: VersionStore, origin: str, enc: str
) -> Stages:
    """The path of :mod:`shardcast.download.receive` (what the downloader runs)."""
    st = Stages()
    part = store.begin(m)
    base = BaseVersion(store, m.header.base_step) if m.header.base_step is not None else None
    t_all, w0 = time.process_time(), time.perf_counter()
    for index in range(len(m.header.shards)):
        entry = m.shard(index)
        e = enc if entry.offered(enc) is not None else codecs.RAW
        url, offset, length = url_of(base_url, m, index, e, origin)
        sink = ShardSink.pooled(length)
        t, hashed = time.process_time(), 0.0
        async for n in client.receive_range_into(url, offset, sink.window(length), timeout_s=30):
            h = time.process_time()
            sink.advance(n)
            hashed += time.process_time() - h
        st.add("receive", time.process_time() - t - hashed)
        st.add("hash", hashed)
        stage = "write" if e == codecs.RAW else "apply"
        await trio.to_thread.run_sync(
            lambda entry=entry, e=e, sink=sink, stage=stage: timed(
                st, stage, verify_and_write, part, entry, e, sink, base, "bench"
            )
        )
        sink.release()
    await trio.to_thread.run_sync(lambda: timed(st, "commit", part.commit))
    if base is not None:
        base.close()
    st.add("total", time.process_time() - t_all)
    st.wall_s = time.perf_counter() - w0
    return st


async def receive_clone(
    client: HttpClient, base_url: str, m: Manifest, store: VersionStore, origin: str, enc: str
) -> Stages:
    """Every delta shard by clone-and-patch (:meth:`PartialVersion.patch_shard`), whatever
    its density (bench only: the alternative to the buffer path for dense shards)."""
    st = Stages()
    part = store.begin(m)
    assert m.header.base_step is not None
    base = BaseVersion(store, m.header.base_step)
    t_all, w0 = time.process_time(), time.perf_counter()
    for index in range(len(m.header.shards)):
        entry = m.shard(index)
        e = enc if entry.offered(enc) is not None else codecs.RAW
        url, offset, length = url_of(base_url, m, index, e, origin)
        sink = ShardSink.pooled(length)
        t = time.process_time()
        async for n in client.receive_range_into(url, offset, sink.window(length), timeout_s=30):
            sink.advance(n)
        st.add("receive", time.process_time() - t)

        def apply(entry: Any = entry, e: str = e, sink: ShardSink = sink) -> None:
            if e == codecs.RAW:
                part.write_shard(entry.index, sink.data, hashed=sink.digest())
                return
            blob = sink.data

            def patch(view: memoryview) -> None:
                codecs.decode(e, blob, entry.length, view, out=view)

            part.patch_shard(entry.index, base.fd(entry.file), patch, blobs={e: bytes(blob)})

        await trio.to_thread.run_sync(lambda apply=apply: timed(st, "apply", apply))
        sink.release()
    await trio.to_thread.run_sync(lambda: timed(st, "commit", part.commit))
    base.close()
    st.add("total", time.process_time() - t_all)
    st.wall_s = time.perf_counter() - w0
    return st


def receive_floor(base_url: str, m: Manifest, dest: Path, origin: str) -> Stages:
    """The floor (see module docstring): raw HTTP/1.1 range requests on blocking sockets."""
    st = Stages()
    host, port = base_url.removeprefix("http://").split(":")
    dest.mkdir(parents=True, exist_ok=True)
    fds: dict[str, int] = {}
    buf = bytearray(max(m.shard(i).length for i in range(len(m.header.shards))))
    view = memoryview(buf)
    t_all, w0 = time.process_time(), time.perf_counter()
    try:
        for index in range(len(m.header.shards)):
            entry = m.shard(index)
            url, offset, length = url_of(base_url, m, index, codecs.RAW, origin)
            t = time.process_time()
            with socket.create_connection((host, int(port))) as sock:
                path = url.removeprefix(base_url)
                sock.sendall(
                    f"GET {path} HTTP/1.1\r\nHost: {host}\r\n"
                    f"Range: bytes={offset}-{offset + length - 1}\r\n\r\n".encode()
                )
                head = b""
                while b"\r\n\r\n" not in head:
                    more = sock.recv(4096)
                    if not more:
                        raise ConnectionError(f"{url}: closed in the response head")
                    head += more
                body = head.split(b"\r\n\r\n", 1)[1]
                view[: len(body)] = body
                pos = len(body)
                while pos < length:
                    n = sock.recv_into(view[pos:length])
                    if n == 0:
                        raise ConnectionError(f"{url}: closed after {pos} of {length} bytes")
                    pos += n
            st.add("receive", time.process_time() - t)
            digest = timed(st, "hash", blake3.blake3, view[:length]).hexdigest()
            if digest != entry.digest:
                raise ValueError(f"floor: shard {index} digest mismatch")
            if entry.file not in fds:
                fds[entry.file] = os.open(
                    dest / entry.file.replace("/", "_"), os.O_RDWR | os.O_CREAT
                )
            fd = fds[entry.file]
            if timed(st, "write", os.pwrite, fd, view[:length], entry.offset) != length:
                raise OSError(f"floor: short write of shard {index}")
        for fd in fds.values():  # durable, as a commit is
            timed(st, "commit", os.fsync, fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    st.add("total", time.process_time() - t_all)
    st.wall_s = time.perf_counter() - w0
    return st


# -- driver ---------------------------------------------------------------------------------


def per_gb(st: Stages, size: int) -> dict[str, float]:
    return {k: round(v / (size / GB), 3) for k, v in sorted(st.cpu_s.items())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=512, help="checkpoint size (<= 1024)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--changed", type=float, default=0.02, help="share of changed words")
    parser.add_argument("--json", type=Path, help="write the breakdown here")
    parser.add_argument(
        "--dir", type=Path, default=Path("/dev/shm"), help="where the files go (default /dev/shm)"
    )
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve, args.serve)
        return
    if not 1 <= args.size_mib <= 1024:
        print("datapath: --size-mib must be in [1, 1024]", file=sys.stderr)
        raise SystemExit(2)
    if not args.dir.is_dir() or not os.access(args.dir, os.W_OK):
        print(f"datapath: --dir {args.dir}: not a writable directory", file=sys.stderr)
        raise SystemExit(2)
    root = args.dir / f"shardnet-datapath-{os.getpid()}"
    size = args.size_mib << 20
    results: dict[str, Any] = {"size_bytes": size, "changed": args.changed, "runs": []}
    try:
        v1, v2 = make_versions(root, size, args.changed)
        ident = Identity.generate()
        origin = VersionStore(root / "origin", RUN, keep_last=8)
        # the origin: step 1 full (schema 2 and 3), step 2 as a delta (xor-zstd / sparse)
        manifests: dict[str, Manifest] = {}
        for schema, step_full, step_next, enc in (
            (2, 1, 2, codecs.XOR_ZSTD),
            (3, 3, 4, codecs.SPARSE),
        ):
            d1 = root / f"o-{step_full}"
            shutil.copytree(v1, d1)
            m1 = build_manifest(d1, RUN, step_full, ident, SHARD, schema=schema)
            origin.adopt(d1, m1, rehash=False)
            d2 = root / f"o-{step_next}"
            shutil.copytree(v2, d2)
            m2 = build_manifest(
                d2,
                RUN,
                step_next,
                ident,
                SHARD,
                encodings=[enc],
                base=Base(step_full, m1.digest, origin.version_dir(step_full)),
                blob_dir=d2 / BLOB_DIR,
                schema=schema,
            )
            origin.adopt(d2, m2, rehash=False)
            manifests[f"full-{schema}"], manifests[f"next-{schema}"] = m1, m2
        delta_bytes = {
            k: sum(e.size for i in range(len(m.header.shards)) for e in m.shard(i).encodings)
            for k, m in manifests.items()
            if k.startswith("next")
        }
        results["delta_bytes"] = delta_bytes
        cmd = [sys.executable, __file__, "--serve", str(origin.run_dir)]
        with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as server:
            try:
                assert server.stdout is not None
                base_url = f"http://127.0.0.1:{int(server.stdout.readline())}"
                for rep in range(args.repeats):
                    results["runs"].append(trio.run(run_once, base_url, root, manifests, size))
                    print(f"repeat {rep + 1}/{args.repeats} done", file=sys.stderr)
            finally:
                server.send_signal(signal.SIGTERM)
                server.wait(timeout=10)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    report(results, args.size_mib)
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))


async def run_once(
    base_url: str, root: Path, manifests: dict[str, Manifest], size: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    async with HttpClient() as client:
        for path, fn, schema, enc in (
            ("old", receive_old, 2, codecs.XOR_ZSTD),
            ("new", receive_new, 3, codecs.SPARSE),
        ):
            recv = root / f"recv-{path}"
            store = VersionStore(recv, RUN, keep_last=4)
            full, nxt = manifests[f"full-{schema}"], manifests[f"next-{schema}"]
            origin_dir = f"step-{full.step}"
            st_full = await fn(client, base_url, full, store, origin_dir, codecs.RAW)
            st_next = await fn(client, base_url, nxt, store, f"step-{nxt.step}", enc)
            out[path] = {
                "full": {"cpu_s_per_gb": per_gb(st_full, size), "wall_s": round(st_full.wall_s, 2)},
                "next": {"cpu_s_per_gb": per_gb(st_next, size), "wall_s": round(st_next.wall_s, 2)},
            }
            if path == "new":  # the clone alternative, from the same full version
                store.discard(nxt.step)
                st_buf = await receive_clone(client, base_url, nxt, store, f"step-{nxt.step}", enc)
                out["clone"] = {
                    "next": {
                        "cpu_s_per_gb": per_gb(st_buf, size),
                        "wall_s": round(st_buf.wall_s, 2),
                    }
                }
            store.close()
            shutil.rmtree(recv, ignore_errors=True)
    full = manifests["full-3"]
    st_floor = receive_floor(base_url, full, root / "recv-floor", f"step-{full.step}")
    out["floor"] = {
        "full": {"cpu_s_per_gb": per_gb(st_floor, size), "wall_s": round(st_floor.wall_s, 2)}
    }
    shutil.rmtree(root / "recv-floor", ignore_errors=True)
    return out


def report(results: dict[str, Any], size_mib: int) -> None:
    runs = results["runs"]
    print(
        f"receiver CPU-s per GB of checkpoint, {size_mib} MiB, {len(runs)} repeat(s), "
        f"median; {results['changed']:.1%} of words changed; delta bytes {results['delta_bytes']}"
    )
    stages = ("receive", "hash", "write", "apply", "commit", "total")
    print(f"{'version':<6} {'path':<4} " + " ".join(f"{s:>8}" for s in stages) + "   wall s")
    for version in ("full", "next"):
        med: dict[str, dict[str, float]] = {}
        for path in ("old", "new", "clone", "floor"):
            if version not in runs[0].get(path, {}):
                continue
            med[path] = {
                s: float(np.median([r[path][version]["cpu_s_per_gb"].get(s, 0.0) for r in runs]))
                for s in stages
            }
            wall = float(np.median([r[path][version]["wall_s"] for r in runs]))
            print(
                f"{version:<6} {path:<4} "
                + " ".join(f"{med[path][s]:>8.3f}" for s in stages)
                + f"   {wall:.2f}"
            )
        ratio = med["new"]["total"] / med["old"]["total"] if med["old"]["total"] else float("nan")
        print(f"{version:<6} new/old total: {ratio:.2f}x")
        results.setdefault("median", {})[version] = {**med, "new_over_old_total": ratio}


if __name__ == "__main__":
    main()
