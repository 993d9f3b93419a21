"""Shard plans over Hugging Face-style checkpoint directories, and the hashing pipeline.

A checkpoint directory holds ``config.json``, one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` when there are several) and optionally tokenizer and
generation-config files. :func:`check_layout` validates that layout; :func:`make_header`
describes the version (files, sizes, shard layout, delta base) without reading any data, so the
origin can sign and announce it at once; :func:`hash_parts` then reads every file once,
sequentially, and emits one :class:`~shardcast.manifest.Part` per ``shards_per_part`` shards —
with each shard's digest, its encoded forms (``zstd``, and ``xor-zstd`` against the base
version when the base has the same file at the same size) and the whole-file digests — as soon
as that part is done (pipelining: the origin serves the first shards while it hashes the rest).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import blake3

from p2p.errors import LocalProtocolError
from p2p.identity import Identity
from shardcast import codecs
from shardcast.manifest import (
    EMPTY_DIGEST,
    MANIFEST_FILE,
    SCHEMA_VERSION,
    Encoded,
    FileEntry,
    Header,
    Manifest,
    ManifestError,
    Part,
    ShardRef,
    check_file_name,
    check_run_id,
    file_root,
    sign_header,
    sign_part,
)
from shardcast.sparse import sparse_count

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 32 * 1024 * 1024
DEFAULT_SHARDS_PER_PART = 16
BLOB_DIR = ".enc"


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


@dataclass(frozen=True)
class Base:
    """The delta base offered with a version: its step, header digest and directory."""

    step: int
    digest: str
    directory: Path


def make_header(
    directory: Path,
    run_id: str,
    step: int,
    shard_size: int = DEFAULT_SHARD_BYTES,
    shards_per_part: int = DEFAULT_SHARDS_PER_PART,
    base: Base | None = None,
    schema: int = SCHEMA_VERSION,
) -> Header:
    """Describe a checkpoint directory as a version header (reads no file content).

    ``schema`` 3 (the default) has hash-list root file digests; 2 (whole-file digests) is
    for tests of old versions.

    Raises:
        CheckpointLayoutError: see :func:`check_layout`.
        ManifestError: invalid run id.
    """
    check_run_id(run_id)
    names = check_layout(directory)
    files = tuple(FileEntry(n, (directory / n).stat().st_size) for n in names)
    return Header(
        run_id,
        step,
        shard_size,
        files,
        shards_per_part,
        None if base is None else base.step,
        None if base is None else base.digest,
        os.urandom(16).hex(),
        schema,
    )


def hash_parts(
    directory: Path,
    header: Header,
    header_digest: str,
    *,
    encodings: Sequence[str] = (),
    base: Base | None = None,
    blob_dir: Path | None = None,
    zstd_level: int = codecs.DEFAULT_LEVEL,
    on_part: Callable[[Part], None],
) -> list[Part]:
    """Read every file once and emit the version's parts in order.

    Args:
        directory: the checkpoint directory described by ``header``.
        header: its header; ``header_digest`` its digest.
        encodings: encoded forms to offer: ``zstd``, ``xor-zstd``, ``sparse``. An encoded form
            is listed only if it is smaller than the raw shard; of the deltas (``xor-zstd``,
            ``sparse``) only the smallest is offered per shard (:func:`_encode_shard`).
        base: the delta base (needed for deltas; files of another size get no delta).
        blob_dir: where encoded blobs are written as ``<index>.<encoding>``.
        zstd_level: compression level.
        on_part: called with each part as soon as it is complete (in the calling thread).

    Returns:
        all parts, in order.

    Raises:
        CheckpointLayoutError: a file changed size while hashing.
        LocalProtocolError: encodings requested without ``blob_dir`` (or delta without base).
    """
    encodings = tuple(encodings)
    if encodings and blob_dir is None:
        raise LocalProtocolError("encoded shards need a blob directory")
    if any(e in codecs.DELTAS for e in encodings) and base is None:
        raise LocalProtocolError("a delta encoding needs a base version")
    if blob_dir is not None:
        blob_dir.mkdir(parents=True, exist_ok=True)
    parts: list[Part] = []
    digests: list[str] = []
    encs: list[tuple[Encoded, ...]] = []
    rooted = header.schema >= 3  # file digests are hash-list roots: no whole-file hash
    empty = file_root([]) if rooted else EMPTY_DIGEST
    file_digests = {f.name: empty for f in header.files if f.size == 0}
    buf = bytearray(header.shard_size)
    scratch = bytearray(header.shard_size if encodings else 0)

    def emit_ready() -> None:
        # part k goes out once all its shards are hashed (its files' digests are then final)
        while len(parts) < header.n_parts and len(digests) >= header.part_range(len(parts)).stop:
            k = len(parts)
            rng = header.part_range(k)
            fds = tuple(sorted((n, file_digests[n]) for n in header.files_ending_in(k)))
            part = Part(
                header.run_id,
                header.step,
                header_digest,
                k,
                tuple(digests[i] for i in rng),
                tuple(encs[i] for i in rng),
                fds,
                header.schema,
            )
            parts.append(part)
            on_part(part)

    for f in header.files:
        if f.size == 0:
            continue
        file_hash = None if rooted else blake3.blake3(max_threads=blake3.blake3.AUTO)
        first = len(digests)
        base_fh = None
        if base is not None and any(e in codecs.DELTAS for e in encodings):
            bp = base.directory / f.name
            if bp.is_file() and bp.stat().st_size == f.size:
                base_fh = open(bp, "rb", buffering=0)
        try:
            with open(directory / f.name, "rb", buffering=0) as fh:
                for ref in (s for s in header.shards if s.file == f.name):
                    view = memoryview(buf)[: ref.length]
                    if fh.readinto(view) != ref.length:
                        raise CheckpointLayoutError(f"{directory / f.name} changed while hashing")
                    if file_hash is not None:
                        file_hash.update(view)
                    digests.append(blake3.blake3(view, max_threads=blake3.blake3.AUTO).hexdigest())
                    encs.append(
                        _encode_shard(view, ref, encodings, base_fh, blob_dir, zstd_level, scratch)
                    )
                    if ref.offset + ref.length == f.size:
                        file_digests[f.name] = (
                            file_hash.hexdigest()
                            if file_hash is not None
                            else file_root(
                                [
                                    (s.length, d)
                                    for s, d in zip(
                                        header.shards[first:], digests[first:], strict=False
                                    )
                                ]
                            )
                        )
                    emit_ready()
        finally:
            if base_fh is not None:
                base_fh.close()
    emit_ready()
    return parts


# Above this share of changed 16-bit words a sparse patch is no longer the smaller delta:
# xor-zstd is tried too (dense updates, e.g. a large learning rate).
SPARSE_DENSE_FRACTION = 0.05


def _encode_shard(
    view: memoryview,
    ref: ShardRef,
    encodings: tuple[str, ...],
    base_fh: object,
    blob_dir: Path | None,
    level: int,
    scratch: bytearray,
) -> tuple[Encoded, ...]:
    """Encode one shard in each requested form; keep those smaller than raw.

    Of the deltas only the smallest is kept: ``sparse`` first (cheap: ~25 ms per 32 MiB
    here), then ``xor-zstd`` only if more than :data:`SPARSE_DENSE_FRACTION` of the words
    changed, where it can win.
    """
    blobs: dict[str, bytes] = {}
    base_view = None
    if base_fh is not None and any(e in codecs.DELTAS for e in encodings):
        base_view = memoryview(scratch)[: ref.length]
        if os.preadv(base_fh.fileno(), [base_view], ref.offset) != ref.length:  # type: ignore[attr-defined]
            base_view = None  # the base file is shorter than announced: offer no delta
    for enc in encodings:
        if enc not in codecs.ENCODINGS or enc == codecs.RAW:
            raise LocalProtocolError(f"cannot offer encoding {enc!r}")
    if base_view is not None:
        if codecs.SPARSE in encodings:
            blobs[codecs.SPARSE] = codecs.encode(codecs.SPARSE, view, base_view)
        dense = codecs.SPARSE not in blobs or (
            sparse_count(blobs[codecs.SPARSE]) > SPARSE_DENSE_FRACTION * (ref.length // 2)
        )
        if codecs.XOR_ZSTD in encodings and dense:
            # XORed in place into ``scratch`` (the base): the sparse patch is already made
            blobs[codecs.XOR_ZSTD] = codecs.encode(
                codecs.XOR_ZSTD, view, base_view, level, scratch=scratch
            )
        deltas = sorted((len(b), e) for e, b in blobs.items())
        for _, loser in deltas[1:]:
            del blobs[loser]
    if codecs.ZSTD in encodings:
        blobs[codecs.ZSTD] = codecs.encode(codecs.ZSTD, view, level=level)
    out = []
    for enc, data in blobs.items():
        if len(data) >= ref.length:  # not worth it
            continue
        assert blob_dir is not None
        path = blob_dir / f"{ref.index}.{enc}"
        with open(path, "wb") as fh:
            fh.write(data)
        out.append(Encoded(enc, len(data), blake3.blake3(data).hexdigest()))
    return tuple(out)


def build_manifest(
    directory: Path,
    run_id: str,
    step: int,
    identity: Identity,
    shard_size: int = DEFAULT_SHARD_BYTES,
    shards_per_part: int = DEFAULT_SHARDS_PER_PART,
    *,
    encodings: Sequence[str] = (),
    base: Base | None = None,
    blob_dir: Path | None = None,
    schema: int = SCHEMA_VERSION,
) -> Manifest:
    """Header, parts and signatures in one call (tests, tools); returns a complete Manifest."""
    header = make_header(directory, run_id, step, shard_size, shards_per_part, base, schema)
    signed = sign_header(header, identity)
    m = Manifest(signed)

    def add(part: Part) -> None:
        m.add_part(sign_part(part, identity))

    hash_parts(
        directory,
        header,
        signed.digest,
        encodings=encodings,
        base=base,
        blob_dir=blob_dir,
        on_part=add,
    )
    return m
