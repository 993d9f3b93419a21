"""publish: the origin side: checkpoint layout, shard plans and hashing
(:mod:`.plan`), encoding while the trainer writes (:mod:`.preencode` for files in a watched
directory, :mod:`.inmemory` for the bytes a trainer holds) and publishing signed, pipelined
versions (:mod:`.origin`).
"""

from __future__ import annotations

from shardcast.publish.inmemory import (
    FileBytes,
    TensorBytes,
    encode_bytes,
    header_matches,
    pre_encode_bytes,
    safetensors_file,
    safetensors_header,
)
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.publish.plan import (
    DEFAULT_SHARD_BYTES,
    ENCODE_WORKERS,
    Base,
    EncodeSettings,
    PreEncoded,
    build_manifest,
    hash_parts,
    make_header,
)
from shardcast.publish.preencode import PreEncoder

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "ENCODE_WORKERS",
    "Base",
    "EncodeSettings",
    "FileBytes",
    "Origin",
    "OriginConfig",
    "PreEncoded",
    "PreEncoder",
    "TensorBytes",
    "build_manifest",
    "encode_bytes",
    "hash_parts",
    "header_matches",
    "make_header",
    "pre_encode_bytes",
    "safetensors_file",
    "safetensors_header",
]
