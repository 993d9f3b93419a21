"""Role configuration: one frozen, validated settings model per role.

Precedence, highest first: command-line options > environment (``SHARDNET_<FIELD>``, e.g.
``SHARDNET_RUN_ID``; list fields as JSON) > the TOML file given with ``--config`` > defaults.
Validation happens at start; an error names the field. Sample files live in ``configs/`` and
are parsed by ``tests/unit/test_config.py``.

Each settings model knows how to build the component configs (:class:`NodeConfig`,
:class:`FollowConfig`, …); units are in the field names.
"""

from __future__ import annotations

import ipaddress
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, TypeVar

from pydantic import Field, ValidationError, ValidationInfo, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from p2p.addresses import (
    check_advertised_families,
    check_http_url,
    check_multiaddr_text,
    check_public_host,
    default_http_host,
    default_listen,
    ensure_bindable,
    ensure_listen_bindable,
    interface_addresses,
)
from p2p.circuits import CircuitConfig
from p2p.errors import ConfigError
from p2p.host import HostConfig, parse_multiaddr, peer_id_of
from p2p.http_server import HttpServerConfig
from p2p.identity import Identity, is_valid_peer_id
from p2p.keepalive import KeepaliveConfig
from p2p.limits import LedgerConfig, ResourceLimits
from p2p.trust import TrustList
from rollout.engine_options import VllmOptions
from rollout.inbox import InboxConfig
from rollout.pacing import PacingConfig
from rollout.task import DEFAULT_REWARD_SPEC, DEFAULT_TASK_SPEC
from shardcast.core import PortMapConfig, PunchConfig, ReachabilityConfig, parse_networks
from shardcast.download import DownloadConfig, FollowConfig, LaneBackoff
from shardcast.node import NodeConfig
from shardcast.publish import DEFAULT_SHARD_BYTES, OriginConfig
from shardcast.serve import SUPER_SEED_MIN_BYTES, SUPER_SEED_S
from shardcast.wire import (
    DEFAULT_ASYNC_LEVEL,
    DEFAULT_ENGINE,
    DEFAULT_SAMPLING,
    MAX_CARD_MIRRORS,
    MAX_MIRROR_URL,
    EngineSpec,
    check_mirror_url,
)
from trainer.config import TrainerConfig

if TYPE_CHECKING:
    from rollout.calibrate import ValidatorProfile

DEFAULT_RUN_ID = "shardnet-run"
"""The run id of a trainer or origin started without ``run_id``."""

S = TypeVar("S", bound="CommonSettings")

# PeerIDs in the sample configurations (documentation addresses, RFC 5737)
_EXAMPLE_ID = "12D3KooWRdFFg3yTbTsDq5Z1yCvCWbqznEFro9jeVivo7rkayJ4D"
_EXAMPLE_RELAY = "12D3KooWP7UngXiovSF7V7xuChxypu5eHMbvmauqTX1EAsdUe2Bd"


class CommonSettings(BaseSettings):
    """Settings every role has.

    Field names are the one name of each setting: the option is ``--field-name``, the TOML key
    ``field_name``, the environment variable ``SHARDNET_FIELD_NAME`` (see :mod:`shardnet.options`).
    """

    model_config = SettingsConfigDict(env_prefix="SHARDNET_", extra="forbid", frozen=True)
    role: ClassVar[str] = ""
    #: fixed, documented ports of roles meant to be reached (0: any free port)
    default_p2p_port: ClassVar[int] = 0
    default_http_port: ClassVar[int] = 0

    run_id: str | None = Field(
        None,
        description="the training run (trainer/origin: default shardnet-run; relay/peer: "
        "default the run card's, and a card for another run is refused)",
        examples=["my-run"],
    )
    data_dir: Path = Field(Path("shardnet-data"), description="versions, key and state")
    key: Path | None = Field(
        None,
        description="Ed25519 key file made by `shardnet keygen` (default: DATA_DIR/node.key, "
        "created on first start)",
    )
    listen: list[str] = Field(
        [],
        description="libp2p listen multiaddrs (default /ip4/0.0.0.0/tcp/PORT with the role's "
        "port: trainer/origin 4001, relay 4002, peer any free port; and /ip6/::/tcp/PORT "
        "where this host has a routable IPv6 address or advertises an IPv6 one)",
    )
    http_host: str | None = Field(
        None,
        description="address the HTTP bulk lane binds (default 0.0.0.0, or :: for both "
        "families when the advertised lane host is IPv6)",
    )
    http_port: int | None = Field(
        None,
        ge=0,
        le=65535,
        description="HTTP bulk lane port (default: trainer/origin 8001, relay 8002, peer any "
        "free port; 0: any free port)",
    )
    announce: list[str] = Field(
        [],
        description="libp2p multiaddrs other hosts dial, advertised instead of the listen "
        "addresses (e.g. /ip4/203.0.113.5/tcp/4001)",
    )
    public_url: str | None = Field(
        None, description="HTTP lane URL other hosts use (http://HOST:PORT), advertised"
    )
    public_host: str | None = Field(
        None,
        description="host name or IP other hosts use for this node: advertises both lanes' "
        "ports on it (--announce and --public-url win)",
    )
    upload_limit_bytes_per_s: float | None = Field(
        None, gt=0, description="cap on HTTP lane upload, bytes/s (unset: none)"
    )
    http_max_connections_per_ip: int = Field(
        HttpServerConfig.max_connections_per_ip,
        ge=1,
        description="HTTP lane connections one client IP address may hold open at once; more "
        "are closed at accept (of 256 in all; nodes behind one NAT or on one host share it)",
    )
    keep_last: int = Field(
        NodeConfig.keep_last, ge=1, description="committed versions kept on disk"
    )
    durable_commits: bool | None = Field(
        None,
        description="fsync every committed version (default: yes for trainer/origin; relays "
        "and peers re-verify their versions after an unclean stop instead)",
    )
    request_read_timeout_s: float = Field(
        ResourceLimits.request_read_timeout_s,
        gt=0,
        description="seconds a remote peer has to send a whole request body on a libp2p "
        "request protocol before its stream is reset (separate from the handler's time)",
    )
    max_streams_per_peer: int = Field(
        ResourceLimits.streams_per_peer,
        ge=1,
        description="concurrent inbound libp2p streams of one remote peer",
    )
    max_requests_per_peer: int = Field(
        ResourceLimits.requests_per_peer,
        ge=1,
        description="concurrent inbound requests of one remote peer per protocol",
    )
    peer_ban_s: float = Field(
        LedgerConfig.ban_s,
        ge=0,
        description="seconds a remote peer that sent malformed frames or invalid gossip "
        "is banned (its connections closed, its streams refused)",
    )
    ping_interval_s: float = Field(
        KeepaliveConfig.ping_interval_s,
        gt=0,
        description="seconds between libp2p pings on each connection (finds connections that "
        "died silently, e.g. behind a NAT that lost its state)",
    )
    ping_timeout_s: float = Field(
        KeepaliveConfig.ping_timeout_s, gt=0, description="a ping unanswered this long failed"
    )
    dead_after_failures: int = Field(
        KeepaliveConfig.dead_after_failures,
        ge=1,
        description="consecutive failed pings or timed-out requests (the last a ping) that "
        "make a libp2p connection dead: it is closed and a peer this node dialled re-dialled",
    )
    redial_max_s: float = Field(
        KeepaliveConfig.redial_max_s,
        gt=0,
        description="cap on the delay between re-dials of a lost trainer, upstream or "
        "bootstrap peer, seconds (exponential from 1 s, jittered)",
    )
    report: Path | None = Field(None, description="write a JSON report here on exit")
    ready_file: Path | None = Field(None, description="write the node's addresses here")
    log_level: str = Field("INFO", description="DEBUG, INFO, WARNING, ERROR")
    log_json: bool = Field(False, description="log as JSON lines")

    @field_validator("log_level")
    @classmethod
    def _level(cls, v: str) -> str:
        if v.upper() not in ("DEBUG", "INFO", "WARNING", "ERROR"):
            raise ValueError("must be DEBUG, INFO, WARNING or ERROR")
        return v.upper()

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: list[str]) -> list[str]:
        for a in v:
            parse_multiaddr(a, "listen")
        return v

    @field_validator("announce")
    @classmethod
    def _announce(cls, v: list[str]) -> list[str]:
        return [check_multiaddr_text(a, "announce") for a in v]

    @field_validator("public_url")
    @classmethod
    def _public_url(cls, v: str | None) -> str | None:
        return None if v is None else check_http_url(v, "public_url")

    @field_validator("public_host")
    @classmethod
    def _public_host(cls, v: str | None) -> str | None:
        return None if v is None else check_public_host(v, "public_host")

    @field_validator("http_host")
    @classmethod
    def _http_host(cls, v: str | None) -> str | None:
        if v is None:
            return None
        try:
            ipaddress.ip_address(v.strip("[]"))
        except ValueError:
            raise ValueError(f"{v!r} is not a numeric IP address (0.0.0.0: all)") from None
        return v.strip("[]")

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        """CLI (init) > environment > TOML file > defaults."""
        return (init_settings, env_settings, TomlConfigSettingsSource(settings_cls))

    def preflight(self) -> None:
        """Check, before anything starts or logs, what an operator can get wrong on this host.

        Creates ``data_dir`` (and parents) if missing. The node checks its ports again when it
        binds (:meth:`shardcast.node.node.ShardcastNode.open`); this early check makes a port in use
        the only output of a failed start.

        Raises:
            ConfigError: naming ``data_dir``, ``key``, ``report`` or ``ready_file`` when it
                cannot be created or written, ``listen``/``http_port`` when a port is in
                use or an address is not this host's, or ``announce``/``public_host``/
                ``public_url`` when it names an address family nothing binds.
        """
        if self.key is not None:  # read before anything is created (data_dir below)
            self.identity()
        _check_writable_dir(self.data_dir, "data_dir")
        for name in ("report", "ready_file"):
            path = getattr(self, name)
            if path is not None:
                _check_writable_dir(path.parent, name)
        cfg = self.node_config()
        check_advertised_families(
            cfg.host.listen_multiaddrs,
            cfg.host.announce_multiaddrs,
            self.public_host,
            cfg.http.host,
            self.public_url,
        )
        ensure_listen_bindable(cfg.host.listen_multiaddrs)
        ensure_bindable(cfg.http.host, cfg.http.port, "http_port", "HTTP lane", "http_host")

    def identity(self) -> Identity:
        """Load the node key named by ``key``, or load or create (mode 0600) the default
        ``DATA_DIR/node.key``.

        A key named with ``--key`` must exist (``shardnet keygen`` makes one): other nodes pin
        this node's PeerID, so a mistyped path must not start the node as somebody new.

        Raises:
            ConfigError: ``key`` does not exist (field ``key``), or a key file is malformed
                or readable by others.
        """
        if self.key is None:
            return Identity.load_or_create(self.data_dir / "node.key")
        if str(self.key) not in ("", ".") and not self.key.exists():
            raise _missing_key(self.key)
        return Identity.load(self.key)

    def listen_multiaddrs(self) -> tuple[str, ...]:
        """``listen``, or all interfaces on the role's port, IPv6 too where this host has
        it or advertises it (:func:`p2p.addresses.default_listen`)."""
        if self.listen:
            return tuple(self.listen)
        return default_listen(
            self.default_p2p_port, interface_addresses(), self.public_host, self.announce
        )

    def http_bind_host(self) -> str:
        """``http_host``, or :func:`p2p.addresses.default_http_host`."""
        if self.http_host is not None:
            return self.http_host
        return default_http_host(self.public_host, self.public_url, interface_addresses())

    def run(self) -> str:
        """The run id: ``run_id``, or :data:`DEFAULT_RUN_ID` when unset."""
        return self.run_id or DEFAULT_RUN_ID

    def node_config(self, run_id: str | None = None) -> NodeConfig:
        """The shardcast node configuration (for ``run_id``, default :meth:`run`)."""
        durable = (
            self.role in ("trainer", "origin")
            if self.durable_commits is None
            else self.durable_commits
        )
        return NodeConfig(
            role=self.role,
            run_id=run_id or self.run(),
            data_dir=self.data_dir,
            keep_last=self.keep_last,
            durable=durable,
            public_url=self.public_url,
            host=HostConfig(
                listen_multiaddrs=self.listen_multiaddrs(),
                announce_multiaddrs=tuple(self.announce),
                public_host=self.public_host,
                # relays (public, long-lived) relay circuits for peers behind NATs; peers
                # reserve on them and hole-punch to each other (p2p.circuits); publishers
                # neither
                circuits=(
                    CircuitConfig(hop=self.role == "relay")
                    if self.role in ("relay", "peer")
                    else None
                ),
                limits=ResourceLimits(
                    streams_per_peer=self.max_streams_per_peer,
                    streams_total=max(ResourceLimits.streams_total, self.max_streams_per_peer),
                    requests_per_peer=self.max_requests_per_peer,
                    request_read_timeout_s=self.request_read_timeout_s,
                ),
                ledger=LedgerConfig(ban_s=self.peer_ban_s),
                keepalive=KeepaliveConfig(
                    ping_interval_s=self.ping_interval_s,
                    ping_timeout_s=self.ping_timeout_s,
                    dead_after_failures=self.dead_after_failures,
                    redial_initial_s=min(KeepaliveConfig.redial_initial_s, self.redial_max_s),
                    redial_max_s=self.redial_max_s,
                ),
            ),
            http=HttpServerConfig(
                host=self.http_bind_host(),
                port=self.default_http_port if self.http_port is None else self.http_port,
                bandwidth_bytes_per_s=self.upload_limit_bytes_per_s,
                max_connections_per_ip=self.http_max_connections_per_ip,
            ),
        )


def _missing_key(path: Path) -> ConfigError:
    """The error of a ``--key`` that names no file (a typo must not make a new identity)."""
    return ConfigError(
        "key",
        f"{path}: no such key file (create it with `shardnet keygen --key {path}`, or leave "
        "--key out to keep one in the data directory)",
    )


def _check_writable_dir(path: Path, option: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        raise ConfigError(
            option, f"{path} is not a writable directory ({exc.strerror or exc})"
        ) from None


def _check_dialable(addrs: list[str], option: str) -> list[str]:
    """Each entry must be a dialable multiaddr ending in ``/p2p/<PeerID>``."""
    for a in addrs:
        check_multiaddr_text(a, option)
        pid = a.rsplit("/p2p/", 1)[1] if "/p2p/" in a else ""
        if not is_valid_peer_id(pid):
            raise ConfigError(option, f"{a!r} must end in /p2p/<PeerID> with a valid PeerID")
    return addrs


def _check_peer_ids(ids: list[str], option: str) -> list[str]:
    for pid in ids:
        if not is_valid_peer_id(pid):
            raise ConfigError(option, f"{pid!r} is not a PeerID (12D3KooW...)")
    return ids


def _task_field() -> Any:
    return Field(
        DEFAULT_TASK_SPEC,
        description="the task: digits (built-in demo), a dataset file (.jsonl or .parquet: "
        "prompt or messages, answer), or an entry point package.module:Task",
        examples=[DEFAULT_TASK_SPEC, "shardnet/tasks/arithmetic.jsonl"],
    )


def _task_reward_field() -> Any:
    return Field(
        DEFAULT_REWARD_SPEC,
        description="reward of a dataset task: exact, numeric[:TOLERANCE], regex:PATTERN or boxed",
    )


def _check_task_reward(v: str) -> str:
    from rollout.rewards import parse_reward

    parse_reward(v)
    return v


def _preflight_task(task: str, task_reward: str) -> None:
    """Load the task once so a bad dataset row or entry point stops the start (one line)."""
    if task == "digits":
        return  # built in: nothing to read (and no need to import transformers here)
    from rollout.task import load_task

    load_task(task, task_reward)


class FollowerSettings(CommonSettings):
    """Settings of roles that download versions (relay, peer)."""

    trainer_id: str = Field(
        ..., description="the trainer's PeerID (pinned)", examples=[_EXAMPLE_ID]
    )
    allow_relay: list[str] = Field([], description="only download from these PeerIDs")
    poll_interval_s: float = Field(
        FollowConfig.poll_interval_s, gt=0, description="upstream info poll period, seconds"
    )
    stall_timeout_s: float = Field(
        DownloadConfig.stall_timeout_s,
        gt=0,
        description="fail a transfer stalled this long, seconds",
    )

    source_ban_s: float = Field(
        DownloadConfig.source_ban_s,
        ge=0,
        description="seconds a shard source that sent corrupt bytes stays banned, across "
        "versions (0: for the current version only)",
    )
    keep_chains: bool = Field(
        DownloadConfig.keep_chains,
        description="keep a version received as deltas as its base plus the verified blobs "
        "(no full files written; built and verified on read); off: write every file at once",
    )
    materialize_every: int = Field(
        DownloadConfig.materialize_every,
        ge=0,
        description="materialize a kept chain in the background once it is this many "
        "versions above a full one (0: only when something needs the files)",
    )
    mirror: list[str] = Field(
        [],
        description="static mirror base URL (http://HOST[:PORT][/PATH], a tree written by "
        "`shardnet mirror export` behind any web server): an extra, untrusted shard source "
        "for announced versions it lists",
    )
    mirror_poll_interval_s: float = Field(
        FollowConfig.mirror_poll_interval_s,
        gt=0,
        description="how often each --mirror's version list is fetched while the run is "
        "live, seconds (one GET per follower and mirror each time: a CDN bills them)",
    )
    exit_on_finish: bool = Field(
        False,
        description="exit (code 0) once the trainer announced the run's end and this node "
        "holds its final version (default: keep serving it)",
    )
    advert_retry_s: float = Field(
        LaneBackoff.first_s,
        gt=0,
        allow_inf_nan=False,
        description="an advertised lane URL that failed its check is tried again after this "
        "many seconds, each further failure waiting advert_retry_factor times longer (each "
        "try is one connection attempt of up to 5 s to that node)",
    )
    advert_retry_factor: float = Field(
        LaneBackoff.factor,
        ge=1,
        allow_inf_nan=False,
        description="growth of the wait between tries of a failing advertised URL",
    )
    advert_max_failures: int = Field(
        LaneBackoff.max_failures,
        ge=1,
        description="failures in a row after which an advertised URL is dropped (not tried "
        "for advert_drop_s)",
    )
    advert_drop_s: float = Field(
        LaneBackoff.drop_s,
        ge=0,
        allow_inf_nan=False,
        description="seconds a dropped advertised URL is not tried (then it starts over)",
    )
    reachability_recheck_s: float = Field(
        ReachabilityConfig.recheck_s,
        gt=0,
        allow_inf_nan=False,
        description="seconds between dial-back checks of this node's own lane once one gave "
        "a verdict (each asks up to 3 connected nodes to open it)",
    )
    serve_behind_nat: bool = Field(
        ReachabilityConfig.serve_behind_nat,
        description="once this node's lane is found unreachable (behind a NAT), serve anyway "
        "over the connections it holds (stream lane) and through relay reservations that "
        "others hole-punch to; off: only download (a LAN lane is still offered to its own "
        "network)",
    )
    public_network: list[str] = Field(
        list(ReachabilityConfig.public_networks),
        description="CIDR whose addresses count as public when judging another node's "
        "advertised lane, repeatable (a deployment across a VPN, an overlay such as "
        "100.64.0.0/10, or a private WAN); by default only globally routable addresses do, "
        "and a private address is tried only from its own network",
    )
    port_mapping: bool = Field(
        PortMapConfig.enabled,
        description="ask the home router (UPnP IGD, found by SSDP multicast on the LAN) to "
        "forward this node's libp2p and HTTP lane ports, renewed while it runs and deleted at "
        "exit; the external lane URL is advertised once a dial-back reached it (for a node "
        "behind a home router; off: nothing is sent to the router)",
    )
    punch_ahead: int = Field(
        PunchConfig.ahead_max_direct,
        ge=0,
        description="nodes behind NATs this node hole-punches to as soon as it hears of them, "
        "before a download needs their bytes (0: punch only when a download does)",
    )

    @field_validator("trainer_id")
    @classmethod
    def _trainer_id(cls, v: str) -> str:
        return _check_peer_ids([v], "trainer_id")[0]

    @field_validator("mirror")
    @classmethod
    def _mirror(cls, v: list[str]) -> list[str]:
        return [check_mirror_url(u, "mirror") for u in v]

    @field_validator("public_network")
    @classmethod
    def _public_network(cls, v: list[str]) -> list[str]:
        parse_networks(v, "public_network")
        return v

    @field_validator("allow_relay")
    @classmethod
    def _allow_relay(cls, v: list[str]) -> list[str]:
        return _check_peer_ids(v, "allow_relay")

    def trust(self) -> TrustList:
        """The trust list."""
        return TrustList(trainer=self.trainer_id, relays=frozenset(self.allow_relay))

    def follow_config(self, upstreams: list[str]) -> FollowConfig:
        """The follower configuration."""
        return FollowConfig(
            upstreams=tuple(upstreams),
            poll_interval_s=self.poll_interval_s,
            mirrors=tuple(self.mirror),
            mirror_poll_interval_s=self.mirror_poll_interval_s,
            download=DownloadConfig(
                stall_timeout_s=self.stall_timeout_s,
                source_ban_s=self.source_ban_s,
                keep_partial=True,
                keep_chains=self.keep_chains,
                materialize_every=self.materialize_every,
            ),
            lane_backoff=LaneBackoff(
                first_s=self.advert_retry_s,
                factor=self.advert_retry_factor,
                max_failures=self.advert_max_failures,
                drop_s=self.advert_drop_s,
            ),
            reachability=ReachabilityConfig(
                recheck_s=self.reachability_recheck_s,
                serve_behind_nat=self.serve_behind_nat,
                public_networks=tuple(self.public_network),
            ),
            punch=PunchConfig(ahead_max_direct=self.punch_ahead),
            port_mapping=PortMapConfig(enabled=self.port_mapping),
        )


class RelaySettings(FollowerSettings):
    """``shardnet relay``."""

    role: ClassVar[str] = "relay"
    default_p2p_port: ClassVar[int] = 4002
    default_http_port: ClassVar[int] = 8002
    upstream: list[str] = Field(
        ...,
        min_length=1,
        description="origin/relay multiaddrs with /p2p/<PeerID>",
        examples=[[f"/ip4/192.0.2.10/tcp/4001/p2p/{_EXAMPLE_ID}"]],
    )

    serve_once_s: float = Field(
        SUPER_SEED_S,
        ge=0,
        allow_inf_nan=False,
        description="relay super-seeding window, seconds: a shard goes to one downloader "
        "first and others fetch it from that one (peers re-serve verified chunks at once); "
        "0: off",
    )

    serve_once_min_bytes: int = Field(
        SUPER_SEED_MIN_BYTES,
        ge=0,
        description="versions offering at most this many bytes in all (deltas, usually) are "
        "served to every requester, not super-seeded: a refusal costs a round trip and an "
        "extra hop (0: super-seed every version)",
    )

    @field_validator("upstream")
    @classmethod
    def _upstream(cls, v: list[str]) -> list[str]:
        return _check_dialable(v, "upstream")


class PeerSettings(FollowerSettings):
    """``shardnet peer``."""

    role: ClassVar[str] = "peer"
    bootstrap: list[str] = Field(
        ...,
        min_length=1,
        description="relay multiaddrs with /p2p/<PeerID> (the run card is fetched from them)",
        examples=[[f"/ip4/192.0.2.11/tcp/4002/p2p/{_EXAMPLE_RELAY}"]],
    )
    torch_threads: int = Field(1, ge=1, description="CPU threads for inference")
    max_versions: int | None = Field(None, ge=1, description="stop generating after N versions")
    engine: Literal["transformers", "vllm"] | None = Field(
        None,
        description="inference engine family: transformers, or vllm (needs the extra); default "
        "the run card's first engine this machine can run",
    )
    vllm_keep_host_copy: bool = Field(
        VllmOptions.keep_host_copy,
        description="vLLM only: keep a host copy of the serving version's weights in RAM (the "
        "checkpoint's size, e.g. 1.32 GB for real-1b, for as long as the peer runs) so a next "
        "version's sparse delta is applied in place instead of reloading the checkpoint from "
        "disk; false: every version is a full reload (transformers updates in place without it)",
    )
    trainer_addr: list[str] = Field([], description="trainer multiaddrs (say hello at start)")
    task: str = _task_field()
    task_reward: str = _task_reward_field()
    pacing: bool = Field(
        PacingConfig.enabled,
        description="cut a batch short (the first k prompts' groups, at least one) when a "
        "newer version arrives or the next group would likely end outside the async window; "
        "false: always whole batches",
    )
    pacing_margin_steps: float = Field(
        PacingConfig.margin_steps,
        ge=0,
        allow_inf_nan=False,
        description="trainer steps of the async window kept in reserve when pacing: a batch "
        "gets (async_level + 1 - margin) step intervals, as this peer sees them, from when "
        "it committed the version",
    )

    @field_validator("bootstrap", "trainer_addr")
    @classmethod
    def _dialable(cls, v: list[str], info: ValidationInfo) -> list[str]:
        return _check_dialable(v, str(info.field_name))

    @field_validator("task_reward")
    @classmethod
    def _reward(cls, v: str) -> str:
        return _check_task_reward(v)

    def preflight(self) -> None:
        """Common checks, then each ``trainer_addr`` names ``trainer_id`` (a multiaddr of
        another node would be dialled and asked for hellos that it never answers), then the
        task loads (see :meth:`CommonSettings.preflight`).

        Raises:
            ConfigError: naming ``trainer_addr`` or the task's fields.
        """
        super().preflight()
        for addr in self.trainer_addr:
            if peer_id_of(addr) != self.trainer_id:
                raise ConfigError(
                    "trainer_addr",
                    f"{addr} ends in another PeerID than --trainer-id {self.trainer_id}",
                )
        _preflight_task(self.task, self.task_reward)

    def vllm_options(self) -> VllmOptions:
        """The vLLM engine's options (used when the peer runs vLLM)."""
        return VllmOptions(keep_host_copy=self.vllm_keep_host_copy)


class PublishSettings(CommonSettings):
    """Settings of roles that publish versions (trainer, origin)."""

    default_p2p_port: ClassVar[int] = 4001
    default_http_port: ClassVar[int] = 8001

    shard_size_bytes: int = Field(
        DEFAULT_SHARD_BYTES, ge=4096, description="shard size of versions"
    )
    shards_per_part: int = Field(
        OriginConfig.shards_per_part,
        ge=1,
        description="shards per signed manifest part: no byte of a shard moves before its part "
        "is hashed and signed, so smaller parts mean earlier first bytes (and more part "
        "requests)",
    )
    delta_shards_per_part: int = Field(
        OriginConfig.delta_shards_per_part,
        ge=1,
        description="shards per signed manifest part of a version offered as a delta: its "
        "bytes are few, so larger parts save every follower requests at no cost in time",
    )
    anchor_every: int = Field(
        OriginConfig.anchor_every, ge=1, description="a full version every N steps"
    )
    deltas: bool = Field(
        OriginConfig.deltas,
        description="offer deltas against the previous version (sparse or xor-zstd)",
    )
    zstd: bool = Field(OriginConfig.zstd, description="also offer zstd of every shard (slow links)")
    encode_workers: int = Field(
        OriginConfig.encode_workers,
        ge=0,
        description="threads that hash and delta-encode a file's shards side by side "
        "(0: one per CPU core, at most 8)",
    )
    serve_once_s: float | None = Field(
        SUPER_SEED_S,
        gt=0,
        description="origin super-seeding window, seconds: a shard goes to one relay, the "
        "others get it from that relay",
    )
    serve_once_min_bytes: int = Field(
        SUPER_SEED_MIN_BYTES,
        ge=0,
        description="versions offering at most this many bytes in all (deltas, usually) are "
        "served to every requester, not super-seeded: a refusal costs a round trip and an "
        "extra hop (0: super-seed every version)",
    )
    # the run's rules, published in the signed run card (peers adopt them from there)
    async_level: int = Field(
        DEFAULT_ASYNC_LEVEL, ge=0, description="versions a rollout may lag (run card)"
    )
    n_prompts: int = Field(
        DEFAULT_SAMPLING.prompts_per_step, ge=1, description="prompts per peer per step (run card)"
    )
    group_size: int = Field(
        DEFAULT_SAMPLING.group_size, ge=1, description="samples per prompt (run card)"
    )
    max_new_tokens: int = Field(
        DEFAULT_SAMPLING.max_new_tokens, ge=1, description="completion cap, tokens (run card)"
    )
    temperature: float = Field(
        DEFAULT_SAMPLING.temperature, gt=0, le=100, description="sampling temperature (run card)"
    )
    engines: list[str] = Field(
        [DEFAULT_ENGINE.id],
        min_length=1,
        max_length=8,
        description="FAMILY-DTYPE of the inference engines whose rollouts the run accepts "
        "(run card; e.g. transformers-bf16, vllm-bf16)",
    )

    card_mirror: list[str] = Field(
        [],
        max_length=MAX_CARD_MIRRORS,
        description="static mirror base URL named in the signed run card "
        "(http://HOST[:PORT][/PATH], a tree written by `shardnet mirror export`): relays and "
        "peers that adopt the card add it to their --mirror list (untrusted, like any mirror)",
    )

    @field_validator("card_mirror")
    @classmethod
    def _card_mirror(cls, v: list[str]) -> list[str]:
        urls = [check_mirror_url(u, "card_mirror") for u in v]
        if any(len(u) > MAX_MIRROR_URL for u in urls):
            raise ValueError(f"a URL is longer than {MAX_MIRROR_URL} characters")
        if len(set(urls)) != len(urls):
            raise ValueError("a mirror is listed twice")
        return urls

    @field_validator("engines")
    @classmethod
    def _engines(cls, v: list[str]) -> list[str]:
        try:
            specs = [EngineSpec.parse(e) for e in v]
        except ConfigError as exc:
            raise ValueError(str(exc).removeprefix("engines: ")) from exc
        if len(set(specs)) != len(specs):
            raise ValueError("an engine is listed twice")
        return v

    def engine_specs(self) -> tuple[EngineSpec, ...]:
        """The ``engines`` field, parsed."""
        return tuple(EngineSpec.parse(e) for e in self.engines)

    task: str = _task_field()
    task_reward: str = _task_reward_field()
    # how rollouts are received and verified (trainer; origin with --rollouts-out)
    allow_peer: list[str] = Field(
        [], description="only accept rollouts from these PeerIDs (default: anyone)"
    )
    torch_threads: int = Field(1, ge=1, description="CPU threads for training/validation")
    check_model: bool = Field(
        TrainerConfig.check_model, description="run TOPLOC and sampling checks"
    )
    late_grace_steps: int = Field(
        InboxConfig.late_grace_steps,
        ge=0,
        description="policy steps beyond async_level a rollout that was already under way may "
        "lag and still be accepted (arriving late is not a fault)",
    )
    validator_profile: Path | None = Field(
        None,
        description="validator profile file (JSON, written by bench/verification.py "
        "--write-profile): per-engine thresholds calibrated for this run's model, used instead "
        "of the built-in ones for the engines it names and published on the run card; refused "
        "if calibrated on another model architecture; unset: the built-in thresholds",
    )

    @field_validator("task_reward")
    @classmethod
    def _reward(cls, v: str) -> str:
        return _check_task_reward(v)

    @field_validator("allow_peer")
    @classmethod
    def _allowed(cls, v: list[str], info: ValidationInfo) -> list[str]:
        return _check_peer_ids(v, str(info.field_name))

    def trust(self, identity: Identity) -> TrustList:
        """The publisher trusts itself as trainer and the allowed peers as submitters."""
        return TrustList(trainer=identity.peer_id, submitters=frozenset(self.allow_peer))

    def preflight(self) -> None:
        """Common checks, then the task loads (one line naming the file and row) and the
        validator profile reads."""
        super().preflight()
        _preflight_task(self.task, self.task_reward)
        self.load_validator_profile()

    def load_validator_profile(self) -> ValidatorProfile | None:
        """The ``validator_profile`` file, read and checked for the run's engines (its
        architecture is checked against the model once it is loaded), or None.

        Raises:
            ConfigError: on ``validator_profile``: unreadable, malformed (naming the field),
                or without thresholds for any of the run's engines.
        """
        if self.validator_profile is None:
            return None
        from rollout.calibrate import load_profile

        profile = load_profile(self.validator_profile)
        profile.for_engines(tuple(self.engines))
        return profile

    def origin_config(self) -> OriginConfig:
        """How versions are published."""
        return OriginConfig(
            shard_size=self.shard_size_bytes,
            shards_per_part=self.shards_per_part,
            delta_shards_per_part=self.delta_shards_per_part,
            anchor_every=self.anchor_every,
            deltas=self.deltas,
            zstd=self.zstd,
            encode_workers=self.encode_workers,
        )


class TrainerSettings(PublishSettings):
    """``shardnet trainer``."""

    role: ClassVar[str] = "trainer"
    steps: int = Field(TrainerConfig.steps, ge=0, description="optimizer steps (versions 1..steps)")
    model: Path | None = Field(
        None,
        description="Hugging Face model directory to train (config.json, safetensors, "
        "tokenizer.json; any causal-LM architecture); unset: the preset",
    )
    preset: str = Field(
        TrainerConfig.preset, description="model preset when --model is unset: tiny or real-1b"
    )
    seed: int = Field(TrainerConfig.seed, description="model init seed")
    lr: float = Field(TrainerConfig.lr, gt=0, description="learning rate")
    optimizer: str = Field(
        TrainerConfig.optimizer, description="adamw or sgd (sgd: no optimizer state)"
    )
    min_batches: int | None = Field(
        None,
        ge=1,
        description="verified batches to wait for per step (default: one per known peer, "
        "at least 1; a step is also ready once every known peer delivered)",
    )
    step_timeout_s: float = Field(
        TrainerConfig.step_timeout_s,
        gt=0,
        description="longest wait for a step's rollouts, seconds",
    )
    peer_timeout_s: float = Field(
        TrainerConfig.peer_timeout_s,
        gt=0,
        description="a peer silent this long no longer counts as known, seconds",
    )
    wait_log_interval_s: float = Field(
        TrainerConfig.wait_log_interval_s,
        gt=0,
        description="period of the waiting_for_* progress log lines, seconds",
    )
    max_shard_bytes: int = Field(
        TrainerConfig.max_shard_bytes, ge=4096, description="safetensors file size cap, bytes"
    )
    expect_peer: list[str] = Field([], description="peers whose commits end a broadcast")
    final_wait_s: float = Field(
        TrainerConfig.final_wait_s, ge=0, description="wait for the last broadcast, seconds"
    )
    start_wait_s: float = Field(
        TrainerConfig.start_wait_s, ge=0, description="wait for expected peers' hello, seconds"
    )

    @field_validator("expect_peer")
    @classmethod
    def _peer_ids(cls, v: list[str], info: ValidationInfo) -> list[str]:
        return _check_peer_ids(v, str(info.field_name))

    def preflight(self) -> None:
        """Publisher checks, then the model directory (one line naming the file)."""
        super().preflight()
        if self.model is not None:
            from rollout.model_dir import check_model_dir

            check_model_dir(self.model, "model")


def load_settings(cls: type[S], config_file: Path | None, overrides: dict[str, Any]) -> S:
    """Build a settings object: ``overrides`` (CLI) > env > ``config_file`` > defaults.

    Options left unset on the command line must be absent from ``overrides`` (not None).

    Raises:
        ConfigError: naming the first invalid field, or an unreadable config file.
    """
    if config_file is not None and not config_file.is_file():
        raise ConfigError("config", f"{config_file} is not a file")
    bound = type(
        cls.__name__,
        (cls,),
        {
            "model_config": SettingsConfigDict(**{**cls.model_config, "toml_file": config_file}),
            "__module__": cls.__module__,
        },
    )
    try:
        return bound(**overrides)  # type: ignore[no-any-return]
    except ValidationError as exc:
        err = exc.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or cls.role
        raise _where(field, err["type"], err["msg"], config_file, overrides, cls.role) from exc
    except ValueError as exc:  # TOML syntax errors
        raise ConfigError("config", f"{config_file}: {exc}") from exc


def _where(
    field: str,
    kind: str,
    msg: str,
    config_file: Path | None,
    overrides: dict[str, Any],
    role: str,
) -> ConfigError:
    """The error of an invalid ``field``, named where its value came from: the command line
    (its option), the environment (``SHARDNET_<FIELD>``) or the config file (its key; an
    unknown key says so)."""
    import os
    import tomllib

    name = field.split(".")[0]
    if name in overrides:
        return ConfigError(field, msg)
    env = f"SHARDNET_{name.upper()}"
    if env in os.environ:
        return ConfigError("config", f"environment {env}: {msg}")
    if config_file is not None:
        try:
            in_file = name in tomllib.loads(config_file.read_text())
        except (OSError, ValueError):
            in_file = False
        if in_file and kind == "extra_forbidden":
            unknown = f"{name} is not a setting of `shardnet {role}`"
            return ConfigError("config", f"{config_file}: {unknown}")
        if in_file:
            return ConfigError("config", f"{config_file}: {name}: {msg}")
    return ConfigError(field, msg)


class OriginSettings(PublishSettings):
    """``shardnet origin``: publish checkpoint directories written by an external trainer."""

    role: ClassVar[str] = "origin"
    watch: Path = Field(
        ...,
        description="directory whose step-<N>/ subdirectories are published",
        examples=["checkpoints"],
    )
    ready_marker: str = Field("DONE", description="file that marks a step-<N>/ as complete")
    finished_marker: str = Field(
        "FINISHED",
        description="file in WATCH that ends the run: the origin signs the run's end at the "
        "newest published version (peers stop generating; --exit-on-finish ones exit); "
        "removing it continues the run",
    )
    poll_interval_s: float = Field(
        0.1,
        gt=0,
        description="how often WATCH is scanned, seconds (a version waits up to this long "
        "after its ready marker appears)",
    )
    pre_encode: bool = Field(
        True,
        description="hash and delta-encode each file of a WATCH/step-<N>/ as soon as it is "
        "complete, while the trainer still writes the others (before the ready marker); "
        "results whose file changed since are never used",
    )
    # 0.25, not 1.0: a file finished less than this before the marker is encoded after it, on
    # the next version's critical path. Measured (bench/broadcast.py --shaped 200M --seed-base
    # --save-mb-s 1000, real-1b, 3 runs each, alternated; bench/results/issue24-s61.txt): last
    # peer 3.38/3.11/3.00 s at 1.0, 3.06/2.81/2.71 s at 0.25; the origin's part 1.82/1.81/1.24
    # -> 1.46/0.92/0.91 s. Still longer than the longest pause the kernel imposes on a writer
    # over its dirty-page limit (MAX_PAUSE, 0.2 s, mm/page-writeback.c).
    pre_encode_settle_s: float = Field(
        0.25,
        ge=0,
        description="a file counts as complete for pre-encoding once its size, mtime and ctime "
        "have not changed for this long, seconds (a wrong guess costs only work twice: a "
        "writer that pauses longer mid-file gets that file encoded again)",
    )
    rollouts_out: Path | None = Field(
        None,
        description="receive and verify peers' rollouts (against the versions published from "
        "WATCH) and write the accepted ones here as Parquet files, one per batch under "
        "step-<N>/ (schema: rollout/parquet_out.py); unset: rollouts are not taken",
    )

    def preflight(self) -> None:
        """Publisher checks, then ``watch`` and ``rollouts_out``.

        ``watch`` may not exist yet (the trainer, started after the origin, creates it: the
        origin waits for it and says so), but must not be something other than a directory;
        ``rollouts_out`` is created if missing and must be writable.

        Raises:
            ConfigError: naming ``watch`` (not a directory) or ``rollouts_out`` (cannot be
                created or written), besides :meth:`PublishSettings.preflight`'s.
        """
        super().preflight()
        if self.watch.exists() and not self.watch.is_dir():
            raise ConfigError("watch", f"{self.watch} is not a directory")
        if self.rollouts_out is not None:
            _check_writable_dir(self.rollouts_out, "rollouts_out")
