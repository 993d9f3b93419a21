"""Role settings: sample configs parse, precedence CLI > env > file > defaults, typed errors."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from p2p.errors import ConfigError
from shardnet.cli import app
from shardnet.config import (
    OriginSettings,
    PeerSettings,
    RelaySettings,
    TrainerSettings,
    load_settings,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SAMPLES = {
    "trainer.toml": TrainerSettings,
    "relay.toml": RelaySettings,
    "peer.toml": PeerSettings,
    "origin.toml": OriginSettings,
}


@pytest.mark.parametrize("name", sorted(SAMPLES))
def test_every_sample_config_parses(name: str) -> None:
    s = load_settings(SAMPLES[name], CONFIGS / name, {})
    assert s.run_id == "my-run"
    # the component configs build from it too
    s.node_config()


def test_all_samples_are_covered() -> None:
    assert {p.name for p in CONFIGS.glob("*.toml")} == set(SAMPLES)


def test_precedence(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = tmp_path / "t.toml"
    cfg.write_text('run_id = "from-file"\nsteps = 5\nlr = 0.1\n')
    monkeypatch.setenv("SHARDNET_STEPS", "7")
    s = load_settings(TrainerSettings, cfg, {"lr": 0.5})
    assert (s.run_id, s.steps, s.lr) == ("from-file", 7, 0.5)  # file, env, CLI
    assert s.group_size == 8  # default


def test_errors_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(TrainerSettings, None, {"steps": -1})
    assert info.value.field == "steps"
    cfg = tmp_path / "r.toml"
    cfg.write_text('trainer_id = "x"\nupstream = []\nbogus = 1\n')
    with pytest.raises(ConfigError) as info:
        load_settings(RelaySettings, cfg, {})
    assert info.value.field in ("upstream", "bogus")
    with pytest.raises(ConfigError, match="not a file"):
        load_settings(TrainerSettings, tmp_path / "missing.toml", {})
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ConfigError):
        load_settings(TrainerSettings, bad, {})


def test_trust_rejects_malformed_trainer_id() -> None:
    s = load_settings(RelaySettings, CONFIGS / "relay.toml", {"trainer_id": "not-a-peer-id"})
    with pytest.raises(ConfigError, match=r"trust\.trainer"):
        s.trust()


@pytest.mark.parametrize(
    "cmd", ["keygen", "trainer", "relay", "peer", "origin", "demo", "checkpoint"]
)
def test_help_documents_every_option(cmd: str) -> None:
    result = CliRunner().invoke(app, [cmd, "--help"])
    assert result.exit_code == 0
    assert "Usage" in result.output
    if cmd in ("relay", "peer"):
        assert "--trainer-id" in result.output


def test_keygen_creates_private_key_once(tmp_path: Path) -> None:
    key = tmp_path / "k" / "node.key"
    first = CliRunner().invoke(app, ["keygen", "--key", str(key)])
    assert first.exit_code == 0
    assert first.output.strip().startswith("12D3KooW")
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    again = CliRunner().invoke(app, ["keygen", "--key", str(key)])
    assert again.output == first.output
    os.chmod(key, 0o644)
    bad = CliRunner().invoke(app, ["keygen", "--key", str(key)])
    assert bad.exit_code == 2
    key.write_bytes(b"garbage")
    os.chmod(key, 0o600)
    bad = CliRunner().invoke(app, ["keygen", "--key", str(key)])
    assert bad.exit_code == 2


def test_relay_without_upstream_is_a_config_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["relay", "--trainer-id", "x", "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
