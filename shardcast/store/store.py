"""store: on-disk store of checkpoint versions: verified shard writes, atomic commit, retention.

Layout under a node's data directory::

    <root>/<run_id>/step-<N>/               a committed version: every file + manifest.json
    <root>/<run_id>/step-<N>/.enc/          encoded shard blobs kept for re-serving
    <root>/<run_id>/step-<N>/chain.json     a version kept as a chain (base + delta blobs;
    <root>/<run_id>/step-<N>/.chain/        its chained files' raw shards; see chains.py)
    <root>/<run_id>/.partial-step-<N>/      a version being downloaded (never served as complete)

Versions kept as chains (:mod:`shardcast.store.chains`, which holds the argument why their
bytes are the trainer's): a download started with ``chain_base`` keeps each verified delta
blob (:meth:`PartialVersion.keep_delta`) instead of reading the base and writing the shard,
and its commit writes ``chain.json`` in the partial directory before the same atomic rename.
:meth:`VersionStore.read_shard` produces any committed version's shard (full: ``pread``;
chain: the base's shard, recursively, with the blob applied) and hashes it against the
signed shard digest before returning it; a mismatch raises
:class:`~shardcast.store.chains.ChainBroken` and removes the damaged version and every chain
on it (:meth:`VersionStore.quarantine`). :meth:`VersionStore.materialize` builds the full
files through that read and flips the version to full. Retention keeps every base a kept
chain needs (:func:`shardcast.core.retention.versions_to_prune`); every open drops chains whose
base is gone (:meth:`VersionStore.check_chains`), and recovery after an unclean stop reads
every chained shard verified.

Theory of operation
-------------------
A download starts with :meth:`VersionStore.begin` as soon as the signed manifest *header* is
known (its parts may still be arriving), which creates the partial directory and preallocates
every file at its final size (sparse). :meth:`PartialVersion.write_shard` checks a shard's
BLAKE3 digest (from its signed part) *before* writing it at its offset with ``pwrite``, so
bytes that fail their digest never touch the disk (a delta patched in place,
:meth:`PartialVersion.patch_shard`, is hashed where it lies and never counts unless it
matches); a caller that hashed the bytes while they
arrived (:mod:`shardcast.download.receive`) passes that digest instead, and the bytes are not hashed
twice. When every part and every shard is present, :meth:`PartialVersion.commit` checks the
file digests — for a schema-3 manifest by deriving each file's hash-list root from the signed
shard digests (every shard was checked before it was written, so no file is read again; see
:mod:`shardcast.wire.manifest`), for a schema-2 manifest by re-hashing every whole file — fsyncs
the files and ``manifest.json``, and renames the partial directory to ``step-<N>`` (atomic on
POSIX), then fsyncs the parent. A ``step-<N>/`` directory therefore exists only if every
digest matched, and a crash at any point leaves either no version or a complete one.

Restarts keep verified work: every verified shard write is followed by one line appended to
``.partial-step-<N>/.journal`` (shard index and digest; the first line names the manifest
digest). A partial directory left by a stop (SIGKILL, crash, or a cancelled download that
kept it) survives the next open if it has a journal and is newer than the newest committed
version; when :meth:`VersionStore.begin` is called again for the same manifest digest, the
journaled shards whose parts are known are re-hashed from the files (BLAKE3: far cheaper than
fetching them again) and those that match are kept, so only the rest is fetched. Anything
inconsistent (another digest, a file of the wrong size, a torn line, bytes that do not match)
is dropped and fetched again. Partials without a journal or of older steps are removed.

Durability: with ``durable`` (the origin's default) the files and ``manifest.json`` are
fsynced before the rename, so a committed version survives a power loss. Followers (relays,
peers) commit without fsync — a version they lose can be downloaded again, and waiting for the
disk at every commit would put it on the broadcast's critical path — and instead mark the store
open while they run: a store opened after an unclean stop (the marker is still there) re-hashes
every committed version and removes those that do not match their manifest, so a version
damaged by a crash is never used or served.

Retention keeps the newest ``keep_last`` committed versions and the bases their chains need.
A version that is pinned (being read, served, or used as a delta base) is never removed while
pinned.

This module does blocking file I/O and no networking; async callers run its methods in a
worker thread (``trio.to_thread.run_sync``). Methods of one :class:`PartialVersion` may be
called from several threads for *different* shards at once.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import shutil
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import blake3

from p2p.errors import IntegrityError, LocalProtocolError, ShardnetError
from p2p.trust import TrustList
from shardcast.core import versions_to_prune
from shardcast.store.chains import BLOB_DIR as BLOB_DIR  # where it always was, too
from shardcast.store.chains import (
    CHAIN_DIR,
    CHAIN_FILE,
    MATERIALIZE_DIR,
    ChainBroken,
    ChainReader,
    ChainRecord,
    Level,
    fsync_dir,
    read_record,
)
from shardcast.wire import (
    MANIFEST_FILE,
    Manifest,
    check_run_id,
    codecs,
    document_signer,
    file_root,
)

_DELTAS = codecs.DELTAS

log = logging.getLogger(__name__)

_HASH_BLOCK = 8 * 1024 * 1024
# Bytes per pwrite into the page cache. Measured on a 2-core Firecracker VM (kernel 6.18,
# ext4, 2026-12-02): writing 2 GB into a new file cost 0.46-1.0 CPU-s in 1 MiB pwrites and
# 3.5-7.5 CPU-s in 16 MiB pwrites of the same buffer (cause not isolated; no end-to-end gain
# shown in one loopback run); elsewhere 1 MiB calls cost only the syscalls (2 048 per 2 GB).
WRITE_BYTES = 1 << 20
_NO_COPY_RANGE = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def hash_file(path: Path) -> str:
    """BLAKE3 hex digest of a whole file, read in 8 MiB blocks."""
    h = blake3.blake3(max_threads=blake3.blake3.AUTO)
    buf = bytearray(_HASH_BLOCK)
    with open(path, "rb", buffering=0) as fh:
        while n := fh.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def file_digest_on_disk(path: Path, manifest: Manifest, name: str) -> str:
    """The digest of file ``name`` at ``path`` as ``manifest``'s schema defines it: the
    hash-list root of its shard ranges (schema 3) or the BLAKE3 of the whole file (schema 2).
    Reads the whole file once, in 8 MiB blocks at most.

    Raises:
        OSError: unreadable, or (schema 3) of another size than the manifest says.
        KeyError: ``name`` is not in the manifest.
    """
    if not manifest.rooted:
        return hash_file(path)
    shards = [s for s in manifest.header.shards if s.file == name]
    buf = bytearray(min(_HASH_BLOCK, max((s.length for s in shards), default=0)))
    listed: list[tuple[int, str]] = []
    with open(path, "rb", buffering=0) as fh:
        size = os.fstat(fh.fileno()).st_size
        if size != manifest.header.file(name).size:
            raise OSError(
                f"{path}: {size} bytes, the manifest says {manifest.header.file(name).size}"
            )
        for s in shards:
            h = blake3.blake3()
            pos = 0
            while pos < s.length:
                view = memoryview(buf)[: min(len(buf), s.length - pos)]
                if os.preadv(fh.fileno(), [view], s.offset + pos) != len(view):
                    raise OSError(f"{path}: short read at {s.offset + pos}")
                h.update(view)
                pos += len(view)
            listed.append((s.length, h.hexdigest()))
    return file_root(listed)


def file_matches(path: Path, manifest: Manifest, name: str) -> bool:
    """True if the file at ``path`` has ``name``'s signed digest (see
    :func:`file_digest_on_disk`); False if it differs or cannot be read."""
    try:
        return file_digest_on_disk(path, manifest, name) == manifest.file_digest(name)
    except (OSError, KeyError):
        return False


def copy_range(src_fd: int, dst_fd: int, offset: int, length: int) -> None:
    """Copy bytes ``[offset, offset + length)`` of ``src_fd`` to the same range of ``dst_fd``
    inside the kernel (``copy_file_range``: a reflink on filesystems that share extents,
    a page-cache copy elsewhere), falling back to ``pread``/``pwrite`` where the call is not
    supported (other filesystems, old kernels).

    Raises:
        OSError: the source is shorter, or a read or write failed.
    """
    pos = 0
    try:
        while pos < length:
            n = os.copy_file_range(src_fd, dst_fd, length - pos, offset + pos, offset + pos)
            if n == 0:
                raise OSError(f"copy_file_range: source ends before {offset + length}")
            pos += n
        return
    except OSError as exc:
        if exc.errno not in _NO_COPY_RANGE:
            raise
    while pos < length:
        data = os.pread(src_fd, min(_HASH_BLOCK, length - pos), offset + pos)
        if not data:
            raise OSError(f"source ends before {offset + length}")
        pwrite_all(dst_fd, data, offset + pos)
        pos += len(data)


def pwrite_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    """Write all of ``data`` at byte ``offset`` of ``fd``, at most :data:`WRITE_BYTES` per call.

    Raises:
        OSError: a write failed (disk full, I/O error); part of ``data`` may be written.
    """
    view, pos = memoryview(data), 0
    while pos < len(view):
        pos += os.pwrite(fd, view[pos : pos + WRITE_BYTES], offset + pos)


def replace_file(path: Path, data: bytes, *, durable: bool) -> None:
    """Make ``path`` hold ``data`` all at once: a temporary file beside it
    (``.<name>.<pid>.tmp``), fsynced if ``durable``, then renamed over ``path``. A crash
    leaves the old contents or the new, never a part. Blocking.

    Raises:
        OSError: the file cannot be written or renamed.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
        if durable:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)


class VersionStore:
    """The versions of one run kept by one node.

    Args:
        root: the node's version directory (created if missing).
        run_id: the run whose versions are stored.
        keep_last: how many committed versions to keep (>= 1).
    """

    def __init__(self, root: Path, run_id: str, keep_last: int, durable: bool = True) -> None:
        if keep_last < 1:
            raise LocalProtocolError("keep_last must be >= 1")
        self.run_dir = root / check_run_id(run_id)
        self.run_id = run_id
        self.keep_last = keep_last
        self.durable = durable
        self._pins: dict[int, int] = {}
        self._lock = threading.Lock()
        self._open_partials: set[int] = set()
        self._digests: dict[int, tuple[int, int, str]] = {}  # step -> (inode, mtime_ns, digest)
        self._manifests: dict[int, Manifest] = {}  # step -> committed manifest (by digest)
        self.chains = ChainReader(self)
        self.damaged: dict[int, str] = {}
        """Steps removed because a verified read found them damaged -> why (this process)."""
        self.on_quarantine: Callable[[list[int]], None] | None = None
        """Told the steps :meth:`quarantine` removed (from the thread that found them; the
        node wakes its follower with it, which fetches them again). Must not block."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        latest = self.latest()
        for p in (*self.run_dir.glob(".partial-step-*"), *self.run_dir.glob(".removing-step-*")):
            suffix = p.name.rsplit("-", 1)[-1]
            resumable = (
                p.name.startswith(".partial-step-")
                and suffix.isdigit()
                and (latest is None or int(suffix) > latest)
                and (p / JOURNAL_FILE).is_file()
            )
            if not resumable:
                log.info("leftover_removed path=%s", p)  # an interrupted download or prune
                shutil.rmtree(p, ignore_errors=True)
        self._marker = self.run_dir / ".open"
        if self._marker.exists():
            self.recover()
        self.check_chains()
        if not durable:
            self._marker.write_bytes(b"")
            fsync_dir(self.run_dir)

    def recover(self) -> list[int]:
        """Re-hash every committed version after an unclean stop; remove damaged ones.

        Returns:
            the removed steps.
        """
        removed = []
        for step in self.committed_steps():
            d = self.version_dir(step)
            if not self.has(step):  # removed with a damaged base below it
                continue
            try:
                raw = (d / MANIFEST_FILE).read_bytes()
                signer = document_signer(raw, str(d))
                m = Manifest.decode(raw, trust=TrustList(trainer=signer))
                rec = read_record(d)
                chained = rec.files if rec is not None else frozenset()
                ok = m.complete and all(
                    file_matches(d / f.name, m, f.name)
                    for f in m.header.files
                    if f.name not in chained
                )
                for ref in m.header.shards if ok and rec is not None else ():
                    if ref.file in chained:
                        self.chains.read_shard(step, ref.index)  # verified, down to a full one
            except ChainBroken:
                continue  # removed already, with the chains on it
            except (OSError, ValueError, KeyError, TypeError, ShardnetError):
                ok = False
            if not ok:
                victim = self.run_dir / f".removing-step-{step}"
                os.rename(d, victim)
                shutil.rmtree(victim, ignore_errors=True)
                removed.append(step)
        log.warning("store_recovered run=%s removed_steps=%s", self.run_id, removed)
        return removed

    def check_chains(self) -> list[int]:
        """Remove every chain version whose record does not parse or whose base (step and
        digest) is not committed, and leftovers of an interrupted materialization. Cheap (no
        shard is read); run at every open, so a chain that cannot be built is never served.

        Returns:
            the removed steps.
        """
        removed: list[int] = []
        for step in self.committed_steps():
            d = self.version_dir(step)
            shutil.rmtree(d / MATERIALIZE_DIR, ignore_errors=True)
            try:
                rec = read_record(d)
            except (OSError, ValueError) as exc:
                removed += self.quarantine(step, f"unreadable chain record: {exc}")
                continue
            if rec is not None and not self.holds(rec.base_step, rec.base_digest):
                removed += self.quarantine(step, f"base step {rec.base_step} is not held")
        return removed

    def manifest_of(self, step: int) -> Manifest | None:
        """The manifest of committed ``step`` (None: not committed, or unreadable), cached
        by its digest. Blocking; thread-safe."""
        digest = self.digest_of(step)
        if digest is None:
            return None
        with self._lock:
            m = self._manifests.get(step)
        if m is not None and m.digest == digest:
            return m
        path = self.version_dir(step) / MANIFEST_FILE
        try:
            data = path.read_bytes()
            m = Manifest.decode(data, trust=TrustList(trainer=document_signer(data, str(path))))
        except (OSError, ValueError, KeyError, TypeError, ShardnetError):
            return None
        with self._lock:
            self._manifests[step] = m
            while len(self._manifests) > 2 * self.keep_last + 16:
                self._manifests.pop(next(iter(self._manifests)))
        return m

    def chain_of(self, step: int) -> ChainRecord | None:
        """The chain record of committed ``step`` (None: full, or not committed).

        Raises:
            ValueError: the record does not parse.
        """
        try:
            return read_record(self.version_dir(step))
        except FileNotFoundError:
            return None

    def chained_files(self, step: int) -> frozenset[str]:
        """Files of committed ``step`` not present in full (empty: a full version)."""
        rec = self.chain_of(step)
        return rec.files if rec is not None else frozenset()

    def quarantine(self, step: int, reason: str) -> list[int]:
        """Remove ``step`` (pinned or not) and every chain version built on it, directly or
        through other chains: none of them can be built from verified bytes any more. They
        are no longer served, offered or loaded; a follower fetches them again.

        Returns:
            the removed steps.
        """
        bad = {step}
        for s in self.committed_steps():
            try:
                rec = read_record(self.version_dir(s))
            except (OSError, ValueError):
                continue
            if rec is not None and rec.base_step in bad:
                bad.add(s)
        removed = [s for s in sorted(bad) if self.discard(s)]
        for s in removed:
            self.damaged[s] = reason
        log.error("versions_quarantined run=%s steps=%s reason=%s", self.run_id, removed, reason)
        if removed and self.on_quarantine is not None:
            self.on_quarantine(removed)
        return removed

    def read_shard(self, step: int, index: int) -> bytearray:
        """The bytes of shard ``index`` of committed ``step``, full or chain, hashed against
        the signed shard digest (and, for a chain, every level under it against its own)
        before they are returned (:mod:`shardcast.store.chains`). Pins ``step`` meanwhile.

        Raises:
            ChainBroken: the bytes do not verify or a base is gone; the damaged version and
                the chains on it are removed, nothing is returned.
        """
        with self.pinned(step):
            return self.chains.read_shard(step, index)

    def read_file_range(self, step: int, name: str, offset: int, length: int) -> bytes:
        """Bytes ``[offset, offset + length)`` of file ``name`` of committed ``step``, built
        from verified shards (:meth:`read_shard`): for serving a chain version's ranges.

        Raises:
            ChainBroken: as :meth:`read_shard`.
            KeyError: no such file.
        """
        m = self.manifest_of(step)
        if m is None:
            raise ChainBroken(step, -1, "the version is not held")
        return _range_of(m, name, offset, length, lambda i: self.read_shard(step, i))

    def materialize(self, step: int) -> bool:
        """Build committed ``step``'s full files from its chain, verifying every shard, and
        flip it to full (:meth:`~shardcast.store.chains.ChainReader.materialize`). Pins the
        step meanwhile; one materialization runs at a time.

        Returns:
            True if it was a chain (full now), False if it was full already or is not held.

        Raises:
            ChainBroken: a shard did not verify (the version and its chains are removed).
        """
        with self.pinned(step):
            return self.chains.materialize(step)

    def materialize_low_priority(self, step: int) -> bool:
        """:meth:`materialize` in a thread of its own at the lowest CPU priority (``nice``
        19, per thread on Linux), so building an anchor yields to the data path. Blocks
        until done; same result and errors."""
        out: list[bool] = []
        err: list[BaseException] = []

        def body() -> None:
            try:
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
            except OSError as exc:  # not Linux, or not permitted: run at normal priority
                log.debug("materialize_nice_refused error=%s", exc)
            try:
                out.append(self.materialize(step))
            except BaseException as exc:  # handed to the caller's thread
                err.append(exc)

        t = threading.Thread(target=body, name=f"materialize-{step}", daemon=True)
        t.start()
        t.join()
        if err:
            raise err[0]
        return out[0]

    def chain_depth(self, step: int) -> int:
        """Chain links from committed ``step`` down to a full version (0: full)."""
        return self.chains.depth(step)

    def close(self) -> None:
        """Flush what was committed and mark a clean stop (no re-verification at the next
        open): :meth:`flush` then :meth:`mark_clean`. Idempotent; blocking (``sync``)."""
        self.flush()
        self.mark_clean()

    def flush(self) -> None:
        """Write every commit made without fsync to the disk (``sync(2)``; blocking, for as
        long as the kernel's dirty pages take, which a slow disk makes seconds). Does nothing
        if the store is durable or already marked clean. A caller that cannot wait (a node
        stopping on SIGTERM) runs it in a thread with a deadline and skips :meth:`mark_clean`
        if the deadline passed: the next open then re-verifies, which is slow but correct."""
        if self._marker.exists():
            os.sync()

    def mark_clean(self) -> None:
        """Remove the unclean-stop marker (call only after :meth:`flush` returned): the next
        open trusts the committed versions without re-hashing them. Idempotent."""
        if self._marker.exists():
            self._marker.unlink()
            fsync_dir(self.run_dir)

    def committed_steps(self) -> list[int]:
        """Steps with a committed ``step-N`` directory, ascending."""
        out = []
        for p in self.run_dir.glob("step-*"):
            suffix = p.name[5:]
            if suffix.isdigit() and (p / MANIFEST_FILE).is_file():
                out.append(int(suffix))
        return sorted(out)

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.committed_steps()
        return steps[-1] if steps else None

    def version_dir(self, step: int) -> Path:
        """Directory of a committed step (may not exist)."""
        return self.run_dir / f"step-{step}"

    def partial_dir(self, step: int) -> Path:
        """Directory of an in-progress step (may not exist)."""
        return self.run_dir / f".partial-step-{step}"

    def has(self, step: int) -> bool:
        """True if ``step`` is committed."""
        return (self.version_dir(step) / MANIFEST_FILE).is_file()

    def digest_of(self, step: int) -> str | None:
        """Manifest digest of committed ``step`` (None: not committed, or its manifest does
        not parse). A version is ``(step, digest)``: callers compare the digest they were
        asked for with this one before using the step's files.

        Cached per ``manifest.json`` (inode and mtime): a step replaced under another digest
        is seen at once. Blocking (reads the manifest on a cache miss); thread-safe.
        """
        path = self.version_dir(step) / MANIFEST_FILE
        try:
            st = path.stat()
        except OSError:
            return None
        with self._lock:
            cached = self._digests.get(step)
        if cached is not None and cached[:2] == (st.st_ino, st.st_mtime_ns):
            return cached[2]
        try:
            data = path.read_bytes()
            signer = document_signer(data, str(path))
            digest = Manifest.decode(data, trust=TrustList(trainer=signer), source=str(path)).digest
        except (OSError, ValueError, KeyError, TypeError, ShardnetError):
            return None
        with self._lock:
            self._digests[step] = (st.st_ino, st.st_mtime_ns, digest)
            while len(self._digests) > 4 * self.keep_last + 16:
                self._digests.pop(next(iter(self._digests)))
        return digest

    def _remember(self, m: Manifest) -> None:
        """Seed the digest and manifest caches with ``m``, just committed here: without it
        the next :meth:`digest_of` and :meth:`manifest_of` decoded (and checked the
        signatures of) the whole manifest just written, twice, for every version (a cost
        that grows with the checkpoint, not with the change)."""
        try:
            st = (self.version_dir(m.step) / MANIFEST_FILE).stat()
        except OSError:
            return
        with self._lock:
            self._digests[m.step] = (st.st_ino, st.st_mtime_ns, m.digest)
            self._manifests[m.step] = m
            while len(self._digests) > 4 * self.keep_last + 16:
                self._digests.pop(next(iter(self._digests)))
            while len(self._manifests) > 2 * self.keep_last + 16:
                self._manifests.pop(next(iter(self._manifests)))

    def holds(self, step: int, digest: str) -> bool:
        """True if version ``(step, digest)`` is committed (the step under that digest)."""
        return self.digest_of(step) == digest

    def committed_versions(self) -> list[tuple[int, str]]:
        """``(step, manifest digest)`` of every committed version, ascending by step."""
        out = []
        for step in self.committed_steps():
            digest = self.digest_of(step)
            if digest is not None:
                out.append((step, digest))
        return out

    def load_manifest(self, step: int, trust: TrustList) -> Manifest:
        """Read and re-verify the manifest of a committed step.

        Raises:
            FileNotFoundError: not committed.
            ManifestError / IntegrityError: the stored manifest does not verify.
        """
        data = (self.version_dir(step) / MANIFEST_FILE).read_bytes()
        return Manifest.decode(data, trust=trust, source=str(self.version_dir(step)))

    def read_range(
        self, step: int, name: str, offset: int, length: int, out: bytearray | None = None
    ) -> memoryview:
        """``length`` bytes at ``offset`` of a committed version's file (e.g. a delta base), as
        a writable view of ``out`` (reused; at least ``length`` bytes) or of a fresh buffer;
        pin the step meanwhile.

        Raises:
            OSError: not committed, or the file is shorter.
            ValueError: ``out`` is shorter than ``length``.
        """
        if out is None:
            out = bytearray(length)
        if len(out) < length:
            raise ValueError(f"read buffer of {len(out)} bytes for {length}")
        view = memoryview(out)[:length]
        with open(self.version_dir(step) / name, "rb", buffering=0) as fh:
            got = os.preadv(fh.fileno(), [view], offset)
        if got != length:
            raise OSError(f"step {step} {name}: short read at {offset}")
        return view

    def blob_path(self, step: int, index: int, encoding: str) -> Path:
        """Where a committed version keeps shard ``index``'s ``encoding`` blob."""
        return self.version_dir(step) / BLOB_DIR / f"{index}.{encoding}"

    def begin(self, manifest: Manifest, chain_base: int | None = None) -> PartialVersion:
        """Start (or restart) downloading a version; returns its partial handle.

        Args:
            manifest: the verified manifest; parts may still be missing and may be added to
                it while the download runs.
            chain_base: the committed base step of ``manifest`` (its header's base, held
                here) to keep delta shards against as blobs (:meth:`PartialVersion.keep_delta`)
                and commit the version as a chain; None: every shard is written in full.

        Raises:
            LocalProtocolError: the manifest is for another run, or the step is committed.
        """
        m = manifest
        if m.run_id != self.run_id:
            raise LocalProtocolError(
                f"manifest of run {m.run_id!r} given to store of {self.run_id!r}"
            )
        if self.has(m.step):
            raise LocalProtocolError(f"step {m.step} is already committed")
        self.run_dir.mkdir(parents=True, exist_ok=True)  # the data directory may have vanished
        if not self.durable and not self._marker.exists():
            self._marker.write_bytes(b"")
        for p in self.run_dir.glob(".partial-step-*"):  # partials of versions passed over
            suffix = p.name.rsplit("-", 1)[-1]
            if suffix.isdigit() and int(suffix) < m.step and int(suffix) not in self._open_partials:
                shutil.rmtree(p, ignore_errors=True)
        if chain_base is not None and (
            chain_base != m.header.base_step
            or m.header.base_digest is None
            or not self.holds(chain_base, m.header.base_digest)
            or not m.rooted
        ):
            raise LocalProtocolError(f"step {m.step} cannot be kept as a chain on {chain_base}")
        part = PartialVersion(self, manifest, chain_base)
        self._open_partials.add(m.step)
        return part

    def discard_partial(self, step: int) -> None:
        """Remove the kept partial version of ``step`` unless a download has it open."""
        if step not in self._open_partials:
            shutil.rmtree(self.partial_dir(step), ignore_errors=True)

    def adopt(self, directory: Path, manifest: Manifest, *, rehash: bool = True) -> Path:
        """Commit a directory that this node produced itself (the origin's own checkpoint).

        The directory is renamed into place (it must be on the same filesystem). With
        ``rehash`` (the default) every file is re-hashed against the manifest first; the
        origin passes ``rehash=False`` when it built the manifest from this very directory
        a moment ago.

        Raises:
            IntegrityError: a file does not match the manifest.
        """
        if not manifest.complete:
            raise LocalProtocolError(f"step {manifest.step}: manifest parts are missing")
        for f in manifest.header.files if rehash else ():
            if not file_matches(directory / f.name, manifest, f.name):
                raise IntegrityError(f"{directory / f.name} does not match its manifest digest")
        return _commit_dir(self, directory, manifest)

    @contextmanager
    def pinned(self, step: int) -> Iterator[None]:
        """Keep ``step`` from being pruned while the context is open (re-entrant)."""
        with self._lock:
            self._pins[step] = self._pins.get(step, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._pins[step] -= 1
                if not self._pins[step]:
                    del self._pins[step]

    def discard(self, step: int) -> bool:
        """Remove committed ``step`` now, pinned or not (it is no longer served; readers
        holding its files open keep reading them). Used when the trainer's signed version of
        ``step`` has another manifest digest.

        Returns:
            True if a version was removed.
        """
        with self._lock:
            if not self.has(step):
                return False
            victim = self.run_dir / f".removing-step-{step}"
            os.rename(self.version_dir(step), victim)
        shutil.rmtree(victim, ignore_errors=True)
        log.warning("version_discarded run=%s step=%d", self.run_id, step)
        return True

    def prune(self) -> list[int]:
        """Remove committed versions beyond the newest ``keep_last`` that are not pinned.

        Returns:
            the removed steps.
        """
        removed = []
        bases = {}
        for step in self.committed_steps():
            try:
                rec = read_record(self.version_dir(step))
            except (OSError, ValueError):
                continue
            if rec is not None:
                bases[step] = rec.base_step
        with self._lock:
            pruned = versions_to_prune(self.committed_steps(), self.keep_last, self._pins, bases)
            for step in pruned:
                victim = self.run_dir / f".removing-step-{step}"
                os.rename(self.version_dir(step), victim)  # disappears atomically
                shutil.rmtree(victim, ignore_errors=True)
                removed.append(step)
        if removed:
            log.info("versions_pruned run=%s steps=%s", self.run_id, removed)
        return removed


def latest_committed(root: Path, run_id: str) -> int | None:
    """The newest committed step under a store root, read without opening the store (no
    clean-up, no recovery), or None."""
    run_dir = root / check_run_id(run_id)
    steps = [
        int(p.name[5:])
        for p in (run_dir.glob("step-*") if run_dir.is_dir() else ())
        if p.name[5:].isdigit() and (p / MANIFEST_FILE).is_file()
    ]
    return max(steps) if steps else None


def _range_of(
    m: Manifest, name: str, offset: int, length: int, shard: Callable[[int], bytearray]
) -> bytes:
    """Bytes ``[offset, offset + length)`` of file ``name`` assembled from ``shard(i)``."""
    size, first = m.header.shard_size, m.header.first_shard(name)
    if offset < 0 or length < 0 or offset + length > m.header.file(name).size:
        raise ValueError(f"{name}: range {offset}+{length} outside the file")
    out = bytearray()
    pos = offset
    while pos < offset + length:
        i = first + pos // size
        start = pos - pos % size
        data = shard(i)
        take = min(offset + length, start + len(data)) - pos
        out += memoryview(data)[pos - start : pos - start + take]
        pos += take
    return bytes(out)


def _commit_dir(store: VersionStore, directory: Path, m: Manifest) -> Path:
    for f in m.header.files if store.durable else ():
        if not (directory / f.name).exists():  # a chained file: see .chain/
            continue
        fd = os.open(directory / f.name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    replace_file(directory / MANIFEST_FILE, m.encode(), durable=store.durable)
    if store.durable:
        fsync_dir(directory)
    final = store.version_dir(m.step)
    os.rename(directory, final)
    if store.durable:
        fsync_dir(store.run_dir)
    store._remember(m)
    log.info(
        "version_committed run=%s step=%d files=%d size_bytes=%d digest=%s",
        m.run_id,
        m.step,
        len(m.header.files),
        m.total_bytes,
        m.digest[:16],
    )
    store.prune()
    return final


JOURNAL_FILE = ".journal"
_JOURNAL_MAGIC = "shardnet-journal 1"


def _read_journal(path: Path, digest: str) -> dict[int, tuple[str, str]]:
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


class PartialVersion:
    """A version being downloaded; see the module docstring.

    Attributes:
        manifest: the version's manifest (parts may arrive while downloading).
        dir: the partial directory.
        restored: shards kept from a previous run of this download (journaled, re-hashed).
    """

    def __init__(
        self, store: VersionStore, manifest: Manifest, chain_base: int | None = None
    ) -> None:
        self.store = store
        self.manifest = manifest
        self.chain_base = chain_base
        """The base step delta shards are kept against (:meth:`keep_delta`), or None."""
        self._delta: dict[int, str] = {}  # shard -> encoding of its kept blob (chain mode)
        self.header = manifest.header
        self.dir = store.partial_dir(manifest.step)
        self._have = [False] * len(self.header.shards)
        self._prefix: dict[int, int] = {}  # shard -> bytes from its start verified and written
        self._lock = threading.Lock()
        self._shard_locks: dict[int, threading.Lock] = {}
        self._closed = False
        self._fds: dict[str, int] = {}
        journal = self.dir / JOURNAL_FILE
        entries = _read_journal(journal, manifest.digest) if self.dir.is_dir() else {}
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
        digest (a kept delta: whose blob hashes to its offered digest, in chain mode only);
        drop every blob of a shard not kept (or not matching its offered digest)."""
        kept = 0
        for index, (digest, enc) in sorted(entries.items()):
            if index >= len(self._have) or not self.manifest.known(index):
                continue
            shard = self.manifest.shard(index)
            if shard.digest != digest:
                continue
            if enc:
                offered = shard.offered(enc)
                path = self.blob_path(index, enc)
                if (
                    self.chain_base is not None
                    and offered is not None
                    and path.is_file()
                    and blake3.blake3(path.read_bytes()).hexdigest() == offered.digest
                ):
                    self._have[index] = True
                    self._delta[index] = enc
                    kept += 1
                continue
            data = os.pread(self._fds[shard.file], shard.length, shard.offset)
            if blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest() == digest:
                self._have[index] = True
                kept += 1
        blob_dir = self.dir / BLOB_DIR
        for path in blob_dir.iterdir() if blob_dir.is_dir() else ():
            stem, _, enc = path.name.partition(".")
            ok = stem.isdigit() and int(stem) < len(self._have) and self._have[int(stem)]
            offered = self.manifest.shard(int(stem)).offered(enc) if ok else None
            if offered is None or blake3.blake3(path.read_bytes()).hexdigest() != offered.digest:
                path.unlink(missing_ok=True)
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

    @property
    def missing(self) -> int:
        """Number of shards not yet verified and written."""
        return self._missing

    def blob_path(self, index: int, encoding: str) -> Path:
        """Where this partial keeps shard ``index``'s ``encoding`` blob."""
        return self.dir / BLOB_DIR / f"{index}.{encoding}"

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
        if encoding not in _DELTAS or self.manifest.shard(index).offered(encoding) is None:
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
            path = self.blob_path(index, enc)
            path.parent.mkdir(exist_ok=True)
            with open(path, "wb") as fh:
                fh.write(blob)
        with self._lock:
            if self._have[index]:
                return False
            self._have[index] = True
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
            top = Level(self.step, self.manifest, self.blob_path(index, enc), enc, False)
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
        return _range_of(
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
        self.store._open_partials.discard(self.step)
        return _commit_dir(self.store, self.dir, self.manifest)

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
        self.store._open_partials.discard(self.step)
        shutil.rmtree(self.dir, ignore_errors=True)

    def close(self) -> None:
        """Stop writing but keep the partial version and its journal (idempotent): a later
        :meth:`VersionStore.begin` of the same manifest resumes its verified shards."""
        self._close_fds()
        self.store._open_partials.discard(self.step)

    def _close_fds(self) -> None:
        with self._lock:
            self._closed = True
            fds, self._fds = self._fds, {}
            journal, self._journal = getattr(self, "_journal", -1), -1
        for fd in fds.values():
            os.close(fd)
        if journal >= 0:
            os.close(journal)
