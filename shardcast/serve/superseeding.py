"""serve: super-seeding, the origin's fan-out rule, sans-IO (shared with the simulator).

:class:`SuperSeeding`: a shard's bytes go to the first requester; another requester within
``window_s`` is refused (it fetches the shard from a relay that has it), and repeats after the
window come out of a budget (10 % of the shards by default), so the origin's egress stays near
one copy of each version however many nodes ask (BitTorrent "super-seeding"; the budget is
ours). Requesters are authenticated PeerIDs (:mod:`shardcast.wire.lane_auth`); anonymous
clients never hold a reservation and get their own bounded share; a reservation whose holder a
requester reports failing is released at once. A refusal names the shard's holder
(:attr:`Decision.holders`; on the wire ``X-Shardnet-Holder``); a requester with no lane to it
(behind a NAT the holder's cannot be punched through, say) says so on its next request and is
served at once (rule 11), instead of waiting out the window. A version whose offered bytes are few
(``small_version_bytes``, e.g. a sparse delta) is not super-seeded at all: a refusal costs
every requester a round trip and the version an extra hop, which buys nothing when serving
every requester a copy costs the origin less than a second of its uplink. Shards nobody holds
yet are spread over the requesters (rule 12): one that already holds its share of the version
is refused a new one for a moment, so that each downloader gets distinct shards to trade
(BitTorrent's super-seeding hands each peer a different piece for the same reason); without
it the fastest asker won every race for a relay's newest shard and alone fed everyone else.

It takes ``now`` as an argument and does no I/O, so :mod:`shardcast.serve.server` and
``simulations/`` run the very same decisions. (Retention, once in the same module, is
:mod:`shardcast.core.retention`.)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum

# the wire's bound on the holders a refusal names (:attr:`Decision.holders`) and on those a
# request names as failing (rule 6) or unreachable (rule 11)
from p2p.http_checks import MAX_HOLDERS

SUPER_SEED_S = 5.0
"""The super-seeding window the command line's origin and relays use (``serve_once_s``), and
the simulator's model of them, seconds: shaped 200 Mb/s bench, last peer 17.7 s with it, 20.0 s
without; relays' egress -30 %. A library :class:`~shardcast.node.NodeConfig` has it off (None)
unless told; ``shardnet peer`` never super-seeds."""

SUPER_SEED_MIN_BYTES = 32 << 20
"""With :data:`SUPER_SEED_S`: versions offering at most this many bytes in all (deltas,
usually) are served to every requester (``serve_once_min_bytes``; rule 9), bytes."""


class Requester(Enum):
    """What a serving node knows of an authenticated requester, from its signed advert
    (:attr:`shardcast.serve.server.VersionServer.requester_kind`); value = metric label."""

    SERVING = "serving"
    """It serves others (a reachable lane, or a stream lane behind a NAT), or nothing is
    known of it: it may hold a shard (rules 1-6)."""
    SIBLING = "sibling"
    """A relay of this relay's own tier: never super-seeded to (siblings fetch a shard from
    each other at once; each shard still enters the tier below once per relay)."""
    DOWNLOAD_ONLY = "download_only"
    """Its advert offers no lane anyone outside its own network can use (a peer behind a
    NAT that does not serve through it): rule 10."""


class Refusal(Enum):
    """Why a request was refused (value = metric label)."""

    WINDOW = "window"
    """Another node was served a shard of it less than ``window_s`` ago (rule 3)."""
    BUDGET = "budget"
    """The step's repeat budget is spent and the requester has not persisted (rule 5)."""
    ANONYMOUS_SHARE = "anonymous_share"
    """The step's anonymous share is spent (rule 7)."""
    SPREAD = "spread"
    """The requester already holds its share of the step's shards; a shard nobody holds
    goes to another requester first (rule 12). Names no holder."""
    FIRST_COPIES = "first_copies"
    """A repeat while this node is still sending first copies of the step, and the
    requester has not persisted (rule 13)."""


@dataclass(frozen=True)
class Decision:
    """:meth:`SuperSeeding.decide`'s answer.

    Attributes:
        allowed: the request may be served now (the serve is recorded).
        refusal: why not (None when allowed).
        holders: for a refusal, the nodes (PeerIDs) holding the refused shards, which the
            requester should fetch them from, at most :data:`p2p.http_checks.MAX_HOLDERS`, in the
            order of the request's shards; empty when allowed or anonymous.
    """

    allowed: bool
    refusal: Refusal | None = None
    holders: tuple[str, ...] = ()


ALLOWED = Decision(True)


@dataclass
class _Scan:
    """What :meth:`SuperSeeding._scan` found over a request's shards."""

    repeats: int = 0
    released: list[int] = field(default_factory=list)  # rule 6
    bypassed: list[int] = field(default_factory=list)  # rule 11
    refused: int | None = None  # the first shard refused within the window (rule 3)
    holders: list[str] = field(default_factory=list)  # of the refused shards
    fresh: list[int] = field(default_factory=list)  # shards nobody holds (rule 1)


class SuperSeeding:
    """Per-(step, shard) first-requester memory of an origin (see module docstring).

    Rule, per shard of a request (the request is allowed only if every shard is):

    1. nobody got the shard yet: allowed, and the requester is recorded as its first;
    2. the same requester asks again (a retry or a resumed transfer): allowed;
    3. another requester within ``window_s`` of the shard's last serve: refused (it fetches
       the shard from a relay that has it);
    4. after the window, a *repeat*: allowed while the step's repeats stay within
       ``repeat_budget`` x its shard count, so that the origin's egress stays near
       ``1 + repeat_budget`` copies of the version however many nodes ask;
    5. over budget: allowed only to a requester that has kept asking for that shard for
       ``persist_s`` since its first refusal. An honest node that can fetch the shard
       elsewhere does so after one refusal; one that keeps asking finds no other source (say
       the first requester withholds it), so the swarm never stalls on a shard that only the
       origin serves.
    6. a requester that names the shard's holder as failing (it stalled, broke, answered 503
       or sent bad bytes for that shard) is served at once and becomes the holder; each
       requester may do so for at most ``report_share`` of a step's shards (at least 4).
    7. an anonymous requester (``requester=None``) never becomes a holder, so it never delays
       anyone; it is served while the step's anonymous serves stay within
       ``anonymous_share`` x its shard count.
    8. a holder that left (:meth:`holder_gone`: its last libp2p connection to the origin
       closed, e.g. a relay killed mid-broadcast) holds nothing it was served before it left:
       those shards go to the next requester at once (rule 1), instead of after
       ``window_s + persist_s``.
    9. a small version (``version_bytes`` given and at most ``small_version_bytes``) is served
       to every requester, without recording a holder or spending a budget.
    10. a download-only requester (:attr:`Requester.DOWNLOAD_ONLY`) is asked like any other
        (refused within the window of a shard another node holds) but never becomes a holder:
        nobody else could fetch the shard from it, so refusing others for its sake only
        delays them (a relay handed its first copies to download-only peers behind NATs and
        refused every serving peer for the window: 13x slower versions).
    11. a refusal names the shards' holders (:attr:`Decision.holders`); a requester that
        names a shard's holder as unreachable (it has no lane to it: none in its network's
        scope, or only through a hole punch that failed, e.g. both behind NATs, one of them
        symmetric) is served that shard at once and becomes its holder, as under rule 6, but
        from its own share: at most ``unreachable_share`` of a step's shards per requester
        (at least 4). A stream-lane-only holder behind a NAT keeps its reservation for those
        who can punch to it (treating it as download-only, rule 10, would send every
        requester to the origin when NATs allow punches) while those who cannot are not
        delayed by ``window_s``. A requester that lies gets at most that share of each step
        from the origin: what rules 4-5 give it after ``window_s + persist_s`` anyway.
    12. spread: a request for shards nobody holds (rule 1) from a requester that already
        holds its share of the step, ``ceil(total_shards / askers)`` where ``askers`` counts
        the holder-capable requesters (not download-only, not anonymous) that asked this
        node for the step within ``window_s``, is refused (:attr:`Refusal.SPREAD`, no holder
        named) so that another asker takes those shards and each has distinct shards to
        trade; once the requester has asked for such a shard for ``window_s`` it is served
        (a shard nobody else wants is never withheld longer), and a lone asker's share is
        the whole version. Only while every asker is a *veteran*, served shards of an
        earlier step by this node: a new asker's lane is still being proven and its hole
        punches are not made yet, so shards spread to it would keep the others waiting
        (the first version of a run, spread: 7.1 s instead of 1.9 s to the last of six
        peers, four behind NATs; later versions 2.4 s instead of 3.5 s). Off with
        ``spread=False``.
    13. first copies first (``first_copies_first``, the origin's): a repeat (rule 4) is
        refused as if the budget were spent (rule 5: served once the requester has kept
        asking for ``persist_s``) while this node served a first copy of a shard of the step
        (rule 1) less than ``window_s`` ago. The origin is the only source of a shard until
        it has sent it once, so its uplink bounds the whole broadcast: a repeat sent while
        first copies are still going out delays every node by its length. Measured on the
        shaped bench (``real-1b``, 2 relays, 4 peers, 200 Mb/s, DEBUG logs of two runs): in
        the last 10 s of a full version the relays fetched again from the origin, their
        fastest measured source, shards that five other nodes held, or the rest of a cut
        transfer: 33-37 MB, 1.4 s of the origin's uplink, while it still sent its last
        unique shards. With the rule the origin sent one copy (1,319.4 MB for 1,319.2 MB in
        three runs; 1,356-1,392 MB in five without); the last peer's time stayed within the
        runs' spread. Off for relays: a relay is one source among several, and its repeats
        are what a downstream fast link is for (``fast_relay_home``).

    Args:
        window_s: how long a shard is reserved for its last requester, seconds; None: off
            (every request allowed).
        max_entries: bound on remembered (step, shard) pairs and on remembered refusals;
            the oldest are forgotten.
        repeat_budget: repeats per step as a share of its shards (rule 4); None: unbounded.
        persist_s: rule 5's persistence, seconds (default ``3 * window_s``: a holder that
            dies or withholds costs others at most ``window_s + persist_s`` per shard; it was
            30x, which let one withholding relay stall a broadcast by 150 s per shard).
        report_share: rule 6's bound per requester and step, as a share of its shards.
        anonymous_share: rule 7's bound per step, as a share of its shards.
        small_version_bytes: rule 9's bound, bytes (0: every version is super-seeded).
        unreachable_share: rule 11's bound per requester and step, as a share of its shards.
        spread: rule 12 on (the default) or off.
        first_copies_first: rule 13 on or off (the default).
    """

    def __init__(
        self,
        window_s: float | None,
        max_entries: int = 1_000_000,
        repeat_budget: float | None = 0.1,
        persist_s: float | None = None,
        report_share: float = 0.1,
        anonymous_share: float = 1.0,
        small_version_bytes: int = 0,
        unreachable_share: float = 0.5,
        spread: bool = True,
        first_copies_first: bool = False,
    ) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self.repeat_budget = repeat_budget
        self.persist_s = persist_s if persist_s is not None else 3 * (window_s or 0.0)
        self.report_share = report_share
        self.anonymous_share = anonymous_share
        self.small_version_bytes = small_version_bytes
        self.unreachable_share = unreachable_share
        self.spread = spread
        self.first_copies_first = first_copies_first
        self._first_at: dict[int, float] = {}  # rule 13: step -> its latest first copy
        self._held: dict[tuple[int, str], int] = {}  # rule 12: shards held per (step, holder)
        self._asked: dict[int, dict[str, float]] = {}  # rule 12: step -> asker -> last asked
        self._first_step: dict[str, int] = {}  # rule 12: requester -> first step it was served
        self._served_to: dict[tuple[int, int], tuple[str, float]] = {}
        self._refused_since: dict[tuple[int, int, str], float] = {}
        self._repeats: dict[int, int] = {}
        self._reports: dict[tuple[int, str], int] = {}
        self._unreached: dict[tuple[int, str], int] = {}  # rule 11's use per (step, requester)
        self._anonymous: dict[int, int] = {}
        self._gone: dict[str, float] = {}  # holder -> when it left
        self.refused = 0
        self.repeats = 0
        self.released = 0
        self.anonymous_served = 0
        self.small_served = 0
        self.unheld_served = 0
        self.unreachable_served = 0
        """Shards served at once because the requester named their holder unreachable
        (rule 11)."""
        self.spread_refused = 0
        """Requests refused because the requester held its share already (rule 12)."""
        self.first_copies_refused = 0
        """Repeats refused while first copies of their step were going out (rule 13)."""

    def allow(
        self,
        requester: str | None,
        step: int,
        shards: Iterable[int],
        now: float,
        total_shards: int | None = None,
        failed: Iterable[str] = (),
        version_bytes: int | None = None,
        kind: Requester = Requester.SERVING,
        unreachable: Iterable[str] = (),
    ) -> bool:
        """True if ``requester`` may get these shards now (and records the serve): the
        ``allowed`` of :meth:`decide`, which takes the same arguments."""
        return self.decide(
            requester, step, shards, now, total_shards, failed, version_bytes, kind, unreachable
        ).allowed

    def decide(
        self,
        requester: str | None,
        step: int,
        shards: Iterable[int],
        now: float,
        total_shards: int | None = None,
        failed: Iterable[str] = (),
        version_bytes: int | None = None,
        kind: Requester = Requester.SERVING,
        unreachable: Iterable[str] = (),
    ) -> Decision:
        """Whether ``requester`` may get these shards now (an allowed serve is recorded), and
        for a refusal why and from whom to fetch them instead.

        Args:
            requester: the requesting node's authenticated id (its PeerID), or None for an
                anonymous client.
            step: the version's policy step.
            shards: indices of the shards the request covers.
            now: current time, seconds.
            total_shards: the version's shard count (for the budgets; None: no budget).
            failed: ids the requester reports as having failed these shards (rule 6).
            version_bytes: what the version offers in all, bytes (the smallest encoding of
                each shard: what a requester fetches), for rule 9; None: unknown.
            kind: what is known of ``requester`` (ignored when it is None): a sibling is
                always allowed, a download-only requester is never recorded (rule 10).
            unreachable: ids the requester reports it has no lane to (rule 11).
        """
        if self.window_s is None or (requester is not None and kind is Requester.SIBLING):
            return ALLOWED
        if version_bytes is not None and version_bytes <= self.small_version_bytes:
            self.small_served += 1
            return ALLOWED
        shards = list(shards)
        if requester is None:
            return self._allow_anonymous(step, shards, total_shards)
        may_hold = kind is not Requester.DOWNLOAD_ONLY  # rule 10
        if may_hold:
            self._note_ask(requester, step, now)
        scan = self._scan(requester, step, shards, now, total_shards, failed, unreachable)
        if scan.refused is not None:
            return self._refuse(requester, step, scan.refused, now, Refusal.WINDOW, scan.holders)
        if may_hold:
            over = self._over_share(requester, step, scan.fresh, now, total_shards)
            if over is not None:
                self.spread_refused += 1
                return self._refuse(requester, step, over, now, Refusal.SPREAD, [])
        if scan.repeats:
            budget = (
                None
                if self.repeat_budget is None or total_shards is None
                else self.repeat_budget * total_shards
            )
            over = budget is not None and self._repeats.get(step, 0) + scan.repeats > budget
            busy = self._sending_first_copies(step, now)
            if over or busy:
                held = self._still_refused(requester, step, shards, now)
                if held is not None:
                    holder = self._served_to[(step, held)][0]
                    why = Refusal.BUDGET if over else Refusal.FIRST_COPIES
                    if not over:
                        self.first_copies_refused += 1
                    return self._refuse(requester, step, held, now, why, [holder])
            self._repeats[step] = self._repeats.get(step, 0) + scan.repeats
            self.repeats += scan.repeats
        _spend(self._reports, (step, requester), len(scan.released), self.max_entries)
        self.released += len(scan.released)
        _spend(self._unreached, (step, requester), len(scan.bypassed), self.max_entries)
        self.unreachable_served += len(scan.bypassed)
        if not may_hold:
            self.unheld_served += len(shards)  # rule 10: served, holds nothing
        else:
            self._record(requester, step, shards, now)
        if scan.fresh and self.first_copies_first:
            self._first_at[step] = now  # rule 13
            _trim(self._first_at, 64)
        return ALLOWED

    def _sending_first_copies(self, step: int, now: float) -> bool:
        """Rule 13: a first copy of a shard of ``step`` was served less than ``window_s``
        ago (always False with the rule off)."""
        last = self._first_at.get(step)
        return last is not None and now - last < (self.window_s or 0.0)

    def _scan(
        self,
        requester: str,
        step: int,
        shards: list[int],
        now: float,
        total_shards: int | None,
        failed: Iterable[str],
        unreachable: Iterable[str],
    ) -> _Scan:
        """Rules 1-3, 6 and 11 over each of ``shards`` (nothing recorded)."""
        window = self.window_s if self.window_s is not None else 0.0
        failing, unreached = set(failed), set(unreachable)
        reports = self._reports.get((step, requester), 0)
        report_limit = max(4, int(self.report_share * (total_shards or 0)))
        bypasses = self._unreached.get((step, requester), 0)
        bypass_limit = max(4, int(self.unreachable_share * (total_shards or 0)))
        scan = _Scan()
        for i in shards:
            prev = self._served_to.get((step, i))
            if prev is None or self._left(prev):
                scan.fresh.append(i)
                continue
            if prev[0] == requester:
                continue
            if prev[0] in failing and reports + len(scan.released) < report_limit:
                scan.released.append(i)  # its holder is failing: serve now (rule 6)
            elif prev[0] in unreached and bypasses + len(scan.bypassed) < bypass_limit:
                scan.bypassed.append(i)  # the requester cannot reach its holder (rule 11)
            elif now - prev[1] < window:
                scan.refused = i if scan.refused is None else scan.refused
                _name(scan.holders, prev[0])
            else:
                scan.repeats += 1
        return scan

    def _over_share(
        self, requester: str, step: int, fresh: list[int], now: float, total: int | None
    ) -> int | None:
        """Rule 12: the first of the ``fresh`` shards (nobody holds them) that ``requester``
        may not take yet because it holds its share of ``step``, or None (only called with
        a window: :meth:`decide` allows everything without one)."""
        if not self.spread or total is None or not fresh:
            return None
        window = self.window_s or 0.0
        askers = [w for w, t in self._asked.get(step, {}).items() if now - t < window]
        if not all(self._veteran(w, step) for w in askers):
            return None  # someone new asks: the others may not reach it yet (first come)
        share = -(-total // max(1, len(askers)))
        if self._held.get((step, requester), 0) + len(fresh) <= share:
            return None
        for i in fresh:
            since = self._refused_since.get((step, i, requester))
            if since is None or now - since < window:
                return i
        return None

    def _veteran(self, requester: str, step: int) -> bool:
        """Rule 12: ``requester`` was served shards of a step before ``step`` by this node."""
        first = self._first_step.get(requester)
        return first is not None and first < step

    def _note_ask(self, requester: str, step: int, now: float) -> None:
        """Rule 12: ``requester`` asked for shards of ``step`` at ``now`` (bounded memory:
        at most ``max_entries`` askers per step, 64 steps)."""
        if not self.spread:
            return
        asked = self._asked.setdefault(step, {})
        asked.pop(requester, None)  # most recent last: the oldest asker is trimmed first
        asked[requester] = now
        _trim(asked, self.max_entries)
        _trim(self._asked, 64)

    def _still_refused(
        self, requester: str, step: int, shards: list[int], now: float
    ) -> int | None:
        """Rule 5, once the step's repeat budget is spent: the first of ``shards`` that
        another live holder was served and that ``requester`` was first refused less than
        ``persist_s`` ago (or never), or None if the request may go on."""
        for i in shards:
            since = self._refused_since.get((step, i, requester))
            prev = self._served_to.get((step, i))
            if (
                prev is not None
                and prev[0] != requester
                and not self._left(prev)
                and (since is None or now - since < self.persist_s)
            ):
                return i
        return None

    def _record(self, requester: str, step: int, shards: list[int], now: float) -> None:
        """``requester`` now holds ``shards`` of ``step`` (served at ``now``)."""
        for i in shards:
            prev = self._served_to.get((step, i))
            if prev is None or prev[0] != requester:  # rule 12's count moves to the requester
                self._held[(step, requester)] = self._held.get((step, requester), 0) + 1
                if prev is not None:
                    self._held[(step, prev[0])] = max(0, self._held.get((step, prev[0]), 0) - 1)
            self._served_to[(step, i)] = (requester, now)
            self._refused_since.pop((step, i, requester), None)
        _trim(self._served_to, self.max_entries)
        _trim(self._held, self.max_entries)
        self._first_step[requester] = min(step, self._first_step.get(requester, step))
        _trim(self._first_step, self.max_entries)

    def holder_gone(self, holder: str, now: float) -> None:
        """Rule 8: ``holder`` left at ``now``; what it was served before no longer binds."""
        if self.window_s is None:
            return
        self._gone[holder] = now
        _trim(self._gone, self.max_entries)

    def _left(self, prev: tuple[str, float]) -> bool:
        gone = self._gone.get(prev[0])
        return gone is not None and prev[1] <= gone

    def _allow_anonymous(self, step: int, shards: list[int], total_shards: int | None) -> Decision:
        """Rule 7: served within the step's anonymous share, never recorded as a holder."""
        used = self._anonymous.get(step, 0)
        if total_shards is not None and used + len(shards) > self.anonymous_share * total_shards:
            self.refused += 1
            return Decision(False, Refusal.ANONYMOUS_SHARE)
        self._anonymous[step] = used + len(shards)
        _trim(self._anonymous, self.max_entries)
        self.anonymous_served += len(shards)
        return ALLOWED

    def _refuse(
        self, requester: str, step: int, shard: int, now: float, why: Refusal, holders: list[str]
    ) -> Decision:
        """Refuse ``requester`` (first refused for ``shard`` at ``now``, for rule 5)."""
        self.refused += 1
        self._refused_since.setdefault((step, shard, requester), now)
        _trim(self._refused_since, self.max_entries)
        return Decision(False, why, tuple(holders))


def _name(holders: list[str], holder: str) -> None:
    """Add ``holder`` to a refusal's ``holders`` (distinct, at most MAX_HOLDERS)."""
    if holder not in holders and len(holders) < MAX_HOLDERS:
        holders.append(holder)


def _spend(used: dict[tuple[int, str], int], key: tuple[int, str], n: int, limit: int) -> None:
    """Add ``n`` (if any) to a per-(step, requester) share ``used`` (at most ``limit`` keys)."""
    if n:
        used[key] = used.get(key, 0) + n
        _trim(used, limit)


def _trim(d: dict, limit: int) -> None:  # type: ignore[type-arg]
    while len(d) > limit:
        d.pop(next(iter(d)))
