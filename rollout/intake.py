"""The trainer's intake decisions, sans-IO: exactly once per submitter, fair staleness, and
acceptance reported per submitter and by rollout length.

Theory of operation
-------------------
A batch is named by ``(submitter PeerID, payload digest)`` (:data:`BatchKey`); its announced
id binds both (:func:`rollout.schema.batch_id_for`). Every decision the trainer makes — an
ack remembered for exactly-once, a fetch in flight, a verdict — is stored under that key, so
another submitter announcing the same bytes (a copy seen on gossip) names a different batch and
can neither pre-empt nor poison the honest one, while a replay by the same submitter is still
the same batch and gets the remembered answer.

Staleness is judged by :func:`judge_staleness` on the policy lag ``current - step``:

* ``lag < 0`` (the batch is for a version the trainer does not count as current yet, a race
  between its own announcement and its clock): ``AHEAD``, answered *retry*, nothing remembered;
* ``0 <= lag <= async_level``: ``FRESH``;
* ``async_level < lag <= async_level + grace_steps``: ``LATE``, a bounded grace for rollouts
  that were already being generated when the window moved — admitted, counted apart, and kept
  in the training buffer for as long as ``FRESH`` ones are (the same bound in both places);
* beyond: ``TOO_OLD``, rejected as ``stale_step``. Arriving late is not a fault: the reputation
  penalty of ``stale_step`` is zero (:mod:`rollout.reputation`), and the refusal is about this
  batch only.

:class:`IntakeLedger` counts, per submitter and per rollout-length bucket (mean completion
tokens per sample, rounded up to a power of two), how many batches were decided, accepted and
finally trained on, so an operator (and the fairness test) can see whether long rollouts are
systematically lost.
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

BatchKey = tuple[str, str]
"""``(submitter PeerID, payload BLAKE3 hex digest)``: the identity of a batch."""

UNFETCHED = "unfetched"
"""Length bucket of batches decided before their payload was fetched (length unknown)."""


class Staleness(enum.Enum):
    """Where a batch's policy step falls relative to the trainer's current step."""

    AHEAD = "ahead"
    FRESH = "fresh"
    LATE = "late"
    TOO_OLD = "too_old"


def judge_staleness(step: int, current: int, async_level: int, grace_steps: int) -> Staleness:
    """Classify a batch generated with ``step``'s weights while the trainer is at ``current``.

    Args:
        step: the batch's policy step.
        current: the trainer's current policy step.
        async_level: steps of lag always admitted (``>= 0``).
        grace_steps: extra steps of lag admitted as ``LATE`` (``>= 0``).
    """
    lag = current - step
    if lag < 0:
        return Staleness.AHEAD
    if lag <= async_level:
        return Staleness.FRESH
    if lag <= async_level + grace_steps:
        return Staleness.LATE
    return Staleness.TOO_OLD


def oldest_trainable_step(current: int, async_level: int, grace_steps: int) -> int:
    """The oldest policy step still trained on at ``current`` (the buffer's drop bound)."""
    return current - async_level - grace_steps


def length_bucket(mean_tokens: float) -> str:
    """Bucket label of a batch by mean completion tokens per sample: ``"le_16"``, ``"le_32"``…"""
    bound = 16
    while bound < mean_tokens:
        bound *= 2
    return f"le_{bound}"


@dataclass(frozen=True)
class Acceptance:
    """Counts of one submitter or one length bucket.

    Attributes:
        decided: batches with a final verdict (accepted or rejected).
        accepted: batches accepted into the training buffer.
        trained: accepted batches handed to the optimizer (not expired in the buffer).
        late: accepted batches admitted in the grace window.
    """

    decided: int = 0
    accepted: int = 0
    trained: int = 0
    late: int = 0

    @property
    def acceptance_rate(self) -> float:
        """``accepted / decided`` (1.0 when nothing was decided)."""
        return self.accepted / self.decided if self.decided else 1.0

    @property
    def trained_rate(self) -> float:
        """``trained / decided`` (1.0 when nothing was decided)."""
        return self.trained / self.decided if self.decided else 1.0


class IntakeLedger:
    """Remembered decisions keyed by :data:`BatchKey`, and acceptance counters.

    Args:
        remember: decided batches remembered for exactly-once (oldest forgotten first).
        max_submitters: submitters kept in the per-submitter counters (least recently
            decided forgotten first), a memory bound against many identities.

    Not thread-safe; trio tasks of one inbox share it (no awaits inside).
    """

    def __init__(self, remember: int = 100_000, max_submitters: int = 10_000) -> None:
        self._remember = remember
        self._max_submitters = max_submitters
        self._decided: OrderedDict[BatchKey, object] = OrderedDict()
        self._by_submitter: OrderedDict[str, Acceptance] = OrderedDict()
        self._by_length: dict[str, Acceptance] = {}

    def decision(self, key: BatchKey) -> object | None:
        """The remembered decision (an ack) of ``key``, or None."""
        return self._decided.get(key)

    def remember(self, key: BatchKey, decision: object) -> None:
        """Store ``key``'s final decision (bounded; the oldest is forgotten first)."""
        self._decided[key] = decision
        self._decided.move_to_end(key)
        while len(self._decided) > self._remember:
            self._decided.popitem(last=False)

    def count(self, submitter: str, bucket: str, *, accepted: bool, late: bool = False) -> None:
        """Count one final verdict of ``submitter``'s batch in length ``bucket``."""
        inc = Acceptance(1, int(accepted), 0, int(accepted and late))
        self._add(submitter, bucket, inc)

    def count_trained(self, submitter: str, bucket: str) -> None:
        """Count one accepted batch handed to the optimizer."""
        self._add(submitter, bucket, Acceptance(0, 0, 1, 0))

    def _add(self, submitter: str, bucket: str, inc: Acceptance) -> None:
        for table, key in ((self._by_submitter, submitter), (self._by_length, bucket)):
            old = table.get(key, Acceptance())
            table[key] = Acceptance(
                old.decided + inc.decided,
                old.accepted + inc.accepted,
                old.trained + inc.trained,
                old.late + inc.late,
            )
        self._by_submitter.move_to_end(submitter)
        while len(self._by_submitter) > self._max_submitters:
            self._by_submitter.popitem(last=False)

    def by_submitter(self) -> dict[str, Acceptance]:
        """Counters per submitter PeerID (a copy)."""
        return dict(self._by_submitter)

    def by_length(self) -> dict[str, Acceptance]:
        """Counters per length bucket (a copy)."""
        return dict(self._by_length)
