"""``shardnet demo``: the whole loop on this machine, as separate OS processes on 127.0.0.1.

It creates a key per node, starts ``shardnet trainer`` (with its origin), 2 ``shardnet relay``
processes whose upstream is the trainer, and 3 ``shardnet peer`` processes that bootstrap from
both relays — the same entry points an operator runs on separate machines — waits for the
trainer to finish its steps, stops the relays and peers with SIGTERM, collects every node's
JSON report and prints a per-step table.

``ok`` is computed from the reports and from the files on disk, not from log text: every peer
reported every version committed with the trainer's manifest digest, the versions a peer still
keeps hash to the trainer's manifest, the trainer finished, and every rollout it trained on had
passed verification. The exit status is 0 only if ``ok``.
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
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import trio

from p2p.errors import LocalProtocolError, ShardnetError
from p2p.identity import Identity
from shardnet.roles import READY_PREFIX, write_json_atomic

log = logging.getLogger(__name__)

PRESETS: dict[str, dict[str, Any]] = {
    "tiny": {
        "steps": 10,
        "preset": "tiny",
        "n_prompts": 4,
        "group_size": 8,
        "max_new_tokens": 16,
        "shard_size": 256 * 1024,
        "max_shard_bytes": 1 << 20,
        "min_batches": 2,
        "lr": 3e-3,
        "keep_last": 3,
        "anchor_every": 10,
        "timeout_s": 900,
    },
    "real-1b": {
        "steps": 2,
        "preset": "real-1b",
        "n_prompts": 1,
        "group_size": 2,
        "max_new_tokens": 8,
        "shard_size": 32 << 20,
        "max_shard_bytes": 256 << 20,
        "min_batches": 3,
        "lr": 1e-5,
        "optimizer": "sgd",
        "async_level": 1,
        "keep_last": 2,
        "anchor_every": 10,
        "timeout_s": 1800,
    },
}
N_RELAYS = 2
N_PEERS = 3


@dataclass(frozen=True)
class DemoOptions:
    """What ``shardnet demo`` was asked to do (see the CLI help)."""

    model: str = "tiny"
    steps: int | None = None
    report: Path | None = None
    workdir: Path | None = None
    keep: bool = False
    timeout_s: float | None = None


class Child:
    """One node process: its command, log file and (once ready) its addresses."""

    def __init__(self, name: str, args: list[str], workdir: Path) -> None:
        self.name = name
        self.cmd = [sys.executable, "-m", "shardnet.cli", *args]
        self.log_path = workdir / "logs" / f"{name}.log"
        self.report_path = workdir / "reports" / f"{name}.json"
        self.proc: trio.Process | None = None
        self.ready: dict[str, Any] = {}

    async def start(self, nursery: trio.Nursery, timeout_s: float) -> dict[str, Any]:
        """Start the process and wait for its ready line.

        Raises:
            LocalProtocolError: it exited or did not become ready within ``timeout_s``.
        """
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logf = open(self.log_path, "wb")  # noqa: ASYNC230 - tiny, local, once per process
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        self.proc = await trio.lowlevel.open_process(
            self.cmd, stdout=subprocess.PIPE, stderr=logf, stdin=subprocess.DEVNULL, env=env
        )
        logf.close()
        assert self.proc.stdout is not None
        buf = b""
        try:
            with trio.fail_after(timeout_s):
                while b"\n" not in buf or not any(
                    ln.startswith(READY_PREFIX.encode()) for ln in buf.split(b"\n")
                ):
                    chunk = await self.proc.stdout.receive_some(65536)
                    if not chunk:
                        raise LocalProtocolError(
                            f"{self.name} exited before it was ready; see {self.log_path}"
                        )
                    buf += chunk
        except trio.TooSlowError as exc:
            raise LocalProtocolError(
                f"{self.name} not ready after {timeout_s}s; see {self.log_path}"
            ) from exc
        line = next(ln for ln in buf.split(b"\n") if ln.startswith(READY_PREFIX.encode()))
        self.ready = json.loads(line[len(READY_PREFIX) :])
        nursery.start_soon(self._drain)
        log.info(
            "node_started name=%s peer_id=%s pid=%d",
            self.name,
            self.ready["peer_id"],
            self.proc.pid,
        )
        return self.ready

    async def _drain(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        with open(self.log_path, "ab") as fh:  # noqa: ASYNC230 - local log file
            while chunk := await self.proc.stdout.receive_some(65536):
                fh.write(chunk)

    async def stop(self, grace_s: float = 30.0) -> int | None:
        """SIGTERM, wait up to ``grace_s``, then SIGKILL; returns the exit code."""
        if self.proc is None:
            return None
        if self.proc.returncode is None:
            self.proc.send_signal(signal.SIGTERM)
            with trio.move_on_after(grace_s):
                await self.proc.wait()
            if self.proc.returncode is None:
                log.warning("node_killed name=%s", self.name)
                self.proc.kill()
        with trio.CancelScope(shield=True):
            return await self.proc.wait()

    def report(self) -> dict[str, Any] | None:
        """The node's JSON report, if it wrote one."""
        try:
            return json.loads(self.report_path.read_text())  # type: ignore[no-any-return]
        except (OSError, ValueError):
            return None


def _common(name: str, workdir: Path, run_id: str, keep_last: int) -> list[str]:
    d = workdir / name
    return [
        "--data-dir",
        str(d),
        "--key",
        str(d / "node.key"),
        "--run-id",
        run_id,
        "--keep-last",
        str(keep_last),
        "--report",
        str(workdir / "reports" / f"{name}.json"),
        # every node of the demo is on this machine: loopback only, any free port
        "--listen",
        "/ip4/127.0.0.1/tcp/0",
        "--http-host",
        "127.0.0.1",
        "--http-port",
        "0",
    ]


def _sampling(p: dict[str, Any]) -> list[str]:
    """The run's sampling rules, given to the trainer (peers adopt them from its run card)."""
    return [
        "--n-prompts",
        str(p["n_prompts"]),
        "--group-size",
        str(p["group_size"]),
        "--max-new-tokens",
        str(p["max_new_tokens"]),
    ]


def _trainer_args(
    p: dict[str, Any], workdir: Path, run_id: str, steps: int, peer_ids: list[str]
) -> list[str]:
    """The trainer's command line: the preset's training settings, every peer allowed."""
    return [
        "trainer",
        *_common("trainer", workdir, run_id, p["keep_last"]),
        "--steps",
        str(steps),
        "--preset",
        p["preset"],
        "--lr",
        str(p["lr"]),
        "--optimizer",
        p.get("optimizer", "adamw"),
        "--async-level",
        str(p.get("async_level", 2)),
        *_sampling(p),
        "--min-batches",
        str(p["min_batches"]),
        "--shard-size-bytes",
        str(p["shard_size"]),
        "--max-shard-bytes",
        str(p["max_shard_bytes"]),
        "--anchor-every",
        str(p["anchor_every"]),
        *[a for i in peer_ids for a in ("--allow-peer", i, "--expect-peer", i)],
    ]


async def run_demo(opts: DemoOptions) -> int:
    """Run the demo; returns the exit code (0 if ``ok``)."""
    if opts.model not in PRESETS:
        raise LocalProtocolError(f"unknown --model {opts.model!r}; use {', '.join(PRESETS)}")
    p = dict(PRESETS[opts.model])
    steps = opts.steps if opts.steps is not None else p["steps"]
    timeout_s = opts.timeout_s if opts.timeout_s is not None else p["timeout_s"]
    workdir = opts.workdir or Path(tempfile.mkdtemp(prefix="shardnet-demo-"))
    workdir.mkdir(parents=True, exist_ok=True)
    run_id = f"demo-{opts.model}"
    t0 = time.monotonic()
    peers = [f"peer{i}" for i in range(1, N_PEERS + 1)]
    relays = [f"relay{i}" for i in range(1, N_RELAYS + 1)]
    ids = {
        name: Identity.load_or_create(workdir / name / "node.key").peer_id
        for name in ["trainer", *relays, *peers]
    }
    print(f"shardnet demo: model={opts.model} steps={steps} workdir={workdir}", flush=True)
    trainer = Child(
        "trainer", _trainer_args(p, workdir, run_id, steps, [ids[n] for n in peers]), workdir
    )
    children = [trainer]
    code = 1

    def common(name: str) -> list[str]:
        return _common(name, workdir, run_id, p["keep_last"])

    try:
        with trio.fail_after(timeout_s):
            trainer_code = await _run_nodes(
                children, relays, peers, ids["trainer"], common, workdir
            )
        if trainer_code is None:
            print("shardnet demo: interrupted; stopping every node", flush=True)
            return 130
        summary = summarize(
            workdir,
            trainer,
            [c for c in children if c.name in peers],
            [c for c in children if c.name in relays],
            steps,
            trainer_code,
            p["anchor_every"],
        )
        summary |= {
            "duration_s": round(time.monotonic() - t0, 1),
            "model": opts.model,
            "workdir": str(workdir),
        }
        print_table(summary)
        if opts.report is not None:
            write_json_atomic(opts.report, summary)
        code = 0 if summary["ok"] else 1
    except trio.TooSlowError:
        print(f"shardnet demo: timed out after {timeout_s}s; logs in {workdir}/logs", flush=True)
    except ShardnetError as exc:
        print(f"shardnet demo: {exc}", flush=True)
    finally:
        with trio.CancelScope(shield=True):
            for c in children:
                await c.stop(grace_s=10)
        if code != 0 or opts.keep or opts.workdir is not None:
            print(f"shardnet demo: work directory kept at {workdir}", flush=True)
        else:
            shutil.rmtree(workdir, ignore_errors=True)
    return code


async def _run_nodes(
    children: list[Child],
    relays: list[str],
    peers: list[str],
    trainer_id: str,
    common: Callable[[str], list[str]],
    workdir: Path,
) -> int | None:
    """Start the trainer (``children[0]``), then the relays one by one, then the peers in
    parallel (each appended to ``children``); wait for the trainer to exit and stop the rest.

    Returns:
        the trainer's exit code; None if SIGINT or SIGTERM interrupted the run.
    """
    trainer = children[0]
    interrupted = False
    trainer_code = None

    async def on_signal(scope: trio.CancelScope) -> None:
        nonlocal interrupted
        with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for _ in signals:
                interrupted = True
                scope.cancel()
                return

    async with trio.open_nursery() as nursery:
        nursery.start_soon(on_signal, nursery.cancel_scope)
        ready = await trainer.start(nursery, 300)
        origin = ready["multiaddrs"][0]
        relay_addrs = []
        for name in relays:
            args = ["relay", *common(name), "--upstream", origin, "--trainer-id", trainer_id]
            c = Child(name, args, workdir)
            children.append(c)
            relay_addrs.append((await c.start(nursery, 120))["multiaddrs"][0])
        for name in peers:
            args = ["peer", *common(name)]
            args += [a for r in relay_addrs for a in ("--bootstrap", r)]
            args += ["--trainer-id", trainer_id, "--trainer-addr", origin]
            children.append(Child(name, args, workdir))
        async with trio.open_nursery() as starting:  # peers start in parallel
            for c in children[1 + len(relays) :]:
                starting.start_soon(c.start, nursery, 300)
        assert trainer.proc is not None
        trainer_code = await trainer.proc.wait()
        for c in reversed(children[1:]):
            await c.stop()
        nursery.cancel_scope.cancel()
    return None if interrupted else trainer_code


def summarize(
    workdir: Path,
    trainer: Child,
    peers: list[Child],
    relays: list[Child],
    steps: int,
    trainer_code: int,
    anchor_every: int = 10,
) -> dict[str, Any]:
    """Merge the node reports into the demo report and compute ``ok``.

    Nodes are named as in the table (``trainer``, ``relay1``, ``peer1`` …) wherever the node
    reports give PeerIDs; ``peers`` maps each peer's name to its PeerID. Per step,
    ``samples_trained`` and ``samples_rejected`` are the table's columns; ``totals`` holds the
    run's sums and the validator's own counts, which the table's last line prints.
    """
    tr = trainer.report() or {}
    rows = tr.get("steps", [])
    digests = {r["step"]: r["manifest_digest"] for r in rows}
    problems: list[str] = []
    if trainer_code != 0 or not tr.get("finished"):
        problems.append(f"trainer exited with {trainer_code}")
    if sorted(digests) != list(range(steps + 1)):
        problems.append(f"trainer published {sorted(digests)}, expected 0..{steps}")
    peer_versions = _peer_versions(peers, digests, problems)
    trust_id = str(trainer.ready.get("peer_id"))
    for c in peers:
        problems += _check_on_disk(workdir / c.name / "versions", c.name, trust_id, digests)
    trained = tr.get("trained_samples", 0)
    if not trained or trained != tr.get("trained_verified_samples"):
        problems.append(f"trained {trained} samples, verified {tr.get('trained_verified_samples')}")
    for r in rows:
        if r.get("broadcast_s") is None:
            problems.append(f"version {r['step']} did not reach every peer")
    rewards = [r["mean_reward"] for r in rows if r.get("mean_reward") is not None]
    names = {str(c.ready.get("peer_id")): c.name for c in [trainer, *relays, *peers]}
    validator = tr.get("validator") or {}
    step_rows = [_step_row(r, names, anchor_every) for r in rows]
    return {
        "ok": not problems,
        "problems": problems,
        "anchor_every": anchor_every,
        "steps": step_rows,
        "totals": {
            "samples_trained": sum(r["samples_trained"] for r in step_rows),
            "samples_rejected": sum(r["samples_rejected"] for r in step_rows),
            "validator_accepted_samples": _total(validator.get("accepted_samples")),
            "validator_rejected_samples": _total(validator.get("rejected_samples")),
        },
        "peers": {
            c.name: {"peer_id": c.ready.get("peer_id"), "versions": peer_versions.get(c.name, {})}
            for c in peers
        },
        "relays": {c.name: c.report() for c in relays},
        "reward_first": rewards[0] if rewards else None,
        "reward_last": rewards[-1] if rewards else None,
        "trainer": {
            k: tr.get(k)
            for k in (
                "trainer",
                "validator",
                "inbox",
                "trained_samples",
                "trained_verified_samples",
                "origin_bytes_total",
            )
        }
        | {"reputation": _reputation(tr, names)},
    }


def _peer_versions(
    peers: list[Child], digests: dict[int, str], problems: list[str]
) -> dict[str, dict[int, str]]:
    """The versions each peer reports committed (step -> manifest digest); a peer without a
    report, or without a version the trainer published, adds to ``problems``."""
    peer_versions: dict[str, dict[int, str]] = {}
    for c in peers:
        rep = c.report()
        if rep is None:
            problems.append(f"{c.name} wrote no report")
            continue
        got = {v["step"]: v["manifest_digest"] for v in rep.get("versions", [])}
        peer_versions[c.name] = got
        for step, digest in digests.items():
            if got.get(step) != digest:
                problems.append(f"{c.name} did not commit version {step} with the trainer's digest")
    return peer_versions


def _check_on_disk(
    versions: Path, name: str, trainer_id: str, digests: dict[int, str]
) -> list[str]:
    """An independent check of what node ``name`` keeps on disk now: every kept version's
    manifest verifies, is the trainer's, and its files hash to it (a version kept as a chain,
    :mod:`shardcast.store.chains`: its chained files built shard by shard and each shard
    verified, through a read-only view of the store). Returns the problems."""
    from p2p.trust import TrustList
    from shardcast.serve import version_problems
    from shardcast.wire import MANIFEST_FILE, Manifest

    trust = TrustList(trainer=trainer_id)
    problems = []
    for run_dir in versions.iterdir():
        for step_dir in sorted(run_dir.glob("step-*")):
            step = int(step_dir.name[5:])
            try:
                m = Manifest.decode((step_dir / MANIFEST_FILE).read_bytes(), trust=trust)
            except (OSError, ShardnetError) as exc:
                problems.append(f"{name} step {step}: manifest does not verify: {exc}")
                continue
            if m.digest != digests.get(step):
                problems.append(f"{name} step {step}: manifest differs from the trainer's")
            problems += [f"{name} step {step}: {p}" for p in version_problems(step_dir, m)]
    return problems


def _reputation(tr: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """The trainer's reputation report with PeerIDs replaced by node names."""
    reputation = dict(tr.get("reputation") or {})
    if reputation:
        reputation["scores"] = {
            names.get(k, k): v for k, v in (reputation.get("scores") or {}).items()
        }
        reputation["refused"] = [names.get(k, k) for k in reputation.get("refused") or []]
    return reputation


def _step_row(r: dict[str, Any], names: dict[str, str], anchor_every: int) -> dict[str, Any]:
    """One row of the demo's table, from the trainer's report of one step."""
    return {
        "step": r.get("step"),
        "kind": "anchor" if r.get("step", 0) % anchor_every == 0 else "delta",
        "broadcast_s": r.get("broadcast_s"),
        "origin_bytes": r.get("origin_bytes"),
        "size_bytes": r.get("size_bytes"),
        "peers_committed": sorted(names.get(p, p) for p in r.get("peers_committed") or []),
        "samples_trained": r.get("rollouts_accepted") or 0,
        "samples_rejected": r.get("rollouts_rejected") or 0,
        "rejected_by_reason": r.get("rejected_by_reason") or {},
        "mean_reward": r.get("mean_reward"),
        "policy_steps_used": r.get("policy_steps_used"),
    }


def _total(v: Any) -> int:
    """A count that a report gives as a number or as counts by reason."""
    if isinstance(v, dict):
        return sum(int(x) for x in v.values())
    return int(v or 0)


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(summary: dict[str, Any]) -> None:
    """Print the per-step table, what its columns mean, and the run's totals."""
    from rich.console import Console
    from rich.table import Table

    n_peers = len(summary["peers"])
    table = Table(title=f"shardnet demo ({summary['model']}): ok={summary['ok']}")
    for col in (
        "step",
        "kind",
        "broadcast s",
        "origin bytes",
        "peers with version",
        "samples trained",
        "samples rejected",
        "mean reward",
        "trained on",
    ):
        table.add_column(col, justify="right")
    for r in summary["steps"]:
        have = r["peers_committed"] or []
        reasons = ",".join(f"{k}:{v}" for k, v in sorted((r["rejected_by_reason"] or {}).items()))
        table.add_row(
            str(r["step"]),
            r["kind"],
            _fmt(r["broadcast_s"], ".2f"),
            f"{r['origin_bytes'] or 0:,}",
            f"{len(have)}/{n_peers} ({','.join(have)})",
            str(r["samples_trained"]),
            f"{r['samples_rejected']}" + (f" ({reasons})" if reasons else ""),
            _fmt(r["mean_reward"], ".3f"),
            ",".join(map(str, r["policy_steps_used"] or [])) or "-",
        )
    console = Console(width=140)
    console.print(table)
    console.print(
        f"kind: anchor = a full version (step 0 and every {summary.get('anchor_every')}th step), "
        "which a node that missed versions can load without the chain of deltas; delta = "
        "the changes against the previous version (sparse patches or xor-zstd, whichever is "
        "smaller per shard), so fewer origin bytes. "
        "origin bytes: bytes the trainer's origin sent for that version. "
        "trained on: the policy steps that generated the samples trained at that step."
    )
    for p in summary["problems"]:
        console.print(f"[red]problem:[/red] {p}")
    t = summary.get("totals", {})
    console.print(
        f"duration {_fmt(summary.get('duration_s'), '.1f')} s; samples trained "
        f"{t.get('samples_trained', 0)} (validator accepted "
        f"{t.get('validator_accepted_samples', 0)}), rejected {t.get('samples_rejected', 0)}; "
        f"mean reward first {_fmt(summary['reward_first'], '.3f')} -> last "
        f"{_fmt(summary['reward_last'], '.3f')}"
    )
