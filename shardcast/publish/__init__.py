"""publish: the origin side: checkpoint layout and its cut into shards (:mod:`.layout`),
hashing and encoding a file's shards (:mod:`.encode`), a version's header and signed parts
(:mod:`.plan`), encoding while the trainer writes (:mod:`.preencode` for files in a watched
directory, :mod:`.inmemory` for the bytes a trainer holds) and publishing signed, pipelined
versions (:mod:`.origin`), what the standalone origin makes of a watched directory
(:mod:`.watchdir`) and how it watches the files it published (:mod:`.published`).
"""

from __future__ import annotations

from shardcast.publish.encode import ENCODE_WORKERS, EncodeSettings, PreEncoded
from shardcast.publish.inmemory import (
    FileBytes,
    TensorBytes,
    encode_bytes,
    header_matches,
    pre_encode_bytes,
    safetensors_file,
    safetensors_header,
)
from shardcast.publish.layout import CheckpointLayoutError, check_layout
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.publish.plan import (
    DEFAULT_SHARD_BYTES,
    Base,
    build_manifest,
    hash_parts,
    make_header,
)
from shardcast.publish.preencode import Ahead, PreEncoder
from shardcast.publish.published import PublishedFiles
from shardcast.publish.watchdir import (
    EndAction,
    Fingerprint,
    RefusedSteps,
    WatchChange,
    WatchPresence,
    changed_files,
    end_action,
    fingerprint,
    ready_steps,
)

__all__ = [
    "DEFAULT_SHARD_BYTES",
    "ENCODE_WORKERS",
    "Ahead",
    "Base",
    "CheckpointLayoutError",
    "EncodeSettings",
    "EndAction",
    "FileBytes",
    "Fingerprint",
    "Origin",
    "OriginConfig",
    "PreEncoded",
    "PreEncoder",
    "PublishedFiles",
    "RefusedSteps",
    "TensorBytes",
    "WatchChange",
    "WatchPresence",
    "build_manifest",
    "changed_files",
    "check_layout",
    "encode_bytes",
    "end_action",
    "fingerprint",
    "hash_parts",
    "header_matches",
    "make_header",
    "pre_encode_bytes",
    "ready_steps",
    "safetensors_file",
    "safetensors_header",
]
