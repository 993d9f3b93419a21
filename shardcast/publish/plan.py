"""publish: a version's header and signed parts from a checkpoint directory (the hashing
pipeline).

:func:`make_header` describes the version (files, sizes, shard layout, delta base) without
reading any data but the safetensors headers (:func:`shardcast.publish.layout.check_layout`),
so the origin can sign and announce it at once; :func:`hash_parts` then reads every file once,
file after file (a file's shards on ``workers`` threads, results in order,
:func:`shardcast.publish.encode.encode_file`), and emits one
:class:`~shardcast.wire.manifest.Part` per ``shards_per_part`` shards — with each shard's
digest, its encoded forms (``zstd``; ``sparse`` or ``xor-zstd`` against the base version when
the base has the same file at the same size) and the whole-file digests — as soon as that part
is done (pipelining: the origin serves the first shards while it hashes the rest). Files
encoded ahead (:mod:`shardcast.publish.preencode`) are linked in, not read again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from p2p.errors import LocalProtocolError
from p2p.identity import Identity
from shardcast.publish.encode import (
    EncodeSettings,
    KnownShards,
    PreEncoded,
    ShardResult,
    encode_file,
)
from shardcast.publish.layout import check_layout
from shardcast.wire import (
    CHUNK_BYTES,
    EMPTY_DIGEST,
    SCHEMA_VERSION,
    Encoded,
    FileEntry,
    Header,
    Manifest,
    Part,
    check_run_id,
    codecs,
    file_root,
    sign_header,
    sign_part,
)

log = logging.getLogger(__name__)


DEFAULT_SHARD_BYTES = 32 * 1024 * 1024
#: shards per signed manifest part: no byte of a shard moves before its part is hashed and
#: signed, so smaller parts mean earlier first bytes (and more part requests)
DEFAULT_SHARDS_PER_PART = 4
#: shards per part of a version offered as a delta: its bytes to move are small, so every part
#: costs each follower more in requests (a part long-poll and a blob batch) than it saves in
#: first bytes, and its last part goes out when its last shard is encoded either way
DEFAULT_DELTA_SHARDS_PER_PART = 16


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
    """Describe a checkpoint directory as a version header (reads no file content but the
    safetensors headers, :func:`check_layout`).

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
    pre_encoded: Mapping[str, PreEncoded] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
    workers: int = 1,
    known: Mapping[str, KnownShards] | None = None,
) -> list[Part]:
    """Read every file once and emit the version's parts as they complete.

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
        pre_encoded: files already hashed and encoded (:mod:`shardcast.publish.preencode`), by name;
            the caller vouches that each still has the bytes it had then. One is used (its
            blobs hard-linked into ``blob_dir``, nothing read) only if its size and
            :class:`EncodeSettings` are this version's; any other file is read here. The
            parts are the same either way. Files used this way go first: parts they complete
            are emitted at once, so part indices may be emitted out of order.
        chunk_bytes: chunk size of the parts' chunk lists (schema 3 only; 0: none).
        workers: threads that encode a file's shards side by side (:func:`encode_file`);
            the parts do not depend on it.
        known: by name, shards of the files read here encoded while they were being written
            (used where the bytes hash the same again: :func:`encode_file`); same parts.

    Returns:
        all parts, in index order.

    Raises:
        CheckpointLayoutError: a file changed size while hashing.
        LocalProtocolError: encodings requested without ``blob_dir`` (or delta without base).
    """
    encodings = tuple(encodings)
    _check_outputs(encodings, base, blob_dir)
    settings = EncodeSettings(
        header.shard_size,
        encodings,
        None if base is None else (base.step, base.digest),
        zstd_level,
        header.schema >= 3,
        chunk_bytes,
    )
    parts = _PartAssembler(header, header_digest, settings, on_part)
    first_shard: dict[str, int] = {}
    for ref in header.shards:
        first_shard.setdefault(ref.file, ref.index)
    todo = [
        f
        for f in header.files
        if f.size and not parts.take_pre_encoded(f, first_shard[f.name], pre_encoded, blob_dir)
    ]
    parts.emit_ready()

    for f in todo:
        first = first_shard[f.name]
        base_path = None if base is None else base.directory / f.name
        blob_path = _blob_path_of(blob_dir, first, header.shard_size)
        path, ahead = directory / f.name, (known or {}).get(f.name)
        shards = encode_file(path, f.size, settings, base_path, blob_path, workers, ahead)
        for j, (shard, file_digest) in enumerate(shards):
            parts.shard_done(first + j, shard)
            if file_digest is not None:
                parts.file_done(f.name, file_digest)
            parts.emit_ready()
    parts.emit_ready()
    return parts.in_order()


def _check_outputs(encodings: tuple[str, ...], base: Base | None, blob_dir: Path | None) -> None:
    """:func:`hash_parts`' argument checks; creates ``blob_dir``.

    Raises:
        LocalProtocolError: encodings without ``blob_dir``, or a delta without ``base``.
    """
    if encodings and blob_dir is None:
        raise LocalProtocolError("encoded shards need a blob directory")
    if any(e in codecs.DELTAS for e in encodings) and base is None:
        raise LocalProtocolError("a delta encoding needs a base version")
    if blob_dir is not None:
        blob_dir.mkdir(parents=True, exist_ok=True)


def _blob_path_of(blob_dir: Path | None, first: int, shard_size: int) -> Callable[[int, str], Path]:
    """Where a file whose first shard is ``first`` puts the blob of the shard at ``offset``."""

    def path(offset: int, encoding: str) -> Path:
        assert blob_dir is not None
        return blob_dir / f"{first + offset // shard_size}.{encoding}"

    return path


class _PartAssembler:
    """The parts of one version as its shards and files are hashed, in any order.

    Part ``k`` goes out (``on_part``) once all its shards are hashed and the digests of the
    files ending in it are final; parts are emitted as soon as they are complete, so indices
    may be emitted out of order (see :func:`hash_parts`).
    """

    def __init__(
        self,
        header: Header,
        header_digest: str,
        settings: EncodeSettings,
        on_part: Callable[[Part], None],
    ) -> None:
        self.header = header
        self.header_digest = header_digest
        self.settings = settings
        self.on_part = on_part
        n = len(header.shards)
        self.digests: list[str | None] = [None] * n
        self.encs: list[tuple[Encoded, ...]] = [()] * n
        self.chunk_lists: list[tuple[str, ...]] = [()] * n
        empty = file_root([]) if settings.rooted else EMPTY_DIGEST
        self.file_digests = {f.name: empty for f in header.files if f.size == 0}
        sizes = {f.name: f.size for f in header.files}
        self.ending: dict[int, list[str]] = {k: [] for k in range(header.n_parts)}
        for ref in header.shards:
            if ref.offset + ref.length == sizes[ref.file]:
                self.ending[ref.index // header.shards_per_part].append(ref.file)
        self.ending[0] += [f.name for f in header.files if f.size == 0]
        self.parts: dict[int, Part] = {}
        self.next_check = 0  # parts below this one are emitted

    def shard_done(self, index: int, shard: ShardResult) -> None:
        """Shard ``index`` is hashed (and encoded)."""
        self.digests[index] = shard.digest
        self.encs[index] = shard.encoded
        self.chunk_lists[index] = shard.chunks

    def take_pre_encoded(
        self,
        f: FileEntry,
        first: int,
        pre_encoded: Mapping[str, PreEncoded] | None,
        blob_dir: Path | None,
    ) -> bool:
        """Take file ``f`` (first shard ``first``) from ``pre_encoded`` if it can be used
        (:func:`_use_pre_encoded`); returns False if it must be read."""
        pre = (pre_encoded or {}).get(f.name)
        if pre is None or not _use_pre_encoded(pre, f.size, self.settings, first, blob_dir):
            return False
        for j, shard in enumerate(pre.shards):
            self.shard_done(first + j, shard)
        self.file_done(f.name, pre.digest)
        return True

    def file_done(self, name: str, digest: str) -> None:
        """File ``name``'s digest is final."""
        self.file_digests[name] = digest

    def emit_ready(self) -> None:
        """Emit every part not emitted yet whose shards and ending files are all done."""
        header = self.header
        for k in range(self.next_check, header.n_parts):
            if k not in self.parts and self._ready(k):
                part = self._part(k)
                self.parts[k] = part
                self.on_part(part)
        while self.next_check in self.parts:
            self.next_check += 1

    def in_order(self) -> list[Part]:
        """Every emitted part, in index order."""
        return [self.parts[k] for k in sorted(self.parts)]

    def _ready(self, k: int) -> bool:
        rng = self.header.part_range(k)
        return all(self.digests[i] is not None for i in rng) and all(
            f in self.file_digests for f in self.ending[k]
        )

    def _part(self, k: int) -> Part:
        header, rng = self.header, self.header.part_range(k)
        fds = tuple(sorted((f, self.file_digests[f]) for f in self.ending[k]))
        listed = self.settings.rooted and all(self.chunk_lists[i] for i in rng)
        return Part(
            header.run_id,
            header.step,
            self.header_digest,
            k,
            tuple(d for d in self.digests[rng.start : rng.stop] if d is not None),
            tuple(self.encs[i] for i in rng),
            fds,
            header.schema,
            self.settings.chunk_bytes if listed else 0,
            tuple(self.chunk_lists[i] for i in rng) if listed else (),
        )


def _use_pre_encoded(
    pre: PreEncoded, size: int, settings: EncodeSettings, first: int, blob_dir: Path | None
) -> bool:
    """True if ``pre`` fits this version and its blobs are now linked into ``blob_dir`` as
    ``<index>.<encoding>``; False (nothing linked that matters) if the file must be read."""
    if pre.size != size or pre.settings != settings:
        return False
    expect = list(range(0, size, settings.shard_size))
    if [s.offset for s in pre.shards] != expect:
        return False
    try:
        for j, shard in enumerate(pre.shards):
            for e in shard.encoded:
                assert blob_dir is not None  # encodings imply a blob dir (checked above)
                target = blob_dir / f"{first + j}.{e.encoding}"
                target.unlink(missing_ok=True)
                os.link(pre.blob(shard.offset, e.encoding), target)
    except OSError as exc:  # the cache was removed meanwhile: read the file instead
        log.warning("pre_encoded_unusable file=%s error=%s", pre.name, exc)
        return False
    return True


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
