"""Shared test helpers: small fake checkpoints and identities (deterministic)."""

from __future__ import annotations

import json
import random
import socket
from pathlib import Path

from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.serve.mirror import open_store, version_problems
from shardcast.store.chains import read_record
from shardcast.wire.manifest import Manifest

TRAINER = Identity.from_seed("test-trainer")


def closed_port() -> int:
    """A loopback port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trust() -> TrustList:
    """Trust list pinning the test trainer."""
    return TrustList(trainer=TRAINER.peer_id)


def make_checkpoint(directory: Path, sizes: dict[str, int], seed: int = 0) -> Path:
    """Write a fake HF-style checkpoint: config.json, the given safetensors files, an index.

    File contents are seeded random bytes (sharding does not parse safetensors).
    """
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    for name, size in sizes.items():
        (directory / name).write_bytes(rng.randbytes(size))
    weights = sorted(n for n in sizes if n.endswith(".safetensors"))
    if len(weights) > 1:
        wm = {f"layer.{i}.weight": n for i, n in enumerate(weights)}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes.values())}, "weight_map": wm})
        )
    return directory


def check_committed(path: Path, m: Manifest) -> None:
    """Assert that the committed version at ``path`` (``<data_dir>/versions/<run>/step-N``)
    is ``m``'s bytes: each full file against its signed digest; a version kept as a chain
    (:mod:`shardcast.store.chains`) by building every chained shard verified, through a
    read-only view of the store (the node may be running; nothing is changed)."""
    problems = version_problems(path, m)
    assert not problems, problems


def committed_bytes(path: Path, run_id: str, name: str) -> bytes:
    """File ``name`` of the committed version at ``path`` (``<data_dir>/versions/<run>/
    step-N``): read, or, kept as a chain, built shard by shard and verified (read-only)."""
    chain = read_record(path)
    if chain is None or name not in chain.files:
        return (path / name).read_bytes()
    view = open_store(path.parents[2], run_id)
    step = int(path.name.removeprefix("step-"))
    m = view.manifest_of(step)
    assert m is not None, path
    return view.read_file_range(step, name, 0, m.header.file(name).size)
