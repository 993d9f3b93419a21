"""core: when to abandon a download: a pure policy taking events and ``now``.

Theory of operation
-------------------
A download must always end: with a commit, or with a typed failure within a bound. The
downloader feeds a :class:`DownloadWatch` what happens (a source's answer about the version,
bytes arriving, whether work is in flight) and asks it for a verdict after every event and at
least every few hundred milliseconds. The watch says to abandon when

- **gone**: every known source has said the version is gone (HTTP ``404`` on a version route,
  confirmed by the source's ``/have``) or is unreachable, and this has lasted
  ``gone_grace_s`` (one upstream that has not started the version yet, or a blip, does not
  end a download); a ``404`` is never a usable answer;
- **no source**: for ``no_source_grace_s`` nothing could be asked of a source that might hold
  the version (all banned, blocked, gone);
- **no progress**: no byte of the version arrived for ``no_progress_s``, whatever the sources
  answer (a source answering ``503`` forever keeps requests "in flight" but delivers nothing).

A fourth reason, **superseded**, is decided by the follower with
:func:`shardcast.core.catchup.worth_finishing` (a newer version was announced and this one cannot be
the base of its delta chain); the reason enum is shared so that reports name one set.

The overall ``deadline_s`` remains the last bound, enforced by the caller with
``trio.fail_after``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Abandon(enum.Enum):
    """Why a download ended without a commit (the value is the log/metric string)."""

    GONE = "gone"
    NO_SOURCE = "no_source"
    NO_PROGRESS = "no_progress"
    SUPERSEDED = "superseded"
    DEADLINE = "deadline"
    STORE_LOST = "store_lost"


class Answer(enum.Enum):
    """What one source's answer says about whether it holds the version."""

    DELIVERED = "delivered"  # bytes or a part of the version arrived from it
    PRESENT = "present"  # it holds the version (``/have`` answered, or 503: not this shard now)
    GONE = "gone"  # 404 on a version route: it does not hold the version
    UNREACHABLE = "unreachable"  # no answer at all (connection refused, reset)


@dataclass
class _SourceView:
    gone_since: float | None = None  # start of the current run of GONE/UNREACHABLE answers
    said_gone: bool = False  # at least one GONE in that run (unreachable alone is not "gone")


@dataclass
class DownloadWatch:
    """Abandonment policy of one download (see module docstring). Pure: no I/O, no clock.

    Args:
        now: when the download started, seconds.
        no_source_grace_s: bound on a spell with nothing usable to ask, seconds.
        gone_grace_s: how long every source must have been gone, seconds.
        no_progress_s: bound on a spell without a byte of the version, seconds.
    """

    now: float
    no_source_grace_s: float
    gone_grace_s: float
    no_progress_s: float
    _sources: dict[str, _SourceView] = field(default_factory=dict)
    _last_usable: float = 0.0
    _last_progress: float = 0.0
    _n_gone: int = 0  # sources whose gone_since is set (all_gone_since is O(1) until all are)

    def __post_init__(self) -> None:
        self._last_usable = self._last_progress = self.now

    def add_source(self, source: str) -> None:
        """A source joined the download (it is presumed to hold the version)."""
        self._sources.setdefault(source, _SourceView())

    def on_answer(self, source: str, answer: Answer, now: float) -> None:
        """Record one answer of ``source`` about the version."""
        view = self._sources.setdefault(source, _SourceView())
        if answer in (Answer.GONE, Answer.UNREACHABLE):
            if view.gone_since is None:
                view.gone_since = now
                self._n_gone += 1
            view.said_gone = view.said_gone or answer is Answer.GONE
        elif view.gone_since is not None:
            view.gone_since, view.said_gone = None, False
            self._n_gone -= 1
        if answer is Answer.DELIVERED:
            self._last_progress = now

    def on_progress(self, now: float) -> None:
        """Bytes of the version arrived (or a part, or a shard verified)."""
        self._last_progress = now

    def quiet_for(self, now: float) -> float:
        """Seconds since the last byte, part or delivery of the version (or the start)."""
        return now - self._last_progress

    def gone(self, source: str) -> bool:
        """True if ``source``'s latest answers say it does not hold the version."""
        view = self._sources.get(source)
        return view is not None and view.gone_since is not None

    def all_gone_since(self) -> float | None:
        """When the last source went gone, if every source is gone and one said so."""
        if not self._sources or self._n_gone < len(self._sources):
            return None
        views = list(self._sources.values())
        if not any(v.said_gone for v in views):
            return None
        return max(v.gone_since for v in views if v.gone_since is not None)

    def tick(self, now: float, active: bool) -> None:
        """The driver's periodic report: ``active`` if requests are in flight or were just
        started (or parts are still awaited). Activity counts as usable only while some
        source may still hold the version."""
        if active and self.all_gone_since() is None:
            self._last_usable = now

    def verdict(self, now: float) -> Abandon | None:
        """The reason to abandon now, or None to go on."""
        since = self.all_gone_since()
        if since is not None and now - since >= self.gone_grace_s:
            return Abandon.GONE
        if now - self._last_usable > self.no_source_grace_s:
            return Abandon.NO_SOURCE
        if now - self._last_progress > self.no_progress_s:
            return Abandon.NO_PROGRESS
        return None

    def next_change(self, now: float) -> float:
        """Seconds until the verdict can change without a new event (for the driver's wait)."""
        times = [
            self._last_usable + self.no_source_grace_s,
            self._last_progress + self.no_progress_s,
        ]
        since = self.all_gone_since()
        if since is not None:
            times.append(since + self.gone_grace_s)
        return max(0.0, min(times) - now)
