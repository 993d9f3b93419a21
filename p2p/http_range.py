"""Sans-IO pieces of the HTTP bulk lane: byte ranges, Content-Range, Retry-After, a token bucket.

Theory of operation
-------------------
Shard bytes move as HTTP/1.1 range requests. A downloader asks for one contiguous range
(``Range: bytes=first-last``); the server answers ``206`` with ``Content-Range:
bytes first-last/total``, ``200`` with the whole representation when it does not honour the
range, or ``416`` with ``Content-Range: bytes */total`` when the range starts past the end.

Range policy (RFC 9110 §14): the server honours exactly one well-formed byte range.

* no ``Range`` header, or a unit other than ``bytes`` → :func:`parse_range` returns ``None``:
  plain ``200`` (RFC 9110 says a server MUST ignore unknown units).
* several ranges (``bytes=0-9,20-29``) → :class:`MultipleRanges`; the server *ignores* the
  header and sends ``200`` (RFC 9110 allows ignoring ``Range``; this is nginx's ``max_ranges 1``
  behaviour). We never generate ``multipart/byteranges``; a multi-range request costs the server
  no more than a plain GET, and our own client never sends one.
* malformed (``bytes=5-3``, ``bytes=x-``) → :class:`InvalidRange`; the server rejects it with
  ``416`` as nginx does (RFC 9110 §14.2: "MAY ignore or reject"; :func:`choose_range` holds the
  whole nginx decision, so a cache in front of a relay or an nginx mirror sees the same
  answers). Our client checks for ``206`` and an exact ``Content-Range``, so an ignored range is
  never mistaken for the bytes it asked for.
* well-formed but unsatisfiable (``first >= total``, ``bytes=-0``, any range of an empty
  representation) → :func:`resolve_range` raises :class:`UnsatisfiableRange` → ``416``.

Everything here is pure: no sockets, no clock. :class:`TokenBucket` takes ``now`` (seconds, any
monotonic origin) as an argument, so the server drives it with ``trio.current_time()`` and the
tests with plain numbers.
"""

from __future__ import annotations

import email.utils
import math
import re
from dataclasses import dataclass

from p2p.errors import ShardnetError

__all__ = [
    "ByteRange",
    "ContentRange",
    "InvalidRange",
    "MultipleRanges",
    "RangeError",
    "RangeSpec",
    "SuffixRange",
    "TokenBucket",
    "UnsatisfiableRange",
    "choose_range",
    "format_content_range",
    "format_range",
    "format_unsatisfied_range",
    "if_range_holds",
    "parse_content_range",
    "parse_range",
    "parse_retry_after",
    "resolve_range",
]

_DIGITS = re.compile(r"[0-9]{1,30}")
_CONTENT_RANGE = re.compile(r"bytes ([0-9]{1,30})-([0-9]{1,30})/([0-9]{1,30}|\*)")
_OWS = " \t"
_TOKEN_EPSILON = 1e-6


class RangeError(ShardnetError, ValueError):
    """Base class of range errors: a :class:`~p2p.errors.ShardnetError` (the one hierarchy a
    decoder of untrusted input raises) and a ``ValueError`` (they describe bad input, not I/O)."""


class InvalidRange(RangeError):
    """A ``Range`` or ``Content-Range`` value that does not follow the grammar."""


class MultipleRanges(RangeError):
    """A well-formed ``Range`` with more than one range; the lane serves one range only."""


class UnsatisfiableRange(RangeError):
    """A well-formed range that selects no byte of a representation of ``total_size`` bytes."""

    def __init__(self, total_size: int) -> None:
        super().__init__(f"range not satisfiable for a representation of {total_size} bytes")
        self.total_size = total_size


@dataclass(frozen=True)
class ByteRange:
    """``bytes=first-last``, or ``bytes=first-`` when ``last`` is ``None`` (inclusive offsets)."""

    first: int
    last: int | None = None


@dataclass(frozen=True)
class SuffixRange:
    """``bytes=-length``: the last ``length`` bytes of the representation."""

    length: int


RangeSpec = ByteRange | SuffixRange


@dataclass(frozen=True)
class ContentRange:
    """A parsed ``Content-Range: bytes first-last/total``; ``total`` is ``None`` for ``*``."""

    first: int
    last: int
    total: int | None

    @property
    def length(self) -> int:
        """Number of bytes the range covers (``last - first + 1``)."""
        return self.last - self.first + 1


def parse_range(value: str) -> RangeSpec | None:
    """Parse a ``Range`` header value that may hold a single byte range.

    Args:
        value: the header value, e.g. ``"bytes=0-1023"``.

    Returns:
        The range, or ``None`` when the unit is not ``bytes`` (the header must be ignored).

    Raises:
        InvalidRange: the ``bytes`` range set does not follow RFC 9110 §14.1.1.
        MultipleRanges: the range set is well-formed but holds more than one range.
    """
    unit, sep, ranges = value.strip(_OWS).partition("=")
    if not sep or unit.lower() != "bytes":
        if sep and not unit:
            raise InvalidRange(f"missing range unit in {value!r}")
        return None
    # 1#range-spec: a comma-separated list; empty elements are allowed and ignored.
    items = [item.strip(_OWS) for item in ranges.split(",")]
    specs = [_parse_range_spec(item) for item in items if item]
    if not specs:
        raise InvalidRange(f"empty range set in {value!r}")
    if len(specs) > 1:
        raise MultipleRanges(f"{len(specs)} ranges in one request")
    return specs[0]


def _parse_range_spec(item: str) -> RangeSpec:
    first, sep, last = item.partition("-")
    if not sep:
        raise InvalidRange(f"range {item!r} has no '-'")
    if not first:
        if not _DIGITS.fullmatch(last):
            raise InvalidRange(f"bad suffix length in {item!r}")
        return SuffixRange(int(last))
    if not _DIGITS.fullmatch(first) or (last and not _DIGITS.fullmatch(last)):
        raise InvalidRange(f"bad range {item!r}")
    if not last:
        return ByteRange(int(first), None)
    spec = ByteRange(int(first), int(last))
    if spec.last is not None and spec.last < spec.first:
        raise InvalidRange(f"range {item!r} ends before it starts")
    return spec


def choose_range(value: str | None, total_size: int) -> tuple[int, int] | None:
    """The server's answer to a ``Range`` header, decided the way nginx decides it.

    nginx (``ngx_http_range_filter_module``, ``max_ranges 1``) ignores a header that is shorter
    than ``bytes=`` plus one character or has another unit (``200``); answers a syntax error,
    a range that ends before it starts, or one that starts past the end with ``416``; ignores a
    range of an empty representation that starts at 0 (and any suffix of it: ``200``); and
    ignores a set of several ranges (``200``) unless none of them is satisfiable (``416``).

    Args:
        value: the ``Range`` header, or None.
        total_size: the representation's size, bytes.

    Returns:
        ``(offset, length)`` to answer ``206``, or None to answer ``200`` with everything.

    Raises:
        UnsatisfiableRange: answer ``416`` (``Content-Range: bytes */total_size``).
    """
    if value is None:
        return None
    text = value.strip(_OWS)
    if len(text) < 7 or text[:6].lower() != "bytes=":
        return None
    try:
        spec = parse_range(text)
    except MultipleRanges:
        items = [i.strip(_OWS) for i in text[6:].split(",") if i.strip(_OWS)]
        if any(_satisfiable(_parse_range_spec(i), total_size) for i in items):
            return None
        raise UnsatisfiableRange(total_size) from None
    except InvalidRange:
        raise UnsatisfiableRange(total_size) from None
    if spec is None:
        return None
    if total_size == 0 and (isinstance(spec, SuffixRange) or spec.first == 0):
        return None
    return resolve_range(spec, total_size)


def _satisfiable(spec: RangeSpec, total_size: int) -> bool:
    try:
        resolve_range(spec, total_size)
    except UnsatisfiableRange:
        return False
    return True


def if_range_holds(value: str, etag: str | None, last_modified: str | None) -> bool:
    """Whether an ``If-Range`` condition holds (RFC 9110 §13.1.5, as nginx applies it).

    It holds if ``value`` is the representation's strong ``etag`` (weak tags never match) or,
    for a date, exactly its ``last_modified`` HTTP-date.
    """
    value = value.strip(_OWS)
    if value.startswith('"'):
        return etag is not None and not etag.startswith("W/") and value == etag
    return last_modified is not None and value == last_modified


def format_range(spec: RangeSpec) -> str:
    """Format ``spec`` as a ``Range`` header value (the inverse of :func:`parse_range`).

    Raises:
        ValueError: negative offsets or ``last < first`` (a caller bug).
    """
    if isinstance(spec, SuffixRange):
        if spec.length < 0:
            raise ValueError("negative suffix length")
        return f"bytes=-{spec.length}"
    if spec.first < 0 or (spec.last is not None and spec.last < spec.first):
        raise ValueError(f"invalid byte range {spec}")
    return f"bytes={spec.first}-" + ("" if spec.last is None else str(spec.last))


def resolve_range(spec: RangeSpec, total_size: int) -> tuple[int, int]:
    """Resolve ``spec`` against a representation of ``total_size`` bytes.

    Returns:
        ``(offset, length)`` in bytes, with ``length >= 1`` and ``offset + length <= total_size``.
        A ``last`` past the end is clamped; a suffix longer than the representation selects
        all of it.

    Raises:
        UnsatisfiableRange: ``first >= total_size``, a zero suffix, or ``total_size == 0``.
    """
    if total_size < 0:
        raise ValueError(f"negative total size {total_size}")
    if isinstance(spec, SuffixRange):
        if spec.length == 0 or total_size == 0:
            raise UnsatisfiableRange(total_size)
        length = min(spec.length, total_size)
        return total_size - length, length
    if spec.first >= total_size:
        raise UnsatisfiableRange(total_size)
    last = total_size - 1 if spec.last is None else min(spec.last, total_size - 1)
    return spec.first, last - spec.first + 1


def format_content_range(offset: int, length: int, total_size: int) -> str:
    """``Content-Range`` value for ``length >= 1`` bytes at ``offset`` of ``total_size`` bytes.

    Raises:
        ValueError: the range is empty or does not fit in ``total_size`` (a caller bug).
    """
    if offset < 0 or length < 1 or offset + length > total_size:
        raise ValueError(f"range {offset}+{length} does not fit in {total_size} bytes")
    return f"bytes {offset}-{offset + length - 1}/{total_size}"


def format_unsatisfied_range(total_size: int) -> str:
    """``Content-Range`` value of a ``416`` answer: ``bytes */total_size``."""
    return f"bytes */{total_size}"


def parse_content_range(value: str) -> ContentRange:
    """Parse a ``Content-Range`` value of a ``206`` answer (``bytes first-last/total``).

    Raises:
        InvalidRange: another form (``bytes */n``, other unit) or ``last < first`` or
            ``last >= total``.
    """
    m = _CONTENT_RANGE.fullmatch(value.strip(_OWS))
    if m is None:
        raise InvalidRange(f"bad Content-Range {value!r}")
    first, last = int(m[1]), int(m[2])
    total = None if m[3] == "*" else int(m[3])
    if last < first or (total is not None and last >= total):
        raise InvalidRange(f"inconsistent Content-Range {value!r}")
    return ContentRange(first, last, total)


def parse_retry_after(value: str, *, now_unix_s: float) -> float | None:
    """Seconds to wait from a ``Retry-After`` value (delta-seconds or an HTTP-date).

    Args:
        value: the header value.
        now_unix_s: the current wall-clock time (seconds since the epoch), for the date form.

    Returns:
        A delay ``>= 0`` in seconds, or ``None`` when the value is neither form.
    """
    value = value.strip(_OWS)
    if _DIGITS.fullmatch(value):
        return float(int(value))
    try:
        when = email.utils.parsedate_to_datetime(value)
        if when.tzinfo is None:
            return None
        return max(0.0, when.timestamp() - now_unix_s)
    except (TypeError, ValueError, OverflowError):  # OverflowError: a day of 10**40
        return None


class TokenBucket:
    """A token bucket that paces bytes to ``rate_bytes_per_s`` with bursts of ``burst_bytes``.

    Sans-IO: every method takes ``now`` (seconds, any monotonic origin, never decreasing). One
    token is one byte. A sender asks :meth:`take` for up to ``want`` bytes; it is granted either
    ``min(want, burst_bytes)`` bytes or nothing, so sends never shrink to a trickle of tiny
    writes. When nothing is granted, :meth:`wait_s` says how long until the same request
    succeeds. Bytes granted but not sent go back with :meth:`refund`.

    Over any interval of length ``T`` the bytes granted are at most
    ``burst_bytes + rate_bytes_per_s * T``.

    Not thread-safe; shared by all connections of one trio server (one thread), which is safe.

    Raises:
        ValueError: ``rate_bytes_per_s <= 0`` or ``burst_bytes < 1``.
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: int, *, now: float) -> None:
        if not rate_bytes_per_s > 0 or math.isinf(rate_bytes_per_s):
            raise ValueError(f"rate_bytes_per_s must be positive and finite: {rate_bytes_per_s}")
        if burst_bytes < 1:
            raise ValueError(f"burst_bytes must be >= 1: {burst_bytes}")
        self.rate_bytes_per_s = float(rate_bytes_per_s)
        self.burst_bytes = burst_bytes
        self._tokens = float(burst_bytes)
        self._updated = now

    def _refill(self, now: float) -> None:
        if now > self._updated:
            self._tokens = min(
                float(self.burst_bytes),
                self._tokens + (now - self._updated) * self.rate_bytes_per_s,
            )
            self._updated = now

    def take(self, want: int, now: float) -> int:
        """Grant ``min(want, burst_bytes)`` bytes if that many tokens are there, else ``0``."""
        self._refill(now)
        need = min(want, self.burst_bytes)
        # The tolerance absorbs float rounding after sleeping exactly ``wait_s``.
        if need <= 0 or self._tokens + _TOKEN_EPSILON < need:
            return 0
        self._tokens -= need
        return need

    def wait_s(self, want: int, now: float) -> float:
        """Seconds from ``now`` until ``take(want, ...)`` would grant bytes (``0.0`` if now).

        ``take(want, now + wait_s(want, now))`` grants, whatever ``now``: a short wait added
        to a large clock reading loses low bits (at ``now`` = 16 s and 831 MB/s, a 1.2 ns
        wait refilled 0.9999985 of 1 token), so the ready time is moved to the next
        representable clock reading until the refill it gives is enough.
        """
        self._refill(now)
        missing = min(want, self.burst_bytes) - self._tokens
        if missing <= _TOKEN_EPSILON:
            return 0.0
        ready = now + missing / self.rate_bytes_per_s
        while (ready - now) * self.rate_bytes_per_s + _TOKEN_EPSILON < missing:
            ready = math.nextafter(ready, math.inf)
        return ready - now

    def refund(self, unused: int) -> None:
        """Give back ``unused`` granted bytes that were not sent (capped at the burst)."""
        if unused > 0:
            self._tokens = min(float(self.burst_bytes), self._tokens + unused)
