"""Two real libp2p hosts on 127.0.0.1: dial, request/response with bounds, gossip."""

from __future__ import annotations

import logging

import pytest
import trio

from p2p.errors import MessageTooLarge, PeerIdMismatch, RemoteProtocolError, StreamBroken
from p2p.host import HostConfig, P2PNode, peer_id_of
from p2p.identity import Identity
from p2p.library_logs import RepeatFilter

PROTO = "/shardnet/test-echo/1.0.0"


def _accept(origin: str, data: bytes) -> None:
    """Gossip check that accepts every message."""


async def test_request_response_and_bounds() -> None:
    a_id, b_id = Identity.from_seed("a"), Identity.from_seed("b")
    async with P2PNode.open(a_id, HostConfig()) as a, P2PNode.open(b_id, HostConfig()) as b:
        release = trio.Event()

        async def echo(peer: str, req: bytes) -> bytes:
            if req == b"stall":
                await release.wait()
            if req == b"refuse":
                raise RemoteProtocolError(peer, "refused")
            return peer.encode() + b"|" + req

        a.serve(PROTO, echo, max_request_bytes=1024, max_response_bytes=4096, timeout_s=30)
        addr = a.multiaddrs()[0]
        assert peer_id_of(addr) == a.peer_id
        assert await b.connect(addr) == a.peer_id
        resp = await b.request(a.peer_id, PROTO, b"hi", max_response_bytes=4096, timeout_s=10)
        assert resp == b.peer_id.encode() + b"|hi"
        # response over the caller's bound
        with pytest.raises(MessageTooLarge):
            await b.request(a.peer_id, PROTO, b"x" * 200, max_response_bytes=100, timeout_s=10)
        # handler refusal resets the stream
        with pytest.raises(StreamBroken):
            await b.request(a.peer_id, PROTO, b"refuse", max_response_bytes=4096, timeout_s=10)
        # unknown protocol
        with pytest.raises((RemoteProtocolError, StreamBroken)):
            await b.request(a.peer_id, "/nope/1", b"x", max_response_bytes=10, timeout_s=10)
        # a stalled handler hits the caller's timeout
        with pytest.raises(StreamBroken):
            await b.request(a.peer_id, PROTO, b"stall", max_response_bytes=4096, timeout_s=0.5)
        release.set()


async def test_gossip_delivers_burst_without_drops() -> None:
    a_id, b_id = Identity.from_seed("ga"), Identity.from_seed("gb")
    async with P2PNode.open(a_id, HostConfig()) as a, P2PNode.open(b_id, HostConfig()) as b:
        await b.connect(a.multiaddrs()[0])
        sub = await a.subscribe("t", _accept)
        await b.subscribe("t", _accept)
        await b.wait_for_subscriber(a.peer_id, "t", timeout_s=10)
        # a, a direct peer subscribed to "t", is sent b's messages (the mesh proper is empty)
        assert b.mesh_sizes() == {"t": 1}
        n = 200  # far above the library's 32-message queues and 10 msg/s limit
        for i in range(n):
            await b.publish("t", b"m%d" % i)
        got = []
        with trio.fail_after(20):
            while len(got) < n:
                msg = await sub.receive()
                assert msg.origin == b.peer_id
                got.append(msg.data)
        assert got == [b"m%d" % i for i in range(n)]
        assert sub.statistics().dropped == 0


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def test_dial_with_wrong_peer_id_says_so_once(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="p2p.host")
    swarm, seen = logging.getLogger("libp2p.network.swarm"), _Collect()
    swarm.addHandler(seen)
    try:
        async with (
            P2PNode.open(Identity.from_seed("mm-a"), HostConfig()) as a,
            P2PNode.open(Identity.from_seed("mm-b"), HostConfig()) as b,
        ):
            wrong = Identity.from_seed("mm-wrong").peer_id
            addr = a.multiaddrs()[0].rsplit("/p2p/", 1)[0] + "/p2p/" + wrong
            for _ in range(3):  # an upstream loop retrying
                with pytest.raises(PeerIdMismatch, match="peer id mismatch"):
                    await b.connect(addr)
    finally:
        swarm.removeHandler(seen)
    errors = [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.ERROR and r.name == "p2p.host"
    ]
    assert errors == [
        f"dial_failed addr={addr} expected={wrong} reason=peer_id_mismatch_or_handshake_failure"
    ]
    handshake = [m for m in seen.messages if m.startswith("failed to upgrade security")]
    assert len(handshake) == 1  # py-libp2p logs one per attempt; the filter keeps the first


def test_repeat_filter_passes_a_message_once_per_interval() -> None:
    now = [0.0]
    f = RepeatFilter("failed to upgrade", interval_s=600.0, clock=lambda: now[0])

    def rec(msg: str) -> logging.LogRecord:
        return logging.LogRecord("libp2p.network.swarm", logging.ERROR, "", 0, msg, None, None)

    seen = []
    for t, msg in [
        (0, "failed to upgrade X"),
        (1, "failed to upgrade X"),
        (2, "other"),
        (3, "other"),
        (4, "failed to upgrade Y"),
        (601, "failed to upgrade X"),
    ]:
        now[0] = float(t)
        seen.append(f.filter(rec(msg)))
    assert seen == [True, False, True, True, True, True]


@pytest.mark.parametrize("helper", [False, True])
async def test_a_helper_host_starts_quietly(helper: bool, caplog: pytest.LogCaptureFixture) -> None:
    """The short-lived host that fetches the run card before a node starts logs its start at
    DEBUG: an operator reads one ``host_started`` per node (the node's own)."""
    caplog.set_level(logging.DEBUG, logger="p2p.host")
    async with P2PNode.open(Identity.from_seed("helper-host"), HostConfig(), helper=helper):
        pass
    started = [r for r in caplog.records if r.getMessage().startswith("host_started")]
    assert [r.levelno for r in started] == [logging.DEBUG if helper else logging.INFO]
