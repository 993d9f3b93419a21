"""How late this node's own event loop runs, and request-body deadlines that do not count it.

Theory of operation
-------------------
A node charges a remote peer ``slow_request`` when a request body does not arrive within
``request_read_timeout_s`` (:mod:`p2p.limits`). On a host whose cores are saturated (several
nodes on one machine, hashing and writing checkpoints) the body has often arrived at the socket
in time but this node's own event loop has not run to decrypt and demultiplex it: the delay is
ours, and charging an honest peer for it can end in a ban. This module measures that delay and
keeps it out of the deadline.

:class:`LoopLag` is fed by a driver task that asks to wake at ``due`` and records when it really
woke (``now``); ``now - due`` is how late the loop ran. It keeps the cumulative lag (a counter,
seconds) and the lags of the last ticks (bounded).

:class:`BodyDeadlines` holds the request bodies being read: a body's *own time* is the wall time
since its read began minus the loop's lateness over the same span (the part of each late
wake-up after the read began). A body is overdue when its own time reaches the timeout, and in
any case when its wall time reaches ``max_factor`` times the timeout (so a loop that is always
late still frees its slots). The driver feeds it the same ticks and cancels the reads that
:meth:`BodyDeadlines.tick` returns. A peer that sends
nothing is charged as before, only measured in this node's responsive time.

Both classes are pure (``now`` is an argument, no I/O) and not thread-safe: one event loop
drives them. Times are seconds on any one monotonic clock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from dataclasses import dataclass

from p2p.errors import ConfigError


class LoopLag:
    """Cumulative and recent lateness of an event loop.

    Args:
        keep: how many recent ticks to remember (bounds memory; >= 1).

    Raises:
        ConfigError: ``keep`` < 1.
    """

    def __init__(self, keep: int = 600) -> None:
        if keep < 1:
            raise ConfigError("keep", "must be >= 1")
        self.total_s = 0.0
        """Sum of every tick's lag since creation, seconds (only grows)."""
        self.ticks = 0
        self._recent: deque[tuple[float, float]] = deque(maxlen=keep)  # (now, lag_s)

    def tick(self, due: float, now: float) -> float:
        """Record a wake-up asked for ``due`` that happened at ``now``.

        Returns:
            this tick's lag, ``max(0, now - due)`` seconds.
        """
        lag = max(0.0, now - due)
        self.total_s += lag
        self.ticks += 1
        self._recent.append((now, lag))
        return lag

    def worst(self, now: float, window_s: float) -> float:
        """Largest lag of the ticks that woke in ``(now - window_s, now]``, seconds (0 if none)."""
        return max((lag for t, lag in self._recent if now - window_s < t <= now), default=0.0)


@dataclass
class _Read:
    started: float
    lag_s: float = 0.0  # the loop's lateness since ``started``


class BodyDeadlines:
    """Request bodies being read, and which of them are overdue in this node's own time.

    Args:
        timeout_s: how long a body may take, seconds of this node's responsive time (> 0).
        max_factor: a body is overdue after ``max_factor * timeout_s`` of wall time whatever
            the lag (>= 1).

    Raises:
        ConfigError: a bound out of range.
    """

    def __init__(self, timeout_s: float, max_factor: float = 5.0) -> None:
        if not timeout_s > 0:
            raise ConfigError("request_read_timeout_s", "must be > 0")
        if not max_factor >= 1:
            raise ConfigError("max_factor", "must be >= 1")
        self.timeout_s = timeout_s
        self.max_factor = max_factor
        self._reads: dict[Hashable, _Read] = {}

    def __len__(self) -> int:
        return len(self._reads)

    def begin(self, key: Hashable, now: float) -> None:
        """A body read identified by ``key`` starts at ``now`` (a key already open restarts)."""
        self._reads[key] = _Read(now)

    def end(self, key: Hashable) -> None:
        """The read of ``key`` ended (read, failed or cancelled); unknown keys are ignored."""
        self._reads.pop(key, None)

    def tick(self, due: float, now: float) -> list[Hashable]:
        """The loop woke at ``now`` for a wake-up asked for ``due``: charge the lateness
        ``[due, now]`` to each open read for the part of it after the read began, then return
        the overdue reads (own time >= ``timeout_s``, or wall time >= ``max_factor *
        timeout_s``), oldest first. They stay open until :meth:`end`."""
        cap = self.max_factor * self.timeout_s
        out: list[Hashable] = []
        for key, read in self._reads.items():
            if now > due:
                read.lag_s += max(0.0, now - max(due, read.started))
            if now - read.started >= cap or self._own(read, now) >= self.timeout_s:
                out.append(key)
        return out

    def own_time(self, key: Hashable, now: float) -> float:
        """Seconds of ``key``'s read that this node's loop was responsive for (>= 0), as of
        the last :meth:`tick`'s lag.

        Raises:
            KeyError: ``key`` is not being read.
        """
        return self._own(self._reads[key], now)

    @staticmethod
    def _own(read: _Read, now: float) -> float:
        return max(0.0, (now - read.started) - read.lag_s)
