"""core: which delta blobs go out together in one HTTP request (sans-IO).

Theory of operation
-------------------
A next version is one small delta blob per shard (~250 KB for ~1.6 % changed bf16 elements
of a 16 MiB shard): ~85 for ``real-1b``, ~380 for ``real-6b``. One HTTP request per blob made
a follower's CPU for a next version grow with the checkpoint, not with the change (request
building and signing, response parsing, a task, a worker-thread hop per blob). The scheduler
lets several blob requests share one request slot (:attr:`SchedulerConfig.light_slot_bytes
<shardcast.core.select.SchedulerConfig>`), and :meth:`BlobBatcher.plan` groups the
:class:`~shardcast.core.session.Fetch` actions one poll of the session hands out into
batches, each fetched with one request on the lane's batch route
(:func:`~shardcast.wire.lane_urls.blobs_url`).

What may share a request: whole blobs (``start == 0``, no resumption) of one encoding from
one source that is not anonymous (a static mirror has no batch route) and has not shown that
it lacks the route (:meth:`BlobBatcher.unsupported`: a node of an older release answers the
batch route ``404``; its blobs are then asked one at a time, for as long as this object
lives). At most :data:`MAX_BATCH_BLOBS` blobs and :data:`BATCH_BYTES` bytes go in one batch
(:data:`BATCH_BYTES` says why so few; the server refuses more than :data:`MAX_BATCH_BYTES`):
memory stays bounded by the slots in flight.

Nothing about verification changes: every blob of a batch is still its own request for the
session (its own sink, digest check, outcome and verdict), and the whole response comes from
one source, so a blob that fails its signed digest blames exactly that source.

Measuring a batch: the driver hands each blob out the moment its last byte lands. A small
blob's bytes come in one or two reads, so its own first-to-last-byte time says nothing of the
source's rate: reported that way every blob would be a sample of near-infinite throughput, and
the scheduler could not tell a fast source of a next version from a slow one.
:func:`first_byte_times`, over the blobs of the batch received so far, instead gives each blob
the share of the batch's time so far (from the request to now) that its bytes took, so every
blob's sample is the batch's throughput so far, measured from the request as for a source
that held a shard whole.

A body cut between two blobs: a source still receiving the version answers a held batch once
its first blob is verified there, and sends each later one as it verifies it; if one is not
verified within the request's hold, the source closes the connection right after the last
blob it sent (its head is out: it can no longer answer ``503``). :func:`cut_between_blobs`
tells that cut from a broken stream: the body ended in order (no reset, no timeout), exactly
at a blob's end, after at least one whole blob. The blobs it did not bring then end as a
range cut at the hold ends (``HOLD_ENDED``, :func:`~shardcast.core.session.ended_at_hold`):
as that ``503`` would have ended them (asked again, elsewhere or later, and no failure
counted against the source), not as a broken stream. A source gains nothing by
cutting a batch this way that it could not get by answering ``503`` to every request; and
the bytes of a cut batch it sent are whole blobs, each checked against its signed digest.
"""

from __future__ import annotations

from collections.abc import Iterable

from p2p.errors import LocalProtocolError
from shardcast.core.session import Fetch
from shardcast.wire import MAX_BATCH_BLOBS, codecs

__all__ = [
    "BATCH_BYTES",
    "MAX_BATCH_BLOBS",
    "MAX_BATCH_BYTES",
    "BlobBatcher",
    "cut_between_blobs",
    "first_byte_times",
]

MAX_BATCH_BYTES = 8 << 20
"""Most bytes of blobs in one batch request (the lane's route accepts no more)."""

BATCH_BYTES = 1 << 20
"""Bytes of blobs a downloader puts in one batch request (:class:`BlobBatcher`'s default).

Batches are streamed at both ends (a source sends each blob the moment it has verified it, a
requester hands each out the moment it is whole: :mod:`shardcast.serve.server`), so a batch is
no longer the unit of forwarding through a relay; before that (session 57), 1 MiB beat 8 MiB on
the shaped bench because a whole batch was held at its source. With streaming (shaped bench,
``bench/broadcast.py --shaped 200M --seed-base --save-mb-s 1000``, real-1b, alternated, session
58) the last peer had the next version in 2.69-2.70 s (3 runs) with 1 MiB and 2.72-3.17 s (3
runs) with 8 MiB, against 2.91-3.21 s (13 runs) for whole-batch forwarding at 1 MiB; 4 MiB was no
better than 1 MiB either. A follower fed part by part by the origin alone
(``bench/follower_cpu.py``) spent about the same CPU at 1, 4 and 8 MiB (0.16-0.23 CPU-s): fewer
requests, but as many blobs handed out and checked."""


def first_byte_times(sizes: Iterable[int], requested: float, arrived: float) -> list[float]:
    """The first-byte instant to report for each blob of a batch whose request went out at
    ``requested`` and whose whole body had arrived at ``arrived`` (seconds, one clock), so
    that each blob's throughput sample (its size over ``arrived`` minus its instant) is the
    batch's: total bytes over ``arrived - requested``.

    Args:
        sizes: each blob's size in bytes, in the batch's order (``>= 0``).
        requested, arrived: seconds; ``arrived >= requested``.

    Returns:
        one instant per blob, each in ``[requested, arrived]``: ``arrived - elapsed * size /
        total`` (``arrived`` for an empty blob; every blob ``requested`` if all are empty).

    Raises:
        LocalProtocolError: a negative size, or ``arrived`` before ``requested``.
    """
    sizes = list(sizes)
    bad = next((i for i, n in enumerate(sizes) if n < 0), None)
    if bad is not None:
        raise LocalProtocolError(f"blob sizes must be >= 0: blob {bad} has {sizes[bad]}")
    if arrived < requested:
        raise LocalProtocolError(f"batch arrived ({arrived}) before its request ({requested})")
    total, elapsed = sum(sizes), arrived - requested
    if total == 0:
        return [requested] * len(sizes)
    return [arrived - elapsed * n / total for n in sizes]


def cut_between_blobs(received: int, sizes: Iterable[int]) -> bool:
    """True if a batch body whose source closed the connection in order after ``received``
    bytes was cut between two blobs (module docstring): ``received`` is the end of a blob
    of the batch, not of the last one, and not 0.

    Args:
        received: bytes of the body that arrived before the close (``>= 0``).
        sizes: each blob's signed size in bytes, in the batch's order.

    Returns:
        True for a cut right after whole blob ``k`` (``0 <= k < len(sizes) - 1``); False for
        a cut inside a blob, before any byte, or at the body's end (a complete body is never
        a cut).
    """
    end = 0
    for n in list(sizes)[:-1]:
        end += n
        if end >= received:
            return end == received and received > 0
    return False


class BlobBatcher:
    """Groups blob fetches into batch requests (module docstring). Pure; not thread-safe.

    Args:
        max_blobs: blobs per batch (1..:data:`MAX_BATCH_BLOBS`).
        max_bytes: bytes per batch (at most :data:`MAX_BATCH_BYTES`; default
            :data:`BATCH_BYTES`). A single blob larger than this is asked on its own.
    """

    def __init__(self, max_blobs: int = MAX_BATCH_BLOBS, max_bytes: int = BATCH_BYTES) -> None:
        if not 1 <= max_blobs <= MAX_BATCH_BLOBS or not 1 <= max_bytes <= MAX_BATCH_BYTES:
            raise ValueError(f"batch bounds {max_blobs} blobs, {max_bytes} bytes out of range")
        self.max_blobs = max_blobs
        self.max_bytes = max_bytes
        self._unsupported: set[str] = set()

    def unsupported(self, source: str) -> None:
        """``source`` answered the batch route ``404`` (an older node, or one that does not
        hold the version): ask it one blob at a time from now on."""
        self._unsupported.add(source)

    def batches_with(self, source: str) -> bool:
        """True if ``source`` may be asked for a batch (not shown to lack the route)."""
        return source not in self._unsupported

    def batchable(self, f: Fetch, anonymous: bool) -> bool:
        """True if ``f`` may share a request: a whole encoded blob (not raw bytes, not a
        resumption) from a source that is not anonymous and has the batch route."""
        return (
            f.encoding != codecs.RAW
            and f.start == 0
            and f.length == f.size
            and f.size <= self.max_bytes
            and not anonymous
            and f.source not in self._unsupported
        )

    def plan(
        self, fetches: Iterable[Fetch], anonymous: frozenset[str] = frozenset()
    ) -> list[tuple[Fetch, ...]]:
        """Group ``fetches`` (in order) into requests: each tuple is one request, a single
        fetch (asked on its own route) or a batch of two or more blobs of one source and
        encoding, within the bounds. ``anonymous``: the ids of anonymous sources. Every
        fetch appears in exactly one tuple; order within a batch follows ``fetches``."""
        open_: dict[tuple[str, str], list[Fetch]] = {}
        sizes: dict[tuple[str, str], int] = {}
        groups: list[list[Fetch]] = []
        for f in fetches:
            if not self.batchable(f, f.source in anonymous):
                groups.append([f])
                continue
            key = (f.source, f.encoding)
            group = open_.get(key)
            if (
                group is None
                or len(group) >= self.max_blobs
                or sizes[key] + f.size > self.max_bytes
            ):
                group = open_[key] = []
                sizes[key] = 0
                groups.append(group)
            group.append(f)
            sizes[key] += f.size
        return [tuple(group) for group in groups]
