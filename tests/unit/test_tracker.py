"""The sans-IO version tracker: which announcement is taken, what is fetched, superseding, and
the upstream poll schedule (no I/O, no clock: every case runs in microseconds)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import cast

from hypothesis import given, settings
from hypothesis import strategies as st

from shardcast.core.liveness import Abandon
from shardcast.core.pollpolicy import PollPolicy
from shardcast.core.tracker import (
    LEARNED_KEPT,
    FinishedTake,
    PollOutcome,
    Take,
    VersionTracker,
    Via,
    Want,
    abandons,
    judge,
    judge_continued,
    judge_finished,
    want,
)
from shardcast.wire.finish import RunContinued, RunFinished
from shardcast.wire.manifest import Manifest
from shardcast.wire.messages import VersionAnnouncement

RUN = "run"


def ann(step: int, digest: str = "a", run: str = RUN) -> VersionAnnouncement:
    """An announcement as the tracker sees it (verified before; the signature is not read)."""
    return VersionAnnouncement(run, step, digest, (), "Qm-trainer", b"")


def fin(step: int, digest: str = "a", run: str = RUN, seq: int = 0) -> RunFinished:
    return RunFinished(run, step, digest, "Qm-trainer", b"", seq)


def cont(step: int, seq: int, run: str = RUN) -> RunContinued:
    return RunContinued(run, step, seq, "Qm-trainer", b"")


class Store:
    """Committed versions, as :class:`shardcast.core.tracker.Held` reads them."""

    def __init__(self, held: dict[int, str]) -> None:
        self.held = held

    def latest(self) -> int | None:
        return max(self.held) if self.held else None

    def digest_of(self, step: int) -> str | None:
        return self.held.get(step)


def test_judge_takes_newer_steps_and_same_step_replacements_only_where_allowed() -> None:
    known = ann(4, "a")
    assert judge(None, ann(0), RUN, replace_same_step=False) is Take.NEWER
    assert judge(known, ann(5, "x"), RUN, replace_same_step=False) is Take.NEWER
    assert judge(known, ann(3, "x"), RUN, replace_same_step=True) is Take.OLDER
    assert judge(known, ann(4, "a"), RUN, replace_same_step=True) is Take.KNOWN
    assert judge(known, ann(4, "b"), RUN, replace_same_step=True) is Take.REPLACED
    assert judge(known, ann(4, "b"), RUN, replace_same_step=False) is Take.SAME_STEP_HELD
    assert judge(known, ann(9, "b", run="other"), RUN, replace_same_step=True) is Take.OTHER_RUN
    assert [t for t in Take if t.taken] == [Take.NEWER, Take.REPLACED]


def test_open_gossip_never_replaces_a_step_and_an_upstream_does_unless_contradicted() -> None:
    t = VersionTracker(RUN)
    assert t.offer(ann(4, "new"), Via.GOSSIP, 0.0, "Qm-g") is Take.NEWER
    assert t.offer(ann(4, "old"), Via.GOSSIP, 0.0, "Qm-g") is Take.SAME_STEP_HELD  # a replay
    assert t.announcement == ann(4, "new")
    t.heard_from("r1", ann(4, "new"))
    ready = {"r1", "r2"}
    # r1 says what this node knows: r2, not caught up, must not flip it back
    assert t.offer(ann(4, "old"), Via.UPSTREAM, 0.0, "r2", ready) is Take.SAME_STEP_HELD
    # r1's own word does not confirm against itself; an unreachable r1's word counts no more
    assert t.offer(ann(4, "old"), Via.UPSTREAM, 0.0, "r2", {"r2"}) is Take.REPLACED
    assert t.announcement == ann(4, "old")
    t.heard_from("r1", None)  # r1's record became unusable: its word is forgotten
    assert t.said == {}
    assert t.offer(ann(4, "newest"), Via.UPSTREAM, 0.0, "r2", ready) is Take.REPLACED
    assert t.offer(ann(4, "self"), Via.SELF, 0.0) is Take.REPLACED  # the origin's own word
    assert t.offer(ann(3, "x"), Via.UPSTREAM, 0.0, "r2", ready) is Take.OLDER


def test_want_never_moves_backwards() -> None:
    held = {1: "h1", 2: "h2"}.get
    assert want(None, 2, held) is Want.NOTHING_KNOWN
    assert want(ann(3), 2, held) is Want.NEWER
    assert want(ann(0), None, held) is Want.NEWER  # nothing held
    assert want(ann(2, "h2"), 2, held) is Want.HELD
    assert want(ann(2, "x"), 2, held) is Want.REPLACE  # the trainer republished it
    assert want(ann(1, "x"), 2, held) is Want.BEHIND
    assert [w for w in Want if w.fetch] == [Want.NEWER, Want.REPLACE]
    t = VersionTracker(RUN)
    t.offer(ann(2, "x"), Via.UPSTREAM, 0.0, "r")
    assert t.wanted(Store({1: "h1", 2: "h2"})) is Want.REPLACE


def test_run_end_is_lifted_by_a_newer_step_and_a_stale_one_is_refused() -> None:
    t = VersionTracker(RUN)
    t.offer(ann(5), Via.UPSTREAM, 0.0, "r")
    assert t.offer_finished(fin(4)) is FinishedTake.STALE  # the trainer resumed since
    assert t.offer_finished(fin(5, run="other")) is FinishedTake.OTHER_RUN
    assert t.offer_finished(fin(5)) is FinishedTake.TAKEN
    assert t.offer_finished(fin(5)) is FinishedTake.NOT_NEWER
    assert not t.settled(Store({4: "a"}).digest_of)
    assert t.settled(Store({5: "a"}).digest_of)
    assert not t.settled(Store({5: "other"}).digest_of)
    assert not t.take(ann(5, "b"), 1.0)  # the same step: still finished
    assert t.finished == fin(5)
    assert t.take(ann(6), 2.0)  # a newer step: the run resumed
    assert t.finished is None
    assert not t.settled(Store({5: "a"}).digest_of)
    t.finish(fin(6))  # the origin's own
    assert t.finished == fin(6)


def test_a_continuation_lifts_the_run_end_and_replays_do_not_flip_it() -> None:
    """The trainer finished at 5 (seq 1), was restarted with more steps (continued, seq 2),
    crashed before step 6 and was started again with the old step count (finished, seq 3)."""
    t = VersionTracker(RUN)
    t.offer(ann(5), Via.UPSTREAM, 0.0, "r")
    assert t.offer_finished(fin(5, seq=1)) is FinishedTake.TAKEN
    assert t.offer_continued(cont(5, 2, run="other")) == (FinishedTake.OTHER_RUN, False)
    assert t.offer_continued(cont(5, 2)) == (FinishedTake.TAKEN, True)
    assert t.finished is None
    assert not t.settled(Store({5: "a"}).digest_of)
    assert t.offer_continued(cont(5, 2)) == (FinishedTake.NOT_NEWER, False)  # a replay
    assert t.offer_finished(fin(5, seq=1)) is FinishedTake.NOT_NEWER  # the old end, replayed
    assert t.offer_finished(fin(5)) is FinishedTake.NOT_NEWER  # one signed without a counter
    assert t.offer_finished(fin(5, seq=3)) is FinishedTake.TAKEN  # it ended again
    assert t.offer_continued(cont(5, 2)) == (FinishedTake.NOT_NEWER, False)
    assert t.finished == fin(5, seq=3)
    # a continuation known before any run end (this node joined late) is kept, lifts nothing,
    # and still refuses the older end it supersedes
    late = VersionTracker(RUN)
    assert late.offer_continued(cont(5, 2)) == (FinishedTake.TAKEN, False)
    assert late.offer_finished(fin(5, seq=1)) is FinishedTake.NOT_NEWER
    assert late.offer_finished(fin(6, seq=1)) is FinishedTake.TAKEN  # a later step's end
    # the origin's own
    t.continue_(cont(5, 4))
    assert (t.finished, t.continued) == (None, cont(5, 4))


def test_judging_run_ends_is_pure_and_ordered_by_step_then_seq() -> None:
    assert judge_continued(None, None, cont(3, 1), RUN) is FinishedTake.TAKEN
    assert judge_continued(fin(3, seq=2), None, cont(3, 1), RUN) is FinishedTake.NOT_NEWER
    assert judge_continued(fin(3, seq=2), None, cont(3, 3), RUN) is FinishedTake.TAKEN
    assert judge_continued(fin(4, seq=1), None, cont(3, 9), RUN) is FinishedTake.NOT_NEWER
    assert judge_continued(None, cont(3, 3), cont(3, 3), RUN) is FinishedTake.NOT_NEWER
    assert judge_finished(None, None, fin(3, seq=1), RUN, cont(3, 2)) is FinishedTake.NOT_NEWER
    assert judge_finished(None, None, fin(4, seq=1), RUN, cont(3, 2)) is FinishedTake.TAKEN


def _manifest(step: int, base_step: int | None, base_digest: str | None) -> Manifest:
    header = SimpleNamespace(base_step=base_step, base_digest=base_digest)
    return cast(Manifest, SimpleNamespace(step=step, digest=f"d{step}", header=header))


def test_a_download_is_abandoned_when_it_cannot_be_the_newer_versions_base() -> None:
    t = VersionTracker(RUN)
    t.offer(ann(1), Via.GOSSIP, 0.0, "g")
    assert not t.superseded(1)
    t.offer(ann(2), Via.GOSSIP, 0.0, "g")
    assert t.superseded(1)
    assert not t.superseded(2)
    assert abandons(1, "d1", _manifest(2, 1, "d1"), {}) is None  # a delta on it: finish it
    assert abandons(1, "d1", _manifest(2, None, None), {}) is Abandon.SUPERSEDED  # an anchor
    assert abandons(1, "d1", _manifest(2, 1, "other"), {}) is Abandon.SUPERSEDED


def test_learning_time_is_the_first_take_of_a_step_and_bounded() -> None:
    t = VersionTracker(RUN)
    assert t.offer(ann(1, "a"), Via.GOSSIP, 5.0) is Take.NEWER
    assert t.offer(ann(1, "b"), Via.UPSTREAM, 7.0, "r") is Take.REPLACED
    assert t.learned_at(1) == 5.0  # a replacement of the step keeps when it was first heard
    assert t.offer(ann(0), Via.UPSTREAM, 8.0, "r") is Take.OLDER
    assert t.learned_at(0) is None  # refused: not learned
    for step in range(2, 2 + LEARNED_KEPT):
        t.offer(ann(step), Via.GOSSIP, float(step))
    assert t.learned_at(1) is None  # forgotten: only the newest LEARNED_KEPT are kept
    assert t.learned_at(2) == 2.0
    assert t.learned_at(1 + LEARNED_KEPT) == float(1 + LEARNED_KEPT)


def test_poll_schedule_backs_off_and_goes_quiet_once_settled() -> None:
    t = VersionTracker(RUN)
    p = PollPolicy(poll_interval_s=1.0, max_backoff_s=10.0)
    fails = [t.polled("a", PollOutcome.UNREACHABLE, p, False) for _ in range(6)]
    assert [n.delay_s for n in fails] == [1.0, 2.0, 4.0, 8.0, 10.0, 10.0]
    assert [n.failures for n in fails] == [1, 2, 3, 4, 5, 6]
    assert all(n.report for n in fails)
    assert t.polled("b", PollOutcome.UNREACHABLE, p, False).failures == 1  # per upstream
    ok = t.polled("a", PollOutcome.ANSWERED, p, False)
    assert (ok.delay_s, ok.failures) == (1.0, 0)
    assert t.polled("a", PollOutcome.WRONG_RUN, p, True).delay_s == 60.0
    settled = [t.polled("a", PollOutcome.UNREACHABLE, p, True) for _ in range(5)]
    assert [n.delay_s for n in settled] == [60.0, 120.0, 240.0, 480.0, 600.0]
    assert [n.report for n in settled] == [True, False, False, False, False]  # said once


# -- properties -------------------------------------------------------------------------------

offers = st.lists(
    st.tuples(
        st.integers(0, 8),  # step
        st.sampled_from("abc"),  # digest
        st.sampled_from(list(Via)),
        st.sampled_from(["r1", "r2", "g"]),  # sender
        st.frozensets(st.sampled_from(["r1", "r2"])),  # upstreams ready
        st.booleans(),  # an upstream's info record: its word is remembered
    ),
    max_size=40,
)


@settings(max_examples=300, deadline=None)
@given(offers, st.dictionaries(st.integers(0, 8), st.sampled_from("abc"), max_size=4))
def test_known_step_is_the_newest_offered_and_nothing_older_than_committed_is_fetched(
    seq: list[tuple[int, str, Via, str, frozenset[str], bool]], held: dict[int, str]
) -> None:
    t = VersionTracker(RUN)
    store = Store(held)
    newest = -1
    for now, (step, digest, via, sender, ready, said) in enumerate(seq):
        before = t.announcement
        take = t.offer(ann(step, digest), via, float(now), sender, ready)
        if via is Via.UPSTREAM and said:
            t.heard_from(sender, ann(step, digest))
        newest = max(newest, step)
        got = t.announcement
        assert got is not None
        assert got.step == newest  # the step never goes back
        assert take.taken == (got is not before)
        assert t.learned_at(newest) is not None  # the step followed has a learning time
        if via is Via.GOSSIP and before is not None and step == before.step:
            assert got is before  # open gossip never replaces a step
        wanted = t.wanted(store)
        latest = store.latest()
        if wanted.fetch:  # never an older step than the newest committed
            assert latest is None or got.step >= latest
            assert got.step > (latest if latest is not None else -1) or (
                held[got.step] != got.manifest_digest
            )
        for s in range(-1, 10):  # a download of any older step is superseded, always
            assert t.superseded(s) == (s < newest)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(list(PollOutcome)), max_size=30), st.booleans())
def test_poll_delays_stay_within_the_policy(outcomes: list[PollOutcome], settled: bool) -> None:
    t = VersionTracker(RUN)
    p = PollPolicy(poll_interval_s=0.5, max_backoff_s=7.0)
    base = p.finished_poll_interval_s if settled else p.poll_interval_s
    cap = max(p.finished_max_backoff_s if settled else p.max_backoff_s, base)
    run = 0
    for o in outcomes:
        nxt = t.polled("u", o, p, settled)
        run = run + 1 if o is PollOutcome.UNREACHABLE else 0
        assert nxt.failures == run
        assert base <= nxt.delay_s <= cap
        if run == 0:
            assert nxt.delay_s == base
