"""core: source selection for shard downloads: a sans-IO scheduler.

Theory of operation
-------------------
A downloader holds a set of *sources* (its relays, the origin, other peers that hold all or
part of the version) and a set of missing shards. The driver (``shardcast.download.downloader``, or
the simulator in virtual time) asks :meth:`Scheduler.next_request` for work whenever it has a
free slot, performs the transfer, and reports back with ``on_first_byte`` / ``on_success`` /
``on_failure``. The scheduler does no I/O and reads no clock: ``now`` is an argument and all
randomness comes from the ``random.Random`` it is given, so the same inputs give the same
decisions (tests and the simulator rely on that).

Choosing a shard: shards nobody is fetching come first, rarest first (fewest sources that
hold them), ties broken by the seeded RNG so that peers spread over different shards instead
of all pulling shard 0 first. A partially received shard (a transfer broke mid-shard) resumes
at the byte where it stopped, from another source if one is eligible.

Choosing a source: among eligible sources (hold the shard, not penalized, below their in-flight
cap), pick the best expected completion time ``(queued bytes + shard) / rate``, where ``rate``
is an EWMA of measured throughput; its first sample replaces the prior. A sample runs from the
first byte to the last, so time spent waiting for a source to receive the shard itself (a
complete source, relay or origin, still filling the version; a peer streaming its verified
prefix) is not held against it, except for a shard a partial source (a peer) held whole when it
was asked: its wait for the first byte is then its own (a busy process, a slow lane, a queue on
its uplink), and the sample runs from the request (as for a light shard, a delta blob, that
arrived in a batch: :func:`~shardcast.core.batch.first_byte_times`). Otherwise a NATed peer
whose libp2p stream lane answers only after hundreds of milliseconds on a loaded machine, then
sends a small shard at once, would look faster than every public source and draw the requests
that then wait on it. An unmeasured source is assumed as fast as the best measured one (or
``initial_rate_bps`` before any measurement): a fixed optimistic prior would make every newly
discovered peer look faster than relays whose per-request throughput is split by the
downloader's own downlink, and pull traffic onto congested peer uplinks. Ties go to complete
sources (relays, origin) before partial ones (peers, whose uplinks also carry their own work).
With probability ``explore`` pick a random eligible source instead, so a source that was slow
once, or is new, gets measured again (epsilon-greedy).

Sources still receiving (the swarm): a partial source advertises, besides the shards it holds
whole, how many bytes of each shard it is receiving it has verified (chunk by chunk,
:mod:`shardcast.download.receive`), :meth:`Scheduler.set_prefixes`. Such a shard is eligible
from that source as soon as the source's verified prefix reaches past this node's own resume
offset: the source's HTTP lane streams the range as its chunks verify. A shard counts as held
by every source holding any of it, so rarest-first sends distinct shards to distinct peers from
the relays and leaves the common ones to the peers. Complete sources (relays, the origin) cost
``complete_cost_factor`` times their expected time, so a peer whose *measured* rate is within
that factor of a relay's takes the range and the relays' uplinks stay free for the bytes only
they have yet (an unmeasured peer gets no such bonus: it is not assumed faster than the best
measured source, and loses ties to complete ones).

Failures: a timeout or broken transfer multiplies the source's rate by ``failure_decay``
and blocks it for ``penalty_s`` (doubling per consecutive failure). Requests that were already
in flight when the source last failed share that failure's cause (its connection dropped, the
process died): they do not double the block again, so one outage with ``per_source_inflight``
requests in flight costs one ``penalty_s``, not ``2**per_source_inflight`` of them. A source
that the driver learns is back (:meth:`Scheduler.source_back`: its upstream answered again,
or it moved to a new URL) is unblocked at once. Bytes that fail their
digest penalize only the source that sent them: if a shard was assembled from several
sources, :func:`shardcast.core.blame.blame` compares it with the verified copy obtained later
and names the sources whose byte ranges differ. A source with ``max_corrupt`` (default 1: the
first proven) corrupt transfers is banned, and the requests it still has in flight are
returned for the driver to cancel. :class:`shardcast.core.blame.SourceBans` carries bans
across versions for a set time.

Overdue transfers: a transfer whose own progress (bytes since its first byte, reported by the
driver through :meth:`Scheduler.on_progress`) projects it to end ``overdue_factor`` times later
than the best other ready, measured source could deliver the rest, and at least
``overdue_min_s`` from now, is handed back by :meth:`Scheduler.overdue` for the driver to
cancel. The shard resumes at the byte the transfer reached, from another source; the slow
one's measured throughput becomes a sample of its rate, and it is not asked for that shard
again for ``overdue_min_s``.
Without this a node's request slots can all sit on home peers' congested uplinks for a
minute while a relay that could send the same bytes in a second stands idle: the rate of a
source is otherwise learnt only when a transfer from it ends.

Endgame: when every missing shard is already in flight, up to ``endgame_duplicates`` extra
requests per shard (and ``endgame_max_total`` overall) go to other sources; the first copy
to verify wins and :meth:`on_success` returns the duplicates to cancel.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from p2p.errors import LocalProtocolError, short_id
from shardcast.core.failure import FailureKind

_SCAN_LIMIT = 64  # idle shards looked at in heap order before a full scan


@dataclass(frozen=True)
class SchedulerConfig:
    """Tuning of the scheduler (units in names).

    Attributes:
        max_inflight: concurrent requests over all sources. Requests stream a shard as it
            arrives at its source (verified chunk prefixes), so every request in flight
            shares this node's downlink and its source's uplink: on shaped 200 Mb/s links
            (``bench/broadcast.py --shaped``) 8 in flight, 4 per source, made each 16 MiB shard
            take 4-14 s and the last ones finish late everywhere (last peer 14.3-15.5 s);
            4 and 2 gave 13.3-13.7 s.
        per_source_inflight: concurrent requests to one source.
        initial_rate_bps: assumed throughput of an unmeasured source, bytes/s.
        ewma_alpha: weight of the newest throughput sample.
        explore: probability of choosing a random eligible source.
        failure_decay: factor applied to a source's rate after a failure.
        penalty_s: base time a failing source is skipped, seconds (doubles per consecutive
            failure, capped at 32x).
        max_corrupt: corrupt transfers after which a source is banned.
        endgame_duplicates: extra concurrent requests per shard in the endgame.
        endgame_max_total: bound on duplicate requests in flight at once.
        rarity_slack: a rarer shard is skipped for a more common one when its best source is
            expected to take more than this factor longer to deliver it than the best source
            holding some idle shard would take for as many bytes; inf: strict rarest first.
        complete_cost_factor: expected time of a complete source (relay, origin) is
            multiplied by this when ranking sources (>= 1; 1: no preference for peers).
        refused_s: a source that refused a shard (``429``, super-seeding: it served that
            shard to another downloader moments ago) is not asked for that shard again for
            this long, seconds; other sources are (``503``, "not verified yet", waits
            ``penalty_s / 10``). Asking again at once only collects more refusals.
        light_slot_bytes: a request for a *light* shard (:meth:`Scheduler.mark_known`: a
            delta blob, which the driver asks a source for several at a time in one HTTP
            request, :mod:`shardcast.core.batch`) takes ``length / light_slot_bytes`` of a
            request slot (at most one), here and in ``per_source_inflight``: with 4 MiB,
            two slots of a source hold ~32 blobs of 250 KB (a next version's typical blob)
            instead of 2, in batches of 4 (1 MiB, ``batch.BATCH_BYTES``), not one request each.
        overdue_factor: a transfer projected (at its own throughput so far) to need more than
            this factor times what the best other ready, measured source is expected to take
            for the bytes it still lacks is handed back by :meth:`Scheduler.overdue` (> 1;
            inf: never).
        overdue_min_s: ... but not before it has run this long, nor when it is projected to
            end sooner than this, seconds (a short transfer is never worth cutting).
    """

    max_inflight: int = 4
    per_source_inflight: int = 2
    initial_rate_bps: float = 100e6
    ewma_alpha: float = 0.3
    explore: float = 0.1
    failure_decay: float = 0.5
    penalty_s: float = 1.0
    max_corrupt: int = 1
    endgame_duplicates: int = 1
    endgame_max_total: int = 4
    rarity_slack: float = 1.5
    complete_cost_factor: float = 1.25
    refused_s: float = 1.0
    light_slot_bytes: int = 4 << 20
    overdue_factor: float = 4.0
    overdue_min_s: float = 4.0

    def __post_init__(self) -> None:
        if not self.complete_cost_factor >= 1:
            raise LocalProtocolError("complete_cost_factor must be >= 1")
        if self.max_inflight < 1 or self.per_source_inflight < 1:
            raise LocalProtocolError("in-flight limits must be >= 1")
        if self.light_slot_bytes < 1:
            raise LocalProtocolError("light_slot_bytes must be >= 1")
        if not self.overdue_factor > 1 or not self.overdue_min_s >= 0:
            raise LocalProtocolError("overdue_factor must be > 1 and overdue_min_s >= 0")
        if not self.rarity_slack >= 1:
            raise LocalProtocolError("rarity_slack must be >= 1")
        if not 0 <= self.explore <= 1 or not 0 < self.ewma_alpha <= 1:
            raise LocalProtocolError("explore and ewma_alpha must be probabilities")


@dataclass
class SourceState:
    """What the scheduler knows of one source."""

    source: str
    rate_bps: float
    have: set[int] | None  # None: holds (or will hold) every shard
    inflight: int = 0
    load: int = 0  # request slots in flight, in units of 1 / light_slot_bytes of a slot
    queued_bytes: int = 0
    failures: int = 0
    consecutive_failures: int = 0
    corrupt: int = 0
    blocked_until: float = 0.0
    outages: int = 0  # failures that blocked it, plus recoveries (requests record the count)
    banned: bool = False
    bytes_received: int = 0
    samples: int = 0  # throughput samples taken (0: rate_bps is still the prior)
    not_before: dict[int, float] = field(default_factory=dict)  # shard -> when to ask again
    prefix: dict[int, int] = field(default_factory=dict)  # shard -> verified bytes (not in have)

    def holds(self, shard: int, offset: int) -> bool:
        """True if this source can serve ``shard`` from byte ``offset`` on (it holds it whole,
        or its verified prefix of it reaches past ``offset``)."""
        return self.have is None or shard in self.have or self.prefix.get(shard, 0) > offset


@dataclass(frozen=True)
class Request:
    """One transfer to perform: bytes ``[start, length)`` of shard ``shard`` from ``source``."""

    id: int
    shard: int
    source: str
    start: int
    length: int
    duplicate: bool


@dataclass
class _Flight:
    req: Request
    started: float
    outage: int = 0  # the source's ``outages`` when the request started
    first_byte: float | None = None
    units: int = 0  # the request's share of a slot (``light_slot_bytes`` = one slot)
    held_whole: bool = False  # a partial source held the (not light) shard whole when asked
    received: int = 0  # bytes of the request received so far (:meth:`Scheduler.on_progress`)
    overdue: bool = False  # handed back by :meth:`Scheduler.overdue`, not yet ended


@dataclass(frozen=True)
class SchedulerStats:
    """Counters for reports and tests."""

    requests: int
    duplicates: int
    failures: int
    corrupt: int
    resumed: int
    banned: tuple[str, ...]
    overdue: int = 0


@dataclass
class _ShardState:
    length: int
    known: bool = True  # its manifest part arrived (digest and encodings known)
    done: bool = False
    received: int = 0  # bytes of a partial transfer kept for resumption
    flights: list[int] = field(default_factory=list)
    light: bool = False  # a delta blob: its requests take a share of a slot (see config)


class Scheduler:
    """Decides which shard to fetch from which source next (see module docstring).

    Args:
        shard_lengths: length in bytes of every shard, by index.
        rng: the seeded random source (never the global RNG).
        config: tuning.
        have: indices already held (e.g. resumed from disk); they are never requested.
    """

    def __init__(
        self,
        shard_lengths: Sequence[int],
        rng: random.Random,
        config: SchedulerConfig | None = None,
        have: Iterable[int] = (),
        known: Iterable[int] | None = None,
    ) -> None:
        self.config = config or SchedulerConfig()
        self._rng = rng
        self._shards = [_ShardState(n, known=known is None) for n in shard_lengths]
        for i in known or ():
            self._shards[i].known = True
        for i in have:
            self._shards[i].done = True
        self._missing = sum(1 for s in self._shards if not s.done)
        # kept in step with the shard and source states so next_request stays cheap with
        # thousands of shards: shards known, not done, not in flight (and how many are not yet
        # known, not done: no endgame before that is 0); and, per shard, how many
        # non-banned partial sources hold it (whole, or a prefix: ``prefix`` maps shards to
        # bytes, so it is counted by its keys, never as a Counter would read a mapping)
        self._idle = {i for i, s in enumerate(self._shards) if s.known and not s.done}
        self._unknown = sum(1 for s in self._shards if not s.known and not s.done)
        self._held: Counter[int] = Counter()
        self._partial: set[int] = set()  # shards with a kept partial transfer (received > 0)
        # ties between equally rare shards are broken by a random order drawn once per
        # scheduler (seeded), so different downloaders spread over different shards; a lazy
        # heap of (partial holders, tie-break, shard) finds the rarest idle shard in
        # O(log n) instead of scanning every idle shard on every request
        self._tiebreak = [rng.random() for _ in shard_lengths]
        self._heap: list[tuple[int, float, int]] = [(0, self._tiebreak[i], i) for i in self._idle]
        heapq.heapify(self._heap)
        self._sources: dict[str, SourceState] = {}
        self._flights: dict[int, _Flight] = {}
        self._load = 0  # request slots in flight, in units (see SourceState.load)
        self._next_id = 0
        self._requests = self._duplicates = self._failures = self._corrupt = self._resumed = 0
        self._overdue = 0

    # -- sources -----------------------------------------------------------------------------

    def add_source(
        self, source: str, have: Iterable[int] | None = None, rate_bps: float | None = None
    ) -> None:
        """Add a source (or update its have-set). ``have=None`` means it serves every shard."""
        st = self._sources.get(source)
        hv = None if have is None else set(have)
        if st is None:
            st = self._sources[source] = SourceState(
                source, rate_bps or self.config.initial_rate_bps, hv
            )
        else:
            if st.have is not None and not st.banned:
                self._held.subtract(st.have)
                self._held.subtract(st.prefix.keys())  # one per shard, not its bytes
            st.prefix = {}
            st.have = hv
        if hv is not None and not st.banned:
            self._held.update(hv)

    def add_have(self, source: str, indices: Iterable[int]) -> None:
        """Record that ``source`` now holds more shards."""
        st = self._sources.get(source)
        if st is not None and st.have is not None:
            have, held, count = st.have, self._held, not st.banned
            for i in indices:
                if i not in have:
                    have.add(i)
                    if st.prefix.pop(i, 0):
                        continue  # already counted as held through its prefix
                    if count:
                        held[i] += 1

    def set_prefixes(self, source: str, prefixes: dict[int, int]) -> None:
        """Record the verified prefixes (bytes) of the shards ``source`` is still receiving
        (replacing the previous ones; shards it holds whole are ignored)."""
        st = self._sources.get(source)
        if st is None or st.have is None:
            return
        new = {
            i: n
            for i, n in prefixes.items()
            if n > 0 and i not in st.have and 0 <= i < len(self._shards)
        }
        if not st.banned:
            self._held.subtract(i for i in st.prefix if i not in new)
            self._held.update(i for i in new if i not in st.prefix)
        st.prefix = new

    def mark_known(self, index: int, length: int | None = None, light: bool = False) -> None:
        """Shard ``index`` may now be requested (its manifest part arrived); ``length`` is the
        number of bytes a transfer of it moves (e.g. its encoded size), if not the default;
        ``light``: it is fetched as a delta blob, batched by the driver, so a request for it
        takes ``length / light_slot_bytes`` of a request slot (:class:`SchedulerConfig`)."""
        s = self._shards[index]
        if not s.known and not s.done:
            self._unknown -= 1
        s.known = True
        s.light = light
        if not s.done and not s.flights:
            self._make_idle(index)
        if length is not None and length != s.length:  # another encoding: its prefix is void
            s.length = length  # (requests in flight keep their own length)
            self._set_received(index, 0)

    def remove_source(self, source: str) -> None:
        """Forget a source; its in-flight requests should be cancelled by the driver."""
        st = self._sources.pop(source, None)
        if st is not None and st.have is not None and not st.banned:
            self._held.subtract(st.have)
            self._held.subtract(st.prefix.keys())  # one per shard, not its bytes

    def sources(self) -> list[SourceState]:
        """Snapshot of the source states (for progress display)."""
        return list(self._sources.values())

    # -- state -------------------------------------------------------------------------------

    @property
    def missing(self) -> int:
        """Shards not yet verified."""
        return self._missing

    def done(self) -> bool:
        """True when every shard is verified."""
        return self._missing == 0

    def is_done(self, shard: int) -> bool:
        """True if ``shard`` is verified."""
        return self._shards[shard].done

    def coming(self, shard: int) -> bool:
        """True if ``shard`` is a delta blob (light) with a request in flight: a source
        that completes it too is no news to this downloader (see :meth:`Session.lacking`)."""
        s = self._shards[shard]
        return s.light and bool(s.flights)

    def inflight(self) -> int:
        """Requests in flight."""
        return len(self._flights)

    def _full(self, units: int, slots: int) -> bool:
        """True if ``units`` in flight fill ``slots`` request slots."""
        return units >= slots * self.config.light_slot_bytes

    def resume_offset(self, shard: int) -> int:
        """Bytes of ``shard`` already received and kept by the driver."""
        return self._shards[shard].received

    def statistics(self) -> SchedulerStats:
        """Counters so far."""
        return SchedulerStats(
            self._requests,
            self._duplicates,
            self._failures,
            self._corrupt,
            self._resumed,
            tuple(s.source for s in self._sources.values() if s.banned),
            self._overdue,
        )

    def explain(self, now: float, limit: int = 8) -> str:
        """Why nothing more is being fetched, in one log-friendly line (for a download that
        makes no progress): counts of missing, idle and unknown shards; the requests in flight
        (shard, source, seconds since sent, whether a byte arrived); and per source what keeps
        it from taking an idle shard (``banned``, ``full``, ``blocked=<s>``, shards it lacks,
        per-shard delays). At most ``limit`` requests are listed. Pure: reads no clock."""
        idle, unknown = self._idle, self._unknown
        flights = sorted(self._flights.values(), key=lambda f: f.started)
        parts = [
            f"missing={self._missing} idle={len(idle)} unknown={unknown} "
            f"inflight={len(flights)}/{self.config.max_inflight}"
        ]
        for fl in flights[:limit]:
            r = fl.req
            parts.append(
                f"req={r.shard}@{short_id(r.source)}+{r.start}"
                f"{'dup' if r.duplicate else ''}:{now - fl.started:.1f}s"
                f"{'' if fl.first_byte is None else ':bytes'}"
            )
        cap = self.config.per_source_inflight
        for st in self._sources.values():
            why = []
            if st.banned:
                why.append("banned")
            if self._full(st.load, cap):
                why.append("full")
            if st.blocked_until > now:
                why.append(f"blocked={st.blocked_until - now:.1f}s")
            lacks = sum(1 for i in idle if not st.holds(i, self._shards[i].received))
            if lacks:
                why.append(f"lacks={lacks}")
            delayed = [st.not_before[i] - now for i in idle if st.not_before.get(i, 0.0) > now]
            if delayed:
                why.append(f"delayed={len(delayed)}<={max(delayed):.1f}s")
            held = "all" if st.have is None else f"{len(st.have)}+{len(st.prefix)}p"
            parts.append(
                f"src={short_id(st.source)}:have={held}:inflight={st.inflight}"
                f":{','.join(why) or 'ready'}"
            )
        return " ".join(parts)

    # -- decisions ---------------------------------------------------------------------------

    def _ready(self, now: float, exclude: set[str]) -> list[SourceState]:
        """Sources that could take a request now for some shard (not banned, excluded,
        full or blocked), in insertion order."""
        cap = self.config.per_source_inflight
        return [
            st
            for st in self._sources.values()
            if not (
                st.banned
                or st.source in exclude
                or self._full(st.load, cap)
                or st.blocked_until > now
            )
        ]

    def _eligible(
        self,
        shard: int,
        now: float,
        exclude: set[str],
        ready: list[SourceState] | None = None,
        offset: int | None = None,
    ) -> list[SourceState]:
        """Ready sources (or those of ``ready``) not in ``exclude`` that hold ``shard`` from
        ``offset`` (default: where the shard resumes) and may be asked for it now."""
        out = []
        offset = self._shards[shard].received if offset is None else offset
        for st in self._ready(now, exclude) if ready is None else ready:
            if not st.holds(shard, offset):
                continue
            if st.not_before.get(shard, 0.0) > now:
                continue
            out.append(st)
        return out

    def _pick_source(
        self,
        shard: int,
        now: float,
        exclude: set[str],
        ready: list[SourceState] | None = None,
        explore: bool | None = None,
        prior: float | None = None,
    ) -> SourceState | None:
        """The best eligible source for ``shard`` (a random one when exploring; ``explore``
        None: flip the ``explore`` coin here)."""
        cands = self._eligible(shard, now, exclude, ready)
        if not cands:
            return None
        if explore is None:
            explore = len(cands) > 1 and self._rng.random() < self.config.explore
        if explore:
            return self._rng.choice(cands)
        length = self._shards[shard].length
        p = self._prior_rate() if prior is None else prior
        return min(cands, key=lambda s: self._cost(s, length, p))

    def _pick_ranked(self, shard: int, now: float, ranked: list[SourceState]) -> SourceState | None:
        """The first source of ``ranked`` (ready sources in ascending :meth:`_cost` for this
        shard's length) that is eligible for ``shard``: :meth:`_pick_source` without the
        per-shard sort, for scanning many shards against one snapshot of the sources."""
        offset = self._shards[shard].received
        for st in ranked:
            if not st.holds(shard, offset):
                continue
            if st.not_before.get(shard, 0.0) > now:
                continue
            return st
        return None

    def _cost(self, st: SourceState, length: int, prior: float) -> tuple[float, bool, str]:
        """(expected seconds until ``length`` more bytes arrive from ``st``, partial, id)."""
        rate = st.rate_bps if st.samples else min(st.rate_bps, prior)
        factor = self.config.complete_cost_factor if st.have is None or not st.samples else 1.0
        return (
            (st.queued_bytes + length) / max(rate, 1.0) * factor,
            st.have is not None,
            st.source,
        )

    def _prior_rate(self) -> float:
        """Assumed throughput of an unmeasured source, bytes/s: the best measured rate."""
        return max(
            (s.rate_bps for s in self._sources.values() if s.samples and not s.banned),
            default=self.config.initial_rate_bps,
        )

    def _make_idle(self, index: int) -> None:
        if index not in self._idle:
            self._idle.add(index)
            heapq.heappush(self._heap, (self._held.get(index, 0), self._tiebreak[index], index))

    def next_request(self, now: float) -> Request | None:
        """The next transfer to start, or None if nothing can start now.

        Call repeatedly while it returns requests and the driver has free slots.
        """
        if self._full(self._load, self.config.max_inflight) or not self._missing:
            return None
        if not self._idle:
            if self._unknown:
                return None  # shards wait for their manifest part: no endgame yet
            return self._endgame(now)
        ready = self._ready(now, set())
        if not ready:  # every source full or blocked: no shard can start
            return None
        base = sum(1 for s in self._sources.values() if not s.banned and s.have is None)
        req = self._next_resumable(now, ready)
        if req is not None:
            return req
        return self._next_rarest(now, ready, base)

    def _next_resumable(self, now: float, ready: list[SourceState]) -> Request | None:
        """A request for an idle shard whose transfer broke mid-shard and whose prefix is kept
        (most received first), or None if no ready source can serve one."""
        resumable = [i for i in self._partial if i in self._idle]
        for i in sorted(
            resumable,
            key=lambda i: (-self._shards[i].received, self._held.get(i, 0), self._tiebreak[i]),
        ):
            st = self._pick_source(i, now, set(), ready)
            if st is not None:
                return self._start(i, st, now, duplicate=False)
        return None

    def _next_rarest(self, now: float, ready: list[SourceState], base: int) -> Request | None:
        """A request for the rarest idle shard (fewest partial holders; ``base`` complete
        sources hold every shard), unless the rarer shard's best source is much slower than
        what another idle shard can get (rarity_slack): a congested relay must not hold every
        slot while idle peers hold shards this node lacks. Scans at most ``_SCAN_LIMIT`` heap
        entries, then every idle shard; the entries popped go back on the heap."""
        explore = len(ready) > 1 and self._rng.random() < self.config.explore
        prior = self._prior_rate()
        holders = None if explore else self._idle_holders(ready)  # the rarity bar's sources
        aside: list[tuple[int, float, int]] = []
        fallback: tuple[int, SourceState] | None = None
        rankings: dict[int, list[SourceState]] = {}  # shard length -> ready sources by cost
        try:
            while self._heap and len(aside) < _SCAN_LIMIT:
                popped = self._pop_idle(aside)
                if popped is None:
                    continue
                i, held = popped
                if base + held == 0:
                    continue  # no source holds it
                length = self._shards[i].length
                st = self._pick_cheapest(i, now, ready, explore, prior, rankings)
                if st is None:
                    continue
                bar = None if holders is None else self._rarity_bar(holders, length, prior)
                if bar is None or self._cost(st, length, prior)[0] <= bar:
                    return self._start(i, st, now, duplicate=False)
                if fallback is None:
                    fallback = (i, st)
            if fallback is not None:
                return self._start(fallback[0], fallback[1], now, duplicate=False)
            if self._heap:  # many unschedulable shards in front: look at every idle one
                return self._next_any_idle(now, ready, base, explore)
            return None
        finally:
            for entry in aside:
                if entry[2] in self._idle:
                    heapq.heappush(self._heap, entry)

    def _pop_idle(self, aside: list[tuple[int, float, int]]) -> tuple[int, int] | None:
        """Pop the heap's top entry: (shard, partial holders) if the shard is idle and
        unstarted (its up-to-date entry appended to ``aside``), else None (a stale entry
        dropped, or one with more holders since it was queued pushed back at its place)."""
        held, tb, i = heapq.heappop(self._heap)
        if i not in self._idle or self._shards[i].received:
            return None  # stale entry (in flight, done) or handled by _next_resumable
        cur = self._held.get(i, 0)
        if cur > held:  # more holders since it was queued: requeue at its place
            heapq.heappush(self._heap, (cur, tb, i))
            return None
        aside.append((cur, tb, i))
        return i, cur

    def _pick_cheapest(
        self,
        shard: int,
        now: float,
        ready: list[SourceState],
        explore: bool,
        prior: float,
        rankings: dict[int, list[SourceState]],
    ) -> SourceState | None:
        """The source for ``shard`` in the rarest-first scan: a random eligible one when
        exploring, else the cheapest by :meth:`_cost`, ranking ``ready`` once per shard length
        (cached in ``rankings``)."""
        if explore:
            return self._pick_source(shard, now, set(), ready, explore, prior)
        length = self._shards[shard].length
        ranked = rankings.get(length)
        if ranked is None:
            ranked = sorted(ready, key=lambda s: self._cost(s, length, prior))
            rankings[length] = ranked
        return self._pick_ranked(shard, now, ranked)

    def _next_any_idle(
        self, now: float, ready: list[SourceState], base: int, explore: bool
    ) -> Request | None:
        """A request for the first idle, unstarted shard with a holder, in rarity order, that a
        ready source can serve: the full scan behind the heap's bounded one."""
        for i in sorted(self._idle, key=lambda i: (self._held.get(i, 0), self._tiebreak[i])):
            if base + self._held.get(i, 0) == 0 or self._shards[i].received:
                continue
            st = self._pick_source(i, now, set(), ready, explore)
            if st is not None:
                return self._start(i, st, now, duplicate=False)
        return None

    def _idle_holders(self, ready: list[SourceState]) -> list[SourceState]:
        """The ready sources that hold an idle shard (whole or a verified prefix)."""
        return [
            st for st in ready if st.have is None or not st.have.isdisjoint(self._idle) or st.prefix
        ]

    def _rarity_bar(self, holders: list[SourceState], length: int, prior: float) -> float:
        """``rarity_slack`` x the least :meth:`_cost` of ``length`` bytes (a candidate
        shard's own length) over ``holders`` (inf if none). Taken per byte at the typical
        shard length instead, it failed every delta blob (~1 % of a shard) once a few were
        queued, and each :meth:`_next_rarest` scan looked at 64 shards for nothing."""
        best = min((self._cost(st, length, prior)[0] for st in holders), default=math.inf)
        return best * self.config.rarity_slack

    def _availability(self, shard: int) -> int:
        return sum(1 for s in self._sources.values() if not s.banned and s.holds(shard, 0))

    def _endgame(self, now: float) -> Request | None:
        dup_total = sum(1 for f in self._flights.values() if f.req.duplicate)
        if dup_total >= self.config.endgame_max_total:
            return None
        cands = [
            i
            for i, s in enumerate(self._shards)
            if not s.done and 0 < len(s.flights) <= self.config.endgame_duplicates
        ]
        self._rng.shuffle(cands)
        for i in cands:
            busy = {self._flights[f].req.source for f in self._shards[i].flights}
            st = self._pick_source(i, now, busy)
            if st is not None:
                return self._start(i, st, now, duplicate=True)
        return None

    def _start(self, shard: int, st: SourceState, now: float, duplicate: bool) -> Request:
        s = self._shards[shard]
        start = 0 if duplicate else s.received
        if start:
            self._resumed += 1
        req = Request(self._next_id, shard, st.source, start, s.length - start, duplicate)
        self._next_id += 1
        slot = self.config.light_slot_bytes
        units = min(slot, max(1, req.length)) if s.light else slot
        held_whole = not s.light and st.have is not None and shard in st.have
        self._flights[req.id] = _Flight(req, now, st.outages, units=units, held_whole=held_whole)
        s.flights.append(req.id)
        self._idle.discard(shard)
        st.inflight += 1
        st.load += units
        self._load += units
        st.queued_bytes += req.length
        self._requests += 1
        self._duplicates += duplicate
        return req

    # -- outcomes ----------------------------------------------------------------------------

    def _finish(self, req_id: int) -> tuple[_Flight, SourceState | None]:
        fl = self._flights.pop(req_id)
        s = self._shards[fl.req.shard]
        s.flights.remove(req_id)
        if not s.flights and s.known and not s.done:
            self._make_idle(fl.req.shard)
        st = self._sources.get(fl.req.source)
        self._load -= fl.units
        if st is not None:
            st.inflight -= 1
            st.load -= fl.units
            st.queued_bytes -= fl.req.length
        return fl, st

    def on_first_byte(self, req_id: int, now: float) -> None:
        """The first byte of a request arrived (starts its throughput clock, unless a partial
        source held the shard whole when asked: see the module docstring)."""
        fl = self._flights.get(req_id)
        if fl is not None and fl.first_byte is None:
            fl.first_byte = now

    def on_progress(self, req_id: int, received: int) -> None:
        """``received`` bytes of request ``req_id`` have arrived so far (its throughput, from
        its first byte, is what :meth:`overdue` projects with)."""
        fl = self._flights.get(req_id)
        if fl is not None:
            fl.received = received

    def overdue(self, now: float) -> list[int]:
        """Requests the driver should cancel (then report with ``on_failure(kind=OVERDUE,
        received=...)``) because another source is expected to deliver the rest of their
        shard much sooner (module docstring, ``overdue_factor``, ``overdue_min_s``).

        Only first copies of whole shards (not endgame duplicates, not delta blobs, which are
        batched) that have received bytes are judged; each one is returned once. Only measured
        sources are alternatives: an unmeasured one is assumed as fast as the best measured
        (or ``initial_rate_bps``), a guess too optimistic to cut a transfer for (a relay whose
        uplink is the bottleneck would draw every transfer its peers forward to each other).
        Sources it picks as the alternative are charged the bytes they would take over, so
        several slow transfers are not all handed to one source that can take one. Pure:
        reads no clock.
        """
        cfg = self.config
        if math.isinf(cfg.overdue_factor):
            return []
        out: list[int] = []
        extra: dict[str, int] = {}  # bytes this call already plans to move to a source
        for rid, fl in self._flights.items():
            req = fl.req
            if fl.overdue or req.duplicate or fl.first_byte is None or not fl.received:
                continue
            s = self._shards[req.shard]
            if s.light or s.done or now - fl.started < cfg.overdue_min_s:
                continue
            rest = req.length - fl.received
            projected = rest / _throughput(fl, fl.first_byte, now)
            if projected < cfg.overdue_min_s:
                continue
            offset = req.start + fl.received
            best: tuple[float, SourceState] | None = None
            for st in self._eligible(req.shard, now, {req.source}, offset=offset):
                if not st.samples:  # an unmeasured source's speed is a guess: no reason to cut
                    continue
                cost = self._cost(st, rest + extra.get(st.source, 0), st.rate_bps)[0]
                if best is None or cost < best[0]:
                    best = (cost, st)
            if best is None or projected <= cfg.overdue_factor * best[0]:
                continue
            extra[best[1].source] = extra.get(best[1].source, 0) + rest
            fl.overdue = True
            out.append(rid)
        return out

    def handed_back(self, req_id: int) -> bool:
        """True if request ``req_id`` is in flight and :meth:`overdue` returned it (the driver
        was told to cancel it; it has not been reported ended yet)."""
        fl = self._flights.get(req_id)
        return fl is not None and fl.overdue

    def on_success(self, req_id: int, now: float) -> list[int]:
        """The request's bytes completed the shard and it verified.

        Returns:
            ids of duplicate requests for the same shard, which the driver should cancel
            (and then report with :meth:`on_cancelled`).
        """
        fl, st = self._finish(req_id)
        if st is not None:
            t0 = fl.first_byte if fl.first_byte is not None and not fl.held_whole else fl.started
            self._sample(st, fl.req.length / max(now - t0, 1e-6))
            st.consecutive_failures = 0
            st.bytes_received += fl.req.length
        s = self._shards[fl.req.shard]
        if not s.done:
            if not s.known:
                self._unknown -= 1
            s.done = True
            self._set_received(fl.req.shard, 0)
            self._missing -= 1
            self._idle.discard(fl.req.shard)
        return list(s.flights)

    def on_cancelled(self, req_id: int) -> None:
        """A request was cancelled by the driver (endgame loser, shutdown)."""
        if req_id in self._flights:
            self._finish(req_id)

    def on_failure(
        self,
        req_id: int,
        now: float,
        *,
        kind: FailureKind,
        received: int = 0,
        kept: bool = False,
    ) -> list[int]:
        """A request failed.

        Args:
            req_id: the request.
            now: current time, seconds.
            kind: how it failed; each :class:`~shardcast.core.failure.FailureKind` says
                what the source and the shard pay.
            received: bytes of this request received and kept by the driver for resuming
                (the kinds that are :attr:`~FailureKind.resumable`, and ``CORRUPT`` with
                ``kept``); the shard's resume offset advances by it.
            kept: for ``CORRUPT``: the driver kept the bytes before the bad chunk (each
                verified against the signed chunk list), so the shard resumes at
                ``start + received`` instead of from 0.

        Returns:
            requests to cancel: those still in flight to a source this failure just banned.
        """
        failed = self._flights[req_id].req
        if kind.stalls and not failed.duplicate:
            # behind the shards nobody tried yet (same rarity): a source that stalls on some
            # shards must not get the same ones first again and hold every request slot
            self._tiebreak[failed.shard] += 1.0
        fl, st = self._finish(req_id)
        s = self._shards[fl.req.shard]
        keeps = kind.resumable or (kind is FailureKind.CORRUPT and kept)  # verified chunks
        if keeps and not fl.req.duplicate and not s.done:
            self._set_received(fl.req.shard, fl.req.start + received)
        elif kind in (FailureKind.CORRUPT, FailureKind.SUSPECT):
            self._set_received(fl.req.shard, 0)
        if st is None:
            return []
        if kind is FailureKind.OVERDUE:
            self._cut(fl, st, now)
            return []
        self._failures += 1
        if kind is FailureKind.SUSPECT:
            return []
        if kind is FailureKind.REFUSED:  # it serves others first: ask elsewhere
            st.not_before[fl.req.shard] = now + self.config.refused_s
            return []
        if kind is FailureKind.REFUSED_UNREACHABLE:  # asked again naming the holder: no wait
            return []
        if kind in (FailureKind.UNAVAILABLE, FailureKind.HOLD_ENDED):  # others first
            if st.have is not None:
                if fl.req.shard in st.have or fl.req.shard in st.prefix:
                    st.have.discard(fl.req.shard)
                    st.prefix.pop(fl.req.shard, None)
                    if not st.banned:
                        self._held[fl.req.shard] -= 1
            st.not_before[fl.req.shard] = now + self.config.penalty_s / 10
            return []
        if kind is FailureKind.CORRUPT:
            return self.penalize_corrupt(st.source, now)
        st.failures += 1
        if fl.outage < st.outages:
            return []  # in flight when the source last failed: the same outage, counted once
        st.consecutive_failures += 1
        st.outages += 1
        self._decay(st)
        st.blocked_until = now + self.config.penalty_s * min(
            32.0, 2.0 ** (st.consecutive_failures - 1)
        )
        return []

    def _cut(self, fl: _Flight, st: SourceState, now: float) -> None:
        """``fl`` was cut as overdue: slow, not failed. Its throughput so far is a sample of
        its source's rate, and that source is not asked for the shard for ``overdue_min_s``."""
        self._overdue += 1
        if fl.first_byte is not None and fl.received:
            self._sample(st, _throughput(fl, fl.first_byte, now))
        st.not_before[fl.req.shard] = now + self.config.overdue_min_s

    def _sample(self, st: SourceState, rate_bps: float) -> None:
        """A measured throughput of ``st``, bytes/s: its first replaces the prior, later ones
        enter the EWMA (``ewma_alpha``)."""
        a = self.config.ewma_alpha
        st.rate_bps = (1 - a) * st.rate_bps + a * rate_bps if st.samples else rate_bps
        st.samples += 1

    def source_back(self, source: str, now: float) -> None:
        """The driver learned that ``source`` is reachable again (its upstream answered after
        an outage, or it restarted at a new URL): lift its failure block and reset its
        consecutive-failure count, so it is asked at once instead of after a backoff sized
        for the outage. Bans (corrupt bytes) and per-shard ``unavailable`` delays stay."""
        st = self._sources.get(source)
        if st is None:
            return
        st.consecutive_failures = 0
        st.outages += 1  # what is still in flight was sent before: its failures count no more
        st.blocked_until = min(st.blocked_until, now)

    def _decay(self, st: SourceState) -> None:
        base = st.rate_bps if st.samples else min(st.rate_bps, self._prior_rate())
        st.rate_bps = base * self.config.failure_decay

    def discard_partial(self, shard: int) -> None:
        """Forget the bytes kept for resuming ``shard`` (e.g. the assembled copy was bad)."""
        self._set_received(shard, 0)

    def _set_received(self, shard: int, received: int) -> None:
        self._shards[shard].received = received
        if received:
            self._partial.add(shard)
        else:
            self._partial.discard(shard)

    def penalize_corrupt(self, source: str, now: float) -> list[int]:
        """Record that ``source`` sent bytes that failed a digest (ban after max_corrupt).

        Returns:
            the ids of requests still in flight to ``source`` if this call banned it (the
            driver cancels them and reports each with :meth:`on_cancelled`), else ``[]``.
        """
        st = self._sources.get(source)
        if st is None:
            return []
        self._corrupt += 1
        st.corrupt += 1
        self._decay(st)
        st.blocked_until = now + self.config.penalty_s * 4
        if st.corrupt >= self.config.max_corrupt and not st.banned:
            return self.ban(source)
        return []

    def ban(self, source: str) -> list[int]:
        """Never ask ``source`` again in this download (e.g. banned in an earlier version).

        Returns:
            the ids of requests in flight to it, for the driver to cancel.
        """
        st = self._sources.get(source)
        if st is None or st.banned:
            return []
        if st.have is not None:
            self._held.subtract(st.have)
            self._held.subtract(st.prefix.keys())  # one per shard, not its bytes
        st.banned = True
        return [rid for rid, fl in self._flights.items() if fl.req.source == source]

    def is_banned(self, source: str) -> bool:
        """True if ``source`` is banned in this download."""
        st = self._sources.get(source)
        return st is not None and st.banned


def _throughput(fl: _Flight, since: float, now: float) -> float:
    """Bytes/s of ``fl``'s bytes received so far, counted from ``since`` (seconds)."""
    return fl.received / max(now - since, 1e-6)
