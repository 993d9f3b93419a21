"""download: the downloader: fetch a version from several sources in parallel, verify, commit.

Theory of operation
-------------------
What a download *decides* lives in the sans-IO :class:`~shardcast.core.session.Session` (source
and shard choice through the :class:`~shardcast.core.select.Scheduler`, resumption, blame and bans,
delta fallback, the endgame, the discovery bound, abandonment); the simulator drives the same
object. :meth:`Downloader.download` starts from a verified manifest header (parts may be
missing) and runs the session's trio driver (:class:`~shardcast.download.driver.DownloadDriver`),
which does what the session's actions say:

- **parts**: missing manifest parts are fetched from the sources (each request waits at the
  source until the part exists), verified (trainer signature, header digest) and reported;
  each new part makes its shards eligible. The origin can therefore announce a version
  before it has hashed it, and every tier forwards parts and shards as soon as they are
  verified.
- **transfers** (:class:`~shardcast.core.session.Fetch`): one task receives the byte range from
  the chosen source over the HTTP lane straight into a pooled shard buffer, hashing it as it
  arrives (:mod:`shardcast.download.receive`): the raw file range, or an encoded blob — the smallest
  delta when this node holds the delta base, ``zstd`` when ``prefer_compressed``. Raw bytes
  are checked against the shard digest and written once (or, when the manifest part lists
  chunk digests, chunk by chunk as they arrive, each verified chunk written and served to
  other nodes at once, :mod:`shardcast.download.receive`); encoded bytes are checked against
  their offered digest, decoded with bounds (:mod:`shardcast.wire.codecs`) and the result checked
  against the shard digest, in a worker thread
  (:func:`~shardcast.download.receive.verify_and_write`).
  Bytes that fail are never served and never committed. The outcome goes back to the session
  as a typed :class:`~shardcast.core.session.Outcome` or :class:`~shardcast.core.session.Verdict`. A
  transfer that breaks mid-shard keeps what arrived (and its running hash); the next request
  resumes at that byte, usually from another source. A copy assembled from several sources
  that fails its digest is kept until a verified copy exists, then
  :func:`~shardcast.core.blame.blame` names the culprit; only it is penalized. A blob that matches
  its signed digest but does not decode, or decodes to wrong bytes, is not the source's doing
  (a delta against a base this node does not share with the origin, or a blob the origin
  encoded badly): the shard falls back to raw, nobody is blamed.
- **versions by digest**: every request names the version as ``(step, manifest digest)``
  (:mod:`shardcast.wire.lane_urls`); a source holding the step under another digest answers
  ``409``, which, like a ``404``, marks it as not holding the version and is never held
  against it (:attr:`~shardcast.core.session.Outcome.WRONG_VERSION`, counted in
  :attr:`~shardcast.core.session.DownloadStats.other_digest_by_source`).
- **have-sets**: partial sources (peers re-serving what they hold) are polled for their
  have-bitmap every ``have_poll_s`` seconds; **discovery** adds sources from
  ``extra_sources``/``upstreams`` every ``have_poll_s`` seconds, and at once (after
  :data:`~shardcast.download.driver.DISCOVERY_SETTLE_S`) when ``sources_changed`` says the node
  heard of a new source.

When the session commits, the version is committed atomically (file digests derived from the
checked shard digests for a schema-3 manifest, every file re-hashed for schema 2; then one
rename). If the download fails or is cancelled, the partial directory is removed: no
``step-N/`` ever appears for an incomplete or unverified version.

Memory: at most ``max_inflight`` shard buffers in transfer plus ``max_resume_buffers`` kept
for resumption (shard size each), suspect copies until blame, plus the manifest.
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import trio

from p2p.lanes import HttpLaneClient
from p2p.trust import TrustList
from shardcast.core import (
    Abandon,
    BlobBatcher,
    DownloadStats,
    Fail,
    Session,
    SessionConfig,
    SourceBans,
    Stage,
    StageCpu,
)
from shardcast.download.driver import DownloadDriver, offer
from shardcast.download.receive import BaseVersion
from shardcast.download.types import (
    DownloadConfig,
    DownloadFailed,
    DownloadObserver,
    ProgressFn,
    Source,
)
from shardcast.store import ChainBroken, PartialVersion, VersionStore
from shardcast.wire import Manifest

log = logging.getLogger(__name__)

__all__ = ["Downloader"]


class Downloader:
    """Downloads versions into a :class:`VersionStore` (one download at a time per instance).

    Args:
        client: the HTTP lane client.
        store: where versions are committed (and delta bases are read).
        config: settings.
        rng: seeded randomness for the scheduler.
        trust: the trust list parts and stored manifests are verified against.
        observer: told of each shard-level event (metrics), or None.
        cpu: the node's CPU account by stage (:class:`~shardcast.core.StageCpu`; the
            driver, the shard checks and the commit charge it), or None.

    ``current`` is the stats of the download running now (None between downloads), for a
    status view.
    """

    def __init__(
        self,
        client: HttpLaneClient,
        store: VersionStore,
        config: DownloadConfig,
        rng: random.Random,
        trust: TrustList,
        observer: DownloadObserver | None = None,
        cpu: StageCpu | None = None,
    ) -> None:
        self.client = client
        self.cpu = cpu if cpu is not None else StageCpu()
        self.store = store
        self.config = config
        self.rng = rng
        self.trust = trust
        self.observer = observer
        self.current: DownloadStats | None = None
        self._extra: Callable[[], list[Source]] | None = None
        self._max_extra = 16
        self.bans = SourceBans(config.source_ban_s)
        self.batcher = BlobBatcher()  # which sources lack the batch route: kept across versions
        self._upstreams: Callable[[], list[Source]] | None = None
        self._sources_changed: Callable[[], Awaitable[None]] | None = None
        self.last_stats: DownloadStats | None = None  # of the latest download, even failed
        self.unreachable: Callable[[Sequence[str]], tuple[str, ...]] | None = None
        """Of the holders a super-seeding refusal named, those this node cannot reach
        (:class:`~shardcast.download.driver.DownloadDriver`'s ``unreachable``); set by a
        follower (None: none is named back, as an older node)."""

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
        sources_changed: Callable[[], Awaitable[None]] | None = None,
    ) -> tuple[Path, DownloadStats]:
        """Fetch every part and shard of ``manifest`` from ``sources``, verify, and commit.

        Args:
            manifest: the verified manifest (header at least); parts are added to it.
            sources: where to fetch from (at least one).
            on_partial: called once with the partial version (to serve it while it fills).
            on_shard: called after each verified shard or part (to wake downstream waiters).
            progress: called with (verified bytes, total bytes).
            extra_sources: polled every ``have_poll_s`` and when ``sources_changed``
                returns; new sources it returns join the download while fewer than
                ``max_extra_sources`` added this way are usable (not banned): the source set,
                its have-polls and their traffic stay bounded however many are discovered.
            max_extra_sources: bound on usable discovered sources in this download.
            upstreams: polled like ``extra_sources``; the configured upstreams reachable now.
                Those not yet in the download (one that recovered) join it, unbounded, and
                one whose URL changed (restarted elsewhere) is used at its new URL.
            sources_changed: returns when ``extra_sources`` may give something new (an
                advert heard); discovery then runs at once instead of at its next
                ``have_poll_s`` tick. None: the tick only.

        Returns:
            the committed ``step-N`` directory and the stats.

        Raises:
            DownloadFailed: with its :class:`~shardcast.core.liveness.Abandon` reason: the version
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
        self._sources_changed = sources_changed
        part, base_step = await self._begin(manifest)
        session = self._session(part, base_step is not None)
        stats = self.current = self.last_stats = session.stats
        try:
            if on_partial is not None:
                on_partial(part)
            with trio.fail_after(self.config.deadline_s):
                if base_step is not None:
                    with self.store.pinned(base_step):
                        base = BaseVersion(self.store, base_step)
                        try:
                            await self._drive(part, session, base, sources, on_shard, progress)
                        finally:
                            base.close()
                else:
                    await self._drive(part, session, None, sources, on_shard, progress)
            path = await self._commit(part, manifest.step, self.cpu)
        except trio.TooSlowError as exc:
            raise DownloadFailed(
                f"step {manifest.step} not complete after {self.config.deadline_s}s",
                Abandon.DEADLINE,
            ) from exc
        finally:
            self.current = None
            await self._leave_partial(part, manifest.step)
        stats.elapsed_s = trio.current_time() - started
        return path, stats

    async def _begin(self, manifest: Manifest) -> tuple[PartialVersion, int | None]:
        """Open the partial version and say which base deltas are taken against (None:
        none). With ``keep_chains`` the version is kept as a chain on that base (its blobs
        kept, the base not read), unless a chain of this very version was found broken at
        its blobs before (:attr:`~shardcast.store.chains.ChainReader.bad_deltas`); eager
        otherwise: a base kept as a chain is materialized first (its files are read), and
        dropped for raw shards if it does not verify."""
        base_step = self._usable_base(manifest)
        chain = (
            base_step is not None
            and self.config.keep_chains
            and manifest.rooted
            and manifest.digest not in self.store.chains.bad_deltas
        )
        if base_step is not None and not chain:
            try:
                await trio.to_thread.run_sync(self.store.materialize, base_step)
            except ChainBroken as exc:  # removed: fetch the shards raw
                log.warning("delta_base_broken step=%d error=%s", base_step, exc)
            base_step = self._usable_base(manifest)
        part = await trio.to_thread.run_sync(
            self.store.begin, manifest, base_step if chain else None
        )
        return part, base_step

    @staticmethod
    async def _commit(part: PartialVersion, step: int, cpu: StageCpu) -> Path:
        """Commit the complete version ``step`` (CPU charged to ``write``); returns its
        directory.

        Raises:
            DownloadFailed: ``store_lost``, the data directory vanished under us.
        """
        try:
            return await trio.to_thread.run_sync(cpu.wrap(Stage.WRITE, part.commit))
        except OSError as exc:
            raise DownloadFailed(
                f"step {step}: store lost at commit ({exc})", Abandon.STORE_LOST
            ) from exc

    def _usable_base(self, manifest: Manifest) -> int | None:
        """The step of ``manifest``'s delta base if deltas are on and the store holds that
        base (its step and digest); None: download the raw shards."""
        base_step = manifest.header.base_step
        base_digest = manifest.header.base_digest
        if (
            self.config.use_deltas
            and base_step is not None
            and base_digest is not None
            and self.store.holds(base_step, base_digest)
        ):
            return base_step
        return None

    async def _leave_partial(self, part: PartialVersion, step: int) -> None:
        """After a download that did not commit ``step``: remove the partial version, or,
        cancelled from outside with ``keep_partial``, close it for the next download to
        resume (shielded: it runs while cancelled)."""
        # cancelled from outside: the effective deadline of a cancelled scope is -inf
        cancelled = trio.current_effective_deadline() == -math.inf
        if not self.store.has(step):
            with trio.CancelScope(shield=True):
                if cancelled and self.config.keep_partial:
                    await trio.to_thread.run_sync(part.close)
                else:
                    await trio.to_thread.run_sync(part.abort)

    async def _drive(
        self,
        part: PartialVersion,
        session: Session,
        base: BaseVersion | None,
        sources: list[Source],
        on_shard: Callable[[int], None] | None,
        progress: ProgressFn | None,
    ) -> None:
        """Run the session's driver until it commits (return) or fails (raise).

        Raises:
            DownloadFailed: the session abandoned the download.
        """
        driver = DownloadDriver(
            self.client,
            part,
            session,
            base,
            trust=self.trust,
            bans=self.bans,
            observer=self.observer,
            stall_timeout_s=self.config.stall_timeout_s,
            have_poll_s=self.config.have_poll_s,
            extra_sources=self._extra,
            upstreams=self._upstreams,
            on_shard=on_shard,
            progress=progress,
            cpu=self.cpu,
            batcher=self.batcher,
            unreachable=self.unreachable,
            sources_changed=self._sources_changed,
        )
        end = await driver.run(sources)
        if isinstance(end, Fail):  # raised here, outside the nursery: a plain exception type
            raise DownloadFailed(end.text, end.reason)

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
            [offer(m.shard(i)) for i in known],
            [i for i in known if part.has(i)],  # kept from a previous run (journal)
            self.rng,
            scfg,
            trio.current_time(),
            signer=m.signed_header.signer,
        )
