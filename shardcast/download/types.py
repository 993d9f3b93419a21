"""download: the types a download is described with, shared by the downloader and its driver.

:class:`Source` (where to fetch from), :class:`DownloadConfig` (settings),
:class:`DownloadObserver` and :data:`ProgressFn` (what is told of progress) and
:class:`DownloadFailed` (how a download ends without a commit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from p2p.errors import ShardnetError
from shardcast.core import Abandon, SchedulerConfig

__all__ = ["DownloadConfig", "DownloadFailed", "DownloadObserver", "ProgressFn", "Source"]


class DownloadFailed(ShardnetError):
    """A version could not be downloaded (see :class:`~shardcast.core.liveness.Abandon`).

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
        anonymous: requests to it are unsigned (a static mirror, :mod:`shardcast.serve.mirror`:
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
        keep_chains: commit a version received as deltas against a base held here as a
            chain (its verified blobs; no base read, no full file written,
            :mod:`shardcast.store.chains`); False: build every file at once (eager, as before
            chains; for comparison).
        materialize_every: a chain this many links above a full version is materialized in
            the background after its commit (an anchor: chains stay short, old bases can be
            pruned); 0: only on demand.
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
    keep_chains: bool = True
    materialize_every: int = 8


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

    def transfer_cut(self, source: str) -> None:
        """A transfer from ``source`` was cut as overdue (a measured source was expected to
        deliver the rest several times sooner: :meth:`~shardcast.core.select.Scheduler.overdue`)
        and resumed elsewhere."""
        ...
