"""Strict checkpoint checks for the vLLM engine, and the check that a swap really applied.

:func:`checkpoint_shapes` reads tensor names and shapes from a checkpoint's safetensors headers
with the index checks of :mod:`rollout.model` (and rejects stray weight files, which vLLM would
load too); :func:`expected_shapes` builds the transformers model of the checkpoint's config on
the meta device; :func:`verify_applied` compares every checkpoint tensor with the weights a
running vLLM model holds after a reload — fused parameters through ``packed_modules_mapping``,
linears that the CPU backend repacked read back through their own kernel (``quant_method.apply``
on one-hot probes), every tensor covered exactly once.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM

from rollout.model import (
    CONFIG_NAME,
    CONSTRUCT_LOCK,
    CheckpointMismatch,
    indexed_shapes,
    read_tensor_shapes,
    tensor_files,
)

__all__ = [
    "checkpoint_shapes",
    "expected_shapes",
    "fused_groups",
    "read_checkpoint",
    "verify_applied",
]

_AUTO_MODEL: Any = AutoModelForCausalLM  # transformers' factory methods are untyped


def checkpoint_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape over all weight files, with the index checks of ``rollout.model``.

    Raises:
        CheckpointMismatch: missing/unreadable files, duplicate or unindexed tensors, or a
            ``*.safetensors`` file outside the layout (vLLM would load it too).
    """
    files = tensor_files(directory)
    stray = sorted(p.name for p in directory.glob("*.safetensors") if p not in files)
    if stray:  # vLLM would read them too (all *.safetensors when there is no index)
        raise CheckpointMismatch(f"{directory}: weight files outside the layout {stray[:5]}")
    return indexed_shapes(directory, files)


def expected_shapes(directory: Path) -> dict[str, tuple[int, ...]]:
    """Persistent state-dict shapes of the transformers model of ``directory``'s config
    (built on the meta device: no memory, milliseconds)."""
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointMismatch(f"{directory / CONFIG_NAME}: {exc}", str(directory)) from exc
    with CONSTRUCT_LOCK, torch.device("meta"):
        model = _AUTO_MODEL.from_config(config)
    return {name: tuple(t.shape) for name, t in model.state_dict().items()}


class _Reader:
    """Reads single tensors of a checkpoint (name → file from the headers)."""

    def __init__(self, directory: Path) -> None:
        self._where: dict[str, Path] = {}
        for path in tensor_files(directory):
            for name in read_tensor_shapes(path):
                self._where[name] = path
        self._handles: dict[Path, Any] = {}

    @property
    def names(self) -> set[str]:
        return set(self._where)

    def get(self, name: str) -> torch.Tensor:
        path = self._where[name]
        try:
            if path not in self._handles:
                self._handles[path] = safe_open(str(path), framework="pt")
            tensor: torch.Tensor = self._handles[path].get_tensor(name)
        except (OSError, SafetensorError) as exc:
            raise CheckpointMismatch(f"{path}: {exc}") from exc
        return tensor


class _Held:
    """Tensors already in memory, read like a checkpoint (:class:`_Reader`'s interface)."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self._tensors = tensors

    @property
    def names(self) -> set[str]:
        return set(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (after :func:`checkpoint_shapes`), by name.

    Raises:
        CheckpointMismatch: a file cannot be read.
    """
    reader = _Reader(directory)
    return {name: reader.get(name).contiguous() for name in sorted(reader.names)}


def fused_groups(model: Any, names: set[str]) -> dict[str, str]:
    """Checkpoint tensor name → the vLLM module it is loaded into (``packed_modules_mapping``:
    ``q_proj``/``k_proj``/``v_proj`` → ``qkv_proj``, ``gate_proj``/``up_proj`` →
    ``gate_up_proj``). vLLM processes a module once all of its tensors arrived, so a reload
    of some tensors must give every tensor of the modules they belong to."""
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    inverse = {part: fused for fused, parts in packed.items() for part in parts}
    out = {}
    for name in names:
        module, _, _kind = name.rpartition(".")
        prefix, _, leaf = module.rpartition(".")
        out[name] = f"{prefix}.{inverse.get(leaf, leaf)}".lstrip(".")
    return out


@torch.inference_mode()
def verify_applied(
    model: Any,
    directory: Path,
    columns: int,
    tensors: Mapping[str, torch.Tensor] | None = None,
) -> int:
    """Check that the engine's weights equal the checkpoint's (see module docstring).

    Args:
        model: the vLLM model (``LlamaForCausalLM`` of ``vllm.model_executor.models``).
        directory: the checkpoint it should hold.
        columns: repacked linears with more input columns than this are checked on that many
            pseudo-random columns (all rows); ``>= 1``.
        tensors: the checkpoint's tensors, already in memory (then no file is read;
            ``directory`` still names the version in errors and seeds the column choice).

    Returns:
        the number of checkpoint tensors verified (all of them).

    Raises:
        CheckpointMismatch: a value differs, a checkpoint tensor has no engine parameter, or
            an engine parameter cannot be checked.
    """
    reader: _Reader | _Held = _Reader(directory) if tensors is None else _Held(tensors)
    names = reader.names
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    covered: set[str] = set()
    for module_name, module in model.named_modules():
        prefix, _, leaf = module_name.rpartition(".")
        for kind in ("weight", "bias"):
            param = module._parameters.get(kind)
            if param is None:
                continue
            parts = (
                [f"{prefix}.{p}.{kind}".lstrip(".") for p in packed[leaf]]
                if leaf in packed
                else [f"{module_name}.{kind}"]
            )
            if not any(p in names for p in parts):
                if module_name == "lm_head" and "lm_head.weight" not in names:
                    continue  # tied to the embedding, which is checked itself
                raise CheckpointMismatch(f"{directory}: engine parameter {parts} not in checkpoint")
            if not all(p in names for p in parts):
                raise CheckpointMismatch(f"{directory}: only some of {parts} in checkpoint")
            expected = torch.cat([reader.get(p) for p in parts])
            _compare_param(module, kind, param, expected, parts, columns, directory)
            covered.update(parts)
    if covered != names:
        raise CheckpointMismatch(f"{directory}: tensors not applied {sorted(names - covered)[:5]}")
    return len(covered)


def _compare_param(
    module: Any,
    kind: str,
    param: torch.Tensor,
    expected: torch.Tensor,
    parts: list[str],
    columns: int,
    directory: Path,
) -> None:
    if param.numel() > 0:
        rows = expected.shape[0]
        same_layout = param.dim() == expected.dim() and param.shape[1:] == expected.shape[1:]
        if same_layout and param.shape[0] >= rows:  # vocabulary rows may be padded
            if torch.equal(param[:rows], expected.to(param.dtype)):
                return
            raise CheckpointMismatch(f"{directory}: engine holds other values for {parts}")
        raise CheckpointMismatch(
            f"{directory}: {parts} shape {tuple(expected.shape)}, engine {tuple(param.shape)}"
        )
    apply = getattr(getattr(module, "quant_method", None), "apply", None)
    if kind != "weight" or expected.dim() != 2 or apply is None:
        raise CheckpointMismatch(f"{directory}: cannot read back engine parameter {parts}")
    in_features = expected.shape[1]
    if in_features <= columns:
        cols = list(range(in_features))
    else:
        rng = random.Random(f"{directory}\x1f{parts[0]}")
        cols = sorted(rng.sample(range(in_features), columns))
    probe = torch.zeros(len(cols), in_features, dtype=expected.dtype)
    probe[torch.arange(len(cols)), torch.tensor(cols)] = 1
    out = apply(module, probe.to(param.dtype), None)  # [len(cols), out_features] = W[:, cols]^T
    if not torch.equal(out.t(), expected[:, cols].to(out.dtype)):
        raise CheckpointMismatch(f"{directory}: engine holds other values for {parts}")
