"""The hosts harness: own addresses, processes run inside, everything removed at the end."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from simulations import netns
from tests.deploy.hosts import Hosts, Node, available

OK, WHY = available()
needs_netns = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")

SERVE = (
    "import http.server, sys\n"
    "s = http.server.HTTPServer((sys.argv[1], 8080), http.server.SimpleHTTPRequestHandler)\n"
    'print(\'shardnet-ready {"http_url": "http://%s:8080"}\' % sys.argv[1], flush=True)\n'
    "s.serve_forever()\n"
)


def _pids(ns: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False)
    return out.stdout.split()


@needs_netns
def test_hosts_reach_each_other_and_are_removed(tmp_path: Path) -> None:
    with Hosts(tmp_path) as hosts:
        a, b = hosts.add("a"), hosts.add("b")
        assert a.ip != b.ip
        assert f"inet {a.ip}/24" in hosts.run(a, ["ip", "-4", "addr", "show", "eth0"])
        (b.workdir / "hello.txt").write_text("hi from b")
        server = hosts.start(b, "server", [sys.executable, "-c", SERVE, b.ip])
        url = server.wait_ready(30)["http_url"]
        assert hosts.http_get(a, url + "/hello.txt") == "hi from b"
        assert _pids(b.netns) == [str(server.pid)]
        assert server.stop() != 0  # SIGTERM: HTTPServer has no handler, so it dies of it
        names = [a.netns, b.netns, hosts.lab.bridge]
    assert not set(names) & set(netns.namespaces())


def _fail_inside(hosts: Hosts, seen: list[object]) -> None:
    with hosts:
        a = hosts.add("a")
        seen += [hosts.start(a, "sleeper", ["sleep", "600"]), a.netns, hosts.lab.bridge]
        raise RuntimeError("boom")


@needs_netns
def test_a_failing_test_leaves_nothing_behind(tmp_path: Path) -> None:
    seen: list[object] = []
    with pytest.raises(RuntimeError, match="boom"):
        _fail_inside(Hosts(tmp_path), seen)
    node, *names = seen
    assert isinstance(node, Node)
    assert node.proc.poll() is not None
    assert not set(names) & set(netns.namespaces())


WHOAMI = (
    "import http.server, sys\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        body = self.client_address[0].encode()\n"
    "        self.send_response(200); self.end_headers(); self.wfile.write(body)\n"
    "s = http.server.HTTPServer((sys.argv[1], 8080), H)\n"
    'print(\'shardnet-ready {"http_url": "http://%s:8080"}\' % sys.argv[1], flush=True)\n'
    "s.serve_forever()\n"
)


@needs_netns
@pytest.mark.skipif(shutil.which("nft") is None, reason="nft (Debian nftables) not installed")
def test_hosts_behind_a_router_go_out_through_its_nat_and_cannot_be_dialled(
    tmp_path: Path,
) -> None:
    with Hosts(tmp_path) as hosts:
        public = hosts.add("public")
        router = hosts.add_router("router")
        lan_a, lan_b = hosts.add_behind(router, "lan-a"), hosts.add_behind(router, "lan-b")
        url = hosts.start(public, "echo", [sys.executable, "-c", WHOAMI, public.ip])
        seen = hosts.http_get(lan_a, url.wait_ready(30)["http_url"] + "/")
        assert seen == router.port.ip  # masqueraded: the public host sees the router
        inside = hosts.start(lan_b, "lan-echo", [sys.executable, "-c", WHOAMI, lan_b.ip])
        lan_url = inside.wait_ready(30)["http_url"] + "/"
        assert hosts.http_get(lan_a, lan_url) == lan_a.ip  # the LAN is one network
        assert hosts.http_get(public, lan_url, timeout_s=2.0) is None  # no route in
        # the router's own public address: unsolicited inbound is dropped
        assert hosts.http_get(public, f"http://{router.port.ip}:8080/", timeout_s=2.0) is None
        names = [public.netns, router.port.netns, lan_a.netns, lan_b.netns]
    assert not set(names) & set(netns.namespaces())


SEEN_PORT = (  # answers each connection, on ports 8080 and 8081, with the port it came from
    "import socket, sys, threading\n"
    "def serve(port):\n"
    "    s = socket.create_server((sys.argv[1], port))\n"
    "    while True:\n"
    "        c, addr = s.accept()\n"
    "        c.sendall(str(addr[1]).encode()); c.close()\n"
    "for port in (8080, 8081):\n"
    "    threading.Thread(target=serve, args=(port,), daemon=True).start()\n"
    'print(\'shardnet-ready {"http_url": "http://%s:8080"}\' % sys.argv[1], flush=True)\n'
    "threading.Event().wait()\n"
)
FROM_ONE_PORT = (  # one local port, two destinations: the source ports the server saw
    "import socket, sys\n"
    "for port in (8080, 8081):\n"
    "    s = socket.socket()\n"
    "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
    "    s.bind((sys.argv[1], 40000))\n"
    "    s.connect((sys.argv[2], port))\n"
    "    print(s.recv(16).decode()); s.close()\n"
)


@needs_netns
@pytest.mark.skipif(shutil.which("nft") is None, reason="nft (Debian nftables) not installed")
def test_a_symmetric_router_maps_each_destination_to_its_own_port(tmp_path: Path) -> None:
    """Plain masquerade keeps the LAN socket's port for every destination (endpoint-independent
    mapping: hole punching works); ``symmetric`` picks a random port per connection."""
    with Hosts(tmp_path) as hosts:
        public = hosts.add("public")
        server = hosts.start(public, "ports", [sys.executable, "-c", SEEN_PORT, public.ip])
        server.wait_ready(30)
        seen = {}
        for symmetric in (False, True):
            name = "sym" if symmetric else "eim"
            lan = hosts.add_behind(hosts.add_router(f"{name}-router", symmetric=symmetric), name)
            out = hosts.run(lan, [sys.executable, "-c", FROM_ONE_PORT, lan.ip, public.ip])
            seen[symmetric] = [int(p) for p in out.split()]
    assert seen[False] == [40000, 40000], seen
    # random ports: equal to each other, or to 40000, by chance once in ~30000 runs
    assert len(set(seen[True])) == 2, seen
    assert 40000 not in seen[True], seen
