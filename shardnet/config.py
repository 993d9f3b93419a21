"""Role configuration: one frozen, validated settings model per role.

Precedence, highest first: command-line options > environment (``SHARDNET_<FIELD>``, e.g.
``SHARDNET_RUN_ID``; list fields as JSON) > the TOML file given with ``--config`` > defaults.
Validation happens at start; an error names the field. Sample files live in ``configs/`` and
are parsed by ``tests/unit/test_config.py``.

Each settings model knows how to build the component configs (:class:`NodeConfig`,
:class:`FollowConfig`, …); units are in the field names.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import Field, ValidationError, field_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    TomlConfigSettingsSource,
)

from p2p.errors import ConfigError
from p2p.host import HostConfig
from p2p.http_server import HttpServerConfig
from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.downloader import DownloadConfig
from shardcast.follower import FollowConfig
from shardcast.node import NodeConfig
from shardcast.origin import OriginConfig

S = TypeVar("S", bound="CommonSettings")


class CommonSettings(BaseSettings):
    """Settings every role has."""

    model_config = SettingsConfigDict(env_prefix="SHARDNET_", extra="forbid", frozen=True)
    role: ClassVar[str] = ""

    run_id: str = Field("shardnet-run", description="the training run to follow or drive")
    data_dir: Path = Field(Path("shardnet-data"), description="versions, key and state")
    key_file: Path | None = Field(None, description="Ed25519 key (default DATA_DIR/node.key)")
    listen: list[str] = Field(["/ip4/127.0.0.1/tcp/0"], description="libp2p listen multiaddrs")
    http_host: str = Field("127.0.0.1", description="address of the HTTP bulk lane")
    http_port: int = Field(0, ge=0, le=65535, description="HTTP bulk lane port (0: any)")
    upload_limit_bytes_per_s: float | None = Field(
        None, gt=0, description="cap on HTTP lane upload"
    )
    keep_last: int = Field(3, ge=1, description="committed versions kept on disk")
    durable_commits: bool | None = Field(
        None,
        description="fsync every committed version (default: yes for trainer/origin; relays "
        "and peers re-verify their versions after an unclean stop instead)",
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

    def identity(self) -> Identity:
        """Load or create the node key (mode 0600)."""
        return Identity.load_or_create(self.key_file or self.data_dir / "node.key")

    def node_config(self) -> NodeConfig:
        """The shardcast node configuration."""
        durable = (
            self.role in ("trainer", "origin")
            if self.durable_commits is None
            else self.durable_commits
        )
        return NodeConfig(
            role=self.role,
            run_id=self.run_id,
            data_dir=self.data_dir,
            keep_last=self.keep_last,
            durable=durable,
            host=HostConfig(listen_multiaddrs=tuple(self.listen)),
            http=HttpServerConfig(
                host=self.http_host,
                port=self.http_port,
                bandwidth_bytes_per_s=self.upload_limit_bytes_per_s,
            ),
        )


class FollowerSettings(CommonSettings):
    """Settings of roles that download versions (relay, peer)."""

    trainer_id: str = Field(..., description="the trainer's PeerID (pinned)")
    allow_relays: list[str] = Field([], description="only download from these PeerIDs")
    poll_interval_s: float = Field(1.0, gt=0, description="upstream info poll period")
    stall_timeout_s: float = Field(30.0, gt=0, description="fail a transfer stalled this long")
    exit_on_finish: bool = Field(
        False,
        description="exit (code 0) once the trainer announced the run's end and this node "
        "holds its final version (default: keep serving it)",
    )

    def trust(self) -> TrustList:
        """The trust list."""
        return TrustList(trainer=self.trainer_id, relays=frozenset(self.allow_relays))

    def follow_config(self, upstreams: list[str]) -> FollowConfig:
        """The follower configuration."""
        return FollowConfig(
            upstreams=tuple(upstreams),
            poll_interval_s=self.poll_interval_s,
            download=DownloadConfig(stall_timeout_s=self.stall_timeout_s),
        )


class RelaySettings(FollowerSettings):
    """``shardnet relay``."""

    role: ClassVar[str] = "relay"
    upstream: list[str] = Field(..., min_length=1, description="origin/relay multiaddrs")


class PeerSettings(FollowerSettings):
    """``shardnet peer``."""

    role: ClassVar[str] = "peer"
    bootstrap: list[str] = Field(..., min_length=1, description="relay multiaddrs")
    n_prompts: int = Field(4, ge=1, description="prompts per step (run rule)")
    group_size: int = Field(8, ge=1, description="samples per prompt (run rule)")
    max_new_tokens: int = Field(16, ge=1, description="completion cap (run rule)")
    temperature: float = Field(1.0, gt=0, description="sampling temperature (run rule)")
    torch_threads: int = Field(1, ge=1, description="CPU threads for inference")
    max_versions: int | None = Field(None, ge=1, description="stop generating after N versions")
    engine: Literal["transformers", "vllm"] = Field(
        "transformers", description="inference engine: transformers, or vllm (needs the extra)"
    )
    trainer_addr: list[str] = Field([], description="trainer multiaddrs (say hello at start)")


class PublishSettings(CommonSettings):
    """Settings of roles that publish versions (trainer, origin)."""

    shard_size_bytes: int = Field(32 << 20, ge=4096, description="shard size of versions")
    shards_per_part: int = Field(16, ge=1, description="shards per signed manifest part")
    anchor_every: int = Field(10, ge=1, description="a full version every N steps")
    deltas: bool = Field(True, description="offer xor-zstd deltas against the last version")
    zstd: bool = Field(False, description="also offer zstd of every shard (slow links)")
    serve_once_s: float | None = Field(
        5.0, gt=0, description="super-seeding window (unset: serve every request)"
    )

    def origin_config(self) -> OriginConfig:
        """How versions are published."""
        return OriginConfig(
            shard_size=self.shard_size_bytes,
            shards_per_part=self.shards_per_part,
            anchor_every=self.anchor_every,
            deltas=self.deltas,
            zstd=self.zstd,
        )


class TrainerSettings(PublishSettings):
    """``shardnet trainer``."""

    role: ClassVar[str] = "trainer"
    steps: int = Field(10, ge=0, description="optimizer steps (versions 1..steps)")
    preset: str = Field("tiny", description="model preset: tiny or real-1b")
    seed: int = Field(0, description="model init seed")
    lr: float = Field(3e-3, gt=0, description="learning rate")
    optimizer: str = Field("adamw", description="adamw or sgd (sgd: no optimizer state)")
    async_level: int = Field(2, ge=0, description="versions a rollout may lag")
    n_prompts: int = Field(4, ge=1, description="prompts per peer per step")
    group_size: int = Field(8, ge=1, description="samples per prompt")
    max_new_tokens: int = Field(16, ge=1, description="completion cap")
    temperature: float = Field(1.0, gt=0, description="sampling temperature")
    min_batches: int | None = Field(
        None,
        ge=1,
        description="verified batches to wait for per step (default: one per known peer, "
        "at least 1; a step is also ready once every known peer delivered)",
    )
    step_timeout_s: float = Field(300.0, gt=0, description="longest wait for a step's rollouts")
    peer_timeout_s: float = Field(
        60.0, gt=0, description="a peer silent this long no longer counts as known, seconds"
    )
    wait_log_interval_s: float = Field(
        5.0, gt=0, description="period of the waiting_for_* progress log lines, seconds"
    )
    max_shard_bytes: int = Field(1 << 20, ge=4096, description="safetensors file size cap")
    allow_peers: list[str] = Field([], description="only accept rollouts from these PeerIDs")
    expect_peers: list[str] = Field([], description="peers whose commits end a broadcast")
    final_wait_s: float = Field(120.0, ge=0, description="wait for the last broadcast")
    start_wait_s: float = Field(300.0, ge=0, description="wait for expected peers' hello")
    torch_threads: int = Field(1, ge=1, description="CPU threads for training/validation")
    check_model: bool = Field(True, description="run TOPLOC and sampling checks")

    def trust(self, identity: Identity) -> TrustList:
        """The trainer trusts itself as trainer and the allowed peers as submitters."""
        return TrustList(trainer=identity.peer_id, submitters=frozenset(self.allow_peers))


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
        raise ConfigError(field, err["msg"]) from exc
    except ValueError as exc:  # TOML syntax errors
        raise ConfigError("config", f"{config_file}: {exc}") from exc


class OriginSettings(PublishSettings):
    """``shardnet origin``: publish checkpoint directories written by an external trainer."""

    role: ClassVar[str] = "origin"
    watch: Path = Field(..., description="directory whose step-<N>/ subdirectories are published")
    ready_marker: str = Field("DONE", description="file that marks a step-<N>/ as complete")
    poll_interval_s: float = Field(0.5, gt=0, description="how often WATCH is scanned")
