"""serve: what a node gives: versions over the HTTP lane (:mod:`.server`), the
origin's super-seeding rule (:mod:`.superseeding`, sans-IO) and the static-mirror export
(:mod:`.mirror`).
"""

from __future__ import annotations

from shardcast.serve.mirror import (
    PREFIX,
    MirrorExport,
    export_mirror,
    open_store,
    version_problems,
)
from shardcast.serve.server import VersionServer
from shardcast.serve.superseeding import (
    SUPER_SEED_MIN_BYTES,
    SUPER_SEED_S,
    Decision,
    Refusal,
    Requester,
    SuperSeeding,
)

__all__ = [
    "PREFIX",
    "SUPER_SEED_MIN_BYTES",
    "SUPER_SEED_S",
    "Decision",
    "MirrorExport",
    "Refusal",
    "Requester",
    "SuperSeeding",
    "VersionServer",
    "export_mirror",
    "open_store",
    "version_problems",
]
