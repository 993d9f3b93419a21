"""When is an optimizer step ready? Pure decisions for the trainer's wait for rollouts.

Theory of operation
-------------------
Before optimizer step ``k`` the trainer waits for verified batches usable at policy step
``k-1``. How many it waits for:

* an explicit ``min_batches`` setting wins;
* otherwise :func:`need_batches` asks for one batch per *known* peer (a peer that said hello
  and was heard from within ``peer_timeout_s``), at least one: what the run can deliver.

:func:`decide` turns a snapshot (batches held, peers known, peers that delivered, seconds
waited) into a :class:`StepReadiness`. The step is ready when ``need`` batches are there, or
as soon as *every* known peer has delivered a usable batch (so a run whose explicit
``min_batches`` exceeds what its peers can send never idles the whole timeout), or as soon as
every known peer has *answered*: delivered a usable batch or had one rejected by the validator
(told ``rejected``, a peer sends no other batch for that policy step, so waiting gains nothing),
or when the timeout has passed (the trainer then trains on what it has, possibly nothing).

:class:`Every` spaces progress log lines (``waiting_for_rollouts …``) ``interval_s`` apart.
Everything here takes times as arguments and does no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Set
from dataclasses import dataclass

__all__ = ["Every", "StepReadiness", "StepSnapshot", "decide", "known_peers", "need_batches"]


class StepReadiness(enum.Enum):
    """Outcome of one readiness check (the value is the log/metric string)."""

    WAIT = "wait"
    ENOUGH_BATCHES = "enough_batches"
    ALL_PEERS_DELIVERED = "all_peers_delivered"
    ALL_PEERS_ANSWERED = "all_peers_answered"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class StepSnapshot:
    """What the trainer holds while it waits for step ``step``'s rollouts.

    Attributes:
        have_batches: usable verified batches buffered now.
        need_batches: batches wanted (see :func:`need_batches`).
        known: PeerIDs of the peers the run can count on now.
        delivered: PeerIDs with at least one usable batch buffered.
        rejected: PeerIDs whose batch of a usable policy step was verified and rejected (told
            so, they send no other batch for it): they have answered too.
        waited_s: seconds since the wait began.
        timeout_s: the longest wait, seconds.
    """

    have_batches: int
    need_batches: int
    known: frozenset[str]
    delivered: frozenset[str]
    waited_s: float
    timeout_s: float
    rejected: frozenset[str] = frozenset()


def need_batches(explicit: int | None, known: int) -> int:
    """Batches to wait for: ``explicit`` if set, else one per known peer, at least 1."""
    if explicit is not None:
        return explicit
    return max(1, known)


def known_peers(
    joined: Mapping[str, float],
    last_seen: Mapping[str, float],
    now: float,
    peer_timeout_s: float,
    allowed: Set[str] | None = None,
) -> frozenset[str]:
    """Peers that said hello and were heard from within ``peer_timeout_s`` of ``now``.

    Args:
        joined: PeerID -> time of its first hello.
        last_seen: PeerID -> time it was last heard from (hello, status or rollouts).
        now: current time, same clock as the two maps, seconds.
        peer_timeout_s: silence after which a peer no longer counts.
        allowed: if given, only these PeerIDs count (the trainer's submitter allowlist).
    """
    return frozenset(
        p
        for p in joined
        if now - last_seen.get(p, joined[p]) <= peer_timeout_s and (allowed is None or p in allowed)
    )


def decide(s: StepSnapshot) -> StepReadiness:
    """Is the step ready (see module docstring)? Pure."""
    if s.have_batches >= s.need_batches:
        return StepReadiness.ENOUGH_BATCHES
    if s.have_batches > 0 and s.known and s.known <= s.delivered:
        return StepReadiness.ALL_PEERS_DELIVERED
    if s.known and s.known <= s.delivered | s.rejected:
        # every known peer answered, some with a rejected batch: waiting longer gains nothing
        # (a run whose only peer's batch was rejected must not sit out the step timeout)
        return StepReadiness.ALL_PEERS_ANSWERED
    if s.waited_s >= s.timeout_s:
        return StepReadiness.TIMEOUT
    return StepReadiness.WAIT


class Every:
    """``due(now)`` is True at most once per ``interval_s`` (first time: ``interval_s``
    after ``start``)."""

    def __init__(self, interval_s: float, start: float) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self.next_at = start + interval_s

    def due(self, now: float) -> bool:
        """True if a line is due at ``now`` (and schedules the next one)."""
        if now < self.next_at:
            return False
        while self.next_at <= now:
            self.next_at += self.interval_s
        return True

    def wait_s(self, now: float) -> float:
        """Seconds until the next line is due (>= 0)."""
        return max(0.0, self.next_at - now)
