"""download: the static mirrors a follower uses: polled for what they list, offered as sources.

Theory of operation
-------------------
A static mirror is a tree written by :func:`shardcast.serve.mirror.export_mirror` and served by
any web server: an HTTP-only source with no PeerID (its source id is its URL). A follower's
:class:`Mirrors` polls each one's ``/versions`` document (a plain, anonymous GET, billed per
request on a CDN: every ``mirror_poll_interval_s`` while the run is live, minutes apart once the
follower is settled, backing off after failures by
:func:`shardcast.core.pollpolicy.poll_delay`) and keeps what it lists in a sans-IO
:class:`~shardcast.core.MirrorPoll`. A mirror never tells the follower that a version exists
(only the trainer's signed announcements do): :meth:`Mirrors.sources` offers it as a source only
of the versions ``(step, digest)`` it lists, and what it serves is checked like any other
source's bytes.

Mirrors come from the follower's settings and from every run card the node adopts
(:meth:`Mirrors.follow_cards`); a mirror, once added, is kept for the life of the process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator

import trio

from p2p.errors import ShardnetError, TransportError
from p2p.lanes import HttpLaneClient
from shardcast.core import MirrorPoll, PollPolicy, poll_delay
from shardcast.download.types import Source
from shardcast.download.versionwatch import MAX_VERSIONS_BYTES
from shardcast.node import ShardcastNode
from shardcast.wire import versions_url

log = logging.getLogger(__name__)

__all__ = ["Mirrors"]

#: seconds a ``/versions`` poll may take
POLL_TIMEOUT_S = 10.0


class Mirrors:
    """The static mirrors a follower polls and downloads from (see the module docstring).

    Args:
        client: the node's lane client (anonymous GETs).
        run_id: the run whose ``/versions`` document is polled.
        urls: the configured mirrors' base URLs (validated already).
        policy: poll and retry periods (``FollowConfig.mirror_poll_policy``).
        settled: True once the follower is settled (polls minutes apart).

    Attributes:
        polls: base URL -> what its polls found.
    """

    def __init__(
        self,
        client: HttpLaneClient,
        run_id: str,
        urls: Iterable[str],
        policy: PollPolicy,
        settled: Callable[[], bool],
    ) -> None:
        self.client = client
        self.run_id = run_id
        self.policy = policy
        self.settled = settled
        self.polls = {url: MirrorPoll(url) for url in urls}
        self._nursery: trio.Nursery | None = None

    def __contains__(self, url: object) -> bool:
        return url in self.polls

    def __iter__(self) -> Iterator[str]:
        return iter(self.polls)

    async def run(self, node: ShardcastNode) -> None:
        """Run until cancelled: poll every mirror, and add those of each run card ``node``
        adopts (held at start, or later)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            for url in self.polls:
                nursery.start_soon(self._poll, url)
            version = 0
            while True:
                signed = await node.wait_card(version + 1)
                version = signed.version
                self.add(signed.card.mirrors, origin="runcard")

    def add(self, urls: Iterable[str], origin: str) -> list[str]:
        """Add mirrors (already validated URLs) not known yet and start polling them;
        ``origin`` (where they came from) is logged.

        Returns:
            the URLs added. Must be called while :meth:`run` runs (from the trio thread).
        """
        added = [u for u in dict.fromkeys(urls) if u not in self.polls]
        for url in added:
            self.polls[url] = MirrorPoll(url)
            assert self._nursery is not None, "Mirrors.add needs Mirrors.run running"
            self._nursery.start_soon(self._poll, url)
            log.info("mirror_added mirror=%s from=%s", url, origin)
        return added

    def sources(self, step: int, digest: str) -> list[Source]:
        """The mirrors that list version ``(step, digest)``, as untrusted, anonymous,
        HTTP-only sources (sorted by URL)."""
        return [
            Source(url, url, complete=False, anonymous=True)
            for url, poll in sorted(self.polls.items())
            if poll.holds(step, digest)
        ]

    async def _poll(self, url: str) -> None:
        """Keep ``polls[url]`` up to date with the mirror's ``/versions`` list."""
        poll = self.polls[url]
        versions = versions_url(url, self.run_id)
        while True:
            try:
                data = await self.client.get_bytes(
                    versions, max_bytes=MAX_VERSIONS_BYTES, timeout_s=POLL_TIMEOUT_S, anonymous=True
                )
            except (TransportError, ShardnetError) as exc:
                if poll.failed(str(exc)):
                    log.info("mirror_unreachable mirror=%s error=%s", url, exc)
            else:
                if poll.answered(data, time.time()):
                    log.info("mirror_versions mirror=%s committed=%s", url, sorted(poll.steps))
                elif poll.error is not None and poll.failures == 1:
                    log.warning("mirror_bad_versions mirror=%s error=%s", url, poll.error)
            await trio.sleep(poll_delay(self.policy, poll.failures, self.settled()))
