"""download: the follower side: following upstreams and learning of versions
(:mod:`.follower`, its settings :mod:`.followconfig`, the run card it waits for :mod:`.cards`,
its ``/status`` and metrics :mod:`.followstatus`), finding extra sources (:mod:`.discovery`;
the adverts heard, :mod:`.adverts`; static mirrors, :mod:`.mirrors`; relay reservations and
hole punches, :mod:`.punching`), downloading one version (:mod:`.downloader`, the trio driver
:mod:`.driver` of a :class:`shardcast.core.Session`), the receiving data path
(:mod:`.receive`) and the types they share (:mod:`.types`).
"""

from __future__ import annotations

from shardcast.download import driver
from shardcast.download.discovery import (
    HolderReach,
    LaneBackoff,
    NodeAdvert,
    PunchRecord,
    SourceDirectory,
    nodes_topic,
)
from shardcast.download.downloader import Downloader
from shardcast.download.driver import DownloadDriver, check_limiter, offer
from shardcast.download.follower import (
    MANIFEST_RETRY_MAX_S,
    CommitHook,
    FollowConfig,
    Follower,
    VersionAnnouncement,
    VersionRecord,
    manifest_retry_s,
)
from shardcast.download.receive import BaseVersion, ShardSink, verify_and_write
from shardcast.download.types import (
    DownloadConfig,
    DownloadFailed,
    DownloadObserver,
    ProgressFn,
    Source,
)

__all__ = [
    "MANIFEST_RETRY_MAX_S",
    "BaseVersion",
    "CommitHook",
    "DownloadConfig",
    "DownloadDriver",
    "DownloadFailed",
    "DownloadObserver",
    "Downloader",
    "FollowConfig",
    "Follower",
    "HolderReach",
    "LaneBackoff",
    "NodeAdvert",
    "ProgressFn",
    "PunchRecord",
    "ShardSink",
    "Source",
    "SourceDirectory",
    "VersionAnnouncement",
    "VersionRecord",
    "check_limiter",
    "driver",
    "manifest_retry_s",
    "nodes_topic",
    "offer",
    "verify_and_write",
]
