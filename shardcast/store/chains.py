"""store: versions kept as chains: a base version plus the verified delta blobs, read verified.

Theory of operation
-------------------
A follower that receives version ``N`` as deltas against a base ``B`` it holds need not build
``N``'s files: the delta blobs it received (each checked against the blob digest the trainer
signed in ``N``'s manifest) and ``B`` determine ``N``'s bytes. It commits ``N`` as a *chain*:

- ``step-N/chain.json`` (:class:`ChainRecord`): the base's step and manifest digest, the files
  not present in full (*chained* files), and, per shard built from a blob, the blob's
  encoding. Written inside the partial directory before the commit's atomic rename, so a
  crash leaves either the old state or a whole chain.
- ``step-N/.enc/pack`` and its index ``pack.idx``: the kept blobs (served to downstream nodes
  as received; :mod:`shardcast.store.blobpack`).
- ``step-N/.chain/<file>``: a chained file's shards that came raw (fetched raw after a
  mismatch, or never offered as a delta), at their offsets; the delta shards' ranges are holes.
  Files with no delta shard stay ``step-N/<file>`` in full; so do unchanged files hard-linked
  from a full base.

**Why a chain version's bytes are the trainer's.** Shard ``i`` of ``N`` is
``decode(blob_i, B_i)``. ``blob_i`` is the blob whose BLAKE3 digest the trainer signed in
``N``'s manifest part (checked on receipt). ``B_i`` is bound to the BLAKE3 digest of shard
``i`` signed in ``B``'s manifest, and ``B`` is exactly the version ``N``'s signed header names
(``base_step``, ``base_digest``). The decoders (:mod:`shardcast.wire.codecs`,
:mod:`shardcast.wire.sparse`) are deterministic functions of (blob, base bytes). So the result
is the trainer's, unless (a) ``B_i`` changed at rest (disk damage, a bad copy, an operator), or
(b) a decoder is wrong (or the trainer signed a blob that does not give the shard it signed).
Neither is assumed away: :meth:`ChainReader.read_shard` hashes every shard it produces against
``N``'s signed shard digest, and every level under it against that level's signed digest,
before returning a byte. Everything that leaves the disk toward a peer (the HTTP lane's full
ranges of a chain version) or a model (a peer's full load, which first materializes) goes
through it; a mismatch raises :class:`ChainBroken`, naming the lowest version whose shard did
not verify, and that version and every chain built on it are removed (no longer served, offered
or loaded; the follower fetches them again). Materialization (:meth:`ChainReader.materialize`)
builds full files through the same verified read, so it re-verifies every shard of the base
chain; anchors (the follower's ``materialize_every``) do this in the background, keeping chains
short and letting retention drop old bases. A peer's in-place engine update reads only the
blobs (each re-checked against its signed digest, :mod:`shardnet.engine_update`), never a
base byte.

Cost: committing a chain writes the blobs only (no base read, no write of the model); a
verified read costs one base shard read, the decode and one BLAKE3 per level.

Blocking file I/O; thread-safe (a lock serializes materializations).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import blake3

from p2p.errors import IntegrityError
from shardcast.store.blobpack import BlobRef, blob_file, find_blob
from shardcast.store.files import fsync_dir
from shardcast.wire import Manifest, codecs

log = logging.getLogger(__name__)

CHAIN_FILE = "chain.json"
"""A chain version's record, beside ``manifest.json``."""
CHAIN_DIR = ".chain"
"""A chain version's chained files, holding only the shards that came raw."""
MATERIALIZE_DIR = ".materialize"
"""Full files being built from a chain (removed when the version flips to full)."""
BLOB_DIR = ".enc"
"""Directory of a version holding its encoded shard blobs (``<version>/.enc/``)."""


class ChainBroken(IntegrityError):
    """A shard built from a chain did not match its signed digest (a base damaged at rest, a
    kept blob damaged, or a decoder bug), or a chain's base is gone. The version ``step`` and
    every chain on it were removed; no byte of the shard was returned.

    Attributes:
        step: the lowest version whose shard did not verify (or whose base is missing).
        shard: the shard index.
    """

    def __init__(self, step: int, shard: int, what: str) -> None:
        super().__init__(f"step {step} shard {shard}: {what}")
        self.step = step
        self.shard = shard


@dataclass(frozen=True)
class ChainRecord:
    """What ``chain.json`` says: a version kept as its base plus blobs.

    Attributes:
        base_step: the base version's step.
        base_digest: the base version's manifest digest (hex).
        files: chained files (not present in full; their delta shards come from blobs).
        deltas: shard index -> encoding of its kept blob (``sparse`` or ``xor-zstd``).
    """

    base_step: int
    base_digest: str
    files: frozenset[str]
    deltas: dict[int, str]

    def encode(self) -> bytes:
        """Canonical JSON bytes."""
        obj = {
            "v": 1,
            "base_step": self.base_step,
            "base_digest": self.base_digest,
            "files": sorted(self.files),
            "deltas": {str(i): e for i, e in sorted(self.deltas.items())},
        }
        return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, data: bytes) -> ChainRecord:
        """Parse ``chain.json``.

        Raises:
            ValueError: not a version-1 chain record, or a field of the wrong type.
        """
        obj = json.loads(data)
        if not isinstance(obj, dict) or obj.get("v") != 1:
            raise ValueError("not a version-1 chain record")
        step, digest = obj.get("base_step"), obj.get("base_digest")
        files, deltas = obj.get("files"), obj.get("deltas")
        if not isinstance(step, int) or not isinstance(digest, str) or len(digest) != 64:
            raise ValueError("chain record: bad base")
        if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
            raise ValueError("chain record: bad files")
        if not isinstance(deltas, dict) or not all(
            k.isdigit() and v in codecs.DELTAS for k, v in deltas.items()
        ):
            raise ValueError("chain record: bad deltas")
        return cls(step, digest, frozenset(files), {int(k): v for k, v in deltas.items()})


def read_record(version_dir: Path) -> ChainRecord | None:
    """The chain record of a committed version directory (None: a full version).

    Raises:
        ValueError: the record exists but does not parse.
        OSError: it exists but cannot be read.
    """
    try:
        data = (version_dir / CHAIN_FILE).read_bytes()
    except FileNotFoundError:
        return None
    return ChainRecord.decode(data)


class Versions(Protocol):
    """What :class:`ChainReader` needs of the store (a :class:`VersionStore`)."""

    durable: bool

    def version_dir(self, step: int) -> Path:
        """Directory of a committed step."""
        ...

    def manifest_of(self, step: int) -> Manifest | None:
        """The committed manifest of ``step`` (None: not committed)."""
        ...

    def quarantine(self, step: int, reason: str) -> list[int]:
        """Remove ``step`` and every chain built on it; returns the removed steps."""
        ...


@dataclass(frozen=True)
class Level:
    """One version on the way down a chain, for one shard: read its own bytes (``encoding``
    is None: ``path`` holds the shard at its offset) or decode its ``encoding`` blob against
    the level below."""

    step: int
    manifest: Manifest
    path: Path
    encoding: str | None = None
    committed: bool = True
    blob: BlobRef | None = None
    """Where a delta level's blob lies (in a pack or a file of its own,
    :func:`~shardcast.store.blobpack.find_blob`); None: not found, and ``path`` is where it
    would be (reading it fails as a missing blob)."""


class ChainReader:
    """Verified reads and materialization of chain versions (see the module docstring)."""

    def __init__(self, versions: Versions) -> None:
        self.v = versions
        self._materializing = threading.Lock()
        self.reads = 0
        """Base and blob reads so far (for tests: a chain commit makes none)."""
        self.bad_deltas: set[str] = set()
        """Manifest digests of versions whose kept blob did not give the signed shard over a
        verified base (a blob damaged at rest, a decoder bug, or a trainer that signed a blob
        and a shard that disagree): downloaded again, they are built eagerly, where a blob
        that does not give its shard falls back to raw (this process)."""

    def level(self, step: int, index: int) -> Level:
        """How committed ``step`` holds shard ``index``.

        Raises:
            ChainBroken: ``step`` is not committed or its chain record is unreadable.
        """
        m = self.v.manifest_of(step)
        if m is None:
            raise ChainBroken(step, index, "the version is not held")
        vdir = self.v.version_dir(step)
        try:
            rec = read_record(vdir)
        except (OSError, ValueError) as exc:
            self.v.quarantine(step, f"unreadable chain record: {exc}")
            raise ChainBroken(step, index, f"unreadable chain record: {exc}") from exc
        ref = m.header.shards[index]
        if rec is None or ref.file not in rec.files:
            return Level(step, m, vdir / ref.file)
        enc = rec.deltas.get(index)
        if enc is None:
            return Level(step, m, vdir / CHAIN_DIR / ref.file)
        at = find_blob(vdir / BLOB_DIR, index, enc)
        if at is None:  # gone: read as missing (damage, unless the version changed form)
            return Level(step, m, blob_file(vdir / BLOB_DIR, index, enc), enc)
        return Level(step, m, at.path, enc, blob=at)

    def read_shard(self, step: int, index: int, top: Level | None = None) -> bytearray:
        """The bytes of shard ``index`` of committed ``step`` (or of ``top``, a partial
        version's delta shard whose base is ``step``), verified at every level.

        Returns:
            exactly the shard's bytes (a fresh buffer).

        Raises:
            ChainBroken: a level's bytes do not match its signed shard digest, or a base is
                missing; the damaged committed version and the chains on it are removed
                (a partial ``top`` is not; a blob that failed is noted in
                :attr:`bad_deltas`, so the version is fetched eagerly next time).
        """
        for attempt in range(2):  # once more if a materialization flipped it meanwhile
            levels = [top] if top is not None else []
            s = self._base_of(top, index) if top is not None else step
            while True:
                lv = self.level(s, index)
                levels.append(lv)
                if lv.encoding is None:
                    break
                s = self._base_of(lv, index)
            try:
                return self._build(levels, index)
            except FileNotFoundError:
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _base_of(self, lv: Level, index: int) -> int:
        """The base step of delta level ``lv``, checked: held under the digest ``lv``
        names, with shard ``index`` laid out alike.

        Raises:
            ChainBroken: not so (a committed ``lv`` is removed).
        """
        rec = read_record(self.v.version_dir(lv.step)) if lv.committed else None
        base_step = rec.base_step if rec else lv.manifest.header.base_step
        base_digest = rec.base_digest if rec else lv.manifest.header.base_digest
        base = self.v.manifest_of(base_step) if base_step is not None else None
        if base is None or base.digest != base_digest:
            if lv.committed:
                self.v.quarantine(lv.step, f"base step {base_step} is gone")
            raise ChainBroken(lv.step, index, f"base step {base_step} is not held")
        mine, theirs = lv.manifest.header.shards[index], base.header.shards[index]
        if (mine.file, mine.offset, mine.length) != (theirs.file, theirs.offset, theirs.length):
            if lv.committed:
                self.v.quarantine(lv.step, "base shard layout differs")
            raise ChainBroken(lv.step, index, "the base lays the shard out differently")
        assert base_step is not None
        return base_step

    def _build(self, levels: list[Level], index: int) -> bytearray:
        bottom = levels[-1]
        ref = bottom.manifest.header.shards[index]
        buf = bytearray(ref.length)
        try:
            with open(bottom.path, "rb", buffering=0) as fh:
                got = os.preadv(fh.fileno(), [buf], ref.offset)
        except FileNotFoundError:
            if self._form_changed(bottom, index):
                raise
            got = -1
        self.reads += 1
        self._check(bottom, index, buf if got == ref.length else None)
        scratch: bytearray | None = None
        for lv in reversed(levels[:-1]):
            assert lv.encoding is not None
            try:
                blob = lv.blob.read() if lv.blob is not None else lv.path.read_bytes()
            except FileNotFoundError:
                if self._form_changed(lv, index):
                    raise
                blob = b""
            self.reads += 1
            if lv.encoding == codecs.XOR_ZSTD and scratch is None:
                scratch = bytearray(ref.length)
            try:
                codecs.decode(lv.encoding, blob, ref.length, buf, str(lv.path), buf, scratch)
                ok = True
            except codecs.CodecError:
                ok = False
            self._check(lv, index, buf if ok else None)
        return buf

    def _form_changed(self, lv: Level, index: int) -> bool:
        """True if ``lv``'s version was materialized (or replaced) since ``lv`` was read: a
        file gone for that reason is no damage, the read starts again."""
        if not lv.committed:
            return False
        try:
            now = self.level(lv.step, index)
        except ChainBroken:
            return False
        return (now.path, now.encoding, now.blob) != (lv.path, lv.encoding, lv.blob)

    def _check(self, lv: Level, index: int, data: bytearray | None) -> None:
        """Raise (and remove a damaged committed version) unless ``data`` is the shard."""
        want = lv.manifest.header.shards[index]
        digest = lv.manifest.shard(index).digest if lv.manifest.known(index) else None
        if data is not None and digest is not None and len(data) == want.length:
            if blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest() == digest:
                return
        what = f"shard {index} of {want.file} does not match its signed digest"
        if lv.encoding is not None:  # the level below verified: this blob or its decoding
            self.bad_deltas.add(lv.manifest.digest)
        if lv.committed:
            removed = self.v.quarantine(lv.step, what)
            log.error("chain_broken step=%d shard=%d removed_steps=%s", lv.step, index, removed)
        raise ChainBroken(lv.step, index, what)

    def depth(self, step: int) -> int:
        """Chain links from ``step`` down to a full version (0: ``step`` is full).

        Raises:
            OSError / ValueError: a chain record cannot be read.
        """
        n, s = 0, step
        while (rec := read_record(self.v.version_dir(s))) is not None:
            n, s = n + 1, rec.base_step
        return n

    def materialize(self, step: int) -> bool:
        """Build ``step``'s full files from its chain, verifying every shard (and so every
        shard of the base chain), then flip the version to full: the chain record goes
        (atomically, one ``unlink``), and the base may be pruned.

        Returns:
            True if it was a chain and is full now; False if it already was full.

        Raises:
            ChainBroken: a shard did not verify (the version and its chains are removed).
            OSError: a write failed (the version stays a chain; a later call retries).
        """
        with self._materializing:
            vdir = self.v.version_dir(step)
            rec = read_record(vdir)
            m = self.v.manifest_of(step)
            if rec is None or m is None:
                return False
            work = vdir / MATERIALIZE_DIR
            shutil.rmtree(work, ignore_errors=True)
            work.mkdir()
            for name in sorted(rec.files):
                build_file(self, step, m, name, work / name, self.v.durable)
            for name in sorted(rec.files):
                os.rename(work / name, vdir / name)
            os.unlink(vdir / CHAIN_FILE)  # the flip: the version is full from here on
            if self.v.durable:
                fsync_dir(vdir)
            shutil.rmtree(vdir / CHAIN_DIR, ignore_errors=True)
            shutil.rmtree(work, ignore_errors=True)
            log.info("version_materialized step=%d files=%d", step, len(rec.files))
            return True


def build_file(
    reader: ChainReader, step: int, m: Manifest, name: str, path: Path, durable: bool
) -> None:
    """Write file ``name`` of committed ``step`` (manifest ``m``) at ``path``, shard by shard
    through :meth:`ChainReader.read_shard` (fsynced if ``durable``).

    Raises:
        ChainBroken: a shard did not verify (``path`` is left incomplete: remove it).
        OSError: a write failed.
    """
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
    try:
        os.ftruncate(fd, m.header.file(name).size)
        for ref in m.header.shards:
            if ref.file == name:
                data = memoryview(reader.read_shard(step, ref.index))
                pos = 0
                while pos < len(data):
                    pos += os.pwrite(fd, data[pos : pos + (1 << 20)], ref.offset + pos)
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)
