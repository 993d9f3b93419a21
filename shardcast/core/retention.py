"""core: retention, which committed versions a node removes (sans-IO).

Keep the newest ``keep_last`` committed versions and everything they are built from: a version
kept as a chain (:mod:`shardcast.store.chains`) needs its base, and the base's base if that is
a chain too, down to a full version. Never remove a pinned one (being read, served, or used
as a delta base). :mod:`shardcast.store.store` and ``simulations/`` run this very rule.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

__all__ = ["should_materialize", "versions_to_prune"]


def versions_to_prune(
    committed: Sequence[int],
    keep_last: int,
    pinned: Iterable[int],
    bases: Mapping[int, int] | None = None,
) -> list[int]:
    """Steps to remove: all but the newest ``keep_last`` committed ones and the bases their
    chains need, skipping pinned ones.

    Args:
        committed: committed steps, ascending.
        keep_last: how many of the newest to keep (>= 1).
        pinned: steps that must not be removed now.
        bases: step -> its base step, for each version kept as a chain.
    """
    keep = set(pinned) | set(committed[max(0, len(committed) - keep_last) :])
    links = bases or {}
    for step in list(keep):
        seen = set()
        while step in links and step not in seen:  # a loop would be a corrupt record
            seen.add(step)
            step = links[step]
            keep.add(step)
    return [s for s in committed if s not in keep]


def should_materialize(depth: int, every: int) -> bool:
    """True if a version committed ``depth`` chain links above a full version is an anchor
    to materialize (``every`` > 0: chains stay at most ``every`` links long; 0: never)."""
    return every > 0 and depth >= every
