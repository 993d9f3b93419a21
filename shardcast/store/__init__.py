"""store: the on-disk store of checkpoint versions (verified writes, atomic commit, versions
kept as chains and read verified, retention through :mod:`shardcast.core`).
"""

from __future__ import annotations

from shardcast.store import chains, store
from shardcast.store.chains import (
    BLOB_DIR,
    CHAIN_FILE,
    ChainBroken,
    ChainReader,
    ChainRecord,
    build_file,
)
from shardcast.store.store import (
    PartialVersion,
    VersionStore,
    copy_range,
    file_matches,
    hash_file,
    latest_committed,
    pwrite_all,
    replace_file,
)

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
    "hash_file",
    "latest_committed",
    "pwrite_all",
    "replace_file",
    "store",
]
