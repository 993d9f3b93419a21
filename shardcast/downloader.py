"""The downloader: fetch a version from several sources in parallel, verify, commit.

Theory of operation
-------------------
:meth:`Downloader.download` starts from a verified manifest header (parts may be missing) and
drives three kinds of tasks with trio:

- **parts**: missing manifest parts are fetched from the sources (each request waits at the
  source until the part exists), verified (trainer signature, header digest) and added; each
  new part makes its shards eligible. The origin can therefore announce a version before it
  has hashed it, and every tier forwards parts and shards as soon as they are verified.
- **shards**: whenever the sans-IO :class:`~shardcast.select.Scheduler` hands out a request, a
  task receives the byte range from the chosen source over the HTTP lane straight into a
  pooled shard buffer, hashing it as it arrives (:mod:`shardcast.receive`): the raw file
  range, or an encoded blob — the smallest delta when this node holds the delta base,
  ``zstd`` when ``prefer_compressed``. Raw bytes are checked against the shard digest and
  written once; encoded bytes are checked against their offered digest, decoded with bounds
  (:mod:`shardcast.codecs`) and the result checked against the shard digest, in a worker
  thread (:func:`~shardcast.receive.verify_and_write`). Bytes that fail are never served
  and never committed. A transfer that breaks
  mid-shard keeps what arrived; the next request resumes at that byte, usually from another
  source. A copy assembled from several sources that fails its digest is kept until a
  verified copy exists, then :func:`~shardcast.select.blame` names the culprit; only it is
  penalized. A blob that matches its signed digest but does not decode, or decodes to wrong
  bytes, is not the source's doing (a delta against a base this node does not share with the
  origin, or a blob the origin encoded badly): the shard falls back to raw, nobody is blamed.
- **versions by digest**: every request names the version as ``(step, manifest digest)``
  (:mod:`shardcast.lane_urls`); a source holding the step under another digest answers
  ``409``, which, like a ``404``, marks it as not holding the version and is never held
  against it.
- **have-sets**: sources that are not complete (peers re-serving what they hold) are polled
  for their have-bitmap every ``have_poll_s`` seconds.

When every shard verified and every part arrived, the version is committed atomically (file
digests derived from the checked shard digests for a schema-3 manifest, every file re-hashed
for schema 2; then one rename). If the download fails or is cancelled, the partial
directory is removed: no ``step-N/`` ever appears for an incomplete or unverified version.

Memory: at most ``max_inflight`` shard buffers in transfer plus ``max_resume_buffers`` kept
for resumption (shard size each), plus the manifest.
"""

from __future__ import annotations

import functools
import logging
import math
import random
from collections.abc import Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import trio

from p2p.errors import (
    IntegrityError,
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
from shardcast.lane_urls import (
    LaneAnswer,
    blob_url,
    file_url,
    have_url,
    lane_answer,
    part_url,
)
from shardcast.liveness import Abandon, Answer, DownloadWatch
from shardcast.manifest import Manifest, ManifestError, ShardEntry, decode_part
from shardcast.receive import (
    BaseMismatch,
    BaseVersion,
    ChunkCorrupt,
    ShardSink,
    verify_and_write,
)
from shardcast.select import Request, Scheduler, SchedulerConfig, SourceBans, blame
from shardcast.serve import decode_have, have_max_bytes
from shardcast.store import PartialVersion, VersionStore

log = logging.getLogger(__name__)


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


@dataclass
class DownloadStats:
    """Result counters of one download."""

    step: int
    bytes_fetched: int = 0
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    bytes_by_encoding: dict[str, int] = field(default_factory=dict)
    corrupt_by_source: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    delta_fallbacks: int = 0
    resumed: int = 0
    restored: int = 0
    asked_by_source: dict[str, int] = field(default_factory=dict)
    unavailable_by_source: dict[str, int] = field(default_factory=dict)
    other_digest_by_source: dict[str, int] = field(default_factory=dict)
    """Requests answered ``409`` (the source holds the step under another digest)."""
    elapsed_s: float = 0.0


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
            on_shard: called after each verified shard, chunk or part (to wake downstream
                waiters).
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
        stats = self.current = DownloadStats(manifest.step)
        self.last_stats = stats
        base_step = manifest.header.base_step
        base_digest = manifest.header.base_digest
        use_base = (
            self.config.use_deltas
            and base_step is not None
            and base_digest is not None
            and self.store.holds(base_step, base_digest)
        )
        try:
            if on_partial is not None:
                on_partial(part)
            with trio.fail_after(self.config.deadline_s):
                if use_base:
                    assert base_step is not None
                    with self.store.pinned(base_step):
                        base = BaseVersion(self.store, base_step)
                        try:
                            await self._run(part, sources, stats, base, on_shard, progress)
                        finally:
                            base.close()
                else:
                    await self._run(part, sources, stats, None, on_shard, progress)
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

    def _choose(self, shard: ShardEntry, base: BaseVersion | None, no_delta: set[int]) -> str:
        if shard.index in no_delta:  # an encoded form failed after its digest matched
            return codecs.RAW
        delta = shard.delta()
        if base is not None and delta is not None:
            return delta.encoding
        if self.config.prefer_compressed and shard.offered(codecs.ZSTD):
            return codecs.ZSTD
        return codecs.RAW

    async def _run(
        self,
        part: PartialVersion,
        sources: list[Source],
        stats: DownloadStats,
        base: BaseVersion | None,
        on_shard: Callable[[int], None] | None,
        progress: ProgressFn | None,
    ) -> None:
        m = part.manifest
        header = m.header
        digest = m.digest  # the version is (m.step, digest) in every request
        known = [i for i in range(len(header.shards)) if m.known(i)]
        held = [i for i in known if part.has(i)]  # kept from a previous run (journal)
        sched = Scheduler(
            [s.length for s in header.shards],
            self.rng,
            self.config.scheduler,
            have=held,
            known=known,
        )
        by_id = {s.id: s for s in sources}
        cfg = self.config
        watch = DownloadWatch(
            trio.current_time(), cfg.no_source_grace_s, cfg.gone_grace_s, cfg.no_progress_s
        )
        for s in sources:
            sched.add_source(s.id, None if s.complete else ())
            if self.bans.is_banned(s.id, trio.current_time()):
                sched.ban(s.id)
            watch.add_source(s.id)
        chosen: dict[int, str] = {}
        no_delta: set[int] = set()
        resume: dict[int, ShardSink] = {}
        suspects: dict[int, list[ShardSink]] = {}
        scopes: dict[int, trio.CancelScope] = {}
        wake = trio.Event()
        verified = sum(header.shards[i].length for i in held)
        stats.restored = len(held)
        observer = self.observer

        def corrupt(source: str) -> None:
            stats.corrupt_by_source[source] = stats.corrupt_by_source.get(source, 0) + 1
            if observer is not None:
                observer.shard_corrupt(source)

        first_seen = False  # debug hook: one first_byte line per download (simulations/)
        probing: set[str] = set()
        failed_by: dict[int, list[str]] = {}  # shard -> sources that failed it (told to origin)

        def failed(shard: int, source: str) -> None:
            names = failed_by.setdefault(shard, [])
            if source not in names:
                names.append(source)
                del names[:-4]

        store_lost: list[OSError] = []
        spawn: list[trio.Nursery] = []  # the download's nursery, once open

        def poke() -> None:
            nonlocal wake
            wake.set()
            wake = trio.Event()

        def banish(source: str, cancel: list[int]) -> None:
            # if the scheduler has banned ``source``: remember it across versions and stop
            # the transfers it still has in flight (``cancel``)
            if not sched.is_banned(source):
                return
            if not self.bans.is_banned(source, trio.current_time()):
                self.bans.ban(source, trio.current_time())
                log.warning(
                    "source_banned step=%d source=%s inflight_cancelled=%d ban_s=%.0f",
                    m.step,
                    short_id(source),
                    len(cancel),
                    self.bans.ban_s,
                )
            for rid in cancel:
                if rid in scopes:
                    scopes[rid].cancel()

        def write_chunk(index: int, start: int, data: memoryview) -> None:
            # a chunk verified: write it now and let this node's lane serve it
            if part.write_prefix(index, start, data) and on_shard is not None:
                on_shard(index)

        def reschedule(index: int) -> None:
            entry = m.shard(index)
            enc = self._choose(entry, base, no_delta)
            chosen[index] = enc
            offered = entry.offered(enc)
            sched.mark_known(index, offered.size if offered is not None else entry.length)

        for i in known:
            reschedule(i)

        def answered(src_id: str, exc: NotAvailable) -> None:
            """A 503/429 shows the source holds the version; a 404 or a 409 (it holds the
            step under another digest) is checked at /have; none is held against it."""
            if lane_answer(exc.status) is LaneAnswer.BUSY:
                watch.on_answer(src_id, Answer.PRESENT, trio.current_time())
            elif src_id not in probing and not watch.gone(src_id) and spawn:
                probing.add(src_id)
                spawn[0].start_soon(probe, src_id)

        async def probe(src_id: str) -> None:
            src = by_id[src_id]
            try:
                await self.client.get_bytes(
                    have_url(src.base_url, m.run_id, m.step, digest),
                    max_bytes=(len(header.shards) + 7) // 8,
                    timeout_s=cfg.stall_timeout_s,
                    anonymous=src.anonymous,
                )
                answer = Answer.PRESENT
            except NotAvailable as exc:
                answer = _presence(exc)
            except (TransportError, RemoteProtocolError):
                answer = Answer.UNREACHABLE
            finally:
                probing.discard(src_id)
            watch.on_answer(src_id, answer, trio.current_time())
            if answer is Answer.GONE:
                log.info("source_gone step=%d source=%s", m.step, short_id(src_id))
            poke()

        async def fetch_parts() -> None:
            missing = [k for k in range(header.n_parts) if k not in m.parts]
            async with trio.open_nursery() as n:
                for k in missing:
                    n.start_soon(fetch_part, k)

        async def fetch_part(k: int) -> None:
            delay = 0.05
            while k not in m.parts:
                for src in list(by_id.values()):
                    url = part_url(src.base_url, m.run_id, m.step, digest, k)
                    try:
                        data = await self.client.get_bytes(
                            url,
                            max_bytes=8 << 20,
                            timeout_s=self.config.stall_timeout_s,
                            anonymous=src.anonymous,
                        )
                        signed = decode_part(data, header, trust=self.trust, source=src.id)
                    except NotAvailable as exc:
                        answered(src.id, exc)
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
                    watch.on_answer(src.id, Answer.DELIVERED, trio.current_time())
                    if m.add_part(signed):
                        for i in header.part_range(k):
                            reschedule(i)
                        if on_shard is not None:
                            on_shard(-1)
                        poke()
                    return
                await trio.sleep(delay)
                delay = min(delay * 2, 1.0)

        async def poll_have(src: Source) -> None:
            url = have_url(src.base_url, m.run_id, m.step, digest) + "?prefix=1"
            while True:
                try:
                    bits = await self.client.get_bytes(
                        url,
                        max_bytes=have_max_bytes(len(header.shards)),
                        timeout_s=self.config.stall_timeout_s,
                        anonymous=src.anonymous,
                    )
                    try:
                        held, prefixes = decode_have(bits, len(header.shards))
                    except ValueError as exc:
                        raise RemoteProtocolError(src.id, f"have: {exc}") from exc
                    sched.set_prefixes(src.id, prefixes)
                    watch.on_answer(src.id, Answer.PRESENT, trio.current_time())
                    if len(held) == len(header.shards):  # it holds everything: stop polling
                        sched.add_source(src.id, None)
                        poke()
                        return
                    sched.add_have(src.id, held)
                    poke()
                except NotAvailable as exc:
                    watch.on_answer(src.id, _presence(exc), trio.current_time())
                except (TransportError, RemoteProtocolError):
                    pass
                await trio.sleep(self.config.have_poll_s)

        async def fetch(req: Request) -> None:
            nonlocal verified, first_seen
            entry = m.shard(req.shard)
            src = by_id[req.source]
            enc = chosen[req.shard]
            offered = entry.offered(enc)
            size = offered.size if offered is not None else entry.length
            buf = resume.pop(req.shard, None) if req.start else None
            if buf is None or buf.pos != req.start or buf.size != size:
                if buf is not None or req.start:
                    sched.discard_partial(req.shard)
                    sched.on_cancelled(req.id)
                    return
                buf = ShardSink.pooled(size)  # bytes land here once and are hashed on arrival
                if enc == codecs.RAW:  # checked per chunk; each verified chunk served at once
                    buf.expect_chunks(entry, functools.partial(write_chunk, req.shard))
            begin = buf.pos
            if begin:
                stats.resumed += 1
            stats.asked_by_source[src.id] = stats.asked_by_source.get(src.id, 0) + 1
            scope = scopes[req.id]
            if enc == codecs.RAW:
                url = file_url(src.base_url, m.run_id, m.step, digest, entry.file)
                offset = entry.offset + req.start
            else:
                url = blob_url(src.base_url, m.run_id, m.step, digest, entry.index, enc)
                offset = req.start
            t0 = trio.current_time()
            try:
                with scope:
                    try:
                        first = True
                        async with aclosing(
                            self.client.receive_range_into(
                                url,
                                offset,
                                buf.window(req.length),
                                timeout_s=self.config.stall_timeout_s,
                                headers=failed_header(failed_by.get(req.shard, ())),
                                anonymous=src.anonymous,
                            )
                        ) as pieces:
                            async for n in pieces:
                                watch.on_progress(trio.current_time())
                                if first:
                                    watch.on_answer(src.id, Answer.DELIVERED, trio.current_time())
                                    sched.on_first_byte(req.id, trio.current_time())
                                    first = False
                                    if not first_seen:
                                        first_seen = True
                                        log.debug(
                                            "first_byte step=%d shard=%d source=%s",
                                            m.step,
                                            req.shard,
                                            short_id(src.id),
                                        )
                                buf.advance(n)  # hashed while hot
                    except NotAvailable as exc:
                        buf.rewind()
                        if exc.status == 429 and observer is not None:
                            observer.refused(src.id)
                        answered(src.id, exc)
                        failed(req.shard, src.id)
                        stats.unavailable_by_source[src.id] = (
                            stats.unavailable_by_source.get(src.id, 0) + 1
                        )
                        if lane_answer(exc.status) is LaneAnswer.OTHER_DIGEST:
                            n = stats.other_digest_by_source.get(src.id, 0) + 1
                            stats.other_digest_by_source[src.id] = n
                        if buf.pos and not req.duplicate:
                            resume[req.shard] = buf  # keep the prefix for the next source
                        elif not req.duplicate:
                            sched.discard_partial(req.shard)
                        sched.on_failure(req.id, trio.current_time(), kind="unavailable")
                        return
                    except ChunkCorrupt as exc:  # one chunk, one sender: exact blame
                        failed(req.shard, src.id)
                        got = buf.pos - begin  # the sink kept only verified chunks
                        keep = not req.duplicate and buf.pos > 0
                        if keep:
                            if got:
                                buf.parts.append((src.id, begin, buf.pos))
                            resume[req.shard] = buf
                        elif not req.duplicate:
                            sched.discard_partial(req.shard)
                        banish(
                            src.id,
                            sched.on_failure(
                                req.id,
                                trio.current_time(),
                                kind="corrupt",
                                received=got,
                                kept=keep,
                            ),
                        )
                        stats.failures += 1
                        corrupt(src.id)
                        log.warning(
                            "chunk_corrupt step=%d shard=%d chunk=%d source=%s",
                            m.step,
                            req.shard,
                            exc.chunk,
                            short_id(src.id),
                        )
                        return
                    except (StreamBroken, PeerUnreachable) as exc:
                        buf.rewind()  # keep whole verified chunks only
                        failed(req.shard, src.id)
                        if isinstance(exc, PeerUnreachable):
                            watch.on_answer(src.id, Answer.UNREACHABLE, trio.current_time())
                        got = buf.pos - begin
                        keep = (
                            not req.duplicate
                            and buf.pos > 0
                            and len(resume) < self.config.max_resume_buffers
                        )
                        if keep:
                            if got:
                                buf.parts.append((src.id, begin, buf.pos))
                            resume[req.shard] = buf
                        elif not req.duplicate:
                            sched.discard_partial(req.shard)
                        sched.on_failure(
                            req.id, trio.current_time(), kind="broken", received=got if keep else 0
                        )
                        stats.failures += 1
                        log.info(
                            "shard_fetch_failed step=%d shard=%d source=%s error=%s",
                            m.step,
                            req.shard,
                            short_id(src.id),
                            exc,
                        )
                        return
                    except RemoteProtocolError as exc:
                        failed(req.shard, src.id)
                        banish(
                            src.id, sched.on_failure(req.id, trio.current_time(), kind="corrupt")
                        )
                        stats.failures += 1
                        corrupt(src.id)
                        log.warning(
                            "source_protocol_error step=%d shard=%d source=%s error=%s",
                            m.step,
                            req.shard,
                            short_id(src.id),
                            exc,
                        )
                        return
                    buf.parts.append((src.id, begin, buf.pos))
                    got = buf.pos - begin
                    stats.bytes_fetched += got
                    stats.bytes_by_source[src.id] = stats.bytes_by_source.get(src.id, 0) + got
                    stats.bytes_by_encoding[enc] = stats.bytes_by_encoding.get(enc, 0) + got
                    v0 = trio.current_time()
                    if observer is not None:
                        observer.shard_received(src.id, enc, got, v0 - t0)
                    try:
                        written = await trio.to_thread.run_sync(
                            verify_and_write, part, entry, enc, buf, base, src.id
                        )
                    except OSError as exc:  # the partial directory vanished: start over
                        store_lost.append(exc)
                        sched.on_cancelled(req.id)
                        return
                    except BaseMismatch:
                        no_delta.add(req.shard)
                        stats.delta_fallbacks += 1
                        sched.on_failure(req.id, trio.current_time(), kind="suspect")
                        reschedule(req.shard)
                        log.warning(
                            "encoded_blob_unusable step=%d shard=%d encoding=%s: fetching raw",
                            m.step,
                            req.shard,
                            enc,
                        )
                        return
                    except IntegrityError:
                        contributors = {p[0] for p in buf.parts}
                        for c in contributors:
                            failed(req.shard, c)
                        if len(contributors) == 1:
                            banish(
                                src.id,
                                sched.on_failure(req.id, trio.current_time(), kind="corrupt"),
                            )
                            corrupt(src.id)
                        else:
                            sched.on_failure(req.id, trio.current_time(), kind="suspect")
                            suspects.setdefault(req.shard, []).append(buf)
                        log.warning(
                            "shard_corrupt step=%d shard=%d sources=%s",
                            m.step,
                            req.shard,
                            ",".join(short_id(c) for c in sorted(contributors)),
                        )
                        return
                    losers = sched.on_success(req.id, trio.current_time())
                    for lid in losers:
                        if lid in scopes:
                            scopes[lid].cancel()
                    resume.pop(req.shard, None)
                    if written:
                        verified += entry.length
                        if observer is not None:
                            observer.shard_verified(src.id, trio.current_time() - v0)
                        if req.shard in suspects:
                            self._assign_blame(
                                sched,
                                suspects.pop(req.shard),
                                buf.data,
                                chosen[req.shard],
                                corrupt,
                                banish,
                            )
                        log.debug(
                            "shard_verified step=%d shard=%d source=%s size_bytes=%d",
                            m.step,
                            req.shard,
                            short_id(src.id),
                            entry.length,
                        )
                        if on_shard is not None:
                            on_shard(req.shard)
                        if progress is not None:
                            progress(verified, m.total_bytes)
                    buf.release()  # written (or already present): the buffer is reusable
                if scope.cancelled_caught:
                    sched.on_cancelled(req.id)
            finally:
                scopes.pop(req.id, None)
                poke()

        failure: str | None = None
        reason: Abandon | None = None

        extra_ids: set[str] = set()

        def join(s: Source) -> None:
            by_id[s.id] = s
            sched.add_source(s.id, None if s.complete else ())
            if self.bans.is_banned(s.id, trio.current_time()):
                sched.ban(s.id)
            watch.add_source(s.id)
            if not s.complete and spawn:
                spawn[0].start_soon(poll_have, s)
            log.info(
                "source_added step=%d source=%s complete=%s", m.step, short_id(s.id), s.complete
            )
            poke()

        reachable: set[str] = {s.id for s in sources}  # upstreams reachable at the last poll

        async def discover() -> None:
            nonlocal reachable
            while self._extra is not None or self._upstreams is not None:
                now_up: set[str] = set()
                for s in self._upstreams() if self._upstreams is not None else ():
                    now_up.add(s.id)
                    known_src = by_id.get(s.id)
                    if known_src is None:
                        join(s)  # an upstream that recovered (or appeared) since the start
                    elif known_src.base_url != s.base_url:
                        by_id[s.id] = s  # restarted elsewhere: new requests go to the new URL
                        sched.source_back(s.id, trio.current_time())
                        log.info("source_moved step=%d source=%s", m.step, short_id(s.id))
                        poke()
                    elif s.id not in reachable:  # it answered again after an outage
                        sched.source_back(s.id, trio.current_time())
                        log.info("source_back step=%d source=%s", m.step, short_id(s.id))
                        poke()
                if self._upstreams is not None:
                    reachable = now_up
                if self._extra is None:
                    await trio.sleep(self.config.have_poll_s)
                    continue
                banned = set(sched.statistics().banned)
                room = self._max_extra - len(extra_ids - banned)
                for s in self._extra() if room > 0 else ():
                    if s.id not in by_id and room > 0:
                        room -= 1
                        extra_ids.add(s.id)
                        join(s)
                await trio.sleep(self.config.have_poll_s)

        async with trio.open_nursery() as nursery:
            spawn.append(nursery)
            if not m.complete:
                nursery.start_soon(fetch_parts)
            for s in sources:
                if not s.complete:
                    nursery.start_soon(poll_have, s)
            nursery.start_soon(discover)
            while not sched.done() or not m.complete:
                now = trio.current_time()
                started_any = False
                while (req := sched.next_request(now)) is not None:
                    scopes[req.id] = trio.CancelScope()
                    nursery.start_soon(fetch, req)
                    started_any = True
                watch.tick(now, started_any or bool(sched.inflight()) or not m.complete)
                reason = Abandon.STORE_LOST if store_lost else watch.verdict(now)
                if reason is not None:
                    failure = self._failure_text(reason, m.step, sched, store_lost)
                    break
                if sched.done() and m.complete:
                    break
                # wake on any completion, new part or have-set; or when a block expires, or
                # when the watch's verdict can change
                wait = min(self.config.scheduler.penalty_s / 4, watch.next_change(now) + 1e-3)
                with trio.move_on_after(wait):
                    await wake.wait()
            nursery.cancel_scope.cancel()
        if failure is not None:  # raised here, outside the nursery: a plain exception type
            assert reason is not None
            log.warning("download_abandoned step=%d reason=%s", m.step, reason.value)
            raise DownloadFailed(failure, reason)

    def _failure_text(
        self, reason: Abandon, step: int, sched: Scheduler, store_lost: list[OSError]
    ) -> str:
        banned = ", ".join(short_id(b) for b in sched.statistics().banned) or "none"
        cfg = self.config
        if reason is Abandon.GONE:
            return f"step {step}: gone from every source for {cfg.gone_grace_s}s"
        if reason is Abandon.NO_PROGRESS:
            return f"step {step}: no byte received for {cfg.no_progress_s}s"
        if reason is Abandon.STORE_LOST:
            return f"step {step}: store lost ({store_lost[0]}); start over"
        return (
            f"step {step}: no usable source for {cfg.no_source_grace_s}s "
            f"({sched.missing} shards missing; banned: {banned})"
        )

    @staticmethod
    def _assign_blame(
        sched: Scheduler,
        bad_copies: list[ShardSink],
        good: memoryview,
        enc: str,
        corrupt: Callable[[str], None],
        banish: Callable[[str, list[int]], None],
    ) -> None:
        now = trio.current_time()
        for buf in bad_copies:
            if len(buf.data) != len(good):
                continue  # a copy of another encoding cannot be compared byte for byte
            for culprit in blame(buf.parts, buf.data, good):
                cancel = sched.penalize_corrupt(culprit, now)
                corrupt(culprit)
                log.warning("source_blamed source=%s reason=corrupt_bytes", short_id(culprit))
                banish(culprit, cancel)


def _presence(exc: NotAvailable) -> Answer:
    """What a source's ``404``/``409``/``429``/``503`` says about it holding the version: a
    ``409`` (the step under another digest) is as good as gone, and not its fault."""
    return Answer.PRESENT if lane_answer(exc.status) is LaneAnswer.BUSY else Answer.GONE
