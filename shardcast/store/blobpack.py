"""store: a version's kept blobs, appended to one pack file instead of one file each.

Theory of operation
-------------------
A follower keeps the encoded blobs it receives (a chain version's delta blobs, the encoded
forms of shards it wrote in full) to serve them on as received and to update an engine in
place. One file per blob cost one file creation per blob: 0.02-1.5 ms of CPU each on the
filesystems measured for issue 24 (ext4 on this VM; 0.012 ms on tmpfs), the largest CPU item
of a follower that receives thousands of small delta blobs. A partial version appends them
instead to ``.enc/pack`` (:class:`BlobPack`), and after each blob's bytes are written, one line
``<shard> <encoding> <offset> <length>`` to ``.enc/pack.idx``. Both move with the partial
directory at the commit's atomic rename, so a committed version reads them where they were
written (:func:`find_blob`).

Nothing read from a pack is trusted: every user checks a blob against the digest the trainer
signed for it (the chain reader's level check, the downloader at the other end of the lane,
the engine update, the restore of a partial, which rewrites the index with only the blobs that
still match). A torn last index line (a crash mid-append) is ignored, so are entries that run
past the pack's end; bytes written without their index line are never referenced.

Blobs kept one per file (``.enc/<shard>.<encoding>``: an origin's published version, stores
written before the pack) stay readable: :func:`find_blob` looks in the pack first, then for the
file.

Blocking file I/O; thread-safe.
"""

from __future__ import annotations

import functools
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from shardcast.store.files import fsync_dir, pwrite_all, replace_file

__all__ = ["PACK_FILE", "PACK_INDEX", "BlobPack", "BlobRef", "find_blob", "read_index"]

PACK_FILE = "pack"
"""The blobs of a version, back to back (in its ``.enc/`` directory)."""
PACK_INDEX = "pack.idx"
"""Where each blob of :data:`PACK_FILE` lies: ``<shard> <encoding> <offset> <length>`` lines."""

Key = tuple[int, str]
"""(shard index, encoding) of a blob."""


@dataclass(frozen=True)
class BlobRef:
    """Where one kept blob lies: ``length`` bytes at byte ``offset`` of ``path`` (a pack, or a
    file holding the blob alone at offset 0)."""

    path: Path
    offset: int
    length: int

    def read(self) -> bytes:
        """The blob's bytes as stored: unverified, and short if the file was cut (check them
        against the signed blob digest and size).

        Raises:
            FileNotFoundError: the file is gone (e.g. its directory was renamed meanwhile).
            OSError: it cannot be read.
        """
        with open(self.path, "rb", buffering=0) as fh:
            return os.pread(fh.fileno(), self.length, self.offset)


def blob_file(enc_dir: Path, index: int, encoding: str) -> Path:
    """The file holding shard ``index``'s ``encoding`` blob alone (the layout before packs,
    and an origin's)."""
    return enc_dir / f"{index}.{encoding}"


def read_index(enc_dir: Path) -> dict[Key, tuple[int, int]]:
    """The blobs listed in ``enc_dir``'s pack index: ``{(shard, encoding): (offset, length)}``.

    Lines that do not parse (a torn last line) and entries past the pack's end are skipped;
    a later line for the same blob wins. Empty if there is no index or pack.
    """
    try:
        text = (enc_dir / PACK_INDEX).read_bytes().decode("ascii", errors="replace")
        size = os.stat(enc_dir / PACK_FILE).st_size
    except FileNotFoundError:
        return {}
    out: dict[Key, tuple[int, int]] = {}
    for line in text.split("\n"):
        fields = line.split(" ")
        if len(fields) != 4 or not all(f.isdigit() for f in (fields[0], *fields[2:])):
            continue
        offset, length = int(fields[2]), int(fields[3])
        if fields[1] and offset + length <= size:
            out[(int(fields[0]), fields[1])] = (offset, length)
    return out


@functools.lru_cache(maxsize=32)
def _parsed(enc_dir: Path, stamp: tuple[int, int, int]) -> dict[Key, tuple[int, int]]:
    """:func:`read_index` of ``enc_dir`` while its index file has ``stamp`` (inode, size,
    mtime): a committed version's index is parsed once, not per lookup."""
    return read_index(enc_dir)


def find_blob(enc_dir: Path, index: int, encoding: str) -> BlobRef | None:
    """Where ``enc_dir`` keeps shard ``index``'s ``encoding`` blob: in its pack (the index
    parsed once per version and kept while the index file is unchanged: one ``stat`` per
    call), else in a file of its own; None if neither holds it."""
    idx = enc_dir / PACK_INDEX
    try:
        st = os.stat(idx)
    except FileNotFoundError:
        st = None
    if st is not None:
        at = _parsed(enc_dir, (st.st_ino, st.st_size, st.st_mtime_ns)).get((index, encoding))
        if at is not None:
            return BlobRef(enc_dir / PACK_FILE, *at)
    path = blob_file(enc_dir, index, encoding)
    try:
        return BlobRef(path, 0, os.stat(path).st_size)
    except FileNotFoundError:
        return None


class BlobPack:
    """The pack a partial version appends its kept blobs to (see the module docstring).

    Args:
        enc_dir: the version's ``.enc`` directory (created at the first append).
        entries: blobs already in its pack that the caller verified (a resumed download);
            the index is rewritten to hold exactly these (atomically); with none, an old pack
            and index are removed.
    """

    def __init__(self, enc_dir: Path, entries: Mapping[Key, tuple[int, int]] | None = None):
        self.dir = enc_dir
        self._entries = dict(entries or {})
        self._lock = threading.Lock()
        self._pack = self._index = -1
        self._end = 0
        self._closed = False
        if enc_dir.is_dir() and not self._entries:  # nothing kept: start the pack afresh
            (enc_dir / PACK_INDEX).unlink(missing_ok=True)
            (enc_dir / PACK_FILE).unlink(missing_ok=True)
        elif enc_dir.is_dir():
            lines = "".join(f"{i} {e} {o} {n}\n" for (i, e), (o, n) in self._entries.items())
            replace_file(enc_dir / PACK_INDEX, lines.encode(), durable=False)

    def append(
        self, index: int, encoding: str, data: bytes | bytearray | memoryview
    ) -> BlobRef | None:
        """Write a blob at the pack's end, then its index line; returns where it lies (a blob
        appended again for the same key replaces the first in the index), or None if the
        pack is closed (nothing written).

        Raises:
            OSError: a write failed (the blob is not listed).
        """
        with self._lock:
            if self._closed:
                return None
            if self._pack < 0:
                self._open()
            offset = self._end
            pwrite_all(self._pack, data, offset)
            self._end += len(data)
            os.write(self._index, f"{index} {encoding} {offset} {len(data)}\n".encode())
            self._entries[(index, encoding)] = (offset, len(data))
        return BlobRef(self.dir / PACK_FILE, offset, len(data))

    def _open(self) -> None:
        self.dir.mkdir(exist_ok=True)
        self._pack = os.open(self.dir / PACK_FILE, os.O_CREAT | os.O_RDWR, 0o644)
        self._end = os.fstat(self._pack).st_size
        self._index = os.open(self.dir / PACK_INDEX, os.O_CREAT | os.O_WRONLY | os.O_APPEND, 0o644)

    def ref(self, index: int, encoding: str) -> BlobRef | None:
        """Where shard ``index``'s ``encoding`` blob lies in the pack (None: not kept)."""
        with self._lock:
            at = self._entries.get((index, encoding))
        return BlobRef(self.dir / PACK_FILE, *at) if at is not None else None

    def sync(self) -> None:
        """Make the blobs and the index durable (``fsync`` both and the directory).

        Raises:
            OSError: a sync failed.
        """
        with self._lock:
            fds = [fd for fd in (self._pack, self._index) if fd >= 0]
            for fd in fds:
                os.fsync(fd)
        if fds:
            fsync_dir(self.dir)

    def close(self) -> None:
        """Close the files (idempotent); :meth:`ref` keeps answering."""
        with self._lock:
            self._closed = True
            fds, self._pack, self._index = (self._pack, self._index), -1, -1
        for fd in fds:
            if fd >= 0:
                os.close(fd)
