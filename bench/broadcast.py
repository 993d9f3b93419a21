"""Broadcast benchmark: shardnet vs SHARDCAST 0.3.2 on the same checkpoints and topology.

Topology, all on 127.0.0.1: 1 origin, 2 relays, 4 peers (SHARDCAST: its origin, 2 middle nodes
with ``--check-interval 1``, 4 clients). Checkpoints: a generated real-architecture bf16
checkpoint (``real-2b`` preset: 2.05 GiB, Llama/TinyLlama-1.1B shape, several safetensors files
with an index), then the next version made from it by one real Adam step at an RL learning rate
(``trainer/evolve.py``). Three systems in one run:

- ``shardnet``: ``shardnet origin`` (deltas on), 2 ``shardnet relay``, 4 leaf followers (the
  download half of ``shardnet peer``, run as ``shardnet relay`` processes whose upstreams are
  both relays; they discover and re-serve to each other);
- ``shardnet-nodelta``: the same with ``--no-deltas``;
- ``shardcast``: SHARDCAST 0.3.2 from PyPI in its own virtual environment
  (``bench/shardcast_baseline.py`` drives it; see its docstring for how completion and bytes
  are measured and how client crashes are restarted and counted).

For each system and version it measures the time from handing the version to the origin until
the last peer holds a verified copy (shardnet: the peer's ``step-N/`` directory exists, which
happens only after every digest matched), bytes sent by the origin and by each relay (shardnet:
``shardnet_served_bytes_total{step}`` from each node's ``/metrics``), repeats everything
``--repeats`` times and reports medians and the ratios against SHARDCAST. ``--json`` prints one
JSON object with ``full_ratio_vs_shardcast``, ``delta_ratio_vs_shardcast`` (shardnet time /
SHARDCAST time) and ``delta_bytes_ratio`` (bytes of the delta version / bytes of the full one).

η = bound / measured, where bound = (bytes that must reach every relay and peer) / (plain-socket
loopback throughput measured in this run): a single machine's loopback and CPUs are shared by
all transfers, so the total bytes received is what has to move.

Run (about 30-40 minutes with 3 repeats; ``--quick`` for a 1-repeat smoke run):

    .venv/bin/python bench/broadcast.py --json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

REPO = Path(__file__).resolve().parents[1]
RUN_ID = "bench"
# every node of the benchmark runs on this machine: loopback only, any free port
LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0", "--http-host", "127.0.0.1", "--http-port", "0"]
N_RELAYS, N_PEERS = 2, 4


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


class Proc:
    """A node process with its ready record."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.name = name
        self.args = args
        self.log = workdir / "logs" / f"{name}.log"
        self.proc: trio.Process | None = None
        self.ready: dict[str, Any] = {}

    async def start(self, nursery: trio.Nursery) -> dict[str, Any]:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        ready_file = self.log.with_suffix(".ready.json")
        with open(self.log, "wb") as logf:  # noqa: ASYNC230 - once per process start
            self.proc = await trio.lowlevel.open_process(
                [sys.executable, "-m", "shardnet.cli", *self.args, "--ready-file", str(ready_file)],
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


def _cpu_s(proc: Proc) -> float:
    """User + system CPU seconds of a node process so far (0 if it is gone)."""
    try:
        assert proc.proc is not None
        fields = Path(f"/proc/{proc.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, AssertionError):
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _served_bytes(client: Any, url: str, step: int) -> int:
    text = (await client.get_bytes(url + "/metrics", max_bytes=1 << 20, timeout_s=10)).decode()
    m = re.search(rf'shardnet_served_bytes_total{{step="{step}"}} (\S+)', text)
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
) -> dict[str, Any]:
    """One shardnet run: publish v0 then v1; returns per-version measurements."""
    from p2p.http_client import HttpClient
    from p2p.identity import Identity

    workdir.mkdir(parents=True)  # noqa: ASYNC240 - setup, before anything is timed
    trainer_key = workdir / "origin" / "node.key"
    trainer_id = Identity.load_or_create(trainer_key).peer_id
    publish = workdir / "publish"
    publish.mkdir()
    common = ["--run-id", RUN_ID, "--keep-last", "2", "--log-level", log_level, *LOOPBACK]
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
                ],
                workdir,
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
                        *common,
                    ],
                    workdir,
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
                        *common,
                    ],
                    workdir,
                )
                procs.append(p)
                peers.append(p)
                await p.start(nursery)
            for step, src in enumerate((v0, v1)):
                staged = publish / f"step-{step}"
                staged.mkdir()
                for f in src.iterdir():
                    os.link(f, staged / f.name)
                cpu0 = {p.name: _cpu_s(p) for p in procs}
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
                sent = {
                    p.name: await _served_bytes(client, p.ready["http_url"], step) for p in procs
                }
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
                        "cpu_s": {p.name: round(_cpu_s(p) - cpu0[p.name], 2) for p in procs},
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


async def run_shardcast(
    v0: Path, v1: Path, workdir: Path, timeout_s: float, venv: Path
) -> dict[str, Any]:
    """One SHARDCAST run through bench/shardcast_baseline.py (1 origin, 2 middles with
    ``--check-interval 1``, 4 clients on 127.0.0.1; crashed clients restarted and counted)."""
    sys.path.insert(0, str(REPO / "bench"))
    import shardcast_baseline  # type: ignore[import-not-found]

    res = await shardcast_baseline.arun_shardcast(
        v0, workdir, next_checkpoints=[v1], timeout_s=timeout_s, venv=str(venv)
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
                "raw": v,
            }
        )
    return {"system": "shardcast", "versions": versions}


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
    out["full_ratio_vs_shardcast"] = round(sn0 / sc0, 4) if sn0 and sc0 else None
    out["delta_ratio_vs_shardcast"] = round(sn1 / sc1, 4) if sn1 and sc1 else None
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
    loopback = await loopback_throughput()
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in args.systems}
    root = Path(tempfile.mkdtemp(prefix="shardnet-bench-", dir=args.workdir))
    try:
        for rep in range(args.repeats):
            for system in args.systems:
                wd = root / f"{system}-{rep}"
                print(f"# run {rep + 1}/{args.repeats}: {system}", file=sys.stderr, flush=True)
                if system == "shardcast":
                    venv = ensure_shardcast_venv(Path(args.shardcast_venv))
                    r = await run_shardcast(v0, v1, wd, args.timeout, venv)
                else:
                    r = await run_shardnet(
                        v0,
                        v1,
                        wd,
                        deltas=system == "shardnet",
                        shard_size=args.shard_size,
                        timeout_s=args.timeout,
                        log_level=args.log_level,
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--repeats", type=int, default=3)
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
    ap.add_argument("--systems", nargs="+", default=["shardnet", "shardnet-nodelta", "shardcast"])
    ap.add_argument("--cache", default="/tmp/shardnet-bench-cache")
    ap.add_argument(
        "--shardcast-venv",
        default=os.environ.get("SHARDCAST_VENV", "/tmp/shardnet-bench-cache/shardcast-venv"),
        help="venv with SHARDCAST 0.3.2 (created if missing)",
    )
    ap.add_argument("--workdir", default=None, help="parent of the run directories")
    ap.add_argument("--timeout", type=float, default=900.0, help="per version, seconds")
    ap.add_argument(
        "--keep", action="store_true", help="keep the run directories (node data and logs)"
    )
    ap.add_argument("--log-level", default="WARNING", help="shardnet nodes' log level")
    args = ap.parse_args()
    if args.quick:
        args.repeats, args.preset = 1, "real-1b"
    out = trio.run(amain, args)
    if args.json:
        print(json.dumps({k: v for k, v in out.items() if k != "runs"}, default=str))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
