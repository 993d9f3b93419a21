"""download: the trio driver of one download, doing what its session decides
(a :class:`~shardcast.core.session.Session`).

Theory of operation
-------------------
:class:`DownloadDriver` owns everything a download *does* (HTTP, worker threads, buffers);
the session owns everything it *decides*. One driver serves one call of
:meth:`shardcast.download.downloader.Downloader.download`; it runs, in one nursery:

- **transfers** (:class:`~shardcast.core.session.Fetch`): one task per request receives the byte
  range from the chosen source over the HTTP lane straight into the shard's
  :class:`~shardcast.download.receive.ShardSink` (:func:`_stream`:
  :meth:`~p2p.http_client.HttpClient.receive_range_into`, hashed as it arrives): the raw file
  range or an encoded blob. Complete bytes are checked, decoded if encoded and written by
  :func:`~shardcast.download.receive.verify_and_write` in a worker thread; the outcome goes back to
  the session as a typed :class:`~shardcast.core.session.Outcome`, then a
  :class:`~shardcast.core.session.Verdict` (a blob that matched its signed digest but does not
  decode is ``UNDECODABLE``; one that decodes to other bytes ``BASE_MISMATCH``).
- **chunks**: a raw shard whose part lists chunk digests is checked chunk by chunk as it
  arrives; each verified chunk is written at once (:meth:`DownloadDriver.write_chunk`) and
  this node's lane serves it while the rest streams in; a bad chunk ends the transfer
  (``CORRUPT_CHUNK``) with the chunks before it kept. Have-polls ask for ``?prefix=1``: the
  sources' verified prefixes go to the scheduler; each names the last answer's token and the
  shards this node lacks, so the source holds it until something changes among those (a
  long-poll, :meth:`DownloadDriver.poll_have`).
- **sinks**: one per request; a broken transfer's sink (bytes *and* running hash) is kept
  per shard when the session says :class:`~shardcast.core.session.Keep` and the next request
  appends to it; a failed copy assembled from several sources is kept until the session
  asks to :class:`~shardcast.core.session.Compare` it with a verified copy
  (:func:`~shardcast.core.blame.blame`). Pooled buffers go back to their pool once nothing
  refers to them.
- **parts** (:class:`~shardcast.download.parts.PartFetcher`: a few at a time, in part
  order, each asked of every upstream at once and of the discovered peers only if the
  upstreams do not give it), **have-polls**, **probes** and **discovery**
  (``extra_sources``, ``upstreams``).

Checks (verify, decode, write) of complete shards run in worker threads, at most one per
core at once in the whole process (:func:`check_limiter`): the blobs of a next version tend
to arrive together, and checking them all at once on 2 cores only made each slower while
each held pooled shard-sized buffers (two apiece before a sparse delta needed only one):
more than the pool keeps, so in the shaped benchmark every follower allocated (and the
kernel zeroed) 32-64 MiB of new buffers for each next version, 352 MiB over the six of
them; with the limiter and one buffer per sparse check, none.

CPU: the node's :class:`~shardcast.core.StageCpu` (``cpu``) is charged with each synchronous
step of a transfer's body reads (``receive``: :meth:`~shardcast.core.StageCpu.steps` around
each piece, so the other tasks of the loop are never charged), the hashing of each piece as
it lands (``verify``), chunk writes (``write``) and, in the worker thread, what
:func:`~shardcast.download.receive.verify_and_write` does.

A super-seeding refusal (``429``) may name the shard's holders
(:attr:`~p2p.http_errors.NotAvailable.holders`); those the ``unreachable`` hook (the
follower's :meth:`~shardcast.download.discovery.SourceDirectory.holder_reach`) finds this node
cannot reach go back to the session with the outcome, and the session's next request of the
shard names them (``X-Shardnet-Unreachable``), so the source serves it at once.

Every request names the version as ``(step, manifest digest)`` (:mod:`shardcast.wire.lane_urls`);
a ``409`` (the source holds the step under another digest) goes to the session as
:attr:`~shardcast.core.session.Outcome.WRONG_VERSION` and, at ``/have``, counts as gone, like a
``404``: never held against the source.
"""

from __future__ import annotations

import bisect
import functools
import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from contextlib import aclosing
from typing import TYPE_CHECKING

import trio

from p2p.errors import (
    ClosedMidBody,
    IntegrityError,
    PeerUnreachable,
    RemoteProtocolError,
    StreamBroken,
    TransportError,
    short_id,
)
from p2p.http_errors import NotAvailable
from p2p.lanes import HttpLaneClient
from p2p.trust import TrustList
from shardcast.core import (
    Action,
    Answer,
    Ban,
    Blame,
    BlobBatcher,
    Cancel,
    Check,
    Commit,
    Compare,
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
    SourceBans,
    Stage,
    StageCpu,
    Verdict,
    blame,
    cut_between_blobs,
    ended_at_hold,
    first_byte_times,
)
from shardcast.download.parts import PartFetcher
from shardcast.download.receive import (
    BaseMismatch,
    BaseVersion,
    ChunkCorrupt,
    ShardSink,
    verify_and_write,
)
from shardcast.store import PartialVersion
from shardcast.wire import (
    LaneAnswer,
    Manifest,
    ShardEntry,
    blob_url,
    blobs_url,
    codecs,
    decode_have,
    encode_want,
    failed_header,
    file_url,
    have_max_bytes,
    have_token,
    have_url,
    lane_answer,
    unreachable_header,
    wanted_token,
)

if TYPE_CHECKING:
    from shardcast.download.types import DownloadObserver, ProgressFn, Source

# the download's events keep the logger they had before the driver got its own module
log = logging.getLogger("shardcast.download.downloader")

DISCOVERY_SETTLE_S = 0.02
"""After ``sources_changed`` wakes discovery, wait this long before the pass, seconds: the
adverts of a version's start arrive in a burst (every node readvertises as it starts), and one
pass takes them all."""

IDLE_REPORT_S = 10.0
"""A download that receives nothing for this long logs why (``download_idle``: what is in
flight, what each source waits for), and again as often while the spell lasts, seconds."""

__all__ = ["DownloadDriver", "check_limiter", "offer"]

_CHECKS: trio.lowlevel.RunVar[trio.CapacityLimiter] = trio.lowlevel.RunVar("shardcast_checks")


def check_limiter() -> trio.CapacityLimiter:
    """The worker-thread limiter of shard checks
    (:func:`~shardcast.download.receive.verify_and_write`)
    of every download in this trio run: as many tokens as this process may use cores
    (``os.sched_getaffinity``), since a check is CPU work (hashing, decoding, copying into the
    page cache) and more threads than cores only share them.

    Must be called from inside a trio run (one limiter per run).
    """
    try:
        return _CHECKS.get()
    except LookupError:
        try:
            cores = len(os.sched_getaffinity(0))
        except AttributeError:  # not on Linux
            cores = os.cpu_count() or 1
        limiter = trio.CapacityLimiter(max(1, cores))
        _CHECKS.set(limiter)
        return limiter


class _StoreLost(Exception):
    """Writing a verified chunk failed (:meth:`DownloadDriver.write_chunk`)."""


_FETCH_FAILURES = (NotAvailable, StreamBroken, PeerUnreachable, RemoteProtocolError)
"""What a fetch from a source may raise that ends it with a typed :class:`Outcome`
(:meth:`DownloadDriver._failure`)."""


def offer(entry: ShardEntry) -> Offer:
    """What a manifest shard entry offers, for the session."""
    return Offer(entry.index, entry.length, {e.encoding: e.size for e in entry.encodings})


def _unavailable(exc: NotAvailable) -> Outcome:
    """The session's outcome for a ``404``/``409``/``429``/``503`` answer."""
    answer = lane_answer(exc.status)
    if answer is LaneAnswer.NOT_HELD:
        return Outcome.GONE
    if answer is LaneAnswer.OTHER_DIGEST:
        return Outcome.WRONG_VERSION
    return Outcome.REFUSED if exc.status == 429 else Outcome.NOT_AVAILABLE


def _presence(exc: NotAvailable) -> Answer:
    """What a source's ``404``/``409``/``429``/``503`` at ``/have`` says about it holding the
    version: a ``409`` (the step under another digest) is as good as gone, and not its fault."""
    return Answer.PRESENT if lane_answer(exc.status) is LaneAnswer.BUSY else Answer.GONE


async def _stream(
    client: HttpLaneClient,
    src: Source,
    m: Manifest,
    f: Fetch,
    sink: ShardSink,
    timeout_s: float,
    on_piece: Callable[[], None],
    cpu: StageCpu,
) -> None:
    """Receive the bytes of ``f`` from ``src`` into ``sink`` (appending at ``sink.pos``,
    hashing each piece as it lands); CPU charged to ``receive`` and ``verify``.

    Raises:
        NotAvailable, PeerUnreachable, StreamBroken, RemoteProtocolError: as
        :meth:`p2p.http_client.HttpClient.receive_range_into`; bytes that arrived stay in
        ``sink`` (and in its hash).
    """
    entry = m.shard(f.shard)
    if f.encoding == codecs.RAW:
        url = file_url(src.base_url, m.run_id, m.step, m.digest, entry.file)
        offset = entry.offset + f.start
    else:
        url = blob_url(src.base_url, m.run_id, m.step, m.digest, entry.index, f.encoding)
        offset = f.start
    async with aclosing(
        client.receive_range_into(
            url,
            offset,
            sink.window(f.length),
            timeout_s=timeout_s,
            headers=[*failed_header(f.failed), *unreachable_header(f.unreachable)],
            anonymous=src.anonymous,
        )
    ) as pieces:
        while True:
            try:  # only the generator's own steps: the socket reads and the HTTP framing
                n = await cpu.steps(Stage.RECEIVE, anext(pieces))
            except StopAsyncIteration:
                break
            on_piece()
            with cpu.measure(Stage.VERIFY):
                sink.advance(n)  # hashed while hot


class DownloadDriver:
    """Does what one download's :class:`~shardcast.core.session.Session` decides, with trio: one
    task per transfer, manifest part, have-poll and probe, plus discovery; sinks live here
    (per request, kept prefixes per shard, suspect copies per copy id).

    Args:
        client: the HTTP lane client.
        part: the version being written.
        session: its decisions.
        base: the committed delta base (pinned by the caller), or None.
        trust: what manifest parts are verified against.
        bans: source bans carried across versions.
        observer: told of shard-level events, or None.
        stall_timeout_s: a request that makes no progress for this long fails, seconds.
        have_poll_s: period of have-polls and discovery, seconds.
        extra_sources, upstreams, sources_changed: discovery callbacks (see
            :meth:`~shardcast.download.downloader.Downloader.download`), or None.
        on_shard, progress: as in :meth:`~shardcast.download.downloader.Downloader.download`.
        cpu: the node's CPU account by stage (module docstring), or None.
        batcher: which blob fetches share a request (kept across versions by the
            downloader: a source found without the batch route stays so), or None.
        unreachable: of the holders a refusal named, those this node cannot reach (module
            docstring), or None (none is ever named back).
    """

    def __init__(
        self,
        client: HttpLaneClient,
        part: PartialVersion,
        session: Session,
        base: BaseVersion | None,
        *,
        trust: TrustList,
        bans: SourceBans,
        observer: DownloadObserver | None,
        stall_timeout_s: float,
        have_poll_s: float,
        extra_sources: Callable[[], list[Source]] | None,
        upstreams: Callable[[], list[Source]] | None,
        on_shard: Callable[[int], None] | None,
        progress: ProgressFn | None,
        cpu: StageCpu | None = None,
        batcher: BlobBatcher | None = None,
        unreachable: Callable[[Sequence[str]], tuple[str, ...]] | None = None,
        sources_changed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self.client = client
        self.sources_changed = sources_changed
        self.unreachable = unreachable
        self.batcher = batcher if batcher is not None else BlobBatcher()
        self.cpu = cpu if cpu is not None else StageCpu()
        self.part = part
        self.m = part.manifest
        self.digest = self.m.digest  # the version is (m.step, digest) in every request
        self.session = session
        self.base = base
        self.trust = trust
        self.bans = bans
        self.observer = observer
        self.stall_timeout_s = stall_timeout_s
        self.have_poll_s = have_poll_s
        self.extra_sources = extra_sources
        self.upstreams = upstreams
        self.on_shard = on_shard
        self.progress = progress
        self.by_id: dict[str, Source] = {}
        self.parts = PartFetcher(
            self.m,
            self.digest,
            session,
            self.by_id,
            client,
            trust,
            stall_timeout_s,
            self.part_answered,
            self.part_arrived,
        )
        self.sinks: dict[int, ShardSink] = {}  # request -> its sink
        self.kept: dict[int, ShardSink] = {}  # shard -> prefix kept for resuming
        self.suspects: dict[int, ShardSink] = {}  # copy -> a failed assembled copy
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
        banned = self.bans.is_banned(s.id, now)
        self.apply(self.session.add_source(s.id, s.complete, now, banned=banned, extra=extra))
        if quiet:
            return
        log.info(
            "source_added step=%d source=%s complete=%s", self.m.step, short_id(s.id), s.complete
        )

    async def run(self, sources: list[Source]) -> Commit | Fail:
        """Until the session commits or fails; returns which."""
        end: Commit | Fail | None = None
        try:
            async with trio.open_nursery() as nursery:
                self.nursery = nursery
                for s in sources:
                    self.join(s, quiet=True)
                nursery.start_soon(self.parts.run)
                nursery.start_soon(self.discover)
                report_at = IDLE_REPORT_S
                while end is None:
                    now = trio.current_time()
                    quiet = self.session.quiet_for(now)
                    if quiet < IDLE_REPORT_S:
                        report_at = IDLE_REPORT_S
                    elif quiet >= report_at:  # then every IDLE_REPORT_S while it lasts
                        report_at = quiet + IDLE_REPORT_S
                        log.info(
                            "download_idle step=%d quiet_s=%.1f %s",
                            self.m.step,
                            quiet,
                            self.session.explain(now),
                        )
                    todo: list[Action] = []
                    for a in self.session.poll(now):
                        if isinstance(a, Commit | Fail):
                            end = a
                        else:
                            todo.append(a)
                    if todo:  # together: the blob fetches of one poll may share requests
                        self.apply(todo)
                    if end is None:
                        wait = min(self.session.next_wake(now), report_at - quiet)
                        with trio.move_on_after(max(wait, 0.0)):
                            await self.wake.wait()
                nursery.cancel_scope.cancel()
        finally:  # every task has ended: no sink is in use any more
            for sink in [*self.kept.values(), *self.suspects.values()]:
                sink.release()
            self.kept.clear()
            self.suspects.clear()
        assert end is not None  # the loop above ends only with one
        return end

    def apply(self, actions: Action | list[Action]) -> None:
        """Do ``actions`` in order; the whole delta blobs among their fetches are grouped by
        the :class:`~shardcast.core.batch.BlobBatcher` and started last, each group as one
        request (their cancel scopes exist at once, so a later ``Cancel`` still applies)."""
        acts = actions if isinstance(actions, list) else [actions]
        deferred: list[Fetch] = []
        for a in acts:
            if isinstance(a, Fetch) and self.batcher.batchable(a, self.by_id[a.source].anonymous):
                self.scopes[a.req] = trio.CancelScope()
                deferred.append(a)
            else:
                self._apply(a)
        assert self.nursery is not None or not deferred
        for group in self.batcher.plan(deferred):
            assert self.nursery is not None
            if len(group) == 1:
                self.nursery.start_soon(self.fetch, group[0], ShardSink.pooled(group[0].size))
            else:
                self.nursery.start_soon(self.fetch_batch, group)
        self.poke()

    def _apply(self, a: Action) -> None:
        assert self.nursery is not None
        if isinstance(a, Fetch):
            if a.start:
                sink = self.kept.pop(a.shard)
            else:
                sink = ShardSink.pooled(a.size)
                if a.encoding == codecs.RAW:  # checked per chunk, each served once verified
                    entry = self.m.shard(a.shard)
                    sink.expect_chunks(entry, functools.partial(self.write_chunk, a.shard))
            self.scopes[a.req] = trio.CancelScope()
            self.nursery.start_soon(self.fetch, a, sink)
        elif isinstance(a, Cancel):
            if a.req in self.scopes:
                self.scopes[a.req].cancel()
        elif isinstance(a, Keep):
            sink = self.sinks[a.req]
            old = self.kept.get(a.shard)
            if old is not None and old is not sink:
                old.release()  # idle: a kept sink is used only once popped by a Fetch
            self.kept[a.shard] = sink
        elif isinstance(a, Drop):
            dropped = self.kept.pop(a.shard, None)
            if dropped is not None:
                dropped.release()
        elif isinstance(a, KeepSuspect):
            self.suspects[a.copy] = self.sinks[a.req]
        elif isinstance(a, Compare):
            bad, good = self.suspects.pop(a.copy), self.sinks[a.good]
            same = bad.size == good.size
            culprits = blame(a.contributions, bad.data, good.data) if same else set()
            bad.release()
            self.apply(self.session.compared(a.copy, a.shard, culprits, trio.current_time()))
        elif isinstance(a, Blame):
            if self.observer is not None:
                self.observer.shard_corrupt(a.source)
        elif isinstance(a, Ban):
            now = trio.current_time()
            if not self.bans.is_banned(a.source, now):
                self.bans.ban(a.source, now)
                log.warning(
                    "source_banned step=%d source=%s ban_s=%.0f",
                    self.m.step,
                    short_id(a.source),
                    self.bans.ban_s,
                )
        elif isinstance(a, PollHave):
            self.nursery.start_soon(self.poll_have, self.by_id[a.source])
        elif isinstance(a, Probe):
            self.nursery.start_soon(self.probe, self.by_id[a.source])
        # Check is handled by the transfer that asked for it (see fetch)

    def write_chunk(self, index: int, start: int, data: memoryview) -> None:
        """A chunk of shard ``index`` verified: write it now, and let this node's lane
        serve it (``on_shard`` wakes the requests held for it).

        Raises:
            _StoreLost: the write failed (disk full, the partial directory removed): the
                session fails the download with ``store_lost`` (its partial is then
                removed), instead of the error ending the node."""
        try:
            with self.cpu.measure(Stage.WRITE):  # inside the hashing (verify): counted once
                written = self.part.write_prefix(index, start, data)
        except OSError as exc:
            self.session.store_lost(None, str(exc))
            raise _StoreLost(str(exc)) from exc
        if written and self.on_shard is not None:
            self.on_shard(index)

    def _held(self, sink: ShardSink) -> bool:
        """True if ``sink`` is kept (a resumable prefix or a suspect copy)."""
        return any(s is sink for s in self.kept.values()) or any(
            s is sink for s in self.suspects.values()
        )

    async def fetch(self, f: Fetch, sink: ShardSink) -> None:
        """Receive ``f`` (a range of one shard or blob) from its source into ``sink`` and end
        it with the session: ``OK`` bytes go to :meth:`check`; a failure keeps whole verified
        chunks only (:meth:`~shardcast.download.receive.ShardSink.rewind`). A body its source
        closed in order at the end of a chunk ended at the source's hold
        (:func:`~shardcast.core.session.ended_at_hold`): ``HOLD_ENDED``, not ``BROKEN``."""
        src, session = self.by_id[f.source], self.session
        self.sinks[f.req] = sink
        begin = sink.pos
        outcome = Outcome.CANCELLED
        unreached: tuple[str, ...] = ()
        closed: ClosedMidBody | None = None
        t0 = trio.current_time()

        def on_piece() -> None:
            now = trio.current_time()
            if sink.pos == begin:
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
                session.progress(now, f.req, sink.pos - begin)

        try:
            with self.scopes[f.req]:
                try:
                    await _stream(
                        self.client,
                        src,
                        self.m,
                        f,
                        sink,
                        self.stall_timeout_s,
                        on_piece,
                        self.cpu,
                    )
                    outcome = Outcome.OK
                except ChunkCorrupt:  # the sink kept the verified chunks before it
                    outcome = Outcome.CORRUPT_CHUNK
                except _StoreLost:  # the session fails the download at its next poll
                    outcome = Outcome.CANCELLED
                except ClosedMidBody as exc:  # decided below, once the sink is rewound
                    outcome, closed = Outcome.BROKEN, exc
                except _FETCH_FAILURES as exc:
                    outcome, unreached = self._failure(exc, f, src)
            dropped = sink.rewind() if outcome is not Outcome.OK else 0
            if closed is not None:
                outcome = self._closed(f, src, closed, sink.pos - begin, dropped, sink.chunked)
            got, now = sink.pos - begin, trio.current_time()
            self._log_ended(f, src, outcome, got, now - t0)
            cuts = session.stats.overdue
            actions = session.transfer_ended(f.req, outcome, got, now, unreachable=unreached)
            if self.observer is not None:
                if outcome is Outcome.OK:
                    self.observer.shard_received(src.id, f.encoding, got, now - t0)
                elif session.stats.overdue > cuts:  # the session cut it (Scheduler.overdue)
                    self.observer.transfer_cut(src.id)
            self.apply(actions)
            if any(isinstance(a, Check) for a in actions):
                await self.check(f, sink, src)
        finally:
            self.scopes.pop(f.req, None)
            self.sinks.pop(f.req, None)
            if not self._held(sink):
                sink.release()  # written, failed or dropped: the buffer is reusable
            self.poke()

    def _closed(
        self, f: Fetch, src: Source, exc: ClosedMidBody, got: int, dropped: int, chunked: bool
    ) -> Outcome:
        """The outcome of ``f``, whose body ``src`` closed in order after ``got`` bytes kept
        (``dropped`` more past the last whole chunk): ``HOLD_ENDED`` if it ended where the
        source's verified prefix ends (:func:`~shardcast.core.session.ended_at_hold`), else
        ``BROKEN``; logged either way."""
        if ended_at_hold(got, dropped, chunked=chunked):
            self._log_failure("range_cut_at_hold", f, exc)
            return Outcome.HOLD_ENDED
        return self._failure(exc, f, src)[0]

    def _log_ended(self, f: Fetch, src: Source, outcome: Outcome, got: int, took_s: float) -> None:
        log.debug(
            "transfer_ended step=%d shard=%d encoding=%s source=%s start=%d length=%d "
            "outcome=%s bytes=%d s=%.3f",
            self.m.step,
            f.shard,
            f.encoding,
            short_id(src.id),
            f.start,
            f.length,
            outcome.name,
            got,
            took_s,
        )

    async def fetch_batch(self, batch: tuple[Fetch, ...]) -> None:
        """Receive the whole blobs of ``batch`` (one source, one encoding) with one request
        on the batch route (:meth:`_get_batch`), handing each blob to the session as its own
        transfer the moment its last byte lands (:meth:`_hand_out`): split by the signed
        sizes, hashed into its own sink, checked on its own while the later blobs arrive (a
        bad blob blames this one source: the whole body came from it); the blobs handed out
        while a check runs are checked together, in one worker-thread hop, after it. A body
        that ends short (the source's hold ran out before a later blob was verified there,
        or the connection broke) ends the blobs it did not bring whole with its failure;
        those it brought stand.

        The body lands in one buffer (``recv_into``) and each blob's sink is a view of its
        slice: no byte is copied between the socket and the store (a sink kept for blame
        keeps the whole buffer alive, at most one batch)."""
        src, t0 = self.by_id[batch[0].source], trio.current_time()
        body = memoryview(bytearray(sum(f.size for f in batch)))
        sinks: list[ShardSink] = []
        ends: list[int] = []
        pos = 0
        for f in batch:
            sinks.append(ShardSink.over(body[pos : pos + f.size]))
            self.sinks[f.req] = sinks[-1]
            pos += f.size
            ends.append(pos)
        handed, checker = 0, False
        queued: list[tuple[Fetch, ShardSink]] = []  # handed out, not yet being checked

        async def check_queued() -> None:  # one hop at a time: what waits meanwhile goes together
            nonlocal checker
            try:
                while queued:
                    items = queued.copy()
                    queued.clear()
                    await self.check_many(items, src)
            finally:
                checker = False

        try:
            async with trio.open_nursery() as checking:

                def hand_out(upto: int, outcome: Outcome, unreached: tuple[str, ...]) -> None:
                    nonlocal handed, checker
                    checks = self._hand_out(batch, sinks, handed, upto, outcome, src, t0, unreached)
                    handed = upto
                    queued.extend(checks)
                    if queued and not checker:
                        checker = True
                        checking.start_soon(check_queued)

                def arrived(received: int) -> None:
                    whole = bisect.bisect_right(ends, received)
                    if whole > handed:
                        hand_out(whole, Outcome.OK, ())

                outcome, unreached = await self._get_batch(batch, src, body, arrived)
                if handed < len(batch):
                    hand_out(len(batch), outcome, unreached)
        finally:
            for f, sink in zip(batch, sinks, strict=True):
                self.scopes.pop(f.req, None)
                self.sinks.pop(f.req, None)
                if not self._held(sink):
                    sink.release()
            self.poke()

    async def _get_batch(
        self,
        batch: tuple[Fetch, ...],
        src: Source,
        body: memoryview,
        arrived: Callable[[int], None],
    ) -> tuple[Outcome, tuple[str, ...]]:
        """Receive the body of ``batch`` from ``src`` into ``body`` (exactly the sum of the
        blobs' signed sizes), calling ``arrived(bytes so far)`` after each piece lands;
        returns how the request ended (and, for a refusal, the holders it named that this
        node cannot reach). A ``404`` means the source lacks the route (an older node), the
        version or the first blobs' encoding: ``CANCELLED`` (its blobs go back to the
        scheduler without a penalty) and the :class:`BlobBatcher` asks it one blob at a
        time from then on. A body of the wrong length is the source's protocol error. A body
        its source ended in order right after a whole blob ends the blobs it did not bring as
        ``HOLD_ENDED`` (:func:`~shardcast.core.batch.cut_between_blobs`), as a range cut at
        the hold ends (:meth:`_closed`); any other failure ends every blob not yet whole the
        same way."""
        url = blobs_url(
            src.base_url,
            self.m.run_id,
            self.m.step,
            self.digest,
            [f.shard for f in batch],
            batch[0].encoding,
        )
        headers = [
            *failed_header(sorted({s for f in batch for s in f.failed})),
            *unreachable_header(sorted({s for f in batch for s in f.unreachable})),
        ]
        received = 0
        try:
            async with aclosing(
                self.client.receive_into(url, body, timeout_s=self.stall_timeout_s, headers=headers)
            ) as pieces:
                while True:
                    try:  # only the generator's own steps: the socket reads and the framing
                        received += await self.cpu.steps(Stage.RECEIVE, anext(pieces))
                    except StopAsyncIteration:
                        break
                    arrived(received)
            return Outcome.OK, ()
        except _FETCH_FAILURES as exc:
            if isinstance(exc, NotAvailable) and exc.status == 404:
                # no batch route there (or no version): one blob at a time from now on
                self.batcher.unsupported(src.id)
                return Outcome.CANCELLED, ()
            if isinstance(exc, ClosedMidBody) and cut_between_blobs(
                received, (f.size for f in batch)
            ):  # the source's hold ran out before it had the next blob: its late 503
                self._log_failure("batch_cut_between_blobs", batch[0], exc)
                return Outcome.HOLD_ENDED, ()
            return self._failure(exc, batch[0], src)

    def _hand_out(
        self,
        batch: tuple[Fetch, ...],
        sinks: list[ShardSink],
        start: int,
        stop: int,
        outcome: Outcome,
        src: Source,
        t0: float,
        unreached: tuple[str, ...] = (),
    ) -> list[tuple[Fetch, ShardSink]]:
        """End the transfers ``batch[start:stop]`` with the session, each with ``outcome``
        (its blob, at its signed size, already in its sink when ``OK``; hashed now); returns
        those to check. Measured at the batch's throughput so far, from ``t0`` (the request)
        to now over the bytes of ``batch[:stop]``
        (:func:`~shardcast.core.batch.first_byte_times`). ``unreached``: a refusal's holders
        this node cannot reach."""
        now, session = trio.current_time(), self.session
        # each blob's share of the batch's time so far: its sample is the batch's throughput
        firsts = first_byte_times((f.size for f in batch[:stop]), t0, now)
        checks: list[tuple[Fetch, ShardSink]] = []
        for k in range(start, stop):
            f, sink, mine = batch[k], sinks[k], outcome
            if mine is Outcome.OK and self.scopes[f.req].cancel_called:
                mine = Outcome.CANCELLED  # cancelled (endgame) while the batch was out
            got = 0
            if mine is Outcome.OK:
                session.first_byte(f.req, now, measure_from=firsts[k])
                with self.cpu.measure(Stage.VERIFY):
                    sink.advance(f.size)  # hashed (the bytes are in place)
                got = f.size
            actions = session.transfer_ended(f.req, mine, got, now, unreachable=unreached)
            if mine is Outcome.OK and self.observer is not None:
                self.observer.shard_received(src.id, f.encoding, got, now - t0)
            self.apply(actions)
            if any(isinstance(a, Check) for a in actions):
                checks.append((f, sink))
        return checks

    def _failure(self, exc: Exception, f: Fetch, src: Source) -> tuple[Outcome, tuple[str, ...]]:
        """The outcome of a fetch (or a batch, named by its first fetch ``f``) from ``src``
        that raised one of :data:`_FETCH_FAILURES`, and for a refusal the holders it named
        that this node cannot reach (the ``unreachable`` hook); logs it and tells the
        observer of a refusal."""
        if isinstance(exc, NotAvailable):
            outcome = _unavailable(exc)
            unreached: tuple[str, ...] = ()
            if outcome is Outcome.REFUSED:
                if self.observer is not None:
                    self.observer.refused(src.id)
                if exc.holders and self.unreachable is not None:
                    unreached = self.unreachable(exc.holders)
            return outcome, unreached
        if isinstance(exc, StreamBroken | PeerUnreachable):
            self._log_failure("shard_fetch_failed", f, exc)
            broken = Outcome.BROKEN if isinstance(exc, StreamBroken) else Outcome.UNREACHABLE
            return broken, ()
        self._log_failure("source_protocol_error", f, exc)
        return Outcome.PROTOCOL_ERROR, ()

    def _log_failure(self, event: str, f: Fetch, exc: Exception) -> None:
        log.info(
            "%s step=%d shard=%d source=%s error=%s",
            event,
            self.m.step,
            f.shard,
            short_id(f.source),
            exc,
        )

    def _verdict(self, f: Fetch, sink: ShardSink, src: Source) -> Verdict | OSError:
        """Verify, decode and write the complete bytes of ``f`` (blocking: in a worker
        thread); an ``OSError`` (the partial directory vanished) is returned, not raised."""
        try:
            written = verify_and_write(
                self.part, self.m.shard(f.shard), f.encoding, sink, self.base, src.id, cpu=self.cpu
            )
            return Verdict.VERIFIED if written else Verdict.ALREADY_HELD
        except OSError as exc:
            return exc
        except BaseMismatch as exc:  # the blob matched its digest: nobody's fault
            undecodable = isinstance(exc.__cause__, codecs.CodecError)
            return Verdict.UNDECODABLE if undecodable else Verdict.BASE_MISMATCH
        except IntegrityError:
            return Verdict.CORRUPT

    async def check(self, f: Fetch, sink: ShardSink, src: Source) -> None:
        """Verify, decode and write the complete bytes of ``f`` in a worker thread."""
        v0 = trio.current_time()
        result = await trio.to_thread.run_sync(self._verdict, f, sink, src, limiter=check_limiter())
        self._checked(f, src, result, v0)

    async def check_many(self, items: list[tuple[Fetch, ShardSink]], src: Source) -> None:
        """:meth:`check` of several blobs of one batch, in one worker-thread hop."""
        v0 = trio.current_time()

        def work() -> list[Verdict | OSError]:
            return [self._verdict(f, sink, src) for f, sink in items]

        results = await trio.to_thread.run_sync(work, limiter=check_limiter())
        for (f, _), result in zip(items, results, strict=True):
            self._checked(f, src, result, v0)

    def _checked(self, f: Fetch, src: Source, result: Verdict | OSError, v0: float) -> None:
        """Tell the session what checking ``f`` found, and the observers."""
        if isinstance(result, OSError):  # the partial directory vanished: start over
            self.session.store_lost(f.req, str(result))
            return
        verdict, entry = result, self.m.shard(f.shard)
        now = trio.current_time()
        self.apply(self.session.shard_checked(f.req, verdict, now))
        if verdict is Verdict.VERIFIED:
            if self.observer is not None:
                self.observer.shard_verified(src.id, now - v0)
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

    async def get_have(
        self, src: Source, last: tuple[bytes, dict[int, int]] | None = None
    ) -> bytes:
        """``/have?prefix=1``: the bitmap, then the verified prefixes of shards being
        received (:func:`shardcast.wire.have.decode_have`; an older node sends the bitmap).
        ``last``: the bitmap and prefixes of ``src``'s last answer. With it the request is a
        long-poll naming that answer's :func:`~shardcast.wire.have.have_token` (``known``:
        the source holds it until its answer differs; an older node answers at once), the
        shards this node lacks (``want``, :meth:`Session.lacking`) and the last answer's
        :func:`~shardcast.wire.have.wanted_token` under them (``wknown``), so that a source
        that knows ``want`` holds it until it has news for this node, not on any change."""
        query = "?prefix=1"
        if last is not None:
            query += f"&known={have_token(*last)}"
            lacking = self.session.lacking()
            want = encode_want(lacking)
            if want is not None:
                query += f"&want={want}&wknown={wanted_token(*last, lacking)}"
        return await self.client.get_bytes(
            have_url(src.base_url, self.m.run_id, self.m.step, self.digest) + query,
            max_bytes=have_max_bytes(len(self.m.header.shards)),
            timeout_s=self.stall_timeout_s,
            anonymous=src.anonymous,
        )

    async def probe(self, src: Source) -> None:
        try:
            await self.get_have(src)
            answer = Answer.PRESENT
        except NotAvailable as exc:
            answer = _presence(exc)
        except (TransportError, RemoteProtocolError):
            answer = Answer.UNREACHABLE
        self.session.probed(src.id, answer, trio.current_time())
        self.poke()

    async def poll_have(self, src: Source) -> None:
        """Follow ``src``'s have-bitmap until it holds everything: each request a long-poll
        that names the last answer's token and the shards this node lacks (the source
        answers when what it holds or serves a prefix of changes among those, :meth:`get_have`);
        after an unchanged answer (the hold ran out, or an older node that does not hold) or
        a failure, wait ``have_poll_s``."""
        n, nbytes = len(self.m.header.shards), (len(self.m.header.shards) + 7) // 8
        known: str | None = None  # the token of ``last``
        last: tuple[bytes, dict[int, int]] | None = None
        while True:
            try:
                try:
                    data = await self.get_have(src, last)
                    held, prefixes = decode_have(data, n)
                except ValueError as exc:
                    raise RemoteProtocolError(src.id, f"have: {exc}") from exc
                full = len(held) == n  # it holds everything: stop polling
                now = trio.current_time()
                self.session.have_changed(src.id, None if full else held, now, prefixes)
                self.poke()
                if full:
                    return
                last = data[:nbytes], prefixes
                token = have_token(*last)
                changed, known = token != known, token
                if changed:
                    continue  # ask again at once: held until the next change
            except NotAvailable as exc:  # 404, 409: it does not hold this version
                self.session.probed(src.id, _presence(exc), trio.current_time())
            except (TransportError, RemoteProtocolError):
                pass
            await trio.sleep(self.have_poll_s)

    def part_answered(self, source: str, exc: NotAvailable | None) -> None:
        """A source's answer to a manifest part ask (:class:`PartFetcher`): the part, or a
        ``404``/``409``/``429``/``503``."""
        now = trio.current_time()
        if exc is None:
            self.session.answered(source, Outcome.OK, now)
        else:
            self.apply(self.session.answered(source, _unavailable(exc), now))

    def part_arrived(self, k: int) -> None:
        """Manifest part ``k`` verified and was added: its shards become fetchable."""
        m = self.m
        self.session.part_arrived(
            k, [offer(m.shard(i)) for i in m.header.part_range(k)], trio.current_time()
        )
        if self.on_shard is not None:
            self.on_shard(-1)
        self.poke()

    async def discover(self) -> None:
        session = self.session
        reachable = set(self.by_id)  # upstreams reachable at the last poll
        while self.extra_sources is not None or self.upstreams is not None:
            now_up: set[str] = set()
            for s in self.upstreams() if self.upstreams is not None else ():
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
            if self.upstreams is not None:
                reachable = now_up
            room = session.extra_room() if self.extra_sources is not None else 0
            for s in self.extra_sources() if self.extra_sources is not None and room > 0 else ():
                if not session.known(s.id) and room > 0:
                    room -= 1
                    self.join(s, extra=True)
            await self._next_discovery()

    async def _next_discovery(self) -> None:
        """Wait for the next discovery pass: ``have_poll_s``, or less when ``sources_changed``
        returns first (the node heard of a new source or a changed one), then
        :data:`DISCOVERY_SETTLE_S`. Polling alone added up to ``have_poll_s`` (0.25 s) to the
        moment every download of a version could use the peers that started it too: in the
        NAT bench's 1.65 MB versions, peers' first discovered source joined a median 0.34 s
        after the announcement (0.15 s with this wake), while the super-seeding relay
        refused most of their first requests."""
        with trio.move_on_after(self.have_poll_s):
            if self.sources_changed is None:
                await trio.sleep_forever()
            else:
                await self.sources_changed()
                await trio.sleep(DISCOVERY_SETTLE_S)
