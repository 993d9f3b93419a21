"""Topology files: every sample parses; invalid files give errors that name the field."""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import pytest

from simulations.costs import CommitMode
from simulations.topology import TopologyError, load, parse, scaled, with_overrides

SAMPLES = sorted((Path(__file__).parents[2] / "simulations" / "topologies").glob("*.toml"))


def _base() -> dict[str, Any]:
    return {
        "name": "t",
        "checkpoint": {"size_bytes": 1 << 20, "shard_size_bytes": 1 << 16},
        "nodes": [
            {"name": "origin", "role": "origin"},
            {"name": "relay", "role": "relay", "count": 2, "upstreams": ["origin"]},
            {
                "name": "peer",
                "role": "peer",
                "count": 3,
                "upstreams": ["relay"],
                "down_mbps": [50, 150],
            },
        ],
    }


def test_samples_exist() -> None:
    names = {p.stem for p in SAMPLES}
    assert {
        "intellect2",
        "intellect2_next",
        "home",
        "slow_relay",
        "churn",
        "calibration",
        "bound",
    } <= names


@pytest.mark.parametrize("path", SAMPLES, ids=lambda p: p.stem)
def test_sample_parses(path: Path) -> None:
    topo = load(path)
    assert topo.origin.role == "origin"
    assert all(topo.nodes[i].index == i for i in range(len(topo.nodes)))
    assert topo.by_role("peer")


def test_intellect2_shape() -> None:
    topo = load(next(p for p in SAMPLES if p.stem == "intellect2"))
    peers = topo.by_role("peer")
    assert len(peers) == 100
    assert topo.spec.checkpoint.size_bytes == 62_000_000_000
    assert all(p.down_bps == pytest.approx(590e6 / 8) for p in peers)


def test_expansion_and_spread() -> None:
    topo = parse(_base())
    assert [n.name for n in topo.nodes] == [
        "origin",
        "relay-0",
        "relay-1",
        "peer-0",
        "peer-1",
        "peer-2",
    ]
    assert topo.nodes[3].upstreams == ("relay-0", "relay-1")
    assert [n.down_bps * 8 / 1e6 for n in topo.by_role("peer")] == pytest.approx([50, 100, 150])


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda d: d["nodes"][1].update(up_mbps=-1), "nodes[1].up_mbps"),
        (lambda d: d["nodes"][2].update(role="seeder"), "nodes[2].role"),
        (lambda d: d["nodes"][2].update(upstreams=["nowhere"]), "nodes[2].upstreams[0]"),
        (lambda d: d["nodes"][1].update(upstreams=[]), "nodes[1].upstreams"),
        (lambda d: d["checkpoint"].update(size_bytes=0), "checkpoint.size_bytes"),
        (lambda d: d["checkpoint"].pop("size_bytes"), "checkpoint.size_bytes"),
        (lambda d: d.update(colour="red"), "colour"),
        (lambda d: d["nodes"][2].update(behavior="forge", role="relay"), "nodes[2].behavior"),
        (
            lambda d: d.update(events=[{"at_s": 1, "node": "ghost", "action": "leave"}]),
            "events[0].node",
        ),
        (
            lambda d: d.update(events=[{"at_s": 1, "node": "peer-0", "action": "explode"}]),
            "events[0].action",
        ),
        (
            lambda d: d.update(links=[{"a": "relay-0", "b": "peer-9", "bandwidth_mbps": 5}]),
            "links[0].b",
        ),
        (
            lambda d: d["nodes"].append({"name": "peer", "role": "peer", "upstreams": ["relay"]}),
            "nodes[3].name",
        ),
        (lambda d: d["nodes"][0].update(role="relay", upstreams=["relay"]), "nodes"),
    ],
)
def test_errors_name_the_field(mutate: Any, field: str) -> None:
    data = _base()
    mutate(data)
    with pytest.raises(TopologyError) as info:
        parse(data)
    assert info.value.field == field, str(info.value)


def test_load_reports_toml_syntax(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("name = \n")
    with pytest.raises(TopologyError, match="TOML syntax"):
        load(bad)
    with pytest.raises(TopologyError, match="No such file"):
        load(tmp_path / "missing.toml")


def test_scaled_and_overrides() -> None:
    topo = parse(_base())
    small = scaled(topo, 0.5)
    assert small.spec.checkpoint.size_bytes == 1 << 19
    assert small.spec.checkpoint.shard_size_bytes == 1 << 16  # floor: 64 KiB
    big = with_overrides(topo, peers=7, time_step_s=0.01)
    assert len(big.by_role("peer")) == 7
    assert big.spec.model.time_step_s == 0.01
    assert topo.spec.costs.commit is CommitMode.CHAIN  # the follower's default (keep_chains)
    eager = with_overrides(topo, commit=CommitMode.MATERIALIZE)
    assert eager.spec.costs.commit is CommitMode.MATERIALIZE
    assert tomllib.loads("a = 1")  # tomllib is the reader (stdlib)
