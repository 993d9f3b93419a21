"""Download progress: a live display on a terminal (rich), periodic log lines otherwise.

On a terminal, one bar per version in progress (percent, size, rate, ETA) on stderr; a
finished version's bar is removed (the follower logs one ``version_downloaded`` line for it),
so the display never grows past the versions actually in flight. Off a terminal, one
``download_progress`` log line per version in progress every ``log_interval_s`` seconds.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TimeRemainingColumn,
    TransferSpeedColumn,
)

log = logging.getLogger(__name__)


class DownloadProgress:
    """``progress(step, verified_bytes, total_bytes)`` callback (see module docstring).

    Args:
        force: draw the live display even when stderr is not a terminal.
        log_interval_s: period of the progress log lines off a terminal, seconds.
        clock: monotonic clock in seconds (tests).

    Use as a context manager around the node's lifetime.
    """

    def __init__(
        self,
        force: bool = False,
        log_interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.live = force or sys.stderr.isatty()
        self.log_interval_s = log_interval_s
        self.clock = clock
        self._progress = (
            Progress(
                "[bold]step {task.fields[step]}",
                BarColumn(),
                "[progress.percentage]{task.percentage:>3.0f}%",
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            if self.live
            else None
        )
        self._tasks: dict[int, TaskID] = {}
        self._started: dict[int, float] = {}
        self._last_log: dict[int, float] = {}

    def __enter__(self) -> DownloadProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def __call__(self, step: int, done: int, total: int) -> None:
        finished = done >= total
        if self._progress is not None:
            if step not in self._tasks:
                self._tasks[step] = self._progress.add_task("", total=total, step=step)
            if finished:
                self._progress.remove_task(self._tasks.pop(step))
            else:
                self._progress.update(self._tasks[step], completed=done)
            return
        now = self.clock()
        start = self._started.setdefault(step, now)
        if finished:
            self._started.pop(step, None)
            self._last_log.pop(step, None)
            return
        if now - self._last_log.get(step, start) < self.log_interval_s:
            return
        self._last_log[step] = now
        elapsed = now - start
        rate = done / elapsed if elapsed > 0 else 0.0
        log.info(
            "download_progress step=%d percent=%.1f verified_bytes=%d total_bytes=%d "
            "rate_bytes_per_s=%.0f eta_s=%s",
            step,
            100.0 * done / total if total else 100.0,
            done,
            total,
            rate,
            f"{(total - done) / rate:.1f}" if rate > 0 else "unknown",
        )
