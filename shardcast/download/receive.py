"""download: the receiving data path: shard bytes into a pooled buffer, hashed while hot,
written once.

Theory of operation
-------------------
Every byte of a shard (or of an encoded blob) crosses Python's memory once:

1. **receive**: :meth:`p2p.http_client.HttpClient.receive_range_into` reads the body with
   ``recv_into`` straight into the shard's :class:`ShardSink` buffer, a shard-sized
   ``bytearray`` from a bounded :class:`BufferPool` (no bytes object per read, no copy out of
   h11, no fresh pages faulted in per shard);
2. **hash**: :meth:`ShardSink.advance` feeds each piece to an incremental BLAKE3 hasher while
   it is still in the CPU cache. A transfer that breaks keeps its buffer and its hasher (the
   hasher covers exactly the bytes kept), so the next source resumes at that byte and nothing
   is hashed twice. Hashing runs on the event-loop thread: a piece is at most 1 MiB, about
   0.1 ms of BLAKE3 on this machine (AVX-512, 0.13 CPU-s/GB), and a worker-thread hop per
   piece would add ~40 us of CPU to it (``trio.to_thread.run_sync``, measured here) while the
   bytes would go cold; blocking the loop for 0.1 ms at a time holds no other transfer back.
   BLAKE3's own threads (``max_threads``) only add CPU at these sizes. What blocks for longer
   (one ``pwrite`` of a whole shard, decoding a delta) runs in a worker thread
   (:func:`verify_and_write`);
3. **write**: the shard's digest, known when its last byte arrived, is compared with the
   signed one and the buffer is written with one ``pwrite``
   (:meth:`~shardcast.store.partial.PartialVersion.write_shard` with ``hashed=``); a schema-3
   manifest then commits without reading any file again (:mod:`shardcast.wire.manifest`).

Chunks (issue 16, "a swarm that swarms"): when the shard's manifest part lists a chunk list
(:mod:`shardcast.wire.manifest`), a raw shard's sink checks each 1 MiB chunk the moment its last
byte arrives (:meth:`ShardSink.expect_chunks`) instead of hashing the whole shard: a chunk
that matches is written at once (:meth:`~shardcast.store.partial.PartialVersion.write_prefix`) and
this node's HTTP lane serves it to others while the rest of the shard still streams in; a
chunk that does not match raises :class:`ChunkCorrupt` before any of its bytes are written or
served, and since a transfer that breaks keeps only whole verified chunks
(:meth:`ShardSink.rewind`), every chunk came from one source: the blame is exact. The bytes
are hashed once either way (chunk digests replace the shard digest, see the manifest docs);
a complete shard is then only marked present, never written twice.

Deltas (:func:`verify_and_write` with a base): the blob's running digest is checked against
its signed digest, then the shard is built one of two ways, by how many pages change:

- **sparse, fewer changed words than 4 KiB pages** (a shard that barely moved, e.g. a
  frozen tensor): the shard's range of the base file is cloned into the new file inside the
  kernel (:func:`~shardcast.store.files.copy_range`: ``copy_file_range``, a reflink where the
  filesystem shares extents, a page-cache copy elsewhere), patched in place through a memory
  map and hashed there (:meth:`~shardcast.store.partial.PartialVersion.patch_shard`): most pages are
  never touched by Python, and with reflinks never copied. A blob that lists no change is
  only the copy (still hashed: a base damaged at rest must not pass into the new version).
- **denser** (a typical RL step changes ~2 % of bf16 words, ~40 per page: every page
  changes): the base range is read once into a pooled buffer, patched there (``sparse``
  touches only the changed words; ``xor-zstd`` XORs its decompressed frame in), hashed and
  written with one ``pwrite``. Measured on tmpfs (``bench/datapath.py``): clone-and-patch of
  such a shard costs more (the copy is as dear as ``pread`` + ``pwrite``, and faulting and
  unmapping every page of the map adds ~0.14 CPU-s/GB).

Either way the result is hashed against the shard digest before the shard counts: a wrong
base (a node whose base differs from the origin's) fails there and the caller fetches the
shard raw.

CPU accounting: :func:`verify_and_write` charges what it does to the node's
:class:`~shardcast.core.StageCpu` by stage (decoding and reading the base: ``apply``; hashing
a decoded shard: ``verify``; ``pwrite``, range copies and blobs: ``write``). The in-place
patch hashes the patched range inside the store's call, which is charged to ``write``. Bytes
hashed as they arrive are charged by the driver (``verify``), and so are the socket reads
(``receive``).

Chains (the default, ``DownloadConfig.keep_chains``): when the download keeps the version as a
chain (:attr:`~shardcast.store.partial.PartialVersion.chain_base`), a delta blob that matches
its signed digest is only kept (:func:`keep_delta`): the base is not read and the shard is not
written; its bytes are built and verified whenever something reads them
(:mod:`shardcast.store.chains`, which argues why they are the trainer's). The paths above are
then the eager mode, and the one for ``zstd`` and raw shards.

This module does no networking itself; its blocking functions run in worker threads.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import blake3

from p2p.errors import IntegrityError, LocalProtocolError
from shardcast.core import Stage, StageCpu
from shardcast.store import PartialVersion, VersionStore
from shardcast.wire import ShardEntry, codecs, is_identity, sparse_count


class ChunkCorrupt(IntegrityError):
    """A chunk of a shard did not match its signed chunk digest (:meth:`ShardSink.advance`).

    Attributes:
        chunk: the chunk's index within the shard.
        start, end: its byte range within the shard (all sent by one source).
    """

    def __init__(self, shard: int, chunk: int, start: int, end: int, source: str = "") -> None:
        super().__init__(f"shard {shard} chunk {chunk} (bytes {start}..{end})", source)
        self.shard = shard
        self.chunk = chunk
        self.start = start
        self.end = end


ChunkWriter = Callable[[int, memoryview], object]
"""``write(start, data)``: verified bytes of the shard at ``start`` (within the shard)."""


class BufferPool:
    """Reusable shard-sized buffers (bounded: at most ``keep`` idle ones are kept; a request
    that finds none large enough allocates one as large as the largest request seen, so that
    buffers stay reusable across shard lengths). Thread-safe.

    Attributes:
        allocated: buffers this pool had to allocate (each a fresh, zeroed allocation of
            ``_largest`` bytes: page faults and zeroing, which reuse avoids); a count that
            grows in steady state means more buffers are in use at once than ``keep``.
    """

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self.allocated = 0
        self._idle: list[bytearray] = []
        self._largest = 0
        self._lock = threading.Lock()

    def get(self, length: int) -> bytearray:
        """A buffer of at least ``length`` bytes (contents undefined)."""
        with self._lock:
            self._largest = max(self._largest, length)
            for k, buf in enumerate(self._idle):
                if len(buf) >= length:
                    return self._idle.pop(k)
            size = self._largest
            self.allocated += 1
        return bytearray(size)

    def put(self, buf: bytearray) -> None:
        """Return a buffer nobody uses any more (dropped if the pool is full)."""
        with self._lock:
            if len(self._idle) < self.keep and len(buf) >= self._largest:
                self._idle.append(buf)


PAGE_BYTES = 4096  #: a sparse delta with fewer changed words than pages is applied in place
POOLED_MIN_BYTES = 4 << 20  #: smaller sinks get their own exact-size buffer
POOL = BufferPool()  #: per process: at most 8 idle shard-sized buffers (256 MiB at 32 MiB)


@dataclass
class ShardSink:
    """The bytes of one shard (or encoded blob) as they arrive, and their running BLAKE3.

    Attributes:
        buffer: the (pooled) buffer, or a view of a buffer shared with other sinks
            (:meth:`over`); only its first ``size`` bytes are used.
        size: the expected length in bytes.
        pos: bytes received so far (the prefix ``[0, pos)`` is filled and hashed).
        parts: ``(source, start, end)`` of who sent which bytes (for blame).
        verified: with a chunk list (:meth:`expect_chunks`): the prefix ``[0, verified)``
            whose chunks matched (a multiple of the chunk size, or ``size``); else 0.
    """

    buffer: bytearray | memoryview
    size: int
    pos: int = 0
    parts: list[tuple[str, int, int]] = field(default_factory=list)
    verified: int = 0
    _hasher: blake3.blake3 = field(default_factory=blake3.blake3, repr=False)
    _pool: BufferPool | None = field(default=None, repr=False)
    _chunks: tuple[str, ...] = field(default=(), repr=False)
    _chunk_bytes: int = field(default=0, repr=False)
    _shard: ShardEntry | None = field(default=None, repr=False)
    _write: ChunkWriter | None = field(default=None, repr=False)

    def expect_chunks(self, entry: ShardEntry, write: ChunkWriter | None = None) -> bool:
        """Check this (raw, still empty) shard chunk by chunk against ``entry``'s signed
        chunk list, handing each verified chunk to ``write`` (see the module docstring).

        Returns:
            False (and nothing changes) if the entry lists no chunks, the sink is not for
            its raw bytes, or bytes already arrived.
        """
        if not entry.chunks or self.size != entry.length or self.pos:
            return False
        self._chunks, self._chunk_bytes, self._shard = entry.chunks, entry.chunk_bytes, entry
        self._write = write
        return True

    @property
    def chunked(self) -> bool:
        """True if bytes are checked chunk by chunk (:meth:`expect_chunks`)."""
        return bool(self._chunks)

    @classmethod
    def pooled(cls, size: int, pool: BufferPool = POOL) -> ShardSink:
        """A sink whose buffer comes from ``pool`` (give it back with :meth:`release`); below
        :data:`POOLED_MIN_BYTES` (a delta blob) a buffer of exactly ``size`` is made instead,
        so a small blob never holds a shard-sized buffer."""
        if size < POOLED_MIN_BYTES:
            return cls(bytearray(size), size)
        return cls(pool.get(size), size, _pool=pool)

    @classmethod
    def over(cls, view: memoryview) -> ShardSink:
        """A sink of ``len(view)`` bytes whose buffer is ``view`` itself (a slice of a buffer
        that a whole batch of blobs was received into: nothing is copied); :meth:`release`
        leaves it alone."""
        return cls(view, len(view))

    @property
    def data(self) -> memoryview:
        """The ``size`` bytes (only ``[0, pos)`` is meaningful before :attr:`full`)."""
        return memoryview(self.buffer)[: self.size]

    @property
    def full(self) -> bool:
        """True when every byte arrived."""
        return self.pos == self.size

    def window(self, length: int) -> memoryview:
        """Where the next ``length`` bytes go: ``[pos, pos + length)``.

        Raises:
            LocalProtocolError: past the end.
        """
        if self.pos + length > self.size:
            raise LocalProtocolError(f"{length} bytes at {self.pos} of a {self.size}-byte sink")
        return memoryview(self.buffer)[self.pos : self.pos + length]

    def advance(self, n: int) -> None:
        """The next ``n`` bytes (at ``pos``) are filled: hash them and move on; with a chunk
        list, check and hand over each chunk they complete.

        Raises:
            ChunkCorrupt: a completed chunk does not match its signed digest; the sink is
                rewound to the end of the last verified chunk (nothing of the bad chunk is
                kept, written or served).
            LocalProtocolError: past the end.
        """
        end = self.pos + n
        if n < 0 or end > self.size:
            raise LocalProtocolError(f"advance by {n} at {self.pos} of {self.size}")
        if not self._chunks:
            self._hasher.update(memoryview(self.buffer)[self.pos : end])
            self.pos = end
            return
        cb = self._chunk_bytes
        while self.pos < end:
            boundary = min(self.size, self.verified + cb)
            stop = min(end, boundary)
            self._hasher.update(memoryview(self.buffer)[self.pos : stop])
            self.pos = stop
            if stop < boundary:
                break
            k = self.verified // cb
            if self._hasher.hexdigest() != self._chunks[k]:
                start = self.verified
                self.rewind()
                assert self._shard is not None
                raise ChunkCorrupt(self._shard.index, k, start, boundary)
            self._hasher = blake3.blake3()
            if self._write is not None:
                self._write(self.verified, memoryview(self.buffer)[self.verified : boundary])
            self.verified = boundary

    def rewind(self) -> int:
        """Drop the bytes past the last verified chunk (a chunked sink whose transfer broke:
        the next source resends whole chunks, so each chunk has one sender). Returns the
        bytes dropped (0 for a sink without a chunk list)."""
        if not self._chunks:
            return 0
        dropped = self.pos - self.verified
        self.pos = self.verified
        self._hasher = blake3.blake3()
        self.parts = [(s, a, min(b, self.pos)) for s, a, b in self.parts if a < self.pos]
        return dropped

    def digest(self) -> str:
        """BLAKE3 hex digest of the ``size`` bytes.

        Raises:
            LocalProtocolError: not every byte arrived yet.
        """
        if not self.full:
            raise LocalProtocolError(f"digest of a sink at {self.pos} of {self.size} bytes")
        if self._chunks:  # every chunk matched its signed digest: the shard is the signed one
            assert self._shard is not None
            if self.verified != self.size and self.size:
                raise LocalProtocolError(f"digest of a sink verified to {self.verified}")
            return self._shard.digest
        return self._hasher.hexdigest()

    def release(self) -> None:
        """Give the buffer back to its pool (idempotent); the sink must not be used after."""
        if self._pool is not None:
            assert isinstance(self.buffer, bytearray)  # a pooled sink owns its buffer
            self._pool.put(self.buffer)
            self._pool = None
            self.buffer = bytearray()
            self.size = self.pos = 0


class BaseVersion:
    """The committed delta base: read ranges of its files and hand out their descriptors.

    Files are opened on first use and closed by :meth:`close`; safe to use from several
    threads. The caller keeps the step pinned in the store meanwhile.
    """

    def __init__(self, store: VersionStore, step: int) -> None:
        self.store = store
        self.step = step
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()

    def fd(self, name: str) -> int:
        """A read-only descriptor of file ``name`` (owned by this object).

        Raises:
            OSError: the base or the file vanished.
        """
        with self._lock:
            fd = self._fds.get(name)
            if fd is None:
                fd = self._fds[name] = os.open(
                    self.store.version_dir(self.step) / name, os.O_RDONLY
                )
            return fd

    def read_into(self, name: str, offset: int, length: int, out: bytearray) -> memoryview:
        """``length`` bytes at ``offset`` of file ``name`` into ``out`` (a view of it).

        Raises:
            OSError: short read (the file is shorter).
        """
        view = memoryview(out)[:length]
        if os.preadv(self.fd(name), [view], offset) != length:
            raise OSError(f"base step {self.step} {name}: short read at {offset}")
        return view

    def close(self) -> None:
        """Close every descriptor (idempotent)."""
        with self._lock:
            fds, self._fds = self._fds, {}
        for fd in fds.values():
            os.close(fd)


class BaseMismatch(IntegrityError):
    """A blob that matched its signed digest did not yield the shard: a delta against a base
    this node does not share with the origin, or a blob the origin encoded badly. Not the
    source's fault: the shard is fetched raw and nobody is blamed."""


def verify_and_write(
    part: PartialVersion,
    entry: ShardEntry,
    encoding: str,
    sink: ShardSink,
    base: BaseVersion | None,
    source: str,
    pool: BufferPool = POOL,
    cpu: StageCpu | None = None,
) -> bool:
    """Check a fully received shard or blob, decode it if encoded, and write the shard.

    Blocking (a ``pwrite`` of a shard, decoding): run it in a worker thread.

    Args:
        part: the version being written.
        entry: the shard.
        encoding: what ``sink`` holds (``raw`` or an offered encoding).
        sink: the received bytes, complete, with their running digest.
        base: the committed delta base (needed for a delta encoding).
        source: who sent the bytes (for errors).
        pool: where scratch buffers for decoding come from.
        cpu: the node's CPU account, charged by stage (module docstring), or None.

    Returns:
        True if the shard was written now, False if it was already present.

    Raises:
        IntegrityError: the bytes (raw) or the blob do not match their signed digest: the
            sender's fault; nothing is written.
        BaseMismatch: the blob matched but does not decode, or decodes to other bytes than
            the shard digest says; nothing is written.
        LocalProtocolError: the encoding is not offered, a delta without a base, or the
            version is closed.
        OSError: the partial directory or the base vanished.
    """
    cpu = cpu if cpu is not None else StageCpu()
    if encoding == codecs.RAW:
        if sink.size != entry.length:
            raise IntegrityError(f"shard {entry.index}: {sink.size} bytes for {entry.length}")
        with cpu.measure(Stage.WRITE):
            return part.write_shard(entry.index, sink.data, source, hashed=sink.digest())
    offered = entry.offered(encoding)
    if offered is None:
        raise LocalProtocolError(f"shard {entry.index} does not offer {encoding}")
    if sink.size != offered.size or sink.digest() != offered.digest:
        raise IntegrityError(f"shard {entry.index} {encoding} blob digest mismatch", source)
    blob = sink.data
    if encoding in codecs.DELTAS and part.chain_base is not None:
        with cpu.measure(Stage.WRITE):  # keeping the blob is this path's only write
            return keep_delta(part, entry, encoding, blob, source)
    blobs = {encoding: bytes(blob)}  # kept for re-serving (deltas are small)
    if encoding in codecs.DELTAS and base is None:
        raise LocalProtocolError(f"{encoding} of shard {entry.index} needs the base version")
    if encoding not in codecs.DELTAS:
        return _write_decompressed(part, entry, encoding, blob, blobs, source, pool, cpu)
    assert base is not None
    if encoding == codecs.SPARSE and sparse_count(blob) * PAGE_BYTES < entry.length:
        return _patch_in_place(part, entry, encoding, blob, blobs, base, source, cpu)
    return _write_dense_delta(part, entry, encoding, blob, blobs, base, source, pool, cpu)


def _hash_and_write(
    part: PartialVersion,
    entry: ShardEntry,
    raw: memoryview | bytearray | bytes,
    blobs: dict[str, bytes],
    source: str,
    cpu: StageCpu,
) -> bool:
    """Hash a decoded shard (``verify``), then let the store check the digest and write it
    (``write``)."""
    with cpu.measure(Stage.VERIFY):
        hashed = blake3.blake3(raw).hexdigest()
    with cpu.measure(Stage.WRITE):
        return part.write_shard(entry.index, raw, source, blobs=blobs, hashed=hashed)


def keep_delta(
    part: PartialVersion, entry: ShardEntry, encoding: str, blob: memoryview, source: str
) -> bool:
    """The chain commit of one shard: keep its verified delta blob, read no base, write no
    shard (:meth:`~shardcast.store.partial.PartialVersion.keep_delta`; the bytes are verified
    whenever they are read, :mod:`shardcast.store.chains`). ``blob`` is written as it is (a
    view of the received bytes: no copy)."""
    return part.keep_delta(entry.index, encoding, blob, source)


def _write_decompressed(
    part: PartialVersion,
    entry: ShardEntry,
    encoding: str,
    blob: memoryview,
    blobs: dict[str, bytes],
    source: str,
    pool: BufferPool,
    cpu: StageCpu,
) -> bool:
    """zstd: decompress into a pooled buffer, write (see :func:`verify_and_write`)."""
    plain = pool.get(entry.length)
    try:
        try:
            with cpu.measure(Stage.APPLY):
                raw = codecs.decode(encoding, blob, entry.length, None, source, scratch=plain)
        except codecs.CodecError as exc:  # digest matched: the origin wrote a bad blob
            raise BaseMismatch(f"{encoding} blob does not decode: {exc}") from exc
        try:
            return _hash_and_write(part, entry, raw, blobs, source, cpu)
        except IntegrityError as exc:
            raise BaseMismatch(str(exc)) from exc
    finally:
        pool.put(plain)


def _patch_in_place(
    part: PartialVersion,
    entry: ShardEntry,
    encoding: str,
    blob: memoryview,
    blobs: dict[str, bytes],
    base: BaseVersion,
    source: str,
    cpu: StageCpu,
) -> bool:
    """A sparse delta with fewer changes than pages: copy the base range into the new file
    and patch it there; most pages stay as copied (or shared, with reflinks)."""
    unchanged = is_identity(blob, entry.length)

    def patch(view: memoryview) -> None:  # the base range, in the new file: patch in place
        if unchanged:  # only the copy (still hashed: the base at rest is not trusted)
            return
        try:
            with cpu.measure(Stage.APPLY):
                codecs.decode(encoding, blob, entry.length, view, source, out=view)
        except codecs.CodecError as exc:  # digest matched: the origin wrote a bad blob
            raise BaseMismatch(f"{encoding} blob does not decode: {exc}") from exc

    try:
        with cpu.measure(Stage.WRITE):  # the copy and the hash in place; the patch is apply
            return part.patch_shard(entry.index, base.fd(entry.file), patch, source, blobs)
    except BaseMismatch:
        raise
    except IntegrityError as exc:  # blob verified, result wrong: base or origin
        raise BaseMismatch(str(exc)) from exc


def _write_dense_delta(
    part: PartialVersion,
    entry: ShardEntry,
    encoding: str,
    blob: memoryview,
    blobs: dict[str, bytes],
    base: BaseVersion,
    source: str,
    pool: BufferPool,
    cpu: StageCpu,
) -> bool:
    """A dense delta, where every page changes: read the base once, patch it in the buffer,
    write once (xor-zstd also needs a buffer to decompress its frame into)."""
    held = pool.get(entry.length)
    scratch = pool.get(entry.length) if encoding == codecs.XOR_ZSTD else None
    try:
        try:
            with cpu.measure(Stage.APPLY):
                base_bytes = base.read_into(entry.file, entry.offset, entry.length, held)
                raw = codecs.decode(
                    encoding,
                    blob,
                    entry.length,
                    base_bytes,
                    source,
                    out=base_bytes,
                    scratch=scratch,
                )
        except codecs.CodecError as exc:  # digest matched: the origin wrote a bad blob
            raise BaseMismatch(f"{encoding} blob does not decode: {exc}") from exc
        try:
            return _hash_and_write(part, entry, raw, blobs, source, cpu)
        except IntegrityError as exc:  # blob verified, result wrong: base or origin
            raise BaseMismatch(str(exc)) from exc
    finally:
        pool.put(held)
        if scratch is not None:
            pool.put(scratch)
