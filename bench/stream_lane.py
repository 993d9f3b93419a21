"""Cost of one shard request over the stream lane against the TCP lane, on loopback.

Theory of operation
-------------------
A NATed peer serves its shards over the stream lane: HTTP/1.1 (our h11 server and client)
over a py-libp2p stream (yamux over Noise over TCP), where a public node's lane is plain TCP.
With small shards (the NAT bench's 64 KiB) a version is many requests, and each one's cost
is per-request work, not bytes: on the namespaced NAT bench's 2 shared cores, that cost is
what the CPU-bound machine turns into latency.

One process holds both ends: an :class:`~p2p.http_server.HttpServer` serving a file from
``/dev/shm`` on a TCP port and, through a py-libp2p host, on the stream lane; and an
:class:`~p2p.http_client.HttpClient` fetching ``--size-kib`` pieces of it with
``receive_range_into`` (as the downloader does), ``--concurrency`` at a time, ``--requests``
in all, over each lane in turn (pooled connections and streams, reused as the downloader
reuses them). It prints per request the median and 90th-percentile latency and the process
CPU (both ends, ``time.process_time``), and the stream lane's ratio to TCP.

Measured (this machine, 2 cores, quiet; 64 KiB, one at a time, 2,000 requests per lane;
median latency and process CPU per request, both ends):

==========================================  ==================  ==================
server                                      TCP lane            stream lane
==========================================  ==================  ==================
head and body in separate sends, file       0.45 ms, 0.47 ms    2.72 ms, 2.79 ms
pieces read in a worker thread (before)
head in the body's first send, pieces of    0.46 ms, 0.48 ms    1.81 ms, 1.82 ms
<= 256 KiB read on the event loop (now)
==========================================  ==================  ==================

The head and a 64 KiB body in separate sends took three yamux frames (the head; 65,524 bytes,
yamux's largest; 12 bytes), together two; each frame is a Noise message, a socket write and,
at the reader, a wake-up. ``PY_YAMUX_RELEASE_ON_READ=0`` (py-libp2p's own tuning variable:
window updates only at half the window) takes the stream lane to ~1.5 ms; it is left at the
library's default.

Usage::

    python bench/stream_lane.py [--requests 2000] [--size-kib 64] [--concurrency 1]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from p2p.bytestream import STREAM_LANE_PROTOCOL, ByteStream, stream_lane_url
from p2p.host import HostConfig, P2PNode
from p2p.http_client import HttpClient
from p2p.http_server import HttpRequest, HttpResponse, HttpServer, HttpServerConfig, file_response
from p2p.identity import Identity
from p2p.keepalive import KeepaliveConfig

PIECES = 26  # distinct offsets fetched in turn (the NAT bench's version has 26 shards)


async def _fetch_all(
    client: HttpClient, url: str, *, size: int, requests: int, concurrency: int
) -> tuple[list[float], float, float]:
    """``requests`` GETs of ``size`` bytes; (latencies s, wall s, process CPU s)."""
    lat: list[float] = []

    async def worker(k: int) -> None:
        buf = memoryview(bytearray(size))
        for i in range(k, requests, concurrency):
            start = (i % PIECES) * size
            t = time.perf_counter()
            async for _ in client.receive_range_into(url, start, buf, timeout_s=30):
                pass
            lat.append(time.perf_counter() - t)

    t0, c0 = time.perf_counter(), time.process_time()
    async with trio.open_nursery() as nursery:
        for k in range(concurrency):
            nursery.start_soon(worker, k)
    return lat, time.perf_counter() - t0, time.process_time() - c0


def _row(name: str, lat: list[float], wall: float, cpu: float) -> dict[str, float]:
    lat = sorted(lat)
    n = len(lat)
    row = {
        "median_ms": statistics.median(lat) * 1e3,
        "p90_ms": lat[int(0.9 * n)] * 1e3,
        "cpu_ms": cpu / n * 1e3,
    }
    print(
        f"{name:8} requests={n:5}  median {row['median_ms']:6.2f} ms  p90 {row['p90_ms']:6.2f} ms"
        f"  CPU {row['cpu_ms']:5.2f} ms/request  wall {wall:5.2f} s"
    )
    return row


async def _run(args: argparse.Namespace, blob: Path) -> None:
    size = args.size_kib * 1024
    total = size * PIECES

    async def handle(req: HttpRequest) -> HttpResponse:
        return file_response(req, blob, total)

    server = HttpServer(handle, HttpServerConfig(host="127.0.0.1", port=0))
    # no keep-alive pings: the two hosts close one after the other at the end, and a ping
    # due in between would report the first one's connection dead
    quiet = KeepaliveConfig(ping_interval_s=3600.0, ping_timeout_s=5.0)
    cfg = HostConfig(("/ip4/127.0.0.1/tcp/0",), dial_timeout_s=5.0, keepalive=quiet)
    ids = [Identity.from_seed(f"bench-stream-lane-{n}") for n in "ab"]
    async with (
        trio.open_nursery() as nursery,
        P2PNode.open(ids[0], cfg) as a,
        P2PNode.open(ids[1], cfg) as b,
    ):
        await nursery.start(server.serve)
        a.serve_stream(STREAM_LANE_PROTOCOL, server.serve_stream)
        await a.connect(b.multiaddrs()[0], keep=False)  # A dials out, as a NATed peer does

        async def opener(peer: str, timeout_s: float) -> ByteStream:
            return await b.open_stream(peer, STREAM_LANE_PROTOCOL, timeout_s)

        rows = {}
        async with HttpClient(open_stream=opener) as client:
            for name, base in (("tcp", server.url), ("stream", stream_lane_url(a.peer_id))):
                url = base + "/piece"
                await _fetch_all(client, url, size=size, requests=PIECES, concurrency=1)  # warm
                lat, wall, cpu = await _fetch_all(
                    client, url, size=size, requests=args.requests, concurrency=args.concurrency
                )
                rows[name] = _row(name, lat, wall, cpu)
        nursery.cancel_scope.cancel()
    print(
        f"stream/tcp: latency {rows['stream']['median_ms'] / rows['tcp']['median_ms']:.1f}x, "
        f"CPU {rows['stream']['cpu_ms'] / rows['tcp']['cpu_ms']:.1f}x"
    )


def main(argv: list[str] | None = None) -> int:
    """Run the bench; 0, or 2 on a bad option."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=2000, help="requests per lane")
    ap.add_argument("--size-kib", type=int, default=64, help="bytes per request, KiB")
    ap.add_argument("--concurrency", type=int, default=1, help="requests in flight")
    args = ap.parse_args(argv)
    if args.requests < 1 or args.size_kib < 1 or args.concurrency < 1:
        ap.error("--requests, --size-kib and --concurrency must be >= 1")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="bench-stream-lane-", dir=shm) as tmp:
        blob = Path(tmp) / "piece"
        rng = random.Random(25)
        with open(blob, "wb") as fh:  # piece by piece: one randbytes call is capped at 2**31 bits
            for _ in range(PIECES):
                fh.write(rng.randbytes(args.size_kib * 1024))
        trio.run(_run, args, blob)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
