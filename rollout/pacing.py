"""Pacing a peer's batch: when to stop generating groups and hand over what is done, sans-IO.

Theory of operation
-------------------
A peer generates a batch for version ``s`` one group (one prompt, ``group_size`` samples) at a
time. Before each group it asks :func:`next_group`, which answers with a :class:`Pace`:

* ``COMPLETE`` — all ``n_prompts`` groups are done;
* ``NEWER_VERSION`` — a newer verified version is committed here: the groups done so far go
  to the trainer as a *partial batch* and the peer moves to the new version (rollouts of the
  newest weights are the freshest the peer can offer, and a batch handed over now is one step
  less stale than one finished later);
* ``TIME_BUDGET`` — the next group is expected to end after the batch's time budget: a slow
  peer hands over fewer groups rather than a batch that arrives outside the async window;
* ``RUN_FINISHED`` — the trainer's signed run end arrived: it trains on no more rollouts, so
  the batch under way is dropped (not sent) and no group more is generated, however many are
  done; a continuation of the run makes the peer generate for its newest version again;
* ``GENERATE`` — generate the next group.

Apart from a run end, at least one group is generated per version (a partial batch holds
``1 <= k <= n_prompts`` groups, those of the first ``k`` assigned prompts: :mod:`rollout.verify`
accepts exactly that, one batch per (submitter, step)), so a peer always makes progress however
fast versions come.
The rest of a cut batch is dropped, never sent later: that is what keeps exactly-once simple.

The time budget of a batch is ``(async_level + 1 - margin_steps) * step_interval_s``,
counted from when the peer committed the version: a batch for ``s`` is fresh until the trainer
publishes ``s + async_level + 1``, about ``(async_level + 1)`` step intervals after ``s``; the
margin covers the delay between the trainer publishing a version and this peer holding it, and
the hand-over. :class:`PaceMeter` supplies both estimates from what the peer itself observes:
the interval between the versions it commits (the trainer's cadence; median of recent
intervals, per step) and its own time per group (exponentially weighted mean). Until two
versions were seen, or one group was timed, there is no budget and only ``NEWER_VERSION``
cuts.

Times are seconds of one monotonic clock chosen by the caller (the peer uses
:func:`time.monotonic`: generation is real work, not protocol time).
"""

from __future__ import annotations

import enum
import itertools
import math
import statistics
from collections import deque
from dataclasses import dataclass

from p2p.errors import ConfigError


class Pace(enum.Enum):
    """What to do before the next group of a batch."""

    GENERATE = "generate"
    COMPLETE = "complete"
    NEWER_VERSION = "newer_version"
    TIME_BUDGET = "time_budget"
    RUN_FINISHED = "run_finished"


@dataclass(frozen=True)
class PacingConfig:
    """A peer's pacing settings.

    Attributes:
        enabled: cut batches (newer version, time budget); False: always ``n_prompts`` groups.
        margin_steps: steps of the async window kept in reserve by the time budget, ``>= 0``
            (see module docstring); ``>= async_level + 1`` leaves a budget of 0, i.e. one
            group per version.
        group_weight: weight of the newest group time in the running mean, in ``(0, 1]``.

    Raises:
        ConfigError: a field out of range.
    """

    enabled: bool = True
    margin_steps: float = 0.5
    group_weight: float = 0.3

    def __post_init__(self) -> None:
        if not self.margin_steps >= 0 or not math.isfinite(self.margin_steps):
            raise ConfigError(
                "pacing_margin_steps", f"must be finite and >= 0, got {self.margin_steps}"
            )
        if not 0 < self.group_weight <= 1:
            raise ConfigError("group_weight", f"must be in (0, 1]: {self.group_weight}")


def next_group(
    done: int,
    n_prompts: int,
    *,
    newer_version: bool,
    elapsed_s: float,
    budget_s: float | None,
    group_estimate_s: float | None,
    run_finished: bool = False,
) -> Pace:
    """Decide what to do before group ``done`` (0-based) of a batch of ``n_prompts``.

    Args:
        done: groups already generated for this batch, ``>= 0``.
        n_prompts: the run's prompts per batch, ``>= 1``.
        newer_version: a version newer than the batch's is committed on this peer.
        elapsed_s: seconds since the peer committed the batch's version.
        budget_s: the batch's time budget in seconds (:func:`batch_budget_s`), or None for
            no budget.
        group_estimate_s: expected seconds of one group, or None if unknown.
        run_finished: the trainer's run end is in force (it takes no more rollouts).

    Returns:
        ``RUN_FINISHED`` when ``run_finished`` (the batch is dropped); else ``COMPLETE``
        when ``done >= n_prompts``; ``GENERATE`` when ``done == 0`` (at least one group per
        version); else ``NEWER_VERSION``, ``TIME_BUDGET`` (when ``elapsed_s +
        group_estimate_s > budget_s``) or ``GENERATE``, in that order.
    """
    if run_finished:
        return Pace.RUN_FINISHED
    if done >= n_prompts:
        return Pace.COMPLETE
    if done == 0:
        return Pace.GENERATE
    if newer_version:
        return Pace.NEWER_VERSION
    if (
        budget_s is not None
        and group_estimate_s is not None
        and elapsed_s + group_estimate_s > budget_s
    ):
        return Pace.TIME_BUDGET
    return Pace.GENERATE


def batch_budget_s(
    step_interval_s: float | None, async_level: int, margin_steps: float
) -> float | None:
    """``max(0, async_level + 1 - margin_steps) * step_interval_s`` seconds, or None when the
    interval is unknown."""
    if step_interval_s is None:
        return None
    return max(0.0, async_level + 1 - margin_steps) * step_interval_s


class PaceMeter:
    """What a peer observes for pacing: when it committed each version, and its group times.

    Args:
        config: the pacing settings.
        window: versions (and so intervals) remembered, ``>= 2``.

    Not thread-safe (one generation loop owns it).
    """

    def __init__(self, config: PacingConfig, window: int = 9) -> None:
        self.config = config
        self._seen: dict[int, float] = {}
        self._order: deque[int] = deque(maxlen=max(2, window))
        self._group_s: float | None = None

    def version_seen(self, step: int, at_s: float) -> None:
        """Record that version ``step`` was committed here at ``at_s`` (first time only)."""
        if step in self._seen:
            return
        if len(self._order) == self._order.maxlen:
            self._seen.pop(self._order[0], None)
        self._order.append(step)
        self._seen[step] = at_s

    def trainer_resumed(self, step: int, at_s: float) -> None:
        """Start the clock again at ``at_s`` for version ``step``, the newest held here: the
        trainer paused (a finished run it continued, or a restart) and takes rollouts of
        ``step`` from now. The versions seen before the pause are forgotten, so neither the
        batch's budget nor the step interval counts the pause (until two versions are seen
        again, only a newer version cuts a batch)."""
        self._seen.clear()
        self._order.clear()
        self.version_seen(step, at_s)

    def seen_at(self, step: int, default: float) -> float:
        """When ``step`` was committed here, or ``default`` if it was not recorded."""
        return self._seen.get(step, default)

    def step_interval_s(self) -> float | None:
        """Median seconds per step between consecutively committed versions, or None."""
        steps = sorted(self._seen)
        rates = [
            (self._seen[b] - self._seen[a]) / (b - a)
            for a, b in itertools.pairwise(steps)
            if self._seen[b] > self._seen[a]
        ]
        return statistics.median(rates) if rates else None

    def group_done(self, seconds: float) -> None:
        """Record the time one group took to generate."""
        w = self.config.group_weight
        g = self._group_s
        self._group_s = seconds if g is None else (1 - w) * g + w * seconds

    @property
    def group_estimate_s(self) -> float | None:
        """Expected seconds of the next group (running mean), or None before the first."""
        return self._group_s

    def decide(
        self,
        done: int,
        n_prompts: int,
        *,
        step: int,
        newest: int,
        now_s: float,
        async_level: int,
        run_finished: bool = False,
    ) -> Pace:
        """:func:`next_group` for a batch of version ``step`` when ``newest`` is the newest
        committed version, at ``now_s``; pacing disabled: ``GENERATE`` until ``COMPLETE``
        (a run end still drops the batch: ``RUN_FINISHED``)."""
        if run_finished:
            return Pace.RUN_FINISHED
        if not self.config.enabled:
            return Pace.COMPLETE if done >= n_prompts else Pace.GENERATE
        return next_group(
            done,
            n_prompts,
            newer_version=newest > step,
            elapsed_s=now_s - self.seen_at(step, now_s),
            budget_s=batch_budget_s(self.step_interval_s(), async_level, self.config.margin_steps),
            group_estimate_s=self.group_estimate_s,
        )
