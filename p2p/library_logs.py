"""py-libp2p's own log lines, kept readable: repeats filtered, handshake failures recognized.

py-libp2p logs some failures at ERROR once per attempt and without naming what failed: its
swarm's dial loop logs ``failed to upgrade security for peer …: handshake failed`` for each of
four attempts per dial, and its pubsub logs an anonymous ERROR pair with every RPC from a node
whose signed peer record it refused. :class:`RepeatFilter` (installed by
:func:`install_library_filters`, which :mod:`p2p.host` calls when it is imported) lets one of
each through per :data:`MISMATCH_LOG_INTERVAL_S`; the node reports the failure itself, once,
naming the address (:meth:`p2p.host.P2PNode.connect`) or the node
(:mod:`p2p.peer_records`). :func:`is_handshake_failure` recognizes, in whatever exception
tree a dial raised, a remote that did not prove the expected PeerID.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator

from libp2p.transport.exceptions import SecurityUpgradeFailure

__all__ = [
    "MISMATCH_LOG_INTERVAL_S",
    "RepeatFilter",
    "install_library_filters",
    "is_handshake_failure",
]

#: a dial failure that names the wrong PeerID is logged at ERROR once per address per this long
MISMATCH_LOG_INTERVAL_S = 600.0
_SWARM_LOGGER = "libp2p.network.swarm"
_SWARM_HANDSHAKE_PREFIX = "failed to upgrade security for peer"


class RepeatFilter(logging.Filter):
    """Drops a record whose message starts with ``prefix`` if the same message passed less than
    ``interval_s`` ago (``clock`` in seconds, monotonic).

    Installed on py-libp2p's swarm logger, whose dial loop logs the same ERROR ``failed to
    upgrade security for peer …: handshake failed`` for every attempt (4 per dial, each retry):
    :meth:`p2p.host.P2PNode.connect` reports that failure itself, once, naming the address;
    and on its pubsub loggers, whose refused-peer-record ERROR pair comes with every RPC of
    the refused node (:mod:`p2p.peer_records` names that node).
    """

    def __init__(
        self,
        prefix: str,
        interval_s: float = MISMATCH_LOG_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self.prefix = prefix
        self.interval_s = interval_s
        self.clock = clock
        self._last: dict[str, float] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if not text.startswith(self.prefix):
            return True
        now = self.clock()
        last = self._last.get(text)
        if last is not None and now - last < self.interval_s:
            return False
        if len(self._last) > 1024:  # bounded: forget the oldest half
            for key in sorted(self._last, key=self._last.__getitem__)[:512]:
                del self._last[key]
        self._last[text] = now
        return True


#: py-libp2p's anonymous ERROR pair for each pubsub RPC whose peer record was refused (it names
#: no peer; :mod:`p2p.peer_records` logs ``peer_record_conflict`` naming it): once per interval
_RECORD_REFUSED = (
    ("libp2p.pubsub.pubsub", "Received an invalid-signed-record"),
    ("libp2p.pubsub.gossipsub", "Received an invalid-signed-record"),
    ("libp2p.pubsub.utils", "Failed to update the Certified-Addr-Book"),
)


def install_library_filters() -> None:
    """Install :class:`RepeatFilter` on py-libp2p's swarm logger (the handshake failure of
    each dial attempt) and its pubsub loggers (the refused-peer-record pair); idempotent."""
    for name, prefix in ((_SWARM_LOGGER, _SWARM_HANDSHAKE_PREFIX), *_RECORD_REFUSED):
        logger = logging.getLogger(name)
        if not any(isinstance(f, RepeatFilter) for f in logger.filters):
            logger.addFilter(RepeatFilter(prefix))


def _exception_tree(exc: BaseException) -> Iterator[BaseException]:
    """``exc``, its causes/contexts and the members of exception groups, each once."""
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        e = todo.pop()
        if id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo.extend(x for x in (e.__cause__, e.__context__) if x is not None)
        for attr in ("exceptions", "errors"):  # ExceptionGroup; libp2p's MultiError
            members = getattr(e, attr, None)
            if isinstance(members, (list, tuple)):
                todo.extend(m for m in members if isinstance(m, BaseException))


def is_handshake_failure(exc: BaseException) -> bool:
    """True if a dial failed because the remote did not prove the expected PeerID."""
    return any(
        isinstance(e, SecurityUpgradeFailure) or str(e).startswith(_SWARM_HANDSHAKE_PREFIX)
        for e in _exception_tree(exc)
    )
