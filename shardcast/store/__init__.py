"""store: the on-disk store of checkpoint versions (:mod:`.store`: committed versions, read
verified, retention through :mod:`shardcast.core`; :mod:`.partial`: a version being
downloaded, verified writes and the atomic commit; :mod:`.chains`: versions kept as a base and
delta blobs; :mod:`.blobpack`: a version's kept blobs in one pack file; :mod:`.files`: file
primitives).
"""

from __future__ import annotations

from shardcast.store import blobpack, chains, files, partial, store
from shardcast.store.blobpack import BlobRef, find_blob
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
    "BlobRef",
    "ChainBroken",
    "ChainReader",
    "ChainRecord",
    "PartialVersion",
    "VersionStore",
    "blobpack",
    "build_file",
    "chains",
    "copy_range",
    "file_matches",
    "files",
    "find_blob",
    "hash_file",
    "latest_committed",
    "partial",
    "pwrite_all",
    "replace_file",
    "store",
]
