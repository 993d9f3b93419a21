"""Shared test helpers: small fake checkpoints and identities (deterministic)."""

from __future__ import annotations

import json
import random
import shutil
import socket
from contextlib import aclosing
from pathlib import Path
from typing import Any

from p2p.identity import Identity
from p2p.lanes import HttpLaneClient
from p2p.trust import TrustList
from shardcast.serve.mirror import open_store, version_problems
from shardcast.store.blobpack import PACK_INDEX, BlobRef, read_index
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


def next_checkpoint(
    base: Path, new: Path, sizes: dict[str, int], seed: int, every: int = 200
) -> Path:
    """Copy checkpoint ``base`` to ``new`` with about one random 16-bit word in every ``every``
    bytes of each file of ``sizes`` changed (seeded): a sparse next version. Returns ``new``."""
    shutil.copytree(base, new)
    rng = random.Random(seed)
    for name, size in sizes.items():
        data = bytearray((new / name).read_bytes())
        for _ in range(size // every):
            i = rng.randrange(0, size // 2) * 2
            data[i : i + 2] = rng.randbytes(2)
        (new / name).write_bytes(bytes(data))
    return new


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


def rot_blob(ref: BlobRef) -> None:
    """Flip one bit in the middle of a kept blob where it lies (a pack or its own file): the
    blob rots at rest."""
    with open(ref.path, "r+b") as fh:
        at = ref.offset + ref.length // 2
        fh.seek(at)
        byte = fh.read(1)[0]
        fh.seek(at)
        fh.write(bytes([byte ^ 1]))


def drop_blob(enc_dir: Path, index: int, encoding: str) -> None:
    """Remove shard ``index``'s ``encoding`` blob from ``enc_dir`` (its pack's index, or its
    own file): as if the shard had been received without it."""
    entries = read_index(enc_dir)
    if entries.pop((index, encoding), None) is None:
        (enc_dir / f"{index}.{encoding}").unlink()
        return
    lines = "".join(f"{i} {e} {o} {n}\n" for (i, e), (o, n) in entries.items())
    (enc_dir / PACK_INDEX).write_text(lines)


async def get_into(client: HttpLaneClient, url: str, view: memoryview, **kwargs: Any) -> None:
    """GET a whole body of exactly ``len(view)`` bytes into ``view``: ``client.receive_into``
    drained (its errors, at the same points)."""
    async with aclosing(client.receive_into(url, view, **kwargs)) as pieces:
        async for _ in pieces:
            pass
