"""Canonical, bounded encoding of wire messages (deterministic CBOR, RFC 8949 §4.2).

Every signed or exchanged message in shardnet is a CBOR map with an explicit ``"v"`` (schema
version) field, encoded canonically by ``cbor2`` (sorted map keys, shortest integer and float
forms), so the same message always has the same bytes and a signature over them is stable.

Decoding is bounded and strict: the input size is checked before parsing, the top level must be
a map, and the typed getters of :mod:`p2p.fields` (``need_int``, ``need_bytes``…, re-exported
here) check types and ranges and raise :class:`~p2p.errors.FieldError` naming the field, so a
malformed message from a peer becomes one typed error at the boundary rather than a
``KeyError`` deep inside. Signed messages are sealed in :mod:`p2p.envelope`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import cbor2

from p2p.errors import MessageTooLarge, RemoteProtocolError
from p2p.fields import (
    need,
    need_bytes,
    need_float,
    need_int,
    need_list,
    need_str,
    need_version,
)

__all__ = [
    "decode",
    "encode",
    "need",
    "need_bytes",
    "need_float",
    "need_int",
    "need_list",
    "need_str",
    "need_version",
]

JSONish = Any


def encode(message: Mapping[str, Any]) -> bytes:
    """Encode a message map canonically.

    Raises:
        LocalProtocolError-free: ``TypeError``/``ValueError`` from cbor2 mean a caller bug.
    """
    return cbor2.dumps(dict(message), canonical=True)


def decode(data: bytes, *, max_bytes: int, sender: str = "") -> dict[str, Any]:
    """Decode ``data`` (at most ``max_bytes`` bytes) into a map with string keys.

    Args:
        data: the encoded message.
        max_bytes: bound checked before parsing.
        sender: PeerID or URL of the sender, for the error.

    Raises:
        MessageTooLarge: ``len(data) > max_bytes``.
        RemoteProtocolError: not valid CBOR, not a map, or non-string keys.
    """
    if len(data) > max_bytes:
        raise MessageTooLarge(sender, f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = cbor2.loads(data)
    except Exception as exc:  # cbor2 raises CBORDecodeError, ValueError, RecursionError...
        raise RemoteProtocolError(sender, f"undecodable message: {exc}") from exc
    if not isinstance(obj, dict) or not all(isinstance(k, str) for k in obj):
        raise RemoteProtocolError(sender, "message is not a map with string keys")
    return obj
