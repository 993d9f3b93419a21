"""Small sans-IO policies shared by the real nodes and the simulator.

- :func:`versions_to_prune`: retention — keep the newest ``keep_last`` committed versions, and
  never remove a pinned one (being read, served, or used as a delta base).
- :class:`SuperSeeding`: the origin's fan-out rule — a shard's bytes go to the first requester;
  another requester within ``window_s`` is refused (it fetches the shard from a relay that has
  it), so the origin's egress stays near one copy of each version (BitTorrent "super-seeding").

Both take ``now`` as an argument and do no I/O, so :mod:`shardcast.store`,
:mod:`shardcast.serve` and ``simulations/`` run the very same decisions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def versions_to_prune(committed: Sequence[int], keep_last: int, pinned: Iterable[int]) -> list[int]:
    """Steps to remove: all but the newest ``keep_last`` committed ones, skipping pinned ones.

    Args:
        committed: committed steps, ascending.
        keep_last: how many of the newest to keep (>= 1).
        pinned: steps that must not be removed now.
    """
    pins = set(pinned)
    return [s for s in committed[: max(0, len(committed) - keep_last)] if s not in pins]


class SuperSeeding:
    """Per-(step, shard) first-requester memory of an origin (see module docstring).

    Args:
        window_s: how long a shard is reserved for its first requester, seconds; None: off.
        max_entries: bound on remembered (step, shard) pairs; the oldest are forgotten.
    """

    def __init__(self, window_s: float | None, max_entries: int = 1_000_000) -> None:
        self.window_s = window_s
        self.max_entries = max_entries
        self._served_to: dict[tuple[int, int], tuple[str, float]] = {}
        self.refused = 0

    def allow(self, requester: str, step: int, shards: Iterable[int], now: float) -> bool:
        """True if ``requester`` may get these shards now (and records it as their first).

        A repeat request by the same requester (a retry or a resumed transfer) is allowed.
        """
        if self.window_s is None:
            return True
        shards = list(shards)
        for i in shards:
            prev = self._served_to.get((step, i))
            if prev is not None and prev[0] != requester and now - prev[1] < self.window_s:
                self.refused += 1
                return False
        for i in shards:
            self._served_to.setdefault((step, i), (requester, now))
        while len(self._served_to) > self.max_entries:
            self._served_to.pop(next(iter(self._served_to)))
        return True
