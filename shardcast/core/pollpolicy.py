"""core: how often a follower polls an upstream, live or after the run finished (pure).

A follower that knows the run finished (:class:`shardcast.wire.finish.RunFinished`) and holds
its final version has nothing left to fetch: :func:`poll_delay` then stretches its upstream
polls and retries from seconds to minutes, so a node left serving after the run does not
retry a departed trainer every 10 s forever. Failed polls back off exponentially, capped.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PollPolicy", "poll_delay"]


@dataclass(frozen=True)
class PollPolicy:
    """Upstream poll and retry periods, seconds.

    Attributes:
        poll_interval_s: period of the info poll while the run is live.
        max_backoff_s: cap of the retry backoff while the run is live.
        finished_poll_interval_s: poll period once the run finished and its final version
            is held.
        finished_max_backoff_s: retry backoff cap in that state.
    """

    poll_interval_s: float = 1.0
    max_backoff_s: float = 10.0
    finished_poll_interval_s: float = 60.0
    finished_max_backoff_s: float = 600.0


def poll_delay(policy: PollPolicy, failures: int, settled: bool) -> float:
    """Seconds to wait before the next poll of one upstream (pure).

    Args:
        policy: the periods.
        failures: consecutive failed polls of this upstream (0: the last one worked).
        settled: the run finished and this node holds its final version.
    """
    base = policy.finished_poll_interval_s if settled else policy.poll_interval_s
    cap = policy.finished_max_backoff_s if settled else policy.max_backoff_s
    if failures <= 0:
        return base
    return float(min(base * 2 ** min(failures - 1, 32), max(cap, base)))
