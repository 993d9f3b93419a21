"""publish: shard plans over Hugging Face-style checkpoint directories, and the hashing pipeline.

A checkpoint directory holds ``config.json``, one or more ``*.safetensors`` files (with
``model.safetensors.index.json`` when there are several) and optionally tokenizer and
generation-config files. :func:`check_layout` validates that layout; :func:`make_header`
describes the version (files, sizes, shard layout, delta base) without reading any data, so the
origin can sign and announce it at once; :func:`hash_parts` then reads every file once, file
after file (a file's shards on ``workers`` threads, results in order), and emits one
:class:`~shardcast.wire.manifest.Part` per ``shards_per_part`` shards —
with each shard's digest, its encoded forms (``zstd``, and ``xor-zstd`` against the base
version when the base has the same file at the same size) and the whole-file digests — as soon
as that part is done (pipelining: the origin serves the first shards while it hashes the rest).
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import blake3

from p2p.errors import LocalProtocolError
from p2p.identity import Identity
from shardcast.wire import (
    CHUNK_BYTES,
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
    chunk_digests,
    codecs,
    file_root,
    sign_header,
    sign_part,
    sparse_count,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 32 * 1024 * 1024
DEFAULT_SHARDS_PER_PART = 16
#: threads that hash and encode a file's shards side by side (BLAKE3, numpy's comparisons,
#: zstd and file reads release the GIL); the results do not depend on it
ENCODE_WORKERS = min(8, os.cpu_count() or 1)


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


@dataclass(frozen=True)
class EncodeSettings:
    """Everything a file's shard digests and encoded forms depend on, besides its bytes.

    Attributes:
        shard_size: bytes per shard.
        encodings: encoded forms requested (see :func:`hash_parts`).
        base: ``(step, header digest)`` of the delta base, or None.
        zstd_level: compression level.
        rooted: file digests are hash-list roots (manifest schema 3,
            :func:`shardcast.wire.manifest.file_root`), else whole-file BLAKE3 (schema 2).
        chunk_bytes: chunk size of the per-shard chunk lists written into the parts
            (:func:`shardcast.wire.manifest.chunk_digests`); 0: no chunk lists.
    """

    shard_size: int
    encodings: tuple[str, ...]
    base: tuple[int, str] | None
    zstd_level: int
    rooted: bool = True
    chunk_bytes: int = CHUNK_BYTES


@dataclass(frozen=True)
class ShardResult:
    """One shard of a file, hashed and encoded: ``length`` bytes at ``offset`` of the file,
    its BLAKE3 ``digest`` and the encoded forms kept (blobs ``<offset>.<encoding>``)."""

    offset: int
    length: int
    digest: str
    encoded: tuple[Encoded, ...]
    chunks: tuple[str, ...] = ()


@dataclass(frozen=True)
class PreEncoded:
    """A file hashed and encoded ahead of its version (:mod:`shardcast.publish.preencode`).

    Attributes:
        name: the file's name in the checkpoint directory.
        size: its size, bytes.
        settings: what the results depend on; used only if the version's are equal.
        shards: the file's shards in offset order (they tile the file).
        digest: the whole-file BLAKE3 digest.
        blob_dir: where the encoded blobs are, named ``<blob_prefix><offset>.<encoding>``.
        blob_prefix: see ``blob_dir``.
    """

    name: str
    size: int
    settings: EncodeSettings
    shards: tuple[ShardResult, ...]
    digest: str
    blob_dir: Path
    blob_prefix: str = ""

    def blob(self, offset: int, encoding: str) -> Path:
        """Path of the encoded blob of the shard at ``offset``."""
        return self.blob_dir / f"{self.blob_prefix}{offset}.{encoding}"


ShardViews = Iterator[tuple[int, memoryview, memoryview | None]]
"""``(offset, new bytes, base bytes or None)`` of each shard of a file, in offset order."""


def encode_file(
    path: Path,
    size: int,
    settings: EncodeSettings,
    base_path: Path | None,
    blob_path: Callable[[int, str], Path] | None,
    workers: int = 1,
) -> Iterator[tuple[ShardResult, str | None]]:
    """Read ``path`` once and yield each shard (offset order) hashed and encoded, with the
    file digest after its last shard (else None): the hash-list root if ``settings.rooted``,
    else the whole-file BLAKE3 (:func:`encode_views` over the file's bytes).

    Args:
        path: the file; ``size`` its expected size, bytes (nonzero).
        settings: shard size, encodings, zstd level (``settings.base`` is not read here).
        base_path: the delta base's file of the same name (deltas only if its size is equal).
        blob_path: where the blob of (shard offset, encoding) is written.
        workers: threads that read, hash, encode and write shards side by side (hash-list
            roots only; a whole-file digest is taken in one sequential pass); at most
            ``2 * workers`` shards are in flight, each worker holding two shard buffers.
            The results do not depend on it.

    Raises:
        CheckpointLayoutError: the file is shorter than ``size``.
        OSError: it cannot be read, or a blob cannot be written.
    """
    shard_size = settings.shard_size
    n = min(shard_size, size)
    base_fh = None
    if base_path is not None and any(e in codecs.DELTAS for e in settings.encodings):
        if base_path.is_file() and base_path.stat().st_size == size:
            base_fh = open(base_path, "rb", buffering=0)

    def write_blobs(shard: ShardResult, blobs: dict[str, bytes]) -> None:
        for enc, data in blobs.items():
            assert blob_path is not None  # encodings imply a blob path
            with open(blob_path(shard.offset, enc), "wb") as out:
                out.write(data)

    def read_base(offset: int, into: memoryview) -> memoryview | None:
        if base_fh is None:
            return None
        if os.preadv(base_fh.fileno(), [into], offset) != len(into):
            return None  # the base file is shorter than announced: offer no delta
        return into

    try:
        with open(path, "rb", buffering=0) as fh:
            if workers > 1 and settings.rooted:
                threaded = _encode_threaded(
                    path, fh, size, settings, read_base, write_blobs, workers
                )
                yield from threaded
                return
            buf = bytearray(n)
            scratch = bytearray(n if settings.encodings else 0)

            def views() -> ShardViews:
                for offset in range(0, size, shard_size):
                    length = min(shard_size, size - offset)
                    view = memoryview(buf)[:length]
                    if fh.readinto(view) != length:
                        raise CheckpointLayoutError(f"{path} changed while hashing")
                    yield offset, view, read_base(offset, memoryview(scratch)[:length])

            for shard, blobs, file_digest in encode_views(views(), size, settings, scratch):
                write_blobs(shard, blobs)
                yield shard, file_digest
    finally:
        if base_fh is not None:
            base_fh.close()


def _encode_threaded(
    path: Path,
    fh: BinaryIO,
    size: int,
    settings: EncodeSettings,
    read_base: Callable[[int, memoryview], memoryview | None],
    write_blobs: Callable[[ShardResult, dict[str, bytes]], None],
    workers: int,
) -> Iterator[tuple[ShardResult, str | None]]:
    """:func:`encode_file`'s shards on ``workers`` threads (hash-list roots only): each thread
    reads its shard (and the base's) with ``preadv`` into its own two buffers, hashes,
    encodes and writes the blobs; results in offset order (:func:`in_order`)."""
    shard_size = settings.shard_size
    n = min(shard_size, size)
    local = threading.local()

    def one(offset: int) -> ShardResult:
        bufs = getattr(local, "bufs", None)
        if bufs is None:  # new bytes; base bytes, XORed in place (scratch)
            bufs = local.bufs = (bytearray(n), bytearray(n if settings.encodings else 0))
        length = min(shard_size, size - offset)
        view = memoryview(bufs[0])[:length]
        if os.preadv(fh.fileno(), [view], offset) != length:
            raise CheckpointLayoutError(f"{path} changed while hashing")
        base_view = read_base(offset, memoryview(bufs[1])[:length])
        shard, blobs = encode_shard(offset, view, base_view, settings, bufs[1])
        write_blobs(shard, blobs)
        return shard

    shard_list: list[tuple[int, str]] = []
    for shard in in_order(one, range(0, size, shard_size), workers):
        shard_list.append((shard.length, shard.digest))
        done = shard.offset + shard.length == size
        yield shard, file_root(shard_list) if done else None


def in_order(work: Callable[[int], _T], offsets: Iterable[int], workers: int) -> Iterator[_T]:
    """``work(offset)`` for each offset on ``workers`` threads, yielded in ``offsets`` order,
    with at most ``2 * workers`` calls started ahead of the consumer (bounded memory). An
    exception of a call is raised when its result's turn comes; the pool then waits for the
    calls already started and runs no more."""
    it = iter(offsets)
    with ThreadPoolExecutor(workers, thread_name_prefix="encode") as pool:
        ahead = deque(pool.submit(work, o) for o in itertools.islice(it, 2 * workers))
        while ahead:
            result = ahead.popleft().result()
            for o in itertools.islice(it, 1):
                ahead.append(pool.submit(work, o))
            yield result


def encode_views(
    views: ShardViews,
    size: int,
    settings: EncodeSettings,
    scratch: bytearray,
) -> Iterator[tuple[ShardResult, dict[str, bytes], str | None]]:
    """Hash and encode a file of ``size`` bytes given shard by shard, as :func:`encode_file`
    (which reads them from disk) and :mod:`shardcast.publish.inmemory` (which takes them from
    bytes held in memory) do: the same code, so the same digests and blobs. Pure but for
    ``scratch`` (and whatever ``views`` does).

    Args:
        views: the shards (they must tile ``[0, size)`` in order; ``settings.shard_size``
            bytes each, the last shorter). A base view may be a view of ``scratch`` (then it
            is XORed in place); any other base view is only read.
        size: the file's size, bytes.
        settings: shard size, encodings, zstd level (``settings.base`` is not read here).
        scratch: at least one shard of bytes for the XOR (overwritten).

    Yields:
        ``(shard, {encoding: blob}, file digest or None)``: the shard's result (its
        ``encoded`` entries are the blobs' sizes and BLAKE3 digests; the blobs are to be
        stored as the blob of (offset, encoding)), and after the last shard the file digest:
        the hash-list root if ``settings.rooted``, else the whole-file BLAKE3.

    Raises:
        LocalProtocolError: an encoding that cannot be offered.
    """
    file_hash = None if settings.rooted else blake3.blake3(max_threads=blake3.blake3.AUTO)
    shard_list: list[tuple[int, str]] = []
    for offset, view, base_view in views:
        if file_hash is not None:
            file_hash.update(view)
        shard, blobs = encode_shard(offset, view, base_view, settings, scratch)
        shard_list.append((shard.length, shard.digest))
        file_digest = None
        if offset + shard.length == size:
            file_digest = file_root(shard_list) if file_hash is None else file_hash.hexdigest()
        yield shard, blobs, file_digest


def encode_shard(
    offset: int,
    view: memoryview,
    base_view: memoryview | None,
    settings: EncodeSettings,
    scratch: bytearray,
) -> tuple[ShardResult, dict[str, bytes]]:
    """Hash and encode the shard at ``offset`` (see :func:`encode_views`; pure but for
    ``scratch``, safe to call from several threads with a scratch each).

    Raises:
        LocalProtocolError: an encoding that cannot be offered.
    """
    digest = blake3.blake3(view, max_threads=blake3.blake3.AUTO).hexdigest()
    chunks = chunk_digests(view, settings.chunk_bytes) if settings.chunk_bytes else ()
    blobs = shard_blobs(view, base_view, settings.encodings, settings.zstd_level, scratch)
    encoded = tuple(
        Encoded(enc, len(data), blake3.blake3(data).hexdigest()) for enc, data in blobs.items()
    )
    return ShardResult(offset, len(view), digest, encoded, chunks), blobs


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
        shards = encode_file(directory / f.name, f.size, settings, base_path, blob_path, workers)
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


# Above this share of changed 16-bit words a sparse patch is no longer the smaller delta:
# xor-zstd is tried too (dense updates, e.g. a large learning rate).
SPARSE_DENSE_FRACTION = 0.05


def shard_blobs(
    view: memoryview,
    base_view: memoryview | None,
    encodings: tuple[str, ...],
    level: int,
    scratch: bytearray,
) -> dict[str, bytes]:
    """The encoded forms of one shard worth offering (pure but for ``scratch``).

    Of the deltas (only with ``base_view``, the same byte range of the base version) only the
    smallest is kept: ``sparse`` first (cheap: ~25 ms per 32 MiB here), then ``xor-zstd`` only
    if more than :data:`SPARSE_DENSE_FRACTION` of the words changed, where it can win. Forms
    not smaller than the raw shard are dropped.

    Args:
        view: the shard's bytes.
        base_view: the base's bytes of the same range, or None (no delta). It may be a view of
            ``scratch`` (then XORed in place); any other buffer is only read.
        encodings: the forms requested (not ``raw``).
        level: zstd level.
        scratch: at least ``len(view)`` bytes for the XOR (overwritten).

    Returns:
        encoding -> blob.

    Raises:
        LocalProtocolError: an encoding that cannot be offered.
    """
    for enc in encodings:
        if enc not in codecs.ENCODINGS or enc == codecs.RAW:
            raise LocalProtocolError(f"cannot offer encoding {enc!r}")
    blobs: dict[str, bytes] = {}
    if base_view is not None and any(e in codecs.DELTAS for e in encodings):
        if codecs.SPARSE in encodings:
            blobs[codecs.SPARSE] = codecs.encode(codecs.SPARSE, view, base_view)
        dense = codecs.SPARSE not in blobs or (
            sparse_count(blobs[codecs.SPARSE]) > SPARSE_DENSE_FRACTION * (len(view) // 2)
        )
        if codecs.XOR_ZSTD in encodings and dense:
            # into ``scratch`` (in place when the base is read there): sparse is already made
            blobs[codecs.XOR_ZSTD] = codecs.encode(
                codecs.XOR_ZSTD, view, base_view, level, scratch=scratch
            )
        deltas = sorted((len(b), e) for e, b in blobs.items())
        for _, loser in deltas[1:]:
            del blobs[loser]
    if codecs.ZSTD in encodings:
        blobs[codecs.ZSTD] = codecs.encode(codecs.ZSTD, view, level=level)
    return {enc: data for enc, data in blobs.items() if len(data) < len(view)}


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
