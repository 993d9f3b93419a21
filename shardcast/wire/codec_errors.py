"""wire: the error of shard encodings, apart from them so that every codec can raise it.

:mod:`shardcast.wire.codecs` dispatches to :mod:`shardcast.wire.sparse`, and both raise
:class:`CodecError`; it lives here so that neither module imports the other's errors.
"""

from __future__ import annotations

from p2p.errors import IntegrityError

__all__ = ["CodecError"]


class CodecError(IntegrityError):
    """Encoded bytes that cannot be decoded within bounds (the sender's fault)."""
