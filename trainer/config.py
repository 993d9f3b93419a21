"""The trainer's configuration: the one declaration of its defaults.

Kept apart from :mod:`trainer.trainer` so that the command line (``shardnet/config.py``) can
take its defaults from :class:`TrainerConfig` without importing torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from p2p.errors import ConfigError
from rollout.inbox import InboxConfig
from rollout.task import DEFAULT_REWARD_SPEC, DEFAULT_TASK_SPEC
from shardcast.node import NodeConfig
from shardcast.publish import OriginConfig
from shardcast.wire import DEFAULT_ASYNC_LEVEL, DEFAULT_ENGINE, DEFAULT_SAMPLING, EngineSpec

if TYPE_CHECKING:
    from rollout.calibrate import ValidatorProfile

__all__ = ["DEFAULT_LR", "TrainerConfig"]

DEFAULT_LR = 3e-3
"""AdamW learning rate for the ``tiny`` preset (measured; see :mod:`trainer.grpo`)."""


@dataclass(frozen=True)
class TrainerConfig:
    """The trainer's settings (the run's rules live here too).

    Attributes:
        node: shardcast node settings (role ``trainer``).
        steps: optimizer steps to run (versions 1..steps are published after version 0).
        model: a Hugging Face model directory (config, safetensors, tokenizer) of any causal
            LM architecture; None: the ``preset`` written as one under
            ``<data_dir>/models/<preset>-seed<seed>``.
        preset, seed: the demo model used when ``model`` is None.
        task, task_reward: the task spec (``digits``, a dataset file, ``package.module:Task``)
            and, for a dataset, its reward (see ``rollout.task.load_task``).
        lr: learning rate.
        optimizer: ``adamw`` (default) or ``sgd`` (no optimizer state: for real-size models
            on a small machine, where AdamW's two fp32 moments would not fit).
        async_level: how many versions a rollout may lag.
        n_prompts, group_size, max_new_tokens, temperature: the sampling rules for peers.
        engines: the inference engines whose rollouts the run accepts (the run card's).
        card_mirrors: static mirror URLs named in the run card (followers add them).
        min_batches: batches to wait for before each optimizer step (None: one per known
            peer, at least 1; see :mod:`trainer.readiness`).
        step_timeout_s: longest wait for the step's rollouts, seconds.
        peer_timeout_s: a peer silent this long no longer counts as known, seconds.
        wait_log_interval_s: period of the ``waiting_for_*`` progress lines, seconds.
        finish_linger_s: after announcing the run's end, how long to keep serving it,
            seconds.
        origin: how versions are published (shard size, parts, deltas, anchors).
        max_shard_bytes: safetensors file size cap of published checkpoints, bytes.
        expected_peers: PeerIDs whose commit reports define "broadcast finished".
        final_wait_s: after the last step, how long to wait for peers to commit it, seconds.
        start_wait_s: before version 0, how long to wait for every expected peer to say
            hello, seconds (so that no expected peer misses a version).
        check_model: run TOPLOC and sampling checks (needs the model per version).
        validator_profile: calibrated thresholds for this run's model
            (:mod:`rollout.calibrate`, ``--validator-profile``): judge the engines it names
            with them and publish them on the run card; refused (ConfigError on
            ``validator_profile``) if calibrated on another model architecture. None: the
            built-in thresholds.
    """

    node: NodeConfig
    steps: int = 10
    model: Path | None = None
    preset: str = "tiny"
    task: str = DEFAULT_TASK_SPEC
    task_reward: str = DEFAULT_REWARD_SPEC
    seed: int = 0
    lr: float = DEFAULT_LR
    optimizer: str = "adamw"
    async_level: int = DEFAULT_ASYNC_LEVEL
    n_prompts: int = DEFAULT_SAMPLING.prompts_per_step
    group_size: int = DEFAULT_SAMPLING.group_size
    max_new_tokens: int = DEFAULT_SAMPLING.max_new_tokens
    temperature: float = DEFAULT_SAMPLING.temperature
    engines: tuple[EngineSpec, ...] = (DEFAULT_ENGINE,)
    card_mirrors: tuple[str, ...] = ()
    min_batches: int | None = None
    step_timeout_s: float = 300.0
    peer_timeout_s: float = 60.0
    wait_log_interval_s: float = 5.0
    finish_linger_s: float = 3.0
    origin: OriginConfig = field(default_factory=lambda: OriginConfig(shard_size=1 << 20))
    max_shard_bytes: int = 1 << 20
    expected_peers: tuple[str, ...] = ()
    final_wait_s: float = 120.0
    start_wait_s: float = 300.0
    check_model: bool = True
    inbox: InboxConfig = field(default_factory=InboxConfig)
    validator_profile: ValidatorProfile | None = None

    def __post_init__(self) -> None:
        if self.steps < 0:
            raise ConfigError("steps", "must be >= 0")
        if self.min_batches is not None and self.min_batches < 1:
            raise ConfigError("min_batches", "must be >= 1")
        if self.wait_log_interval_s <= 0:
            raise ConfigError("wait_log_interval_s", "must be > 0")
        if self.async_level < 0:
            raise ConfigError("async_level", "must be >= 0")
        if self.optimizer not in ("adamw", "sgd"):
            raise ConfigError("optimizer", f"{self.optimizer!r} is not adamw or sgd")
