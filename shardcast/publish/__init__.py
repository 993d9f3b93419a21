"""publish: the origin side: checkpoint layout, shard plans and hashing
(:mod:`.plan`), encoding while the trainer writes (:mod:`.preencode`) and publishing signed,
pipelined versions (:mod:`.origin`).
"""

from __future__ import annotations

from shardcast.publish.origin import Origin, OriginConfig
from shardcast.publish.plan import DEFAULT_SHARD_BYTES, Base, EncodeSettings, build_manifest
from shardcast.publish.preencode import PreEncoder

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "Base",
    "EncodeSettings",
    "Origin",
    "OriginConfig",
    "PreEncoder",
    "build_manifest",
]
