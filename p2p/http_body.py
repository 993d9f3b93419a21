"""Response bodies the lane's HTTP servers send besides ``bytes``: a slice of a file and a
body streamed piece by piece.

Both the real server (:mod:`p2p.http_server`) and the in-memory one (:mod:`p2p.memnet`) take
them in :class:`~p2p.http_server.HttpResponse`. Each declares its length up front (the
``Content-Length`` of the head); a body that cannot deliver every byte it declared is cut
short (the connection closes mid-body), never padded, so the client sees a short body
(``StreamBroken`` in :mod:`p2p.http_client`) and keeps only what arrived.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["FileSlice", "StreamedBody"]


@dataclass(frozen=True)
class FileSlice:
    """``length`` bytes at ``offset`` of the representation at ``path`` (from its byte
    ``base``), whose full size is ``total_size``."""

    path: Path
    offset: int
    length: int
    total_size: int
    fallbacks: tuple[Path, ...] = ()
    """Paths tried in order if ``path`` no longer exists when the body is sent (the same
    bytes moved, e.g. a directory renamed on commit)."""
    base: int = 0
    """Byte of the file where the representation starts (its ``offset`` 0): a representation
    stored inside a larger file, e.g. a blob in a pack (each fallback holds it there too)."""
    on_done: Callable[[], None] | None = field(default=None, compare=False)
    """Called once when the server is done with this slice (sent, failed or abandoned), e.g.
    to release a pin that kept the file from being deleted."""
    on_sent: Callable[[int], None] | None = field(default=None, compare=False)
    """Called once with the body bytes of this slice actually sent (a broken or abandoned
    response reports what left before it ended), e.g. to count traffic by kind."""
    ready: Callable[[int], Awaitable[int]] | None = field(default=None, compare=False)
    """For a file still being filled: ``await ready(offset)`` waits until bytes from
    ``offset`` (in the file) may be sent and returns where that run ends (exclusive); a
    return of ``offset`` or less means none came in time, and the response is cut there (the
    client sees a short body and resumes elsewhere). None: every byte may be sent now."""

    def __post_init__(self) -> None:
        if (
            min(self.offset, self.length, self.base) < 0
            or self.offset + self.length > self.total_size
        ):
            raise ValueError(f"slice {self.offset}+{self.length} outside {self.total_size} bytes")


@dataclass(frozen=True)
class StreamedBody:
    """A body of exactly ``length`` bytes whose pieces become available over time, sent as
    each is produced: ``pieces`` is iterated once, by the server, after the head is sent, and
    closed (``aclose``) however the response ends.

    Used where the head can be sent before every byte exists: a batch of delta blobs, each
    sent as soon as it is verified at this node (:mod:`shardcast.serve.server`), so the
    requester can check and forward the first blobs while the later ones arrive. If the
    pieces end before ``length`` bytes (a blob did not arrive in time), the server cuts the
    connection there; more than ``length`` bytes is the producer's bug, and the connection is
    cut too (``body_overrun``).
    """

    length: int
    """Body bytes the head declares (``Content-Length``); ``>= 0``."""
    pieces: AsyncGenerator[bytes, None] = field(compare=False)
    """The body's bytes in order, in pieces of any size; may wait between pieces."""
    on_sent: Callable[[int], None] | None = field(default=None, compare=False)
    """Called once with the body bytes actually sent (as :attr:`FileSlice.on_sent`)."""

    def __post_init__(self) -> None:
        if self.length < 0:
            raise ValueError(f"a streamed body's length must be >= 0, not {self.length}")
