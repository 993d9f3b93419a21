"""download: a follower's settings (:class:`FollowConfig`) and its record of each version.

:class:`FollowConfig` is the one declaration of what :class:`~shardcast.download.follower.Follower`
takes (the CLI's settings map onto it); :class:`VersionRecord` is what the follower keeps of
each version it committed, and :data:`CommitHook` the call it makes after each commit (an
inference peer loads the weights there).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

from p2p.errors import ConfigError
from p2p.host import peer_id_of
from shardcast.core import (
    DownloadStats,
    PollPolicy,
    PortMapConfig,
    PunchConfig,
    ReachabilityConfig,
)
from shardcast.download.discovery import LaneBackoff, SourceDirectory
from shardcast.download.types import DownloadConfig
from shardcast.wire import Manifest, check_mirror_url

__all__ = ["CommitHook", "FollowConfig", "VersionRecord", "source_directory"]


@dataclass(frozen=True)
class FollowConfig:
    """Follower settings.

    Attributes:
        upstreams: multiaddrs (with ``/p2p/<PeerID>``) of the nodes to follow.
        poll_interval_s: period of the info poll per upstream, seconds.
        max_backoff_s: cap of the retry backoff for a failing upstream, seconds.
        discovery: advertise this node and use other nodes as extra sources.
        advert_interval_s: period of this node's advert, seconds.
        max_extra_sources: discovered sources added to one download.
        download: downloader settings.
        finished_poll_interval_s: upstream poll period once settled (run finished, final
            version held), seconds.
        finished_max_backoff_s: retry backoff cap once settled, seconds.
        mirrors: base URLs of static mirrors (``http://HOST[:PORT][/PATH]``) used as extra,
            untrusted HTTP-only sources (see the module docstring).
        mirror_poll_interval_s: period of the ``/versions`` poll per mirror while the run is
            live, seconds (a plain GET of a static file on a web server or CDN, billed per
            request: slower than the libp2p info poll of upstreams).
        lane_backoff: when an advertised URL that failed its whoami challenge is tried again,
            and when it is dropped.
        reachability: when this node checks its own lane by dial-back.
        punch: reservations on relays (when this node is unreachable) and hole punches to
            unreachable sources (:class:`shardcast.core.PunchPlanner`); used only on a host
            with circuits (:class:`p2p.circuits.CircuitConfig`).
        port_mapping: ask the LAN's UPnP gateway to forward this node's ports (off by
            default); the external lane URL is advertised once a dial-back reached it
            (:class:`shardcast.node.portmap.PortMapping`). Needs ``discovery``.
    """

    upstreams: tuple[str, ...]
    poll_interval_s: float = 1.0
    max_backoff_s: float = 10.0
    discovery: bool = True
    advert_interval_s: float = 2.0
    max_extra_sources: int = 16
    download: DownloadConfig = field(default_factory=DownloadConfig)
    finished_poll_interval_s: float = 60.0
    finished_max_backoff_s: float = 600.0
    mirrors: tuple[str, ...] = ()
    mirror_poll_interval_s: float = 5.0
    lane_backoff: LaneBackoff = field(default_factory=LaneBackoff)
    reachability: ReachabilityConfig = field(default_factory=ReachabilityConfig)
    punch: PunchConfig = field(default_factory=PunchConfig)
    port_mapping: PortMapConfig = field(default_factory=PortMapConfig)

    def poll_policy(self) -> PollPolicy:
        """The poll/retry periods."""
        return PollPolicy(
            self.poll_interval_s,
            self.max_backoff_s,
            self.finished_poll_interval_s,
            self.finished_max_backoff_s,
        )

    def mirror_poll_policy(self) -> PollPolicy:
        """The poll/retry periods of a static mirror's version list: ``poll_policy`` at the
        mirror's live period (a billed GET, not a libp2p request)."""
        return dataclasses.replace(
            self.poll_policy(),
            poll_interval_s=self.mirror_poll_interval_s,
            max_backoff_s=max(self.max_backoff_s, self.mirror_poll_interval_s),
        )

    def __post_init__(self) -> None:
        if not self.upstreams:
            raise ConfigError("upstreams", "at least one upstream multiaddr is required")
        for a in self.upstreams:
            peer_id_of(a)
        if self.poll_interval_s <= 0 or self.advert_interval_s <= 0:
            raise ConfigError("poll_interval_s", "intervals must be > 0")
        if self.mirror_poll_interval_s <= 0:
            raise ConfigError("mirror_poll_interval_s", "must be > 0")
        object.__setattr__(
            self, "mirrors", tuple(check_mirror_url(u, "mirror") for u in self.mirrors)
        )


@dataclass
class VersionRecord:
    """What happened to one version on this node (times are ``trio.current_time()``)."""

    step: int
    digest: str
    learned_at: float
    committed_at: float = 0.0
    stats: DownloadStats | None = None
    path: Path | None = None


CommitHook = Callable[[Manifest, Path, VersionRecord], Awaitable[None]]


def source_directory(own_id: str, config: FollowConfig, rng: random.Random) -> SourceDirectory:
    """The directory of nodes a follower of ``config`` downloads from: its upstreams are
    trusted; an advert is kept for five advert intervals, its lane offered only once
    verified, one node per URL, failing URLs backed off by ``config.lane_backoff``; at most
    1,024 entries."""
    return SourceDirectory(
        own_id,
        {peer_id_of(a) for a in config.upstreams},
        ttl_s=5 * config.advert_interval_s,
        max_entries=1024,
        rng=rng,
        require_verified=True,
        one_per_url=True,
        backoff=config.lane_backoff,
    )
