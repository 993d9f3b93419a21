"""Every role: ready line with advertised addresses, exit 0 on SIGINT/SIGTERM (real processes)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from p2p.identity import Identity

TRAINER_ID = Identity.from_seed("exit-codes-trainer").peer_id
LOOPBACK = ["--listen", "/ip4/127.0.0.1/tcp/0", "--http-host", "127.0.0.1", "--http-port", "0"]


def _argv(role: str, tmp: Path) -> list[str]:
    # with --run-id a relay listens at once (without, it first fetches the run card upstream)
    common = ["--data-dir", str(tmp / role), "--run-id", "exit-codes", *LOOPBACK]
    if role == "relay":
        # the upstream is never reachable: the relay must still start, report and stop cleanly
        up = f"/ip4/127.0.0.1/tcp/9/p2p/{TRAINER_ID}"
        return ["relay", "--upstream", up, "--trainer-id", TRAINER_ID, *common]
    return ["origin", "--watch", str(tmp / "watch"), *common]


def _start(argv: list[str], stdout: int) -> subprocess.Popen[str]:
    """A CLI node; a user's Ctrl-C meets the default SIGINT disposition (background shells
    start jobs with SIGINT ignored)."""
    return subprocess.Popen(
        [sys.executable, "-m", "shardnet.cli", *argv],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def _signal_and_reap(proc: subprocess.Popen[str], sig: signal.Signals) -> str:
    """Send ``sig``, wait for the exit (kill after 30 s); returns stderr."""
    try:
        os.kill(proc.pid, sig)
        _, err = proc.communicate(timeout=30)
        return str(err)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("role", ["relay", "origin"])
def test_role_stops_cleanly_with_exit_0(tmp_path: Path, role: str, sig: signal.Signals) -> None:
    proc = _start(_argv(role, tmp_path), subprocess.PIPE)
    try:
        assert proc.stdout is not None
        ready_now, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready_now, "no ready line within 60 s"
        line = proc.stdout.readline()  # the node is ready (or exited)
        assert line.startswith("shardnet-ready "), (line, proc.stderr.read() if proc.stderr else "")
        ready = json.loads(line.split(" ", 1)[1])
        assert ready["role"] == role
        assert ready["listen"][0].startswith("/ip4/127.0.0.1/tcp/")
        assert ready["multiaddrs"][0].startswith("/ip4/127.0.0.1/tcp/")
        assert ready["http_url"].startswith("http://127.0.0.1:")
    finally:
        err = _signal_and_reap(proc, sig)
    assert proc.returncode == 0, err
    assert "Traceback" not in err


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.parametrize("role", ["relay", "peer"])
def test_stop_while_waiting_for_the_run_card_is_clean(
    tmp_path: Path, role: str, sig: signal.Signals
) -> None:
    # no --run-id and no reachable upstream: the node waits for the run card before it listens
    up = f"/ip4/127.0.0.1/tcp/9/p2p/{TRAINER_ID}"
    where = ["--upstream", up] if role == "relay" else ["--bootstrap", up]
    argv = [role, *where, "--trainer-id", TRAINER_ID, "--data-dir", str(tmp_path), *LOOPBACK]
    proc = _start(argv, subprocess.DEVNULL)
    seen = []
    try:
        assert proc.stderr is not None
        while not any("runcard_unavailable" in line for line in seen):
            ready_now, _, _ = select.select([proc.stderr], [], [], 60)
            assert ready_now, f"no runcard_unavailable line within 60 s: {seen}"
            line = proc.stderr.readline()
            assert line, f"exited early: {seen}"
            seen.append(line)
    finally:
        err = _signal_and_reap(proc, sig)
    assert proc.returncode == 0, err
    assert "Traceback" not in err
