"""The downloader: fetch a version from several sources in parallel, verify, commit.

Theory of operation
-------------------
What a download *decides* lives in the sans-IO :class:`~shardcast.session.Session` (source
and shard choice through the :class:`~shardcast.select.Scheduler`, resumption, blame and bans,
delta fallback, the endgame, the discovery bound, abandonment); the simulator drives the same
object. This module is its trio driver, :meth:`Downloader.download`: it starts from a verified
manifest header (parts may be missing) and does what the session's actions say:

- **parts**: missing manifest parts are fetched from the sources (each request waits at the
  source until the part exists), verified (trainer signature, header digest) and reported;
  the origin can therefore announce a version before it has hashed it.
- **transfers** (:class:`~shardcast.session.Fetch`): one task streams the byte range from the
  chosen source over the HTTP lane (:func:`_stream`): the raw file range or an encoded blob
  (``xor-zstd``/``sparse`` against a held base, ``zstd``). Complete bytes are decoded with
  bounds and checked (:meth:`Downloader._verify_and_write`, in a worker thread) before they
  are written; bytes that fail never reach the disk or another node. The outcome goes back to
  the session as a typed :class:`~shardcast.session.Outcome` or
  :class:`~shardcast.session.Verdict`. Buffers live here: one per transfer, the prefixes the
  session keeps for resuming, and suspect copies it compares once a verified copy exists
  (:func:`~shardcast.select.blame` names who sent the differing ranges).
- **have-sets**: partial sources (peers re-serving what they hold) are polled every
  ``have_poll_s``; **discovery** adds sources from ``extra_sources``/``upstreams``.

When the session commits, the version is committed atomically
(:meth:`~shardcast.store.PartialVersion.commit`). If the download fails or is cancelled, the
partial directory is removed: no ``step-N/`` ever appears for an incomplete or unverified
version.

Memory: at most ``max_inflight`` shard buffers in transfer plus ``max_resume_buffers`` kept
for resumption (shard size each), suspect copies until blame, plus the manifest.
"""

from __future__ import annotations

import logging
import math
import random
import threading
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import blake3
import trio

from p2p.errors import (
    IntegrityError,
    LocalProtocolError,
    PeerUnreachable,
    RemoteProtocolError,
    ShardnetError,
    StreamBroken,
    TransportError,
    short_id,
)
from p2p.http_client import HttpClient
from p2p.http_errors import NotAvailable
from p2p.trust import TrustList
from shardcast import codecs
from shardcast.lane_auth import failed_header
from shardcast.liveness import Abandon, Answer
from shardcast.manifest import Manifest, ManifestError, ShardEntry, decode_part
from shardcast.select import SchedulerConfig, SourceBans, blame
from shardcast.session import (
    Action,
    Ban,
    Blame,
    Cancel,
    Check,
    Commit,
    Compare,
    DownloadStats,
    Drop,
    Fail,
    Fetch,
    Keep,
    KeepSuspect,
    Offer,
    Outcome,
    PollHave,
    Probe,
    Session,
    SessionConfig,
    Verdict,
)
from shardcast.store import PartialVersion, VersionStore

log = logging.getLogger(__name__)

# DownloadStats lives with the session that fills it; it stays importable from here
__all__ = [
    "DownloadConfig",
    "DownloadFailed",
    "DownloadObserver",
    "DownloadStats",
    "Downloader",
    "Source",
    "file_url",
    "manifest_url",
    "version_url",
]


class DownloadFailed(ShardnetError):
    """A version could not be downloaded (see :class:`~shardcast.liveness.Abandon`).

    Attributes:
        reason: why it was abandoned.
    """

    def __init__(self, message: str, reason: Abandon = Abandon.NO_SOURCE) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass(frozen=True)
class Source:
    """A place to fetch from.

    Attributes:
        id: a stable label (the source's PeerID, or its URL).
        base_url: HTTP lane base URL, e.g. ``http://127.0.0.1:9000``.
        complete: True if it holds (or will hold) every shard of the version; False for a
            peer that re-serves only what it has (its have-set is polled).
        anonymous: requests to it are unsigned (a static mirror, :mod:`shardcast.mirror`:
            no PeerID, no super-seeding, nothing to prove to it).
    """

    id: str
    base_url: str
    complete: bool = True
    anonymous: bool = False


def version_url(base_url: str, run_id: str, step: int) -> str:
    """Base URL of one version on a node's HTTP lane."""
    return f"{base_url}/shardnet/v1/{run_id}/{step}"


def file_url(base_url: str, run_id: str, step: int, name: str) -> str:
    """URL of one file of a version."""
    return f"{version_url(base_url, run_id, step)}/files/{name}"


def manifest_url(base_url: str, run_id: str, step: int) -> str:
    """URL of a version's manifest document."""
    return f"{version_url(base_url, run_id, step)}/manifest"


@dataclass(frozen=True)
class DownloadConfig:
    """Downloader settings.

    Attributes:
        stall_timeout_s: a transfer that makes no progress for this long fails, seconds.
        deadline_s: give up on a version after this long, seconds.
        no_source_grace_s: fail if no source is usable for this long, seconds (a source
            that answered ``404`` for the version is not usable).
        gone_grace_s: fail once every source has said for this long that it does not hold
            the version (``404``, confirmed by its ``/have``) or is unreachable, seconds.
        no_progress_s: fail if no byte of the version arrives for this long, seconds.
        keep_partial: on cancellation, keep the partial version and its journal of verified
            shards (a restarted node resumes it); failures always remove it.
        max_resume_buffers: shard buffers kept for resuming broken transfers.
        have_poll_s: period of have-bitmap polls of partial sources, seconds.
        use_deltas: fetch ``xor-zstd`` when the base version is held.
        prefer_compressed: fetch ``zstd`` where offered (slow links).
        scheduler: source-selection tuning.
        source_ban_s: a source banned for corrupt bytes stays banned this long, across the
            versions this downloader fetches, seconds (0: only for the version).
    """

    stall_timeout_s: float = 30.0
    deadline_s: float = 3600.0
    no_source_grace_s: float = 120.0
    gone_grace_s: float = 5.0
    no_progress_s: float = 600.0
    keep_partial: bool = False
    max_resume_buffers: int = 8
    have_poll_s: float = 0.25
    use_deltas: bool = True
    prefer_compressed: bool = False
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    source_ban_s: float = 600.0


ProgressFn = Callable[[int, int], None]
"""``progress(verified_bytes, total_bytes)``, called after every verified shard."""


class DownloadObserver(Protocol):
    """Told of each shard-level event of a download as it happens (for metrics).

    ``source`` is the source's id (a PeerID); calls come from the downloading trio task and
    must not block.
    """

    def shard_received(self, source: str, codec: str, size_bytes: int, fetch_s: float) -> None:
        """``size_bytes`` of one request arrived from ``source`` in ``fetch_s`` seconds."""
        ...

    def shard_verified(self, source: str, verify_s: float) -> None:
        """A shard from ``source`` was decoded, hash-checked and written in ``verify_s``."""
        ...

    def shard_corrupt(self, source: str) -> None:
        """``source`` was blamed for bytes that failed verification."""
        ...

    def refused(self, source: str) -> None:
        """``source`` refused a request under super-seeding (HTTP 429)."""
        ...


@dataclass
class _Buf:
    data: bytearray
    pos: int = 0


@dataclass
class _Base:
    step: int
    read: Callable[[str, int, int, bytearray], memoryview]


class _BufferPool:
    """Reusable shard-sized buffers for decoding in worker threads (bounded: at most
    ``keep`` idle buffers are kept; a thread that finds none large enough allocates one as
    large as the largest request seen, so that buffers stay reusable across shard lengths)."""

    def __init__(self, keep: int = 8) -> None:
        self.keep = keep
        self._idle: list[bytearray] = []
        self._largest = 0
        self._lock = threading.Lock()

    def get(self, length: int) -> bytearray:
        with self._lock:
            self._largest = max(self._largest, length)
            for k, buf in enumerate(self._idle):
                if len(buf) >= length:
                    return self._idle.pop(k)
            size = self._largest
        return bytearray(size)

    def put(self, buf: bytearray) -> None:
        with self._lock:
            if len(self._idle) < self.keep and len(buf) >= self._largest:
                self._idle.append(buf)


_POOL = _BufferPool()  # per process: at most 8 idle shard-sized buffers (128 MiB at 16 MiB)


class Downloader:
    """Downloads versions into a :class:`VersionStore` (one download at a time per instance).

    Args:
        client: the HTTP lane client.
        store: where versions are committed (and delta bases are read).
        config: settings.
        rng: seeded randomness for the scheduler.
        trust: the trust list parts and stored manifests are verified against.
        observer: told of each shard-level event (metrics), or None.

    ``current`` is the stats of the download running now (None between downloads), for a
    status view.
    """

    def __init__(
        self,
        client: HttpClient,
        store: VersionStore,
        config: DownloadConfig,
        rng: random.Random,
        trust: TrustList,
        observer: DownloadObserver | None = None,
    ) -> None:
        self.client = client
        self.store = store
        self.config = config
        self.rng = rng
        self.trust = trust
        self.observer = observer
        self.current: DownloadStats | None = None
        self._extra: Callable[[], list[Source]] | None = None
        self._max_extra = 16
        self.bans = SourceBans(config.source_ban_s)
        self._upstreams: Callable[[], list[Source]] | None = None
        self.last_stats: DownloadStats | None = None  # of the latest download, even failed

    async def download(
        self,
        manifest: Manifest,
        sources: list[Source],
        *,
        on_partial: Callable[[PartialVersion], None] | None = None,
        on_shard: Callable[[int], None] | None = None,
        progress: ProgressFn | None = None,
        extra_sources: Callable[[], list[Source]] | None = None,
        max_extra_sources: int = 16,
        upstreams: Callable[[], list[Source]] | None = None,
    ) -> tuple[Path, DownloadStats]:
        """Fetch every part and shard of ``manifest`` from ``sources``, verify, and commit.

        Args:
            manifest: the verified manifest (header at least); parts are added to it.
            sources: where to fetch from (at least one).
            on_partial: called once with the partial version (to serve it while it fills).
            on_shard: called after each verified shard or part (to wake downstream waiters).
            progress: called with (verified bytes, total bytes).
            extra_sources: polled every ``have_poll_s``; sources it returns that are new are
                added to the download (nodes discovered while it runs), while fewer than
                ``max_extra_sources`` added this way are usable (not banned): the source set,
                its have-polls and their traffic stay bounded however many nodes are
                discovered.
            max_extra_sources: bound on usable discovered sources in this download.
            upstreams: polled like ``extra_sources``; the configured upstreams reachable now.
                Those not yet in the download (one that recovered) join it, unbounded, and
                one whose URL changed (restarted elsewhere) is used at its new URL.

        Returns:
            the committed ``step-N`` directory and the stats.

        Raises:
            DownloadFailed: with its :class:`~shardcast.liveness.Abandon` reason: the version
                is gone from every source (``gone_grace_s``), no usable source for
                ``no_source_grace_s``, no byte for ``no_progress_s``, past ``deadline_s``,
                or the data directory vanished (``store_lost``: a later call starts over).
            IntegrityError: the assembled files do not match (nothing is committed).
            Failures leave no partial directory behind; so does cancellation unless
            ``keep_partial`` (then the verified shards are resumed by the next download).
        """
        if not sources:
            raise DownloadFailed(f"no source for step {manifest.step}")
        started = trio.current_time()
        self._extra = extra_sources
        self._max_extra = max_extra_sources
        self._upstreams = upstreams
        part = await trio.to_thread.run_sync(self.store.begin, manifest)
        base_step = manifest.header.base_step
        use_base = (
            self.config.use_deltas
            and base_step is not None
            and self.store.has(base_step)
            and self._base_matches(base_step, manifest)
        )
        session = self._session(part, use_base)
        stats = self.current = self.last_stats = session.stats
        try:
            if on_partial is not None:
                on_partial(part)
            with trio.fail_after(self.config.deadline_s):
                if use_base:
                    assert base_step is not None
                    with self.store.pinned(base_step):
                        base = _Base(
                            base_step,
                            lambda n, o, ln, out: self.store.read_range(base_step, n, o, ln, out),
                        )
                        await _Driver(self, part, session, base, on_shard, progress).run(sources)
                else:
                    await _Driver(self, part, session, None, on_shard, progress).run(sources)
            try:
                path = await trio.to_thread.run_sync(part.commit)
            except OSError as exc:  # the data directory vanished under us
                raise DownloadFailed(
                    f"step {manifest.step}: store lost at commit ({exc})", Abandon.STORE_LOST
                ) from exc
        except trio.TooSlowError as exc:
            raise DownloadFailed(
                f"step {manifest.step} not complete after {self.config.deadline_s}s",
                Abandon.DEADLINE,
            ) from exc
        finally:
            self.current = None
            # cancelled from outside: the effective deadline of a cancelled scope is -inf
            cancelled = trio.current_effective_deadline() == -math.inf
            if not self.store.has(manifest.step):
                with trio.CancelScope(shield=True):
                    if cancelled and self.config.keep_partial:
                        await trio.to_thread.run_sync(part.close)
                    else:
                        await trio.to_thread.run_sync(part.abort)
        stats.elapsed_s = trio.current_time() - started
        return path, stats

    def _base_matches(self, base_step: int, manifest: Manifest) -> bool:
        try:
            held = self.store.load_manifest(base_step, self.trust)
        except Exception:
            return False
        return held.digest == manifest.header.base_digest

    def _session(self, part: PartialVersion, use_base: bool) -> Session:
        m = part.manifest
        shards = m.header.shards
        known = [i for i in range(len(shards)) if m.known(i)]
        cfg = self.config
        scfg = SessionConfig(
            cfg.scheduler,
            cfg.max_resume_buffers,
            use_base,
            cfg.prefer_compressed,
            self._max_extra,
            cfg.no_source_grace_s,
            cfg.gone_grace_s,
            cfg.no_progress_s,
        )
        return Session(
            m.step,
            [s.length for s in shards],
            m.header.n_parts,
            m.parts,
            [_offer(m.shard(i)) for i in known],
            [i for i in known if part.has(i)],  # kept from a previous run (journal)
            self.rng,
            scfg,
            trio.current_time(),
        )

    @staticmethod
    def _verify_and_write(
        part: PartialVersion,
        entry: ShardEntry,
        enc: str,
        data: bytearray,
        base: _Base | None,
        source: str,
    ) -> bool:
        """Decode (if encoded), verify and write one shard; runs in a worker thread."""
        if enc == codecs.RAW:
            return part.write_shard(entry.index, data, source)
        offered = entry.offered(enc)
        if offered is None:
            raise LocalProtocolError(f"shard {entry.index} does not offer {enc}")
        if blake3.blake3(data).hexdigest() != offered.digest:
            raise IntegrityError(f"shard {entry.index} {enc} blob digest mismatch", source)
        # pooled buffers: the base range is read into one, the frame decompressed into the
        # other, and xor-zstd XORs in place into the base buffer (no per-shard allocation)
        held = [_POOL.get(entry.length), _POOL.get(entry.length)]
        try:
            base_bytes = None
            if enc in codecs.DELTAS:
                assert base is not None
                base_bytes = base.read(entry.file, entry.offset, entry.length, held[0])
            try:
                raw = codecs.decode(
                    enc, data, entry.length, base_bytes, source, out=base_bytes, scratch=held[1]
                )
            except codecs.CodecError as exc:  # digest matched: the origin wrote a bad blob
                raise _BaseMismatch(f"{enc} blob does not decode: {exc}") from exc
            try:
                return part.write_shard(entry.index, raw, source, blobs={enc: bytes(data)})
            except IntegrityError as exc:  # blob verified, result wrong: base or origin
                raise _BaseMismatch(str(exc)) from exc
        finally:
            for buf in held:
                _POOL.put(buf)


class _BaseMismatch(IntegrityError):
    """A blob that matched its signed digest did not yield the shard: a delta against a base
    this node does not share with the origin, or a blob the origin encoded badly. Not the
    source's fault: the shard is fetched raw and nobody is blamed."""


def _offer(entry: ShardEntry) -> Offer:
    return Offer(entry.index, entry.length, {e.encoding: e.size for e in entry.encodings})


_UNAVAILABLE = {404: Outcome.GONE, 409: Outcome.WRONG_VERSION, 429: Outcome.REFUSED}


def _unavailable(exc: NotAvailable) -> Outcome:
    return _UNAVAILABLE.get(exc.status, Outcome.NOT_AVAILABLE)


async def _stream(
    client: HttpClient,
    src: Source,
    m: Manifest,
    f: Fetch,
    buf: _Buf,
    timeout_s: float,
    on_chunk: Callable[[], None],
) -> None:
    """Move the bytes of ``f`` from ``src`` into ``buf`` (appending at ``buf.pos``).

    Raises:
        NotAvailable, PeerUnreachable, StreamBroken, RemoteProtocolError: as
        :meth:`p2p.http_client.HttpClient.stream_range`; bytes that arrived stay in ``buf``.
    """
    entry = m.shard(f.shard)
    vurl = version_url(src.base_url, m.run_id, m.step)
    if f.encoding == codecs.RAW:
        url, offset = f"{vurl}/files/{entry.file}", entry.offset + f.start
    else:
        url, offset = f"{vurl}/shard/{entry.index}/{f.encoding}", f.start
    async with aclosing(
        client.stream_range(
            url,
            offset,
            f.length,
            timeout_s=timeout_s,
            headers=failed_header(f.failed),
            anonymous=src.anonymous,
        )
    ) as chunks:
        async for chunk in chunks:
            on_chunk()
            buf.data[buf.pos : buf.pos + len(chunk)] = chunk
            buf.pos += len(chunk)


class _Driver:
    """Does what one download's :class:`~shardcast.session.Session` decides, with trio: one
    task per transfer, manifest part, have-poll and probe, plus discovery; buffers live here
    (per request, kept prefixes per shard, suspect copies per copy id)."""

    def __init__(
        self,
        dl: Downloader,
        part: PartialVersion,
        session: Session,
        base: _Base | None,
        on_shard: Callable[[int], None] | None,
        progress: ProgressFn | None,
    ) -> None:
        self.dl = dl
        self.part = part
        self.m = part.manifest
        self.session = session
        self.base = base
        self.on_shard = on_shard
        self.progress = progress
        self.by_id: dict[str, Source] = {}
        self.bufs: dict[int, _Buf] = {}  # request -> its buffer
        self.kept: dict[int, _Buf] = {}  # shard -> prefix kept for resuming
        self.suspects: dict[int, bytearray] = {}  # copy -> a failed assembled copy
        self.scopes: dict[int, trio.CancelScope] = {}
        self.wake = trio.Event()
        self.nursery: trio.Nursery | None = None
        self.first_seen = False

    def poke(self) -> None:
        self.wake.set()
        self.wake = trio.Event()

    def join(self, s: Source, extra: bool = False, quiet: bool = False) -> None:
        """Add ``s`` to the download (logged unless ``quiet``: a source it started with)."""
        self.by_id[s.id] = s
        now = trio.current_time()
        banned = self.dl.bans.is_banned(s.id, now)
        self.apply(self.session.add_source(s.id, s.complete, now, banned=banned, extra=extra))
        if quiet:
            return
        log.info(
            "source_added step=%d source=%s complete=%s", self.m.step, short_id(s.id), s.complete
        )

    async def run(self, sources: list[Source]) -> None:
        """Until the session commits (return) or fails (:class:`DownloadFailed`)."""
        end: Commit | Fail | None = None
        async with trio.open_nursery() as nursery:
            self.nursery = nursery
            for s in sources:
                self.join(s, quiet=True)
            for k in self.session.missing_parts:
                nursery.start_soon(self.fetch_part, k)
            nursery.start_soon(self.discover)
            while end is None:
                now = trio.current_time()
                for a in self.session.poll(now):
                    if isinstance(a, Commit | Fail):
                        end = a
                    else:
                        self.apply(a)
                if end is None:
                    with trio.move_on_after(self.session.next_wake(now)):
                        await self.wake.wait()
            nursery.cancel_scope.cancel()
        if isinstance(end, Fail):  # raised here, outside the nursery: a plain exception type
            raise DownloadFailed(end.text, end.reason)

    def apply(self, actions: Action | list[Action]) -> None:
        for a in actions if isinstance(actions, list) else [actions]:
            self._apply(a)
        self.poke()

    def _apply(self, a: Action) -> None:
        assert self.nursery is not None
        if isinstance(a, Fetch):
            buf = self.kept.pop(a.shard) if a.start else _Buf(bytearray(a.size))
            self.scopes[a.req] = trio.CancelScope()
            self.nursery.start_soon(self.fetch, a, buf)
        elif isinstance(a, Cancel):
            if a.req in self.scopes:
                self.scopes[a.req].cancel()
        elif isinstance(a, Keep):
            self.kept[a.shard] = self.bufs[a.req]
        elif isinstance(a, Drop):
            self.kept.pop(a.shard, None)
        elif isinstance(a, KeepSuspect):
            self.suspects[a.copy] = self.bufs[a.req].data
        elif isinstance(a, Compare):
            bad, good = self.suspects.pop(a.copy), self.bufs[a.good].data
            culprits = blame(a.contributions, bad, good) if len(bad) == len(good) else set()
            self.apply(self.session.compared(a.copy, a.shard, culprits, trio.current_time()))
        elif isinstance(a, Blame):
            if self.dl.observer is not None:
                self.dl.observer.shard_corrupt(a.source)
        elif isinstance(a, Ban):
            bans, now = self.dl.bans, trio.current_time()
            if not bans.is_banned(a.source, now):
                bans.ban(a.source, now)
                log.warning(
                    "source_banned step=%d source=%s ban_s=%.0f",
                    self.m.step,
                    short_id(a.source),
                    bans.ban_s,
                )
        elif isinstance(a, PollHave):
            self.nursery.start_soon(self.poll_have, self.by_id[a.source])
        elif isinstance(a, Probe):
            self.nursery.start_soon(self.probe, self.by_id[a.source])
        # Check is handled by the transfer that asked for it (see fetch)

    async def fetch(self, f: Fetch, buf: _Buf) -> None:
        src, dl, session = self.by_id[f.source], self.dl, self.session
        self.bufs[f.req] = buf
        begin = buf.pos
        outcome = Outcome.CANCELLED
        t0 = trio.current_time()

        def on_chunk() -> None:
            now = trio.current_time()
            if buf.pos == begin:
                session.first_byte(f.req, now)
                if not self.first_seen:  # debug hook: one line per download (simulations/)
                    self.first_seen = True
                    log.debug(
                        "first_byte step=%d shard=%d source=%s",
                        self.m.step,
                        f.shard,
                        short_id(src.id),
                    )
            else:
                session.progress(now)

        try:
            with self.scopes[f.req]:
                try:
                    timeout = dl.config.stall_timeout_s
                    await _stream(dl.client, src, self.m, f, buf, timeout, on_chunk)
                    outcome = Outcome.OK
                except NotAvailable as exc:
                    outcome = _unavailable(exc)
                    if outcome is Outcome.REFUSED and dl.observer is not None:
                        dl.observer.refused(src.id)
                except (StreamBroken, PeerUnreachable) as exc:
                    broken = isinstance(exc, StreamBroken)
                    outcome = Outcome.BROKEN if broken else Outcome.UNREACHABLE
                    self._log_failure("shard_fetch_failed", f, exc)
                except RemoteProtocolError as exc:
                    outcome = Outcome.PROTOCOL_ERROR
                    self._log_failure("source_protocol_error", f, exc)
            got = buf.pos - begin
            now = trio.current_time()
            actions = session.transfer_ended(f.req, outcome, got, now)
            if outcome is Outcome.OK and dl.observer is not None:
                dl.observer.shard_received(src.id, f.encoding, got, now - t0)
            self.apply(actions)
            if any(isinstance(a, Check) for a in actions):
                await self.check(f, buf, src)
        finally:
            self.scopes.pop(f.req, None)
            self.bufs.pop(f.req, None)
            self.poke()

    def _log_failure(self, event: str, f: Fetch, exc: Exception) -> None:
        log.info(
            "%s step=%d shard=%d source=%s error=%s",
            event,
            self.m.step,
            f.shard,
            short_id(f.source),
            exc,
        )

    async def check(self, f: Fetch, buf: _Buf, src: Source) -> None:
        """Decode, verify and write the complete bytes of ``f`` in a worker thread."""
        entry, v0 = self.m.shard(f.shard), trio.current_time()
        try:
            written = await trio.to_thread.run_sync(
                self.dl._verify_and_write, self.part, entry, f.encoding, buf.data, self.base, src.id
            )
            verdict = Verdict.VERIFIED if written else Verdict.ALREADY_HELD
        except OSError as exc:  # the partial directory vanished: start over
            self.session.store_lost(f.req, str(exc))
            return
        except _BaseMismatch as exc:
            undecodable = isinstance(exc.__cause__, codecs.CodecError)
            verdict = Verdict.UNDECODABLE if undecodable else Verdict.BASE_MISMATCH
        except IntegrityError:
            verdict = Verdict.CORRUPT
        now = trio.current_time()
        self.apply(self.session.shard_checked(f.req, verdict, now))
        if verdict is Verdict.VERIFIED:
            if self.dl.observer is not None:
                self.dl.observer.shard_verified(src.id, now - v0)
            log.debug(
                "shard_verified step=%d shard=%d source=%s size_bytes=%d",
                self.m.step,
                f.shard,
                short_id(src.id),
                entry.length,
            )
            if self.on_shard is not None:
                self.on_shard(f.shard)
            if self.progress is not None:
                self.progress(self.session.verified_bytes, self.m.total_bytes)

    async def get_have(self, src: Source) -> bytes:
        return await self.dl.client.get_bytes(
            f"{version_url(src.base_url, self.m.run_id, self.m.step)}/have",
            max_bytes=(len(self.m.header.shards) + 7) // 8,
            timeout_s=self.dl.config.stall_timeout_s,
            anonymous=src.anonymous,
        )

    async def probe(self, src: Source) -> None:
        try:
            await self.get_have(src)
            answer = Answer.PRESENT
        except NotAvailable as exc:
            answer = Answer.GONE if exc.status in (404, 409) else Answer.PRESENT
        except (TransportError, RemoteProtocolError):
            answer = Answer.UNREACHABLE
        self.session.probed(src.id, answer, trio.current_time())
        self.poke()

    async def poll_have(self, src: Source) -> None:
        n = len(self.m.header.shards)
        while True:
            try:
                bits = await self.get_have(src)
                held = [
                    i for i in range(n) if i // 8 < len(bits) and bits[i // 8] & (0x80 >> i % 8)
                ]
                full = len(held) == n  # it holds everything: stop polling
                self.session.have_changed(src.id, None if full else held, trio.current_time())
                self.poke()
                if full:
                    return
            except NotAvailable as exc:  # 404, 409: it does not hold this version
                answer = Answer.GONE if exc.status in (404, 409) else Answer.PRESENT
                self.session.probed(src.id, answer, trio.current_time())
            except (TransportError, RemoteProtocolError):
                pass
            await trio.sleep(self.dl.config.have_poll_s)

    async def fetch_part(self, k: int) -> None:
        m, delay = self.m, 0.05
        while k not in m.parts:
            for src in list(self.by_id.values()):
                url = f"{version_url(src.base_url, m.run_id, m.step)}/manifest/part/{k}"
                try:
                    data = await self.dl.client.get_bytes(
                        url,
                        max_bytes=8 << 20,
                        timeout_s=self.dl.config.stall_timeout_s,
                        anonymous=src.anonymous,
                    )
                    signed = decode_part(data, m.header, trust=self.dl.trust, source=src.id)
                except NotAvailable as exc:
                    self.apply(
                        self.session.answered(src.id, _unavailable(exc), trio.current_time())
                    )
                    continue
                except (TransportError, ManifestError, IntegrityError) as exc:
                    log.info(
                        "part_fetch_failed step=%d part=%d source=%s error=%s",
                        m.step,
                        k,
                        short_id(src.id),
                        exc,
                    )
                    continue
                self.session.answered(src.id, Outcome.OK, trio.current_time())
                if m.add_part(signed):
                    offers = [_offer(m.shard(i)) for i in m.header.part_range(k)]
                    self.session.part_arrived(k, offers, trio.current_time())
                    if self.on_shard is not None:
                        self.on_shard(-1)
                    self.poke()
                return
            await trio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def discover(self) -> None:
        dl, session = self.dl, self.session
        reachable = set(self.by_id)  # upstreams reachable at the last poll
        while dl._extra is not None or dl._upstreams is not None:
            now_up: set[str] = set()
            for s in dl._upstreams() if dl._upstreams is not None else ():
                now_up.add(s.id)
                known_src = self.by_id.get(s.id)
                event = None
                if known_src is None:
                    self.join(s)  # an upstream that recovered (or appeared) since the start
                elif known_src.base_url != s.base_url:
                    self.by_id[s.id] = s  # restarted elsewhere: new requests go there
                    event = "source_moved"
                elif s.id not in reachable:  # it answered again after an outage
                    event = "source_back"
                if event is not None:
                    session.source_back(s.id, trio.current_time())
                    log.info("%s step=%d source=%s", event, self.m.step, short_id(s.id))
                    self.poke()
            if dl._upstreams is not None:
                reachable = now_up
            room = session.extra_room() if dl._extra is not None else 0
            for s in dl._extra() if dl._extra is not None and room > 0 else ():
                if not session.known(s.id) and room > 0:
                    room -= 1
                    self.join(s, extra=True)
            await trio.sleep(dl.config.have_poll_s)
