"""Checkpoints for the broadcast benchmark's scaling run: a large preset written tensor by
tensor, and its next version with a given number of changed bf16 elements.

Theory of operation
-------------------
The question the scaling run answers is how a next version's time grows with the size of
the checkpoint when the change does not: RL steps change a number of weights set by the
optimizer and the data, and the data plane should cost what changed. So the larger
checkpoint's next version changes **the same number** of bf16 elements as ``real-1b``'s
(measured there after one real Adam step, ``trainer/evolve.py``), not the same fraction.

- :func:`write_checkpoint` writes a preset (``real-6b``: 6.03 GB) in the Hugging Face layout
  without building the model in memory: names and shapes come from the model built on the
  ``meta`` device, each weight file's tensors are drawn (seeded normal, std 0.02, directly in
  bf16) and saved, then dropped; peak memory is one weight file. Every tensor, norms
  included, is random: the values do not matter to a broadcast, and the files load with
  ``rollout.model.load_model`` like any checkpoint.
- :func:`write_next` copies it and flips the lowest mantissa bit (a one-ulp step, as a small
  Adam update makes) of exactly ``changed`` bf16 elements drawn uniformly without
  replacement over every tensor (seeded), so the changes spread over tensors in proportion
  to their sizes; file layout and headers stay the same, so deltas line up shard by shard.
- :func:`preset_bytes` is the size arithmetic (from the ``meta`` model; nothing written).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import struct
from pathlib import Path

import numpy as np

__all__ = ["SCALED_PRESETS", "changed_elements", "preset_bytes", "write_checkpoint", "write_next"]

SCALED_PRESETS = frozenset({"real-6b"})
"""Presets generated here (their next version: :func:`write_next`), not by ``checkpoint
generate``/``evolve`` (an fp32 build and an Adam step of ``real-6b`` need ~12-30 GB)."""

_BF16 = "BF16"


def _meta_state(preset: str) -> tuple[object, list[tuple[str, tuple[int, ...]]]]:
    """The preset's model on the ``meta`` device (no memory) and its stored tensors' names
    and shapes in state-dict order."""
    import torch
    from transformers import AutoModelForCausalLM

    from rollout.model import preset_config

    factory: object = AutoModelForCausalLM
    with torch.device("meta"):
        model = factory.from_config(preset_config(preset), dtype=torch.bfloat16)  # type: ignore[attr-defined]
    return model, [(n, tuple(t.shape)) for n, t in model.state_dict().items()]


def preset_bytes(preset: str) -> int:
    """Bytes of the preset's weights in bf16 (tensor data only, headers excluded)."""
    _, shapes = _meta_state(preset)
    return sum(2 * math.prod(s) for _, s in shapes)


def write_checkpoint(preset: str, out: Path, max_shard_bytes: int, seed: int = 0) -> int:
    """Write ``preset`` with seeded random bf16 weights as a checkpoint directory ``out``
    (created; must not exist), weight files of at most ``max_shard_bytes`` of tensors.

    Returns:
        bytes of all files written.
    """
    import torch
    from safetensors.torch import save_file

    from rollout.model import INDEX_NAME, build_tokenizer, shard_name
    from trainer.checkpoint import config_json, plan_shards

    model, shapes = _meta_state(preset)
    out.mkdir(parents=True)
    plan = plan_shards([(n, 2 * math.prod(s)) for n, s in shapes], max_shard_bytes)
    shape_of = dict(shapes)
    gen = torch.Generator().manual_seed(seed)
    weight_map: dict[str, str] = {}
    for k, names in enumerate(plan, start=1):
        name = shard_name(k, len(plan))
        tensors = {
            n: torch.empty(shape_of[n], dtype=torch.bfloat16).normal_(0.0, 0.02, generator=gen)
            for n in names
        }
        save_file(tensors, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, name))
        del tensors
    index = {
        "metadata": {"total_size": sum(2 * math.prod(s) for _, s in shapes)},
        "weight_map": weight_map,
    }
    (out / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (out / "config.json").write_text(config_json(model))  # type: ignore[arg-type]
    generation = getattr(model, "generation_config", None)
    if generation is not None:
        (out / "generation_config.json").write_text(generation.to_json_string(use_diff=True))
    build_tokenizer().save_pretrained(str(out))
    return sum(p.stat().st_size for p in out.iterdir())


def _tensor_words(path: Path) -> list[tuple[int, int]]:
    """``(first 16-bit word in the file, words)`` of each tensor of a safetensors file.

    Raises:
        ValueError: a tensor that is not bf16, or a misaligned data section.
    """
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    start = 8 + n
    if start % 2:
        raise ValueError(f"{path}: data section at odd offset {start}")
    out = []
    for name, t in sorted(header.items()):
        if name == "__metadata__":
            continue
        if t["dtype"] != _BF16:
            raise ValueError(f"{path}: {name} is {t['dtype']}, not {_BF16}")
        a, b = t["data_offsets"]
        out.append(((start + a) // 2, (b - a) // 2))
    return sorted(out)


def write_next(v0: Path, v1: Path, changed: int, seed: int = 1) -> int:
    """Write ``v1`` (created; must not exist): ``v0`` with the lowest bit of exactly
    ``changed`` bf16 elements flipped (module docstring); other files are hard links.

    Returns:
        the elements changed (``changed``).

    Raises:
        ValueError: ``changed`` is negative or more than the checkpoint's elements; a
            weight file that is not all bf16.
    """
    weights = sorted(p.name for p in v0.iterdir() if p.name.endswith(".safetensors"))
    spans = [(name, first, words) for name in weights for first, words in _tensor_words(v0 / name)]
    total = sum(w for _, _, w in spans)
    if not 0 <= changed <= total:
        raise ValueError(f"changed={changed}: not within 0..{total} elements")
    rng = np.random.default_rng(seed)
    picked = np.unique(rng.integers(0, total, size=changed + changed // 50 + 16, dtype=np.int64))
    while picked.size < changed:  # a rare top-up after collisions
        more = rng.integers(0, total, size=changed - picked.size + 16, dtype=np.int64)
        picked = np.unique(np.concatenate([picked, more]))
    picked = np.sort(rng.permutation(picked)[:changed])
    v1.mkdir(parents=True)
    for f in v0.iterdir():
        if f.name not in weights:
            os.link(f, v1 / f.name)
    ends = np.cumsum([w for _, _, w in spans])
    # picked is sorted and spans are in the same order: span k's elements are one slice
    cut = np.searchsorted(picked, np.concatenate([[0], ends]))
    for name in weights:
        shutil.copyfile(v0 / name, v1 / name)
        words = np.memmap(v1 / name, dtype="<u2", mode="r+")
        for k, (span_file, first, w) in enumerate(spans):
            if span_file == name:
                mine = picked[cut[k] : cut[k + 1]] - (ends[k] - w)  # element within the tensor
                words[first + mine] ^= 1
        words.flush()
        del words
    return changed


def changed_elements(v0: Path, v1: Path) -> int:
    """bf16 elements that differ between two checkpoints with the same weight files."""
    diff = 0
    for f in sorted(v0.glob("*.safetensors")):
        a = np.memmap(f, dtype="<u2", mode="r")
        b = np.memmap(v1 / f.name, dtype="<u2", mode="r")
        for first, words in _tensor_words(f):
            diff += int(np.count_nonzero(a[first : first + words] != b[first : first + words]))
    return diff
