"""publish: pipelined origin encoding: hash and encode each file of a checkpoint while the
trainer is still writing the others.

Theory of operation
-------------------
A trainer writes ``WATCH/step-<N>/`` file by file and then its ready marker (``DONE``). Before
this module the origin did all of its hashing and delta encoding after the marker, on the
critical path (12.8 s of a 25 s run, issue 16). :class:`PreEncoder` instead scans the step
directories that have no marker yet and hashes and encodes
(:func:`shardcast.publish.encode.encode_file`,
the very code the publish uses) every file that looks complete, in a worker thread, one file
at a time, as soon as it looks complete (a file that completes while another is being
encoded is taken right after it, not a poll later). When the marker appears,
:meth:`PreEncoder.take` hands the publish the results whose
files are provably unchanged; :func:`shardcast.publish.plan.hash_parts` links their blobs into the
version (nothing is read again) and signs their parts at once, and reads only the files that
were not done ahead. The parts are byte-identical either way: same code, same settings.

When is a file complete before the marker? Nothing in the file system says so, so the origin
guesses and then *checks*:

* guess (:func:`quiet`): a file whose size, mtime and ctime have not changed for
  ``settle_s`` (hidden and temp-named files — ``.x``, ``*.tmp``, ``*.part``, ``*.partial``,
  ``*.incomplete`` — are never taken: atomic writers rename them into place, and the final name
  then appears complete);
* check: each result carries the :class:`FileIdentity` (device, inode, size, mtime, ctime)
  stat'ed before the file was read, which must equal the identity after reading and again the
  identity when the marker is seen (:meth:`PreEncodeCache.take`). A write in place changes mtime
  (and ctime), a rename over the name brings another inode, a ``copy2``/``utime`` that restores
  an old mtime still moves ctime: a result of bytes that may have changed is never used, the
  file is read at publish as before. The only cost of a wrong guess is work done twice.

Files still being written are not idle meanwhile: each whole shard below such a file's size
(a trainer writes a file front to back) is hashed and encoded as soon as the file grows past
it (:meth:`PreEncodeCache.regions_wanted`, :func:`shardcast.publish.encode.encode_known`), its
digest, chunk list and blobs from one consistent read. Nothing proves that the writer will not
go back and change those bytes, so they are *known*, not trusted: when the file is taken
(quiet before the marker, or at the publish if it was still being written then) each known
shard costs one BLAKE3 pass over its bytes, and is used only if they hash to its digest again;
any other shard is encoded as before (:func:`shardcast.publish.encode.encode_file`). Without
this the last file a trainer writes, which is never quiet before its marker, was read,
compared with its base and encoded after the marker, on the critical path (1.5 s of a 2.6 s
next version of ``real-1b``, measured in session 62).

The delta encodings depend on the base (the previous step) and the settings
(:class:`~shardcast.publish.encode.EncodeSettings`); a step whose base is not decided yet (the
previous
step still exists in WATCH but is not committed) waits. A result is used only if its settings
equal the version's at publish.

Restarts: results live in memory, blobs in ``cache_dir/step-<N>/`` (``<file>.<offset>.<enc>``);
the directory is emptied when the pre-encoder starts, so an origin restarted mid-step simply
encodes again (at publish, or ahead if the marker is not there yet). After a step is
published its cache directory is removed (the blobs live on as hard links in the version).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import trio

from shardcast.publish.encode import (
    EncodeSettings,
    KnownShards,
    PreEncoded,
    ShardResult,
    cached_blob,
    encode_file,
    encode_known,
)
from shardcast.publish.layout import CheckpointLayoutError
from shardcast.publish.plan import Base
from shardcast.publish.watchdir import STEP_DIR
from shardcast.wire import MANIFEST_FILE, ManifestError, check_file_name

log = logging.getLogger(__name__)

TEMP_SUFFIXES = (".tmp", ".part", ".partial", ".incomplete", ".lock")


@dataclass(frozen=True)
class FileIdentity:
    """What must stay equal for a file's bytes to count as unchanged (times in ns)."""

    dev: int
    ino: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, st: os.stat_result) -> FileIdentity:
        """The identity in a stat result."""
        return cls(st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


def candidate_name(name: str) -> bool:
    """True for a name that can be a checkpoint file: not hidden, not ours, not temp-named,
    and a valid manifest file name."""
    if name.startswith(".") or name == MANIFEST_FILE or name.endswith(TEMP_SUFFIXES):
        return False
    try:
        check_file_name(name)
    except ManifestError:
        return False
    return True


def quiet(identity: FileIdentity, now_ns: int, settle_s: float) -> bool:
    """True if the file has not been modified (data or metadata) for ``settle_s`` seconds."""
    return max(identity.mtime_ns, identity.ctime_ns) <= now_ns - int(settle_s * 1e9)


@dataclass
class _Step:
    settings: EncodeSettings
    results: dict[str, tuple[FileIdentity, PreEncoded]] = field(default_factory=dict)
    failed: dict[str, FileIdentity] = field(default_factory=dict)  # not again until it changes
    known: dict[str, KnownShards] = field(default_factory=dict)  # of files still being written


@dataclass(frozen=True)
class Ahead:
    """What was encoded ahead for one step (:meth:`PreEncoder.take`).

    Attributes:
        files: complete files whose bytes are provably the ones read, by name
            (``Origin.publish(..., pre_encoded=...)``: linked in, not read again).
        known: shards of the other files, encoded while those were being written, by name
            (``Origin.publish(..., known=...)``: each used where its bytes hash the same
            again, :func:`shardcast.publish.encode.encode_file`).
    """

    files: dict[str, PreEncoded] = field(default_factory=dict)
    known: dict[str, KnownShards] = field(default_factory=dict)


class PreEncodeCache:
    """Which files of which steps are encoded ahead, and which to encode next (no I/O)."""

    def __init__(self) -> None:
        self.steps: dict[int, _Step] = {}
        self.closed_through = -1  # steps <= this one are published (or being published)

    def wanted(
        self,
        step: int,
        settings: EncodeSettings,
        listing: Mapping[str, FileIdentity],
        now_ns: int,
        settle_s: float,
    ) -> list[str]:
        """Names of ``step``'s files to encode now (sorted): candidates, nonempty, quiet, and
        not already encoded at this identity with these settings. Settings that differ from
        the step's earlier ones drop its earlier results."""
        if step <= self.closed_through:
            return []
        st = self._step(step, settings)
        out = []
        for name in sorted(listing):
            ident = listing[name]
            if not candidate_name(name) or ident.size == 0 or not quiet(ident, now_ns, settle_s):
                continue
            have = st.results.get(name)
            if (have is not None and have[0] == ident) or st.failed.get(name) == ident:
                continue
            out.append(name)
        return out

    def _step(self, step: int, settings: EncodeSettings) -> _Step:
        """``step``'s state, new (earlier results dropped) if its settings moved."""
        st = self.steps.get(step)
        if st is None or st.settings != settings:
            st = self.steps[step] = _Step(settings)
        return st

    def regions_wanted(
        self,
        step: int,
        settings: EncodeSettings,
        listing: Mapping[str, FileIdentity],
        now_ns: int,
        settle_s: float,
    ) -> dict[str, list[int]]:
        """Offsets of whole shards to encode now in ``step``'s files that are still being
        written (candidates, not :func:`quiet`), by name: each shard wholly below the file's
        size with no known result yet (hash-list roots only: ``settings.rooted``). A file
        now shorter than its known shards (rewritten from the start) loses them."""
        if step <= self.closed_through or not settings.rooted:
            return {}
        st = self._step(step, settings)
        size = settings.shard_size
        out: dict[str, list[int]] = {}
        for name in sorted(listing):
            ident = listing[name]
            if not candidate_name(name) or quiet(ident, now_ns, settle_s):
                continue
            have = st.known.get(name)
            if have is not None and ident.size < max(have.shards, default=0) + size:
                del st.known[name]
                have = None
            done = have.shards if have is not None else {}
            offsets = [o for o in range(0, ident.size - size + 1, size) if o not in done]
            if offsets:
                out[name] = offsets
        return out

    def add_known(self, step: int, name: str, known: KnownShards) -> bool:
        """Record shards of a file still being written (joined with those known before);
        returns False (nothing recorded) if the settings moved on or the step is closed."""
        st = self.steps.get(step)
        if st is None or step <= self.closed_through or st.settings != known.settings:
            return False
        have = st.known.get(name)
        st.known[name] = known if have is None else have.joined(known)
        return True

    def known(self, step: int, name: str) -> KnownShards | None:
        """The shards of ``step``'s file ``name`` encoded while it was being written."""
        st = self.steps.get(step)
        return None if st is None else st.known.get(name)

    def add(
        self, step: int, name: str, before: FileIdentity, after: FileIdentity, result: PreEncoded
    ) -> bool:
        """Record a file encoded from identity ``before`` (stat'ed again ``after`` reading);
        returns False (nothing recorded) if it changed meanwhile, the settings moved on, or
        the step is closed."""
        st = self.steps.get(step)
        if st is None or step <= self.closed_through or st.settings != result.settings:
            return False
        if before != after or after.size != result.size:
            st.results.pop(name, None)
            return False
        st.results[name] = (before, result)
        return True

    def fail(self, step: int, name: str, identity: FileIdentity) -> None:
        """A file that could not be encoded at ``identity`` (not retried until it changes)."""
        st = self.steps.get(step)
        if st is not None:
            st.failed[name] = identity

    def take(self, step: int, listing: Mapping[str, FileIdentity]) -> Ahead:
        """The results of ``step`` whose file identity (stat'ed when the marker was seen) is
        still the one read, and the known shards of its other files in ``listing``; closes
        every step up to ``step``."""
        self.closed_through = max(self.closed_through, step)
        st = self.steps.get(step)
        if st is None:
            return Ahead()
        files = {
            name: res for name, (ident, res) in st.results.items() if listing.get(name) == ident
        }
        known = {n: k for n, k in st.known.items() if n in listing and n not in files}
        return Ahead(files, known)

    def drop_through(self, step: int) -> list[int]:
        """Forget steps up to ``step``; returns the steps forgotten."""
        gone = [s for s in self.steps if s <= step]
        for s in gone:
            del self.steps[s]
        return gone


def list_identities(directory: Path) -> dict[str, FileIdentity]:
    """Identities of the regular files directly in ``directory`` (symlinks left out)."""
    out = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return {}
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False):
                out[entry.name] = FileIdentity.of(entry.stat(follow_symlinks=False))
        except OSError:
            continue  # vanished (renamed) meanwhile
    return out


def unfinished_steps(watch: Path, ready_marker: str) -> list[int]:
    """Steps N whose ``watch/step-N/`` exists without its ready marker (none if unreadable)."""
    steps = []
    try:
        for entry in os.scandir(watch):
            m = STEP_DIR.fullmatch(entry.name)
            if m and entry.is_dir() and not (Path(entry.path) / ready_marker).exists():
                steps.append(int(m.group(1)))
    except OSError:
        return []
    return steps


def pre_encode_file(
    path: Path,
    name: str,
    size: int,
    settings: EncodeSettings,
    base: Base | None,
    cache_dir: Path,
    workers: int = 1,
    known: KnownShards | None = None,
) -> PreEncoded:
    """Hash and encode one file into ``cache_dir`` (blocking; see :func:`encode_file`, which
    runs ``workers`` threads, and confirms rather than encodes the ``known`` shards encoded
    while the file was being written, whose blobs are already in ``cache_dir``).

    Raises:
        CheckpointLayoutError: the file is shorter than ``size``.
        OSError: it cannot be read, or a blob cannot be written.
    """
    cache_dir.mkdir(parents=True, exist_ok=True)
    shards: list[ShardResult] = []
    digest = ""
    base_path = None if base is None else base.directory / name

    def blob(offset: int, encoding: str) -> Path:
        return cached_blob(cache_dir, f"{name}.", offset, encoding)

    for shard, file_digest in encode_file(path, size, settings, base_path, blob, workers, known):
        shards.append(shard)
        if file_digest is not None:
            digest = file_digest
    return PreEncoded(name, size, settings, tuple(shards), digest, cache_dir, f"{name}.")


class PreEncoder:
    """Encodes the files of unfinished steps in WATCH ahead of their marker (module docstring).

    Args:
        settings_for: ``step -> (settings, base)`` as the origin would publish it now, or
            None while the base is undecided (:meth:`shardcast.publish.origin.Origin.encode_plan`).
        cache_dir: where the blobs go (emptied now).
        settle_s: see :func:`quiet`.
        pinned: context manager factory that keeps a base step from being pruned while read.
        clock_ns: wall clock in ns (``time.time_ns``; the file system's clock).
        workers: threads that encode a file's shards side by side (results do not depend
            on it).
    """

    def __init__(
        self,
        settings_for: Callable[[int], tuple[EncodeSettings, Base | None] | None],
        cache_dir: Path,
        settle_s: float,
        pinned: Callable[[int], AbstractContextManager[object]] | None = None,
        clock_ns: Callable[[], int] = time.time_ns,
        workers: int = 1,
    ) -> None:
        self.settings_for = settings_for
        self.cache_dir = cache_dir
        self.settle_s = settle_s
        self.pinned = pinned
        self.clock_ns = clock_ns
        self.workers = workers
        self.cache = PreEncodeCache()
        self.busy_step: int | None = None
        self.idle = trio.Event()
        self.idle.set()
        self.encoded_files = 0
        self.encoded_shards = 0  # of files still being written
        shutil.rmtree(cache_dir, ignore_errors=True)

    def step_dir(self, step: int) -> Path:
        """The cache directory of ``step``."""
        return self.cache_dir / f"step-{step}"

    async def scan_once(self, watch: Path, ready_marker: str) -> int:
        """Encode every file that is due now in the unfinished steps of ``watch`` (oldest step
        first); returns how many files were encoded."""
        steps = await trio.to_thread.run_sync(unfinished_steps, watch, ready_marker)
        done = 0
        for step in sorted(steps):
            if step <= self.cache.closed_through:
                continue
            plan = self.settings_for(step)
            if plan is None:
                continue  # base undecided: the previous step is not committed yet
            settings, base = plan
            directory = watch / f"step-{step}"
            listing = await trio.to_thread.run_sync(list_identities, directory)
            now = self.clock_ns()
            for name in self.cache.wanted(step, settings, listing, now, self.settle_s):
                if await self._encode(step, directory, name, listing[name], settings, base):
                    done += 1
            growing = self.cache.regions_wanted(step, settings, listing, now, self.settle_s)
            for name, offsets in growing.items():
                if await self._encode_regions(step, directory, name, offsets, settings, base):
                    done += 1
        return done

    def _pin(self, base: Base | None) -> AbstractContextManager[object]:
        """Keeps ``base``'s step from being pruned while it is read (if pinning is given)."""
        return self.pinned(base.step) if self.pinned and base else nullcontext()

    @contextmanager
    def _busy(self, step: int) -> Iterator[None]:
        """Marks ``step`` as being encoded (:meth:`take` waits for it)."""
        self.busy_step, self.idle = step, trio.Event()
        try:
            yield
        finally:
            self.busy_step = None
            self.idle.set()

    async def _encode_regions(
        self,
        step: int,
        directory: Path,
        name: str,
        offsets: list[int],
        settings: EncodeSettings,
        base: Base | None,
    ) -> bool:
        """Encode whole shards of a file still being written (:func:`encode_known`); True if
        some were recorded."""
        base_path = None if base is None else base.directory / name

        def work() -> KnownShards:
            with self._pin(base):
                return encode_known(
                    directory / name,
                    offsets,
                    settings,
                    base_path,
                    self.step_dir(step),
                    f"{name}.",
                    self.workers,
                )

        with self._busy(step):
            try:
                known = await trio.to_thread.run_sync(work)
            except (OSError, CheckpointLayoutError) as exc:  # rewritten meanwhile: next scan
                log.info("pre_encode_regions_skipped step=%d file=%s error=%s", step, name, exc)
                return False
        if not known.shards or not self.cache.add_known(step, name, known):
            return False
        self.encoded_shards += len(known.shards)
        log.debug("pre_encoded_shards step=%d file=%s shards=%d", step, name, len(known.shards))
        return True

    async def _encode(
        self,
        step: int,
        directory: Path,
        name: str,
        before: FileIdentity,
        settings: EncodeSettings,
        base: Base | None,
    ) -> bool:
        path = directory / name
        known = self.cache.known(step, name)

        def work() -> PreEncoded:
            with self._pin(base):
                return pre_encode_file(
                    path,
                    name,
                    before.size,
                    settings,
                    base,
                    self.step_dir(step),
                    self.workers,
                    known,
                )

        with self._busy(step):
            try:
                result = await trio.to_thread.run_sync(work)
            except (OSError, CheckpointLayoutError) as exc:
                log.info("pre_encode_skipped step=%d file=%s error=%s", step, name, exc)
                self.cache.fail(step, name, before)
                return False
            try:
                after = FileIdentity.of(os.stat(path, follow_symlinks=False))
            except OSError:
                return False
            ok = self.cache.add(step, name, before, after, result)
        if ok:
            self.encoded_files += 1
            confirmed = sum(1 for s in result.shards if known and known.shards.get(s.offset) is s)
            log.info(
                "pre_encoded step=%d file=%s size_bytes=%d confirmed_shards=%d",
                step,
                name,
                before.size,
                confirmed,
            )
        return ok

    async def scan_until_idle(self, watch: Path, ready_marker: str) -> int:
        """:meth:`scan_once` again as long as it encodes something: a file that became
        complete while another was being encoded starts at once, not a poll later (each
        file's delta is pipelined behind the writer, file by file). Returns the files
        encoded."""
        total = 0
        while done := await self.scan_once(watch, ready_marker):
            total += done
        return total

    async def run(self, watch: Path, ready_marker: str, poll_s: float) -> None:
        """Scan ``watch`` until idle (:meth:`scan_until_idle`), then every ``poll_s``
        seconds, forever (cancel to stop)."""
        while True:
            await self.scan_until_idle(watch, ready_marker)
            await trio.sleep(poll_s)

    async def take(self, step: int, directory: Path) -> Ahead:
        """What is usable for publishing ``step`` from ``directory`` (its WATCH directory,
        whose marker is there): waits for a file of ``step`` being encoded now, then stats
        every file and keeps the results whose identity is unchanged, and the shards known
        of the others. Call before anything (such as staging) touches the files."""
        while self.busy_step is not None and self.busy_step <= step:
            await self.idle.wait()
        listing = await trio.to_thread.run_sync(list_identities, directory)
        out = self.cache.take(step, listing)
        if out.files or out.known:
            log.info(
                "pre_encoded_used step=%d files=%d known_shards=%d",
                step,
                len(out.files),
                sum(len(k.shards) for k in out.known.values()),
            )
        return out

    def published(self, step: int) -> None:
        """``step`` is committed (or failed): drop its cache and every older one."""
        for s in self.cache.drop_through(step):
            shutil.rmtree(self.step_dir(s), ignore_errors=True)
