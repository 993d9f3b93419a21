"""Two nodes with one key (issue 25's real internet: a cloned VM image with its node key).

Three real libp2p hosts on 127.0.0.1: the genuine node G, an observer O, and D, started later
with G's key. O keeps the newest signed peer record per PeerID and drops every pubsub RPC that
carries an older one (py-libp2p 0.8.1), so once it has seen D's record, G is not heard; before
:mod:`p2p.peer_records` that lasted after D had gone, for good. Now O names the PeerID at
WARNING (``peer_record_conflict``), and G is heard again once it re-issues its record (every
``record_refresh_s``; called directly here).
"""

from __future__ import annotations

import logging

import trio

from p2p.host import HostConfig, P2PNode
from p2p.identity import Identity


def _accept(origin: str, data: bytes) -> None:
    """Gossip check that accepts every message."""


class _Conflicts(logging.Handler):
    """Sets ``seen`` at the first ``peer_record_conflict`` line."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.seen = trio.Event()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        if text.startswith("peer_record_conflict"):
            self.lines.append(text)
            self.seen.set()


async def _received(sub: object, data: bytes) -> None:
    while True:
        msg = await sub.receive()  # type: ignore[attr-defined]
        if msg.data == data:
            return


async def test_a_node_is_heard_again_after_a_node_with_its_key_left() -> None:
    g_id, o_id = Identity.from_seed("dup-g"), Identity.from_seed("dup-o")
    slow = HostConfig(record_refresh_s=3600.0)  # refreshed by hand below
    handler = _Conflicts()
    logger = logging.getLogger("p2p.peer_records")
    logger.addHandler(handler)
    try:
        async with P2PNode.open(o_id, HostConfig()) as o, P2PNode.open(g_id, slow) as g:
            await g.connect(o.multiaddrs()[0])
            sub = await o.subscribe("t", _accept)
            await g.subscribe("t", _accept)
            await g.wait_for_subscriber(o.peer_id, "t", timeout_s=10)
            await g.publish("t", b"before")
            with trio.fail_after(10):
                await _received(sub, b"before")

            async with P2PNode.open(g_id, slow) as d, trio.open_nursery() as nursery:
                await d.connect(o.multiaddrs()[0])

                async def publish_from_g() -> None:  # G's traffic while D is there
                    for i in range(10_000):
                        await g.publish("t", b"during-%d" % i)
                        await trio.sleep(0.2)

                nursery.start_soon(publish_from_g)
                with trio.fail_after(20):
                    await handler.seen.wait()
                nursery.cancel_scope.cancel()
            assert g.peer_id in handler.lines[0]
            assert o.record_conflicts.conflicts >= 1

            g.refresh_record()  # what G's refresh task does every record_refresh_s
            await g.publish("t", b"after")
            with trio.fail_after(10):
                await _received(sub, b"after")
    finally:
        logger.removeHandler(handler)
