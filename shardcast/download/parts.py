"""download: the manifest parts of one download, fetched from its sources (trio).

Theory of operation
-------------------
A download that starts before its version is complete (a relay or peer following a live
upstream, an origin still hashing) gets the version's signed manifest parts as they appear.
:class:`PartFetcher` asks for the missing parts in part order, :data:`PARTS_IN_FLIGHT` at a
time. Each part is asked in rounds (:meth:`PartFetcher.ask_round`): the upstreams at once,
each asked to hold the request until it has the part, and the discovered peers only if the
upstreams do not give it, or at once after a peer gave one (whom to ask when is the
session's decision, :meth:`~shardcast.core.session.Session.part_asks`); the first answer
that verifies against the trusted origin key wins. The driver
(:class:`~shardcast.download.driver.DownloadDriver`) owns the sources and the session and is
told of each answer and each new part.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import trio

from p2p.errors import IntegrityError, TransportError, short_id
from p2p.http_errors import NotAvailable
from p2p.lanes import HttpLaneClient
from p2p.trust import TrustList
from shardcast.core import Session
from shardcast.wire import HOLD_HEADER, Manifest, ManifestError, decode_part, part_url

if TYPE_CHECKING:
    from shardcast.download.types import Source

# the download's events keep the logger they had before the driver got its own module
log = logging.getLogger("shardcast.download.downloader")

PART_RETRY_MAX_S = 0.25
"""Longest wait between asks for a missing manifest part, seconds (the first is 0.05 s,
doubling): a part that appears is fetched within this."""

PARTS_IN_FLIGHT = 8
"""Manifest parts asked for at once, in part order (each one's asks race its sources, and an
upstream holds it until it has the part). Asking for every missing part at once held a
connection per part and upstream: 44 at the start of a real-1b version with two upstreams,
~190 at real-6b, past the client's 64 and ahead of the blob fetches that need them; parts
reach an upstream in order, ~75 ms apart while the origin encodes, so 8 ahead is enough."""

PART_RACE_GRACE_S = 1.0
"""Once one source's answer gave a manifest part, the other asks of that round may still end
on their own for this long, seconds; then they are cancelled. An ask held by an upstream
usually ends within milliseconds (the upstreams get the part at about the same time), and
one that ends returns its connection to the pool: cancelling it at once closed a connection
per part and upstream (16-20 of the ~50 TCP connections a follower opened per next version of
real-1b in the shaped bench). The late answer's body (a few KB) is read and dropped."""

PART_PEERS_AFTER_S = 2.0
"""Longest wait, seconds, before a missing manifest part is asked of discovered peers while
an upstream still holds its ask (it answers the moment it has the part; see
:meth:`~shardcast.core.session.Session.part_asks`)."""

NO_HOLD = ((HOLD_HEADER, "0"),)
"""Request headers that ask a source to answer at once, not hold the request for content it
does not have yet (replacing the node's default hold)."""


class PartFetcher:
    """Fetches the missing manifest parts of one download (see the module docstring).

    Args:
        m: the version's manifest so far; parts are added to it as they verify.
        digest: the manifest digest (hex) that names the version on the lane.
        session: the download's session (whom to ask; told of each answer by the driver).
        sources: the download's sources by PeerID, the driver's live mapping.
        client: the HTTP lane client.
        trust: what parts are verified against.
        stall_timeout_s: longest wait for an answer, seconds.
        answered: told of each answer from a source: ``None`` for a part that verified,
            the ``404``/``409``/``429``/``503`` otherwise.
        arrived: told of each part ``k`` added to ``m``.
    """

    def __init__(
        self,
        m: Manifest,
        digest: str,
        session: Session,
        sources: Mapping[str, Source],
        client: HttpLaneClient,
        trust: TrustList,
        stall_timeout_s: float,
        answered: Callable[[str, NotAvailable | None], None],
        arrived: Callable[[int], None],
    ) -> None:
        self.m, self.digest, self.session, self.sources = m, digest, session, sources
        self.client, self.trust, self.stall_timeout_s = client, trust, stall_timeout_s
        self.answered, self.arrived = answered, arrived
        self.failed: set[str] = set()  # sources whose part_fetch_failed was logged
        self.slots = trio.Semaphore(PARTS_IN_FLIGHT)  # parts being asked for
        self.slot_held: set[int] = set()  # parts that hold one of the slots

    async def run(self) -> None:
        """Fetch every missing manifest part, in part order, :data:`PARTS_IN_FLIGHT` at a
        time (:meth:`fetch`)."""
        async with trio.open_nursery() as nursery:
            for k in sorted(self.session.missing_parts):
                await self.slots.acquire()
                self.slot_held.add(k)
                nursery.start_soon(self.fetch, k)

    def release_slot(self, k: int) -> None:
        """Part ``k`` arrived or its fetch ended: the next part may be asked for (once)."""
        if k in self.slot_held:
            self.slot_held.discard(k)
            self.slots.release()

    async def fetch(self, k: int) -> None:
        """Get manifest part ``k``: once it is among the first :data:`PARTS_IN_FLIGHT`
        missing parts, ask the sources in rounds (:meth:`ask_round`) until one gives
        it, with a backoff between rounds (0.05 s doubling to :data:`PART_RETRY_MAX_S`).

        Asking one source after another let each hold the request for its ``wait_s`` (10 s)
        while it lacked the part itself: a relay whose origin was still hashing the last file
        asked the origin (held, then 503), then each peer in turn (held 10 s each, none had
        it), and every node waited 40-50 s on one part of a version the origin had published
        long before."""
        delay = 0.05
        try:
            while k not in self.m.parts:
                await self.ask_round(k)
                if k in self.m.parts:
                    return
                await trio.sleep(delay)
                delay = min(delay * 2, PART_RETRY_MAX_S)
        finally:
            self.release_slot(k)  # if its arrival did not already

    async def ask_round(self, k: int) -> None:
        """One round of asks for manifest part ``k`` (:meth:`ask`): the upstreams at
        once, the discovered peers once no upstream ask is pending or after
        :data:`PART_PEERS_AFTER_S`, unless the part came meanwhile
        (:meth:`~shardcast.core.session.Session.part_asks`). The first verified answer wins;
        the round ends when every ask ended (the others within :data:`PART_RACE_GRACE_S`)."""
        first, then = self.session.part_asks(list(self.sources))
        pending = len(first)
        upstreams_done = trio.Event()

        async def ask_upstream(src: Source, race: trio.CancelScope) -> None:
            nonlocal pending
            try:
                await self.ask(k, src, race)
            finally:
                pending -= 1
                if not pending:
                    upstreams_done.set()

        async def ask_later(race: trio.Nursery) -> None:
            with trio.move_on_after(PART_PEERS_AFTER_S):
                await upstreams_done.wait()
            for sid in then:
                src = self.sources.get(sid)
                if k not in self.m.parts and src is not None:
                    race.start_soon(self.ask, k, src, race.cancel_scope)

        async with trio.open_nursery() as race:
            for sid in first:
                race.start_soon(ask_upstream, self.sources[sid], race.cancel_scope)
            if then:
                race.start_soon(ask_later, race)

    async def ask(self, k: int, src: Source, race: trio.CancelScope) -> None:
        """Ask ``src`` for manifest part ``k``; if it verifies, add it and end ``race``
        within :data:`PART_RACE_GRACE_S` (an answer that comes once the part is there is
        dropped undecoded).

        Only an upstream (a source the download was given, not one found by discovery) is
        asked to hold the request until it has the part: the part reaches this node through
        it. A discovered peer answers at once, so a part that no peer has yet costs no held
        request per peer (they are asked again each round)."""
        m = self.m
        url = part_url(src.base_url, m.run_id, m.step, self.digest, k)
        try:
            data = await self.client.get_bytes(
                url,
                max_bytes=8 << 20,
                timeout_s=self.stall_timeout_s,
                headers=NO_HOLD if self.session.discovered(src.id) else (),
                anonymous=src.anonymous,
            )
            if k in m.parts:  # another source's answer came first
                return
            signed = decode_part(data, m.header, trust=self.trust, source=src.id)
        except NotAvailable as exc:
            self.answered(src.id, exc)
            return
        except (TransportError, ManifestError, IntegrityError) as exc:
            # each round asks the same sources again: say it once per source, not 4 times a
            # second
            first = src.id not in self.failed
            self.failed.add(src.id)
            log.log(
                logging.INFO if first else logging.DEBUG,
                "part_fetch_failed step=%d part=%d source=%s error=%s",
                m.step,
                k,
                short_id(src.id),
                exc,
            )
            return
        self.answered(src.id, None)
        race.deadline = min(race.deadline, trio.current_time() + PART_RACE_GRACE_S)
        self.release_slot(k)  # the losers' grace does not hold up the next part
        if m.add_part(signed):
            self.session.part_given(src.id)
            self.arrived(k)
