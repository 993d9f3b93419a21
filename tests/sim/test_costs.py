"""The cost model (simulations/costs.py) and what it does to a next version in the model."""

from __future__ import annotations

from typing import Any

import pytest

from simulations.costs import GB, CommitMode, CostModel, OriginDigest
from simulations.model import Model
from simulations.topology import TopologyError, parse

SHARD = 128 << 20
CHANGED = 10_000_000  # elements a next version changes, whatever the checkpoint's size


def _world(size: int, commit: CommitMode) -> dict[str, Any]:
    """A full version, then one next version changing ``CHANGED`` bf16 elements, from an
    origin through 2 relays to 6 peers (1 Gb/s); the origin hashes only the change, so what
    differs with the checkpoint's size is the followers' work."""
    return {
        "name": "next",
        "seed": 5,
        "checkpoint": {
            "size_bytes": size,
            "shard_size_bytes": SHARD,
            "versions": 2,
            "interval_s": 600,
            "changed_fraction": CHANGED / (size / 2),
        },
        "costs": {"commit": commit.value, "origin_digest": OriginDigest.INCREMENTAL.value},
        "nodes": [
            {"name": "origin", "role": "origin", "up_mbps": 10_000, "down_mbps": 10_000},
            {
                "name": "relay",
                "role": "relay",
                "count": 2,
                "upstreams": ["origin"],
                "up_mbps": 10_000,
                "down_mbps": 10_000,
                "latency_ms": 2,
            },
            {
                "name": "peer",
                "role": "peer",
                "count": 6,
                "upstreams": ["relay"],
                "up_mbps": 1000,
                "down_mbps": 1000,
                "latency_ms": 10,
            },
        ],
        "rollouts": {"load_s": 1, "generate_s": 2, "batch_bytes": 10_000},
    }


def _next(size: int, commit: CommitMode) -> tuple[float, float, int]:
    """(seconds to the last peer's commit, to its engine holding it, peers' bytes received
    for the next version) of the next version."""
    s = Model(parse(_world(size, commit))).run()
    peers = [n for n in s["nodes"].values() if n["role"] == "peer"]
    for p in peers:
        assert p["versions"]["1"]["digest_ok"] is True
    run = s["run"]
    return run["time_to_last_peer_s"]["1"], run["time_to_last_ready_s"]["1"], len(peers)


def test_a_chained_next_version_costs_the_change_a_materialized_one_the_checkpoint() -> None:
    """Same changed elements in a 4x larger checkpoint: a follower that materializes the next
    version needs several times longer (it reads, patches, hashes and writes the whole
    checkpoint, then reloads it); one that keeps it as a chain receives, hashes and keeps the
    same blob bytes and updates the same elements in its engine, so its time grows far less:
    only by the round trips of 4x as many (4x smaller) blob requests through the bounded
    in-flight window."""
    small, big = 1 << 30, 4 << 30
    chain_small, chain_small_ready, n = _next(small, CommitMode.CHAIN)
    chain_big, chain_big_ready, _ = _next(big, CommitMode.CHAIN)
    mat_small, mat_small_ready, _ = _next(small, CommitMode.MATERIALIZE)
    mat_big, mat_big_ready, _ = _next(big, CommitMode.MATERIALIZE)
    assert n == 6
    assert mat_big >= 2 * mat_small
    assert chain_big - chain_small <= 0.25 * (mat_big - mat_small)
    assert chain_big_ready - chain_big == pytest.approx(chain_small_ready - chain_small, abs=0.01)
    assert mat_big_ready - mat_big >= 3.5 * (mat_small_ready - mat_small)
    assert mat_small > chain_small
    assert mat_big > 3 * chain_big


def test_the_origin_rehashing_every_byte_costs_the_checkpoint() -> None:
    """With ``origin_digest = "rehash"`` the next version's manifest waits for the origin to
    hash the whole new version (``size / hash_bytes_per_s``) even when followers chain."""
    data = _world(4 << 30, CommitMode.CHAIN)
    incremental = Model(parse(data)).run()["run"]["time_to_last_peer_s"]["1"]
    data["costs"]["origin_digest"] = OriginDigest.REHASH.value
    rehash = Model(parse(data)).run()["run"]["time_to_last_peer_s"]["1"]
    hash_s = (4 << 30) / 2e9  # the default hash_bytes_per_s
    assert rehash >= incremental + 0.8 * hash_s


def test_check_and_commit_costs_follow_their_inputs() -> None:
    chain, mat = CostModel(commit=CommitMode.CHAIN), CostModel(commit=CommitMode.MATERIALIZE)
    shard, blob = 50e6, 0.5e6
    assert chain.check_s(blob, shard, delta=True) == pytest.approx(
        (chain.hash_cpu_s_per_gb + chain.write_cpu_s_per_gb) * blob / GB
    )
    assert mat.check_s(blob, shard, delta=True) >= mat.materialize_cpu_s_per_gb * shard / GB
    assert chain.check_s(shard, shard, delta=False) == mat.check_s(shard, shard, delta=False)
    assert chain.commit_s(62e9, delta=True) == chain.chain_commit_s
    assert mat.commit_s(62e9, delta=True) == pytest.approx(mat.commit_cpu_s_per_gb * 62)
    assert chain.engine_s(62e9, 1e6, delta=True) == pytest.approx(chain.engine_update_s_per_mchange)
    assert chain.engine_s(62e9, 1e6, delta=False) == mat.engine_s(62e9, 1e6, delta=True)
    ratio = chain.delta_ratio(0.01)
    assert ratio == pytest.approx(0.01 * chain.blob_bytes_per_change / chain.element_bytes)
    assert chain.changed_elements(62e9, ratio) == pytest.approx(0.01 * 62e9 / 2)
    assert CostModel(blob_bytes_per_change=6).delta_ratio(0.5) == 1.0  # never above raw


def test_changed_fraction_and_delta_ratio_are_one_setting() -> None:
    data = _world(1 << 30, CommitMode.CHAIN)
    data["checkpoint"]["delta_ratio"] = 0.05
    with pytest.raises(TopologyError, match="changed_fraction or delta_ratio"):
        parse(data)
    data["costs"]["commit"] = "copy"
    del data["checkpoint"]["delta_ratio"]
    with pytest.raises(TopologyError, match=r"costs\.commit"):
        parse(data)
