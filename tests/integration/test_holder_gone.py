"""Super-seeding rule 8 on real hosts on 127.0.0.1: a holder whose last connection to the
origin closed is reported to the origin's version server (the libp2p notifee path)."""

from __future__ import annotations

from pathlib import Path

import trio

from p2p.identity import Identity
from shardcast.node.node import NodeConfig, ShardcastNode
from tests.helpers import TRAINER, trust


async def test_the_origin_hears_a_relay_leave(tmp_path: Path) -> None:
    relay = Identity.from_seed("gone-relay")
    cfg = NodeConfig("trainer", "run", tmp_path / "o", serve_once_s=5.0)
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o:
        gone: list[str] = []
        left = trio.Event()

        def on_gone(peer_id: str) -> None:
            gone.append(peer_id)
            left.set()

        o.p2p.on_peer_gone(on_gone)
        rcfg = NodeConfig("relay", "run", tmp_path / "r")
        async with ShardcastNode.open(relay, trust(), rcfg) as r:
            await r.p2p.connect(o.p2p.multiaddrs()[0])
            assert relay.peer_id in o.p2p.connected_peers()
            assert gone == []
        with trio.fail_after(10):
            await left.wait()
        assert gone == [relay.peer_id]
        assert relay.peer_id not in o.p2p.connected_peers()
