"""store: the on-disk store of checkpoint versions (:mod:`.store`: committed versions, read
verified, retention through :mod:`shardcast.core`; :mod:`.partial`: a version being
downloaded, verified writes and the atomic commit; :mod:`.chains`: versions kept as a base and
delta blobs; :mod:`.files`: file primitives).
"""

from __future__ import annotations

from shardcast.store import chains, files, partial, store
from shardcast.store.chains import (
    BLOB_DIR,
    CHAIN_FILE,
    ChainBroken,
    ChainReader,
    ChainRecord,
    build_file,
)
from shardcast.store.files import copy_range, file_matches, hash_file, pwrite_all, replace_file
from shardcast.store.partial import PartialVersion
from shardcast.store.store import VersionStore, latest_committed

__all__ = [
    "BLOB_DIR",
    "CHAIN_FILE",
    "ChainBroken",
    "ChainReader",
    "ChainRecord",
    "PartialVersion",
    "VersionStore",
    "build_file",
    "chains",
    "copy_range",
    "file_matches",
    "files",
    "hash_file",
    "latest_committed",
    "partial",
    "pwrite_all",
    "replace_file",
    "store",
]
