"""Chaos bench: liveness of real shardnet processes under faults and hostile peers (issue 14).

Every scenario starts its own cluster of CLI processes on 127.0.0.1 (any free port; the
origin's ports are chosen up front so that a restarted origin keeps its addresses):

- ``shardnet origin`` publishing a generated checkpoint (seeded random safetensors-named files)
  through ``--watch``;
- 2 ``shardnet relay`` following the origin;
- 2 download-only followers (``shardnet relay`` processes whose upstreams are both relays, as
  ``bench/broadcast.py`` runs its leaf peers; they discover and re-serve to each other).

The same checkpoint is published as step 0 in every scenario; ``clean`` runs first and is the
baseline. For each scenario the report gives the time from handing the version to the origin
(``DONE`` marker written) to the last follower's commit (its ``step-N/manifest.json`` exists,
which happens only after every digest matched), the nodes that crashed (exited before the end
unless the scenario killed them, or a non-zero exit on SIGTERM; tracebacks in the logs are
counted too), each node's RSS growth (psutil, first sample after start to end), bytes
re-fetched where it applies, and whether it meets the issue's targets: no crash; last commit
within ``1.5 x clean + 10 s``; a restarted follower re-fetches at most the shards it had not
journaled plus one per request in flight (``max_inflight`` = 8); RSS growth < 50 MB per node
(and, under the gossip flood, flat across rounds: the last round adds < 10 MB).

Scenarios (``--scenarios``, comma-separated; default all, in this order):

``clean``          no fault (the baseline; always run first, added if missing)
``malformed``      every :class:`p2p.hostile.Malformed` frame kind on the gossip and the info
                   protocol to the origin, a relay and a follower (a fresh attacker identity per
                   frame), during the broadcast
``flood``          rounds of correctly signed junk gossip to a relay (fresh identities), RSS of
                   every node sampled before and after each round, then the broadcast
``slots``          attackers hold half-sent info requests on the origin and a relay during the
                   broadcast
``relay_kill``     SIGKILL a relay once it has verified a quarter of the version
``peer_restart``   SIGKILL a follower at half the version, restart it on its data directory;
                   bytes fetched after the restart against the shards it had not journaled
``wipe``           a follower's data directory is deleted at a quarter of the version
``plain_client``   an anonymous HTTP client (httpx) fetches every file from the origin from the
                   moment the manifest exists
``origin_kill``    SIGKILL the origin while it hashes the version, restart it (same key, ports,
                   data directory and watch directory)
``prune``          a follower is stopped (SIGSTOP) at a quarter of step 0 while steps 1-4 are
                   published and relays keep only 2 versions; time from SIGCONT to its commit of
                   step 4 (compared with the clean time of one version)

``fake_adverts``   8 fresh identities gossip correctly signed adverts (relay, holding step 0)
                   for lanes they do not hold: half the origin's, half a junk lane in the
                   bench; every 2 s during the broadcast, to relays and followers. Reports
                   adverts sent, ``advert_unproven`` lines and how often a fake was used
``corrupting_relay`` an attacker identity whose lane proves its PeerID (whoami) and proxies the
                   origin's lane with one byte flipped in every shard or file body advertises
                   itself as a relay holding step 0; reports how many nodes used it and how
                   many banned it

Not covered yet: a stalling relay, the 30-minute soak.

Timings on a shared machine are noisy: run it on an idle one for numbers that mean anything.

Run (a few minutes)::

    PYTHONPATH=. .venv/bin/python bench/chaos.py --quick --json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import trio
import trio.lowlevel

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

RUN_ID = "chaos"
MAX_INFLIGHT = 8  # shardcast.core.select.SelectConfig.max_inflight: requests in flight per download
RSS_BOUND_MB = 50.0
FLOOD_FLAT_MB = 10.0
MB = 1e6


@dataclass
class Settings:
    """What one bench run uses (``--quick`` shrinks it)."""

    size_bytes: int = 256 << 20
    files: int = 4
    shard_size: int = 4 << 20
    relays: int = 2
    followers: int = 2
    timeout_s: float = 180.0
    flood_rounds: int = 3
    flood_messages: int = 1000
    log_level: str = "WARNING"


# ----------------------------------------------------------------------------- checkpoint


def make_checkpoint(directory: Path, s: Settings, seed: int = 0) -> Path:
    """Seeded random files named like a sharded HF checkpoint (sharding does not parse them)."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    per = s.size_bytes // s.files
    names = [f"model-{i + 1:05d}-of-{s.files:05d}.safetensors" for i in range(s.files)]
    for name in names:
        with open(directory / name, "wb") as fh:
            for off in range(0, per, 1 << 24):  # randbytes takes at most 2**28 bytes at once
                fh.write(rng.randbytes(min(1 << 24, per - off)))
    wm = {f"layer.{i}.weight": n for i, n in enumerate(names)}
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": per * s.files}, "weight_map": wm})
    )
    return directory


def next_version(src: Path, dst: Path, seed: int) -> Path:
    """A copy of ``src`` with a few bytes of every weight file changed (a small update)."""
    rng = random.Random(seed)
    dst.mkdir(parents=True)
    for f in sorted(src.iterdir()):
        data = bytearray(f.read_bytes())
        if f.name.endswith(".safetensors"):
            for _ in range(64):
                data[rng.randrange(len(data))] ^= 0xFF
        (dst / f.name).write_bytes(bytes(data))
    return dst


# ----------------------------------------------------------------------------- processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Node:
    """One CLI node process (started with loopback addresses), its ready record and RSS."""

    def __init__(self, name: str, role: str, args: list[str], data_dir: Path, logs: Path) -> None:
        self.name = name
        self.role = role
        self.args = args
        self.data_dir = data_dir
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] = {}
        self.starts = 0
        self.killed_on_purpose = False  # the scenario killed it and did not restart it
        self.rss0: int | None = None
        self.exit_code: int | None = None

    def launch(self) -> None:
        self.starts += 1
        ready_file = self.logs / f"{self.name}.{self.starts}.ready.json"
        log = open(self.logs / f"{self.name}.log", "ab")  # the child keeps its own copy
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shardnet.cli", *self.args, "--ready-file", str(ready_file)],
            stdout=log,
            stderr=log,
            stdin=subprocess.DEVNULL,
            cwd=REPO,
            env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
        )
        log.close()
        self._ready_file = ready_file

    async def wait_ready(self, timeout_s: float = 120) -> dict[str, Any]:
        assert self.proc is not None
        with trio.fail_after(timeout_s):
            while not self._ready_file.exists():
                if self.proc.poll() is not None:
                    raise RuntimeError(f"{self.name} exited; see {self.logs}/{self.name}.log")
                await trio.sleep(0.05)
        self.ready = json.loads(self._ready_file.read_text())
        if self.rss0 is None:
            self.rss0 = self.rss()
        return self.ready

    @property
    def addr(self) -> str:
        return str(self.ready["multiaddrs"][0])

    @property
    def url(self) -> str:
        return str(self.ready["http_url"])

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def rss(self) -> int | None:
        if not self.alive():
            return None
        assert self.proc is not None
        try:
            return int(psutil.Process(self.proc.pid).memory_info().rss)
        except psutil.Error:
            return None

    def signal(self, sig: int) -> None:
        if self.alive():
            assert self.proc is not None
            self.proc.send_signal(sig)

    async def kill(self) -> None:
        """SIGKILL and reap."""
        self.signal(signal.SIGKILL)
        assert self.proc is not None
        while self.proc.poll() is None:  # noqa: ASYNC110 - another process's state
            await trio.sleep(0.01)

    async def stop(self) -> None:
        """SIGTERM (SIGKILL after 20 s); records the exit code."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(20):
                while self.proc.poll() is None:  # noqa: ASYNC110 - another process
                    await trio.sleep(0.05)
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        self.exit_code = self.proc.returncode

    def run_dir(self) -> Path:
        return self.data_dir / "versions" / RUN_ID

    def committed(self, step: int) -> bool:
        return (self.run_dir() / f"step-{step}" / "manifest.json").exists()

    def journaled(self, step: int) -> int:
        """Shards listed in the partial version's journal (0 if none)."""
        try:
            lines = (self.run_dir() / f".partial-step-{step}" / ".journal").read_text()
        except OSError:
            return 0
        return max(0, len(lines.splitlines()) - 1)

    def tracebacks(self) -> int:
        try:
            return (self.logs / f"{self.name}.log").read_text(errors="replace").count("Traceback")
        except OSError:
            return 0


class Cluster:
    """Origin, relays and followers of one scenario (see the module docstring)."""

    def __init__(self, root: Path, s: Settings, keep_last: int = 3) -> None:
        from p2p.identity import Identity

        self.root = root
        self.s = s
        logs = root / "logs"
        logs.mkdir(parents=True)
        self.publish_dir = root / "publish"
        self.publish_dir.mkdir()
        key = root / "origin" / "node.key"
        self.trainer_id = Identity.load_or_create(key).peer_id
        common = ["--run-id", RUN_ID, "--keep-last", str(keep_last), "--log-level", s.log_level]
        loop = ["--http-host", "127.0.0.1"]
        self.origin_port, self.origin_http = free_port(), free_port()
        self.origin = Node(
            "origin",
            "origin",
            [
                "origin",
                "--key",
                str(key),
                "--data-dir",
                str(root / "origin"),
                "--watch",
                str(self.publish_dir),
                "--shard-size-bytes",
                str(s.shard_size),
                "--listen",
                f"/ip4/127.0.0.1/tcp/{self.origin_port}",
                "--http-port",
                str(self.origin_http),
                "--poll-interval-s",
                "0.1",
                *loop,
                *common,
            ],
            root / "origin",
            logs,
        )
        self._follow = [
            "--trainer-id",
            self.trainer_id,
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--http-port",
            "0",
            *loop,
            *common,
        ]
        self.relays: list[Node] = []
        self.followers: list[Node] = []
        self.logs = logs

    @property
    def nodes(self) -> list[Node]:
        return [self.origin, *self.relays, *self.followers]

    async def start(self) -> None:
        self.origin.launch()
        await self.origin.wait_ready()
        for i in range(1, self.s.relays + 1):
            d = self.root / f"relay{i}"
            args = ["relay", "--upstream", self.origin.addr, "--data-dir", str(d), *self._follow]
            self.relays.append(Node(f"relay{i}", "relay", args, d, self.logs))
        await self._start_all(self.relays)
        ups = [a for r in self.relays for a in ("--upstream", r.addr)]
        for i in range(1, self.s.followers + 1):
            d = self.root / f"follower{i}"
            args = ["relay", *ups, "--data-dir", str(d), *self._follow]
            self.followers.append(Node(f"follower{i}", "follower", args, d, self.logs))
        await self._start_all(self.followers)

    async def _start_all(self, nodes: list[Node]) -> None:
        for n in nodes:
            n.launch()
        for n in nodes:
            await n.wait_ready()

    def publish(self, step: int, src: Path) -> float:
        """Stage ``src`` as ``step-N`` (hard links) and write the marker; the time it was."""
        staged = self.publish_dir / f"step-{step}"
        staged.mkdir()
        for f in src.iterdir():
            os.link(f, staged / f.name)
        t0 = time.perf_counter()
        (staged / "DONE").touch()
        return t0

    async def wait_commits(
        self, step: int, nodes: list[Node], t0: float, timeout_s: float
    ) -> dict[str, float | None]:
        """Seconds from ``t0`` to each node's commit of ``step`` (None: not within timeout)."""
        done: dict[str, float | None] = {}
        with trio.move_on_after(timeout_s):
            while len(done) < len(nodes):
                for n in nodes:
                    if n.name not in done and n.committed(step):
                        done[n.name] = round(time.perf_counter() - t0, 3)
                await trio.sleep(0.02)
        return {n.name: done.get(n.name) for n in nodes}

    async def stop(self) -> None:
        for n in reversed(self.nodes):
            await n.stop()


async def received_bytes(node: Node) -> int | None:
    """``shardnet_http_received_bytes`` of a live node (None if it cannot be read)."""
    try:
        async with httpx.AsyncClient(timeout=10) as c:
            text = (await c.get(node.url + "/metrics")).text
    except httpx.HTTPError:
        return None
    m = re.search(r"^shardnet_http_received_bytes(?:_total)? (\S+)$", text, re.M)
    return int(float(m.group(1))) if m else None


async def wait_for(pred: Callable[[], bool], timeout_s: float, every_s: float = 0.01) -> bool:
    with trio.move_on_after(timeout_s):
        while not pred():  # noqa: ASYNC110 - polls files other processes write
            await trio.sleep(every_s)
        return True
    return False


# ----------------------------------------------------------------------------- scenarios


@dataclass
class Ctx:
    """What a scenario gets: its cluster, the checkpoint and a place for its measurements."""

    cluster: Cluster
    ckpt: Path
    s: Settings
    shards: int
    extra: dict[str, Any] = field(default_factory=dict)

    def timeout(self) -> float:
        return self.s.timeout_s


Scenario = Callable[[Ctx], Awaitable[dict[str, float | None]]]
Fault = Callable[[Ctx], Awaitable[None]]


async def _broadcast(
    ctx: Ctx, during: Callable[[Ctx], Awaitable[None]] | None = None, *, finish: bool = False
) -> dict[str, float | None]:
    """Publish step 0, run ``during`` alongside, wait for relays and followers.

    With ``finish``, ``during`` (an attack) also runs to its end (at most the timeout) before
    the nodes are judged, even when the version arrived first; otherwise it is cancelled once
    every node committed."""
    c = ctx.cluster
    done = trio.Event()

    async def run_during() -> None:
        assert during is not None
        try:
            await during(ctx)
        finally:
            done.set()

    async with trio.open_nursery() as nursery:
        if during is not None:
            nursery.start_soon(run_during)
            await trio.lowlevel.checkpoint()
        t0 = c.publish(0, ctx.ckpt)
        result = await c.wait_commits(0, [*c.relays, *c.followers], t0, ctx.timeout())
        if during is not None and finish:
            with trio.move_on_after(ctx.timeout()):
                await done.wait()
            ctx.extra["attack_done_s"] = round(time.perf_counter() - t0, 3)
        nursery.cancel_scope.cancel()
    return result


async def sc_clean(ctx: Ctx) -> dict[str, float | None]:
    return await _broadcast(ctx)


async def sc_malformed(ctx: Ctx) -> dict[str, float | None]:
    from p2p.hostile import MESHSUB, HostileClient, Malformed, frame
    from shardcast.wire import INFO_PROTOCOL, versions_topic

    ends: dict[str, int] = {}

    async def attack(ctx: Ctx) -> None:
        c = ctx.cluster
        topic = versions_topic(RUN_ID)
        for victim in (c.origin, c.relays[0], c.followers[0]):
            peer = victim.addr.rsplit("/p2p/", 1)[1]
            for protocol in (MESHSUB, INFO_PROTOCOL):
                for kind in Malformed:
                    data = frame(kind, topic)
                    if kind is Malformed.HOSTILE_RPC:
                        data += frame(Malformed.GARBAGE)
                    try:
                        async with HostileClient.open() as evil:
                            await evil.connect(victim.addr)
                            how = await evil.send(peer, protocol, data, wait_s=5)
                    except Exception as e:  # a refused dial counts, it must not stop the bench
                        how = f"error:{type(e).__name__}"
                    key = f"{victim.role}:{how}"
                    ends[key] = ends.get(key, 0) + 1
        ctx.extra["frames_sent"] = sum(ends.values())

    res = await _broadcast(ctx, attack, finish=True)
    ctx.extra["stream_ends"] = ends
    return res


async def sc_flood(ctx: Ctx) -> dict[str, float | None]:
    from p2p import wire
    from p2p.hostile import MESHSUB, HostileClient, Malformed, frame
    from shardcast.wire import versions_topic

    c = ctx.cluster
    victim = c.relays[0]
    peer = victim.addr.rsplit("/p2p/", 1)[1]
    topic = versions_topic(RUN_ID)
    batch = 100
    rounds: list[dict[str, Any]] = []
    for r in range(ctx.s.flood_rounds):
        before = {n.name: n.rss() for n in c.nodes}
        sent = 0
        while sent < ctx.s.flood_messages:
            async with HostileClient.open() as evil:
                junk = wire.encode(
                    {"body": os.urandom(1000), "signer": evil.identity.peer_id, "sig": b"0" * 64}
                )
                rpcs = b"".join(evil.signed_publish(topic, junk) for _ in range(batch))
                try:
                    await evil.connect(victim.addr)
                    await evil.send(peer, MESHSUB, rpcs + frame(Malformed.GARBAGE), wait_s=10)
                except Exception:  # refused: counted as sent, the node decided
                    pass
            sent += batch
        await trio.sleep(1.0)
        after = {n.name: n.rss() for n in c.nodes}
        rounds.append(
            {
                "round": r,
                "messages": sent,
                "rss_growth_mb": {k: _growth_mb(before[k], after[k]) for k in before},
            }
        )
    ctx.extra["flood_rounds"] = rounds
    return await _broadcast(ctx)


def _growth_mb(before: int | None, after: int | None) -> float | None:
    return round((after - before) / MB, 1) if after is not None and before is not None else None


async def sc_slots(ctx: Ctx) -> dict[str, float | None]:
    from p2p.hostile import HostileClient
    from shardcast.wire import INFO_PROTOCOL

    held = {"streams": 0}

    async def attack(ctx: Ctx) -> None:
        c = ctx.cluster
        async with HostileClient.open() as e1, HostileClient.open() as e2:
            for victim in (c.origin, c.relays[0]):
                peer = victim.addr.rsplit("/p2p/", 1)[1]
                for evil in (e1, e2):
                    try:
                        await evil.connect(victim.addr)
                    except Exception:
                        continue
                    for _ in range(80):
                        if await evil.hold(peer, INFO_PROTOCOL, b"\x05ab") is not None:
                            held["streams"] += 1
            ctx.extra["streams_accepted"] = held["streams"]
            await trio.sleep_forever()  # keep holding until the broadcast ends

    return await _broadcast(ctx, attack)


async def sc_relay_kill(ctx: Ctx) -> dict[str, float | None]:
    async def fault(ctx: Ctx) -> None:
        relay = ctx.cluster.relays[0]
        hit = await wait_for(lambda: relay.journaled(0) >= ctx.shards // 4, ctx.timeout())
        ctx.extra["killed_at_shards"] = relay.journaled(0) if hit else None
        await relay.kill()
        relay.killed_on_purpose = True

    c = ctx.cluster
    t0 = c.publish(0, ctx.ckpt)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(fault, ctx)
        res = await c.wait_commits(0, [*c.relays[1:], *c.followers], t0, ctx.timeout())
        nursery.cancel_scope.cancel()
    ctx.extra["trigger_missed"] = ctx.extra.get("killed_at_shards") is None
    return res


async def sc_peer_restart(ctx: Ctx) -> dict[str, float | None]:
    c = ctx.cluster
    f = c.followers[0]
    t0 = c.publish(0, ctx.ckpt)
    others = [*c.relays, *c.followers[1:]]
    async with trio.open_nursery() as nursery:
        res_box: dict[str, dict[str, float | None]] = {}

        async def rest() -> None:
            res_box["r"] = await c.wait_commits(0, others, t0, ctx.timeout())

        nursery.start_soon(rest)
        hit = await wait_for(lambda: f.journaled(0) >= ctx.shards // 2, ctx.timeout())
        before = await received_bytes(f)
        journaled = f.journaled(0)
        await f.kill()
        journaled = max(journaled, f.journaled(0))  # lines written before the kill landed
        f.launch()
        await f.wait_ready()
        mine = await c.wait_commits(0, [f], t0, ctx.timeout())
        after = await received_bytes(f)
    res = {**res_box["r"], **mine}
    missing = ctx.s.size_bytes - journaled * ctx.s.shard_size
    ctx.extra.update(
        trigger_missed=not hit,
        journaled_shards_at_kill=journaled,
        received_before_kill_bytes=before,
        fetched_after_restart_bytes=after,
        not_journaled_bytes=missing,
    )
    if after is not None:
        refetched = max(0, after - missing)
        ctx.extra["refetched_bytes"] = refetched
        ctx.extra["refetch_bound_bytes"] = MAX_INFLIGHT * ctx.s.shard_size
    return res


async def sc_wipe(ctx: Ctx) -> dict[str, float | None]:
    async def fault(ctx: Ctx) -> None:
        f = ctx.cluster.followers[0]
        hit = await wait_for(lambda: f.journaled(0) >= ctx.shards // 4, ctx.timeout())
        ctx.extra["wiped_at_shards"] = f.journaled(0) if hit else None
        shutil.rmtree(f.data_dir, ignore_errors=True)
        ctx.extra["trigger_missed"] = not hit

    return await _broadcast(ctx, fault)


async def sc_plain_client(ctx: Ctx) -> dict[str, float | None]:
    codes: dict[str, int] = {}
    got = {"bytes": 0}

    async def client(ctx: Ctx) -> None:
        run = f"{ctx.cluster.origin.url}/shardnet/v1/{RUN_ID}"
        names = sorted(p.name for p in ctx.ckpt.iterdir())
        async with httpx.AsyncClient(timeout=60) as http:
            while True:  # a version is (step, digest): learn step 0's digest, then its manifest
                try:
                    digest = (await http.get(f"{run}/versions")).json()["digests"].get("0")
                    base = f"{run}/0/{digest}"
                    if digest and (await http.get(base + "/manifest")).status_code == 200:
                        break
                except (httpx.HTTPError, ValueError, KeyError):
                    pass
                await trio.sleep(0.01)
            pending = list(names)
            while pending:
                name = pending.pop(0)
                try:
                    r = await http.get(f"{base}/files/{name}")
                except httpx.HTTPError as e:
                    codes[type(e).__name__] = codes.get(type(e).__name__, 0) + 1
                    pending.append(name)
                    continue
                codes[str(r.status_code)] = codes.get(str(r.status_code), 0) + 1
                if r.status_code == 200:
                    got["bytes"] += len(r.content)
                else:
                    pending.append(name)
                    await trio.sleep(0.05)
        ctx.extra["client_done_s"] = round(time.perf_counter() - t_start, 3)

    t_start = time.perf_counter()
    res = await _broadcast(ctx, client)
    ctx.extra["client_status_codes"] = codes
    ctx.extra["client_bytes"] = got["bytes"]
    return res


async def sc_origin_kill(ctx: Ctx) -> dict[str, float | None]:
    c = ctx.cluster
    o = c.origin
    # the origin stages the version (hard links) and hashes it from there while serving it live
    staged = o.data_dir / "staging" / "step-0"
    committed = o.run_dir() / "step-0"
    t0 = c.publish(0, ctx.ckpt)
    hit = await wait_for(lambda: staged.exists() or committed.exists(), ctx.timeout(), 0.005)
    await trio.sleep(0.02)  # a small checkpoint is hashed in ~0.1-0.2 s: this may miss it
    ctx.extra["killed_while_hashing"] = hit and not committed.exists()
    ctx.extra["killed_at_s"] = round(time.perf_counter() - t0, 3)
    await o.kill()
    o.launch()
    await o.wait_ready()
    ctx.extra["restarted_after_s"] = round(time.perf_counter() - t0, 3)
    return await c.wait_commits(0, [*c.relays, *c.followers], t0, ctx.timeout())


async def sc_prune(ctx: Ctx) -> dict[str, float | None]:
    c = ctx.cluster
    f = c.followers[-1]
    last = 4
    versions = [ctx.ckpt] + [
        next_version(ctx.ckpt, c.root / "ckpts" / f"v{k}", seed=k) for k in range(1, last + 1)
    ]
    c.publish(0, versions[0])
    hit = await wait_for(lambda: f.journaled(0) >= ctx.shards // 4, ctx.timeout())
    f.signal(signal.SIGSTOP)
    ctx.extra["stopped_at_shards"] = f.journaled(0) if hit else None
    ctx.extra["trigger_missed"] = not hit
    for k in range(1, last + 1):
        tk = c.publish(k, versions[k])
        await c.wait_commits(k, c.relays, tk, ctx.timeout())
    ctx.extra["versions_published"] = last + 1
    ctx.extra["relay_steps_held"] = sorted(
        int(p.name.split("-")[1]) for p in c.relays[0].run_dir().glob("step-*")
    )
    t0 = time.perf_counter()
    f.signal(signal.SIGCONT)
    res = await c.wait_commits(last, [f], t0, ctx.timeout())
    res.update({n.name: 0.0 for n in (*c.relays, *c.followers[:-1])})  # committed before
    return res


def _log_count(c: Cluster, nodes: list[Node], needle: str) -> int:
    """Lines containing ``needle`` in the logs of ``nodes``."""
    total = 0
    for n in nodes:
        try:
            text = (c.logs / f"{n.name}.log").read_text(errors="replace")
        except OSError:
            continue
        total += sum(needle in line for line in text.splitlines())
    return total


async def _advertise_to(evil: Any, victims: list[Node], advert: bytes) -> None:
    """Gossip one correctly signed node advert from ``evil`` straight to each victim."""
    from p2p.hostile import MESHSUB
    from shardcast.download import nodes_topic

    rpc = evil.signed_publish(nodes_topic(RUN_ID), advert)

    async def one(v: Node) -> None:
        try:
            await evil.connect(v.addr)
            await evil.send(v.addr.rsplit("/p2p/", 1)[1], MESHSUB, rpc, wait_s=1)
        except Exception:  # refused or reset: the node decided
            pass

    async with trio.open_nursery() as nursery:
        for v in victims:
            nursery.start_soon(one, v)


async def _advert_round(
    victims: list[Node], lanes: list[tuple[Any, str]], sent: dict[str, int]
) -> None:
    """Each (identity, URL) in ``lanes`` advertises itself, at once, as a relay holding step 0
    at that URL to every victim (a fresh host per identity)."""
    from p2p.hostile import HostileClient
    from shardcast.download import NodeAdvert

    async def one(ident: Any, url: str) -> None:
        advert = NodeAdvert(ident.peer_id, "relay", url, (0,), (0,)).encode()
        async with HostileClient.open(ident) as evil:
            sent["adverts"] = sent.get("adverts", 0) + len(victims)
            await _advertise_to(evil, victims, advert)

    async with trio.open_nursery() as nursery:
        for ident, url in lanes:
            nursery.start_soon(one, ident, url)


async def _advert_rounds(
    victims: list[Node], lanes: list[tuple[Any, str]], sent: dict[str, int]
) -> None:
    """:func:`_advert_round` every 2 s until cancelled (the first one has been sent)."""
    while True:
        await trio.sleep(2.0)
        await _advert_round(victims, lanes, sent)


async def sc_fake_adverts(ctx: Ctx) -> dict[str, float | None]:
    """Fresh identities advertise lanes they do not hold: half the origin's (to steer the
    swarm's requests onto it), half a junk lane that answers anything with 200 and random
    bytes (its whoami answer proves nothing). No follower may use either."""
    from p2p.http_server import HttpRequest, HttpResponse, open_http_server
    from p2p.identity import Identity

    c = ctx.cluster
    served = {"requests": 0}

    async def junk(req: HttpRequest) -> HttpResponse:
        served["requests"] += 1
        return HttpResponse(200, (), os.urandom(64))

    sent: dict[str, int] = {}
    async with open_http_server(junk) as lane:
        idents = [Identity.generate() for _ in range(8)]
        lanes = [(ident, c.origin.url if k % 2 else lane.url) for k, ident in enumerate(idents)]
        victims = [*c.relays, *c.followers]
        await _advert_round(victims, lanes, sent)  # held before the version appears
        res = await _broadcast(ctx, lambda ctx: _advert_rounds(victims, lanes, sent))
    followers = [*c.relays, *c.followers]
    ctx.extra["adverts_sent"] = sent.get("adverts", 0)
    ctx.extra["junk_lane_requests"] = served["requests"]
    ctx.extra["adverts_unproven"] = _log_count(c, followers, "advert_unproven")
    fakes = {short_id_of(i.peer_id) for i, _ in lanes}
    ctx.extra["fake_sources_used"] = sum(
        _log_count(c, followers, f"source_added step=0 source={f}") for f in fakes
    )
    return res


def short_id_of(peer_id: str) -> str:
    from p2p.errors import short_id

    return short_id(peer_id)


async def sc_corrupting_relay(ctx: Ctx) -> dict[str, float | None]:
    """An attacker identity runs a lane that proves its PeerID (answers whoami) and serves the
    origin's bytes with one byte flipped in every shard or file range; it advertises itself as
    a relay holding step 0. Followers that use it must ban it at its first bad shard and still
    commit in time."""
    from p2p.http_server import HttpRequest, HttpResponse, open_http_server
    from p2p.identity import Identity
    from shardcast.wire import HOLD_HEADER, sign_whoami

    c = ctx.cluster
    ident = Identity.generate()
    stats = {"requests": 0, "corrupted": 0}
    box: dict[str, str] = {}

    async def relay(req: HttpRequest) -> HttpResponse:
        stats["requests"] += 1
        if req.path.startswith("/shardnet/v1/whoami/"):
            nonce = req.path.rsplit("/", 1)[1]
            return HttpResponse(200, (), sign_whoami(ident, nonce, box["url"]))
        fwd = {k: v for k, v in req.headers.items() if k in ("range", HOLD_HEADER)}
        try:
            r = await http.get(c.origin.url + req.path, headers=fwd)
        except httpx.HTTPError:
            return HttpResponse(503, [("retry-after", "1")])
        body = bytearray(r.content)
        if (
            body
            and r.status_code in (200, 206)
            and ("/files/" in req.path or "/shard/" in req.path)
        ):
            body[len(body) // 2] ^= 0x5A
            stats["corrupted"] += 1
        keep = ("content-range", "retry-after", "content-type")
        return HttpResponse(
            r.status_code, [(k, v) for k, v in r.headers.items() if k in keep], bytes(body)
        )

    sent: dict[str, int] = {}
    async with httpx.AsyncClient(timeout=60) as http, open_http_server(relay) as lane:
        box["url"] = lane.url
        victims = [*c.relays, *c.followers]
        await _advert_round(victims, [(ident, lane.url)], sent)
        res = await _broadcast(ctx, lambda ctx: _advert_rounds(victims, [(ident, lane.url)], sent))
    sid = short_id_of(ident.peer_id)
    ctx.extra["adverts_sent"] = sent.get("adverts", 0)
    ctx.extra["relay_requests"] = stats["requests"]
    ctx.extra["relay_corrupted_responses"] = stats["corrupted"]
    ctx.extra["nodes_that_used_it"] = sum(
        _log_count(c, [n], f"source_added step=0 source={sid}") > 0 for n in victims
    )
    ctx.extra["nodes_that_banned_it"] = sum(
        _log_count(c, [n], f"source_banned step=0 source={sid}") > 0 for n in victims
    )
    return res


SCENARIOS: dict[str, tuple[Scenario, dict[str, Any]]] = {
    "clean": (sc_clean, {}),
    "malformed": (sc_malformed, {}),
    "flood": (sc_flood, {}),
    "slots": (sc_slots, {}),
    "relay_kill": (sc_relay_kill, {}),
    "peer_restart": (sc_peer_restart, {}),
    "wipe": (sc_wipe, {}),
    "plain_client": (sc_plain_client, {}),
    "origin_kill": (sc_origin_kill, {}),
    "prune": (sc_prune, {"keep_last": 2}),
    "fake_adverts": (sc_fake_adverts, {}),
    "corrupting_relay": (sc_corrupting_relay, {}),
}


# ----------------------------------------------------------------------------- driver


async def run_scenario(
    name: str, root: Path, ckpt: Path, s: Settings, clean_s: float | None
) -> dict[str, Any]:
    fn, opts = SCENARIOS[name]
    cluster = Cluster(root / name, s, keep_last=opts.get("keep_last", 3))
    ctx = Ctx(cluster, ckpt, s, shards=s.size_bytes // s.shard_size)
    error = None
    commits: dict[str, float | None] = {}
    t_start = time.perf_counter()
    try:
        await cluster.start()
        commits = await fn(ctx)
    except Exception as e:  # a scenario that breaks is reported, the next one still runs
        error = f"{type(e).__name__}: {e}"
    unexpected = [n.name for n in cluster.nodes if not n.alive() and not n.killed_on_purpose]
    nodes: dict[str, Any] = {}
    for n in cluster.nodes:
        rss = n.rss()
        nodes[n.name] = {
            "alive": n.alive(),
            "starts": n.starts,
            "rss_mb": round(rss / MB, 1) if rss else None,
            "rss_growth_mb": round((rss - n.rss0) / MB, 1) if rss and n.rss0 else None,
        }
    await cluster.stop()
    for n in cluster.nodes:
        nodes[n.name]["exit_code"] = n.exit_code
        nodes[n.name]["tracebacks"] = n.tracebacks()
    crashed = sorted(
        set(unexpected)
        | {
            k
            for k, v in nodes.items()
            if not cluster_node(cluster, k).killed_on_purpose and v["exit_code"] not in (0, None)
        }
    )
    follower_times = [commits.get(f.name) for f in cluster.followers]
    last = None if any(t is None for t in follower_times) else max(follower_times)  # type: ignore[type-var]
    out: dict[str, Any] = {
        "scenario": name,
        "last_follower_commit_s": last,
        "commits_s": commits,
        "crashed": crashed,
        "nodes": nodes,
        "wall_s": round(time.perf_counter() - t_start, 1),
        **ctx.extra,
    }
    if error:
        out["error"] = error
    out["targets"] = judge(out, clean_s)
    out["meets_targets"] = all(v is not False for v in out["targets"].values()) and not error
    return out


def cluster_node(c: Cluster, name: str) -> Node:
    return next(n for n in c.nodes if n.name == name)


def judge(r: dict[str, Any], clean_s: float | None) -> dict[str, bool | None]:
    """The issue's targets for one scenario result (None: does not apply / cannot tell)."""
    t: dict[str, bool | None] = {"no_crash": not r["crashed"]}
    last = r["last_follower_commit_s"]
    if clean_s is not None:
        r["time_bound_s"] = round(1.5 * clean_s + 10, 3)
        t["time"] = last is not None and last <= r["time_bound_s"]
    else:
        t["time"] = last is not None
    growth = [v["rss_growth_mb"] for v in r["nodes"].values() if v["rss_growth_mb"] is not None]
    # the bound is for one version's broadcast (prune publishes several: reported, not judged)
    one_version = r.get("versions_published", 1) == 1
    t["rss"] = all(g < RSS_BOUND_MB for g in growth) if growth and one_version else None
    if "flood_rounds" in r:
        rounds = r["flood_rounds"]
        per_node = [g for g in rounds[-1]["rss_growth_mb"].values() if g is not None]
        t["rss_flat"] = all(g < FLOOD_FLAT_MB for g in per_node)
    if "refetched_bytes" in r:
        t["refetch"] = r["refetched_bytes"] <= r["refetch_bound_bytes"]
    return t


async def amain(args: argparse.Namespace, s: Settings) -> dict[str, Any]:
    names = [n for n in args.scenarios.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        raise SystemExit(
            f"unknown scenario(s): {', '.join(unknown)} (known: {', '.join(SCENARIOS)})"
        )
    if "clean" in names:
        names.remove("clean")
    names.insert(0, "clean")
    root = Path(tempfile.mkdtemp(prefix="shardnet-chaos-", dir=args.workdir))
    results: list[dict[str, Any]] = []
    try:
        ckpt = make_checkpoint(root / "ckpt", s)
        clean_s: float | None = None
        for name in names:
            print(f"# scenario {name}", file=sys.stderr, flush=True)
            r = await run_scenario(name, root, ckpt, s, clean_s)
            if name == "clean":
                clean_s = r["last_follower_commit_s"]
            results.append(r)
            print(
                f"#   last follower commit {r['last_follower_commit_s']} s, "
                f"crashed {r['crashed']}, meets targets {r['meets_targets']}"
                + (f", error {r['error']}" if "error" in r else ""),
                file=sys.stderr,
                flush=True,
            )
    finally:
        if args.keep:
            print(f"# kept: {root}", file=sys.stderr, flush=True)
        else:
            shutil.rmtree(root, ignore_errors=True)
    return {
        "settings": vars(s),
        "clean_s": clean_s,
        "scenarios": results,
        "all_meet_targets": all(r["meets_targets"] for r in results),
        "note": "single shared machine: timings are noisy",
    }


def print_table(out: dict[str, Any]) -> None:
    s = out["settings"]
    print(
        f"checkpoint {s['size_bytes'] / MB:.0f} MB, shard {s['shard_size'] / MB:.1f} MB, "
        f"{s['relays']} relays, {s['followers']} followers; clean {out['clean_s']} s"
    )
    print(
        f"{'scenario':<14}{'last s':>9}{'bound s':>9}{'crashed':>20}{'max rss +MB':>13}"
        f"{'refetch MB':>12}  targets"
    )
    for r in out["scenarios"]:
        growth = [v["rss_growth_mb"] for v in r["nodes"].values() if v["rss_growth_mb"]]
        ref = r.get("refetched_bytes")
        print(
            f"{r['scenario']:<14}{r['last_follower_commit_s']!s:>9}"
            f"{r.get('time_bound_s', '-')!s:>9}"
            f"{','.join(r['crashed']) or '-':>20}{max(growth, default=0):>13.1f}"
            f"{(f'{ref / MB:.1f}' if ref is not None else '-'):>12}  "
            + ("OK" if r["meets_targets"] else "FAIL")
            + " "
            + ",".join(k for k, v in r["targets"].items() if v is False)
            + (f" error={r['error']}" if "error" in r else "")
        )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true", help="64 MiB checkpoint, 1 MiB shards")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated")
    ap.add_argument("--size-bytes", type=int, default=None, help="checkpoint size")
    ap.add_argument("--shard-size", type=int, default=None, help="shard size, bytes")
    ap.add_argument("--timeout", type=float, default=None, help="per wait, seconds")
    ap.add_argument("--workdir", default=None, help="parent of the run directory")
    ap.add_argument("--out", default=None, help="also write the JSON report to this file")
    ap.add_argument("--keep", action="store_true", help="keep node data and logs")
    ap.add_argument("--log-level", default="WARNING", help="nodes' log level")
    args = ap.parse_args()
    logging.disable(logging.ERROR)  # the attackers' own libp2p hosts complain of resets
    s = Settings(log_level=args.log_level)
    if args.quick:
        s.size_bytes, s.files, s.shard_size, s.timeout_s = 64 << 20, 2, 1 << 20, 90.0
        s.flood_rounds, s.flood_messages = 3, 500
    if args.size_bytes:
        s.size_bytes = args.size_bytes
    if args.shard_size:
        s.shard_size = args.shard_size
    if args.timeout:
        s.timeout_s = args.timeout
    out = trio.run(amain, args, s)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1, default=str))
    if args.json:
        print(json.dumps(out, default=str))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
