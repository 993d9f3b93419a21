"""The README's role commands on IPv6-only hosts: trainer, relay and peer with an IPv6
``--public-host`` and ``/ip6/`` multiaddrs, nothing else added.

The hosts are network namespaces (tests/deploy/hosts.py) whose IPv4 address is removed and
replaced by a unique local IPv6 address (``fd77::/64``, RFC 4193) on the lab's bridge, so
nothing can pass over IPv4 and no traffic leaves the namespaces. The commands are the README's
with ``/ip4/`` written ``/ip6/`` (the peer's ``--listen /ip4/0.0.0.0/…`` as ``/ip6/::/…``), as
the README's "Addresses" paragraph says. Checked: every node binds ``::`` and advertises its
IPv6 address (multiaddrs and bracketed HTTP lane URL), the peer commits versions through the
relay, the relay and the peer prove their lanes by dial-back over IPv6 (and advertise them),
the trainer accepts its rollouts, and every node stops with exit 0.
"""

from __future__ import annotations

import dataclasses
import sys
from urllib.parse import urlsplit

import pytest

from simulations import netns
from tests.deploy.hosts import Host, Hosts, Node
from tests.deploy.test_operator_path import (
    PROGRESS_S,
    READY_S,
    Deployment,
    committed,
    read_report,
)

PREFIX = "fd77::"


def ipv6_only(hosts: Hosts, name: str, index: int) -> Host:
    """Host ``name`` with ``fd77::<index+2>/64`` as its only address (besides loopback)."""
    host = hosts.add(name)
    ip = f"{PREFIX}{index + 2}"
    netns._run(["ip", "-n", host.netns, "addr", "add", f"{ip}/64", "dev", "eth0", "nodad"])
    netns._run(["ip", "-n", host.netns, "addr", "del", f"{host.ip}/24", "dev", "eth0"])
    v6 = dataclasses.replace(host, ip=ip)
    hosts.hosts[name] = v6
    return v6


def as_ipv6(argv: list[str]) -> list[str]:
    """The README's command with its IPv4 multiaddrs written for IPv6."""
    return [a.replace("/ip4/0.0.0.0/", "/ip6/::/").replace("/ip4/", "/ip6/") for a in argv]


def start(dep: Deployment, role: str, host: Host, name: str) -> Node:
    argv = as_ipv6(dep.argv(role, host))
    dep.note(f"start {name} on {host.name} ({host.ip}): {' '.join(argv[3:])}")
    node = dep.hosts.start(host, name, argv)
    ready = node.wait_ready(READY_S)
    dep.note(f"{name} ready: {ready}")
    assert ready["multiaddrs"][0].startswith(f"/ip6/{host.ip}/tcp/"), ready
    assert urlsplit(ready["http_url"]).hostname == host.ip, ready
    assert ready["http_url"].startswith(f"http://[{host.ip}]:"), ready
    assert all(a.startswith("/ip6/::/") for a in ready["listen"]), ready
    return node


@pytest.mark.slow  # 0.4-2 min of node processes: outside the 15-minute default run
def test_readme_commands_on_ipv6_only_hosts(hosts: Hosts) -> None:
    bridge = hosts.lab.bridge
    netns._run(["ip", "-n", bridge, "link", "set", "br0", "type", "bridge", "mcast_snooping", "0"])
    dep = Deployment(hosts)
    a, b, c = (ipv6_only(hosts, n, i) for i, n in enumerate(("a-trainer", "b-relay", "c-peer")))
    dep.values.update(TRAINER_IP=a.ip, RELAY_IP=b.ip)
    trainer_id = dep.keygen(a, "trainer")
    relay_id = dep.keygen(b, "relay")
    peer_id = dep.keygen(c, "peer")
    dep.values.update(TRAINER_ID=trainer_id, RELAY_ID=relay_id, PEER_ID=[peer_id])

    trainer = start(dep, "trainer", a, "trainer")
    relay = start(dep, "relay", b, "relay")
    peer = start(dep, "peer", c, "peer")
    dep.wait_latest([peer], 1, a, "the peer committed version 2 over IPv6")
    for node in (relay, peer):  # dial-back over IPv6: the lane is proven and advertised
        verdict = node.wait_line(
            lambda line: line if "reachability http_url=" in line else None, PROGRESS_S
        )
        assert verdict is not None, f"{node.name}: no reachability verdict\n{node.tail()}"
        assert "state=reachable advertised=True" in verdict, f"{node.name}: {verdict}"

    for node in (peer, relay, trainer):
        code = node.stop()
        assert code == 0, f"{node.name} exited {code}\n{node.tail()}"
    rep = read_report(c.workdir / "peer-report.json")
    assert len(committed(rep)) >= 2, rep["versions"]
    acked = rep["exchange"]["acked"]
    assert acked.get("accepted", 0) > 0, f"no rollout accepted ({acked})"
    print("\n".join(dep.events), file=sys.stderr)
