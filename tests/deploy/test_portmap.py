"""A peer behind a home router maps its ports with UPnP and is then reached directly.

Hosts (tests/deploy/hosts.py): on the public bridge A runs the trainer, B a relay, and S a STUN
responder (tests/deploy/stun.py); router R does source NAT for its LAN (no port forwarding,
unsolicited inbound dropped, :meth:`simulations.netns.Lab.add_nat_router`) and runs Debian's
``miniupnpd`` on its LAN side (UPnP IGD and NAT-PMP, ``secure_mode``: a LAN host may map ports
only to itself; an allow rule for the LAN's unprivileged ports, deny the rest; its nftables
backend in a table of its own, whose forward chain the router's own lets through with ``ct
status dnat accept``, as a home router accepts what its port forwards let in). Debian's
miniupnpd (2.3.1) maps nothing while its external interface has a private address unless a
STUN check says no NAT filters in front of it: S answers that check (the lab's bridge,
10.211.K.0/24, plays the internet). SSDP multicast stays on R's LAN: nothing here leaves the
lab's namespaces.

Peers D and E behind R run the README's peer command with ``--port-mapping`` (and their LAN
address as ``--public-host``, what an operator behind a home router types; E on its own libp2p
port, as the README says for a second peer behind one router, but the same HTTP lane port as D,
so its lane's external port is taken). What is checked:

1. D maps its HTTP lane and libp2p ports on R (``/status`` ``port_mapping``: ``mapped``, the
   router's address, a lease), and the dial-back check reached the external lane URL, which D
   then advertises; its own LAN URL stays unreachable from outside;
   E's lane is mapped to another external port, the one the router gave (IGDv2
   ``AddAnyPortMapping`` after ``ConflictInMappingEntry``), and reached there too;
2. the relay, a public node, verified D's URL (``known_nodes``: ``verified``), and a plain
   HTTP GET from public host A at the router's address and each mapped port reaches D's and
   E's lanes (their whoami answers name their PeerIDs): no hole punch, no relay;
3. D logged no WARNING or ERROR about port mapping, and when D stops it deletes its mappings:
   the external URL no longer answers.

Marked ``slow`` (torch imports); skips without ``miniupnpd`` or ``nft``.
"""

from __future__ import annotations

import importlib.util
import secrets
import shutil
import subprocess
import sys
import uuid
from urllib.parse import urlsplit

import pytest

from simulations import netns
from tests.deploy.hosts import Host, Hosts, Node
from tests.deploy.test_nat import SECOND_PORT, ShortRun, start_behind, status
from tests.deploy.test_operator_path import PROGRESS_S

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("nft") is None, reason="nft (Debian nftables) missing"),
    pytest.mark.skipif(
        shutil.which("miniupnpd") is None,
        reason="miniupnpd missing (Debian: apt-get install miniupnpd); .ci/run installs it",
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("miniupnpc") is None,
        reason="the miniupnpc package is not installed in this venv (pip install -e .)",
    ),
]

STUN_PORT = 3478
MAPPED_S = 90.0  # start of D until its external lane URL was reached by a dial-back

# miniupnpd's chains in a table of their own (the nftables backend's layout, Debian's
# /etc/miniupnpd/nft_init.sh, with an accepting policy: the router's own forward chain decides)
_UPNP_TABLE = """
table inet miniupnpd {
    chain forward {
        type filter hook forward priority filter - 1; policy accept;
        jump miniupnpd
    }
    chain miniupnpd {
    }
    chain prerouting {
        type nat hook prerouting priority dstnat; policy accept;
        jump prerouting_miniupnpd
    }
    chain postrouting {
        type nat hook postrouting priority srcnat; policy accept;
        jump postrouting_miniupnpd
    }
    chain prerouting_miniupnpd {
    }
    chain postrouting_miniupnpd {
    }
}
"""


def start_miniupnpd(hosts: Hosts, router: netns.NatRouter, stun: Host) -> Node:
    """Run miniupnpd on ``router`` (see the module docstring); returns once it enabled port
    forwarding after its STUN check against ``stun``."""
    host = hosts.hosts["r-router"]
    subprocess.run(
        [*host.exec_prefix(), "nft", "-f", "-"], input=_UPNP_TABLE, text=True, check=True
    )
    hosts.run(
        host, ["nft", "add", "rule", "inet", "filter", "forward", "ct", "status", "dnat", "accept"]
    )
    conf = host.workdir / "miniupnpd.conf"
    conf.write_text(
        "\n".join(
            [
                "ext_ifname=eth0",
                "listening_ip=lan0",
                "http_port=0",
                "enable_upnp=yes",
                "enable_natpmp=yes",
                "secure_mode=yes",
                "system_uptime=yes",
                "ext_perform_stun=yes",
                f"ext_stun_host={stun.ip}",
                f"ext_stun_port={STUN_PORT}",
                "upnp_table_name=miniupnpd",
                "upnp_nat_table_name=miniupnpd",
                f"uuid={uuid.uuid4()}",
                f"allow 1024-65535 {router.subnet}.0/24 1024-65535",
                "deny 0-65535 0.0.0.0/0 0-65535",
                "",
            ]
        )
    )
    pid = host.workdir / "miniupnpd.pid"
    daemon = hosts.start(host, "miniupnpd", ["miniupnpd", "-d", "-f", str(conf), "-P", str(pid)])
    enabled = daemon.wait_line(lambda line: "Port forwarding is now enabled" in line or None, 30)
    assert enabled, f"miniupnpd did not enable port forwarding\n{daemon.tail()}"
    return daemon


def whoami(hosts: Hosts, host: Host, url: str) -> str | None:
    """The PeerID that the lane at ``url`` names in its whoami answer, fetched from ``host``
    (None: no answer)."""
    body = hosts.http_get(host, f"{url}/shardnet/v1/whoami/{secrets.token_hex(16)}", 5.0)
    return body.split(" ")[0] if body else None


def test_peer_behind_upnp_router_maps_its_ports_and_is_reached_directly(hosts: Hosts) -> None:
    dep = ShortRun(hosts)
    a, b, s = (hosts.add(n) for n in ("a-trainer", "b-relay", "s-stun"))
    router = hosts.add_router("r-router")
    d, e = hosts.add_behind(router, "d-peer"), hosts.add_behind(router, "e-peer")
    stun = hosts.start(s, "stun", [sys.executable, "-m", "tests.deploy.stun", s.ip, str(STUN_PORT)])
    assert stun.wait_line(lambda line: "stun_ready" in line or None, 30), stun.tail()
    daemon = start_miniupnpd(hosts, router, s)
    dep.values.update(TRAINER_IP=a.ip, RELAY_IP=b.ip)
    trainer_id = dep.keygen(a, "trainer")
    relay_id = dep.keygen(b, "relay")
    peer_ids = [dep.keygen(h, "peer") for h in (d, e)]
    dep.values.update(TRAINER_ID=trainer_id, RELAY_ID=relay_id, PEER_ID=peer_ids)
    trainer = dep.start("trainer", a, "trainer")
    relay = dep.start("relay", b, "relay")
    peer = start_behind(dep, d, "peer-d", d.ip, ("--port-mapping",))
    peer_e = start_behind(dep, e, "peer-e", e.ip, ("--port-mapping",), SECOND_PORT)
    peer_id = peer.info["peer_id"]
    lane_port = urlsplit(peer.info["http_url"]).port

    # 1. mapped, and the external URL reached by a dial-back (each logs its state once)
    want = f"http_url=http://{router.port.ip}:"
    for node in (peer, peer_e):
        reached = node.wait_line(
            lambda line: (
                line
                if "reachability" in line and want in line and "state=reachable" in line
                else None
            ),
            MAPPED_S,
        )
        assert reached, f"{node.name}'s external URL not reached\n{hosts.logs()}\n{daemon.tail()}"
    doc = status(dep, peer)
    pm = doc["port_mapping"]
    assert pm["state"] == "mapped", pm
    assert pm["external_host"] == router.port.ip, pm
    assert set(pm["mappings"]) == {"http", "libp2p"}, pm
    assert pm["mappings"]["http"]["internal_port"] == lane_port, pm
    assert pm["lease_left_s"] is not None, pm
    assert pm["lease_left_s"] > 0, pm
    assert pm["candidate_state"] == "reachable", pm
    assert pm["advertised"], pm
    mapped_url = pm["candidate_url"]
    pm_e = status(dep, peer_e)["port_mapping"]
    assert pm_e["mappings"]["http"]["internal_port"] == lane_port, pm_e  # the same as D's
    assert pm_e["mappings"]["http"]["external_port"] != lane_port, pm_e  # taken: another one
    assert pm_e["mappings"]["libp2p"]["external_port"] == SECOND_PORT, pm_e
    assert pm_e["advertised"], pm_e

    # 2. once the run ended (adverts every 2 s meanwhile), the relay has verified the mapped
    # URL; a public host reaches D's lane there directly
    try:
        code = trainer.wait(PROGRESS_S)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"the trainer did not finish\n{hosts.logs()}") from exc
    assert code == 0, trainer.tail()
    known = {n["peer_id"]: n for n in status(dep, relay)["known_nodes"]}
    assert known.get(peer_id, {}).get("http_url") == mapped_url, known
    assert known[peer_id]["lane"] == "verified", known[peer_id]
    own = status(dep, peer)["reachability"]  # its own (LAN) URL: not reachable from outside
    assert own["state"] == "unreachable", own
    assert whoami(hosts, a, mapped_url) == peer_id
    assert whoami(hosts, a, pm_e["candidate_url"]) == peer_e.info["peer_id"]
    assert whoami(hosts, a, peer.info["http_url"]) is None  # the LAN URL: not from outside

    # 3. no warning about mapping; the mappings are deleted at exit
    for node, url in ((peer, mapped_url), (peer_e, pm_e["candidate_url"])):
        assert node.stop() == 0, node.tail()
        text = node.err_path.read_text(errors="replace")
        assert not [
            line
            for line in text.splitlines()
            if "port_mapping" in line and ("WARNING" in line or "ERROR" in line)
        ], text[-3000:]
        assert whoami(hosts, a, url) is None, daemon.tail()
