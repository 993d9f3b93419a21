"""Signed peer records: re-issued periodically, and a PeerID presented by two nodes told apart.

Every pubsub RPC of py-libp2p 0.8.1 carries the sender's signed peer record (libp2p RFC 0003,
"Routing Records"; its ``seq`` is a timestamp taken when the record is issued). A receiver
keeps the record with the highest ``seq`` per PeerID and drops every RPC whose record is older
(``Peerstore.consume_peer_record``, logged only as an ERROR pair that names nobody). A node
issues its record once and reuses it while its addresses do not change, so when a second node
runs with the same key (a cloned VM image with its ``node.key``) and starts later, every RPC of
the first node is dropped by the nodes that saw the second one: for good, even after the
second one exits. Two measures, both here:

- :func:`refresh_every` drives :meth:`p2p.host.P2PNode.refresh_record`, which re-issues this
  node's record (a newer ``seq``) every ``HostConfig.record_refresh_s``: that ends it within
  one period of the duplicate leaving;
- :class:`RecordConflicts` names the PeerID whose older record was refused while a record with
  other addresses was held (the sign of two nodes with one key), at WARNING, once per PeerID
  per :data:`CONFLICT_LOG_INTERVAL_S`, instead of the library's anonymous ERROR every RPC.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import trio

log = logging.getLogger(__name__)

#: a PeerID whose records conflict is named at WARNING at most once per this long, seconds
CONFLICT_LOG_INTERVAL_S = 600.0
#: PeerIDs remembered by :class:`RecordConflicts` (the oldest half is forgotten beyond it)
MAX_REMEMBERED = 1024


class RecordConflicts:
    """Decides when a refused peer record is worth a WARNING (pure; no I/O).

    A record is refused when the peerstore holds a newer one for the same PeerID. With the
    same addresses that is harmless (a late RPC of a node that re-issued its record); with
    other addresses two nodes present one PeerID, and the one with the older record is not
    heard until it re-issues.
    """

    def __init__(self, interval_s: float = CONFLICT_LOG_INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.conflicts = 0
        """Refused records whose addresses differed from the held one's (all, logged or not)."""
        self._logged: dict[str, float] = {}  # PeerID -> time of its last WARNING

    def refused(
        self, peer_id: str, held_addrs: set[str], offered_addrs: set[str], now: float
    ) -> bool:
        """Count a refused record of ``peer_id``; True if it should be logged now.

        Args:
            held_addrs, offered_addrs: multiaddrs (text) of the held and the refused record.
            now: seconds, monotonic.
        """
        if held_addrs == offered_addrs:
            return False
        self.conflicts += 1
        last = self._logged.get(peer_id)
        if last is not None and now - last < self.interval_s:
            return False
        if len(self._logged) >= MAX_REMEMBERED:
            for key in sorted(self._logged, key=self._logged.__getitem__)[: MAX_REMEMBERED // 2]:
                del self._logged[key]
        self._logged[peer_id] = now
        return True


def watch_records(peerstore: Any, conflicts: RecordConflicts, clock: Callable[[], float]) -> None:
    """Wrap ``peerstore.consume_peer_record`` (py-libp2p 0.8.1, fingerprinted in
    :mod:`p2p.boundary`) so that a record refused for an older ``seq`` while a record with
    other addresses is held logs ``peer_record_conflict`` (see :class:`RecordConflicts`).
    The peerstore's decision is unchanged."""
    consume = peerstore.consume_peer_record

    def consume_peer_record(envelope: Any, ttl: int) -> bool:
        accepted = bool(consume(envelope, ttl))
        if accepted:
            return True
        try:
            record = envelope.record()
            held = peerstore.peer_record_map.get(record.peer_id)
            if held is None or held.seq <= record.seq:
                return False  # refused for another reason (a bad signature)
            held_addrs = {str(a) for a in held.envelope.record().addrs}
            offered = {str(a) for a in record.addrs}
        except Exception:  # a malformed record: the library refused it, nothing to add
            return False
        peer_id = record.peer_id.to_base58()
        if conflicts.refused(peer_id, held_addrs, offered, clock()):
            log.warning(
                "peer_record_conflict peer_id=%s held_addrs=%s refused_addrs=%s "
                "hint=two nodes run with this PeerID's key (a copied key file?); the one with "
                "the older record is not heard until it re-issues it",
                peer_id,
                ",".join(sorted(held_addrs)),
                ",".join(sorted(offered)),
            )
        return False

    peerstore.consume_peer_record = consume_peer_record


async def refresh_every(interval_s: float, refresh: Callable[[], None]) -> None:
    """Call ``refresh`` every ``interval_s`` seconds, for ever (a task of the host's nursery).

    Raises:
        ValueError: ``interval_s`` is not > 0.
    """
    if not interval_s > 0:
        raise ValueError(f"interval_s must be > 0, got {interval_s}")
    while True:
        await trio.sleep(interval_s)
        refresh()
