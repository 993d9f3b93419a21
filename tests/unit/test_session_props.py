"""Properties of the sans-IO download session over random event orders (Hypothesis).

A stand-in driver plays the network, the checker and the byte buffers exactly as the trio
driver does (real bytes: honest sources send the true bytes, liars flip them; kept prefixes,
suspect copies and byte comparisons with :func:`shardcast.core.blame.blame`), and Hypothesis
chooses what happens next: which transfer ends and how, which check finishes, which manifest
part or have-set arrives, how far the clock moves. Then every source turns well behaved and the
session must end. Properties, checked at every action:

- a :class:`Commit` comes only when every shard was verified (written) and every part arrived;
- :class:`Blame` and :class:`Ban` name only sources that actually sent a wrong byte (or broke
  the protocol); a ``409`` or a base mismatch blames nobody;
- duplicate requests in flight never exceed the endgame bounds (per shard and overall);
- a resumed request finds its prefix kept, exactly as long as the request assumes;
- the session ends (commit or typed failure) within a bounded number of rounds.
"""

from __future__ import annotations

import dataclasses
import random
import sys
from dataclasses import dataclass
from typing import cast

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from shardcast.core.blame import blame
from shardcast.core.liveness import Answer
from shardcast.core.select import SchedulerConfig
from shardcast.core.session import (
    Action,
    Ban,
    Blame,
    Cancel,
    Check,
    Commit,
    Compare,
    Drop,
    End,
    Fail,
    Fetch,
    Keep,
    KeepSuspect,
    Offer,
    Outcome,
    PollHave,
    Probe,
    Session,
    SessionConfig,
    Verdict,
)
from shardcast.wire.codecs import DELTAS, RAW, XOR_ZSTD, ZSTD

PER_PART = 2
SCHED = SchedulerConfig(
    max_inflight=4,
    per_source_inflight=2,
    endgame_duplicates=1,
    endgame_max_total=2,
    penalty_s=1.0,
    explore=0.2,
)
FAILURES = [
    Outcome.BROKEN,
    Outcome.HOLD_ENDED,
    Outcome.TIMEOUT,
    Outcome.UNREACHABLE,
    Outcome.NOT_AVAILABLE,
    Outcome.REFUSED,
    Outcome.GONE,
    Outcome.WRONG_VERSION,
]

_AFTER_BYTES = {  # how a transfer can end once bytes of it arrived
    Outcome.OK,
    Outcome.BROKEN,
    Outcome.HOLD_ENDED,
    Outcome.TIMEOUT,
    Outcome.PROTOCOL_ERROR,
    Outcome.CORRUPT_CHUNK,
}


@dataclass
class _Req:
    f: Fetch
    buf: bytearray
    pos: int
    checking: bool = False
    cancel: bool = False


class World:
    """The stand-in driver (see module docstring)."""

    def __init__(self, data: st.DataObject) -> None:
        draw = data.draw
        self.draw = draw
        n = draw(st.integers(1, 6), label="shards")
        self.lengths = [draw(st.integers(1, 24)) for _ in range(n)]
        self.n_parts = (n + PER_PART - 1) // PER_PART
        self.parts = set(draw(st.sets(st.integers(0, self.n_parts - 1)), label="parts"))
        self.base_broken = set(draw(st.sets(st.integers(0, n - 1)), label="base_broken"))
        self.offers = {i: self._offer(i) for i in range(n)}
        known = [i for k in self.parts for i in self._part(k)]
        held = [i for i in known if draw(st.booleans())] if draw(st.booleans()) else []
        self.liars = {f"liar{k}" for k in range(draw(st.integers(0, 2), label="liars"))}
        self.partial = {f"peer{k}" for k in range(draw(st.integers(0, 2), label="peers"))}
        self.partial_have: dict[str, set[int]] = {p: set() for p in self.partial}
        cfg = SessionConfig(
            SCHED,
            max_resume_buffers=2,
            use_base=draw(st.booleans(), label="use_base"),
            prefer_compressed=draw(st.booleans(), label="zstd"),
            max_extra_sources=2,
        )
        self.now = 0.0
        rng = random.Random(draw(st.integers(0, 2**32 - 1), label="seed"))
        self.s = Session(
            7,
            self.lengths,
            self.n_parts,
            self.parts,
            [self.offers[i] for i in known],
            held,
            rng,
            cfg,
            self.now,
        )
        self.written = set(held)
        self.sent_wrong: set[str] = set()  # sources that sent a wrong byte or broke protocol
        self.reqs: dict[int, _Req] = {}
        self.kept: dict[int, tuple[bytearray, int]] = {}
        self.suspects: dict[int, bytearray] = {}
        self.checks: list[int] = []
        self.end: End | None = None
        self.do(self.s.add_source("honest", True, self.now))
        for name in sorted(self.liars):
            complete = draw(st.booleans())
            if not complete:
                self.partial.add(name)
                self.partial_have[name] = set()
            self.do(self.s.add_source(name, complete, self.now))
        for name in sorted(self.partial - self.liars):
            self.do(self.s.add_source(name, False, self.now, extra=True))
        self.poll()

    # -- truth -------------------------------------------------------------------------------

    def _part(self, k: int) -> range:
        return range(k * PER_PART, min((k + 1) * PER_PART, len(self.lengths)))

    def _offer(self, i: int) -> Offer:
        n = self.lengths[i]
        return Offer(i, n, {XOR_ZSTD: n // 2 + 1, ZSTD: max(1, n - 1)})

    def truth(self, shard: int, enc: str, size: int) -> bytes:
        return random.Random(f"{shard}:{enc}").randbytes(size)

    # -- the driver --------------------------------------------------------------------------

    def do(self, actions: list[Action] | list[Action | End]) -> None:
        for a in actions:
            assert self.end is None, f"{a} after {self.end}"
            self.apply(a)

    def apply(self, a: Action | End) -> None:
        if isinstance(a, Fetch):
            if a.start:
                buf, pos = self.kept.pop(a.shard)
                assert (pos, len(buf)) == (a.start, a.size), a
            else:
                buf = bytearray(a.size)
            assert a.start + a.length == a.size
            self.reqs[a.req] = _Req(a, buf, a.start)
            dups = [r for r in self.reqs.values() if r.f.duplicate]
            assert len(dups) <= SCHED.endgame_max_total
            same = [r for r in self.reqs.values() if r.f.shard == a.shard]
            assert len(same) <= 1 + SCHED.endgame_duplicates
        elif isinstance(a, Cancel):
            if a.req in self.reqs:
                self.reqs[a.req].cancel = True
        elif isinstance(a, Keep):
            r = self.reqs[a.req]
            self.kept[a.shard] = (r.buf, r.pos)
        elif isinstance(a, Drop):
            self.kept.pop(a.shard, None)
        elif isinstance(a, Check):
            self.checks.append(a.req)
        elif isinstance(a, KeepSuspect):
            self.suspects[a.copy] = self.reqs[a.req].buf
        elif isinstance(a, Compare):
            bad, good = self.suspects.pop(a.copy), self.reqs[a.good].buf
            assert len(bad) == len(good)
            culprits = blame(a.contributions, bad, good)
            event("compare")
            self.do(self.s.compared(a.copy, a.shard, culprits, self.now))
        elif isinstance(a, Blame | Ban):
            assert a.source in self.sent_wrong, f"{a} of a source that sent only correct bytes"
            event(type(a).__name__)
        elif isinstance(a, PollHave):
            assert a.source in self.partial
        elif isinstance(a, Probe):
            self.s.probed(a.source, Answer.PRESENT, self.now)
        elif isinstance(a, Commit):
            assert self.written == set(range(len(self.lengths))), "commit with unverified shards"
            assert len(self.parts) == self.n_parts, "commit with missing parts"
            self.end = a
        else:
            assert isinstance(a, Fail)
            self.end = a

    def poll(self) -> None:
        if self.end is None:
            self.do(self.s.poll(self.now))

    def send(self, r: _Req, upto: int, lie: bool) -> None:
        """Bytes ``[r.pos, upto)`` of the request's encoded blob arrive."""
        f = r.f
        true = self.truth(f.shard, f.encoding, f.size)[r.pos : upto]
        if lie and true:
            self.sent_wrong.add(f.source)
            true = bytes(b ^ 0xFF for b in true)
        r.buf[r.pos : upto] = true
        r.pos = upto

    def end_transfer(self, rid: int, outcome: Outcome, lie: bool, frac: float) -> None:
        r = self.reqs[rid]
        f = r.f
        begin = f.start  # bytes may have arrived before (progress)
        if outcome is Outcome.OK:
            self.send(r, f.size, lie)
        elif outcome in (Outcome.BROKEN, Outcome.TIMEOUT, Outcome.UNREACHABLE, Outcome.HOLD_ENDED):
            self.send(r, f.start + int(frac * f.length), lie)
        elif outcome is Outcome.PROTOCOL_ERROR:
            self.sent_wrong.add(f.source)
        elif outcome is Outcome.CORRUPT_CHUNK:  # verified chunks kept, then one bad chunk
            self.send(r, f.start + int(frac * f.length), False)
            self.sent_wrong.add(f.source)
        self.do(self.s.transfer_ended(rid, outcome, r.pos - begin, self.now))
        if not r.checking and rid not in self.checks:
            del self.reqs[rid]
        self.poll()

    def finish_check(self, rid: int) -> None:
        self.checks.remove(rid)
        r = self.reqs[rid]
        f = r.f
        if bytes(r.buf) != self.truth(f.shard, f.encoding, f.size):
            verdict = Verdict.CORRUPT
        elif f.encoding in DELTAS and f.shard in self.base_broken:
            verdict = Verdict.BASE_MISMATCH if f.shard % 2 else Verdict.UNDECODABLE
        elif f.shard in self.written:
            verdict = Verdict.ALREADY_HELD
        else:
            verdict = Verdict.VERIFIED
            self.written.add(f.shard)
        self.do(self.s.shard_checked(rid, verdict, self.now))
        del self.reqs[rid]
        self.poll()

    def part_arrives(self, k: int) -> None:
        self.parts.add(k)
        self.s.part_arrived(k, [self.offers[i] for i in self._part(k)], self.now)
        self.poll()

    # -- phases ------------------------------------------------------------------------------

    def step(self) -> None:
        """One event chosen by Hypothesis."""
        draw = self.draw
        open_reqs = sorted(rid for rid in self.reqs if rid not in self.checks)
        kinds = ["time"]
        if open_reqs:
            kinds += ["end", "progress"]
        if self.checks:
            kinds.append("check")
        if len(self.parts) < self.n_parts:
            kinds.append("part")
        if self.partial:
            kinds.append("have")
        kind = draw(st.sampled_from(kinds))
        if kind == "time":
            self.now += draw(st.floats(0.01, 3.0))
            self.poll()
        elif kind == "end":
            rid = draw(st.sampled_from(open_reqs))
            src = self.reqs[rid].f.source
            choices = [Outcome.OK, *FAILURES]
            if src in self.liars:
                choices += [Outcome.PROTOCOL_ERROR, Outcome.CORRUPT_CHUNK]
            if self.reqs[rid].pos > self.reqs[rid].f.start:  # bytes came: no status now
                choices = [c for c in choices if c in _AFTER_BYTES]
            if self.reqs[rid].cancel:
                choices = [Outcome.CANCELLED, Outcome.OK]
            outcome = draw(st.sampled_from(choices))
            lie = src in self.liars and draw(st.booleans())
            self.end_transfer(rid, outcome, lie, draw(st.floats(0, 1)))
        elif kind == "progress":  # some bytes arrive; the session may judge it overdue
            rid = draw(st.sampled_from(open_reqs))
            r = self.reqs[rid]
            if r.pos == r.f.start:
                self.s.first_byte(rid, self.now)
            lie = r.f.source in self.liars and draw(st.booleans())
            self.send(r, r.pos + int(draw(st.floats(0, 1)) * (r.f.size - r.pos)), lie)
            self.now += draw(st.floats(0.01, 6.0))
            self.s.progress(self.now, rid, r.pos - r.f.start)
            self.poll()
        elif kind == "check":
            self.finish_check(draw(st.sampled_from(self.checks)))
        elif kind == "part":
            missing = sorted(set(range(self.n_parts)) - self.parts)
            self.part_arrives(draw(st.sampled_from(missing)))
        else:
            peer = draw(st.sampled_from(sorted(self.partial)))
            have = self.partial_have[peer]
            have |= draw(st.sets(st.integers(0, len(self.lengths) - 1)))
            full = len(have) == len(self.lengths)
            prefixes = draw(  # verified prefixes of shards it is still receiving
                st.dictionaries(
                    st.integers(0, len(self.lengths) - 1), st.integers(1, 64), max_size=3
                )
            )
            self.s.have_changed(peer, None if full else sorted(have), self.now, prefixes)
            self.poll()

    def settle(self, rounds: int) -> None:
        """Everyone behaves (liars keep lying): the session must end within ``rounds``."""
        for _ in range(rounds):
            if self.end is not None:
                return
            for rid in list(self.checks):
                if self.end is None and rid in self.checks:
                    self.finish_check(rid)
            for rid in sorted(self.reqs):
                if self.end is not None:
                    break
                r = self.reqs.get(rid)
                if r is None or rid in self.checks:
                    continue
                outcome = Outcome.CANCELLED if r.cancel else Outcome.OK
                self.end_transfer(rid, outcome, r.f.source in self.liars, 1.0)
            for k in sorted(set(range(self.n_parts)) - self.parts):
                if self.end is None:
                    self.part_arrives(k)
            self.now += 0.5
            self.poll()
        raise AssertionError(f"no end after {rounds} rounds: {self.s.sched.statistics()}")


@settings(
    max_examples=200,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(st.data())
def test_random_event_orders_keep_the_session_honest_and_bounded(data: st.DataObject) -> None:
    w = World(data)
    for _ in range(data.draw(st.integers(0, 80), label="events")):
        if w.end is not None:
            break
        w.step()
    w.settle(400)
    assert w.end is not None
    event("commit" if isinstance(w.end, Commit) else f"fail {w.end.reason.value}")
    stats = w.s.sched.statistics()
    event(f"resumed={min(stats.resumed, 1)} duplicates={min(stats.duplicates, 1)}")
    event(f"fallbacks={min(w.s.stats.delta_fallbacks, 1)}")
    if isinstance(w.end, Fail):
        assert w.end.text


class _Replay:
    """A stand-in for Hypothesis' ``data``: returns recorded draws in order."""

    def __init__(self, draws: list[object]) -> None:
        self.draws = list(draws)

    def draw(self, strategy: object, label: str | None = None) -> object:
        return self.draws.pop(0)


def test_a_suspect_copy_is_compared_only_with_a_verified_copy_of_its_encoding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An event order the property test found (kept verbatim): shard 1's 2-byte ``xor-zstd``
    blob, half from ``honest`` (broken transfer, prefix kept) and half from ``liar0``, fails
    its check and is kept as a suspect; the shard's base then proves broken, so it is fetched
    raw, also 2 bytes. Comparing the suspect blob with the raw bytes (same size, different
    encoding) blamed ``honest``; a suspect must be compared only with a verified copy in its
    own encoding (here none comes, so nobody is blamed for that shard)."""
    monkeypatch.setattr(sys.modules[__name__], "event", lambda *a, **k: None)  # no Hypothesis
    times = ["time", 1.0] * 6
    late = ["time", 0.25] * 3 + ["time", 0.01]
    world_draws: list[object] = [5, 1, 2, 1, 1, 1, {0, 1, 2}, {0, 1}, False, 1, 0, True]
    world_draws += [False, 147, True]
    w = World(
        cast(st.DataObject, _Replay([*world_draws, *times, "end", 0, Outcome.BROKEN, 0.5, *late]))
    )
    for _ in range(11):
        w.step()
    w.settle(400)
    assert isinstance(w.end, Commit)
    assert w.s.stats.delta_fallbacks >= 1  # the path under test was taken


def test_a_409_blames_nobody() -> None:
    """A source answering 409 (another version under this step) is not blamed or banned."""
    s = Session(3, [8], 1, [0], [Offer(0, 8)], [], random.Random(1), SessionConfig(SCHED), 0.0)
    s.add_source("a", True, 0.0)
    (fetch,) = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
    out = s.transfer_ended(fetch.req, Outcome.WRONG_VERSION, 0, 0.0)
    assert not [a for a in out if isinstance(a, Blame | Ban)]
    assert s.stats.corrupt_by_source == {}
    assert not s.sched.is_banned("a")


def test_a_base_mismatch_falls_back_to_raw_and_blames_nobody() -> None:
    offer = Offer(0, 8, {XOR_ZSTD: 3})
    cfg = SessionConfig(SCHED, use_base=True)
    s = Session(3, [8], 1, [0], [offer], [], random.Random(1), cfg, 0.0)
    s.add_source("a", True, 0.0)
    (fetch,) = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
    assert (fetch.encoding, fetch.size) == (XOR_ZSTD, 3)
    assert [type(a) for a in s.transfer_ended(fetch.req, Outcome.OK, 3, 0.0)] == [Check]
    out = s.shard_checked(fetch.req, Verdict.BASE_MISMATCH, 0.0)
    assert not [a for a in out if isinstance(a, Blame | Ban)]
    (again,) = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
    assert (again.encoding, again.size) == (RAW, 8)
    assert s.stats.delta_fallbacks == 1


def test_a_broken_transfer_resumes_at_the_kept_prefix_from_another_source() -> None:
    s = Session(3, [10], 1, [0], [Offer(0, 10)], [], random.Random(1), SessionConfig(SCHED), 0.0)
    s.add_source("a", True, 0.0)
    (first,) = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
    s.add_source("b", True, 0.0)
    assert s.transfer_ended(first.req, Outcome.BROKEN, 4, 0.0) == [Keep(first.req, 0)]
    (resume,) = [a for a in s.poll(0.1) if isinstance(a, Fetch)]
    assert (resume.source, resume.start, resume.length) == ("b", 4, 6)
    assert s.transfer_ended(resume.req, Outcome.OK, 6, 0.2) == [Check(resume.req, 0, RAW)]
    assert s.shard_checked(resume.req, Verdict.VERIFIED, 0.2) == []
    assert s.poll(0.2) == [Commit()]
    assert s.stats.resumed == 1


def test_a_body_ended_at_its_sources_hold_keeps_its_bytes_and_blocks_only_that_shard() -> None:
    """``HOLD_ENDED`` (a held range cut where the source's verified prefix ends) is the
    source's late 503: the bytes stay, nothing counts as a failure, the source is asked at
    once for another shard, and for this one again after ``penalty_s / 10``, resuming at the
    kept byte. ``BROKEN`` after the same bytes blocks the whole source for ``penalty_s``."""
    cfg = SessionConfig(dataclasses.replace(SCHED, per_source_inflight=1))

    def cut(outcome: Outcome) -> tuple[Session, Fetch]:
        s = Session(3, [10, 10], 1, [0], [Offer(0, 10), Offer(1, 10)], [], random.Random(1), cfg, 0)
        s.add_source("a", True, 0.0)
        (first,) = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
        assert s.transfer_ended(first.req, outcome, 4, 0.0) == [Keep(first.req, first.shard)]
        return s, first

    s, first = cut(Outcome.HOLD_ENDED)
    assert (s.stats.failures, s.stats.unavailable_by_source) == (0, {"a": 1})
    (other,) = [a for a in s.poll(0.0) if isinstance(a, Fetch)]  # the source is not blocked
    assert (other.source, other.shard) == ("a", 1 - first.shard)
    s.transfer_ended(other.req, Outcome.OK, 10, 0.05)
    s.shard_checked(other.req, Verdict.VERIFIED, 0.05)
    assert not [a for a in s.poll(0.05) if isinstance(a, Fetch)]  # this shard: not yet
    (resume,) = [a for a in s.poll(0.11) if isinstance(a, Fetch)]
    assert (resume.source, resume.shard, resume.start) == ("a", first.shard, 4)

    s, first = cut(Outcome.BROKEN)
    assert s.stats.failures == 1
    assert not [a for a in s.poll(0.5) if isinstance(a, Fetch)]  # the whole source waits
    assert [a.start for a in s.poll(1.01) if isinstance(a, Fetch) and a.shard == first.shard] == [4]


def test_a_refusal_naming_an_unreachable_holder_is_asked_again_at_once_naming_it() -> None:
    """Super-seeding rule 11 on the requester's side: a 429 whose named holder this node
    cannot reach is retried at once with that holder in ``Fetch.unreachable``; a refusal that
    names nothing new (an older source ignoring the names) waits ``refused_s`` as before."""
    s = Session(3, [8], 1, [0], [Offer(0, 8)], [], random.Random(1), SessionConfig(SCHED), 0.0)
    s.add_source("relay", True, 0.0)
    (first,) = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
    assert first.unreachable == ()
    s.transfer_ended(first.req, Outcome.REFUSED, 0, 0.0, unreachable=["nat-a"])
    (again,) = [a for a in s.poll(0.0) if isinstance(a, Fetch)]  # at once, same time
    assert (again.source, again.unreachable) == ("relay", ("nat-a",))
    assert s.stats.refused_unreachable == 1
    s.transfer_ended(again.req, Outcome.REFUSED, 0, 0.0, unreachable=["nat-a"])  # ignored
    assert [a for a in s.poll(0.0) if isinstance(a, Fetch)] == []  # no loop: it waits
    assert [a for a in s.poll(0.5) if isinstance(a, Fetch)] == []
    (later,) = [a for a in s.poll(SCHED.refused_s + 0.01) if isinstance(a, Fetch)]
    assert later.unreachable == ("nat-a",)  # still named: the holder is no nearer
    assert s.stats.refused_unreachable == 1
    s.transfer_ended(later.req, Outcome.REFUSED, 0, 1.1)  # a refusal naming no holder
    assert [a for a in s.poll(1.1) if isinstance(a, Fetch)] == []


def test_a_plain_refusal_waits_and_names_nobody() -> None:
    s = Session(3, [8], 1, [0], [Offer(0, 8)], [], random.Random(1), SessionConfig(SCHED), 0.0)
    s.add_source("relay", True, 0.0)
    (first,) = [a for a in s.poll(0.0) if isinstance(a, Fetch)]
    s.transfer_ended(first.req, Outcome.REFUSED, 0, 0.0)
    assert [a for a in s.poll(0.0) if isinstance(a, Fetch)] == []
    (again,) = [a for a in s.poll(SCHED.refused_s + 0.01) if isinstance(a, Fetch)]
    assert again.unreachable == ()
