"""Role settings: sample configs parse, precedence CLI > env > file > defaults, typed errors."""

from __future__ import annotations

import inspect
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from p2p.errors import ConfigError
from p2p.identity import Identity
from shardnet.cli import ROLES, app
from shardnet.config import (
    OriginSettings,
    PeerSettings,
    RelaySettings,
    TrainerSettings,
    load_settings,
)
from shardnet.options import option_name
from shardnet.samples import sample_toml

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
PID = "12D3KooWRdFFg3yTbTsDq5Z1yCvCWbqznEFro9jeVivo7rkayJ4D"
UP = f"/ip4/127.0.0.1/tcp/1/p2p/{PID}"
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
    cfg.write_text(f'trainer_id = "{PID}"\nupstream = []\nbogus = 1\n')
    with pytest.raises(ConfigError) as info:
        load_settings(RelaySettings, cfg, {})
    # named where the value came from: the file and its key (an unknown key says so)
    assert info.value.field == "config"
    assert str(info.value).startswith(f"config: {cfg}: ")
    assert "upstream:" in str(info.value) or "bogus is not a setting of `shardnet relay`" in (
        str(info.value)
    )
    cfg.write_text(f'trainer_id = "{PID}"\nupstream = ["{UP}"]\nbogus = 1\n')
    with pytest.raises(ConfigError, match=r"r\.toml: bogus is not a setting of `shardnet relay`"):
        load_settings(RelaySettings, cfg, {})
    with pytest.raises(ConfigError) as info:
        load_settings(RelaySettings, None, {"trainer_id": "x", "upstream": [UP]})
    assert info.value.field == "trainer_id"
    with pytest.raises(ConfigError, match="not a file"):
        load_settings(TrainerSettings, tmp_path / "missing.toml", {})
    bad = tmp_path / "bad.toml"
    bad.write_text("steps = = 3")
    with pytest.raises(ConfigError):
        load_settings(TrainerSettings, bad, {})


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"trainer_id": "not-a-peer-id"}, "trainer_id"),
        ({"upstream": ["/ip4/127.0.0.1/tcp/4001"]}, "upstream"),  # no /p2p/<PeerID>
        ({"upstream": ["garbage"]}, "upstream"),
        ({"upstream": [f"/ip4/0.0.0.0/tcp/4001/p2p/{PID}"]}, "upstream"),
        ({"announce": ["/ip4/0.0.0.0/tcp/4001"]}, "announce"),
        ({"announce": ["/ip4/1.2.3.4/udp/4001"]}, "announce"),
        ({"public_url": "ftp://example.org:1"}, "public_url"),
        ({"public_url": "http://example.org"}, "public_url"),  # no port
        ({"public_host": "0.0.0.0"}, "public_host"),
        ({"public_host": "bad host!"}, "public_host"),
        ({"http_host": "localhost"}, "http_host"),
        ({"listen": ["/ip4/1.2.3/tcp/1"]}, "listen"),
        ({"allow_relay": ["nope"]}, "allow_relay"),
        ({"mirror": ["ftp://example.org/m"]}, "mirror"),
        ({"mirror": ["http://0.0.0.0:80"]}, "mirror"),
        ({"mirror_poll_interval_s": 0}, "mirror_poll_interval_s"),
    ],
)
def test_addresses_and_ids_are_checked_at_load(overrides: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_settings(RelaySettings, CONFIGS / "relay.toml", overrides)
    assert info.value.field.split(".")[0] == field


@pytest.mark.parametrize("role", sorted(ROLES))
def test_every_field_is_an_option_with_the_same_name(role: str) -> None:
    import shardnet.config as config

    cls = getattr(config, ROLES[role][0])
    result = CliRunner().invoke(app, [role, "--help"])
    assert result.exit_code == 0
    text = "".join(result.output.split())  # help is wrapped to the terminal
    for name, info in cls.model_fields.items():
        assert option_name(name) in text, name
        default = info.get_default(call_default_factory=True)
        if not info.is_required() and default not in (None, []) and type(default) is not bool:
            assert f"[default:{default}]".replace(" ", "") in text, name


@pytest.mark.parametrize("role", sorted(ROLES))
def test_samples_are_generated_from_the_models(role: str) -> None:
    import shardnet.config as config

    cls = getattr(config, ROLES[role][0])
    assert (CONFIGS / f"{role}.toml").read_text() == sample_toml(cls)
    result = CliRunner().invoke(app, ["sample-config", role])
    assert result.exit_code == 0
    assert result.output == sample_toml(cls)


def test_a_bad_environment_value_is_named_as_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SHARDNET_KEEP_LAST", "abc")
    with pytest.raises(ConfigError, match=r"^config: environment SHARDNET_KEEP_LAST: ") as info:
        load_settings(RelaySettings, None, {"trainer_id": PID, "upstream": [UP]})
    assert info.value.field == "config"
    # the same value given as an option is named as the option
    with pytest.raises(ConfigError) as info:
        load_settings(RelaySettings, None, {"trainer_id": PID, "upstream": [UP], "keep_last": "x"})
    assert info.value.field == "keep_last"


def test_environment_uses_the_field_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHARDNET_STEP_TIMEOUT_S", "12.5")
    monkeypatch.setenv("SHARDNET_ALLOW_PEER", f'["{PID}"]')
    s = load_settings(TrainerSettings, None, {})
    assert s.step_timeout_s == 12.5
    assert s.allow_peer == [PID]


def test_role_defaults_listen_on_all_interfaces_on_fixed_ports() -> None:
    from p2p.addresses import default_listen, interface_addresses

    here = interface_addresses()  # IPv6 too where this host has a routable IPv6 address
    t = load_settings(TrainerSettings, None, {}).node_config()
    assert t.host.listen_multiaddrs == default_listen(4001, here)
    assert t.host.listen_multiaddrs[0] == "/ip4/0.0.0.0/tcp/4001"
    assert (t.http.host, t.http.port) == ("0.0.0.0", 8001)
    r = load_settings(RelaySettings, CONFIGS / "relay.toml", {}).node_config()
    assert r.host.listen_multiaddrs == default_listen(4002, here)
    assert r.http.port == 8002
    p = load_settings(PeerSettings, CONFIGS / "peer.toml", {}).node_config()
    assert p.host.listen_multiaddrs == default_listen(0, here)
    assert p.http.port == 0
    s = load_settings(
        RelaySettings, CONFIGS / "relay.toml", {"public_host": "relay.example.org"}
    ).node_config()
    assert s.host.public_host == "relay.example.org"
    v6 = load_settings(RelaySettings, CONFIGS / "relay.toml", {"public_host": "fd77::2"})
    assert v6.node_config().host.listen_multiaddrs == ("/ip6/::/tcp/4002",)
    assert v6.node_config().http.host == "::"


def test_defaults_are_the_libraries_own() -> None:
    """Each setting's default is declared once, in the library that uses it: the command
    line's defaults build the same library objects as the libraries' own defaults."""
    from p2p.http_server import HttpServerConfig
    from p2p.keepalive import KeepaliveConfig
    from p2p.limits import LedgerConfig, ResourceLimits
    from rollout.pacing import PacingConfig
    from rollout.verify import ValidatorConfig
    from shardcast.core.reachability import ReachabilityConfig
    from shardcast.download.discovery import LaneBackoff
    from shardcast.download.follower import FollowConfig
    from shardcast.download.types import DownloadConfig
    from shardcast.node.node import NodeConfig
    from shardcast.publish.origin import OriginConfig
    from shardcast.wire.runcard import DEFAULT_SAMPLING, SamplingRules
    from trainer.config import TrainerConfig

    relay = load_settings(
        RelaySettings, None, {"upstream": [f"/ip4/127.0.0.1/tcp/1/p2p/{PID}"], "trainer_id": PID}
    )
    node = relay.node_config()
    assert node.host.limits == ResourceLimits()
    assert node.host.ledger == LedgerConfig()
    assert node.host.keepalive == KeepaliveConfig()
    assert node.http.max_connections_per_ip == HttpServerConfig().max_connections_per_ip
    assert node.keep_last == NodeConfig.keep_last
    follow = relay.follow_config(relay.upstream)
    assert follow.poll_interval_s == FollowConfig.poll_interval_s
    assert follow.lane_backoff == LaneBackoff()
    assert follow.reachability == ReachabilityConfig()
    lib = DownloadConfig()
    assert (follow.download.stall_timeout_s, follow.download.source_ban_s) == (
        lib.stall_timeout_s,
        lib.source_ban_s,
    )
    trainer = load_settings(TrainerSettings, None, {})
    origin = trainer.origin_config()
    lib_origin = OriginConfig()
    assert (origin.shard_size, origin.anchor_every, origin.deltas, origin.zstd) == (
        lib_origin.shard_size,
        lib_origin.anchor_every,
        lib_origin.deltas,
        lib_origin.zstd,
    )
    rules = SamplingRules(
        trainer.n_prompts, trainer.group_size, trainer.max_new_tokens, trainer.temperature
    )
    assert rules == DEFAULT_SAMPLING
    assert trainer.async_level == ValidatorConfig.async_level == TrainerConfig.async_level
    for name in (
        "steps",
        "preset",
        "seed",
        "lr",
        "optimizer",
        "task",
        "task_reward",
        "step_timeout_s",
        "peer_timeout_s",
        "wait_log_interval_s",
        "max_shard_bytes",
        "final_wait_s",
        "start_wait_s",
        "check_model",
    ):
        assert getattr(trainer, name) == getattr(TrainerConfig, name), name
    peer = load_settings(PeerSettings, CONFIGS / "peer.toml", {})
    assert (peer.pacing, peer.pacing_margin_steps) == (
        PacingConfig.enabled,
        PacingConfig.margin_steps,
    )


def test_advert_backoff_and_reachability_recheck_are_settings() -> None:
    from shardcast.core.reachability import PunchConfig, ReachabilityConfig
    from shardcast.download.discovery import LaneBackoff

    overrides: dict[str, object] = {
        "advert_retry_s": 30.0,
        "advert_retry_factor": 2.0,
        "advert_max_failures": 2,
        "advert_drop_s": 600.0,
        "reachability_recheck_s": 120.0,
        "punch_ahead": 0,
        "serve_behind_nat": False,
    }
    s = load_settings(RelaySettings, CONFIGS / "relay.toml", overrides)
    follow = s.follow_config(s.upstream)
    assert follow.lane_backoff == LaneBackoff(30.0, 2.0, LaneBackoff.max_s, 2, 600.0)
    assert follow.reachability == ReachabilityConfig(recheck_s=120.0, serve_behind_nat=False)
    assert follow.punch == PunchConfig(ahead_max_direct=0)
    assert (
        load_settings(RelaySettings, CONFIGS / "relay.toml", {}).follow_config(s.upstream).punch
        == PunchConfig()
    )  # the library's default
    for bad in (
        {"advert_max_failures": 0},
        {"advert_retry_s": 0},
        {"advert_retry_factor": 0.5},
        {"punch_ahead": -1},
    ):
        with pytest.raises(ConfigError) as info:
            load_settings(RelaySettings, CONFIGS / "relay.toml", bad)
        assert info.value.field == next(iter(bad))


def test_a_stopping_peer_waits_only_briefly_for_a_busy_vllm_engine(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A generation abandoned by the stop still holds vLLM (it cannot be interrupted mid-call):
    the close gives up after ENGINE_CLOSE_WAIT_S and leaves the engine to the process exit."""
    from rollout.engine_vllm import VllmEngine
    from shardnet import roles

    engine = VllmEngine()  # nothing loaded, vLLM never imported
    assert engine.close(wait_s=0.0) is True
    monkeypatch.setattr(roles, "ENGINE_CLOSE_WAIT_S", 0.0)
    with engine._busy:  # what a running generate holds
        assert engine.close(wait_s=0.0) is False
        roles.close_engine(engine)
    assert "engine_close_skipped reason=busy" in caplog.text
    roles.close_engine(object())  # type: ignore[arg-type]  # an engine without close: nothing


def test_vllm_keep_host_copy_is_a_peer_setting_that_reaches_the_engine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from rollout import engine_vllm
    from rollout.engine_options import VllmOptions
    from shardnet.roles import make_engine

    engine_default = inspect.signature(engine_vllm.VllmEngine).parameters["keep_host_copy"]
    assert engine_default.default is VllmOptions.keep_host_copy is False  # declared once
    default = load_settings(PeerSettings, CONFIGS / "peer.toml", {})
    assert default.vllm_options() == VllmOptions()
    on = load_settings(PeerSettings, CONFIGS / "peer.toml", {"vllm_keep_host_copy": True})
    assert on.vllm_options() == VllmOptions(keep_host_copy=True)
    monkeypatch.setattr(engine_vllm, "vllm_available", lambda: True)  # nothing starts vLLM
    for settings, want in ((default, False), (on, True)):
        engine = make_engine("vllm", settings.vllm_options())
        assert isinstance(engine, engine_vllm.VllmEngine)
        assert engine.keep_host_copy is want
    runner = CliRunner()
    result = runner.invoke(app, ["peer", "--help"])
    assert "--vllm-keep-host-copy" in result.output


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--trainer-id", "bogus"], "--trainer-id: 'bogus' is not a PeerID"),
        (["--upstream", "/ip4/127.0.0.1/tcp/1"], "--upstream:"),
        (["--data-dir", "/proc/no/such"], "--data-dir: /proc/no/such is not a writable"),
        (["--announce", "nonsense"], "--announce:"),
        (["--keep-last", "0"], "--keep-last:"),
        (["--public-host", "fd77::2"], "--public-host: fd77::2 is IPv6 but libp2p listens only"),
        (["--announce", "/ip6/fd77::2/tcp/4002"], "--announce: /ip6/fd77::2/tcp/4002 is IPv6"),
        (
            ["--public-host", "fd77::2", "--listen", "/ip6/::1/tcp/0"],
            "--public-host: fd77::2 is IPv6 but the HTTP lane binds 127.0.0.1",
        ),
    ],
)
def test_operator_mistakes_are_one_line_and_exit_2(
    tmp_path: Path, argv: list[str], needle: str
) -> None:
    base = {
        "--trainer-id": PID,
        "--upstream": UP,
        "--data-dir": str(tmp_path / "d"),
        "--listen": "/ip4/127.0.0.1/tcp/0",
        "--http-host": "127.0.0.1",
        "--http-port": "0",
    }
    base.update(dict(zip(argv[::2], argv[1::2], strict=True)))
    args = [a for kv in base.items() for a in kv]
    result = CliRunner().invoke(app, ["relay", *args])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert needle in lines[0]
    assert "Traceback" not in result.output


def test_port_in_use_is_reported_before_ready(tmp_path: Path) -> None:
    import socket

    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as py-libp2p does
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        for lane, extra in (
            ("--listen", ["--listen", f"/ip4/127.0.0.1/tcp/{port}", "--http-port", "0"]),
            ("--http-port", ["--listen", "/ip4/127.0.0.1/tcp/0", "--http-port", str(port)]),
        ):
            result = CliRunner().invoke(
                app,
                [
                    "relay",
                    "--trainer-id",
                    PID,
                    "--upstream",
                    UP,
                    "--data-dir",
                    str(tmp_path),
                    "--http-host",
                    "127.0.0.1",
                    *extra,
                ],
            )
            assert result.exit_code == 2, result.output
            assert f"{lane}: port {port}" in result.output
            assert "already in use" in result.output
            assert "shardnet-ready" not in result.output


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
    assert bad.output.startswith("shardnet: error: --key: ")  # the option's name, as typed
    key.write_bytes(b"garbage")
    os.chmod(key, 0o600)
    bad = CliRunner().invoke(app, ["keygen", "--key", str(key)])
    assert bad.exit_code == 2
    assert bad.output.startswith("shardnet: error: --key: ")


def test_a_trainer_addr_of_another_peer_id_is_one_line_and_exit_2(tmp_path: Path) -> None:
    """A peer given the relay's multiaddr as ``--trainer-addr`` started and then failed every
    status report to it, forever."""
    other = Identity.generate().peer_id
    args = [
        *("peer", "--trainer-id", PID, "--bootstrap", UP, "--data-dir", str(tmp_path / "d")),
        *("--listen", "/ip4/127.0.0.1/tcp/0", "--http-host", "127.0.0.1", "--http-port", "0"),
        *("--trainer-addr", f"/ip4/127.0.0.1/tcp/4001/p2p/{other}"),
    ]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert (
        f"--trainer-addr: /ip4/127.0.0.1/tcp/4001/p2p/{other} ends in another PeerID" in (lines[0])
    )


def test_keygen_into_an_unwritable_place_is_one_line_and_exit_2() -> None:
    result = CliRunner().invoke(app, ["keygen", "--key", "/proc/no-such-dir/node.key"])
    assert result.exit_code == 2
    assert result.output.startswith("shardnet: error: --key: /proc/no-such-dir/node.key: ")
    assert len(result.output.strip().splitlines()) == 1, result.output


@pytest.mark.parametrize(
    ("option", "make", "needle"),
    [
        ("--watch", "file", "--watch: {path} is not a directory"),
        ("--rollouts-out", "file", "--rollouts-out: {path} is not a writable directory"),
        ("--rollouts-out", "proc", "--rollouts-out: {path} is not a writable directory"),
    ],
)
def test_origin_watch_and_rollouts_out_mistakes_are_one_line_and_exit_2(
    tmp_path: Path, option: str, make: str, needle: str
) -> None:
    """Checked before anything listens (the origin said ``shardnet-ready`` and then failed
    with a traceback when ``--rollouts-out`` could not be created)."""
    path = tmp_path / "a-file"
    if make == "file":
        path.write_text("")
    else:
        path = Path("/proc/no-such-dir/rollouts")
    args = {
        "--watch": str(tmp_path / "ckpts"),
        "--data-dir": str(tmp_path / "d"),
        "--listen": "/ip4/127.0.0.1/tcp/0",
        "--http-host": "127.0.0.1",
        "--http-port": "0",
        option: str(path),
    }
    result = CliRunner().invoke(app, ["origin", *[a for kv in args.items() for a in kv]])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert needle.format(path=path) in lines[0]
    assert "shardnet-ready" not in result.output


@pytest.mark.parametrize("role", ["relay", "peer", "trainer", "origin"])
def test_a_missing_key_file_is_a_config_error_not_a_new_identity(tmp_path: Path, role: str) -> None:
    """``--key`` names a key made by ``shardnet keygen``; a mistyped path fails before
    anything is created (no key, no key directory, no data directory)."""
    key = tmp_path / "nodir" / "k.key"
    data = tmp_path / "data"
    upstream = f"/ip4/127.0.0.1/tcp/9/p2p/{PID}"
    extra = {
        "relay": ["--trainer-id", PID, "--upstream", upstream],
        "peer": ["--trainer-id", PID, "--bootstrap", upstream],
        "trainer": [],
        "origin": ["--watch", str(tmp_path)],
    }[role]
    args = [role, "--key", str(key), "--data-dir", str(data), *extra]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    assert result.output.strip() == (
        f"shardnet: error: --key: {key}: no such key file (create it with `shardnet keygen "
        f"--key {key}`, or leave --key out to keep one in the data directory)"
    )
    assert not key.parent.exists()
    assert not data.exists()
    # a key path that exists but holds no usable key: one line each, nothing created
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "empty.key").touch(mode=0o600)
    (bad / "garbage.key").write_bytes(b"garbage")
    (bad / "garbage.key").chmod(0o600)
    Identity.load_or_create(bad / "open.key")
    (bad / "open.key").chmod(0o644)
    for path, says in (
        (bad, "is a directory, not a key file"),
        (bad / "empty.key", "is empty (make a key with `shardnet keygen"),
        (bad / "garbage.key", "is not a libp2p private key"),
        (bad / "open.key", "is accessible by group/others (mode 644); run: chmod 600"),
        (Path(""), "'.' names no key file"),
    ):
        args[2] = str(path)
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        out = result.output.strip()
        assert out.startswith("shardnet: error: --key: "), out
        assert says in out, out
        assert len(out.splitlines()) == 1
        assert not data.exists()
    # without --key, the data directory's key is created on first start, as before
    settings = load_settings(OriginSettings, None, {"watch": tmp_path, "data_dir": data})
    ident = settings.identity()
    assert (data / "node.key").is_file()
    assert settings.identity().peer_id == ident.peer_id


def test_relay_without_upstream_is_a_config_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["relay", "--trainer-id", PID, "--data-dir", str(tmp_path)])
    assert result.exit_code == 2
    assert result.output.strip() == "shardnet: error: --upstream: Field required"


@pytest.mark.parametrize(("role", "option"), [("relay", "--upstream"), ("peer", "--bootstrap")])
def test_an_upstream_naming_the_node_itself_is_a_config_error(
    tmp_path: Path, role: str, option: str
) -> None:

    key = tmp_path / "node.key"
    me = Identity.load_or_create(key).peer_id
    args = [role, "--key", str(key), "--data-dir", str(tmp_path / "d"), "--trainer-id", PID]
    args += ["--listen", "/ip4/127.0.0.1/tcp/0", "--http-host", "127.0.0.1", "--http-port", "0"]
    result = CliRunner().invoke(app, [*args, option, f"/ip4/127.0.0.1/tcp/9/p2p/{me}"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1].startswith(f"shardnet: error: {option}: ")
    assert "is this node itself" in result.output


def test_card_mirror_is_checked_and_goes_into_the_origin_card(tmp_path: Path) -> None:
    from shardnet.roles import origin_card_rules

    base = {"watch": tmp_path, "data_dir": tmp_path / "d"}
    s = load_settings(OriginSettings, None, {**base, "card_mirror": ["http://127.0.0.1:8080/"]})
    assert s.card_mirror == ["http://127.0.0.1:8080"]  # the normal form the card requires
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    card = origin_card_rules(s, "12D3KooW" + "a" * 44, tmp_path)
    assert card.mirrors == ("http://127.0.0.1:8080",)
    plain = load_settings(OriginSettings, None, base)
    assert origin_card_rules(plain, "12D3KooW" + "a" * 44, tmp_path).mirrors == ()
    for bad, match in (
        (["https://m.example.org"], "http://HOST"),
        (["http://m.example.org", "http://m.example.org/"], "twice"),
        ([f"http://m{i}.example.org" for i in range(9)], "at most 8"),
        (["http://m.example.org/" + "a" * 300], "256"),
    ):
        with pytest.raises(ConfigError, match=match) as info:
            load_settings(OriginSettings, None, {**base, "card_mirror": bad})
        assert info.value.field == "card_mirror"


def _profile_file(path: Path, arch: str, engine: str = "transformers-bf16") -> Path:
    from rollout.calibrate import Provenance, ValidatorProfile, write_profile
    from rollout.verify import VLLM_BF16_PROFILE

    write_profile(
        path,
        ValidatorProfile(
            arch, {engine: VLLM_BF16_PROFILE}, Provenance("m", 10, 0, "2026-12-01T20:00:00Z")
        ),
    )
    return path


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (None, "--validator-profile: "),
        ("{", "not JSON"),
        ('{"v": 1}', "field document: missing"),
        ("vllm", "none of the run's engines"),
    ],
)
def test_bad_validator_profile_is_one_line_and_exit_2(
    tmp_path: Path, content: str | None, needle: str
) -> None:
    path = tmp_path / "profile.json"
    if content == "vllm":
        _profile_file(path, "cd" * 32, "vllm-bf16")
    elif content is not None:
        path.write_text(content)
    result = CliRunner().invoke(
        app,
        [
            "trainer",
            "--validator-profile",
            str(path),
            "--data-dir",
            str(tmp_path / "d"),
            "--listen",
            "/ip4/127.0.0.1/tcp/0",
            "--http-host",
            "127.0.0.1",
            "--http-port",
            "0",
        ],
    )
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith("shardnet: error: --validator-profile: "), lines[0]
    assert needle in lines[0], lines[0]
    assert "Traceback" not in result.output


def test_validator_profile_goes_into_the_origin_card(tmp_path: Path) -> None:
    from rollout.calibrate import load_profile
    from shardcast.wire.runcard import architecture_digest
    from shardnet.roles import origin_card_rules, origin_profiles

    config = {"model_type": "llama"}
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    path = _profile_file(tmp_path / "p.json", architecture_digest(config))
    base = {"watch": tmp_path, "data_dir": tmp_path / "d"}
    s = load_settings(OriginSettings, None, {**base, "validator_profile": path})
    card = origin_card_rules(s, "12D3KooW" + "a" * 44, tmp_path)
    assert card.validator_profile is not None
    assert card.validator_profile.digest == load_profile(path).digest()
    assert set(card.validator_profile.thresholds()) == {"transformers-bf16"}
    assert set(origin_profiles(s)) == {"transformers-bf16"}
    plain = load_settings(OriginSettings, None, base)
    assert origin_card_rules(plain, "12D3KooW" + "a" * 44, tmp_path).validator_profile is None
    assert origin_profiles(plain) == {}
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(ConfigError, match="calibrated on model architecture") as info:
        origin_card_rules(s, "12D3KooW" + "a" * 44, tmp_path)
    assert info.value.field == "validator_profile"
