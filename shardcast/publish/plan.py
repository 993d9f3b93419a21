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

import functools
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
import numpy as np
from safetensors import SafetensorError, safe_open

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
    changed_words,
    check_file_name,
    check_run_id,
    chunk_digests,
    codecs,
    encode_changes,
    file_root,
    sign_header,
    sign_part,
    sparse_count,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")

INDEX_FILE = "model.safetensors.index.json"
DEFAULT_SHARD_BYTES = 32 * 1024 * 1024
#: shards per signed manifest part: no byte of a shard moves before its part is hashed and
#: signed, so smaller parts mean earlier first bytes (and more part requests)
DEFAULT_SHARDS_PER_PART = 4
#: shards per part of a version offered as a delta: its bytes to move are small, so every part
#: costs each follower more in requests (a part long-poll and a blob batch) than it saves in
#: first bytes, and its last part goes out when its last shard is encoded either way
DEFAULT_DELTA_SHARDS_PER_PART = 16
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
    else the whole-file BLAKE3. The same digests and blobs as :func:`encode_views` over the
    file's bytes (:func:`scan_shard` and :func:`shard_blobs`, piece by piece, read into
    small buffers here: :class:`_FileShards`).

    Args:
        path: the file; ``size`` its expected size, bytes (nonzero).
        settings: shard size, encodings, zstd level (``settings.base`` is not read here).
        base_path: the delta base's file of the same name (deltas only if its size is equal).
        blob_path: where the blob of (shard offset, encoding) is written.
        workers: threads that read, hash, encode and write shards side by side (hash-list
            roots only; a whole-file digest is taken in one sequential pass); at most
            ``2 * workers`` shards are in flight, each worker holding two
            :data:`SCAN_PIECE_BYTES` buffers (and two shard buffers once a shard needs its
            whole bytes: ``zstd``, or ``xor-zstd`` of a dense change). The results do not
            depend on it.

    Raises:
        CheckpointLayoutError: the file is shorter than ``size``.
        OSError: it cannot be read, or a blob cannot be written.
    """
    shard_size = settings.shard_size
    base_fh = None
    if base_path is not None and any(e in codecs.DELTAS for e in settings.encodings):
        if base_path.is_file() and base_path.stat().st_size == size:
            base_fh = open(base_path, "rb", buffering=0)
    try:
        with open(path, "rb", buffering=0) as fh:
            reader = _FileShards(path, fh, base_fh, size, settings)
            file_hash = None if settings.rooted else blake3.blake3(max_threads=blake3.blake3.AUTO)

            def one(offset: int) -> ShardResult:
                shard, blobs = reader.encode(offset, file_hash)
                for enc, data in blobs.items():
                    assert blob_path is not None  # encodings imply a blob path
                    with open(blob_path(shard.offset, enc), "wb") as out:
                        out.write(data)
                return shard

            offsets = range(0, size, shard_size)
            threaded = workers > 1 and file_hash is None  # a whole-file hash goes in order
            shards = in_order(one, offsets, workers) if threaded else map(one, offsets)
            shard_list: list[tuple[int, str]] = []
            for shard in shards:
                shard_list.append((shard.length, shard.digest))
                digest = None
                if shard.offset + shard.length == size:
                    digest = file_root(shard_list) if file_hash is None else file_hash.hexdigest()
                yield shard, digest
    finally:
        if base_fh is not None:
            base_fh.close()


#: bytes of a shard read, hashed and compared at a time (a multiple of the chunk size when
#: that is smaller): each pass over a piece (BLAKE3 of the shard, of its chunk, the
#: comparison with the base) reads it from the CPU's cache, not from memory
SCAN_PIECE_BYTES = 1 << 20

Pieces = Iterable[tuple[memoryview, memoryview | None]]
"""``(new bytes, base bytes or None)`` of consecutive pieces of one shard (see
:func:`scan_shard`); a base piece of None: the base could not be read (no delta)."""


def piece_bytes(settings: EncodeSettings) -> int:
    """The piece size :func:`scan_shard` is given for ``settings``: whole chunks (the chunk
    list is taken piece by piece) of an even number of bytes (whole 16-bit words, for the
    sparse comparison), about :data:`SCAN_PIECE_BYTES`; the whole shard if the chunk size is
    odd."""
    c = settings.chunk_bytes
    if c <= 0:
        return min(SCAN_PIECE_BYTES, settings.shard_size)
    if c % 2:
        return settings.shard_size
    return c * max(1, SCAN_PIECE_BYTES // c)


@dataclass(frozen=True)
class ShardScan:
    """What one pass over a shard's bytes gives (:func:`scan_shard`).

    Attributes:
        digest: BLAKE3 of the shard (hex).
        chunks: its chunk list (``()`` if not asked).
        changes: ``(index, diff, tail)`` against the base, as
            :func:`shardcast.wire.sparse.encode_changes` takes them, or None (not asked, or
            the base could not be read).
    """

    digest: str
    chunks: tuple[str, ...]
    changes: tuple[np.ndarray, np.ndarray, int | None] | None


def scan_shard(
    pieces: Pieces,
    chunk_bytes: int,
    diff: bool,
    file_hash: blake3.blake3 | None = None,
) -> ShardScan:
    """Hash a shard and find its changed 16-bit words against the base in one pass over its
    pieces, each piece read by every step while it is in the CPU's cache.

    Args:
        pieces: the shard's pieces in order (they tile it); each but the last of a length
            that is a multiple of ``chunk_bytes`` (if nonzero) and even (:func:`piece_bytes`).
        chunk_bytes: chunk size of the chunk list (0: none).
        diff: find the changes against the base pieces
            (:func:`shardcast.wire.sparse.changed_words`, piece by piece: the same words).
        file_hash: a whole-file hash to update with the shard's bytes, or None.

    Raises:
        CheckpointLayoutError: no piece (a shard is never empty).
    """
    # one thread: shards are hashed side by side (``workers``), and BLAKE3's own threads cost
    # ~20 % more CPU-seconds on 1 MiB updates (measured here)
    shard_hash = blake3.blake3()
    chunks: list[str] = []
    index: list[np.ndarray] | None = [] if diff else None
    diffs: list[np.ndarray] = []
    at = 0
    last: memoryview | None = None
    for new, base in pieces:
        shard_hash.update(new)
        if file_hash is not None:
            file_hash.update(new)
        if chunk_bytes:
            chunks.extend(chunk_digests(new, chunk_bytes))
        if index is not None and base is None:
            index = None  # the base is shorter than announced: no delta
        if index is not None and base is not None:
            i, d = changed_words(new, base)
            index.append(i + (at >> 1))
            diffs.append(d)
        at += len(new)
        last = new
    if last is None:
        raise CheckpointLayoutError("a shard of no bytes")
    changes = None
    if index is not None:
        tail = last[len(last) - 1] if at % 2 else None
        changes = (np.concatenate(index), np.concatenate(diffs), tail)
    return ShardScan(shard_hash.hexdigest(), tuple(chunks), changes)


class _FileShards:
    """Shards of one file (and of its base file) for :func:`encode_file`: each read piece by
    piece into two small buffers per thread (``preadv``) while :func:`scan_shard` hashes and
    compares it; the whole shard is read again only for a form that needs it
    (:func:`shard_blobs`). Safe to use from several threads (buffers are per thread)."""

    def __init__(
        self, path: Path, fh: BinaryIO, base_fh: BinaryIO | None, size: int, s: EncodeSettings
    ) -> None:
        self.path, self.fd, self.size, self.settings = path, fh.fileno(), size, s
        self.base_fd = None if base_fh is None else base_fh.fileno()
        self.piece = min(piece_bytes(s), s.shard_size, size)
        self.local = threading.local()

    def encode(
        self, offset: int, file_hash: blake3.blake3 | None = None
    ) -> tuple[ShardResult, dict[str, bytes]]:
        """Hash and encode the shard at ``offset`` (as :func:`encode_shard` does from memory).

        Raises:
            CheckpointLayoutError: the file is shorter than announced.
        """
        s = self.settings
        length = min(s.shard_size, self.size - offset)
        diff = self.base_fd is not None and codecs.SPARSE in s.encodings
        scan = scan_shard(
            self._pieces(offset, length, diff), scan_chunk_bytes(s, diff), diff, file_hash
        )
        # read once per shard, however many forms need its whole bytes
        whole = functools.cache(lambda: self._whole(offset, length))
        return _encoded(offset, length, scan, self.base_fd is not None, diff, whole, s)

    def _bufs(self, name: str, n: int) -> tuple[memoryview, memoryview]:
        bufs = getattr(self.local, name, None)
        if bufs is None:
            bufs = (memoryview(bytearray(n)), memoryview(bytearray(n)))
            setattr(self.local, name, bufs)
        return bufs

    def _read(self, fd: int, view: memoryview, offset: int) -> bool:
        return os.preadv(fd, [view], offset) == len(view)

    def _pieces(self, offset: int, length: int, diff: bool) -> Pieces:
        new_buf, base_buf = self._bufs("pieces", self.piece)
        for at in range(0, length, self.piece):
            n = min(self.piece, length - at)
            new, base = new_buf[:n], base_buf[:n]
            if not self._read(self.fd, new, offset + at):
                raise CheckpointLayoutError(f"{self.path} changed while hashing")
            if not diff:
                yield new, None
                continue
            assert self.base_fd is not None
            yield new, (base if self._read(self.base_fd, base, offset + at) else None)

    def _whole(self, offset: int, length: int) -> tuple[memoryview, memoryview | None, bytearray]:
        new_buf, base_buf = self._bufs("whole", min(self.settings.shard_size, self.size))
        new, base = new_buf[:length], base_buf[:length]
        if not self._read(self.fd, new, offset):
            raise CheckpointLayoutError(f"{self.path} changed while hashing")
        scratch = base_buf.obj
        assert isinstance(scratch, bytearray)
        if self.base_fd is None or not self._read(self.base_fd, base, offset):
            return new, None, scratch
        return new, base, scratch  # the base is read into the scratch: XORed in place


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
    """Hash and encode a file of ``size`` bytes given shard by shard, as
    :mod:`shardcast.publish.inmemory` does (taking them from bytes held in memory), with the
    per-shard code of :func:`encode_file`, which reads them from disk (:func:`scan_shard`,
    :func:`shard_blobs`): the same digests and blobs. Pure but for ``scratch`` (and whatever
    ``views`` does).

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
    ``scratch``, safe to call from several threads with a scratch each): :func:`scan_shard`
    over its pieces (:func:`piece_bytes`), then :func:`shard_blobs`.

    Raises:
        LocalProtocolError: an encoding that cannot be offered.
    """
    length = len(view)
    diff = base_view is not None and codecs.SPARSE in settings.encodings
    step = piece_bytes(settings)
    pieces = (
        (view[at : at + step], base_view[at : at + step] if base_view is not None else None)
        for at in range(0, length, step)
    )
    scan = scan_shard(pieces, scan_chunk_bytes(settings, diff), diff)
    return _encoded(
        offset,
        length,
        scan,
        base_view is not None,
        diff,
        lambda: (view, base_view, scratch),
        settings,
    )


def _encoded(
    offset: int,
    length: int,
    scan: ShardScan,
    has_base: bool,
    diff: bool,
    whole: Callable[[], tuple[memoryview, memoryview | None, bytearray]],
    settings: EncodeSettings,
) -> tuple[ShardResult, dict[str, bytes]]:
    """The shard's result and blobs after its :func:`scan_shard`, from disk or memory: its
    forms (:func:`shard_blobs`, ``whole`` as there), and its chunk list taken late from its
    whole bytes if it was scanned without one and goes whole (:func:`late_chunk_list`; the
    bytes ``whole`` gives are those a ``zstd`` or ``xor-zstd`` attempt already read)."""
    blobs = shard_blobs(
        length, scan.changes, has_base, whole, settings.encodings, settings.zstd_level
    )
    chunks = scan.chunks
    if late_chunk_list(settings, diff, blobs):
        chunks = chunk_digests(whole()[0], settings.chunk_bytes)
    encoded = tuple(
        Encoded(enc, len(data), blake3.blake3(data).hexdigest()) for enc, data in blobs.items()
    )
    return ShardResult(offset, length, scan.digest, encoded, chunks), blobs


def scan_chunk_bytes(settings: EncodeSettings, diff: bool) -> int:
    """The chunk size :func:`scan_shard` takes a shard's chunk list at: ``settings``' for a
    shard sent whole, none (0) for one compared with its base (``diff``).

    A chunk list lets a receiver check, and re-serve, a shard that streams in as raw bytes
    one chunk at a time (:mod:`shardcast.wire.manifest`). A shard sent as a delta is a blob a
    small fraction of the shard's size, checked against its own signed digest before it is
    applied, so nobody streams its raw bytes: the list would cost the origin a second BLAKE3
    pass over every byte of the version (0.2-0.5 CPU-s per 1.3 GB on this project's 2-core
    machine, next to 0.9 CPU-s for reading, hashing and comparing it once) and the parts
    32 bytes per MiB. Such a shard's list is taken after its encoding is decided, only if it
    got no delta (:func:`late_chunk_list`)."""
    return 0 if diff else settings.chunk_bytes


def late_chunk_list(settings: EncodeSettings, diff: bool, blobs: Mapping[str, bytes]) -> bool:
    """True if a shard scanned without its chunk list (:func:`scan_chunk_bytes`) needs one
    after all: chunk lists are asked for and no delta of the shard was kept (a dense change
    where no delta beat the raw shard, or a base that could not be read), so receivers take
    it whole. Its part lists chunks only if every shard of the part has a list."""
    return diff and settings.chunk_bytes > 0 and not any(e in codecs.DELTAS for e in blobs)


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
    length: int,
    changes: tuple[np.ndarray, np.ndarray, int | None] | None,
    has_base: bool,
    whole: Callable[[], tuple[memoryview, memoryview | None, bytearray]],
    encodings: tuple[str, ...],
    level: int,
) -> dict[str, bytes]:
    """The encoded forms of one ``length``-byte shard worth offering.

    Of the deltas (only with a base: the same byte range of the base version) only the
    smallest is kept: ``sparse`` first (from ``changes``: cheap), then ``xor-zstd`` only if
    more than :data:`SPARSE_DENSE_FRACTION` of the words changed, where it can win. Forms not
    smaller than the raw shard are dropped.

    Args:
        length: the shard's length, bytes.
        changes: its changes against the base (:attr:`ShardScan.changes`), or None (no
            ``sparse``).
        has_base: a base is offered for the shard (else no delta).
        whole: the shard's bytes, the base's (None: cannot be read) and a scratch buffer of
            at least ``length`` bytes for the XOR (the base may be a view of it, then XORed
            in place); called only for ``zstd`` or a dense ``xor-zstd``, maybe more than once:
            it gives the same shard bytes each time (:func:`encode_file` reads them once per
            shard), and a base that an earlier call's ``xor-zstd`` may have XORed.
        encodings: the forms requested (not ``raw``).
        level: zstd level.

    Returns:
        encoding -> blob.

    Raises:
        LocalProtocolError: an encoding that cannot be offered.
    """
    for enc in encodings:
        if enc not in codecs.ENCODINGS or enc == codecs.RAW:
            raise LocalProtocolError(f"cannot offer encoding {enc!r}")
    blobs: dict[str, bytes] = {}
    if has_base and any(e in codecs.DELTAS for e in encodings):
        if codecs.SPARSE in encodings and changes is not None:
            blobs[codecs.SPARSE] = encode_changes(*changes[:2], length, changes[2], level)
        dense = codecs.SPARSE not in blobs or (
            sparse_count(blobs[codecs.SPARSE]) > SPARSE_DENSE_FRACTION * (length // 2)
        )
        if codecs.XOR_ZSTD in encodings and dense:
            view, base_view, scratch = whole()
            if base_view is not None:  # into ``scratch`` (in place when the base is there)
                blobs[codecs.XOR_ZSTD] = codecs.encode(
                    codecs.XOR_ZSTD, view, base_view, level, scratch=scratch
                )
        deltas = sorted((len(b), e) for e, b in blobs.items())
        for _, loser in deltas[1:]:
            del blobs[loser]
    if codecs.ZSTD in encodings:
        blobs[codecs.ZSTD] = codecs.encode(codecs.ZSTD, whole()[0], level=level)
    return {enc: data for enc, data in blobs.items() if len(data) < length}


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
