"""download: the adverts a follower hears: decoded, scoped to what it may try, lanes challenged.

Theory of operation
-------------------
Every serving node gossips a :class:`~shardcast.download.discovery.NodeAdvert` on the run's
nodes topic: its lane URL (and LAN URL), the versions it holds and fills, its relays. A
follower's :class:`AdvertIntake`

1. decodes each advert (a malformed one is logged and dropped; the gossip validator
   :func:`~shardcast.download.discovery.check_advert_gossip` already refused what it could);
2. scopes its URL (:meth:`AdvertIntake.in_scope`, :func:`shardcast.core.scoped_lane`): a
   private address is tried only if it is on one of this host's own networks or the address
   this node sees the advertiser connect from, so a NATed peer's LAN address is never dialled
   from another network ("LAN scope" in :mod:`shardcast.core.reachability`);
3. offers it to the follower's :class:`~shardcast.download.discovery.SourceDirectory`, which
   uses an advertised URL only once the node behind it proved it holds the advertiser's key:
   :meth:`AdvertIntake.verify` challenges each new URL (``whoami``,
   :func:`shardcast.node.challenge_lane`), at most 8 per round, and the directory backs a
   failing URL off exponentially and then drops it (:class:`~shardcast.download.discovery.
   LaneBackoff`).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
from collections import Counter

import trio

from p2p.addresses import interface_subnets
from p2p.errors import ShardnetError, short_id
from p2p.lanes import Host, HttpLaneClient
from shardcast.core import LaneCheck, ReachabilityConfig, scoped_lane
from shardcast.download.discovery import (
    NodeAdvert,
    SourceDirectory,
    check_advert_gossip,
    nodes_topic,
)
from shardcast.node import challenge_lane

log = logging.getLogger(__name__)

__all__ = ["VERIFY_BATCH", "AdvertIntake"]

#: advertised URLs challenged per round (a round ends when the directory changes, or after
#: the advert interval)
VERIFY_BATCH = 8
#: seconds a whoami challenge of an advertised URL may take
CHALLENGE_TIMEOUT_S = 5.0


class AdvertIntake:
    """A follower's intake of node adverts (see the module docstring).

    Args:
        p2p: the node's host (gossip subscription; the hosts a peer connects from).
        client: the node's lane client (whoami challenges).
        run_id: the run whose nodes topic is listened to.
        directory: where adverts are offered and challenge results recorded.
        reachability: the node's reachability settings (which networks count as public).
        interval_s: the longest wait between challenge rounds, seconds.

    Attributes:
        interfaces: this host's own networks (which private URLs are on its LANs).
        checks: challenges of advertised URLs by outcome (metrics).
        out_of_scope: adverts heard whose URL was not this node's to try (a private address
            of another network).
    """

    def __init__(
        self,
        p2p: Host,
        client: HttpLaneClient,
        run_id: str,
        directory: SourceDirectory,
        reachability: ReachabilityConfig,
        interval_s: float,
    ) -> None:
        self.p2p = p2p
        self.client = client
        self.run_id = run_id
        self.directory = directory
        self.interval_s = interval_s
        self.interfaces = interface_subnets()
        self._public_networks = reachability.networks()
        self.checks: Counter[LaneCheck] = Counter()
        self.out_of_scope = 0

    async def listen(self) -> None:
        """Run until cancelled: decode each advert gossiped on the run's nodes topic and
        offer it, scoped (:meth:`in_scope`), to the directory."""
        sub = await self.p2p.subscribe(nodes_topic(self.run_id), check_advert_gossip)
        async for msg in sub:
            try:
                advert = NodeAdvert.decode(msg.data, msg.origin)
            except ShardnetError as exc:
                log.info("advert_rejected origin=%s error=%s", short_id(msg.origin), exc)
                continue
            self.directory.offer(self.in_scope(advert), trio.current_time())

    def in_scope(self, advert: NodeAdvert) -> NodeAdvert:
        """``advert`` with the URL this node may try as its ``http_url`` (empty: none), by
        :func:`shardcast.core.scoped_lane`; counts it in :attr:`out_of_scope` if none."""
        if not advert.http_url and not advert.lan_url:
            return advert
        observed = self.p2p.remote_hosts(advert.peer_id)
        url = scoped_lane(
            advert.http_url, advert.lan_url, observed, self.interfaces, self._public_networks
        )
        if not url:
            self.out_of_scope += 1
        if url == advert.http_url:
            return advert
        return dataclasses.replace(advert, http_url=url)

    async def verify(self) -> None:
        """Run until cancelled: challenge the lane behind each new advert; its URL is used
        only once it proved that it holds the advertiser's key; failed URLs back off and are
        dropped (:mod:`shardcast.download.discovery`). Each challenge is bounded by
        :data:`CHALLENGE_TIMEOUT_S`; its outcome is counted, never raised."""
        while True:
            now = trio.current_time()
            for advert in self.directory.to_verify(now)[:VERIFY_BATCH]:
                result = await challenge_lane(
                    self.client,
                    advert.http_url,
                    advert.peer_id,
                    secrets.token_hex(16),
                    timeout_s=CHALLENGE_TIMEOUT_S,
                )
                self.checks[result] += 1
                lane = self.directory.verified(
                    advert.peer_id, advert.http_url, result, trio.current_time()
                )
                if result is not LaneCheck.VERIFIED:
                    log.info(
                        "advert_unproven advertiser=%s http_url=%s result=%s failures=%d%s",
                        short_id(advert.peer_id),
                        advert.http_url,
                        result.value,
                        lane.failures,
                        " dropped" if lane.dropped(self.directory.backoff) else "",
                    )
            with trio.move_on_after(self.interval_s):
                await self.directory.changed.wait()
