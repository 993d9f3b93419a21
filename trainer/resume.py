"""The trainer's resumable state: fp32 master weights and optimizer state, one per version.

Theory of operation
-------------------
Published versions are bf16 (what peers load); a trainer that is to resume needs its float32
master weights and its optimizer's state (AdamW moments) too. Before version ``k`` is
published, :func:`save_state` writes them to ``<data_dir>/trainer-state/step-<k>/`` (beside
the version store, never inside a published checkpoint):

* ``state.pt`` — ``torch.save`` of ``{"model": state_dict, "optimizer": state_dict,
  "torch_rng": ...}`` (fp32);
* ``state.json`` — what the state belongs to (run id, preset, seed, optimizer, step).

Files go into a hidden temporary directory, are fsynced, and the directory is renamed into
place and its parent fsynced: a crash leaves either no ``step-<k>`` or a complete one, and a
leftover temporary directory is removed on the next start. After version ``k`` is committed,
older states are removed (:func:`prune_states`): resuming needs only the newest.

On start, :func:`plan_resume` compares the newest committed version ``L`` in the store with
the saved states:

======================  ==========================================================
store / states           plan
======================  ==========================================================
nothing / nothing        ``FRESH``: publish version 0
``L`` / newest ``L``     ``RESUME``: load state ``L``, re-announce ``L``, train ``L+1``
``L`` / newest ``L+1``   ``REPUBLISH``: the trainer stopped between saving state ``L+1``
                         and committing version ``L+1``; load it and publish ``L+1`` from
                         the very same weights (nothing of ``L+1`` was committed)
anything else            ``INCONSISTENT``: refuse to start (the step numbers would be
                         reused with other weights)
======================  ==========================================================

So a step number is never committed twice with different weights.
"""

from __future__ import annotations

import enum
import json
import os
import pickle
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from p2p.errors import ConfigError

__all__ = [
    "STATE_DIR",
    "ResumeKind",
    "ResumePlan",
    "check_state",
    "load_state",
    "plan_resume",
    "prune_states",
    "save_state",
    "saved_steps",
]

STATE_DIR = "trainer-state"
_STATE_FILE = "state.pt"
_META_FILE = "state.json"


class ResumeKind(enum.Enum):
    """What a starting trainer does (see module docstring)."""

    FRESH = "fresh"
    RESUME = "resume"
    REPUBLISH = "republish"
    INCONSISTENT = "inconsistent"


@dataclass(frozen=True)
class ResumePlan:
    """A start decision.

    Attributes:
        kind: the decision.
        step: the state to load (RESUME, REPUBLISH), else -1.
        published: newest committed version in the store, or None.
        detail: why (INCONSISTENT), for the operator.
    """

    kind: ResumeKind
    step: int = -1
    published: int | None = None
    detail: str = ""


def plan_resume(published: int | None, states: Sequence[int]) -> ResumePlan:
    """Decide how to start from the newest committed version and the saved states (pure).

    Args:
        published: newest committed step in the trainer's store, or None.
        states: steps with a saved trainer state, any order.
    """
    newest = max(states) if states else None
    if published is None:
        if newest is None:
            return ResumePlan(ResumeKind.FRESH)
        if newest == 0:
            return ResumePlan(ResumeKind.REPUBLISH, 0, None)
        return ResumePlan(
            ResumeKind.INCONSISTENT,
            published=None,
            detail=f"trainer state for step {newest} but no committed version",
        )
    if newest == published:
        return ResumePlan(ResumeKind.RESUME, published, published)
    if newest == published + 1:
        return ResumePlan(ResumeKind.REPUBLISH, newest, published)
    have = "no trainer state" if newest is None else f"trainer state for step {newest}"
    return ResumePlan(
        ResumeKind.INCONSISTENT,
        published=published,
        detail=f"versions up to step {published} are committed but there is {have}",
    )


def _root(data_dir: Path) -> Path:
    return data_dir / STATE_DIR


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def saved_steps(data_dir: Path) -> list[int]:
    """Steps with a complete saved state, ascending; removes leftover temporary directories."""
    root = _root(data_dir)
    if not root.is_dir():
        return []
    out = []
    for p in root.iterdir():
        if p.name.startswith("."):
            shutil.rmtree(p, ignore_errors=True)  # interrupted save or prune
        elif p.name.startswith("step-") and p.name[5:].isdigit() and (p / _META_FILE).is_file():
            out.append(int(p.name[5:]))
    return sorted(out)


def save_state(
    data_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
) -> Path:
    """Save the trainer state that version ``step`` is published from (atomic, durable).

    Args:
        data_dir: the trainer's data directory.
        step: the version these weights are.
        model, optimizer: the fp32 master model and its optimizer.
        meta: identifies the run (run id, preset, seed, optimizer); checked by
            :func:`load_state`.

    Returns:
        the state directory.

    Blocking (run it in a worker thread). An existing state for ``step`` is replaced.
    """
    root = _root(data_dir)
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "torch_rng": torch.get_rng_state(),
        },
        tmp / _STATE_FILE,
    )
    (tmp / _META_FILE).write_text(json.dumps({**meta, "step": step}, sort_keys=True))
    for name in (_STATE_FILE, _META_FILE):
        _fsync(tmp / name)
    _fsync(tmp)
    final = root / f"step-{step}"
    if final.exists():
        victim = root / f".old-step-{step}-{os.getpid()}"
        os.rename(final, victim)
        shutil.rmtree(victim, ignore_errors=True)
    os.rename(tmp, final)
    _fsync(root)
    return final


def check_state(data_dir: Path, step: int, meta: dict[str, Any]) -> None:
    """Check that the saved state of ``step`` belongs to this run (cheap: no tensors read).

    Raises:
        ConfigError: another run, preset, seed or optimizer (field ``data_dir``), or
            unreadable.
    """
    d = _root(data_dir) / f"step-{step}"
    try:
        saved = json.loads((d / _META_FILE).read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("data_dir", f"cannot read trainer state {d}: {exc}") from exc
    for key, want in meta.items():
        if saved.get(key) != want:
            raise ConfigError(
                "data_dir",
                f"{d} holds trainer state with {key}={saved.get(key)!r}, this run has "
                f"{want!r}; use another --data-dir or the same settings",
            )


def load_state(
    data_dir: Path,
    step: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    meta: dict[str, Any],
) -> None:
    """Load the state of ``step`` into ``model`` and ``optimizer``.

    Raises:
        ConfigError: see :func:`check_state`; or the tensors cannot be read or loaded.
    """
    check_state(data_dir, step, meta)
    d = _root(data_dir) / f"step-{step}"
    try:
        blob = torch.load(d / _STATE_FILE, map_location="cpu", weights_only=True)
        model.load_state_dict(blob["model"])
        optimizer.load_state_dict(blob["optimizer"])
        torch.set_rng_state(blob["torch_rng"])
    except (OSError, ValueError, KeyError, RuntimeError, EOFError, pickle.UnpicklingError) as exc:
        raise ConfigError("data_dir", f"cannot load trainer state {d}: {exc}") from exc


def prune_states(data_dir: Path, keep_from: int) -> list[int]:
    """Remove saved states of steps below ``keep_from``; returns the removed steps."""
    root = _root(data_dir)
    removed = []
    for step in saved_steps(data_dir):
        if step < keep_from:
            victim = root / f".removing-step-{step}"
            os.rename(root / f"step-{step}", victim)
            shutil.rmtree(victim, ignore_errors=True)
            removed.append(step)
    return removed
