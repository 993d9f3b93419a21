"""core: catch-up planning: which versions to download to reach the newest one with fewest bytes.

A node that holds version ``have`` and wants ``target`` can download ``target`` in full, or,
if every version ``have+1 .. target`` offers a delta against its predecessor, download that
chain of deltas (committing each version on the way). Each delta version costs the sum, over
its shards, of the ``xor-zstd`` size where offered and the raw size where not. Anchors (no
base) break a chain. :func:`plan` picks the cheaper option; it is pure (no I/O).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shardcast.wire import Manifest


@dataclass(frozen=True)
class Plan:
    """The steps to download, in order, and the bytes that plan is expected to move."""

    steps: tuple[int, ...]
    bytes: int
    full_bytes: int


def delta_cost(m: Manifest) -> int | None:
    """Bytes to fetch ``m`` given its base, or None if its parts are not all known."""
    if not m.complete or m.header.base_step is None:
        return None
    total = 0
    for i in range(len(m.header.shards)):
        entry = m.shard(i)
        offered = entry.delta()
        total += offered.size if offered is not None else entry.length
    return total


def plan(
    have: int | None, have_digest: str | None, target: Manifest, chain: Mapping[int, Manifest]
) -> Plan:
    """Choose between the full ``target`` and the delta chain from ``have``.

    Args:
        have: the newest step this node holds (None: nothing).
        have_digest: its header digest.
        target: the newest version's manifest.
        chain: manifests of versions ``have+1 .. target.step - 1`` known so far (complete).

    Returns:
        the cheaper plan (ties: the shorter one).
    """
    full = target.total_bytes
    if have is None or have >= target.step - 1:  # nothing to chain: one download
        return Plan((target.step,), delta_cost(target) or full, full)
    versions = {**chain, target.step: target}
    cost, prev_step, prev_digest = 0, have, have_digest
    for step in range(have + 1, target.step + 1):
        m = versions.get(step)
        if m is None or m.header.base_step != prev_step or m.header.base_digest != prev_digest:
            return Plan((target.step,), full, full)
        c = delta_cost(m)
        if c is None:
            return Plan((target.step,), full, full)
        cost += c
        prev_step, prev_digest = step, m.digest
    if cost < full:
        return Plan(tuple(range(have + 1, target.step + 1)), cost, full)
    return Plan((target.step,), full, full)


def worth_finishing(
    step: int, digest: str, target: Manifest, chain: Mapping[int, Manifest]
) -> bool:
    """Whether a download of version ``(step, digest)`` is still worth finishing now that
    ``target`` (newer) was announced: True if ``target`` is a delta on it, or if the delta
    chain from it to ``target`` is cheaper than ``target`` in full (see :func:`plan`); False
    when it can no longer be the base of a delta the node will use (an anchor came, a link of
    the chain is missing or is a full version): the caller abandons it and fetches
    ``target``.

    Args:
        step: the step being downloaded.
        digest: its header digest.
        target: the newest announced version's manifest (``target.step > step``).
        chain: manifests of ``step+1 .. target.step-1`` known (complete ones count).
    """
    if target.step <= step:
        return False
    if target.step == step + 1:
        h = target.header
        return h.base_step == step and h.base_digest == digest
    return plan(step, digest, target, chain).steps != (target.step,)
