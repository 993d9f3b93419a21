"""wire: the have-bitmap of the HTTP lane, which shards of a filling version a node serves.

A ``GET .../have`` answer is a bitmap of the shards held whole (bit ``i`` of byte ``i // 8``,
most significant bit first), followed with ``?prefix=1`` by the verified prefix of each shard
being received (:func:`encode_prefixes`). The server (:mod:`shardcast.serve.server`) writes
it; a downloader (:mod:`shardcast.download.driver`) reads it with :func:`decode_have`, bounded
by :func:`have_max_bytes`, and long-polls it with :data:`HAVE_TOKEN_HEADER` and
:data:`HOLD_HEADER`, naming the shards it still lacks (:func:`encode_want`) so that the
source answers only with news for it (:func:`wanted_token`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import struct
from collections.abc import Callable

import numpy as np

__all__ = [
    "HAVE_HOLD_S",
    "HAVE_TOKEN_HEADER",
    "HOLD_HEADER",
    "MAX_PREFIX_ENTRIES",
    "PREFIX_ENTRY",
    "VERSIONS_HOLD_S",
    "WANT_MAX_CHARS",
    "decode_have",
    "decode_want",
    "encode_prefixes",
    "encode_want",
    "full_bits",
    "has_bit",
    "have_max_bytes",
    "have_token",
    "shard_bits",
    "versions_token",
    "wanted_token",
]

HOLD_HEADER = "x-shardnet-hold-s"
"""Request header: how long (seconds) the client accepts to be held for unverified content."""
PREFIX_ENTRY = struct.Struct(">IQ")  #: (shard index, verified bytes) after the have-bitmap
MAX_PREFIX_ENTRIES = 256  #: at most this many partial shards are advertised


def shard_bits(n_shards: int, holds: Callable[[int], bool]) -> bytes:
    """The have-bitmap of a version of ``n_shards`` shards: bit ``i`` (of byte ``i // 8``,
    most significant first) set where ``holds(i)``; ``(n_shards + 7) // 8`` bytes. The
    layout of a ``/have`` answer and of a long-poll's ``want``."""
    out = bytearray((n_shards + 7) // 8)
    for i in range(n_shards):
        if holds(i):
            out[i // 8] |= 0x80 >> (i % 8)
    return bytes(out)


def full_bits(n_shards: int) -> bytes:
    """:func:`shard_bits` of a version whose every shard is held (a committed one), without a
    call per shard: ``(n_shards + 7) // 8`` bytes, the bits past ``n_shards`` clear."""
    out = bytearray(b"\xff" * ((n_shards + 7) // 8))
    if n_shards % 8:
        out[-1] = (0xFF << (8 - n_shards % 8)) & 0xFF
    return bytes(out)


def has_bit(bits: bytes, i: int) -> bool:
    """True if :func:`shard_bits` ``bits`` names shard ``i`` (False past its end)."""
    return i // 8 < len(bits) and bool(bits[i // 8] & (0x80 >> i % 8))


def encode_prefixes(prefixes: dict[int, int]) -> bytes:
    """The suffix of a ``/have?prefix=1`` answer: ``(u32 shard, u64 verified bytes)``
    big-endian per partial shard, in shard order, at most :data:`MAX_PREFIX_ENTRIES`."""
    items = sorted(prefixes.items())[:MAX_PREFIX_ENTRIES]
    return b"".join(PREFIX_ENTRY.pack(i, n) for i, n in items)


def decode_have(data: bytes, n_shards: int) -> tuple[list[int], dict[int, int]]:
    """Parse a ``/have`` (or ``/have?prefix=1``) answer: the shards held whole, and the
    verified prefixes of shards being received.

    Raises:
        ValueError: a suffix that is not whole entries, or names a shard out of range.
    """
    nbytes = (n_shards + 7) // 8
    bits, rest = data[:nbytes], data[nbytes:]
    # one C pass over the bits (a Python test per shard made each answer O(shards) calls)
    whole = np.frombuffer(bytes(bits).ljust(nbytes, b"\0"), np.uint8)  # short: none past it
    unpacked = np.unpackbits(whole, count=n_shards)
    held: list[int] = np.flatnonzero(unpacked).tolist()
    if len(rest) % PREFIX_ENTRY.size or len(rest) > MAX_PREFIX_ENTRIES * PREFIX_ENTRY.size:
        raise ValueError(f"have suffix of {len(rest)} bytes")
    prefixes: dict[int, int] = {}
    for i, n in PREFIX_ENTRY.iter_unpack(rest):
        if i >= n_shards:
            raise ValueError(f"prefix of shard {i} of {n_shards}")
        prefixes[i] = n
    return held, prefixes


HAVE_TOKEN_HEADER = "x-shardnet-have-token"
"""Response header of ``/have``: the answer's :func:`have_token`. Sent back as
``?known=TOKEN`` (with :data:`HOLD_HEADER`), it makes the next request a long-poll."""

HAVE_HOLD_S = 2.0
"""Longest hold of a ``/have`` long-poll, seconds: the answer then reports how far the
verified prefixes grew even if no shard completed or started."""


def have_token(bits: bytes, prefixes: dict[int, int]) -> str:
    """The token of a ``/have`` answer (:data:`HAVE_TOKEN_HEADER`; a client computes the same
    from the answer it decoded): a digest of its bitmap and of the set of shards with a
    verified prefix, as :func:`encode_prefixes` lists them. Their growth alone does not change
    it: a held file-range request follows a prefix as it grows."""
    listed = sorted(prefixes.items())[:MAX_PREFIX_ENTRIES]
    h = hashlib.blake2s(bits, digest_size=8)
    h.update(b"".join(struct.pack(">I", i) for i, n in listed if n))
    return h.hexdigest()


WANT_MAX_CHARS = 4096
"""Longest ``?want=`` a downloader sends, characters: the bitmap of up to 24,576 shards (a
393 GB version in 16 MiB shards). A larger version's long-polls name no ``want`` and are
answered on any change, as before ``want`` existed."""


_BASE64URL = re.compile(r"[A-Za-z0-9_-]*")


def encode_want(bits: bytes) -> str | None:
    """The ``?want=`` value of a ``/have`` long-poll: ``bits``, a bitmap laid out as the
    answer's (bit ``i`` of byte ``i // 8``, most significant first) of the shards the
    downloader still lacks, in unpadded base64url; None if longer than
    :data:`WANT_MAX_CHARS` (then no ``want`` is sent)."""
    text = base64.urlsafe_b64encode(bits).rstrip(b"=").decode()
    return text if len(text) <= WANT_MAX_CHARS else None


def decode_want(text: str, n_shards: int) -> bytes:
    """The bitmap of an :func:`encode_want` value, for a version of ``n_shards`` shards.

    Raises:
        ValueError: not unpadded base64url, or not ``(n_shards + 7) // 8`` bytes.
    """
    if len(text) > WANT_MAX_CHARS:
        raise ValueError(f"want of {len(text)} characters")
    if not _BASE64URL.fullmatch(text):
        raise ValueError("want is not base64url")
    try:
        bits = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"want is not base64url: {exc}") from None
    if len(bits) != (n_shards + 7) // 8:
        raise ValueError(f"want of {len(bits)} bytes for {n_shards} shards")
    return bits


def wanted_token(bits: bytes, prefixes: dict[int, int], want: bytes) -> str:
    """The :func:`have_token` of a ``/have`` answer seen through ``want`` (an
    :func:`encode_want` bitmap): only the shards the downloader lacks count, so that two
    answers differing only in shards it holds already have the same token.

    A downloader sends ``?want=`` with ``?wknown=`` (this token of the last answer, under the
    ``want`` it sends now) beside ``?known=``. A server that knows ``want`` holds the
    long-poll until this token differs (a shard the downloader lacks completed or started at
    the source); one that does not holds it on ``known`` as before. In the shaped benchmark
    (``bench/broadcast.py --shaped --seed-base``, real-1b) each peer then served 39-53
    ``/have`` answers per next version instead of 105-130
    (``bench/results/issue24-shaped-200M-s52-have-want.txt``)."""
    masked = bytes(b & w for b, w in zip(bits, want, strict=False))
    listed = sorted(prefixes.items())[:MAX_PREFIX_ENTRIES]  # what the answer carries
    inside = {i: n for i, n in listed if has_bit(want, i)}
    return have_token(masked, inside)


def have_max_bytes(n_shards: int) -> int:
    """Largest ``/have?prefix=1`` answer for a version of ``n_shards`` shards, bytes."""
    return (n_shards + 7) // 8 + MAX_PREFIX_ENTRIES * PREFIX_ENTRY.size


VERSIONS_HOLD_S = 10.0
"""Longest hold of a ``/versions`` long-poll, seconds (also capped by the server's
``wait_s``). A node that holds such requests says so in its answer (``"hold_s"``); a
follower watching an upstream this way polls its info record seldom, and at once when the
answer changes (:mod:`shardcast.download.versionwatch`)."""


def versions_token(versions: dict[str, str]) -> str:
    """The token of a ``/versions`` answer: a digest of its ``digests`` object (every
    version served, committed or filling, ``{"<step>": "<manifest digest>"}``). Sent back as
    ``?known=TOKEN`` (with :data:`HOLD_HEADER`), it makes the request a long-poll answered
    when the set of versions served changes (at most :data:`VERSIONS_HOLD_S` later)."""
    h = hashlib.blake2s(digest_size=8)
    for step, digest in sorted(versions.items()):
        h.update(f"{step}:{digest};".encode())
    return h.hexdigest()
