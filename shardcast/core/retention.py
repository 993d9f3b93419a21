"""core: retention, which committed versions a node removes (sans-IO).

Keep the newest ``keep_last`` committed versions, and never remove a pinned one (being read,
served, or used as a delta base). :mod:`shardcast.store.store` and ``simulations/`` run this
very rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

__all__ = ["versions_to_prune"]


def versions_to_prune(committed: Sequence[int], keep_last: int, pinned: Iterable[int]) -> list[int]:
    """Steps to remove: all but the newest ``keep_last`` committed ones, skipping pinned ones.

    Args:
        committed: committed steps, ascending.
        keep_last: how many of the newest to keep (>= 1).
        pinned: steps that must not be removed now.
    """
    pins = set(pinned)
    return [s for s in committed[: max(0, len(committed) - keep_last)] if s not in pins]
