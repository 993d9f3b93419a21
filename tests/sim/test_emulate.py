"""Emulation: namespaces are created and removed; real processes run and are always stopped.

Tests that create namespaces skip (with the reason) when not root or without ``ip netns``.
They only use addresses inside the namespaces they create.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from typing import Any

import pytest

from simulations import netns

REPO = Path(__file__).parents[2]
OK, WHY = netns.available()
needs_netns = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")

TINY = """
name = "tiny"
seed = 1
[checkpoint]
size_bytes = 2_097_152
shard_size_bytes = 262_144
[[nodes]]
name = "origin"
role = "origin"
up_mbps = 200
down_mbps = 200
[[nodes]]
name = "relay"
role = "relay"
upstreams = ["origin"]
up_mbps = 200
down_mbps = 200
[[nodes]]
name = "peer"
role = "peer"
count = 2
upstreams = ["relay"]
up_mbps = 100
down_mbps = 100
[emulation]
timeout_s = 120
"""


def _lab_namespaces(lab_id: str) -> list[str]:
    return [n for n in netns.namespaces() if n.startswith(f"{netns.PREFIX}{lab_id}-")]


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_netns
def test_lab_creates_and_removes_namespaces_and_processes() -> None:
    with netns.Lab() as lab:
        a = lab.add_node(0, 12.5e6, 12.5e6, 0.0, 0.0)
        lab.add_node(1, 1e6, 2e6, 0.005, 0.0)
        assert set(_lab_namespaces(lab.id)) == {lab.bridge, a.netns, f"sns-{lab.id}-1"}
        assert lab.registry.exists()
        child = subprocess.Popen(
            [*lab.exec_prefix(0), sys.executable, "-c", "import time; time.sleep(600)"]
        )
        lab.set_rate(1, 0.5)
        qdisc = subprocess.run(
            ["ip", "netns", "exec", a.netns, "tc", "qdisc", "show", "dev", "eth0"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert "tbf" in qdisc
    assert _lab_namespaces(lab.id) == []
    assert not lab.registry.exists()
    assert child.wait(timeout=10) in (-signal.SIGKILL, 0)  # 0: reaped elsewhere
    assert not _alive(child.pid)


@needs_netns
def test_cleanup_stale_removes_labs_of_dead_owners() -> None:
    scratch = Path(tempfile.mkdtemp(prefix="shardnet-emulate-"))  # the dead owner's data
    (scratch / "node0").mkdir()
    lab = netns.Lab(scratch=scratch)
    lab.__enter__()
    lab.add_node(0, 1e6, 1e6, 0.0, 0.0)
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(lab.registry.read_text())
    data["owner_pid"] = int(dead.stdout)
    lab.registry.write_text(json.dumps(data))
    assert lab.id in netns.cleanup_stale()
    assert _lab_namespaces(lab.id) == []
    assert not scratch.exists()  # a helper's trial: a SIGKILLed run left 2 GB behind


# the same lab on links so slow (0.5 Mb/s: ~40 s for the checkpoint) that a signal sent once the
# first node is up lands mid-run, however fast the machine
SLOW = TINY.replace("up_mbps = 100\ndown_mbps = 100", "up_mbps = 0.5\ndown_mbps = 0.5")


def _default_sigint() -> None:
    # A shell starts background jobs with SIGINT ignored, and Python keeps an ignored SIGINT
    # ignored: give the emulator the disposition an interactive user's Ctrl-C meets.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(tmp_path: Path, *extra: str, topology: str = TINY) -> subprocess.Popen[str]:
    topo = tmp_path / "tiny.toml"
    topo.write_text(topology)
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardnet.cli",
            "simulate",
            "emulate",
            str(topo),
            "--out",
            str(tmp_path / "report"),
            *extra,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_sigint,
    )


def _read_until(proc: subprocess.Popen[str], prefix: str) -> tuple[str, list[str]]:
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return line, seen
    raise AssertionError(f"no {prefix!r} line; output:\n{''.join(seen)}")


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_mid_run_removes_everything(tmp_path: Path, sig: signal.Signals) -> None:
    assert SLOW != TINY
    proc = _start(tmp_path, "--shaping", "netns", topology=SLOW)
    lab_line, _ = _read_until(proc, "emulate_lab_ready")
    lab_id = lab_line.split("id=")[1].strip()
    node_line, _ = _read_until(proc, "emulate_node_ready")  # a real node process is up
    pid = int(node_line.split("pid=")[1])
    assert _lab_namespaces(lab_id)
    proc.send_signal(sig)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, out  # 143 for SIGTERM, 130 for SIGINT
    assert _lab_namespaces(lab_id) == []
    assert not _alive(pid)


def _check_success(tmp_path: Path, proc: subprocess.Popen[str]) -> dict[str, Any]:
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    summary: dict[str, Any] = json.loads((tmp_path / "report" / "summary.json").read_text())
    peers = [n for n in summary["nodes"].values() if n["role"] == "peer"]
    assert len(peers) == 2
    for p in peers:
        v = p["versions"]["0"]
        assert v["commit_s"] is not None
        assert v["first_byte_s"] <= v["commit_s"]
        assert v["shards"] >= 1
        assert p["bytes_down"] >= summary["checkpoint"]["size_bytes"]
    assert summary["run"]["origin_egress_bytes"] >= summary["checkpoint"]["size_bytes"]
    for png in ("cdf.png", "bytes_per_tier.png", "timeline.png"):
        assert (tmp_path / "report" / png).stat().st_size > 1000
    return summary


@needs_netns
def test_emulation_success_then_clean(tmp_path: Path) -> None:
    before = set(netns.namespaces())
    proc = _start(tmp_path, "--shaping", "netns")
    summary = _check_success(tmp_path, proc)
    assert any("network namespaces" in n for n in summary["notes"])
    assert set(netns.namespaces()) == before


@needs_netns
def test_emulation_failure_then_clean(tmp_path: Path) -> None:
    before = set(netns.namespaces())
    proc = _start(tmp_path, "--shaping", "netns", "--timeout", "0.01")
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 1, out
    assert "not finished" in out
    assert set(netns.namespaces()) == before
    assert (tmp_path / "report" / "summary.json").exists()


@pytest.mark.slow
def test_emulation_transport_fallback(tmp_path: Path) -> None:
    proc = _start(tmp_path, "--shaping", "transport")
    summary = _check_success(tmp_path, proc)
    assert any("--upload-limit-bytes-per-s" in n for n in summary["notes"])


def test_logged_commit_reads_only_whole_new_lines(tmp_path: Path) -> None:
    """The run waits for a peer's version_downloaded line, not only its version directory
    (the directory appears first; a node stopped in between left the summary without a
    commit time)."""
    from simulations.emulate import _Proc, logged_commit

    p = _Proc(node=None, argv=[], dir=tmp_path)  # type: ignore[arg-type]
    log = tmp_path / "log.jsonl"
    assert not logged_commit(p, 0)  # no log yet
    rec = {"event": "version_downloaded", "step": 1}
    other = {"event": "download_started", "step": 2, "msg": "version_downloaded"}
    line = json.dumps(rec).encode()
    log.write_bytes(json.dumps(other).encode() + b"\nnot json version_downloaded\n" + line[:10])
    assert not logged_commit(p, 0)  # half a line is not read
    with log.open("ab") as f:
        f.write(line[10:] + b"\n")
    assert logged_commit(p, 1)
    assert logged_commit(p, 0)
    assert not logged_commit(p, 2)
    assert p.log_pos == log.stat().st_size


@pytest.mark.parametrize("window", [None, 0.0, 2.5])
def test_emulated_peers_never_super_seed_relays_use_the_models_window(
    tmp_path: Path, window: float | None
) -> None:
    """Emulated peers run ``shardnet relay`` (a download+re-serve follower) and must serve as a
    ``shardnet peer`` does, to every requester (``--serve-once-s 0``; with the relay's default
    window they refused their neighbours); relays get the model's ``relay_serve_once_s``, so
    model and emulation run the same rules (the default: ``shardnet relay``'s)."""
    from shardcast.serve import SUPER_SEED_S
    from simulations.emulate import EmulateOptions, Emulation, _Proc
    from simulations.topology import parse

    data = tomllib.loads(TINY)
    if window is not None:
        data["model"] = {"relay_serve_once_s": window}
    topo = parse(data)
    em = Emulation(topo, EmulateOptions(), tmp_path)
    addr = "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWExample"
    for n in topo.nodes:
        em.procs[n.index] = _Proc(n, [], tmp_path, ready={"multiaddrs": [addr]})

    def window_of(role: str) -> float:
        argv = em._argv(next(n for n in topo.nodes if n.role == role))
        return float(argv[argv.index("--serve-once-s") + 1])

    assert window_of("peer") == 0.0
    assert window_of("relay") == (SUPER_SEED_S if window is None else window)


def test_a_run_that_fails_to_set_up_undoes_its_signal_handler_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``run`` installs a SIGTERM handler and creates its temporary directory first: an error
    while the emulation is set up (here its constructor) must restore the handler and remove
    the directory, as an error during the run does."""
    from simulations import emulate
    from simulations.topology import TopologyError, parse

    def refuse(*args: object) -> None:
        raise TopologyError("checkpoint.size_bytes", "refused for the test")

    monkeypatch.setattr(emulate, "Emulation", refuse)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(TopologyError):
        emulate.run(parse(tomllib.loads(TINY)), emulate.EmulateOptions())
    assert signal.getsignal(signal.SIGTERM) is before
    assert list(tmp_path.iterdir()) == []
