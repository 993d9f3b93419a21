"""store: a version being downloaded: verified shard writes, a journal, the atomic commit.

Theory of operation
-------------------
A download starts with :meth:`~shardcast.store.store.VersionStore.begin` as soon as the signed
manifest *header* is known (its parts may still be arriving), which creates the partial
directory ``.partial-step-<N>/`` and preallocates every file at its final size (sparse).
:meth:`PartialVersion.write_shard` checks a shard's BLAKE3 digest (from its signed part)
*before* writing it at its offset with ``pwrite``, so bytes that fail their digest never touch
the disk (a delta patched in place, :meth:`PartialVersion.patch_shard`, is hashed where it lies
and never counts unless it matches); a caller that hashed the bytes while they arrived
(:mod:`shardcast.download.receive`) passes that digest instead, and the bytes are not hashed
twice. A download kept as a chain (``chain_base``) keeps each verified delta blob
(:meth:`PartialVersion.keep_delta`) instead of reading the base and writing the shard, and its
commit writes ``chain.json`` (:mod:`shardcast.store.chains`) in the partial directory before
the same atomic rename. When every part and every shard is present,
:meth:`PartialVersion.commit` checks the file digests — for a schema-3 manifest by deriving
each file's hash-list root from the signed shard digests (every shard was checked before it
was written, so no file is read again; see :mod:`shardcast.wire.manifest`), for a schema-2
manifest by re-hashing every whole file — and has the store commit the directory (fsyncs when
durable, then an atomic rename to ``step-<N>``): a ``step-<N>/`` directory therefore exists
only if every digest matched, and a crash at any point leaves either no version or a complete
one.

Restarts keep verified work: every verified shard write is followed by one line appended to
``.partial-step-<N>/.journal`` (shard index and digest; the first line names the manifest
digest). A partial directory left by a stop (SIGKILL, crash, or a cancelled download that
kept it) survives the next open if it has a journal and is newer than the newest committed
version; when ``begin`` is called again for the same manifest digest, the journaled shards
whose parts are known are re-hashed from the files (BLAKE3: far cheaper than fetching them
again) and those that match are kept, so only the rest is fetched. Anything inconsistent
(another digest, a file of the wrong size, a torn line, bytes that do not match) is dropped
and fetched again.

Blocking file I/O, no networking; async callers run these methods in a worker thread. Methods
of one :class:`PartialVersion` may be called from several threads for *different* shards at
once.
"""

from __future__ import annotations

import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Protocol

import blake3

from p2p.errors import IntegrityError, LocalProtocolError
from shardcast.store.blobpack import PACK_FILE, PACK_INDEX, BlobPack, BlobRef, read_index
from shardcast.store.chains import (
    BLOB_DIR,
    CHAIN_DIR,
    CHAIN_FILE,
    ChainBroken,
    ChainReader,
    ChainRecord,
    Level,
)
from shardcast.store.files import copy_range, hash_file, pwrite_all, range_of
from shardcast.wire import Manifest, codecs

log = logging.getLogger(__name__)

__all__ = ["JOURNAL_FILE", "PartialVersion", "VersionHome", "read_journal"]


JOURNAL_FILE = ".journal"
_JOURNAL_MAGIC = "shardnet-journal 1"


def read_journal(path: Path, digest: str) -> dict[int, tuple[str, str]]:
    """Entries (shard index -> (digest, kept blob encoding or ``""`` for a shard written in
    the file)) of a journal written for manifest ``digest``; empty if it is missing, of
    another version, or unreadable. A torn last line is ignored."""
    try:
        lines = path.read_text(encoding="ascii", errors="replace").split("\n")
    except OSError:
        return {}
    if not lines or lines[0] != f"{_JOURNAL_MAGIC} {digest}":
        return {}
    out: dict[int, tuple[str, str]] = {}
    for line in lines[1:]:
        fields = line.split(" ")
        if len(fields) in (2, 3) and fields[0].isdigit() and len(fields[1]) == 64:
            out[int(fields[0])] = (fields[1], fields[2] if len(fields) == 3 else "")
    return out


class VersionHome(Protocol):
    """What a :class:`PartialVersion` needs of the store it commits into
    (:class:`shardcast.store.store.VersionStore` is one)."""

    durable: bool
    chains: ChainReader

    def partial_dir(self, step: int) -> Path:
        """Where a version being downloaded is written."""
        ...

    def version_dir(self, step: int) -> Path:
        """Where a committed version is."""
        ...

    def manifest_of(self, step: int) -> Manifest | None:
        """A committed version's manifest (None: not held)."""
        ...

    def chained_files(self, step: int) -> frozenset[str]:
        """The files a committed version keeps as a chain (empty: held in full)."""
        ...

    def pinned(self, step: int) -> AbstractContextManager[None]:
        """Keep a committed version from being pruned while the context is open."""
        ...

    def commit_dir(self, directory: Path, m: Manifest) -> Path:
        """Commit the complete, verified version in ``directory`` atomically; its path."""
        ...

    def partial_closed(self, step: int) -> None:
        """The download of ``step`` has closed its partial version."""
        ...


class PartialVersion:
    """A version being downloaded; see the module docstring.

    Args:
        store: the store it is committed into.
        manifest: the verified manifest (parts may still be missing).
        chain_base: the committed base step delta shards are kept against, or None.

    Attributes:
        manifest: the version's manifest (parts may arrive while downloading).
        dir: the partial directory.
        restored: shards kept from a previous run of this download (journaled, re-hashed).
    """

    def __init__(
        self, store: VersionHome, manifest: Manifest, chain_base: int | None = None
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.chain_base = chain_base
        """The base step delta shards are kept against (:meth:`keep_delta`), or None."""
        self._delta: dict[int, str] = {}  # shard -> encoding of its kept blob (chain mode)
        self.header = manifest.header
        self.dir = store.partial_dir(manifest.step)
        self._have = [False] * len(self.header.shards)
        self._bits = bytearray((len(self._have) + 7) // 8)  # _have as a /have bitmap
        self._prefix: dict[int, int] = {}  # shard -> bytes from its start verified and written
        self._lock = threading.Lock()
        self._shard_locks: dict[int, threading.Lock] = {}
        self._closed = False
        self._fds: dict[str, int] = {}
        journal = self.dir / JOURNAL_FILE
        entries = read_journal(journal, manifest.digest) if self.dir.is_dir() else {}
        if not entries or not self._open_files(create=False):
            self._close_fds()
            self._closed = False
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir.mkdir(parents=True)
            self._open_files(create=True)
            entries = {}
        self.restored = self._restore(entries)
        self._missing = len(self._have) - self.restored
        tmp = self.dir / f"{JOURNAL_FILE}.tmp"  # rewritten with the kept entries only
        with open(tmp, "w", encoding="ascii") as fh:
            fh.write(f"{_JOURNAL_MAGIC} {manifest.digest}\n")
            for i, ok in enumerate(self._have):
                if ok:
                    enc = f" {self._delta[i]}" if i in self._delta else ""
                    fh.write(f"{i} {self.manifest.shard(i).digest}{enc}\n")
        os.rename(tmp, journal)
        self._journal = os.open(journal, os.O_WRONLY | os.O_APPEND)
        if self.restored:
            log.info(
                "partial_resumed step=%d shards_kept=%d shards_missing=%d",
                self.step,
                self.restored,
                self._missing,
            )

    def _open_files(self, *, create: bool) -> bool:
        """Open every file (created sparse at its size, or reopened: False if one is missing
        or has another size)."""
        for f in self.header.files:
            path = self.dir / f.name
            if create:
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o644)
                os.ftruncate(fd, f.size)
            else:
                try:
                    fd = os.open(path, os.O_RDWR)
                except OSError:
                    return False
                if os.fstat(fd).st_size != f.size:
                    os.close(fd)
                    return False
            self._fds[f.name] = fd
        return True

    def _restore(self, entries: dict[int, tuple[str, str]]) -> int:
        """Keep the journaled shards whose part is known and whose bytes hash to the journaled
        digest (a kept delta: whose blob in the pack hashes to its offered digest, in chain
        mode only); keep in the pack's index only the blobs of kept shards that match their
        offered digests (:mod:`shardcast.store.blobpack`), and remove blobs kept one per file
        (the layout before packs: their shards are fetched again)."""
        kept = 0
        blob_dir = self.dir / BLOB_DIR
        stored = read_index(blob_dir)
        good: dict[tuple[int, str], tuple[int, int]] = {}
        pack = blob_dir / PACK_FILE

        def matches(index: int, enc: str) -> bool:
            offered = self.manifest.shard(index).offered(enc)
            at = stored.get((index, enc))
            if offered is None or at is None or at[1] != offered.size:
                return False
            if (index, enc) not in good:
                data = BlobRef(pack, *at).read()
                if blake3.blake3(data).hexdigest() != offered.digest:
                    return False
                good[(index, enc)] = at
            return True

        for index, (digest, enc) in sorted(entries.items()):
            if index >= len(self._have) or not self.manifest.known(index):
                continue
            shard = self.manifest.shard(index)
            if shard.digest != digest:
                continue
            if enc:
                if self.chain_base is not None and matches(index, enc):
                    self._set_have(index)
                    self._delta[index] = enc
                    kept += 1
                continue
            data = os.pread(self._fds[shard.file], shard.length, shard.offset)
            if blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest() == digest:
                self._set_have(index)
                kept += 1
        for index, enc in stored:
            if index < len(self._have) and self._have[index] and self._delta.get(index, enc) == enc:
                matches(index, enc)
        good = {k: v for k, v in good.items() if self._have[k[0]]}
        for path in blob_dir.iterdir() if blob_dir.is_dir() else ():
            if path.name not in (PACK_FILE, PACK_INDEX):
                path.unlink(missing_ok=True)
        self._pack = BlobPack(blob_dir, good)
        return kept

    @property
    def step(self) -> int:
        """The version's step."""
        return self.manifest.step

    def has(self, index: int) -> bool:
        """True if shard ``index`` is written and verified."""
        return self._have[index]

    def prefix(self, index: int) -> int:
        """Bytes of shard ``index``, from its start, that are verified and written: its
        length once the shard is present, else what :meth:`write_prefix` wrote (verified
        chunks of a shard still arriving, servable at once)."""
        if self._have[index]:
            return self.header.shards[index].length
        return self._prefix.get(index, 0)

    def prefixes(self) -> dict[int, int]:
        """``{shard: verified bytes}`` of the shards partly written (not yet present)."""
        with self._lock:
            return {i: n for i, n in self._prefix.items() if not self._have[i]}

    def write_prefix(self, index: int, start: int, data: bytes | bytearray | memoryview) -> bool:
        """Write bytes of shard ``index`` at ``start`` (within the shard) that the caller
        verified against the shard's signed chunk list, extending its verified prefix to
        ``start + len(data)`` if that is further (the bytes must follow on from it).

        Called on the event-loop thread as each chunk verifies (one ``pwrite`` of about
        1 MiB into the page cache). When the whole shard came this way, :meth:`write_shard`
        writes nothing again.

        Returns:
            False if the version is closed or the shard already present (nothing written).

        Raises:
            LocalProtocolError: the bytes would leave a gap after the verified prefix, or
                run past the shard.
        """
        ref = self.header.shards[index]
        end = start + len(data)
        if end > ref.length:
            raise LocalProtocolError(f"shard {index}: bytes {start}..{end} past {ref.length}")
        with self._lock:
            if self._closed or self._have[index]:
                return False
            if start > self._prefix.get(index, 0):
                raise LocalProtocolError(f"shard {index}: a gap before byte {start}")
            fd = self._fds[ref.file]
        pwrite_all(fd, data, ref.offset + start)
        with self._lock:
            if end > self._prefix.get(index, 0):
                self._prefix[index] = end
        return True

    def have_bitmap(self) -> list[bool]:
        """Copy of the per-shard availability."""
        return list(self._have)

    def have_bits(self) -> bytes:
        """The shards present as a ``/have`` bitmap (:func:`~shardcast.wire.have.shard_bits`'
        layout, ``(shards + 7) // 8`` bytes), kept up to date as shards arrive: O(shards / 8)
        per call, where building it from :meth:`has` costs a Python call per shard (held
        ``/have`` long-polls rebuild their answer on every shard that starts or completes,
        so that was O(shards²) per version)."""
        with self._lock:
            return bytes(self._bits)

    def _set_have(self, index: int) -> None:
        """Mark shard ``index`` present (caller holds :attr:`_lock`, or is the constructor)."""
        self._have[index] = True
        self._bits[index >> 3] |= 0x80 >> (index & 7)

    @property
    def missing(self) -> int:
        """Number of shards not yet verified and written."""
        return self._missing

    def blob_ref(self, index: int, encoding: str) -> BlobRef | None:
        """Where this partial keeps shard ``index``'s ``encoding`` blob (None: not kept)."""
        return self._pack.ref(index, encoding)

    def write_shard(
        self,
        index: int,
        data: bytes | bytearray | memoryview,
        source: str = "",
        blobs: dict[str, bytes] | None = None,
        hashed: str | None = None,
    ) -> bool:
        """Verify shard ``index`` against its digest, then write it at its offset.

        Args:
            index: shard index.
            data: exactly the shard's decoded bytes.
            source: who sent the bytes (for the error).
            blobs: encoded forms received for it (already checked against their offered
                digests by the caller), kept for re-serving.
            hashed: the BLAKE3 hex digest the caller computed over exactly ``data`` (while
                it arrived); it is compared with the signed digest instead of hashing
                ``data`` again. The caller vouches that ``data`` did not change since.

        Returns:
            True if written now, False if the shard was already present (nothing written).

        Raises:
            LocalProtocolError: its part has not arrived, or the version is closed.
            IntegrityError: wrong length or digest; nothing is written.
        """
        if not self.manifest.known(index):
            raise LocalProtocolError(f"shard {index}: its manifest part has not arrived")
        shard = self.manifest.shard(index)
        if len(data) != shard.length:
            raise IntegrityError(
                f"shard {index} has {len(data)} bytes, expected {shard.length}", source
            )
        if hashed is None:
            hashed = blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()
        if hashed != shard.digest:
            raise IntegrityError(f"shard {index} of {shard.file} digest mismatch", source)
        with self._claim(index) as fd:
            if fd < 0:
                return False
            if self._prefix.get(index, 0) < shard.length:  # else every chunk was written
                pwrite_all(fd, data, shard.offset)  # as it verified
            return self._mark(index, blobs)

    def patch_shard(
        self,
        index: int,
        src_fd: int,
        patch: Callable[[memoryview], None],
        source: str = "",
        blobs: dict[str, bytes] | None = None,
    ) -> bool:
        """Build shard ``index`` in place: copy the same range of ``src_fd`` (the base
        version's file) into it (:func:`copy_range`), let ``patch`` change that range through
        a memory map, then hash it there against the signed digest.

        The delta path of :mod:`shardcast.download.receive`: the base bytes are never copied
        through a
        Python buffer, a ``sparse`` patch touches only the changed words, and the result is
        hashed where it lies. Unlike :meth:`write_shard`, bytes that fail their digest have
        touched the partial file's range; the shard stays absent (never served, never
        journaled) and the next attempt rewrites the whole range (a re-copy before a patch,
        or a raw write).

        Args:
            index: shard index.
            src_fd: the base version's file holding the same range.
            patch: changes the range in place (its argument: a writable view of exactly the
                shard's bytes, valid only during the call); exceptions propagate.
            source: who sent the delta (for the error).
            blobs: encoded forms to keep for re-serving.

        Returns:
            True if written now, False if already present (nothing done).

        Raises:
            IntegrityError: the patched bytes do not match the shard digest.
            LocalProtocolError: its part has not arrived, or the version is closed.
            OSError: the copy or the map failed.
        """
        if not self.manifest.known(index):
            raise LocalProtocolError(f"shard {index}: its manifest part has not arrived")
        shard = self.manifest.shard(index)
        with self._claim(index) as fd:
            if fd < 0:
                return False
            copy_range(src_fd, fd, shard.offset, shard.length)
            if shard.length == 0:
                return self._mark(index, blobs)
            start = shard.offset - shard.offset % mmap.ALLOCATIONGRANULARITY
            skip = shard.offset - start
            flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)  # no fault per page
            with mmap.mmap(fd, skip + shard.length, flags=flags, offset=start) as mm:
                view = memoryview(mm)[skip : skip + shard.length]
                try:
                    patch(view)
                    digest = blake3.blake3(view).hexdigest()
                finally:
                    view.release()
            if digest != shard.digest:
                raise IntegrityError(f"shard {index} of {shard.file} digest mismatch", source)
            return self._mark(index, blobs)

    @contextmanager
    def _claim(self, index: int) -> Iterator[int]:
        """Hold shard ``index`` exclusively (writes of one shard never interleave, and a
        patch is never applied twice); yields the file's descriptor, or -1 if the shard is
        already present.

        Raises:
            LocalProtocolError: the version is closed.
        """
        with self._lock:
            if self._closed:
                raise LocalProtocolError(f"step {self.step} is no longer open")
            lock = self._shard_locks.setdefault(index, threading.Lock())
        with lock:
            with self._lock:
                if self._closed:
                    raise LocalProtocolError(f"step {self.step} is no longer open")
                fd = -1 if self._have[index] else self._fds[self.header.shards[index].file]
            yield fd

    def keep_delta(
        self, index: int, encoding: str, blob: bytes | memoryview, source: str = ""
    ) -> bool:
        """Keep shard ``index`` as its delta blob against :attr:`chain_base`, without reading
        the base or writing the shard (the chain commit of one shard,
        :mod:`shardcast.store.chains`). The caller checked ``blob`` against its signed
        digest; the shard's bytes are verified whenever they are read.

        Returns:
            True if kept now, False if the shard was already present.

        Raises:
            LocalProtocolError: not in chain mode, the part has not arrived, ``encoding`` is
                not an offered delta of the shard, or the version is closed.
        """
        if self.chain_base is None:
            raise LocalProtocolError(f"step {self.step} is not kept as a chain")
        if not self.manifest.known(index):
            raise LocalProtocolError(f"shard {index}: its manifest part has not arrived")
        if encoding not in codecs.DELTAS or self.manifest.shard(index).offered(encoding) is None:
            raise LocalProtocolError(f"shard {index}: {encoding} is not an offered delta")
        with self._claim(index) as fd:
            if fd < 0:
                return False
            return self._mark(index, {encoding: blob}, delta=encoding)

    def in_file(self, index: int) -> bool:
        """True if shard ``index``'s bytes are (or will be) in this partial's file; False if
        it is kept as a delta blob (its bytes are built on read)."""
        return index not in self._delta

    def _mark(
        self, index: int, blobs: Mapping[str, bytes | memoryview] | None, delta: str | None = None
    ) -> bool:
        """Keep the blobs, then mark shard ``index`` present and journal it (``delta``: kept
        as that blob, not written)."""
        shard = self.manifest.shard(index)
        for enc, blob in (blobs or {}).items():
            if self._pack.append(index, enc, blob) is None:
                return False  # closed meanwhile
        with self._lock:
            if self._have[index]:
                return False
            self._set_have(index)
            if delta is not None:
                self._delta[index] = delta
            self._prefix.pop(index, None)
            self._missing -= 1
            if not self._closed:  # one append per verified shard (atomic with O_APPEND)
                enc = f" {delta}" if delta is not None else ""
                os.write(self._journal, f"{index} {shard.digest}{enc}\n".encode())
        return True

    def read_shard(self, index: int) -> bytes:
        """The bytes of a verified shard (a kept delta: built from the base and verified,
        :meth:`~shardcast.store.chains.ChainReader.read_shard`).

        Raises:
            LocalProtocolError: the shard is not present.
            ChainBroken: a kept delta's bytes did not verify (the base's damage removes it).
        """
        if not self._have[index]:
            raise LocalProtocolError(f"shard {index} is not present")
        enc = self._delta.get(index)
        if enc is not None:
            assert self.chain_base is not None
            ref = self._pack.ref(index, enc)
            if ref is None:
                raise ChainBroken(self.step, index, f"its {enc} blob is not kept")
            top = Level(self.step, self.manifest, ref.path, enc, False, ref)
            with self.store.pinned(self.chain_base):
                return bytes(self.store.chains.read_shard(self.chain_base, index, top))
        s = self.header.shards[index]
        return os.pread(self._fds[s.file], s.length, s.offset)

    def read_file_range(self, name: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of file ``name``, from present shards
        (:meth:`read_shard`): for serving ranges that cover kept deltas.

        Raises:
            LocalProtocolError: a shard of the range is not present.
            ChainBroken: as :meth:`read_shard`.
        """
        return range_of(
            self.manifest, name, offset, length, lambda i: bytearray(self.read_shard(i))
        )

    def commit(self) -> Path:
        """Check every file digest and commit atomically; returns the ``step-N`` directory.

        Schema 3 reads no file: the roots are derived from the signed shard digests that
        every written shard matched. Schema 2 re-hashes every file.

        Raises:
            LocalProtocolError: shards or manifest parts are missing.
            IntegrityError: a whole-file digest does not match; the partial is removed and
                nothing is committed.
        """
        if self._missing or not self.manifest.complete:
            raise LocalProtocolError(
                f"{self._missing} shards missing (manifest complete: "
                f"{self.manifest.complete}), cannot commit"
            )
        if self.store.durable:
            self._pack.sync()  # kept blobs: a chain version's shards are built from them
        self._close_fds()
        if self._delta:
            self._write_chain()
        for f in self.header.files:
            if self.manifest.rooted:  # every shard was checked before it was written
                ok = self.manifest.shard_root(f.name) == self.manifest.file_digest(f.name)
            else:
                ok = hash_file(self.dir / f.name) == self.manifest.file_digest(f.name)
            if not ok:
                self.abort()
                raise IntegrityError(f"file {f.name} of step {self.step} digest mismatch")
        (self.dir / JOURNAL_FILE).unlink()
        self.store.partial_closed(self.step)
        return self.store.commit_dir(self.dir, self.manifest)

    def _write_chain(self) -> None:
        """Move the files holding kept deltas aside (``.chain/``: only their raw shards are
        in them) and write ``chain.json``, both inside the partial directory: the commit's
        rename then makes the whole chain appear at once."""
        assert self.chain_base is not None
        assert self.header.base_digest is not None
        files = {self.header.shards[i].file for i in self._delta}
        deltas = dict(self._delta)
        for name in sorted(files):
            if self._link_unchanged(name):
                files.discard(name)
                deltas = {i: e for i, e in deltas.items() if self.header.shards[i].file != name}
        if not files:
            return
        (self.dir / CHAIN_DIR).mkdir(exist_ok=True)
        for name in sorted(files):
            os.rename(self.dir / name, self.dir / CHAIN_DIR / name)
        rec = ChainRecord(self.chain_base, self.header.base_digest, frozenset(files), deltas)
        tmp = self.dir / f".{CHAIN_FILE}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(rec.encode())
            if self.store.durable:
                fh.flush()
                os.fsync(fh.fileno())
        os.rename(tmp, self.dir / CHAIN_FILE)

    def _link_unchanged(self, name: str) -> bool:
        """Put the base's file ``name`` in place of this partial's if both versions sign the
        same file digest and the base holds it in full: a hard link (no byte read or
        written), or an in-kernel copy where links are refused. Unchanged files (config,
        tokenizer, frozen weights) so stay whole in every chain version. False: keep it
        chained."""
        assert self.chain_base is not None
        base = self.store.manifest_of(self.chain_base)
        base_dir = self.store.version_dir(self.chain_base)
        if (
            base is None
            or name not in {f.name for f in base.header.files}
            or name in self.store.chained_files(self.chain_base)
            or base.file_digest(name) != self.manifest.file_digest(name)
        ):
            return False
        tmp = self.dir / f".{name}.link"
        try:
            os.link(base_dir / name, tmp)
        except OSError:
            size = self.header.file(name).size
            src = os.open(base_dir / name, os.O_RDONLY)
            try:
                dst = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
                try:
                    os.ftruncate(dst, size)
                    copy_range(src, dst, 0, size)
                finally:
                    os.close(dst)
            finally:
                os.close(src)
        os.rename(tmp, self.dir / name)
        return True

    def abort(self) -> None:
        """Drop the partial version (idempotent); a later ``begin`` starts afresh."""
        self._close_fds()
        self.store.partial_closed(self.step)
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        """Stop writing but keep the partial version and its journal (idempotent): a later
        :meth:`VersionStore.begin` of the same manifest resumes its verified shards."""
        self._close_fds()
        self.store.partial_closed(self.step)

    def _close_fds(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
            journal, self._journal = getattr(self, "_journal", -1), -1
        for fd in fds.values():
            os.close(fd)
        if journal >= 0:
            os.close(journal)
        if hasattr(self, "_pack"):
            self._pack.close()
