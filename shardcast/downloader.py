"""The downloader: fetch a version's shards from several sources in parallel, verify, commit.

Theory of operation
-------------------
:meth:`Downloader.download` drives the sans-IO :class:`~shardcast.select.Scheduler` with trio:
whenever the scheduler hands out a request, a task streams that byte range of the shard from
the chosen source over the HTTP lane into a shard-sized buffer. A complete shard is checked
against its BLAKE3 digest and written at its offset by :class:`~shardcast.store.PartialVersion`
(in a worker thread), so bytes that fail never reach the disk or another peer. A transfer that
breaks mid-shard keeps what it received; the next request for that shard resumes at that byte,
usually from another source. If a copy assembled from several sources fails its digest, the
pieces are kept and, once a verified copy exists, :func:`~shardcast.select.blame` names the
source whose bytes differed; only that source is penalized.

When every shard verified, the whole version is committed atomically (every file re-hashed,
then one rename). If the download fails or is cancelled, the partial directory is removed:
no ``step-N/`` ever appears for an incomplete or unverified version.

Memory: at most ``max_inflight`` shard buffers in transfer plus ``max_resume_buffers`` kept
for resumption (shard size each).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from p2p.errors import (
    IntegrityError,
    PeerUnreachable,
    RemoteProtocolError,
    ShardnetError,
    StreamBroken,
    short_id,
)
from p2p.http_client import HttpClient
from p2p.http_errors import NotAvailable
from shardcast.manifest import SignedManifest
from shardcast.select import Request, Scheduler, SchedulerConfig, blame
from shardcast.store import PartialVersion, VersionStore

log = logging.getLogger(__name__)


class DownloadFailed(ShardnetError):
    """A version could not be downloaded (no usable source, deadline passed)."""


@dataclass(frozen=True)
class Source:
    """A place to fetch shards from.

    Attributes:
        id: a stable label (the source's PeerID, or its URL).
        base_url: HTTP lane base URL, e.g. ``http://127.0.0.1:9000``.
        complete: True if it holds (or will hold) every shard of the version; False for a
            peer that re-serves only what it has (its have-set is then given separately).
    """

    id: str
    base_url: str
    complete: bool = True


def file_url(base_url: str, run_id: str, step: int, name: str) -> str:
    """URL of one file of a version on a node's HTTP lane."""
    return f"{base_url}/shardnet/v1/{run_id}/{step}/files/{name}"


def manifest_url(base_url: str, run_id: str, step: int) -> str:
    """URL of a version's signed manifest on a node's HTTP lane."""
    return f"{base_url}/shardnet/v1/{run_id}/{step}/manifest"


@dataclass(frozen=True)
class DownloadConfig:
    """Downloader settings.

    Attributes:
        stall_timeout_s: a transfer that makes no progress for this long fails, seconds.
        deadline_s: give up on a version after this long, seconds.
        no_source_grace_s: fail if no source is usable for this long, seconds.
        max_resume_buffers: shard buffers kept for resuming broken transfers.
        scheduler: source-selection tuning.
    """

    stall_timeout_s: float = 30.0
    deadline_s: float = 3600.0
    no_source_grace_s: float = 120.0
    max_resume_buffers: int = 8
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)


@dataclass
class DownloadStats:
    """Result counters of one download."""

    step: int
    bytes_fetched: int = 0
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    corrupt_by_source: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    elapsed_s: float = 0.0


ProgressFn = Callable[[int, int], None]
"""``progress(verified_bytes, total_bytes)``, called after every verified shard."""


@dataclass
class _Buf:
    data: bytearray
    pos: int = 0
    parts: list[tuple[str, int, int]] = field(default_factory=list)  # (source, start, end)


class Downloader:
    """Downloads versions into a :class:`VersionStore` (one download at a time per instance).

    Args:
        client: the HTTP lane client.
        store: where versions are committed.
        config: settings.
        rng: seeded randomness for the scheduler.
    """

    def __init__(
        self, client: HttpClient, store: VersionStore, config: DownloadConfig, rng: random.Random
    ) -> None:
        self.client = client
        self.store = store
        self.config = config
        self.rng = rng

    async def download(
        self,
        signed: SignedManifest,
        sources: list[Source],
        *,
        on_partial: Callable[[PartialVersion], None] | None = None,
        on_shard: Callable[[int], None] | None = None,
        progress: ProgressFn | None = None,
    ) -> tuple[Path, DownloadStats]:
        """Fetch every shard of ``signed`` from ``sources``, verify, and commit.

        Args:
            signed: the verified manifest of the version.
            sources: where to fetch from (at least one).
            on_partial: called once with the partial version (e.g. to serve it while it fills).
            on_shard: called with each shard index once verified and written.
            progress: called with (verified bytes, total bytes).

        Returns:
            the committed ``step-N`` directory and the stats.

        Raises:
            DownloadFailed: no usable source for ``no_source_grace_s`` or past ``deadline_s``.
            IntegrityError: the assembled files do not match (nothing is committed).
            Cancellation leaves no partial directory behind.
        """
        m = signed.manifest
        if not sources:
            raise DownloadFailed(f"no source for step {m.step}")
        started = trio.current_time()
        part = await trio.to_thread.run_sync(self.store.begin, signed)
        stats = DownloadStats(m.step)
        try:
            if on_partial is not None:
                on_partial(part)
            with trio.fail_after(self.config.deadline_s):
                await self._run(part, sources, stats, on_shard, progress)
            path = await trio.to_thread.run_sync(part.commit)
        except trio.TooSlowError as exc:
            raise DownloadFailed(
                f"step {m.step} not complete after {self.config.deadline_s}s"
            ) from exc
        finally:
            if not self.store.has(m.step):
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(part.abort)
        stats.elapsed_s = trio.current_time() - started
        return path, stats

    async def _run(
        self,
        part: PartialVersion,
        sources: list[Source],
        stats: DownloadStats,
        on_shard: Callable[[int], None] | None,
        progress: ProgressFn | None,
    ) -> None:
        m = part.manifest
        sched = Scheduler([s.length for s in m.shards], self.rng, self.config.scheduler)
        by_id = {s.id: s for s in sources}
        for s in sources:
            sched.add_source(s.id, None if s.complete else ())
        resume: dict[int, _Buf] = {}
        suspects: dict[int, list[tuple[_Buf, set[str]]]] = {}
        scopes: dict[int, trio.CancelScope] = {}
        wake = trio.Event()
        verified_bytes = 0
        last_usable = trio.current_time()

        async def fetch(req: Request) -> None:
            nonlocal wake, verified_bytes
            shard = m.shards[req.shard]
            src = by_id[req.source]
            buf = resume.pop(req.shard, None) if req.start else None
            if buf is None or buf.pos != req.start:
                buf = _Buf(bytearray(shard.length), req.start)
            begin = buf.pos
            scope = scopes[req.id]
            url = file_url(src.base_url, m.run_id, m.step, shard.file)
            try:
                with scope:
                    try:
                        first = True
                        async for chunk in self.client.stream_range(
                            url,
                            shard.offset + req.start,
                            req.length,
                            timeout_s=self.config.stall_timeout_s,
                        ):
                            if first:
                                sched.on_first_byte(req.id, trio.current_time())
                                first = False
                            buf.data[buf.pos : buf.pos + len(chunk)] = chunk
                            buf.pos += len(chunk)
                    except NotAvailable:
                        sched.on_failure(req.id, trio.current_time(), kind="unavailable")
                        if begin:  # nothing arrived: the kept prefix waits for the next source
                            resume[req.shard] = buf
                        return
                    except (StreamBroken, PeerUnreachable) as exc:
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
                        sched.on_failure(
                            req.id,
                            trio.current_time(),
                            kind="timeout" if "timed out" in str(exc) else "broken",
                            received=got if keep else 0,
                        )
                        if not keep and not req.duplicate:
                            sched.discard_partial(req.shard)  # the scheduler kept the offset
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
                        sched.on_failure(req.id, trio.current_time(), kind="corrupt")
                        stats.failures += 1
                        stats.corrupt_by_source[src.id] = stats.corrupt_by_source.get(src.id, 0) + 1
                        log.warning(
                            "source_protocol_error step=%d shard=%d source=%s error=%s",
                            m.step,
                            req.shard,
                            short_id(src.id),
                            exc,
                        )
                        return
                    buf.parts.append((src.id, begin, buf.pos))
                    stats.bytes_fetched += buf.pos - begin
                    stats.bytes_by_source[src.id] = (
                        stats.bytes_by_source.get(src.id, 0) + buf.pos - begin
                    )
                    try:
                        written = await trio.to_thread.run_sync(
                            part.write_shard, req.shard, buf.data, src.id
                        )
                    except IntegrityError:
                        contributors = {p[0] for p in buf.parts}
                        if len(contributors) == 1:
                            sched.on_failure(req.id, trio.current_time(), kind="corrupt")
                            stats.corrupt_by_source[src.id] = (
                                stats.corrupt_by_source.get(src.id, 0) + 1
                            )
                        else:
                            sched.on_failure(req.id, trio.current_time(), kind="suspect")
                            suspects.setdefault(req.shard, []).append((buf, contributors))
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
                    if written:
                        verified_bytes += shard.length
                        if req.shard in suspects:
                            self._assign_blame(sched, suspects.pop(req.shard), buf.data, stats)
                        if on_shard is not None:
                            on_shard(req.shard)
                        if progress is not None:
                            progress(verified_bytes, m.total_bytes)
                if scope.cancelled_caught:
                    sched.on_cancelled(req.id)
            finally:
                scopes.pop(req.id, None)
                wake.set()

        failure: str | None = None
        async with trio.open_nursery() as nursery:
            while not sched.done():
                now = trio.current_time()
                started_any = False
                while (req := sched.next_request(now)) is not None:
                    scopes[req.id] = trio.CancelScope()
                    nursery.start_soon(fetch, req)
                    started_any = True
                if started_any or sched.inflight():
                    last_usable = now
                elif now - last_usable > self.config.no_source_grace_s:
                    failure = (
                        f"step {m.step}: no usable source for {self.config.no_source_grace_s}s "
                        f"({sched.missing} shards missing; banned: "
                        f"{', '.join(short_id(b) for b in sched.statistics().banned) or 'none'})"
                    )
                    break
                if sched.done():
                    break
                wake = trio.Event()
                # nothing in flight: wait for a blocked source to become eligible again
                with trio.move_on_after(
                    self.config.scheduler.penalty_s / 4 if not sched.inflight() else 3600
                ):
                    await wake.wait()
            nursery.cancel_scope.cancel()
        if failure is not None:  # raised here, outside the nursery: a plain exception type
            raise DownloadFailed(failure)

    @staticmethod
    def _assign_blame(
        sched: Scheduler,
        bad_copies: list[tuple[_Buf, set[str]]],
        good: bytearray,
        stats: DownloadStats,
    ) -> None:
        now = trio.current_time()
        for buf, _ in bad_copies:
            for culprit in blame(buf.parts, buf.data, good):
                sched.penalize_corrupt(culprit, now)
                stats.corrupt_by_source[culprit] = stats.corrupt_by_source.get(culprit, 0) + 1
                log.warning("source_blamed source=%s reason=corrupt_bytes", short_id(culprit))
