"""Throughput of the HTTP bulk lane on loopback: our server (sendfile / pread) × three clients.

Usage::

    python bench/http_lane.py [--size-mib 1024] [--repeats 2] [--report out.json]

Writes a file of ``--size-mib`` MiB to /dev/shm (deleted afterwards), runs
:class:`p2p.http_server.HttpServer` in a child process (one core each for server and client),
and downloads the whole file with: ``p2p.http_client.HttpClient.stream_range`` (our client:
h11 over pooled trio sockets, with its error and bound checks; row ``client``), httpx (row
``httpx``, the library this client replaced), a bare h11-over-trio loop (what a lean Python
client reaches) and ``curl -o /dev/null`` (a C client, the reference). Prints MB/s (10^6 bytes
per second), best of ``--repeats``, with the CPU seconds per GiB spent by the server process and
by the client.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import h11
import trio

from p2p.http_client import HttpClient
from p2p.http_server import (
    HttpRequest,
    HttpResponse,
    HttpServer,
    HttpServerConfig,
    file_response,
)

BLOCK = 16 << 20


@dataclass(frozen=True)
class Run:
    mb_per_s: float
    server_cpu_s_per_gib: float
    client_cpu_s_per_gib: float


@dataclass(frozen=True)
class Row:
    server: str
    client: str
    runs: list[Run]

    @property
    def best(self) -> Run:
        return max(self.runs, key=lambda r: r.mb_per_s)


def make_file(path: Path, size: int) -> None:
    block = os.urandom(BLOCK)
    with path.open("wb") as f:
        for offset in range(0, size, BLOCK):
            f.write(block[: min(BLOCK, size - offset)])


async def serve(path: Path, size: int, use_sendfile: bool) -> None:
    async def handler(request: HttpRequest) -> HttpResponse:
        return file_response(request, path, size)

    server = HttpServer(handler, HttpServerConfig(use_sendfile=use_sendfile))
    with trio.open_signal_receiver(signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            await nursery.start(server.serve)
            print(server.port, flush=True)
            async for _ in signals:
                nursery.cancel_scope.cancel()
                break


async def with_client(url: str, size: int) -> int:
    got = 0
    async with HttpClient() as client:
        async for chunk in client.stream_range(url, 0, size, timeout_s=30):
            got += len(chunk)
    return got


async def with_httpx(url: str, size: int) -> int:
    import httpx

    got = 0
    async with httpx.AsyncClient() as client, client.stream("GET", url) as response:
        async for chunk in response.aiter_raw():
            got += len(chunk)
    return got


async def with_h11(url: str, size: int) -> int:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    got = 0
    async with await trio.open_tcp_stream("127.0.0.1", port) as stream:
        conn = h11.Connection(h11.CLIENT)
        request = h11.Request(method="GET", target="/f", headers=[("host", "bench")])
        await stream.send_all(conn.send(request) + conn.send(h11.EndOfMessage()))
        while True:
            event = conn.next_event()
            if event is h11.NEED_DATA:
                conn.receive_data(await stream.receive_some(1 << 20))
            elif isinstance(event, h11.Data):
                got += len(event.data)
            elif isinstance(event, h11.EndOfMessage):
                return got


def with_curl(url: str, size: int) -> int:
    out = subprocess.run(
        ["curl", "-s", "-o", "/dev/null", "-w", "%{size_download}", url],
        check=True,
        capture_output=True,
        text=True,
    )
    return int(out.stdout)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def own_cpu_s() -> float:
    """CPU seconds of this process plus its waited-for children (curl)."""
    me, kids = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def measure(client: str, url: str, size: int, server_pid: int) -> Run:
    server0, client0, start = cpu_s(server_pid), own_cpu_s(), time.perf_counter()
    if client == "curl":
        got = with_curl(url, size)
    else:
        fn = {"client": with_client, "httpx": with_httpx, "h11": with_h11}[client]
        got = trio.run(fn, url, size)
    elapsed = time.perf_counter() - start
    if got != size:
        raise SystemExit(f"{client}: got {got} of {size} bytes")
    gib = size / (1 << 30)
    server_cpu, client_cpu = cpu_s(server_pid) - server0, own_cpu_s() - client0
    return Run(size / elapsed / 1e6, server_cpu / gib, client_cpu / gib)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--report", type=Path)
    parser.add_argument("--serve", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-sendfile", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        trio.run(serve, args.serve, args.serve.stat().st_size, not args.no_sendfile)
        return
    if shutil.which("curl") is None:
        raise SystemExit("curl not found")
    path = Path("/dev/shm") / f"shardnet-bench-{os.getpid()}.bin"
    size = args.size_mib << 20
    rows: list[Row] = []
    try:
        make_file(path, size)
        for use_sendfile in (True, False):
            cmd = [sys.executable, __file__, "--serve", str(path)]
            cmd += [] if use_sendfile else ["--no-sendfile"]
            with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) as server:
                try:
                    assert server.stdout is not None
                    url = f"http://127.0.0.1:{int(server.stdout.readline())}/f"
                    for client in ("client", "httpx", "h11", "curl"):
                        runs = [measure(client, url, size, server.pid) for _ in range(args.repeats)]
                        name = "sendfile" if use_sendfile else "pread+send"
                        rows.append(Row(name, client, runs))
                finally:
                    server.send_signal(signal.SIGTERM)
                    server.wait(timeout=10)
    finally:
        path.unlink(missing_ok=True)
    print(f"1 file of {args.size_mib} MiB over loopback, best of {args.repeats} by MB/s")
    head = ("server", "client", "MB/s", "srv CPU s/GiB", "cli CPU s/GiB", "all MB/s")
    print("{:<11} {:<6} {:>6} {:>14} {:>14}  {}".format(*head))
    for row in rows:
        b, all_runs = row.best, ", ".join(f"{r.mb_per_s:.0f}" for r in row.runs)
        print(
            f"{row.server:<11} {row.client:<6} {b.mb_per_s:>6.0f} {b.server_cpu_s_per_gib:>14.2f}"
            f" {b.client_cpu_s_per_gib:>14.2f}  {all_runs}"
        )
    best = {(r.server, r.client): r.best.mb_per_s for r in rows}
    ratio = best[("sendfile", "client")] / best[("sendfile", "httpx")]
    print(f"our client / httpx on the sendfile server: {ratio:.2f}x")
    if args.report:
        report = {"size_bytes": size, "rows": [asdict(r) for r in rows], "client_over_httpx": ratio}
        args.report.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
