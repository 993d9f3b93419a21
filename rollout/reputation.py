"""Submitter reputation and announcement rate limits (sans-IO; time is an argument).

Reputation: every submitter starts at ``initial``. A rejected batch lowers the score by the
penalty of its reason — forgery-like reasons (a bad TOPLOC proof, tampered prompts, inflated
rewards, a wrong signer, a corrupt payload) cost much more than reasons an honest peer can hit
(a duplicate after a lost ack costs little; arriving late, ``stale_step``, and the trainer's own
``check_error`` cost nothing). An accepted batch raises the score by ``reward``, capped at
``initial``, so an honest peer whose batches pass never ends below where it started. Below
``threshold`` the submitter is *refused*: its announcements are dropped before any payload is
fetched or any model is run, and the decision is logged once and counted.

No refusal is permanent: when the caller passes ``now``, a score recovers by
``recovery_per_s`` per second (up to ``initial``), and a refused submitter is readmitted once
its score is back at ``readmit_score`` (half an hour with the defaults). A forger readmitted
costs one verification before it is refused again.

Rate limit: a token bucket per submitter (``rate_per_s``, ``burst``) on announcements, so a
peer that floods announcements is refused (``rate_limited``) without costing a fetch.
Tables are bounded (``max_tracked``); the least recently seen honest submitters are forgotten
first, refused ones are kept.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from rollout.reasons import RejectReason

log = logging.getLogger(__name__)

_SEVERE: dict[str, float] = {  # a penalty for every reason (a test checks it)
    RejectReason.TOPLOC: 0.5,
    RejectReason.REPLAY: 0.5,
    RejectReason.PROMPT: 0.5,
    RejectReason.REWARD: 0.5,
    RejectReason.UNTRUSTED: 0.5,
    RejectReason.INTEGRITY: 0.5,
    RejectReason.SCHEMA: 0.5,
    RejectReason.SAMPLING: 0.5,
    RejectReason.TERMINATION: 0.5,
    RejectReason.UNKNOWN_WEIGHTS: 0.34,
    RejectReason.WRONG_RUN: 0.34,
    RejectReason.CHECK_ERROR: 0.0,
    RejectReason.STALE_STEP: 0.0,
    RejectReason.DUPLICATE: 0.1,
}


@dataclass(frozen=True)
class ReputationConfig:
    """Scores and limits.

    Attributes:
        initial: starting (and maximum) score.
        threshold: below this a submitter is refused.
        reward: score added per accepted batch.
        penalties: score removed per rejected batch, by reason (default 0.5).
        rate_per_s: sustained announcements per second per submitter.
        burst: announcements allowed in a burst.
        max_tracked: submitters kept in the tables.
        recovery_per_s: score regained per second (when callers pass ``now``).
        readmit_score: a refused submitter is readmitted at this score.
    """

    initial: float = 1.0
    threshold: float = 0.01
    reward: float = 0.05
    penalties: dict[str, float] = field(default_factory=lambda: dict(_SEVERE))
    default_penalty: float = 0.5
    rate_per_s: float = 2.0
    burst: float = 8.0
    max_tracked: int = 100_000
    recovery_per_s: float = 1.0 / 3600.0
    readmit_score: float = 0.5


@dataclass(frozen=True)
class ReputationStats:
    """Scores of known submitters and the refusals made."""

    scores: dict[str, float]
    refused: tuple[str, ...]
    refused_announcements: int
    rate_limited: int


class Reputation:
    """Per-submitter scores and announcement token buckets (see module docstring)."""

    def __init__(self, config: ReputationConfig | None = None) -> None:
        self.config = config or ReputationConfig()
        self._scores: OrderedDict[str, float] = OrderedDict()
        self._scored_at: dict[str, float] = {}
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()
        self._refused: set[str] = set()
        self._refused_count = 0
        self._limited = 0

    def score(self, peer: str, now: float | None = None) -> float:
        """Current score (``initial`` for an unknown peer), recovered up to ``now`` (seconds,
        the caller's monotonic clock; None: no time passes)."""
        c = self.config
        stored = self._scores.get(peer, c.initial)
        at = self._scored_at.get(peer)
        if now is None or at is None or now <= at:
            return stored
        return min(c.initial, stored + (now - at) * c.recovery_per_s)

    def refused(self, peer: str, now: float | None = None) -> bool:
        """True if ``peer`` is refused; counts the refusal. A refused peer whose score has
        recovered to ``readmit_score`` by ``now`` is readmitted (False)."""
        if peer not in self._refused:
            return False
        score = self.score(peer, now)
        if now is not None and score >= self.config.readmit_score:
            self._refused.discard(peer)
            self._scores[peer], self._scored_at[peer] = score, now
            log.info("submitter_readmitted peer=%s score=%.2f", peer[-8:], score)
            return False
        self._refused_count += 1
        return True

    def record(self, peer: str, accepted: bool, reason: str, now: float | None = None) -> float:
        """Record a verdict at ``now`` (seconds; None: no recovery is applied); returns the
        new score."""
        c = self.config
        old = self.score(peer, now)
        new = (
            min(c.initial, old + c.reward)
            if accepted
            else old - c.penalties.get(reason, c.default_penalty)
        )
        self._scores[peer] = new
        self._scores.move_to_end(peer)
        if now is not None:
            self._scored_at[peer] = now
        if new < c.threshold and peer not in self._refused:
            self._refused.add(peer)
            log.warning(
                "submitter_refused peer=%s score=%.2f last_reason=%s", peer[-8:], new, reason
            )
        self._trim(self._scores)
        return new

    def allow_announcement(self, peer: str, now: float) -> bool:
        """Take one token from ``peer``'s bucket; False (and counted) if empty."""
        c = self.config
        tokens, last = self._buckets.get(peer, (c.burst, now))
        tokens = min(c.burst, tokens + (now - last) * c.rate_per_s)
        ok = tokens >= 1.0
        self._buckets[peer] = (tokens - 1.0 if ok else tokens, now)
        self._buckets.move_to_end(peer)
        self._trim(self._buckets)
        if not ok:
            self._limited += 1
        return ok

    def _trim(self, table: OrderedDict[str, Any]) -> None:
        while len(table) > self.config.max_tracked:
            for key in table:
                if key not in self._refused:
                    del table[key]
                    if table is self._scores:
                        self._scored_at.pop(key, None)
                    break
            else:
                break

    def statistics(self) -> ReputationStats:
        """Current scores and counters."""
        return ReputationStats(
            dict(self._scores), tuple(sorted(self._refused)), self._refused_count, self._limited
        )
