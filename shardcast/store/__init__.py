"""store: the on-disk store of checkpoint versions (verified writes, atomic commit,
retention through :mod:`shardcast.core`).
"""

from __future__ import annotations

from shardcast.store import store
from shardcast.store.store import (
    BLOB_DIR,
    PartialVersion,
    VersionStore,
    copy_range,
    file_matches,
    hash_file,
    latest_committed,
    pwrite_all,
)

__all__ = [
    "BLOB_DIR",
    "PartialVersion",
    "VersionStore",
    "copy_range",
    "file_matches",
    "hash_file",
    "latest_committed",
    "pwrite_all",
    "store",
]
