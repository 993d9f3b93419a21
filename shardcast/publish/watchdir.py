"""publish: which ``WATCH/step-<N>/`` directories the standalone origin publishes, and which it
refused.

Theory of operation
-------------------
``shardnet origin --watch WATCH`` publishes the checkpoints another trainer writes: a directory
``WATCH/step-<N>/`` is ready once it holds the ready marker (``DONE``), which the trainer
writes last. :func:`ready_steps` lists the ready steps newer than the newest published one.

A trainer can get this wrong: the marker written before the files, a file still being written
or cut short, a weights file missing. Such a directory is refused before anything is signed
(:func:`shardcast.publish.layout.check_layout` checks the layout and that every safetensors file
is whole), logged once, and tried again only when the directory changes: :class:`RefusedSteps`
keeps, per refused step, the :func:`fingerprint` of its directory (each file's name, inode,
size and mtime: not its ctime, which the origin's own staging changes) when it was refused.
One bad directory therefore neither stops the origin nor gets published; newer steps are
published as they become ready (a refused step older than the newest published one is never
published: versions only go forward).

The run's end: the trainer writes the finished marker (``FINISHED``) into ``WATCH`` when it
has written its last step (after that step's ready marker). The origin looks for it before
each scan of ``WATCH`` and acts on it after publishing what the scan found, if it is still as
it was (else at the next scan): the steps made ready before the marker are out first, and a
marker removed while a new step was found does not end the run at that step. The origin
then signs the run's end at the newest published version
(:class:`~shardcast.wire.finish.RunFinished`: relays and peers log it, peers stop generating,
``--exit-on-finish`` peers exit). Removing the marker continues the run
(:class:`~shardcast.wire.finish.RunContinued`, resent until the next version is out), as a
trainer restarted with more steps does. :func:`end_action` decides which (pure); after a restart
the origin does not know which of the two followers hold, so it signs the one the marker says.

A published step's files must not change: the origin hard-links them from ``WATCH`` into its
store where it can, so a trainer that rewrites one in place changes the bytes the origin
serves, which no longer match the signed manifest (every follower refuses them as corrupt and
bans the origin). The origin keeps the :func:`fingerprint` of each version it published, on
disk too, and compares it at every scan and at start (:func:`changed_files`,
:class:`~shardcast.publish.published.PublishedFiles`); the changed files are re-hashed, and a
version whose bytes changed is quarantined (removed, no longer served; followers that hold it
still serve it) and said at ERROR.

:class:`RefusedSteps`, :func:`changed_files` and :func:`end_action` are pure (the caller lists
the files and checks the marker); memory is bounded by the refused steps newer than the newest
published one, and the fingerprints of the versions held.
"""

from __future__ import annotations

import enum
import os
import re
from collections.abc import Hashable
from pathlib import Path

__all__ = [
    "STEP_DIR",
    "EndAction",
    "RefusedSteps",
    "WatchChange",
    "WatchPresence",
    "changed_files",
    "end_action",
    "fingerprint",
    "ready_steps",
]

STEP_DIR = re.compile(r"step-(0|[1-9][0-9]*)")
"""A step directory's name: ``step-<N>``, ``N`` in decimal without leading zeros (the origin
names a step by its number: ``step-020`` would be step 20 read from ``step-20``)."""

_PADDED_STEP_DIR = re.compile(r"step-0[0-9]+")

Fingerprint = frozenset[tuple[str, int, int, int]]
"""``(name, inode, size, mtime_ns)`` of each file of a directory (:func:`fingerprint`)."""


def ready_steps(
    watch: Path, ready_marker: str, latest: int | None, padded: set[str] | None = None
) -> list[int]:
    """The steps newer than ``latest`` whose ``watch/step-<N>/`` holds ``ready_marker``, in
    step order (none while ``watch`` does not exist or cannot be read). Directories named
    with leading zeros (``step-020``) are not steps (:data:`STEP_DIR`): their names are added
    to ``padded`` if given, for the caller to say so."""
    ready = []
    try:
        entries = list(os.scandir(watch))
    except OSError:
        return []
    for entry in entries:
        if padded is not None and _PADDED_STEP_DIR.fullmatch(entry.name) and entry.is_dir():
            padded.add(entry.name)
        m = STEP_DIR.fullmatch(entry.name)
        if m and entry.is_dir() and (Path(entry.path) / ready_marker).exists():
            step = int(m.group(1))
            if latest is None or step > latest:
                ready.append(step)
    return sorted(ready)


def fingerprint(directory: Path) -> Fingerprint:
    """``(name, inode, size, mtime_ns)`` of each regular, not hidden file directly in
    ``directory`` (empty if it cannot be read): what a trainer changes when it writes a file
    again, in place or by rename (a hidden temp file counts once renamed). Blocking."""
    out = set()
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return frozenset()
    for entry in entries:
        try:
            if entry.is_file(follow_symlinks=False) and not entry.name.startswith("."):
                st = entry.stat(follow_symlinks=False)
                out.add((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError:
            continue  # vanished meanwhile
    return frozenset(out)


def changed_files(published: Fingerprint, now: Fingerprint) -> list[str]:
    """Names of the files of a published version whose ``(inode, size, mtime)`` differs now
    or that are gone (pure; files added since are not the version's and are ignored)."""
    current = {name: rest for name, *rest in now}
    return sorted(name for name, *rest in published if current.get(name) != rest)


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

    def steps(self) -> list[int]:
        """The refused steps, ascending."""
        return sorted(self._refused)

    def __len__(self) -> int:
        return len(self._refused)


class WatchChange(enum.Enum):
    """What :meth:`WatchPresence.seen` found changed about ``WATCH`` itself."""

    MISSING = "missing"  # not there at the first scan: the trainer has not created it yet
    FOUND = "found"  # there now, after it was missing or gone
    GONE = "gone"  # there before, not any more (moved, deleted, unmounted)


class WatchPresence:
    """Whether ``WATCH`` is there, scan after scan (pure): each change is reported once, so
    the origin says that it waits for a directory the trainer creates later (the README's
    order: origin first), and that a directory it watched went away, without a line per
    scan."""

    def __init__(self) -> None:
        self.present: bool | None = None  # None: not scanned yet
        self.padded_said: set[str] = set()

    def padded(self, names: set[str]) -> list[str]:
        """Of the zero-padded step directory names a scan found (:func:`ready_steps`), those
        not said yet, sorted (each is said once; the set is bounded by ``WATCH``'s
        entries)."""
        new = sorted(names - self.padded_said)
        self.padded_said |= names
        return new

    def seen(self, present: bool) -> WatchChange | None:
        """Record a scan's finding; returns the change to say, if any."""
        before, self.present = self.present, present
        if before is None:
            return None if present else WatchChange.MISSING
        if before == present:
            return None
        return WatchChange.FOUND if present else WatchChange.GONE


class EndAction(enum.Enum):
    """What the origin signs about the run's end after a scan of ``WATCH``."""

    NONE = "none"
    FINISH = "finish"  # sign RunFinished at the newest published version
    CONTINUE = "continue"  # sign RunContinued (and resend it until the next version)


def end_action(before: bool, after: bool, ended: bool | None, latest: int | None) -> EndAction:
    """Whether to end or continue the run after one pass over ``WATCH`` (pure).

    The marker is acted on only if it was the same before the pass's scan for ready steps
    and after the pass published what the scan found:

    - A trainer writes the marker after its last step's ready marker, so a marker seen
      before the scan comes after every step that scan finds. Seen only after it, a step
      made ready between the scan and the look was ended unpublished: its followers were
      told the run had ended at the step before (those with ``--exit-on-finish`` left
      without it), and the end was signed again once the step was published.
    - A restarted trainer removes the marker, then writes its next step. Seen only before
      the scan, a removal during the pass that found that step would end the run at it.

    Args:
        before: the finished marker was in ``WATCH`` before the pass's scan.
        after: it is there after the pass.
        ended: what this origin last signed: True a run end, False a continuation or a newer
            version (which lifts an end by itself), None not known (just started: followers
            may hold either).
        latest: the newest published step (None: none, so there is nothing to end).

    Returns:
        ``NONE`` when the marker came or went during the pass (the next pass decides);
        ``FINISH`` when it is there and the end is not known to be signed; ``CONTINUE`` when
        it is not there and an end may be in force; else ``NONE``.
    """
    if latest is None or before != after:
        return EndAction.NONE
    if after and ended is not True:
        return EndAction.FINISH
    if not after and ended is not False:
        return EndAction.CONTINUE
    return EndAction.NONE
