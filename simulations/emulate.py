"""Emulation: the real node processes of a topology on this machine, on shaped links.

Theory of operation
-------------------
:func:`run` starts one real process per node with the CLI an operator uses: ``shardnet origin
--watch`` for the origin, ``shardnet relay`` for relays, and for peers ``shardnet relay``
processes whose upstreams are their relays — the download-and-re-serve half of ``shardnet
peer`` (the same :class:`~shardcast.download.follower.Follower`), without an inference engine, since
the checkpoint is synthetic bytes (rollouts are therefore not emulated; the model covers
them). As root, each node runs in its own network namespace (:mod:`simulations.netns`) with its
uplink and downlink shaped by ``tc``; otherwise every node listens on 127.0.0.1 and only its
upload is shaped, inside the transport (``--upload-limit-bytes-per-s``), and the report says so.

The checkpoint (``size_bytes * scale``; a ``config.json`` and one ``model.safetensors`` of
seeded random bytes, each later version changing ``delta_ratio`` of its 4 KiB blocks) is
written before the clock starts; version k is handed to the origin (its ``DONE`` marker) at
``k * interval_s``. Events fire at their times: ``leave`` sends SIGTERM, ``join`` starts the
process, ``slow`` changes the node's ``tbf`` rates.

Timelines come from what the nodes expose: JSON logs (``--log-json --log-level DEBUG``:
``version_announced``, ``first_byte``, ``shard_verified``, ``version_downloaded``, each with a
wall-clock ISO 8601 ``ts``) and ``--report`` files (bytes per source, HTTP bytes sent). The run ends
when every live honest peer committed the last version, on timeout, or on SIGINT/SIGTERM;
whatever the end, every process is stopped and every namespace removed (``finally``), and a
report is written from what was collected.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from p2p.errors import ConfigError
from simulations import netns
from simulations.progress import SimProgress, Snapshot
from simulations.summary import finish, progress_bands
from simulations.topology import Node, Topology, TopologyError, scaled

log = logging.getLogger(__name__)

RUN_ID = "sim"
LAB_READY = "emulate_lab_ready"
LOG_SETTLE_S = 10.0  # longest wait, seconds, for a committed node's version_downloaded line


class EmulationFailed(RuntimeError):
    """The emulation did not finish (timeout, a node that would not start)."""


@dataclass(frozen=True)
class EmulateOptions:
    """Options of one emulation run.

    Raises:
        ConfigError: ``timeout_s`` given and not > 0 (named ``timeout``, the CLI's option; a
            ``scale`` not > 0 is refused by :func:`~simulations.topology.scaled` when
            :func:`run` builds the emulation, before any node starts).

    Attributes:
        scale: checkpoint size factor (None: the topology's ``[emulation] scale``).
        timeout_s: give up after this long, seconds (None: the topology's).
        shaping: ``auto`` (namespaces if possible), ``netns`` (required) or ``transport``.
        workdir: keep keys, data and logs here (default: a temporary directory, removed).
        start_timeout_s: longest wait for one node to print its ready record, seconds.
    """

    scale: float | None = None
    timeout_s: float | None = None
    shaping: str = "auto"
    workdir: Path | None = None
    start_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ConfigError("timeout", f"must be > 0, not {self.timeout_s:g}")


@dataclass
class _Proc:
    node: Node
    argv: list[str]
    dir: Path
    popen: subprocess.Popen[bytes] | None = None
    ready: dict[str, Any] = field(default_factory=dict)
    log_pos: int = 0  # bytes of log.jsonl already read for commit lines
    logged_step: int = -1  # highest step the node's log says it committed


class Interrupted(KeyboardInterrupt):
    """SIGTERM during an emulation, unwinding through its cleanup like Ctrl-C does;
    ``signum`` is the signal's number (the CLI exits with 128 + it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum}")
        self.signum = signum


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise Interrupted(signum)


def logged_commit(p: _Proc, step: int) -> bool:
    """True once ``p``'s log holds its ``version_downloaded`` line for ``step`` or later.

    The version directory appears (atomic rename) a moment before the node logs the
    commit; the summary takes its times from the log, so the run waits for the line.
    Reads only the complete lines appended since the last call.
    """
    if p.logged_step >= step:
        return True
    path = p.dir / "log.jsonl"
    try:
        with path.open("rb") as f:
            f.seek(p.log_pos)
            data = f.read()
    except OSError:
        return False
    end = data.rfind(b"\n") + 1
    p.log_pos += end
    for line in data[:end].splitlines():
        if b"version_downloaded" not in line:
            continue
        try:
            rec = json.loads(line)
            if rec.get("event") == "version_downloaded":
                p.logged_step = max(p.logged_step, int(rec["step"]))
        except (ValueError, TypeError, KeyError):
            continue
    return p.logged_step >= step


def write_checkpoints(root: Path, size: int, versions: int, delta_ratio: float, seed: int) -> None:
    """``root/step-k/`` (config.json + model.safetensors) for k < versions; seeded bytes."""
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=size, dtype=np.uint8)
    blocks = max(1, size // 4096)
    for k in range(versions):
        if k:
            if delta_ratio >= 1:
                data = rng.integers(0, 256, size=size, dtype=np.uint8)
            else:
                pick = rng.choice(blocks, size=max(1, int(blocks * delta_ratio)), replace=False)
                for b in pick:
                    data[b * 4096 : (b + 1) * 4096] = rng.integers(0, 256, 4096, dtype=np.uint8)
        d = root / f"step-{k}"
        d.mkdir(parents=True)
        (d / "config.json").write_text(json.dumps({"model_type": "synthetic", "step": k}))
        data.tofile(d / "model.safetensors")


class Emulation:
    """One emulation run (see module docstring); use :func:`run`."""

    def __init__(self, topo: Topology, opts: EmulateOptions, workdir: Path) -> None:
        self.scale = opts.scale if opts.scale is not None else topo.spec.emulation.scale
        self.topo = scaled(topo, self.scale)
        self.opts = opts
        self.timeout_s = (
            opts.timeout_s if opts.timeout_s is not None else topo.spec.emulation.timeout_s
        )
        self.wd = workdir
        self.procs: dict[int, _Proc] = {}
        self.lab: netns.Lab | None = None
        self.notes: list[str] = []
        self.t0 = 0.0
        self.published: dict[int, float] = {}
        self.failure: str | None = None
        self.trainer_id = ""

    # -- processes ----------------------------------------------------------------------------

    def _addr(self, n: Node) -> tuple[str, int, int]:
        if self.lab is None:
            return "127.0.0.1", 0, 0
        return self.lab.ports[n.index].ip, 4001, 8000

    def _argv(self, n: Node) -> list[str]:
        from p2p.identity import Identity

        d = self.wd / n.name
        Identity.load_or_create(d / "node.key")  # as `shardnet keygen` would: --key must exist
        ip, p2p_port, http_port = self._addr(n)
        ms = self.topo.spec.model
        common = [
            "--run-id",
            RUN_ID,
            "--data-dir",
            str(d / "data"),
            "--key",
            str(d / "node.key"),
            "--listen",
            f"/ip4/{ip}/tcp/{p2p_port}",
            "--http-host",
            ip,
            "--http-port",
            str(http_port),
            "--keep-last",
            str(ms.keep_last),
            "--report",
            str(d / "report.json"),
            "--ready-file",
            str(d / "ready.json"),
            "--log-json",
            "--log-level",
            "DEBUG",
        ]
        if self.lab is None:
            common += ["--upload-limit-bytes-per-s", str(n.up_bps)]
        ck = self.topo.spec.checkpoint
        if n.role == "origin":
            role = [
                "origin",
                "--watch",
                str(self.wd / "publish"),
                "--shard-size-bytes",
                str(ck.shard_size_bytes),
                "--shards-per-part",
                str(ck.shards_per_part),
                "--anchor-every",
                str(ck.anchor_every),
                "--deltas" if self.topo.spec.delta_ratio < 1 else "--no-deltas",
            ]
            if ms.serve_once_s is not None:
                role += ["--serve-once-s", str(ms.serve_once_s)]
        else:
            ups = []
            for u in n.upstreams:
                ups += ["--upstream", self.procs[self.topo.index(u)].ready["multiaddrs"][0]]
            # peers stand in as download+re-serve relays; like `shardnet peer` they never
            # super-seed, and relays use the model's window (0: off), as the model does
            once = ms.relay_serve_once_s if n.role == "relay" else 0.0
            role = ["relay", *ups, "--trainer-id", self.trainer_id, "--serve-once-s", f"{once:g}"]
        prefix = self.lab.exec_prefix(n.index) if self.lab is not None else []
        return [*prefix, sys.executable, "-m", "shardnet.cli", *role, *common]

    def _start(self, n: Node) -> _Proc:
        d = self.wd / n.name
        d.mkdir(parents=True, exist_ok=True)
        (d / "ready.json").unlink(missing_ok=True)
        p = _Proc(n, self._argv(n), d)
        with open(d / "stdout.log", "ab") as out, open(d / "log.jsonl", "ab") as err:
            p.popen = subprocess.Popen(
                p.argv,
                stdout=out,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a terminal's Ctrl-C reaches us only; we stop them
                env={**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"},
            )
        self.procs[n.index] = p
        return p

    def _wait_ready(self, procs: list[_Proc]) -> None:
        deadline = time.monotonic() + self.opts.start_timeout_s
        for p in procs:
            ready = p.dir / "ready.json"
            while not ready.exists():
                assert p.popen is not None
                if p.popen.poll() is not None:
                    raise EmulationFailed(
                        f"{p.node.name} exited ({p.popen.returncode}); see {p.dir / 'log.jsonl'}"
                    )
                if time.monotonic() > deadline:
                    raise EmulationFailed(f"{p.node.name} not ready in time")
                time.sleep(0.05)
            p.ready = json.loads(ready.read_text())
            assert p.popen is not None
            print(f"emulate_node_ready name={p.node.name} pid={p.popen.pid}", flush=True)

    def stop_all(self) -> None:
        """SIGTERM every live process (they write their reports), then SIGKILL stragglers."""
        live = [p.popen for p in self.procs.values() if p.popen and p.popen.poll() is None]
        for po in live:
            po.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        for po in live:
            try:
                po.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                po.kill()
                po.wait()

    # -- the run ------------------------------------------------------------------------------

    def start(self) -> None:
        """Create the lab (or choose transport shaping), the checkpoints and the processes."""
        self._shape_links()
        if self.topo.links:
            self.notes.append("[[links]] overrides are not emulated (model only)")
        if any(n.behavior != "honest" for n in self.topo.nodes):
            raise TopologyError(
                "nodes.behavior",
                "emulation runs honest nodes only; use `shardnet simulate model` for adversaries",
            )
        if any(n.natted for n in self.topo.nodes):
            raise TopologyError(
                "nodes.nat",
                "emulation runs public nodes only; use `shardnet simulate model` for NATs "
                "(tests/deploy/test_nat.py runs the real node behind NATs)",
            )
        self.notes.append(
            "peers run as download+re-serve followers (no inference; serving every requester, "
            "as shardnet peer does): rollouts are modelled only"
        )
        ck = self.topo.spec.checkpoint
        write_checkpoints(
            self.wd / "src",
            ck.size_bytes,
            ck.versions,
            self.topo.spec.delta_ratio,
            self.topo.spec.seed,
        )
        (self.wd / "publish").mkdir()
        from p2p.identity import Identity

        origin = self.topo.origin
        (self.wd / origin.name).mkdir(parents=True)
        self.trainer_id = Identity.load_or_create(self.wd / origin.name / "node.key").peer_id
        self._start_tiers()

    def _shape_links(self) -> None:
        """Build the network-namespace lab with each node's rates, latency and loss, or (no
        namespaces, or ``shaping="transport"``) note that uploads are shaped in the transport.

        Raises:
            EmulationFailed: ``shaping="netns"`` and namespaces are unavailable.
        """
        ok, why = netns.available() if self.opts.shaping != "transport" else (False, "asked")
        if self.opts.shaping == "netns" and not ok:
            raise EmulationFailed(f"network namespaces unavailable: {why}")
        if ok:
            # a scratch directory of ours is removed by `simulate cleanup` if we are killed
            self.lab = netns.Lab(scratch=self.wd if self.opts.workdir is None else None)
            self.lab.__enter__()
            for n in self.topo.nodes:
                self.lab.add_node(n.index, n.up_bps, n.down_bps, n.latency_s, n.loss)
            self.notes.append(f"links: network namespaces + tc (lab {self.lab.id})")
            if not self.lab.netem:
                self.notes.append(
                    "kernel has no sch_netem: rates shaped (tbf); latency and loss NOT emulated"
                )
            print(f"{LAB_READY} id={self.lab.id}", flush=True)
        else:
            self.notes.append(
                f"no namespaces ({why}): uploads shaped in the transport "
                "(--upload-limit-bytes-per-s); downlinks, latency and loss NOT emulated"
            )
            print(f"{LAB_READY} id=none", flush=True)

    def _start_tiers(self) -> None:
        """Start every node not waiting for a join event, tier by tier: a node starts once
        all its upstreams are ready.

        Raises:
            EmulationFailed: some nodes' upstreams never start.
        """
        offline = {
            e.node
            for e in self.topo.events
            if e.action == "join" and next(x for x in self.topo.events if x.node == e.node) is e
        }
        started: set[str] = set()
        pending = [n for n in self.topo.nodes if n.index not in offline]
        while pending:
            tier = [n for n in pending if all(u in started for u in n.upstreams)]
            if not tier:
                raise EmulationFailed("upstreams of the remaining nodes never start")
            self._wait_ready([self._start(n) for n in tier])
            started |= {n.name for n in tier}
            pending = [n for n in pending if n.name not in started]

    def _publish(self, k: int) -> None:
        src, dst = self.wd / "src" / f"step-{k}", self.wd / "publish" / f"step-{k}"
        dst.mkdir()
        for f in src.iterdir():
            os.link(f, dst / f.name)
        self.published[k] = time.time()
        (dst / "DONE").touch()

    def _event(self, node: int, action: str, factor: float) -> None:
        n = self.topo.nodes[node]
        p = self.procs.get(node)
        if action == "leave" and p and p.popen and p.popen.poll() is None:
            p.popen.send_signal(signal.SIGTERM)
        elif action == "join" and (p is None or (p.popen and p.popen.poll() is not None)):
            self._wait_ready([self._start(n)])
        elif action == "slow":
            if self.lab is not None:
                self.lab.set_rate(node, factor)
            else:
                self.notes.append(f"slow event on {n.name} ignored (transport shaping)")

    def _committed(self, n: Node, step: int) -> bool:
        run_dir = self.wd / n.name / "data" / "versions" / RUN_ID
        if not run_dir.is_dir():
            return False
        return any(int(d.name[5:]) >= step for d in run_dir.glob("step-*") if d.name[5:].isdigit())

    def snapshot(self) -> Snapshot:
        """Where the run stands: seconds since the clock started, versions, peers at latest."""
        latest = max(self.published) if self.published else -1
        peers = [
            p
            for p in self.procs.values()
            if p.node.role == "peer" and p.popen is not None and p.popen.poll() is None
        ]
        at = sum(1 for p in peers if latest >= 0 and self._committed(p.node, latest))
        return Snapshot(
            time.time() - self.t0,
            len(self.published),
            self.topo.spec.checkpoint.versions,
            latest,
            at,
            len(peers),
        )

    def loop(self, progress: SimProgress | None = None) -> None:
        """Publish, fire events, and wait for every live honest peer to commit the last one.

        ``progress`` (optional) is shown a :meth:`snapshot` whenever it is due.
        """
        ck = self.topo.spec.checkpoint
        self.t0 = time.time()
        todo = sorted(
            [(k * ck.interval_s, 0, k, "publish", 1.0) for k in range(ck.versions)]
            + [(e.at_s, 1, e.node, e.action, e.factor) for e in self.topo.events]
        )
        last = ck.versions - 1
        settle_until: float | None = None  # bounded wait for the peers' commit log lines
        while True:
            now = time.time() - self.t0
            while todo and todo[0][0] <= now:
                _, kind, x, action, factor = todo.pop(0)
                if kind == 0:
                    self._publish(x)
                else:
                    self._event(x, action, factor)
            if not todo and last in self.published:
                peers = [
                    p
                    for p in self.procs.values()
                    if p.node.role == "peer" and p.popen is not None and p.popen.poll() is None
                ]
                if all(self._committed(p.node, last) for p in peers):
                    settle_until = settle_until or time.monotonic() + LOG_SETTLE_S
                    if all(logged_commit(p, last) for p in peers):
                        return
                    if time.monotonic() > settle_until:
                        return  # a node killed between commit and log line: summary shows None
            if progress is not None and progress.due():
                progress.update(self.snapshot())
            if now > self.timeout_s:
                raise EmulationFailed(f"not finished after {self.timeout_s:.0f} s")
            time.sleep(0.1)

    # -- results ------------------------------------------------------------------------------

    def summary(self) -> dict[str, Any]:
        """The run summary (see :mod:`simulations.summary`) from logs and reports."""
        ck = self.topo.spec.checkpoint
        nodes: dict[str, Any] = {}
        shard_times: list[list[float]] = []
        ids: dict[str, str] = {}
        reports: dict[str, dict[str, Any]] = {}
        for p in self.procs.values():
            rp = p.dir / "report.json"
            reports[p.node.name] = json.loads(rp.read_text()) if rp.exists() else {}
            ids[p.node.name] = p.ready.get("peer_id", "")
        origin_id = ids.get(self.topo.origin.name, self.trainer_id)
        origin_up = 0
        for n in self.topo.nodes:
            rep = reports.get(n.name, {})
            down = sum(sum(v.get("bytes_by_source", {}).values()) for v in rep.get("versions", []))
            origin_up += sum(
                v.get("bytes_by_source", {}).get(origin_id, 0) for v in rep.get("versions", [])
            )
            versions = self._timeline(n, shard_times)
            nodes[n.name] = {
                "role": n.role,
                "group": n.group,
                "behavior": n.behavior,
                "up_bps": n.up_bps,
                "down_bps": n.down_bps,
                "bytes_up": rep.get("http", {}).get("bytes_sent", 0),
                "bytes_down": down,
                "versions": versions,
            }
        nodes[self.topo.origin.name]["bytes_up"] = origin_up
        summary: dict[str, Any] = {
            "mode": "emulate",
            "topology": self.topo.name,
            "source": str(self.topo.source) if self.topo.source else None,
            "seed": self.topo.spec.seed,
            "notes": self.notes,
            "checkpoint": {
                "size_bytes": ck.size_bytes,
                "shard_size_bytes": ck.shard_size_bytes,
                "n_shards": -(-ck.size_bytes // ck.shard_size_bytes),
                "versions": ck.versions,
                "scale": self.scale,
            },
            "run": {
                "rollouts": {"sent": 0, "accepted": 0, "rejected": 0},
                "wall_s": round(time.time() - self.t0, 3) if self.t0 else 0.0,
                "failure": self.failure,
            },
            "nodes": nodes,
            "progress": progress_bands(
                shard_times,
                self.published[0] - self.t0 if 0 in self.published else 0.0,
                -(-ck.size_bytes // ck.shard_size_bytes),
            ),
        }
        return finish(summary, self.topo)

    def _timeline(self, n: Node, shard_times: list[list[float]]) -> dict[str, Any]:
        """Node ``n``'s per-version times from its JSON log; a peer's version-0 shard times
        (seconds from the clock's start) are appended to ``shard_times``."""
        versions: dict[str, Any] = {}
        path = self.wd / n.name / "log.jsonl"
        shards: dict[int, list[float]] = {}
        if path.exists():
            for line in path.read_text(errors="replace").splitlines():
                if not line.startswith("{"):
                    continue
                try:
                    rec = json.loads(line)
                    step = int(rec.get("step", -1))
                except (ValueError, TypeError):
                    continue
                if step < 0:
                    continue
                t = datetime.fromisoformat(rec["ts"]).timestamp() - self.t0
                v = versions.setdefault(
                    str(step), {"learned_s": None, "first_byte_s": None, "commit_s": None}
                )
                ev = rec.get("event")
                if ev == "version_announced" and v["learned_s"] is None:
                    v["learned_s"] = round(t, 3)
                elif ev == "first_byte" and v["first_byte_s"] is None:
                    v["first_byte_s"] = round(t, 3)
                elif ev == "shard_verified":
                    shards.setdefault(step, []).append(t)
                elif ev == "version_downloaded":
                    v["commit_s"] = round(t, 3)
        for key, v in versions.items():
            pub = self.published.get(int(key))
            v["published_s"] = None if pub is None else round(pub - self.t0, 3)
            c = v["commit_s"]
            v["duration_s"] = None if c is None or pub is None else round(c - (pub - self.t0), 3)
            v["shards"] = len(shards.get(int(key), []))
        if n.role == "peer" and 0 in shards:
            shard_times.append(shards[0])
        return versions


def run(
    topo: Topology, opts: EmulateOptions, progress: SimProgress | None = None
) -> dict[str, Any]:
    """Run one emulation and return its summary; cleans up whatever happens.

    ``progress`` (optional) is shown where the run stands while it waits for the peers.

    SIGTERM is turned into KeyboardInterrupt for the duration, so Ctrl-C and SIGTERM both
    unwind through the cleanup; the summary (with ``run.failure`` set) is returned for a
    timeout or a node that failed, and KeyboardInterrupt is re-raised after cleanup.

    Raises:
        TopologyError: the topology cannot be emulated (adversaries, NATs).
        EmulationFailed: namespaces required but unavailable.
    """
    old = signal.signal(signal.SIGTERM, _raise_interrupt)
    tmp = opts.workdir is None
    wd: Path | None = None
    em: Emulation | None = None
    try:  # everything after the handler, so that whatever raises undoes what was done
        wd = Path(tempfile.mkdtemp(prefix="shardnet-emulate-")) if tmp else opts.workdir
        assert wd is not None
        wd.mkdir(parents=True, exist_ok=True)
        em = Emulation(topo, opts, wd)
        netns.cleanup_stale()
        try:
            em.start()
            em.loop(progress)
        except EmulationFailed as exc:
            em.failure = str(exc)
            log.error("emulation_failed error=%s", exc)
        em.stop_all()
        return em.summary()
    finally:
        try:
            if em is not None:
                em.stop_all()
        finally:
            if em is not None and em.lab is not None:
                em.lab.teardown()
            signal.signal(signal.SIGTERM, old)
            if tmp and wd is not None:
                shutil.rmtree(wd, ignore_errors=True)
