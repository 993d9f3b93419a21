"""Shared test helpers: small fake checkpoints and identities (deterministic)."""

from __future__ import annotations

import json
import random
from pathlib import Path

from p2p.identity import Identity
from p2p.trust import TrustList

TRAINER = Identity.from_seed("test-trainer")


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
