"""Canonical, bounded encoding of wire messages (deterministic CBOR, RFC 8949 §4.2).

Every signed or exchanged message in shardnet is a CBOR map with an explicit ``"v"`` (schema
version) field, encoded canonically by ``cbor2`` (sorted map keys, shortest integer and float
forms), so the same message always has the same bytes and a signature over them is stable.

Decoding is bounded and strict: the input size is checked before parsing, the top level must be
a map, and the typed getters below (``need_int``, ``need_bytes``…) check types and ranges and
raise :class:`~p2p.errors.RemoteProtocolError` naming the field, so a malformed message from a
peer becomes one typed error at the boundary rather than a ``KeyError`` deep inside.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import cbor2

from p2p.errors import MessageTooLarge, RemoteProtocolError

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


def need(msg: Mapping[str, Any], key: str, typ: type | tuple[type, ...], sender: str = "") -> Any:
    """Return ``msg[key]`` if present and of type ``typ``.

    Raises:
        RemoteProtocolError: the field is missing or has the wrong type.
    """
    if key not in msg:
        raise RemoteProtocolError(sender, f"missing field {key!r}")
    val = msg[key]
    # bool is an int subclass: never accept it where an int is expected
    if isinstance(val, bool) and typ is not bool and not (isinstance(typ, tuple) and bool in typ):
        raise RemoteProtocolError(sender, f"field {key!r} must be {typ}, got bool")
    if not isinstance(val, typ):
        raise RemoteProtocolError(sender, f"field {key!r} must be {typ}, got {type(val).__name__}")
    return val


def need_int(msg: Mapping[str, Any], key: str, lo: int, hi: int, sender: str = "") -> int:
    """``msg[key]`` as an int in ``[lo, hi]``; raises RemoteProtocolError otherwise."""
    val: int = need(msg, key, int, sender)
    if not lo <= val <= hi:
        raise RemoteProtocolError(sender, f"field {key!r}={val} outside [{lo}, {hi}]")
    return val


def need_float(msg: Mapping[str, Any], key: str, lo: float, hi: float, sender: str = "") -> float:
    """``msg[key]`` as a finite float (ints accepted) in ``[lo, hi]``."""
    val = need(msg, key, (int, float), sender)
    val = float(val)
    if not math.isfinite(val) or not lo <= val <= hi:
        raise RemoteProtocolError(sender, f"field {key!r}={val} outside [{lo}, {hi}]")
    return val


def need_str(msg: Mapping[str, Any], key: str, max_len: int, sender: str = "") -> str:
    """``msg[key]`` as a str of at most ``max_len`` characters."""
    val: str = need(msg, key, str, sender)
    if len(val) > max_len:
        raise RemoteProtocolError(sender, f"field {key!r} longer than {max_len}")
    return val


def need_bytes(
    msg: Mapping[str, Any], key: str, max_len: int, sender: str = "", exact: int | None = None
) -> bytes:
    """``msg[key]`` as bytes of at most ``max_len`` (or exactly ``exact``) bytes."""
    val: bytes = need(msg, key, bytes, sender)
    if exact is not None and len(val) != exact:
        raise RemoteProtocolError(sender, f"field {key!r} has {len(val)} bytes, need {exact}")
    if len(val) > max_len:
        raise RemoteProtocolError(sender, f"field {key!r} longer than {max_len} bytes")
    return val


def need_list(msg: Mapping[str, Any], key: str, max_len: int, sender: str = "") -> list[Any]:
    """``msg[key]`` as a list of at most ``max_len`` items."""
    val: list[Any] = need(msg, key, list, sender)
    if len(val) > max_len:
        raise RemoteProtocolError(sender, f"field {key!r} has more than {max_len} items")
    return val


def need_version(msg: Mapping[str, Any], supported: int, kind: str, sender: str = "") -> None:
    """Check the schema version field ``"v"`` equals ``supported``."""
    v = need(msg, "v", int, sender)
    if v != supported:
        raise RemoteProtocolError(
            sender, f"{kind} schema version {v}, this node speaks {supported}"
        )
