"""IPv6: a node given only an IPv6 public host binds ``::`` and is reachable there (on ::1)."""

from __future__ import annotations

import json
from pathlib import Path

import trio

from p2p.addresses import default_http_host, default_listen, interface_addresses
from p2p.host import HostConfig
from p2p.http_server import HttpServerConfig
from p2p.identity import Identity
from shardcast.node.node import NodeConfig, ShardcastNode
from tests.helpers import TRAINER, trust


async def test_an_ipv6_public_host_binds_and_is_reachable(tmp_path: Path) -> None:
    listen = default_listen(0, interface_addresses(), "::1")
    assert listen == ("/ip6/::/tcp/0",)
    served = NodeConfig(
        "relay",
        "run",
        tmp_path / "a",
        host=HostConfig(listen, public_host="::1"),
        http=HttpServerConfig(host=default_http_host("::1", None), port=0),
    )
    dialler = NodeConfig("peer", "run", tmp_path / "b", host=HostConfig(("/ip6/::1/tcp/0",)))
    async with (
        ShardcastNode.open(TRAINER, trust(), served) as a,
        ShardcastNode.open(Identity.from_seed("v6-peer"), trust(), dialler) as b,
    ):
        (addr,) = a.p2p.multiaddrs()
        assert addr.startswith("/ip6/::1/tcp/")
        pid = await b.p2p.connect(addr)
        info = await b.query_info(pid)
        assert info.http_url.startswith("http://[::1]:")
        body = await b.client.get_bytes(info.http_url + "/status", max_bytes=1 << 20, timeout_s=10)
        assert json.loads(body)["http_url"] == info.http_url


async def test_an_ipv6_asker_is_seen_and_its_lane_reached(tmp_path: Path) -> None:
    """py-libp2p gives no remote address for an IPv6 connection; the node reads it from the
    socket, so an IPv6 node sees where an asker comes from and dials its lane back (before,
    every IPv6 dial-back was refused: no IPv6 node ever learned it was reachable)."""
    from shardcast.core.reachability import DialbackResult
    from shardcast.node.dialback import ask

    def v6(name: str) -> NodeConfig:
        return NodeConfig(
            "relay" if name == "a" else "peer",
            "run",
            tmp_path / name,
            host=HostConfig(("/ip6/::1/tcp/0",), public_host="::1"),
            http=HttpServerConfig(host="::1", port=0),
        )

    async with (
        ShardcastNode.open(TRAINER, trust(), v6("a")) as a,
        ShardcastNode.open(Identity.from_seed("v6-asker"), trust(), v6("b")) as b,
    ):
        a_id = await b.p2p.connect(a.p2p.multiaddrs()[0])
        assert b.p2p.remote_hosts(a_id) == ["::1"]
        assert a.p2p.remote_hosts(b.identity.peer_id) == ["::1"]
        assert b.http_url.startswith("http://[::1]:")
        with trio.fail_after(30):
            assert await ask(b.p2p, a_id, b.http_url, 10.0) is DialbackResult.REACHED
