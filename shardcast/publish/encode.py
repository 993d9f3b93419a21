"""publish: hashing and encoding one file's shards: BLAKE3 digests, chunk lists and the
encoded forms (``zstd``; ``sparse`` and ``xor-zstd`` against the base version).

One code path per shard, whether its bytes come from disk (:func:`encode_file`, read piece by
piece into small buffers, :class:`_FileShards`) or from memory (:func:`encode_views`, for the
trainer's in-memory origin): :func:`scan_shard` hashes a shard and finds its changed words in
one pass, :func:`shard_blobs` keeps the smallest delta and the forms smaller than the raw
shard. The same bytes give the same digests and blobs either way; the results do not depend on
how many threads encode side by side. :mod:`shardcast.publish.plan` assembles the results into
a version's signed parts.

Shards of a file still being written are encoded ahead by :func:`encode_known`
(:class:`KnownShards`); :func:`encode_file` later uses each only where the file's bytes hash to
its digest again (:mod:`shardcast.publish.preencode`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, TypeVar

import blake3
import numpy as np

from p2p.errors import LocalProtocolError
from shardcast.publish.layout import CheckpointLayoutError
from shardcast.wire import (
    CHUNK_BYTES,
    Encoded,
    changed_words,
    chunk_digests,
    codecs,
    encode_changes,
    file_root,
    sparse_count,
)

log = logging.getLogger(__name__)
_T = TypeVar("_T")


#: threads that hash and encode a file's shards side by side (BLAKE3, numpy's comparisons,
#: zstd and file reads release the GIL); the results do not depend on it
ENCODE_WORKERS = min(8, os.cpu_count() or 1)


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


def cached_blob(blob_dir: Path, prefix: str, offset: int, encoding: str) -> Path:
    """Where an encoding cache keeps the blob of (shard offset, encoding) of a file:
    ``blob_dir/<prefix><offset>.<encoding>`` (the prefix is ``<file name>.`` in the origin's
    caches)."""
    return blob_dir / f"{prefix}{offset}.{encoding}"


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
        return cached_blob(self.blob_dir, self.blob_prefix, offset, encoding)


@dataclass(frozen=True)
class KnownShards:
    """Whole shards of one file hashed and encoded while the file was still being written
    (:func:`encode_known`, for :mod:`shardcast.publish.preencode`). Nobody vouches that the
    file still holds those bytes: :func:`encode_file` uses a shard only where the file's bytes
    at its offset hash to its digest again, and encodes the others.

    Attributes:
        name: the file's name in the checkpoint directory.
        settings: what the results depend on; used only if the file's are equal.
        with_base: they were encoded against the base file (taken to be as long as the
            final file); used only where the final file has a base of its size too.
        shards: by offset; each ``settings.shard_size`` bytes long.
        blob_dir: where the encoded blobs are, named ``<blob_prefix><offset>.<encoding>``.
        blob_prefix: see ``blob_dir``.
    """

    name: str
    settings: EncodeSettings
    with_base: bool
    shards: Mapping[int, ShardResult]
    blob_dir: Path
    blob_prefix: str = ""

    def blob(self, offset: int, encoding: str) -> Path:
        """Path of the encoded blob of the shard at ``offset``."""
        return cached_blob(self.blob_dir, self.blob_prefix, offset, encoding)

    def fits(self, settings: EncodeSettings, with_base: bool) -> bool:
        """True if these shards may be confirmed for a file encoded with ``settings``
        (hash-list roots only) and with (or without) a base file of its size."""
        return settings.rooted and self.settings == settings and self.with_base == with_base

    def joined(self, more: KnownShards) -> KnownShards:
        """These shards and ``more``'s (``more`` wins at an offset in both); ``more`` alone if
        it was encoded otherwise (settings, base, file or blob directory)."""
        if dataclasses.replace(self, shards={}) != dataclasses.replace(more, shards={}):
            return more
        return dataclasses.replace(self, shards={**self.shards, **more.shards})


ShardViews = Iterator[tuple[int, memoryview, memoryview | None]]
"""``(offset, new bytes, base bytes or None)`` of each shard of a file, in offset order."""


def encode_file(
    path: Path,
    size: int,
    settings: EncodeSettings,
    base_path: Path | None,
    blob_path: Callable[[int, str], Path] | None,
    workers: int = 1,
    known: KnownShards | None = None,
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
        known: shards of this file encoded while it was being written (hash-list roots
            only). A shard of it whose bytes here hash to its digest is not encoded again:
            its blobs are linked to ``blob_path`` (one BLAKE3 pass over the shard instead of
            reading it and its base, comparing and encoding), and the very
            :class:`ShardResult` object of ``known`` is yielded. The results are the same.

    Raises:
        CheckpointLayoutError: the file is shorter than ``size``.
        OSError: it cannot be read, or a blob cannot be written.
    """
    with _base_file(base_path, settings, size) as base_fh, open(path, "rb", buffering=0) as fh:
        reader = _FileShards(path, fh, base_fh, size, settings)
        file_hash = None if settings.rooted else blake3.blake3(max_threads=blake3.blake3.AUTO)
        with_base = base_fh is not None
        reuse = known if known is not None and known.fits(settings, with_base) else None

        def one(offset: int) -> ShardResult:
            prior = None if reuse is None else _confirmed(reader, reuse, offset, blob_path)
            if prior is not None:
                return prior
            shard, blobs = reader.encode(offset, file_hash)
            _write_blobs(blobs, shard.offset, blob_path)
            return shard

        offsets = range(0, size, settings.shard_size)
        threaded = workers > 1 and file_hash is None  # a whole-file hash goes in order
        shards = in_order(one, offsets, workers) if threaded else map(one, offsets)
        shard_list: list[tuple[int, str]] = []
        for shard in shards:
            shard_list.append((shard.length, shard.digest))
            digest = None
            if shard.offset + shard.length == size:
                digest = file_root(shard_list) if file_hash is None else file_hash.hexdigest()
            yield shard, digest


@contextmanager
def _base_file(
    base_path: Path | None, settings: EncodeSettings, size: int | None
) -> Iterator[BinaryIO | None]:
    """The delta base's file, open for reading, if ``settings`` ask for a delta and it exists
    (with ``size`` bytes, unless ``size`` is None); else None."""
    fh = None
    if base_path is not None and any(e in codecs.DELTAS for e in settings.encodings):
        if base_path.is_file() and (size is None or base_path.stat().st_size == size):
            fh = open(base_path, "rb", buffering=0)
    try:
        yield fh
    finally:
        if fh is not None:
            fh.close()


def _write_blobs(
    blobs: Mapping[str, bytes], offset: int, blob_path: Callable[[int, str], Path] | None
) -> None:
    """Write the blobs of the shard at ``offset``, each to ``blob_path(offset, encoding)``."""
    for enc, data in blobs.items():
        assert blob_path is not None  # encodings imply a blob path
        with open(blob_path(offset, enc), "wb") as out:
            out.write(data)


def _confirmed(
    reader: _FileShards,
    known: KnownShards,
    offset: int,
    blob_path: Callable[[int, str], Path] | None,
) -> ShardResult | None:
    """``known``'s shard at ``offset`` if the file's bytes there are still the ones it was
    encoded from (same length, same BLAKE3) and its blobs are now at ``blob_path``; None: encode
    it again (nothing that matters was linked)."""
    prior = known.shards.get(offset)
    if prior is None:
        return None
    if prior.offset + prior.length > reader.size or not reader.holds(prior):
        return None
    try:
        for e in prior.encoded:
            assert blob_path is not None  # encodings imply a blob path
            src, dst = known.blob(prior.offset, e.encoding), blob_path(prior.offset, e.encoding)
            if src != dst:
                dst.unlink(missing_ok=True)
                os.link(src, dst)
    except OSError as exc:  # the blob is gone: encode the shard again
        log.warning(
            "known_shard_unusable file=%s offset=%d error=%s", known.name, prior.offset, exc
        )
        return None
    return prior


def encode_known(
    path: Path,
    offsets: Sequence[int],
    settings: EncodeSettings,
    base_path: Path | None,
    blob_dir: Path,
    blob_prefix: str,
    workers: int = 1,
) -> KnownShards:
    """Hash and encode the whole shards at ``offsets`` of a file still being written (each
    of them below its current size), for :func:`encode_file` to confirm later
    (:class:`KnownShards`). Blocking.

    The base file (``base_path``, if it exists) is taken to be as long as the final file will
    be. Each shard's digest, chunk list and blobs come from the same bytes: a shard whose
    bytes are read again for a form that needs them whole (``zstd``, dense ``xor-zstd``) must
    hash to the digest of its first read (:class:`_FileShards`, ``strict``), else it is left
    out. Memory and threads as :func:`encode_file`.

    Args:
        path: the file; ``offsets`` multiples of ``settings.shard_size``.
        settings: as for :func:`encode_file` (hash-list roots: ``settings.rooted``).
        base_path: the delta base's file of the same name, or None.
        blob_dir: where the blobs go, as ``<blob_prefix><offset>.<encoding>``.
        workers: threads that encode shards side by side.

    Raises:
        CheckpointLayoutError: the file is shorter than the last shard's end.
        OSError: it cannot be read, or a blob cannot be written.
    """
    size = max(offsets, default=0) + settings.shard_size
    blob_dir.mkdir(parents=True, exist_ok=True)

    def blob_path(offset: int, encoding: str) -> Path:
        return cached_blob(blob_dir, blob_prefix, offset, encoding)

    with _base_file(base_path, settings, None) as base_fh, open(path, "rb", buffering=0) as fh:
        with_base = base_fh is not None
        reader = _FileShards(path, fh, base_fh, size, settings, strict=True)

        def one(offset: int) -> ShardResult | None:
            try:
                shard, blobs = reader.encode(offset)
            except ShardChanged:
                return None
            _write_blobs(blobs, offset, blob_path)
            return shard

        results = zip(offsets, in_order(one, offsets, workers), strict=True)
        done = {o: r for o, r in results if r is not None}
    return KnownShards(path.name, settings, with_base, done, blob_dir, blob_prefix)


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


class ShardChanged(CheckpointLayoutError):
    """A shard's bytes changed between two reads of it (a file still being written)."""


class _FileShards:
    """Shards of one file (and of its base file) for :func:`encode_file`: each read piece by
    piece into two small buffers per thread (``preadv``) while :func:`scan_shard` hashes and
    compares it; the whole shard is read again only for a form that needs it
    (:func:`shard_blobs`). ``strict`` (a file still being written): that second read must
    hash to the first one's digest, else :class:`ShardChanged`. Safe to use from several
    threads (buffers are per thread)."""

    def __init__(
        self,
        path: Path,
        fh: BinaryIO,
        base_fh: BinaryIO | None,
        size: int,
        s: EncodeSettings,
        strict: bool = False,
    ) -> None:
        self.path, self.fd, self.size, self.settings = path, fh.fileno(), size, s
        self.base_fd = None if base_fh is None else base_fh.fileno()
        self.piece = min(piece_bytes(s), s.shard_size, size)
        self.strict = strict
        self.local = threading.local()

    def encode(
        self, offset: int, file_hash: blake3.blake3 | None = None
    ) -> tuple[ShardResult, dict[str, bytes]]:
        """Hash and encode the shard at ``offset`` (as :func:`encode_shard` does from memory).

        Raises:
            CheckpointLayoutError: the file is shorter than announced.
            ShardChanged: ``strict``, and the shard's bytes changed between two reads.
        """
        s = self.settings
        length = min(s.shard_size, self.size - offset)
        diff = self.base_fd is not None and codecs.SPARSE in s.encodings
        scan = scan_shard(
            self._pieces(offset, length, diff), scan_chunk_bytes(s, diff), diff, file_hash
        )
        # read once per shard, however many forms need its whole bytes
        whole = functools.cache(lambda: self._whole(offset, length, scan.digest))
        return _encoded(offset, length, scan, self.base_fd is not None, diff, whole, s)

    def holds(self, shard: ShardResult) -> bool:
        """True if the file's bytes at ``shard.offset`` hash to ``shard.digest`` (one BLAKE3
        pass, piece by piece; the base is not read).

        Raises:
            CheckpointLayoutError: the file is shorter than the shard's end.
        """
        h = blake3.blake3()
        for new, _ in self._pieces(shard.offset, shard.length, False):
            h.update(new)
        return h.hexdigest() == shard.digest

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

    def _whole(
        self, offset: int, length: int, digest: str
    ) -> tuple[memoryview, memoryview | None, bytearray]:
        new_buf, base_buf = self._bufs("whole", min(self.settings.shard_size, self.size))
        new, base = new_buf[:length], base_buf[:length]
        if not self._read(self.fd, new, offset):
            raise CheckpointLayoutError(f"{self.path} changed while hashing")
        if self.strict and blake3.blake3(new).hexdigest() != digest:
            raise ShardChanged(f"{self.path}: the shard at {offset} changed while encoding")
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
