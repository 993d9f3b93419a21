"""core: one download's decisions, sans-IO: events in, actions out.

Theory of operation
-------------------
A :class:`Session` owns everything a download *decides*; its driver owns everything it *does*
(HTTP, threads, buffers, the disk). The trio driver
(:class:`shardcast.download.downloader.Downloader`)
and the simulator (:mod:`simulations.model`) drive the same object, so the model runs the real
resume, blame, fallback, endgame and abandonment code. It reads no clock (``now`` is an
argument) and draws chance only from the seeded ``random.Random`` it is given.

Events (methods) and what they return (lists of actions):

- :meth:`poll` — call after every event and at least every :meth:`next_wake` seconds: it
  hands out new transfers (:class:`Fetch`, from the :class:`~shardcast.core.select.Scheduler`,
  which stays inside), and ends the session with :class:`Commit` (every shard verified, every
  manifest part arrived) or :class:`Fail` (a :class:`~shardcast.core.liveness.Abandon` reason from
  the :class:`~shardcast.core.liveness.DownloadWatch`, which also stays inside).
- :meth:`part_arrived` (a verified manifest part: its shards become fetchable, each in the
  encoding :meth:`_choose` picks), :meth:`have_changed` (a partial source's have-bitmap),
  :meth:`add_source` / :meth:`source_back` (sources discovered, recovered, moved),
  :meth:`answered` (what a source said about the version), :meth:`probed`.
- :meth:`transfer_ended` with a typed :class:`Outcome` and the bytes received: a broken
  transfer keeps its prefix (:class:`Keep`) and the next request resumes at that byte, usually
  from another source; complete bytes go to :class:`Check`. A raw shard whose manifest part
  lists chunk digests is checked chunk by chunk as it streams (:mod:`shardcast.download.receive`): a
  chunk that fails ends the transfer with ``CORRUPT_CHUNK``, its one sender is blamed at once
  and the verified chunks before it are kept (a broken transfer keeps whole chunks only).
  A body its source closed right after a whole chunk ended at the source's hold
  (:func:`ended_at_hold`, ``HOLD_ENDED``): the chunks are kept and the source is asked for
  that shard again later, as after a ``503``, without blame.
- :meth:`shard_checked` with a :class:`Verdict`: ``VERIFIED`` completes the shard (endgame
  duplicates are cancelled); ``CORRUPT`` bytes from one source ban it; a copy assembled from
  several sources is kept (:class:`KeepSuspect`) until a verified copy exists, then compared
  (:class:`Compare` → :meth:`compared`) and only the sources whose ranges differ are blamed;
  ``BASE_MISMATCH``/``UNDECODABLE`` (a blob that matched its signed digest but decodes to
  wrong bytes, or does not decode) is no source's fault: the shard falls back to raw.

A super-seeding refusal (``REFUSED``) may name the shard's holders; those the driver found
this node cannot reach (:meth:`shardcast.download.discovery.SourceDirectory.holder_reach`)
come back in :meth:`transfer_ended`'s ``unreachable``: the next request of that shard names
them (:attr:`Fetch.unreachable`, at most 4 per shard) and may go out at once, to the same
source, which then serves it (:class:`shardcast.serve.superseeding.SuperSeeding` rule 11). A
refusal that names no holder new to the request waits ``refused_s`` as before, so a source
that ignores the names (an older node) costs one extra round trip per holder, not a loop.

Nobody is blamed for anything but bytes proven wrong: a source that sent only correct bytes
is never named by :class:`Blame`. A ``409`` (the source holds another version under this
step, :attr:`Outcome.WRONG_VERSION`) blames nobody either.

Bounds: at most ``max_resume_buffers`` kept prefixes, ``endgame_max_total`` duplicate
requests in flight, ``max_extra_sources`` usable discovered sources; the watch bounds time.
"""

from __future__ import annotations

import enum
import logging
import math
import random
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from p2p.errors import short_id
from shardcast.core.failure import FailureKind
from shardcast.core.liveness import Abandon, Answer, DownloadWatch
from shardcast.core.select import Request, Scheduler, SchedulerConfig
from shardcast.wire import MAX_HOLDERS, codecs, shard_bits

log = logging.getLogger(__name__)


class Outcome(enum.Enum):
    """How one transfer ended (the value is the log/metric string)."""

    OK = "ok"  # every requested byte arrived
    BROKEN = "broken"  # the stream broke mid-way; the bytes received are kept
    TIMEOUT = "timeout"  # no progress for the stall timeout; the bytes received are kept
    UNREACHABLE = "unreachable"  # no connection to the source
    NOT_AVAILABLE = "not_available"  # 503: the source holds the version, not this shard yet
    REFUSED = "refused"  # 429: super-seeding, ask others first
    GONE = "gone"  # 404: the source may not hold the version (checked at /have)
    WRONG_VERSION = "wrong_version"  # 409: another version under this step; nobody's fault
    PROTOCOL_ERROR = "protocol_error"  # the source broke the protocol (too many bytes, ...)
    CORRUPT_CHUNK = "corrupt_chunk"  # a chunk failed its signed digest; the whole verified
    # chunks before it (``received`` bytes of this request) are kept, the sender is blamed
    CANCELLED = "cancelled"  # the driver cancelled it (after a Cancel action, or shutdown)
    HOLD_ENDED = "hold_ended"  # the source ended the body in order at the end of what it
    # had verified (its hold ran out): a range at a chunk's end (:func:`ended_at_hold`), a
    # batch at a blob's end (:func:`~shardcast.core.batch.cut_between_blobs`); its late 503:
    # the bytes received are kept and nobody is blamed


def ended_at_hold(received: int, dropped: int, *, chunked: bool) -> bool:
    """Whether a raw shard's body that its source closed in order before its end was cut at
    the source's hold (:mod:`shardcast.serve.server`, "Partial shards"): a held range request
    follows the source's verified prefix and ends there when no new chunk is verified within
    the hold; the source's head is out, so this is its late ``503``.

    Args:
        received: bytes of the request kept after the close (whole verified chunks).
        dropped: bytes past the last whole chunk that the close left, and the sink dropped
            (:meth:`~shardcast.download.receive.ShardSink.rewind`).
        chunked: the shard is checked chunk by chunk (its manifest part lists chunks); a
            source serves a shard it is still receiving only then.

    Returns:
        True only if the body ended exactly at a chunk boundary after at least one chunk:
        where a source's verified prefix ends. A close inside a chunk is no hold's end (the
        request's outcome stays ``BROKEN``). A source gains nothing from cutting a body this
        way: it could answer ``503`` at once, and every byte it did send is whole chunks, each
        checked against its signed digest."""
    return chunked and received > 0 and dropped == 0


class Verdict(enum.Enum):
    """What checking a transfer's complete bytes found."""

    VERIFIED = "verified"  # decoded, matched the shard digest, written
    ALREADY_HELD = "already_held"  # correct, but another copy was written first
    CORRUPT = "corrupt"  # the bytes (or the encoded blob) fail their signed digest
    BASE_MISMATCH = "base_mismatch"  # blob matched its digest, decoded to wrong bytes
    UNDECODABLE = "undecodable"  # blob matched its digest but does not decode (origin's fault)


@dataclass(frozen=True)
class Offer:
    """What a shard's manifest part offers: raw ``length`` bytes, and encoded ``sizes``."""

    index: int
    length: int
    sizes: Mapping[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Fetch:
    """Transfer bytes ``[start, start + length)`` of shard ``shard`` in ``encoding``
    (whose whole size is ``size`` bytes) from ``source``. ``start > 0``: append to the prefix
    kept for the shard (:class:`Keep`); otherwise into a fresh buffer. ``failed``: sources
    that failed this shard lately (told to the source, so an origin can serve it again).
    ``unreachable``: holders a refusal of this shard named that this node cannot reach (told
    to the source, which then serves it at once)."""

    req: int
    shard: int
    source: str
    encoding: str
    start: int
    length: int
    size: int
    duplicate: bool
    failed: tuple[str, ...] = ()
    unreachable: tuple[str, ...] = ()


@dataclass(frozen=True)
class Cancel:
    """Cancel request ``req``; report it with ``transfer_ended(CANCELLED)``."""

    req: int


@dataclass(frozen=True)
class Keep:
    """Keep request ``req``'s buffer as the resumable prefix of ``shard``."""

    req: int
    shard: int


@dataclass(frozen=True)
class Drop:
    """Forget the prefix kept for ``shard``."""

    shard: int


@dataclass(frozen=True)
class Check:
    """Decode and verify request ``req``'s complete bytes; report with ``shard_checked``."""

    req: int
    shard: int
    encoding: str


@dataclass(frozen=True)
class KeepSuspect:
    """Keep request ``req``'s failed copy as ``copy`` until a verified copy exists."""

    req: int
    copy: int


@dataclass(frozen=True)
class Compare:
    """Compare kept ``copy`` with request ``good``'s verified bytes over each contributor's
    ``(source, start, end)`` range; report the sources that differ with ``compared``."""

    copy: int
    shard: int
    good: int
    contributions: tuple[tuple[str, int, int], ...]


@dataclass(frozen=True)
class Blame:
    """``source`` sent bytes of ``shard`` proven wrong (metrics, logs)."""

    source: str
    shard: int


@dataclass(frozen=True)
class Ban:
    """``source`` is banned: remember it across versions."""

    source: str


@dataclass(frozen=True)
class PollHave:
    """Poll ``source``'s have-bitmap until it holds everything (report ``have_changed``)."""

    source: str


@dataclass(frozen=True)
class Probe:
    """Ask ``source``'s ``/have`` whether it holds the version (report ``probed``)."""

    source: str


@dataclass(frozen=True)
class Commit:
    """Every shard verified and every part arrived: commit the version."""


@dataclass(frozen=True)
class Fail:
    """Abandon the download."""

    reason: Abandon
    text: str


Action = (
    Fetch | Cancel | Keep | Drop | Check | KeepSuspect | Compare | Blame | Ban | PollHave | Probe
)
End = Commit | Fail


@dataclass(frozen=True)
class SessionConfig:
    """Settings of one session (units in names).

    Attributes:
        scheduler: source-selection tuning.
        max_resume_buffers: prefixes of broken transfers kept for resuming.
        use_base: the delta base is held and matches: fetch deltas where offered.
        prefer_compressed: fetch ``zstd`` where offered.
        max_extra_sources: bound on usable discovered sources.
        no_source_grace_s, gone_grace_s, no_progress_s: the watch's bounds, seconds.
    """

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    max_resume_buffers: int = 8
    use_base: bool = False
    prefer_compressed: bool = False
    max_extra_sources: int = 16
    no_source_grace_s: float = 120.0
    gone_grace_s: float = 5.0
    no_progress_s: float = 600.0


@dataclass
class DownloadStats:
    """Result counters of one download."""

    step: int
    bytes_fetched: int = 0
    bytes_by_source: dict[str, int] = field(default_factory=dict)
    bytes_by_encoding: dict[str, int] = field(default_factory=dict)
    corrupt_by_source: dict[str, int] = field(default_factory=dict)
    failures: int = 0
    delta_fallbacks: int = 0
    resumed: int = 0
    restored: int = 0
    asked_by_source: dict[str, int] = field(default_factory=dict)
    unavailable_by_source: dict[str, int] = field(default_factory=dict)
    other_digest_by_source: dict[str, int] = field(default_factory=dict)
    """Requests answered ``409`` (the source holds the step under another digest)."""
    refused_unreachable: int = 0
    """Refusals that named a holder this node cannot reach (asked again at once)."""
    overdue: int = 0
    """Transfers cancelled as overdue and resumed from a faster source."""
    elapsed_s: float = 0.0


def _bump(d: dict[str, int], key: str, n: int = 1) -> None:
    d[key] = d.get(key, 0) + n


@dataclass
class _Prefix:
    """Bytes of a shard kept from broken transfers: where they end, who sent which."""

    pos: int
    encoding: str
    size: int
    parts: list[tuple[str, int, int]]


@dataclass
class _Req:
    fetch: Fetch
    parts: list[tuple[str, int, int]]  # contributions of the copy this request fills
    checking: bool = False


class Session:
    """The decisions of one download (see module docstring). Pure: no I/O, no clock.

    Args:
        step: the version's step (for messages).
        lengths: raw length of every shard, bytes.
        n_parts: manifest parts of the version.
        parts: parts already held; ``offers``: their shards' offers.
        held: shards already verified (resumed from a journal).
        rng: seeded randomness for the scheduler.
        config: settings.
        now: start time, seconds.
        signer: the PeerID that signed the version (the origin), or None. As a source it
            counts as holding every shard whose part is known, with no have-poll: the origin
            serves a part only once it serves each of that part's shards (raw and every
            encoded form, :mod:`shardcast.publish.origin`), and every part comes from it. A
            long-poll of its ``/have`` (one request per part it signed) only told that again.
            Were the claim ever wrong (an origin restarted mid-publish), its requests are
            held or answered ``503``/``404`` like any other source's: a delay, never a byte
            unchecked.
    """

    def __init__(
        self,
        step: int,
        lengths: list[int],
        n_parts: int,
        parts: Iterable[int],
        offers: Iterable[Offer],
        held: Iterable[int],
        rng: random.Random,
        config: SessionConfig,
        now: float,
        signer: str | None = None,
    ) -> None:
        self.step = step
        self.signer = signer
        self.config = config
        offers = list(offers)
        held = list(held)
        self.sched = Scheduler(
            lengths, rng, config.scheduler, have=held, known=[o.index for o in offers]
        )
        self.watch = DownloadWatch(
            now, config.no_source_grace_s, config.gone_grace_s, config.no_progress_s
        )
        self.stats = DownloadStats(step, restored=len(held))
        self.missing_parts = set(range(n_parts)) - set(parts)
        self.finished = False
        self.verified_bytes = sum(lengths[i] for i in held)
        self._lengths = lengths
        self._offers: dict[int, Offer] = {}
        self._chosen: dict[int, str] = {}
        self._no_delta: set[int] = set()
        self._reqs: dict[int, _Req] = {}
        self._kept: dict[int, _Prefix] = {}
        self._suspects: dict[int, list[tuple[int, str, int, tuple[tuple[str, int, int], ...]]]] = {}
        self._next_copy = 0
        self._comparing: dict[int, set[str]] = {}  # copy -> its contributors
        self._failed_by: dict[int, list[str]] = {}
        self._unreachable_by: dict[int, list[str]] = {}  # shard -> holders named unreachable
        self._complete: dict[str, bool] = {}
        self._extra: set[str] = set()
        self._peers_give_parts = False  # a discovered peer gave a part (part_given)
        self._probing: set[str] = set()
        self._store_lost: str | None = None
        for o in offers:
            self._offer(o)

    # -- sources -----------------------------------------------------------------------------

    def add_source(
        self, source: str, complete: bool, now: float, *, banned: bool = False, extra: bool = False
    ) -> list[Action]:
        """A source joined (``banned``: under a ban carried from an earlier version;
        ``extra``: discovered, counted against ``max_extra_sources``). Returns a
        :class:`PollHave` for a partial source; the version's signer is never partial (see
        the class docstring)."""
        complete = complete or source == self.signer
        self._complete[source] = complete
        self.sched.add_source(source, None if complete else ())
        if banned:
            self.sched.ban(source)
        if extra:
            self._extra.add(source)
        self.watch.add_source(source)
        self._assure_light(self._offers, [source])
        return [] if complete else [PollHave(source)]

    def _assure_light(self, shards: Iterable[int], sources: Iterable[str]) -> None:
        """Count each upstream of ``sources`` (a partial source the download was given, not
        a discovered one) as holding those of ``shards`` that are fetched as delta blobs
        (light): see :meth:`lacking`."""
        light = [i for i in shards if self._chosen.get(i) in codecs.DELTAS]
        for source in sources:
            if source not in self._extra and not self._complete[source]:
                self.sched.add_have(source, light)

    def known(self, source: str) -> bool:
        """True if ``source`` is part of the download."""
        return source in self._complete

    def discovered(self, source: str) -> bool:
        """True if ``source`` joined through discovery (``extra``), not as an upstream."""
        return source in self._extra

    def part_asks(self, sources: Iterable[str]) -> tuple[list[str], list[str]]:
        """Whom to ask for a missing manifest part at once, and whom only if those do not
        give it (pure): ``(upstreams, discovered)`` of ``sources``, in their order.

        An upstream (a source the download was given) is asked to hold the request until it
        has the part: the part reaches this node through it. A discovered peer answers at
        once and, in a tree, gets its parts from the same upstreams at about the same time,
        so asking it while an upstream holds the ask only costs both ends a request: in the
        shaped benchmark (4 peers under 2 relays, a real-1b next version) each peer served
        ~54 part asks of its 3 neighbours, ~2.5 per part and neighbour, nearly all ``503``.
        The driver asks the discovered ones once no upstream ask is pending (each ended
        without the part: a dead or lagging upstream) or after a bounded wait. With no
        upstream left, or once a discovered peer gave a part (:meth:`part_given`: the
        upstreams lag behind the peers), every source is asked at once: ``([], [])`` never
        happens for a non-empty ``sources``."""
        ids = list(sources)
        ups = [s for s in ids if s not in self._extra]
        found = [s for s in ids if s in self._extra]
        if self._peers_give_parts:
            return ups + found, []
        return (ups, found) if ups else (found, [])

    def part_given(self, source: str) -> None:
        """``source`` gave a manifest part first: if it is a discovered peer, the
        upstreams lagged behind it, and :meth:`part_asks` asks the peers at once from now
        on (a stalled upstream costs the wait for one round of parts, not for each)."""
        if source in self._extra:
            self._peers_give_parts = True

    def extra_room(self) -> int:
        """How many more discovered sources may join (usable ones count against the bound)."""
        banned = set(self.sched.statistics().banned)
        return self.config.max_extra_sources - len(self._extra - banned)

    def source_back(self, source: str, now: float) -> None:
        """``source`` answers again after an outage, or moved: ask it at once."""
        self.sched.source_back(source, now)

    def have_changed(
        self,
        source: str,
        have: Iterable[int] | None,
        now: float,
        prefixes: Mapping[int, int] | None = None,
    ) -> None:
        """A partial source's have-set (None: it holds everything now) and the verified
        prefixes (bytes) of the shards it is still receiving (which it serves already)."""
        self.watch.on_answer(source, Answer.PRESENT, now)
        if have is None:
            self.sched.add_source(source, None)
        else:
            self.sched.add_have(source, have)
            self.sched.set_prefixes(source, dict(prefixes or {}))

    def answered(self, source: str, outcome: Outcome, now: float) -> list[Action]:
        """What a request to ``source`` (a shard or a part) said about the version."""
        if outcome is Outcome.OK:
            self.watch.on_answer(source, Answer.DELIVERED, now)
        elif outcome in (Outcome.NOT_AVAILABLE, Outcome.REFUSED, Outcome.HOLD_ENDED):
            self.watch.on_answer(source, Answer.PRESENT, now)
        elif outcome is Outcome.WRONG_VERSION:
            self.watch.on_answer(source, Answer.GONE, now)
        elif outcome is Outcome.UNREACHABLE:
            self.watch.on_answer(source, Answer.UNREACHABLE, now)
        elif outcome is Outcome.GONE:  # a 404 alone proves little: confirm at /have
            if source not in self._probing and not self.watch.gone(source):
                self._probing.add(source)
                return [Probe(source)]
        return []

    def probed(self, source: str, answer: Answer, now: float) -> None:
        """The answer of a :class:`Probe` (or of a have-poll)."""
        self._probing.discard(source)
        self.watch.on_answer(source, answer, now)
        if answer is Answer.GONE:
            log.info("source_gone step=%d source=%s", self.step, short_id(source))

    # -- manifest ----------------------------------------------------------------------------

    def part_arrived(self, part: int, offers: Iterable[Offer], now: float) -> None:
        """Manifest part ``part`` was verified; ``offers`` are its shards."""
        self.missing_parts.discard(part)
        self.watch.on_progress(now)
        offers = list(offers)
        for o in offers:
            self._offer(o)
        self._assure_light((o.index for o in offers), self._complete)

    def _offer(self, o: Offer) -> None:
        self._offers[o.index] = o
        self._reschedule(o.index)

    def _choose(self, index: int) -> str:
        o = self._offers[index]
        if index in self._no_delta:  # an encoded form failed after its digest matched
            return codecs.RAW
        deltas = [(size, enc) for enc, size in o.sizes.items() if enc in codecs.DELTAS]
        if self.config.use_base and deltas:
            return min(deltas)[1]
        if self.config.prefer_compressed and codecs.ZSTD in o.sizes:
            return codecs.ZSTD
        return codecs.RAW

    def _size(self, index: int, enc: str) -> int:
        o = self._offers[index]
        return o.length if enc == codecs.RAW else o.sizes[enc]

    def _reschedule(self, index: int) -> None:
        enc = self._chosen[index] = self._choose(index)
        self.sched.mark_known(index, self._size(index, enc), light=enc in codecs.DELTAS)

    # -- the loop ----------------------------------------------------------------------------

    def poll(self, now: float) -> list[Action | End]:
        """New transfers to start, or the end of the session (then nothing more)."""
        if self.finished:
            return []
        out: list[Action | End] = []
        # ended by the driver with transfer_ended(CANCELLED): then resumed elsewhere (_cut)
        out += [Cancel(rid) for rid in self.sched.overdue(now)]
        while (req := self.sched.next_request(now)) is not None:
            fetch = self._begin(req, out)
            if fetch is not None:
                out.append(fetch)
        active = (
            any(isinstance(a, Fetch) for a in out)
            or bool(self.sched.inflight())
            or bool(self.missing_parts)
        )
        self.watch.tick(now, active)
        reason = Abandon.STORE_LOST if self._store_lost else self.watch.verdict(now)
        if reason is not None:
            self.finished = True
            log.warning("download_abandoned step=%d reason=%s", self.step, reason.value)
            out.append(Fail(reason, self._failure_text(reason)))
        elif self.sched.done() and not self.missing_parts:
            self.finished = True
            out.append(Commit())
        return out

    def lacking(self) -> bytes:
        """The shards a source's news of would help this download, as a bitmap laid out as
        a ``/have`` answer (bit ``i`` of byte ``i // 8``, most significant first): the
        ``want`` of a have long-poll (:func:`shardcast.wire.have.encode_want`), so a source
        answers only with news. That is every shard not verified yet, except a delta blob
        already asked for (:meth:`Scheduler.coming`): its batch is held at the source asked,
        and a neighbour that gets it from the same relay at about the same time is no news.
        A raw shard in flight stays wanted: another holder may serve it sooner (endgame).

        Nor are delta blobs wanted while an upstream is usable (given to the download, not
        banned, not gone): an upstream counts as holding every delta blob of a known part
        (:meth:`_assure_light`), as the signer holds every shard. It is a relay that gets
        each blob from the origin (or the origin itself), and it holds a request for a blob
        it has not yet got until it has it (a batch's hold), so it is asked at once. The
        blobs are ~1 % of the version: the neighbours' uplinks are not needed for them.
        When this node holds the base (``use_base``), the shards of parts not yet known are
        not wanted either: they are nearly all delta blobs, and neighbours that knew a part
        first were the rest of that news (the origin signs parts over its whole encode).
        A ``/have`` answer still carries the source's whole state, so a raw shard among
        them is known the moment its part is. Once no upstream is usable, all of these are
        wanted from everyone again."""
        sched, chosen = self.sched, self._chosen
        skip_light = self._upstream_usable()
        skip_unknown = skip_light and self.config.use_base
        return shard_bits(
            len(self._lengths),
            lambda i: (
                not (
                    sched.is_done(i)
                    or sched.coming(i)
                    or (skip_light and chosen.get(i) in codecs.DELTAS)
                    or (skip_unknown and i not in chosen)
                )
            ),
        )

    def _upstream_usable(self) -> bool:
        """True if a source given to the download (not discovered) is neither banned nor
        gone."""
        return any(
            s not in self._extra and not self.sched.is_banned(s) and not self.watch.gone(s)
            for s in self._complete
        )

    def quiet_for(self, now: float) -> float:
        """Seconds since the last byte, part or delivery of the version arrived."""
        return self.watch.quiet_for(now)

    def explain(self, now: float) -> str:
        """Why the download waits, one line (for a log when it makes no progress): the parts
        still awaited, kept resume prefixes, and
        :meth:`~shardcast.core.select.Scheduler.explain`."""
        return (
            f"parts_missing={len(self.missing_parts)} kept={len(self._kept)} "
            f"{self.sched.explain(now)}"
        )

    def next_wake(self, now: float) -> float:
        """Seconds until :meth:`poll` must be called again if nothing happens (penalties
        expire, the watch's verdict can change, a transfer in flight may be overdue: every
        quarter of ``overdue_min_s``, at least 0.1 s apart)."""
        sc = self.config.scheduler
        wake = min(sc.penalty_s / 4, self.watch.next_change(now) + 1e-3)
        if self.sched.inflight() and not math.isinf(sc.overdue_factor):
            wake = min(wake, max(sc.overdue_min_s / 4, 0.1))
        return wake

    def _begin(self, req: Request, out: list[Action | End]) -> Fetch | None:
        enc = self._chosen[req.shard]
        size = self._size(req.shard, enc)
        parts: list[tuple[str, int, int]] = []
        if req.start:  # resume: the prefix must be there, as long as the request assumes
            prefix = self._kept.pop(req.shard, None)
            if prefix is None or (prefix.pos, prefix.encoding, prefix.size) != (
                req.start,
                enc,
                size,
            ):
                self.sched.discard_partial(req.shard)
                self.sched.on_cancelled(req.id)
                if prefix is not None:
                    out.append(Drop(req.shard))
                return None
            parts = prefix.parts
            self.stats.resumed += 1
        elif not req.duplicate and self._kept.pop(req.shard, None) is not None:
            out.append(Drop(req.shard))
        _bump(self.stats.asked_by_source, req.source)
        fetch = Fetch(
            req.id,
            req.shard,
            req.source,
            enc,
            req.start,
            req.length,
            size,
            req.duplicate,
            tuple(self._failed_by.get(req.shard, ())),
            tuple(self._unreachable_by.get(req.shard, ())),
        )
        self._reqs[req.id] = _Req(fetch, list(parts))
        return fetch

    # -- transfers ---------------------------------------------------------------------------

    def first_byte(self, req: int, now: float, *, measure_from: float | None = None) -> None:
        """The first byte of ``req`` arrived (seconds). ``measure_from``: the instant the
        scheduler measures the transfer's throughput from, if not ``now`` (a blob of a batch:
        :func:`~shardcast.core.batch.first_byte_times`)."""
        r = self._reqs.get(req)
        if r is not None:
            self.watch.on_answer(r.fetch.source, Answer.DELIVERED, now)
            self.sched.on_first_byte(req, now if measure_from is None else measure_from)
        self.watch.on_progress(now)

    def progress(self, now: float, req: int | None = None, received: int = 0) -> None:
        """More bytes of the version arrived: ``received`` bytes of request ``req`` so far,
        if the driver tracks them (the scheduler judges overdue transfers by them)."""
        self.watch.on_progress(now)
        if req is not None:
            self.sched.on_progress(req, received)

    def store_lost(self, req: int | None, error: str) -> None:
        """The partial directory vanished (checking ``req`` hit it): the next poll fails."""
        self._store_lost = error
        if req is not None and self._reqs.pop(req, None) is not None:
            self.sched.on_cancelled(req)

    def _failed(self, shard: int, source: str) -> None:
        names = self._failed_by.setdefault(shard, [])
        if source not in names:
            names.append(source)
            del names[:-MAX_HOLDERS]  # the wire names at most this many

    def transfer_ended(
        self,
        req: int,
        outcome: Outcome,
        received: int,
        now: float,
        *,
        unreachable: Iterable[str] = (),
    ) -> list[Action]:
        """Request ``req`` ended with ``outcome`` after ``received`` bytes of it arrived;
        ``unreachable``: for ``REFUSED``, the holders the refusal named that this node cannot
        reach (module docstring)."""
        r = self._reqs.get(req)
        if r is None:
            return []
        f = r.fetch
        out: list[Action] = []
        cut = self.sched.handed_back(req)  # a Cancel sent as overdue (it may end otherwise)
        if outcome is Outcome.OK:
            r.parts.append((f.source, f.start, f.start + received))
            r.checking = True
            self.stats.bytes_fetched += received
            _bump(self.stats.bytes_by_source, f.source, received)
            _bump(self.stats.bytes_by_encoding, f.encoding, received)
            return [Check(req, f.shard, f.encoding)]
        del self._reqs[req]
        if cut and outcome is Outcome.CANCELLED:  # cut for a faster source: resume there
            return self._cut(req, r, received, now)
        if outcome is Outcome.CANCELLED:
            self.sched.on_cancelled(req)
            if not f.duplicate and not self.sched.is_done(f.shard):
                self.sched.discard_partial(f.shard)
            return out
        out += self.answered(f.source, outcome, now)
        self._failed(f.shard, f.source)
        if outcome in (Outcome.NOT_AVAILABLE, Outcome.REFUSED, Outcome.GONE, Outcome.WRONG_VERSION):
            again = outcome is Outcome.REFUSED and self._unreachable(f, unreachable)
            return out + self._unavailable(req, r, outcome, now, again=again)
        if outcome is Outcome.HOLD_ENDED:  # its late 503: ask again after its next /have
            _bump(self.stats.unavailable_by_source, f.source)
            return out + self._resume_elsewhere(req, r, FailureKind.HOLD_ENDED, received, now)
        self.stats.failures += 1
        if outcome is Outcome.PROTOCOL_ERROR:
            cancel = self.sched.on_failure(req, now, kind=FailureKind.CORRUPT)
            return out + self._corrupt(f.source, f.shard, cancel)
        if outcome is Outcome.CORRUPT_CHUNK:
            return out + self._corrupt_chunk(req, r, received, now)
        kind = FailureKind.TIMEOUT if outcome is Outcome.TIMEOUT else FailureKind.BROKEN
        return out + self._resume_elsewhere(req, r, kind, received, now)

    def _unreachable(self, f: Fetch, holders: Iterable[str]) -> bool:
        """Remember the ``holders`` a refusal of ``f`` named that this node cannot reach (the
        last 4 per shard); True if one of them was not named in ``f`` already (ask again at
        once, naming it)."""
        names = self._unreachable_by.setdefault(f.shard, [])
        new = False
        for h in holders:
            if h not in f.unreachable:
                new = True
            if h not in names:
                names.append(h)
        del names[:-MAX_HOLDERS]
        if not names:
            del self._unreachable_by[f.shard]
        return new

    def _unavailable(
        self, req: int, r: _Req, outcome: Outcome, now: float, *, again: bool = False
    ) -> list[Action]:
        """``req`` was answered that its source does not serve the shard (not available,
        refused, gone, another version): no blame for bytes; a prefix it resumed from stays.
        ``again``: a refusal to ask again at once (it named a holder this node cannot reach)."""
        f = r.fetch
        out: list[Action] = []
        _bump(self.stats.unavailable_by_source, f.source)
        if outcome is Outcome.WRONG_VERSION:
            _bump(self.stats.other_digest_by_source, f.source)
        if f.start and not f.duplicate:  # the prefix stays for the next source
            self._kept[f.shard] = _Prefix(f.start, f.encoding, f.size, r.parts)
            out.append(Keep(req, f.shard))
        elif not f.duplicate:
            self.sched.discard_partial(f.shard)
        kind = FailureKind.UNAVAILABLE
        if outcome is Outcome.REFUSED:
            kind = FailureKind.REFUSED_UNREACHABLE if again else FailureKind.REFUSED
            self.stats.refused_unreachable += again
        self.sched.on_failure(req, now, kind=kind)
        return out

    def _corrupt_chunk(self, req: int, r: _Req, received: int, now: float) -> list[Action]:
        """A chunk of ``req`` failed its digest after ``received`` good bytes: one chunk, one
        sender, blamed at once; the verified bytes before it are kept (bounded)."""
        f = r.fetch
        out: list[Action] = []
        keep = self._keep_prefix(req, r, received)
        if keep is not None:
            out.append(keep)
        elif not f.duplicate:
            self.sched.discard_partial(f.shard)
        log.warning(
            "chunk_corrupt step=%d shard=%d at_byte=%d source=%s",
            self.step,
            f.shard,
            f.start + received,
            short_id(f.source),
        )
        cancel = self.sched.on_failure(
            req, now, kind=FailureKind.CORRUPT, received=received, kept=keep is not None
        )
        return out + self._corrupt(f.source, f.shard, cancel)

    def _resume_elsewhere(
        self, req: int, r: _Req, kind: FailureKind, received: int, now: float
    ) -> list[Action]:
        """``req`` broke, timed out, found its source unreachable, was cut as overdue or ended
        at its source's hold (``kind``, as :meth:`~shardcast.core.select.Scheduler.on_failure`
        takes it) after ``received`` bytes: keep what arrived (bounded) and resume elsewhere."""
        keep = self._keep_prefix(req, r, received)
        self.sched.on_failure(req, now, kind=kind, received=received if keep is not None else 0)
        if keep is None and not r.fetch.duplicate:
            self.sched.discard_partial(r.fetch.shard)
        return [keep] if keep is not None else []

    def _cut(self, req: int, r: _Req, received: int, now: float) -> list[Action]:
        """``req`` was cancelled as overdue after ``received`` bytes: keep them (bounded) and
        resume the shard from the faster source the scheduler found; nobody is blamed."""
        self.stats.overdue += 1
        log.debug(
            "transfer_overdue step=%d shard=%d source=%s received=%d",
            self.step,
            r.fetch.shard,
            short_id(r.fetch.source),
            received,
        )
        return self._resume_elsewhere(req, r, FailureKind.OVERDUE, received, now)

    def _keep_prefix(self, req: int, r: _Req, received: int) -> Keep | None:
        """Keep the prefix of ``r``'s shard that arrived (its first ``f.start + received``
        bytes) for the next source to resume from: the :class:`Keep` action, or None when
        ``r`` is a duplicate, nothing arrived or all ``max_resume_buffers`` are in use."""
        f = r.fetch
        pos = f.start + received
        if f.duplicate or pos <= 0 or len(self._kept) >= self.config.max_resume_buffers:
            return None
        if received:
            r.parts.append((f.source, f.start, pos))
        self._kept[f.shard] = _Prefix(pos, f.encoding, f.size, r.parts)
        return Keep(req, f.shard)

    def shard_checked(self, req: int, verdict: Verdict, now: float) -> list[Action]:
        """The bytes of ``req`` (after :class:`Check`) were found ``verdict``."""
        r = self._reqs.pop(req, None)
        if r is None:
            return []
        f = r.fetch
        out: list[Action] = []
        if verdict in (Verdict.BASE_MISMATCH, Verdict.UNDECODABLE):
            self._no_delta.add(f.shard)
            self.stats.delta_fallbacks += 1
            self.sched.on_failure(req, now, kind=FailureKind.SUSPECT)
            self._reschedule(f.shard)
            log.warning(
                "encoded_blob_unusable step=%d shard=%d encoding=%s: fetching raw",
                self.step,
                f.shard,
                f.encoding,
            )
            return out
        if verdict is Verdict.CORRUPT:
            contributors = sorted({p[0] for p in r.parts})
            for c in contributors:
                self._failed(f.shard, c)
            log.warning(
                "shard_corrupt step=%d shard=%d sources=%s",
                self.step,
                f.shard,
                ",".join(short_id(c) for c in contributors),
            )
            if len(contributors) == 1:
                cancel = self.sched.on_failure(req, now, kind=FailureKind.CORRUPT)
                return self._corrupt(contributors[0], f.shard, cancel)
            self.sched.on_failure(req, now, kind=FailureKind.SUSPECT)
            copy = self._next_copy
            self._next_copy += 1
            self._suspects.setdefault(f.shard, []).append(
                (copy, f.encoding, f.size, tuple(r.parts))
            )
            return [KeepSuspect(req, copy)]
        losers = self.sched.on_success(req, now)
        self.watch.on_progress(now)
        for lid in losers:
            out.append(Cancel(lid))
        if self._kept.pop(f.shard, None) is not None:
            out.append(Drop(f.shard))
        if verdict is Verdict.VERIFIED:
            self.verified_bytes += self._lengths[f.shard]
            for copy, encoding, size, parts in self._suspects.pop(f.shard, ()):
                # another encoding cannot be compared byte for byte, even at the same size (a
                # 2-byte xor-zstd blob against the 2 raw bytes blamed an honest source)
                if encoding == f.encoding and size == f.size:
                    self._comparing[copy] = {p[0] for p in parts}
                    out.append(Compare(copy, f.shard, req, parts))
        return out

    def compared(self, copy: int, shard: int, culprits: Iterable[str], now: float) -> list[Action]:
        """The sources whose ranges of a kept ``copy`` of ``shard`` differ from the verified
        bytes (from the driver's comparison)."""
        out: list[Action] = []
        contributors = self._comparing.pop(copy, set())
        for culprit in sorted(set(culprits) & contributors):
            log.warning("source_blamed source=%s reason=corrupt_bytes", short_id(culprit))
            out += self._corrupt(culprit, shard, self.sched.penalize_corrupt(culprit, now))
        return out

    def _corrupt(self, source: str, shard: int, cancel: list[int]) -> list[Action]:
        _bump(self.stats.corrupt_by_source, source)
        out: list[Action] = [Blame(source, shard)]
        if self.sched.is_banned(source):
            out.append(Ban(source))
            out += [Cancel(rid) for rid in cancel if rid in self._reqs]
        return out

    # -- views -------------------------------------------------------------------------------

    def inflight(self) -> int:
        """Requests started and not yet ended."""
        return len(self._reqs)

    def _failure_text(self, reason: Abandon) -> str:
        cfg = self.config
        step = self.step
        if reason is Abandon.GONE:
            return f"step {step}: gone from every source for {cfg.gone_grace_s}s"
        if reason is Abandon.NO_PROGRESS:
            return f"step {step}: no byte received for {cfg.no_progress_s}s"
        if reason is Abandon.STORE_LOST:
            return f"step {step}: store lost ({self._store_lost}); start over"
        banned = ", ".join(short_id(b) for b in self.sched.statistics().banned) or "none"
        return (
            f"step {step}: no usable source for {cfg.no_source_grace_s}s "
            f"({self.sched.missing} shards missing; banned: {banned})"
        )
