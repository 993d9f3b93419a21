"""core: how a request to a source failed, as the scheduler (:mod:`.select`) takes it.

The session (:mod:`.session`) maps each transfer's :class:`~shardcast.core.session.Outcome`
to one of these and hands it to :meth:`~shardcast.core.select.Scheduler.on_failure`; the kind
decides what the source pays (nothing, a wait for that shard, a block of the whole source, a
ban) and whether the bytes the request received are kept for resuming.
"""

from __future__ import annotations

import enum


class FailureKind(enum.Enum):
    """Why a request failed (the value names it in logs).

    Each member's comment says what the scheduler does with the source and the shard."""

    TIMEOUT = "timeout"  # no progress for the stall timeout: a failure, blocks the source
    BROKEN = "broken"  # the stream broke mid-body: a failure, blocks the source
    UNAVAILABLE = "unavailable"  # 503/404/409: it does not serve the shard yet; that shard
    # waits penalty_s/10 there and leaves its have-set until its next /have answer
    REFUSED = "refused"  # 429: it holds the shard but serves others first (super-seeding);
    # that shard waits refused_s there
    REFUSED_UNREACHABLE = "refused_unreachable"  # a refusal that named a holder this node
    # cannot reach: it may be asked again at once, naming it
    CORRUPT = "corrupt"  # this source alone sent bytes that failed the digest: banned
    SUSPECT = "suspect"  # a copy assembled from several sources failed its digest: nobody is
    # penalized until :func:`~shardcast.core.blame.blame` names the culprit
    OVERDUE = "overdue"  # cancelled after Scheduler.overdue named it: its throughput so far
    # becomes a sample of the source's rate; not blocked, not asked for this shard for
    # overdue_min_s
    HOLD_ENDED = "hold_ended"  # the source ended the body at the end of its verified prefix
    # (its hold ran out): its late 503, taken as UNAVAILABLE once the bytes are kept

    @property
    def resumable(self) -> bool:
        """Whether the bytes the failed request received are kept and the shard resumes
        after them (``CORRUPT`` keeps them only when the driver says so: ``kept``)."""
        return self in _RESUMABLE

    @property
    def stalls(self) -> bool:
        """Whether the source stalled or broke on this shard (``TIMEOUT``, ``BROKEN``): the
        shard goes behind the shards nobody tried yet, so that a source stalling on some
        shards does not get the same ones first again and hold every request slot."""
        return self in (FailureKind.TIMEOUT, FailureKind.BROKEN)


_RESUMABLE = frozenset(
    {FailureKind.TIMEOUT, FailureKind.BROKEN, FailureKind.OVERDUE, FailureKind.HOLD_ENDED}
)
