"""wire: canonical JSON and BLAKE3 digests: the signed-bytes helpers of manifests and run cards.

Pure (stdlib and ``blake3`` only): importable without libp2p or torch, so that
:mod:`shardcast.wire.runcard` and any tool reading signed documents can use it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

import blake3

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
"""What a run id may be: 1-128 characters of ``[A-Za-z0-9._-]``, not starting with ``.-_``."""

DIGEST_RE = re.compile(r"^[0-9a-f]{64}$")
"""A BLAKE3-256 hex digest."""


def blake3_hex(data: bytes | bytearray | memoryview) -> str:
    """BLAKE3-256 digest of ``data`` as 64 lowercase hex characters."""
    return blake3.blake3(data, max_threads=blake3.blake3.AUTO).hexdigest()


def canonical_json(obj: Any) -> bytes:
    """Canonical JSON: sorted keys, no whitespace, ASCII only; rejects floats.

    Raises:
        TypeError: ``obj`` contains a float or another non-JSON type (caller bug), or is
            nested too deeply to encode (a parsed untrusted document can be).
    """
    try:
        text = json.dumps(
            obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
        )
    except RecursionError:
        raise TypeError("document nested too deeply") from None
    except ValueError as exc:  # a circular document, or a NaN/infinity (a float)
        raise TypeError(f"not a canonical document: {exc}") from None
    _reject_floats(obj)  # after the encoding: no cycle, depth bounded
    return text.encode()


def loads_untrusted(data: bytes) -> Any:
    """``json.loads`` for bytes from a remote node: every failure is a ``ValueError``.

    Raises:
        ValueError: not UTF-8, not JSON, or nested too deeply for the parser (a bare
            ``json.loads`` raises ``RecursionError`` on ``[[[[…`` a few thousand deep).
    """
    try:
        return json.loads(data)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _reject_floats(obj: Any) -> None:
    """Raise ``TypeError`` if ``obj`` holds a float anywhere; iterative, with the common
    JSON types tested by exact type first (a manifest part is thousands of strings: the
    recursive ``isinstance`` walk cost more than encoding it)."""
    stack = [obj]
    while stack:
        o = stack.pop()
        t = type(o)
        if t is str or t is int or t is bool or o is None:
            continue
        if t is dict:
            stack.extend(o.values())
        elif t is list or t is tuple:
            stack.extend(o)
        elif isinstance(o, float):
            raise TypeError("floats are not allowed in canonical documents")
        elif isinstance(o, Mapping):
            stack.extend(o.values())
        elif isinstance(o, list | tuple):
            stack.extend(o)
