"""Peers behind NATs in the model (:mod:`simulations.nat`), on ``volunteers.toml`` at a quarter
of its checkpoint size (seeded: each run is deterministic, 2-4 s)."""

from __future__ import annotations

import copy
import tomllib
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from simulations.model import Model
from simulations.nat import NatModel, punch_s
from simulations.topology import TopologyError, parse, scaled

TOPOS = Path(__file__).parents[2] / "simulations" / "topologies"
MODES = {  # mode -> (nat of the NATed groups, serve_behind_nat)
    "public": ("none", True),
    "eim": ("eim", True),
    "symmetric": ("symmetric", True),
    "download_only": ("eim", False),
}


@cache
def _run(mode: str, relay_serve_once_s: float = 0.0) -> dict[str, Any]:
    """``volunteers.toml`` with its NATed groups in ``mode``, at 1/4 size (relays super-seeding
    with ``relay_serve_once_s``; 0: off, so that only the NATs differ): the summary."""
    data = tomllib.loads((TOPOS / "volunteers.toml").read_text())
    data["model"] = {"relay_serve_once_s": relay_serve_once_s}
    nat, serve = MODES[mode]
    for g in data["nodes"]:
        if "nat" not in g:
            continue
        if nat == "none":
            del g["nat"]
            g.pop("router", None)
        else:
            g["nat"], g["serve_behind_nat"] = nat, serve
    return Model(scaled(parse(data), 0.25)).run()


def _every_version_on_every_peer(s: dict[str, Any]) -> None:
    peers = [n for n in s["nodes"].values() if n["role"] == "peer"]
    assert len(peers) == 26
    for p in peers:
        for step in ("0", "1"):
            assert p["versions"][step]["digest_ok"] is True


def _last_s(s: dict[str, Any]) -> float:
    return float(s["run"]["time_to_last_peer_max_s"])


def test_eim_nat_peers_serve_a_real_share_and_keep_pace_with_public() -> None:
    s = _run("eim")
    _every_version_on_every_peer(s)
    nat = s["nat"]
    assert nat["nat_share_of_p2p"] >= 0.3  # issue 25's target
    assert nat["bytes_to_peers"]["nat_punched"] > 0
    assert nat["bytes_to_peers"]["nat_lan"] > 0  # the lab's 8 peers share a router
    assert nat["bytes_to_peers"]["other"] == 0  # no path the NATs do not allow
    assert nat["punches"]["direct"] > 0
    assert nat["punches"]["ahead"] > 0  # PunchPlanner.ahead admitted some
    assert nat["punches"]["failed"] == 0
    assert _last_s(s) <= 1.2 * _last_s(_run("public"))
    assert "nat" not in _run("public")  # no NAT: no NAT section, as before


def test_symmetric_nats_punches_fail_every_version_still_arrives() -> None:
    s = _run("symmetric")
    _every_version_on_every_peer(s)
    nat = s["nat"]
    assert nat["punches"]["started"] > 0
    assert nat["punches"]["direct"] == 0
    assert nat["bytes_to_peers"]["nat_punched"] == 0
    assert nat["bytes_to_peers"]["other"] == 0
    assert _last_s(s) > 1.2 * _last_s(_run("eim"))  # the NATed uplinks are lost


def test_download_only_falls_back_to_relays_and_public_peers() -> None:
    s = _run("download_only")
    _every_version_on_every_peer(s)
    nat = s["nat"]
    assert nat["punches"]["started"] == 0
    by = nat["bytes_to_peers"]
    assert by["nat_punched"] == by["nat_dialled"] == by["other"] == 0
    assert by["relay"] + by["public_peer"] > by["nat_lan"]  # the lab still serves its LAN
    homes = [n for name, n in s["nodes"].items() if name.startswith("home-")]
    batches = 2 * 1_000_000  # each home peer's rollouts: its only uplink bytes
    assert all(n["bytes_up"] <= batches for n in homes)


def test_symmetric_nat_peers_do_not_wait_out_relays_super_seeding_windows() -> None:
    """Relays super-seed (``shardnet relay``'s default): a NATed peer served a shard first holds
    it for 5 s, and peers behind symmetric NATs cannot punch to it. The refusal names it, they
    name it back as unreachable (``SourceDirectory.holder_reach``) and are served at once
    (``SuperSeeding`` rule 11), so super-seeding costs them about what it costs peers whose
    punches work (it halves the relays' egress for some time to the last peer: here +15 %
    behind symmetric NATs, +8 % behind EIM NATs, +22 % all public; without rule 11 the
    symmetric run took +30 %; before overdue transfers were cut, note 44, +13 % and +16 %).
    Where punches work nobody is served that way: holders stay reserved."""
    s = _run("symmetric", 5.0)
    _every_version_on_every_peer(s)
    assert s["run"]["unreachable_served"] > 0
    assert s["run"]["relay_seeding_refused"] > 0
    eim = _run("eim", 5.0)
    _every_version_on_every_peer(eim)
    cost_symmetric = _last_s(s) / _last_s(_run("symmetric"))
    cost_eim = _last_s(eim) / _last_s(_run("eim"))
    cost_public = _last_s(_run("public", 5.0)) / _last_s(_run("public"))
    assert cost_symmetric <= 1.2  # +30 % without rule 11
    assert cost_symmetric <= 1.05 * max(cost_eim, cost_public)
    assert eim["run"]["relay_seeding_refused"] > 0
    assert eim["run"]["unreachable_served"] == 0
    assert _run("symmetric")["run"]["relay_seeding_refused"] == 0  # off at 0


def _small(nat: str, serve: bool) -> dict[str, Any]:
    peer = {
        "name": "peer",
        "role": "peer",
        "count": 4,
        "upstreams": ["origin"],
        "up_mbps": 100,
        "down_mbps": 100,
        "latency_ms": 10,
        "nat": nat,
        "serve_behind_nat": serve,
    }
    return {
        "name": "small",
        "seed": 5,
        "checkpoint": {"size_bytes": 64 << 20, "shard_size_bytes": 4 << 20, "versions": 2},
        "nodes": [
            {"name": "origin", "role": "origin", "up_mbps": 1000, "latency_ms": 2},
            {"name": "cloud", "role": "peer", "upstreams": ["origin"], "up_mbps": 100},
            peer,
        ],
        "rollouts": {"load_s": 1, "generate_s": 2, "batch_bytes": 10000},
    }


def test_origin_serves_download_only_peers_without_holding_a_shard_for_them() -> None:
    m = Model(parse(_small("eim", False)))
    s = m.run()
    assert m.seeding.unheld_served > 0  # super-seeding rule 10
    for p in (n for n in s["nodes"].values() if n["role"] == "peer"):
        assert p["versions"]["1"]["digest_ok"] is True
    served = Model(parse(_small("eim", True)))
    served.run()
    assert served.seeding.unheld_served == 0
    # no relay to punch through: nobody but the origin reaches a NATed peer, so a peer
    # refused a shard a NATed peer holds names it back and is served at once (rule 11;
    # the last peer at 16.0 s, against 26.4 s waiting out the windows)
    assert served.seeding.unreachable_served > 0


def test_same_seed_same_nat_run() -> None:
    a, b = Model(parse(_small("eim", True))).run(), Model(parse(_small("eim", True))).run()
    assert a["nat"] == b["nat"]
    assert a["run"]["time_to_last_peer_s"] == b["run"]["time_to_last_peer_s"]


def test_punch_rule_and_duration() -> None:
    topo = parse(_small("symmetric", True))
    nat = NatModel(topo.nodes, 1)
    cloud, p0, p1 = (topo.index(x) for x in ("cloud", "peer-0", "peer-1"))
    assert not nat.succeeds(cloud, p0)
    assert not nat.succeeds(p0, p1)
    eim = NatModel(parse(_small("eim", True)).nodes, 1)
    assert eim.succeeds(cloud, p0)
    assert eim.succeeds(p0, p1)
    rtt = 0.1
    ok = punch_s(rtt / 2, rtt / 2, True)
    assert 2 * rtt <= ok <= 4 * rtt  # "about 2-3 RTTs" and the direct handshake
    assert punch_s(rtt / 2, rtt / 2, False) > ok


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda d: d["nodes"][0].update(nat="eim"), "nodes[0].nat"),
        (lambda d: d["nodes"][1].update(router="home"), "nodes[1].router"),
        (lambda d: d["nodes"][1].update(upstreams=["peer"]), "nodes.upstreams"),
    ],
)
def test_nat_topology_errors_name_the_field(change: Any, field: str) -> None:
    data = copy.deepcopy(_small("eim", True))
    change(data)
    with pytest.raises(TopologyError) as exc:
        parse(data)
    assert exc.value.field == field
