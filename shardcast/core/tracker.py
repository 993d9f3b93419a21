"""core: which version to follow, sans-IO: announcements in, decisions out.

Theory of operation
-------------------
A node learns of versions from trainer-signed
:class:`~shardcast.wire.messages.VersionAnnouncement`\\ s arriving three ways (:class:`Via`): its
upstreams' info records (allowlisted nodes, polled), the run's open gossip topic (anybody may
replay an old signed message there), and itself (the origin announces what it publishes). A
:class:`VersionTracker` holds what the node concluded from them: the newest announcement it
knows, the trainer's :class:`~shardcast.wire.finish.RunFinished` if the run ended, when it first
heard of each recent step, what each upstream's last info record said, and each upstream's run
of failed polls. Its drivers are :class:`shardcast.node.node.ShardcastNode` (which verifies the
bytes, logs and wakes waiters), :class:`shardcast.download.follower.Follower` (which polls and
downloads) and the simulator (:mod:`simulations.model`), which offers the announcements its
nodes hear to the same object. It does no I/O and reads no clock (``now`` is an argument);
nothing in it is random.

The rules, each a pure function the tracker and its drivers share:

- :func:`judge` — an announcement is taken if it names a newer step than the known one
  (:attr:`Take.NEWER`), or the known step with another manifest digest where a same-step
  replacement is allowed (:attr:`Take.REPLACED`: the trainer republished the step and its newest
  word is authoritative). Older steps, the known version itself and other runs are refused.
- :func:`confirmed_elsewhere` — a same-step replacement is allowed from an upstream only, and
  not while another reachable upstream's last info record names the known version: an upstream
  that has not caught up with a republication must not flip the node back (it flip-flopped on
  every poll before, and could end a run on the old digest). Open gossip never replaces.
- :func:`want` — the known announcement is fetched if it is newer than the newest committed
  step, or that very step under another digest (the local copy is then discarded). A node
  never moves backwards: an older step is :attr:`Want.BEHIND`, whatever its digest.
- :func:`superseded` / :func:`abandons` — a download is superseded once a newer step is
  announced; it is abandoned (:attr:`shardcast.core.liveness.Abandon.SUPERSEDED`) if it cannot be
  the base of the newer version's delta chain (:func:`shardcast.core.catchup.worth_finishing`).
- :func:`judge_finished` — a run end is taken if it is newer than the one known and not older
  than the known announcement (an old run end after the trainer resumed is stale), nor than
  the newest continuation (:func:`shardcast.wire.finish.end_order`); an announcement of a
  newer step than the run end lifts it (the trainer resumed).
- :func:`judge_continued` — a continuation (the trainer restarted on a finished run with more
  steps, :class:`~shardcast.wire.finish.RunContinued`) is taken if it is newer than the
  newest continuation and the run end known; it lifts that run end.
- :func:`manifest_retry_s` — a manifest document (or run card) that no source serves yet is
  asked for again after a short doubling wait, capped at :data:`MANIFEST_RETRY_MAX_S`.
- :meth:`VersionTracker.polled` — an upstream's polls are spaced by
  :func:`shardcast.core.pollpolicy.poll_delay`: every ``poll_interval_s`` while it answers,
  doubling up
  to ``max_backoff_s`` while it fails, minutes apart once the node is settled (run finished,
  final version held), when a failure is reported once only (not every retry).

Bounds: one entry per upstream that ever answered (the configured upstreams: a fixed set);
the learning times of the newest :data:`LEARNED_KEPT` steps.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Protocol

from shardcast.core.catchup import worth_finishing
from shardcast.core.liveness import Abandon
from shardcast.core.pollpolicy import PollPolicy, poll_delay
from shardcast.wire import Manifest, RunContinued, RunFinished, VersionAnnouncement, end_order

__all__ = [
    "LEARNED_KEPT",
    "MANIFEST_RETRY_FIRST_S",
    "MANIFEST_RETRY_MAX_S",
    "FinishedTake",
    "Held",
    "PollNext",
    "PollOutcome",
    "Take",
    "Version",
    "VersionTracker",
    "Via",
    "Want",
    "abandons",
    "confirmed_elsewhere",
    "judge",
    "judge_finished",
    "manifest_retry_s",
    "superseded",
    "want",
]

Version = tuple[int, str]
"""``(step, manifest digest)``."""

LEARNED_KEPT = 64
"""Steps whose learning time a tracker remembers (the newest ones; a catch-up chain is at most
32 links)."""

MANIFEST_RETRY_FIRST_S = 0.02
"""First wait before asking the sources for a manifest document again, seconds."""
MANIFEST_RETRY_MAX_S = 0.25
"""Cap of that wait, seconds. A downstream node usually learns of a version (gossip) a few
hundred milliseconds before its upstream relay has fetched the manifest and serves it; every
millisecond the retry overshoots that moment is added to the version's arrival at every node
below, so the cap is small (a manifest request is one small GET per upstream)."""


def manifest_retry_s(attempt: int) -> float:
    """Wait after the ``attempt``-th round (0-based) of manifest (or run card) requests that
    found no source holding it yet, seconds: doubling from :data:`MANIFEST_RETRY_FIRST_S`,
    capped at :data:`MANIFEST_RETRY_MAX_S`."""
    return min(MANIFEST_RETRY_FIRST_S * float(2 ** min(attempt, 16)), MANIFEST_RETRY_MAX_S)


class Via(enum.Enum):
    """Where an announcement came from (the value is the log/metric string)."""

    UPSTREAM = "upstream"  # an allowlisted upstream's info record
    GOSSIP = "gossip"  # the run's open versions topic: anybody may replay a signed message
    SELF = "self"  # this node announces it (the origin)


class Take(enum.Enum):
    """What became of an offered announcement (the value is the log/metric string)."""

    NEWER = "newer"  # a newer step than the known one (or the first known): taken
    REPLACED = "replaced"  # the known step with another digest, replacement allowed: taken
    OTHER_RUN = "other_run"  # refused: another run's
    OLDER = "older"  # refused: an older step than the known one
    KNOWN = "known"  # refused: the known version itself
    SAME_STEP_HELD = "same_step_held"  # refused: the known step with another digest, from
    # open gossip or while another upstream confirms the known digest

    @property
    def taken(self) -> bool:
        """True if the announcement became the known one."""
        return self in (Take.NEWER, Take.REPLACED)


class FinishedTake(enum.Enum):
    """What became of an offered run end (the value is the log/metric string)."""

    TAKEN = "taken"
    OTHER_RUN = "other_run"  # refused: another run's
    NOT_NEWER = "not_newer"  # refused: not newer than the run end (or continuation) known
    STALE = "stale"  # refused: older than the known announcement (the trainer resumed since)


class Want(enum.Enum):
    """Whether the known announcement names a version to fetch (value: log/metric string)."""

    NOTHING_KNOWN = "nothing_known"  # no announcement yet
    NEWER = "newer"  # fetch: newer than every committed step
    REPLACE = "replace"  # fetch: the newest committed step, under another digest
    HELD = "held"  # nothing to do: the newest committed version
    BEHIND = "behind"  # never fetched: older than the newest committed step

    @property
    def fetch(self) -> bool:
        """True if the announced version is to be downloaded."""
        return self in (Want.NEWER, Want.REPLACE)


class PollOutcome(enum.Enum):
    """How one info poll of an upstream ended (the value is the log/metric string)."""

    ANSWERED = "answered"  # its info record arrived, of this run
    WRONG_RUN = "wrong_run"  # its info record arrived, of another run (an operator mistake)
    UNREACHABLE = "unreachable"  # no connection, no answer, or a malformed one


@dataclass(frozen=True)
class PollNext:
    """When to poll an upstream next, and whether to report the poll that just ended.

    Attributes:
        delay_s: wait before the next poll, seconds.
        failures: consecutive failed polls of this upstream (0 after an answer).
        report: log this outcome (a failure once settled is reported once, not per retry).
    """

    delay_s: float
    failures: int
    report: bool


class Held(Protocol):
    """What a tracker needs to know of the node's committed versions
    (:class:`~shardcast.store.store.VersionStore` is one)."""

    def latest(self) -> int | None:
        """The newest committed step, or None."""
        ...

    def digest_of(self, step: int) -> str | None:
        """The manifest digest of committed ``step``, or None."""
        ...


def judge(
    known: VersionAnnouncement | None,
    ann: VersionAnnouncement,
    run_id: str,
    *,
    replace_same_step: bool,
) -> Take:
    """Whether ``ann`` replaces the ``known`` announcement of run ``run_id`` (pure).

    Args:
        replace_same_step: an announcement of the known step with another digest may replace
            it (from an upstream that no other upstream contradicts; see
            :func:`confirmed_elsewhere`).
    """
    if ann.run_id != run_id:
        return Take.OTHER_RUN
    if known is None or ann.step > known.step:
        return Take.NEWER
    if ann.step < known.step:
        return Take.OLDER
    if ann.manifest_digest == known.manifest_digest:
        return Take.KNOWN
    return Take.REPLACED if replace_same_step else Take.SAME_STEP_HELD


def confirmed_elsewhere(
    known: VersionAnnouncement | None,
    sender: str,
    said: Mapping[str, Version],
    ready: Collection[str],
) -> bool:
    """True if an upstream other than ``sender``, reachable now (in ``ready``), announced in
    its last info record (``said``: upstream -> version) the very version ``known`` names: a
    same-step replacement from ``sender`` then waits (see the module docstring). Once every
    upstream says the new digest it is taken. (Two trainer-signed announcements of one step
    cannot be ordered; an upstream that keeps announcing an old one holds its downstreams where
    they are, it cannot move them back.)"""
    if known is None:
        return False
    version = (known.step, known.manifest_digest)
    return any(pid != sender and pid in ready and v == version for pid, v in said.items())


def want(
    ann: VersionAnnouncement | None, latest: int | None, held_digest: Callable[[int], str | None]
) -> Want:
    """Whether announcement ``ann`` names a version to fetch (pure).

    Args:
        latest: the newest committed step, or None.
        held_digest: the manifest digest of a committed step (asked for ``latest`` only).
    """
    if ann is None:
        return Want.NOTHING_KNOWN
    if latest is None or ann.step > latest:
        return Want.NEWER
    if ann.step < latest:
        return Want.BEHIND
    held = held_digest(ann.step)
    return Want.REPLACE if held is not None and held != ann.manifest_digest else Want.HELD


def superseded(known: VersionAnnouncement | None, step: int) -> bool:
    """True if ``known`` (the newest announcement) names a newer step than ``step``."""
    return known is not None and known.step > step


def abandons(
    step: int, digest: str, newer: Manifest, chain: Mapping[int, Manifest]
) -> Abandon | None:
    """Whether the download of version ``(step, digest)`` is abandoned for ``newer`` (whose
    delta chain below it, by step, is ``chain``): :attr:`Abandon.SUPERSEDED` if it cannot be
    a base of that chain (:func:`shardcast.core.catchup.worth_finishing`), else None (finish it)."""
    return None if worth_finishing(step, digest, newer, chain) else Abandon.SUPERSEDED


def judge_finished(
    finished: RunFinished | None,
    known: VersionAnnouncement | None,
    msg: RunFinished,
    run_id: str,
    continued: RunContinued | None = None,
) -> FinishedTake:
    """Whether run end ``msg`` is taken, given the run end, announcement and continuation
    known (pure)."""
    if msg.run_id != run_id:
        return FinishedTake.OTHER_RUN
    if end_order(msg) <= _newest_end(finished, continued):
        return FinishedTake.NOT_NEWER
    if known is not None and msg.step < known.step:
        return FinishedTake.STALE
    return FinishedTake.TAKEN


def _newest_end(finished: RunFinished | None, continued: RunContinued | None) -> tuple[int, int]:
    """The greater :func:`~shardcast.wire.finish.end_order` of the two known (``(-1, -1)``:
    neither)."""
    return max((end_order(m) for m in (finished, continued) if m is not None), default=(-1, -1))


def judge_continued(
    finished: RunFinished | None,
    continued: RunContinued | None,
    msg: RunContinued,
    run_id: str,
) -> FinishedTake:
    """Whether continuation ``msg`` is taken, given the run end and continuation known
    (pure). One that is taken lifts the run end known (the caller drops it)."""
    if msg.run_id != run_id:
        return FinishedTake.OTHER_RUN
    if end_order(msg) <= _newest_end(finished, continued):
        return FinishedTake.NOT_NEWER
    return FinishedTake.TAKEN


class VersionTracker:
    """What a node knows about the run's versions, and what it decides from it (see the
    module docstring). Not thread-safe; call it from one thread (the trio thread).

    Args:
        run_id: the run followed; announcements of others are refused.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.announcement: VersionAnnouncement | None = None
        """The newest announcement taken."""
        self.finished: RunFinished | None = None
        """The trainer's run end, while no newer step is announced and no newer continuation."""
        self.continued: RunContinued | None = None
        """The newest continuation taken (kept after a newer step, to refuse older run ends)."""
        self._said: dict[str, Version] = {}  # upstream -> its last info record's version
        self._learned: dict[int, float] = {}  # step -> when first taken (newest LEARNED_KEPT)
        self._failures: dict[str, int] = {}  # upstream -> consecutive failed polls

    # -- announcements ------------------------------------------------------------------------

    @property
    def said(self) -> Mapping[str, Version]:
        """Upstream -> the version its last info record announced (read-only view)."""
        return self._said

    def offer(
        self,
        ann: VersionAnnouncement,
        via: Via,
        now: float,
        sender: str = "",
        ready: Collection[str] = (),
    ) -> Take:
        """Take ``ann`` (already verified) if it is news (see :func:`judge`).

        Args:
            via: where it came from: a same-step replacement is taken from an upstream that
                no other reachable upstream contradicts (:func:`confirmed_elsewhere`), or from
                this node itself; never from open gossip.
            now: the time, seconds (any monotonic clock; see :meth:`learned_at`).
            sender: the upstream or gossip origin that passed it on.
            ready: the upstreams reachable now.
        """
        replace = via is Via.SELF or (
            via is Via.UPSTREAM
            and not confirmed_elsewhere(self.announcement, sender, self._said, ready)
        )
        take = judge(self.announcement, ann, self.run_id, replace_same_step=replace)
        if take.taken:
            self.take(ann, now)
        return take

    def take(self, ann: VersionAnnouncement, now: float) -> bool:
        """Make ``ann`` the known announcement at time ``now`` (seconds), unconditionally (the
        origin's own, or one :func:`judge` took). Returns True if it lifted a known run end
        (the trainer resumed)."""
        resumed = self.finished is not None and ann.step > self.finished.step
        if resumed:
            self.finished = None
        self.announcement = ann
        self._learned.setdefault(ann.step, now)
        if len(self._learned) > LEARNED_KEPT:
            del self._learned[min(self._learned)]
        return resumed

    def learned_at(self, step: int) -> float | None:
        """When an announcement of ``step`` was first taken (the ``now`` it was taken with),
        or None (never, or not among the newest :data:`LEARNED_KEPT` steps)."""
        return self._learned.get(step)

    def heard_from(self, upstream: str, ann: VersionAnnouncement | None) -> None:
        """Remember what ``upstream``'s last info record announced (None: nothing usable)."""
        if ann is None:
            self._said.pop(upstream, None)
        else:
            self._said[upstream] = (ann.step, ann.manifest_digest)

    def offer_finished(self, msg: RunFinished) -> FinishedTake:
        """Take run end ``msg`` (already verified) if it is news (see :func:`judge_finished`)."""
        take = judge_finished(self.finished, self.announcement, msg, self.run_id, self.continued)
        if take is FinishedTake.TAKEN:
            self.finished = msg
        return take

    def finish(self, msg: RunFinished) -> None:
        """Record this node's own run end, unconditionally (the origin)."""
        self.finished = msg

    def offer_continued(self, msg: RunContinued) -> tuple[FinishedTake, bool]:
        """Take continuation ``msg`` (already verified) if it is news (see
        :func:`judge_continued`).

        Returns:
            the verdict, and True if it lifted a known run end.
        """
        take = judge_continued(self.finished, self.continued, msg, self.run_id)
        if take is not FinishedTake.TAKEN:
            return take, False
        self.continued = msg
        lifted = self.finished is not None
        self.finished = None
        return take, lifted

    def continue_(self, msg: RunContinued) -> None:
        """Record this node's own continuation, unconditionally (the origin)."""
        self.continued = msg
        self.finished = None

    # -- decisions ----------------------------------------------------------------------------

    def wanted(self, held: Held) -> Want:
        """Whether the known announcement names a version to fetch (:func:`want`)."""
        return want(self.announcement, held.latest(), held.digest_of)

    def superseded(self, step: int) -> bool:
        """True if a newer step than ``step`` has been announced."""
        return superseded(self.announcement, step)

    def settled(self, held_digest: Callable[[int], str | None]) -> bool:
        """True once the run finished and its final version is committed (``held_digest``:
        the manifest digest of a committed step, or None)."""
        fin = self.finished
        return fin is not None and held_digest(fin.step) == fin.manifest_digest

    def polled(
        self,
        upstream: str,
        outcome: PollOutcome,
        policy: PollPolicy,
        settled: bool,
        watched: bool = False,
    ) -> PollNext:
        """Record how a poll of ``upstream`` ended; when to poll it next.

        Args:
            upstream: the key of one poll schedule (the follower uses the configured
                multiaddr: one schedule per poll loop).
            policy: the poll periods (see :func:`shardcast.core.pollpolicy.poll_delay`).
            settled: :meth:`settled` now (polls and retries are then minutes apart).
            watched: a long-poll of the upstream's ``/versions`` is held
                (:class:`~shardcast.core.pollpolicy.VersionWatch`): polls are further apart.
        """
        if outcome is PollOutcome.UNREACHABLE:
            failures = self._failures.get(upstream, 0) + 1
            self._failures[upstream] = failures
            report = not settled or failures == 1  # once settled, say it once, not forever
        else:
            failures = 0
            self._failures.pop(upstream, None)
            report = True
        return PollNext(poll_delay(policy, failures, settled, watched), failures, report)
