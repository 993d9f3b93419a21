"""Field validators for decoded remote messages: the one place type and bound checks live.

Every decoder of untrusted bytes (manifests, run cards, node messages, rollout batches and
announcements) first parses its input into plain maps and lists (CBOR or JSON), then reads
each field through the getters below. A getter checks presence, type (``bool`` is never
accepted as an ``int``) and bounds, and raises one typed error naming the field:
:class:`~p2p.errors.FieldError` by default, or the subclass the caller passes as ``error``
(``ManifestError``, ``MalformedRunCard``…), built with its ``for_field`` classmethod. ``prefix``
is prepended to the field name in errors (``"sampling."``) for nested maps.

Pure (stdlib and :mod:`p2p.errors` only).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from p2p.errors import FieldError

__all__ = [
    "DIGEST_RE",
    "need",
    "need_bytes",
    "need_digest",
    "need_float",
    "need_int",
    "need_list",
    "need_map",
    "need_str",
    "need_version",
    "opt_int",
]

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
"""A BLAKE3-256 hex digest: 64 lowercase hex characters."""

_Error = type[FieldError]


def _type_name(typ: type | tuple[type, ...]) -> str:
    if isinstance(typ, tuple):
        return " or ".join(t.__name__ for t in typ)
    return typ.__name__


def need(
    msg: Mapping[str, Any],
    key: str,
    typ: type | tuple[type, ...],
    sender: str = "",
    *,
    error: _Error = FieldError,
    prefix: str = "",
) -> Any:
    """``msg[key]`` if present and of type ``typ`` (``bool`` only where ``typ`` names it).

    Raises:
        FieldError (or ``error``): the field is missing or has the wrong type.
    """
    if key not in msg:
        raise error.for_field(sender, prefix + key, "is missing")
    val = msg[key]
    allows_bool = typ is bool or (isinstance(typ, tuple) and bool in typ)
    if (isinstance(val, bool) and not allows_bool) or not isinstance(val, typ):
        raise error.for_field(
            sender, prefix + key, f"must be {_type_name(typ)}, got {type(val).__name__}"
        )
    return val


def need_int(
    msg: Mapping[str, Any],
    key: str,
    lo: int,
    hi: int,
    sender: str = "",
    *,
    error: _Error = FieldError,
    prefix: str = "",
) -> int:
    """``msg[key]`` as an int in ``[lo, hi]``.

    Raises:
        FieldError (or ``error``): missing, not an int, or out of range.
    """
    val = msg.get(key)
    if not isinstance(val, int) or isinstance(val, bool) or not lo <= val <= hi:
        raise error.for_field(
            sender, prefix + key, f"= {val!r:.40} is not an integer in [{lo}, {hi}]"
        )
    return val


def opt_int(
    msg: Mapping[str, Any],
    key: str,
    lo: int,
    hi: int,
    default: int,
    sender: str = "",
    *,
    error: _Error = FieldError,
    prefix: str = "",
) -> int:
    """``msg[key]`` as an int in ``[lo, hi]``, or ``default`` when the field is absent."""
    if key not in msg:
        return default
    return need_int(msg, key, lo, hi, sender, error=error, prefix=prefix)


def need_float(
    msg: Mapping[str, Any],
    key: str,
    lo: float,
    hi: float,
    sender: str = "",
    *,
    error: _Error = FieldError,
    prefix: str = "",
) -> float:
    """``msg[key]`` as a finite float (ints accepted) in ``[lo, hi]``."""
    val = float(need(msg, key, (int, float), sender, error=error, prefix=prefix))
    if not math.isfinite(val) or not lo <= val <= hi:
        raise error.for_field(sender, prefix + key, f"= {val} outside [{lo}, {hi}]")
    return val


def need_str(
    msg: Mapping[str, Any],
    key: str,
    max_len: int,
    sender: str = "",
    *,
    pattern: re.Pattern[str] | None = None,
    error: _Error = FieldError,
    prefix: str = "",
) -> str:
    """``msg[key]`` as a str of at most ``max_len`` characters (matching ``pattern`` if given).

    Raises:
        FieldError (or ``error``): missing, not a str, too long, or not matching.
    """
    val: str = need(msg, key, str, sender, error=error, prefix=prefix)
    if len(val) > max_len:
        raise error.for_field(sender, prefix + key, f"longer than {max_len}")
    if pattern is not None and not pattern.match(val):
        raise error.for_field(
            sender, prefix + key, f"= {val!r:.80} is not of the form {pattern.pattern}"
        )
    return val


def need_digest(
    msg: Mapping[str, Any],
    key: str,
    sender: str = "",
    *,
    error: _Error = FieldError,
    prefix: str = "",
) -> str:
    """``msg[key]`` as a BLAKE3 hex digest (64 lowercase hex characters)."""
    return need_str(msg, key, 64, sender, pattern=DIGEST_RE, error=error, prefix=prefix)


def need_bytes(
    msg: Mapping[str, Any],
    key: str,
    max_len: int,
    sender: str = "",
    exact: int | None = None,
    *,
    error: _Error = FieldError,
    prefix: str = "",
) -> bytes:
    """``msg[key]`` as bytes of at most ``max_len`` (or exactly ``exact``) bytes."""
    val: bytes = need(msg, key, bytes, sender, error=error, prefix=prefix)
    if exact is not None and len(val) != exact:
        raise error.for_field(sender, prefix + key, f"has {len(val)} bytes, need {exact}")
    if len(val) > max_len:
        raise error.for_field(sender, prefix + key, f"longer than {max_len} bytes")
    return val


def opt_bytes(
    msg: Mapping[str, Any],
    key: str,
    max_len: int,
    sender: str = "",
    *,
    error: _Error = FieldError,
    prefix: str = "",
) -> bytes | None:
    """``msg[key]`` as bytes of at most ``max_len`` bytes, or None when the field is absent
    (or null)."""
    if msg.get(key) is None:
        return None
    return need_bytes(msg, key, max_len, sender, error=error, prefix=prefix)


def need_list(
    msg: Mapping[str, Any],
    key: str,
    max_len: int,
    sender: str = "",
    *,
    min_len: int = 0,
    error: _Error = FieldError,
    prefix: str = "",
) -> list[Any]:
    """``msg[key]`` as a list of ``min_len`` to ``max_len`` items (items unchecked)."""
    val: list[Any] = need(msg, key, list, sender, error=error, prefix=prefix)
    if not min_len <= len(val) <= max_len:
        raise error.for_field(sender, prefix + key, f"must have {min_len} to {max_len} items")
    return val


def need_map(
    msg: Mapping[str, Any],
    key: str,
    keys: frozenset[str] | set[str],
    sender: str = "",
    *,
    optional: frozenset[str] | set[str] = frozenset(),
    error: _Error = FieldError,
    prefix: str = "",
) -> dict[str, Any]:
    """``msg[key]`` as a map holding every key of ``keys`` and nothing but ``keys | optional``."""
    val = msg.get(key)
    if not isinstance(val, dict) or not set(keys) <= set(val) <= set(keys) | set(optional):
        raise error.for_field(sender, prefix + key, f"must be a map with exactly {sorted(keys)}")
    return val


def need_version(
    msg: Mapping[str, Any],
    supported: int,
    kind: str,
    sender: str = "",
    *,
    error: _Error = FieldError,
) -> None:
    """Check the schema version field ``"v"`` equals ``supported``."""
    v = msg.get("v")
    if v != supported or isinstance(v, bool):
        raise error.for_field(
            sender, "v", f"{kind} schema version {v!r:.20}, this node speaks {supported}"
        )
