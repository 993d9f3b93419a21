"""shardnet.logs: py-libp2p's records come out through our handler, in our format."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from shardnet.logs import configure


@pytest.fixture
def _restore_logging() -> Iterator[None]:
    root = logging.getLogger()
    saved = (root.handlers[:], root.level)
    libs = {
        n: (lg.handlers[:], lg.level, lg.propagate)
        for n in ("libp2p", "multiaddr")
        for lg in [logging.getLogger(n)]
    }
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    for n, (h, lvl, prop) in libs.items():
        lg = logging.getLogger(n)
        lg.handlers[:], lg.propagate = h, prop
        lg.setLevel(lvl)


@pytest.mark.usefixtures("_restore_logging")
def test_libp2p_warnings_formatted_like_ours(capsys: pytest.CaptureFixture[str]) -> None:
    configure("INFO", name="relay")
    logging.getLogger("libp2p.pubsub.gossipsub").warning("GRAFT: ignoring request from %s", "X")
    logging.getLogger("libp2p.pubsub.gossipsub").info("chatty detail")  # below WARNING
    logging.getLogger("shardcast.node.node").info("node_ready role=relay")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2
    assert err[0].endswith('libp2p_message text="GRAFT: ignoring request from X"')
    assert " WARNING relay libp2p.pubsub.gossipsub " in err[0]
    assert err[1].endswith("node_ready role=relay")


@pytest.mark.usefixtures("_restore_logging")
def test_libp2p_warnings_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    configure("INFO", as_json=True)
    logging.getLogger("libp2p.network").warning("dial failed: a b c")
    (line,) = capsys.readouterr().err.splitlines()
    rec = json.loads(line)
    assert rec["event"] == "libp2p_message"
    assert rec["text"] == "dial failed: a b c"
    assert rec["level"] == "WARNING"


@pytest.mark.usefixtures("_restore_logging")
def test_times_are_wall_clock_iso_8601(capsys: pytest.CaptureFixture[str]) -> None:
    import time
    from datetime import datetime

    from shardcast.node.nodestatus import iso

    assert iso(0.0) == "1970-01-01T00:00:00.000Z"
    assert iso(1_700_000_000.1234) == "2023-11-14T22:13:20.123Z"
    before = time.time()
    configure("INFO", as_json=True)
    logging.getLogger("shardcast.node.node").info("node_ready role=relay")
    configure("INFO", name="relay")
    logging.getLogger("shardcast.node.node").info("node_ready role=relay")
    json_line, text_line = capsys.readouterr().err.splitlines()
    ts = datetime.fromisoformat(json.loads(json_line)["ts"]).timestamp()
    assert before - 0.001 <= ts <= time.time()
    stamp = text_line.split(" ", 1)[0]
    assert stamp.endswith("Z")
    assert abs(datetime.fromisoformat(stamp).timestamp() - ts) < 5


@pytest.mark.usefixtures("_restore_logging")
def test_expected_library_noise_only_at_debug(capsys: pytest.CaptureFixture[str]) -> None:
    graft = "GRAFT: ignoring request from direct peer %s"
    configure("INFO", name="peer")
    logging.getLogger("libp2p.pubsub.gossipsub").warning(graft, "12D3KooWX")
    logging.getLogger("libp2p.transport.tcp.tcp").error("Failed to open TCP stream: x")
    logging.getLogger("libp2p.pubsub.gossipsub").warning(
        "GRAFT flood detected from peer %s for topic %s, applying penalty", "12D3KooWX", "t"
    )
    logging.getLogger("libp2p.host.basic_host").error(
        "Failed to open stream to peer %s:\n  Error: handshake read failed", "12D3KooWX"
    )
    logging.getLogger("libp2p.pubsub.gossipsub").warning("something else")
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1
    assert "something else" in err[0]
    configure("DEBUG", name="peer")
    logging.getLogger("libp2p.pubsub.gossipsub").warning(graft, "12D3KooWX")
    assert "ignoring request from direct peer" in capsys.readouterr().err
