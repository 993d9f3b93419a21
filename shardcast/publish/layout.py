"""publish: the layout of a Hugging Face-style checkpoint directory, and its cut into shards.

A checkpoint directory holds ``config.json``, one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` when there are several) and optionally tokenizer and
generation-config files. :func:`check_layout` validates that layout (every weights file whole,
:func:`check_weights_file`) before anything is signed; :func:`plan_shards` cuts the files into
shards (sorted-name order, then offset order).
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from safetensors import SafetensorError, safe_open

from p2p.errors import LocalProtocolError
from shardcast.wire import (
    MANIFEST_FILE,
    ManifestError,
    ShardRef,
    check_file_name,
)

log = logging.getLogger(__name__)


INDEX_FILE = "model.safetensors.index.json"


class CheckpointLayoutError(LocalProtocolError):
    """A directory that is not a valid Hugging Face-style checkpoint."""


def list_files(directory: Path) -> list[str]:
    """Names of the regular files of a checkpoint directory, sorted.

    Hidden files and our own ``manifest.json`` are skipped.

    Raises:
        CheckpointLayoutError: a subdirectory, a symlink or an unsafe name.
    """
    names = []
    for entry in sorted(os.scandir(directory), key=lambda e: e.name):
        if entry.name.startswith(".") or entry.name == MANIFEST_FILE:
            continue
        if entry.is_symlink() or not entry.is_file():
            raise CheckpointLayoutError(f"{directory}/{entry.name}: only regular files allowed")
        try:
            check_file_name(entry.name)
        except ManifestError as exc:
            raise CheckpointLayoutError(f"{directory}: {exc}") from exc
        names.append(entry.name)
    return names


def check_layout(directory: Path) -> list[str]:
    """Validate a checkpoint directory and return its file names (sorted).

    Every ``*.safetensors`` file is checked to be whole (:func:`check_weights_file`), so a
    file cut short or still being written is refused before anything is signed.

    Raises:
        CheckpointLayoutError: no ``config.json``; no ``*.safetensors``; several safetensors
            files without an index; an index whose weight map names files that are absent
            or omits files that are present; a safetensors file that is not whole.
    """
    if not directory.is_dir():
        raise CheckpointLayoutError(f"{directory} is not a directory")
    names = list_files(directory)
    if "config.json" not in names:
        raise CheckpointLayoutError(f"{directory} has no config.json")
    weights = sorted(n for n in names if n.endswith(".safetensors"))
    if not weights:
        raise CheckpointLayoutError(f"{directory} has no *.safetensors file")
    if len(weights) > 1 or INDEX_FILE in names:
        if INDEX_FILE not in names:
            raise CheckpointLayoutError(
                f"{directory}: {len(weights)} safetensors files but no {INDEX_FILE}"
            )
        try:
            index = json.loads((directory / INDEX_FILE).read_text())
            mapped = set(index["weight_map"].values())
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointLayoutError(f"{directory}/{INDEX_FILE} is malformed: {exc}") from exc
        if mapped != set(weights):
            raise CheckpointLayoutError(
                f"{directory}/{INDEX_FILE} maps {sorted(mapped)} but the directory holds {weights}"
            )
    for name in weights:
        check_weights_file(directory / name)
    return names


#: a safetensors header longer than this is not one (the library's own limit is 100 MB)
MAX_SAFETENSORS_HEADER = 100_000_000


def check_weights_file(path: Path) -> None:
    """Refuse a ``*.safetensors`` file that is not whole: shorter than the 8-byte header
    length, cut short inside its header, or (checked by the ``safetensors`` library, header
    only) with tensors that do not cover the rest of the file exactly (``file not fully
    covered``: cut short, or still being written). Blocking; reads the header only.

    A file whose first 8 bytes do not declare a JSON header of a plausible length (under
    :data:`MAX_SAFETENSORS_HEADER`, starting with ``{``) is not parsed: sharding does not
    need the format, and the random bytes of test and benchmark checkpoints are no header.

    Raises:
        CheckpointLayoutError: the file is not whole, or cannot be read.
    """
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(9)
    except OSError as exc:
        raise CheckpointLayoutError(f"{path} cannot be read: {exc}") from exc
    if size < 8:
        raise CheckpointLayoutError(f"{path} holds {size} bytes: empty, or still being written")
    declared = int.from_bytes(head[:8], "little")
    if declared >= MAX_SAFETENSORS_HEADER or head[8:9] != b"{":
        return
    if 8 + declared > size:
        raise CheckpointLayoutError(
            f"{path} is cut short inside its safetensors header ({size} bytes of at least "
            f"{8 + declared}): still being written?"
        )
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, OSError) as exc:
        raise CheckpointLayoutError(
            f"{path} is not a whole safetensors file ({exc}): cut short, or still being written?"
        ) from exc


def plan_shards(sizes: dict[str, int], shard_size: int) -> list[ShardRef]:
    """Cut files into shards: sorted-name order, then offset order; they tile every file.

    Raises:
        LocalProtocolError: ``shard_size <= 0``.
    """
    if shard_size <= 0:
        raise LocalProtocolError(f"shard_size must be > 0, got {shard_size}")
    out: list[ShardRef] = []
    for name in sorted(sizes):
        for off in range(0, sizes[name], shard_size):
            out.append(ShardRef(len(out), name, off, min(shard_size, sizes[name] - off)))
    return out
