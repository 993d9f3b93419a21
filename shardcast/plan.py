"""The shard plan of a Hugging Face-style checkpoint directory, and the manifest built from it.

A checkpoint directory holds ``config.json``, one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` when there are several) and optionally tokenizer and
generation-config files. :func:`check_layout` validates that layout; :func:`plan_shards` cuts
every file into shards of ``shard_size`` bytes (the last shard of a file may be shorter; empty
files have none); :func:`build_manifest` hashes everything in one sequential read per file.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import blake3

from p2p.errors import LocalProtocolError
from shardcast.manifest import (
    MANIFEST_FILE,
    FileEntry,
    Manifest,
    ManifestError,
    ShardEntry,
    check_file_name,
    check_run_id,
)

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 32 * 1024 * 1024


class CheckpointLayoutError(LocalProtocolError):
    """A directory that is not a valid Hugging Face-style checkpoint."""


@dataclass(frozen=True)
class PlannedShard:
    """A shard before hashing: ``length`` bytes at ``offset`` of ``file``."""

    file: str
    offset: int
    length: int


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

    Raises:
        CheckpointLayoutError: no ``config.json``; no ``*.safetensors``; several safetensors
            files without an index; an index whose weight map names files that are absent
            or omits files that are present.
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
    return names


def plan_shards(sizes: dict[str, int], shard_size: int) -> list[PlannedShard]:
    """Cut files into shards.

    Args:
        sizes: file name -> size in bytes.
        shard_size: bytes per shard (> 0).

    Returns:
        shards in sorted-name order then offset order; they tile every file exactly.
    """
    if shard_size <= 0:
        raise LocalProtocolError(f"shard_size must be > 0, got {shard_size}")
    out = []
    for name in sorted(sizes):
        for off in range(0, sizes[name], shard_size):
            out.append(PlannedShard(name, off, min(shard_size, sizes[name] - off)))
    return out


def build_manifest(
    directory: Path,
    run_id: str,
    step: int,
    shard_size: int = DEFAULT_SHARD_BYTES,
    on_shard: Callable[[ShardEntry], None] | None = None,
) -> Manifest:
    """Hash a checkpoint directory into a manifest (one sequential read of every file).

    Args:
        directory: the checkpoint directory (validated with :func:`check_layout`).
        run_id: the run identifier.
        step: the policy step of this version.
        shard_size: bytes per shard.
        on_shard: called with each shard entry as soon as it is hashed (lets an origin start
            serving before the whole checkpoint is hashed).

    Raises:
        CheckpointLayoutError: see :func:`check_layout`.
        OSError: reading failed.
    """
    check_run_id(run_id)
    names = check_layout(directory)
    sizes = {n: (directory / n).stat().st_size for n in names}
    planned = plan_shards(sizes, shard_size)
    files: list[FileEntry] = []
    shards: list[ShardEntry] = []
    buf = bytearray(shard_size)
    it = iter(planned)
    pending = next(it, None)
    for name in names:
        file_hash = blake3.blake3(max_threads=blake3.blake3.AUTO)
        with open(directory / name, "rb", buffering=0) as fh:
            while pending is not None and pending.file == name:
                view = memoryview(buf)[: pending.length]
                got = fh.readinto(view)
                if got != pending.length:
                    raise CheckpointLayoutError(f"{directory}/{name} changed while hashing")
                file_hash.update(view)
                entry = ShardEntry(
                    len(shards),
                    name,
                    pending.offset,
                    pending.length,
                    blake3.blake3(view, max_threads=blake3.blake3.AUTO).hexdigest(),
                )
                shards.append(entry)
                if on_shard is not None:
                    on_shard(entry)
                pending = next(it, None)
        files.append(FileEntry(name, sizes[name], file_hash.hexdigest()))
    return Manifest(run_id, step, shard_size, tuple(files), tuple(shards))
