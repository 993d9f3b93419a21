"""Progress of a running simulation: a live line on a terminal, periodic log lines otherwise.

``shardnet simulate model`` may run for minutes over thousands of nodes and ``emulate`` for as
long as its checkpoints take to spread; both report, while they run, how far they got: the
simulated time reached (virtual seconds for the model, seconds since the first publication for
the emulation), versions published, how many peers hold the latest published version, and the
wall time spent.

The caller asks :meth:`SimProgress.due` often (it is one clock read) and computes the figures
only when it returns True, so a model over thousands of nodes pays O(nodes) a few times a second
at most. On a terminal a transient rich line on stderr is redrawn every ``refresh_s``; off a
terminal one ``simulate_progress`` log line is written every ``log_interval_s``.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType

from rich.console import Console
from rich.live import Live
from rich.text import Text

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Snapshot:
    """Where a simulation stands.

    Attributes:
        sim_s: simulated time reached, seconds (virtual for the model).
        published: versions published so far.
        versions: versions the run will publish.
        latest_step: step of the latest published version (-1: none yet).
        peers_at_latest: peers that committed ``latest_step`` (or a later one).
        peers: live peers.
    """

    sim_s: float
    published: int
    versions: int
    latest_step: int
    peers_at_latest: int
    peers: int


class SimProgress:
    """Progress display of one simulation run (see module docstring); a context manager.

    Args:
        mode: ``model`` or ``emulate`` (shown and logged).
        force_live: True/False forces the live line on/off; None: on when stderr is a terminal.
        log_interval_s: period of the log lines off a terminal, seconds of wall time.
        refresh_s: period of the live line's redraw on a terminal, seconds of wall time.
        clock: monotonic wall clock in seconds (tests).
        console: where the live line goes (default: stderr).
    """

    def __init__(
        self,
        mode: str,
        force_live: bool | None = None,
        log_interval_s: float = 10.0,
        refresh_s: float = 0.25,
        clock: Callable[[], float] = time.monotonic,
        console: Console | None = None,
    ) -> None:
        self.mode = mode
        self.clock = clock
        self.live = sys.stderr.isatty() if force_live is None else force_live
        self.period_s = refresh_s if self.live else log_interval_s
        self.started = clock()
        self._next = self.started + self.period_s
        self._live = (
            Live(
                Text(""),
                console=console or Console(stderr=True),
                transient=True,
                auto_refresh=False,
            )
            if self.live
            else None
        )
        self.updates = 0

    def __enter__(self) -> SimProgress:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._live is not None:
            self._live.stop()

    def due(self) -> bool:
        """True when a new :meth:`update` would be shown (one clock read; call it often)."""
        return self.clock() >= self._next

    def line(self, s: Snapshot) -> str:
        """The live line's text for ``s``."""
        wall = self.clock() - self.started
        clock = "virtual" if self.mode == "model" else "elapsed"
        at = f"step {s.latest_step}" if s.latest_step >= 0 else "latest"
        return (
            f"{self.mode}: {clock} {s.sim_s:,.1f} s · published {s.published}/{s.versions}"
            f" · peers at {at}: {s.peers_at_latest}/{s.peers} · wall {wall:,.1f} s"
        )

    def update(self, s: Snapshot) -> None:
        """Show ``s`` (live line or log line) and schedule the next update."""
        now = self.clock()
        self._next = now + self.period_s
        self.updates += 1
        if self._live is not None:
            self._live.update(Text(self.line(s), no_wrap=True, overflow="ellipsis"), refresh=True)
            return
        log.info(
            "simulate_progress mode=%s sim_s=%.1f versions_published=%d versions=%d "
            "latest_step=%d peers_committed_latest=%d peers=%d wall_s=%.1f",
            self.mode,
            s.sim_s,
            s.published,
            s.versions,
            s.latest_step,
            s.peers_at_latest,
            s.peers,
            now - self.started,
        )
