"""store: on-disk store of checkpoint versions: verified shard writes, atomic commit, retention.

Layout under a node's data directory::

    <root>/<run_id>/step-<N>/               a committed version: every file + manifest.json
    <root>/<run_id>/step-<N>/.enc/          encoded shard blobs kept for re-serving (one pack
                                            file and its index; see blobpack.py)
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
A version being downloaded is a :class:`~shardcast.store.partial.PartialVersion`
(:mod:`shardcast.store.partial`: shards verified before they are written, a journal that
keeps verified work across restarts, commit by an atomic rename), started by
:meth:`VersionStore.begin`. A ``step-<N>/`` directory exists only if every digest matched: a
crash at any point leaves either no version or a complete one. A partial directory left by a
stop survives the next open if it has a journal and is newer than the newest committed
version; partials without a journal or of older steps are removed.

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
worker thread (``trio.to_thread.run_sync``). File primitives (hashing a file as a manifest
defines its digest, in-kernel range copies, atomic replacement) are :mod:`shardcast.store.files`.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from p2p.errors import IntegrityError, LocalProtocolError, ShardnetError
from p2p.trust import TrustList
from shardcast.core import versions_to_prune
from shardcast.store.blobpack import BlobRef, find_blob
from shardcast.store.chains import BLOB_DIR as BLOB_DIR  # where it always was, too
from shardcast.store.chains import (
    CHAIN_DIR,
    MATERIALIZE_DIR,
    ChainBroken,
    ChainReader,
    ChainRecord,
    read_record,
)
from shardcast.store.files import file_matches, fsync_dir, range_of, replace_file
from shardcast.store.partial import JOURNAL_FILE, PartialVersion
from shardcast.wire import (
    MANIFEST_FILE,
    Manifest,
    check_run_id,
    document_signer,
)

log = logging.getLogger(__name__)


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
        return range_of(m, name, offset, length, lambda i: self.read_shard(step, i))

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

    def blob_ref(self, step: int, index: int, encoding: str) -> BlobRef | None:
        """Where committed ``step`` keeps shard ``index``'s ``encoding`` blob (None: not
        kept; :func:`shardcast.store.blobpack.find_blob`). Unverified bytes: check them
        against the signed blob digest."""
        return find_blob(self.version_dir(step) / BLOB_DIR, index, encoding)

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
        return self.commit_dir(directory, manifest)

    def commit_dir(self, directory: Path, m: Manifest) -> Path:
        """Commit the complete, verified version ``m`` in ``directory`` (on this store's
        filesystem): fsync its files and ``manifest.json`` if durable, rename it to
        ``step-<N>`` atomically, remember its manifest, then prune. Returns the committed path.

        Raises:
            OSError: a file cannot be synced, or the rename fails (the version is then not
                committed).
        """
        for f in m.header.files if self.durable else ():
            path = directory / f.name
            if not path.exists():  # a chained file: its raw shards are in .chain/
                path = directory / CHAIN_DIR / f.name
                if not path.exists():
                    continue
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        replace_file(directory / MANIFEST_FILE, m.encode(), durable=self.durable)
        if self.durable:
            if (directory / CHAIN_DIR).is_dir():
                fsync_dir(directory / CHAIN_DIR)
            fsync_dir(directory)
        final = self.version_dir(m.step)
        os.rename(directory, final)
        if self.durable:
            fsync_dir(self.run_dir)
        self._remember(m)
        log.info(
            "version_committed run=%s step=%d files=%d size_bytes=%d digest=%s",
            m.run_id,
            m.step,
            len(m.header.files),
            m.total_bytes,
            m.digest[:16],
        )
        self.prune()
        return final

    def partial_closed(self, step: int) -> None:
        """The download of ``step`` closed its partial version (committed, aborted, or kept
        for a later resume)."""
        self._open_partials.discard(step)

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
