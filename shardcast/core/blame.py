"""core: corrupt bytes: which source sent them, and how long it stays banned (sans-IO).

A shard may be assembled from several sources (a broken transfer resumed elsewhere, a cut
overdue one). When the assembled copy fails its signed digest, nobody can be blamed yet; once a
verified copy of the same shard arrives, :func:`blame` compares the two range by range and names
the senders whose bytes differ, so only they are penalized (the scheduler, :mod:`.select`,
bans a source at its ``max_corrupt``-th proven corrupt transfer). :class:`SourceBans` carries
those bans across versions for ``ban_s`` seconds, bounded in memory. Both are pure: the trio
driver and the simulator use them alike.
"""

from __future__ import annotations

from collections.abc import Sequence

from p2p.errors import LocalProtocolError

__all__ = ["SourceBans", "blame"]


class SourceBans:
    """Sources banned for sending corrupt bytes, remembered across versions for ``ban_s``.

    Pure and bounded: at most ``max_sources`` bans are kept (the one ending first is dropped).
    """

    def __init__(self, ban_s: float, max_sources: int = 1024) -> None:
        self.ban_s = ban_s
        self.max_sources = max_sources
        self._until: dict[str, float] = {}

    def ban(self, source: str, now: float) -> None:
        """Ban ``source`` until ``now + ban_s``."""
        if self.ban_s <= 0:
            return
        self._until[source] = now + self.ban_s
        if len(self._until) > self.max_sources:
            del self._until[min(self._until, key=self._until.__getitem__)]

    def is_banned(self, source: str, now: float) -> bool:
        """True while ``source``'s ban lasts."""
        until = self._until.get(source)
        if until is not None and now >= until:
            del self._until[source]
            return False
        return until is not None

    def banned(self, now: float) -> list[str]:
        """Sources banned at ``now``, sorted."""
        return sorted(s for s in list(self._until) if self.is_banned(s, now))


def blame(
    contributions: Sequence[tuple[str, int, int]],
    bad: bytes | bytearray | memoryview,
    good: bytes | bytearray | memoryview,
) -> set[str]:
    """Which sources sent bytes that differ from the verified copy.

    Args:
        contributions: ``(source, start, end)`` byte ranges of the bad copy, by sender.
        bad: the assembled copy that failed its digest.
        good: the verified copy of the same shard.

    Returns:
        the sources whose range differs from ``good`` (empty if none can be blamed).
    """
    if len(bad) != len(good):
        raise LocalProtocolError("blame needs copies of equal length")
    out = set()
    for source, start, end in contributions:
        if bytes(bad[start:end]) != bytes(good[start:end]):
            out.add(source)
    return out
