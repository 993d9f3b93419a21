"""Checkpoint writer: the trainer's model → a Hugging Face layout directory.

Theory of operation
-------------------
The trainer keeps float32 master weights and publishes each version cast to bf16 in the
layout that transformers and vLLM load as is, and that ``rollout.model.load_model`` checks:

* ``config.json`` (``dtype`` set to the published dtype, ``architectures`` filled in),
  ``generation_config.json``, the tokenizer's files;
* weights: one ``model.safetensors`` when everything fits in ``max_shard_bytes``, else shards
  ``model-0000k-of-0000N.safetensors`` plus ``model.safetensors.index.json``
  (``{"metadata": {"total_size": ...}, "weight_map": {name: file}}``).

Shards are planned the way ``transformers.save_pretrained`` does it (tensors in state-dict
order; a new shard starts when the next tensor would overflow the current one; a tensor
larger than the cap gets a shard of its own), but written here with ``safetensors`` directly:
no progress bars, no renaming, and bytes that depend only on the tensors and the
transformers/tokenizers versions (JSON keys sorted; the safetensors header is canonical).

:func:`weight_files` is the plan with the tensors cast, before anything is written; the
trainer hands the same :class:`WeightFile` objects to :func:`save_checkpoint` and, through
:func:`file_bytes`, to the origin's in-memory encoder, which hashes and delta-encodes the
version from them while the files are written (:mod:`shardcast.publish.inmemory`).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedTokenizerFast

from p2p.errors import LocalProtocolError
from rollout.model import (
    CONFIG_NAME,
    INDEX_NAME,
    SINGLE_WEIGHTS_NAME,
    build_model,
    build_tokenizer,
    preset_config,
    shard_name,
    stored_state,
)
from rollout.model_dir import ASSET_NAMES
from shardcast.publish import FileBytes, TensorBytes, safetensors_file, safetensors_header

__all__ = [
    "WeightFile",
    "config_json",
    "file_bytes",
    "plan_shards",
    "save_checkpoint",
    "weight_files",
    "write_preset_dir",
]

_COMPLETE = ".complete"
METADATA = {"format": "pt"}  #: the safetensors metadata of every weight file written here

#: torch dtype -> safetensors dtype code, for the dtypes :mod:`shardcast.publish.inmemory` lays out
_DTYPE_CODES = {
    torch.bool: "BOOL",
    torch.uint8: "U8",
    torch.int8: "I8",
    torch.int16: "I16",
    torch.uint16: "U16",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int32: "I32",
    torch.uint32: "U32",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.uint64: "U64",
}


@dataclass(frozen=True)
class WeightFile:
    """One safetensors file of a checkpoint before it is written.

    Attributes:
        name: its file name (``model.safetensors`` or ``model-0000k-of-0000N.safetensors``).
        tensors: name -> CPU, contiguous tensor in the published dtype, in write order.
    """

    name: str
    tensors: dict[str, torch.Tensor]


def weight_files(
    model: torch.nn.Module,
    max_shard_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    copy: bool = False,
) -> list[WeightFile]:
    """The weight files :func:`save_checkpoint` writes for ``model`` cast to ``dtype``.

    Args:
        model: a transformers causal LM.
        max_shard_bytes: cap on one file's tensor bytes (see :func:`plan_shards`).
        dtype: published dtype.
        copy: give every tensor storage of its own even where the cast is a no-op (a caller
            that keeps them while the model trains on must not hold views of its parameters).

    Raises:
        LocalProtocolError: ``max_shard_bytes < 1``.
    """
    state = {
        name: tensor.detach().to(device="cpu", dtype=dtype, copy=copy).contiguous()
        for name, tensor in stored_state(model).items()
    }
    sizes = [(name, t.numel() * t.element_size()) for name, t in state.items()]
    plan = plan_shards(sizes, max_shard_bytes)
    if len(plan) == 1:
        return [WeightFile(SINGLE_WEIGHTS_NAME, state)]
    return [
        WeightFile(shard_name(k, len(plan)), {n: state[n] for n in names})
        for k, names in enumerate(plan, start=1)
    ]


def file_bytes(weights: WeightFile) -> tuple[FileBytes, bytes] | None:
    """The bytes :func:`save_checkpoint` writes for ``weights``, as the tensors' own memory
    laid out by the safetensors header (:mod:`shardcast.publish.inmemory`), with that header;
    None if a tensor has a dtype the layout does not cover (the file is then hashed from
    disk). The caller checks the written file's header against it
    (:func:`shardcast.publish.header_matches`) before trusting the layout.
    """
    tensors: dict[str, TensorBytes] = {}
    for name, t in weights.tensors.items():
        code = _DTYPE_CODES.get(t.dtype)
        if code is None:
            return None
        raw = t.reshape(-1).view(torch.uint8).numpy().data
        tensors[name] = TensorBytes(code, tuple(t.shape), raw)
    header = safetensors_header(list(tensors.items()), METADATA)
    layout = safetensors_file(weights.name, header, {n: t.data for n, t in tensors.items()})
    return layout, header


def plan_shards(sizes: Sequence[tuple[str, int]], max_shard_bytes: int) -> list[list[str]]:
    """Group tensors into shards of at most ``max_shard_bytes`` (pure).

    Args:
        sizes: ``(name, size_bytes)`` in the order they are written.
        max_shard_bytes: the cap; a tensor larger than it gets a shard of its own.

    Returns:
        Names per shard, in order; never an empty shard.

    Raises:
        LocalProtocolError: ``max_shard_bytes < 1``.
    """
    if max_shard_bytes < 1:
        raise LocalProtocolError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    shards: list[list[str]] = []
    current: list[str] = []
    current_bytes = 0
    for name, size in sizes:
        if current and current_bytes + size > max_shard_bytes:
            shards.append(current)
            current, current_bytes = [], 0
        current.append(name)
        current_bytes += size
    if current:
        shards.append(current)
    return shards


def save_checkpoint(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerFast,
    directory: str | Path,
    max_shard_bytes: int,
    dtype: torch.dtype = torch.bfloat16,
    assets_from: Path | None = None,
    weights: Sequence[WeightFile] | None = None,
) -> list[Path]:
    """Write ``model`` (cast to ``dtype``) and ``tokenizer`` as a checkpoint directory.

    Args:
        model: a transformers causal LM (any parameter dtype; the trainer's is float32).
        tokenizer: saved with ``save_pretrained`` beside the weights.
        directory: created if absent; must not contain files already (stale shards of an
            earlier layout would otherwise be mixed in).
        max_shard_bytes: cap on one weight file's tensor bytes (header excluded).
        dtype: published dtype (bf16 for inference peers).
        assets_from: a model directory whose tokenizer, chat template and generation config
            (``rollout.model_dir.ASSET_NAMES``) are copied verbatim instead of being written
            from ``tokenizer`` and the model: every version then carries the same bytes.
        weights: the weight files already planned and cast (:func:`weight_files` of the same
            model, ``max_shard_bytes`` and ``dtype``); planned here when None.

    Returns:
        Every file written, sorted by name.

    Raises:
        LocalProtocolError: ``directory`` is a non-empty directory or a file, or
            ``max_shard_bytes < 1``.

    Not safe to call concurrently on the same directory. An exception part-way leaves a
    partial directory that the caller should remove; a reader rejects it (missing files).
    """
    directory = Path(directory)
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise LocalProtocolError(f"checkpoint directory {directory} exists and is not empty")
    directory.mkdir(parents=True, exist_ok=True)
    files = weight_files(model, max_shard_bytes, dtype) if weights is None else list(weights)
    for wf in files:
        save_file(wf.tensors, str(directory / wf.name), metadata=METADATA)
    if len(files) > 1:
        weight_map = {n: wf.name for wf in files for n in wf.tensors}
        total = sum(t.numel() * t.element_size() for wf in files for t in wf.tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        index_path = directory / INDEX_NAME
        index_path.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    _write_configs(model, directory, dtype)
    if assets_from is None:
        tokenizer.save_pretrained(str(directory))
    else:
        for name in ASSET_NAMES:
            if (assets_from / name).is_file():
                shutil.copyfile(assets_from / name, directory / name)
    return sorted(p for p in directory.iterdir() if p.is_file())  # the directory began empty


def config_json(model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> str:
    """The ``config.json`` text :func:`save_checkpoint` writes for ``model`` (published as
    ``dtype``); the run card's architecture digest is computed from it."""
    hf_model: Any = model  # a transformers PreTrainedModel
    config = copy.deepcopy(hf_model.config)
    config.dtype = dtype
    config.architectures = [type(model).__name__]
    return str(config.to_json_string(use_diff=True))


def _write_configs(model: torch.nn.Module, directory: Path, dtype: torch.dtype) -> None:
    hf_model: Any = model  # a transformers PreTrainedModel
    (directory / CONFIG_NAME).write_text(config_json(model, dtype))
    generation_config = getattr(hf_model, "generation_config", None)
    if generation_config is not None:
        generation_path = directory / "generation_config.json"
        generation_path.write_text(generation_config.to_json_string(use_diff=True))


def write_preset_dir(preset: str, seed: int, directory: str | Path) -> Path:
    """Write a preset (seeded random fp32 weights, the character tokenizer) as an ordinary
    model directory, which the trainer then loads like any ``--model PATH``.

    Idempotent: a complete directory (marked by a hidden ``.complete`` file, which the shard
    plan skips) is reused. Built in a temporary sibling and renamed, so a crash never leaves a
    half-written directory under ``directory``.

    Returns:
        ``directory``.

    Raises:
        ConfigError: unknown preset.
    """
    directory = Path(directory)
    if (directory / _COMPLETE).is_file():
        return directory
    preset_config(preset)  # ConfigError before any work
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    try:
        model = build_model(preset, seed, dtype=torch.float32)
        save_checkpoint(model, build_tokenizer(), tmp, 1 << 62, dtype=torch.float32)
        (tmp / _COMPLETE).write_text(json.dumps({"preset": preset, "seed": seed}) + "\n")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(tmp, directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return directory
