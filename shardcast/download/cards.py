"""download: a follower holds a version back until it holds the run card the version names.

Theory of operation
-------------------
Every version announcement names the run card (:mod:`shardcast.wire.runcard`) it was made
under, by version. A follower that learns of a newer card (from an upstream's info record, or
from an announcement) fetches it from its upstreams (:func:`shardcast.node.fetch_card`,
verified against the pinned trainer) and adopts it before it uses the version:
:func:`ensure_card` asks every upstream at once and returns the moment the card is held,
whichever path brought it, so one upstream slow to answer does not hold the version back
while another already gave the card. The upstreams may not hold the card yet either (they
fetch it from theirs): it asks again after :func:`shardcast.core.manifest_retry_s`, until the
card is held or a newer version supersedes the one waiting. A card that fails verification is
logged and never adopted.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence

import trio

from p2p.errors import ShardnetError, short_id
from shardcast.core import manifest_retry_s
from shardcast.node import ShardcastNode, fetch_card
from shardcast.wire import VersionAnnouncement

log = logging.getLogger(__name__)

__all__ = ["Adopt", "adopt_card_of", "adopt_from_any", "card_version", "ensure_card"]

Adopt = Callable[[str], Awaitable[bool]]
"""Fetch one upstream's run card (by PeerID) and adopt it if newer; True if adopted."""


def card_version(node: ShardcastNode) -> int:
    """The version of the run card ``node`` holds (0: none)."""
    card = node.card
    return card.version if card is not None else 0


async def adopt_card_of(node: ShardcastNode, pid: str) -> bool:
    """Fetch upstream ``pid``'s run card, verify it and have ``node`` adopt it if newer.

    Returns:
        True if ``node`` adopted it; False if it was not newer, ``pid`` had none, or on any
        failure (logged, never raised).
    """
    try:
        card = await fetch_card(node.p2p, pid, node.trust.trainer)
    except ShardnetError as exc:
        log.warning("runcard_refused upstream=%s error=%s", short_id(pid), exc)
        return False
    return card is not None and node.set_card(card)


async def ensure_card(
    node: ShardcastNode,
    upstreams: Callable[[], Iterable[str]],
    ann: VersionAnnouncement,
    superseded: Callable[[int], bool],
    adopt: Adopt,
) -> None:
    """Return once ``node`` holds the run card ``ann`` names (or a newer one), or once
    ``superseded(ann.step)`` (a newer version was announced).

    Args:
        upstreams: the PeerIDs of the upstreams to ask (read at each attempt).
        adopt: fetches one upstream's card (:func:`adopt_card_of` with ``node``).
    """
    attempt = 0
    while card_version(node) < ann.card_version and not superseded(ann.step):
        await adopt_from_any(node, sorted(upstreams()), ann.card_version, adopt)
        if card_version(node) >= ann.card_version:
            return
        log.info(
            "runcard_waiting step=%d card_version=%d have=%d",
            ann.step,
            ann.card_version,
            card_version(node),
        )
        with trio.move_on_after(manifest_retry_s(attempt)):
            await node.wait_card(ann.card_version)
        attempt += 1


async def adopt_from_any(
    node: ShardcastNode, upstreams: Sequence[str], version: int, adopt: Adopt
) -> None:
    """Ask every upstream (``adopt``) for its run card at once; return when ``node`` holds a
    card of ``version`` or newer (from any of them, or from another path) or when every
    answer is in."""
    if not upstreams:
        return
    async with trio.open_nursery() as nursery:
        pending = list(upstreams)

        async def ask(pid: str) -> None:
            await adopt(pid)
            pending.remove(pid)
            if not pending or card_version(node) >= version:
                nursery.cancel_scope.cancel()

        async def held() -> None:
            await node.wait_card(version)
            nursery.cancel_scope.cancel()

        nursery.start_soon(held)
        for pid in upstreams:
            nursery.start_soon(ask, pid)
