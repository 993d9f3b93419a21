"""Download progress on a terminal, like a torrent client (rich), and nothing when piped."""

from __future__ import annotations

import sys
from types import TracebackType

from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    TaskID,
    TimeRemainingColumn,
    TransferSpeedColumn,
)


class DownloadProgress:
    """``progress(step, verified_bytes, total_bytes)`` callback drawing one bar per version.

    Draws only when stderr is a terminal (or ``force``); otherwise every call is a no-op.
    Use as a context manager around the node's lifetime.
    """

    def __init__(self, force: bool = False) -> None:
        self.enabled = force or sys.stderr.isatty()
        self._progress = (
            Progress(
                "[bold]step {task.fields[step]}",
                BarColumn(),
                "[progress.percentage]{task.percentage:>3.0f}%",
                DownloadColumn(),
                TransferSpeedColumn(),
                TimeRemainingColumn(),
                transient=False,
            )
            if self.enabled
            else None
        )
        self._tasks: dict[int, TaskID] = {}

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
        if self._progress is None:
            return
        if step not in self._tasks:
            self._tasks[step] = self._progress.add_task("", total=total, step=step)
        self._progress.update(self._tasks[step], completed=done)
