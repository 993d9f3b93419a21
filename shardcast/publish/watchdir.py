"""publish: which ``WATCH/step-<N>/`` directories the standalone origin publishes, and which it
refused.

Theory of operation
-------------------
``shardnet origin --watch WATCH`` publishes the checkpoints another trainer writes: a directory
``WATCH/step-<N>/`` is ready once it holds the ready marker (``DONE``), which the trainer
writes last. :func:`ready_steps` lists the ready steps newer than the newest published one.

A trainer can get this wrong: the marker written before the files, a file still being written
or cut short, a weights file missing. Such a directory is refused before anything is signed
(:func:`shardcast.publish.plan.check_layout` checks the layout and that every safetensors file
is whole), logged once, and tried again only when the directory changes: :class:`RefusedSteps`
keeps, per refused step, the :func:`fingerprint` of its directory (each file's name, inode,
size and mtime: not its ctime, which the origin's own staging changes) when it was refused.
One bad directory therefore neither stops the origin nor gets published; newer steps are
published as they become ready (a refused step older than the newest published one is never
published: versions only go forward).

:class:`RefusedSteps` is pure (the caller lists the files); memory is bounded by the refused
steps newer than the newest published one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Hashable
from pathlib import Path

__all__ = ["RefusedSteps", "fingerprint", "ready_steps"]

_STEP_DIR = re.compile(r"step-(\d+)")


def ready_steps(watch: Path, ready_marker: str, latest: int | None) -> list[int]:
    """The steps newer than ``latest`` whose ``watch/step-<N>/`` holds ``ready_marker``, in
    step order (none while ``watch`` does not exist or cannot be read)."""
    ready = []
    try:
        entries = list(os.scandir(watch))
    except OSError:
        return []
    for entry in entries:
        m = _STEP_DIR.fullmatch(entry.name)
        if m and entry.is_dir() and (Path(entry.path) / ready_marker).exists():
            step = int(m.group(1))
            if latest is None or step > latest:
                ready.append(step)
    return sorted(ready)


def fingerprint(directory: Path) -> frozenset[tuple[str, int, int, int]]:
    """``(name, inode, size, mtime_ns)`` of each regular file directly in ``directory``
    (empty if it cannot be read): what a trainer changes when it writes a file again, in
    place or by rename. Blocking."""
    out = set()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return frozenset()
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False):
                st = entry.stat(follow_symlinks=False)
                out.add((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            continue  # vanished meanwhile
    return frozenset(out)


class RefusedSteps:
    """Steps whose directory was refused, each with what its files were then (any hashable
    fingerprint, e.g. :func:`fingerprint`)."""

    def __init__(self) -> None:
        self._refused: dict[int, Hashable] = {}

    def should_try(self, step: int, fingerprint: Hashable) -> bool:
        """True unless ``step`` was refused and its files are as they were then."""
        return self._refused.get(step) != fingerprint

    def refused(self, step: int, fingerprint: Hashable) -> None:
        """Remember that ``step`` was refused with its files at ``fingerprint``."""
        self._refused[step] = fingerprint

    def published(self, step: int) -> None:
        """``step`` is out: forget it and every older refused step (never published now)."""
        for s in [s for s in self._refused if s <= step]:
            del self._refused[s]

    def __len__(self) -> int:
        return len(self._refused)
