"""core: how often a follower polls an upstream, live or after the run finished (pure).

A follower that knows the run finished (:class:`shardcast.wire.finish.RunFinished`) and holds
its final version has nothing left to fetch: :func:`poll_delay` then stretches its upstream
polls and retries from seconds to minutes, so a node left serving after the run does not
retry a departed trainer every 10 s forever. Failed polls back off exponentially, capped.

A *watched* upstream (:class:`VersionWatch`: this node holds a long-poll of its
``/versions`` list, answered the moment a version is added there) is polled every
``watched_poll_interval_s`` instead of every ``poll_interval_s``, and at once when the
watch sees a change: it is heard as soon as it adds a version (sooner than a poll every
second), and a waiting follower sends one held HTTP request per hold instead of a libp2p
info request per second (each a new stream: its negotiation and frames were ~40 % of an
idle follower's CPU, ``bench/follower_cpu.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PollPolicy", "VersionWatch", "WatchStep", "poll_delay"]


@dataclass(frozen=True)
class PollPolicy:
    """Upstream poll and retry periods, seconds.

    Attributes:
        poll_interval_s: period of the info poll while the run is live.
        max_backoff_s: cap of the retry backoff while the run is live.
        finished_poll_interval_s: poll period once the run finished and its final version
            is held.
        finished_max_backoff_s: retry backoff cap in that state.
        watched_poll_interval_s: poll period of an upstream whose ``/versions`` this node
            long-polls (:class:`VersionWatch`), while the run is live.
    """

    poll_interval_s: float = 1.0
    max_backoff_s: float = 10.0
    finished_poll_interval_s: float = 60.0
    finished_max_backoff_s: float = 600.0
    watched_poll_interval_s: float = 10.0


def poll_delay(policy: PollPolicy, failures: int, settled: bool, watched: bool = False) -> float:
    """Seconds to wait before the next poll of one upstream (pure).

    Args:
        policy: the periods.
        failures: consecutive failed polls of this upstream (0: the last one worked).
        settled: the run finished and this node holds its final version.
        watched: a long-poll of the upstream's ``/versions`` is held (:class:`VersionWatch`),
            which wakes the poller when that list changes.
    """
    if settled:
        base = policy.finished_poll_interval_s
    elif watched:
        base = max(policy.poll_interval_s, policy.watched_poll_interval_s)
    else:
        base = policy.poll_interval_s
    cap = policy.finished_max_backoff_s if settled else policy.max_backoff_s
    if failures <= 0:
        return base
    return float(min(base * 2 ** min(failures - 1, 32), max(cap, base)))


@dataclass(frozen=True)
class WatchStep:
    """What a :class:`VersionWatch` does after an answer or a failure.

    Attributes:
        wake: poll the upstream's info record now (its list of versions changed, or the
            watch failed: the poll finds out whether the upstream is still there).
        again_s: ask again after this long, seconds; None: stop watching (the upstream
            does not hold these requests: an older node).
    """

    wake: bool
    again_s: float | None


class VersionWatch:
    """The decisions of one long-poll of an upstream's ``/versions`` (pure; the follower
    does the requests, :mod:`shardcast.download.versionwatch`).

    ``token`` is the last answer's :func:`~shardcast.wire.have.versions_token` (sent back as
    ``?known=``); ``watching`` is True while the last request was answered by a node that
    holds such requests (the poller then uses ``watched_poll_interval_s``).

    Args:
        policy: the periods (a failing watch retries like a failing poll).
        min_gap_s: shortest time between two requests, seconds: an upstream that answers
            at once with a new list each time costs at most one request (and one info poll)
            per ``min_gap_s``.
    """

    def __init__(self, policy: PollPolicy, min_gap_s: float = 0.05) -> None:
        self.policy = policy
        self.min_gap_s = min_gap_s
        self.token: str | None = None
        self.watching = False
        self.failures = 0

    def answered(self, token: str, holds: bool) -> WatchStep:
        """An answer listing versions whose token is ``token``; ``holds``: it says how long
        its node holds these requests."""
        changed = self.token is not None and token != self.token
        self.token, self.failures = token, 0
        self.watching = holds
        return WatchStep(changed, self.min_gap_s if holds else None)

    def failed(self, settled: bool) -> WatchStep:
        """The request failed (unreachable, broken, a malformed answer): not watching until
        an answer comes; wake the poller once, retry with the poll's backoff."""
        self.failures += 1
        wake = self.watching
        self.watching = False
        return WatchStep(wake, poll_delay(self.policy, self.failures, settled))
