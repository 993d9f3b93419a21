"""The trainer with ``validator_profile``: its validator judges with the profile, its signed
run card carries the profile's digest and thresholds, and a profile calibrated on another
model architecture stops it (ConfigError on ``validator_profile``). Listens on 127.0.0.1."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import trio

from p2p.errors import ConfigError
from p2p.identity import Identity
from p2p.trust import TrustList
from rollout.calibrate import Provenance, ValidatorProfile, profile_thresholds
from rollout.model_dir import load_trainable
from rollout.verify import VLLM_BF16_PROFILE
from shardcast.node.node import NodeConfig
from shardcast.wire.runcard import architecture_digest
from trainer.checkpoint import config_json, write_preset_dir
from trainer.config import TrainerConfig
from trainer.trainer import Trainer

TRAINER = Identity.from_seed("profile-trainer")
OWN = dataclasses.replace(VLLM_BF16_PROFILE, replay_margin=0.0123)


def _trainer(tmp_path: Path, profile: ValidatorProfile) -> Trainer:
    return Trainer(
        TRAINER,
        TrustList(trainer=TRAINER.peer_id),
        TrainerConfig(
            node=NodeConfig("trainer", "profile-run", tmp_path / "trainer"),
            steps=3,
            step_timeout_s=600,
            validator_profile=profile,
        ),
    )


def _profile(arch: str) -> ValidatorProfile:
    return ValidatorProfile(
        arch,
        {"transformers-bf16": OWN, "vllm-bf16": VLLM_BF16_PROFILE},
        Provenance("tiny", 18, 0, "2026-12-01T20:00:00Z"),
    )


async def test_trainer_judges_and_publishes_with_its_profile(tmp_path: Path) -> None:
    torch.set_num_threads(1)
    # the model the trainer trains: the tiny preset, seed 0, written where it writes it
    model_dir = write_preset_dir("tiny", 0, tmp_path / "trainer" / "models" / "tiny-seed0")
    model, _ = load_trainable(model_dir)
    arch = architecture_digest(json.loads(config_json(model)))
    profile = _profile(arch)
    trainer = _trainer(tmp_path, profile)
    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            node = await nursery.start(trainer.run)
            assert trainer.validator is not None
            assert trainer.validator.config.profile("transformers-bf16") == OWN
            assert node.card is not None
            card = node.card.card.validator_profile
            assert card is not None
            assert card.digest == profile.digest()
            # only the run's engines go on the card
            assert card.thresholds() == {"transformers-bf16": profile_thresholds(OWN)}
            nursery.cancel_scope.cancel()
    # another architecture: refused before the node starts
    other = _trainer(tmp_path, _profile("ef" * 32))
    with pytest.raises(ConfigError, match="calibrated on model architecture") as info:
        with trio.fail_after(60):
            await other.run()
    assert info.value.field == "validator_profile"
