"""``shardnet status`` names an unreachable target once, with what failed, and nothing else."""

from __future__ import annotations

import subprocess
import sys

import pytest

from shardnet.status import StatusError, fetch_status, run_status
from tests.helpers import closed_port


async def test_an_unreachable_target_is_named_once() -> None:
    target = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(StatusError) as err:
        await fetch_status(target)
    msg = str(err.value)
    assert msg.startswith(f"{target}: connect failed"), msg
    assert msg.count(target) == 1, msg


async def test_a_multiaddr_that_does_not_answer_is_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A node that does not answer the libp2p dial (behind a NAT: the SYN is dropped; here a
    socket that never accepts) is a StatusError naming the target, not a TooSlowError
    traceback."""
    import socket

    import shardnet.status
    from p2p.identity import Identity

    monkeypatch.setattr(shardnet.status, "TIMEOUT_S", 0.5)
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(0)
        port = silent.getsockname()[1]
        target = f"/ip4/127.0.0.1/tcp/{port}/p2p/{Identity.from_seed('silent').peer_id}"
        with pytest.raises(StatusError) as err:
            await fetch_status(target)
    assert str(err.value) == f"{target}: connect timed out after 0.5s"


FAKE_DIAL = """
import logging
import typer
import shardnet.status

def fake_run_status(target, *_):
    logging.getLogger("p2p.host").warning("dial_failed addr=%s", target)
    logging.getLogger("libp2p.network.swarm").error("failed to upgrade security")
    typer.echo(f"shardnet status: {target}: dial failed", err=True)
    return 1

shardnet.status.run_status = fake_run_status
from shardnet.cli import app
app(["status", "http://127.0.0.1:9"])
"""


def test_the_status_command_prints_its_line_and_no_dial_logs() -> None:
    """A failed dial logs on its way (ours: ``dial_failed``; py-libp2p's: the handshake);
    the command prints only its own one-line reason (a process of its own: pytest's log
    capture would hide what Python's last-resort handler prints)."""
    done = subprocess.run(
        [sys.executable, "-c", FAKE_DIAL], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 1
    assert done.stderr == "shardnet status: http://127.0.0.1:9: dial failed\n"
    assert done.stdout == ""


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("/ip4/127.0.0.1/tcp/4001", "a multiaddr needs /p2p/<PeerID>"),
        ("/ip4/127.0.0.1/tcp/4001/p2p/12D3KooWXXXX", "'12D3KooWXXXX' is not a PeerID"),
        ("ftp://h:1", "is not http://HOST:PORT or a multiaddr"),
        ("fd77::3", "an IPv6 address goes in brackets"),  # was a ValueError traceback
        ("http://fd77::3:8003", "an IPv6 address goes in brackets"),
    ],
)
def test_a_malformed_target_is_a_usage_error(
    target: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_status(target) == 2
    err = capsys.readouterr().err
    assert says in err, err
    assert len(err.splitlines()) == 1
