"""The shaped-link mode of ``bench/broadcast.py``: rates, the bound, the summary, checkpoint
subsets, operator errors, and that an interrupted run leaves no namespace behind (as root)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from bench import broadcast
from shardcast.publish.layout import check_layout
from simulations import netns
from tests.helpers import make_checkpoint

OK, WHY = netns.available()
needs_netns = pytest.mark.skipif(not OK, reason=f"network namespaces unavailable: {WHY}")


def test_rates() -> None:
    assert broadcast.parse_rate("200M") == 200e6
    assert broadcast.parse_rate("1G") == 1e9
    assert broadcast.parse_rate("200mbit") == 200e6
    assert broadcast.parse_rate("5e8") == 5e8
    assert broadcast.rate_label(1e9) == "1 Gb/s"
    assert broadcast.rate_label(200e6) == "200 Mb/s"
    for bad in ("0", "-1M", "fast"):
        with pytest.raises(ValueError):  # noqa: PT011 - float() or ours
            broadcast.parse_rate(bad)


def test_bound_is_the_issues() -> None:
    # issue 16: 1.32 GB at 200 Mb/s, 32 MiB shards, 6 receivers -> 55.5 s
    assert broadcast.tree_depth(6) == 2
    assert broadcast.tree_depth(1) == 0
    bound = broadcast.shaped_bound_s(1_319_238_087, 32 << 20, 200e6 / 8, 6)
    assert math.isclose(bound, 55.45, abs_tol=0.05)


def _run(system: str, lasts: tuple[float, float], least: tuple[int, int] | None) -> dict[str, Any]:
    versions = []
    for step, last in enumerate(lasts):
        v: dict[str, Any] = {
            "step": step,
            "first_s": last - 1,
            "last_s": last,
            "origin_bytes": 1000 * (step + 1),
            "cpu_s": {"origin": 1.0 + step, "peer1": 2.0},
        }
        if least is not None:
            v["least_bytes"], v["shards"] = least[step], 4
        versions.append(v)
    return {"system": system, "versions": versions}


def test_summary_medians_bound_and_ratios() -> None:
    rate = 8e6  # 1 MB/s
    runs = {
        "shardnet": [
            _run("shardnet", (10.0, 2.0), (4_000_000, 40_000)),
            _run("shardnet", (12.0, 4.0), (4_000_000, 40_000)),
            _run("shardnet", (30.0, 3.0), (4_000_000, 40_000)),
            {"system": "shardnet", "versions": [], "error": "TooSlowError()"},
        ],
        "shardcast": [_run("shardcast", (20.0, 20.0), None) for _ in range(3)],
    }
    out = broadcast.summarize_shaped(runs, 4_000_000, rate, 1_000_000)
    full, nxt = out["systems"]["shardnet"]
    assert (full["last_s"], nxt["last_s"]) == (12.0, 3.0)
    # S/B + 2 * s/B with s = S / 4 shards
    assert out["bounds"][0]["bound_s"] == pytest.approx(4.0 + 2 * 1.0)
    assert out["bounds"][1]["bound_s"] == pytest.approx(0.04 + 2 * 0.01)
    assert full["eta"] == pytest.approx(6.0 / 12.0, abs=1e-3)
    assert out["systems"]["shardcast"][0]["eta"] == pytest.approx(6.0 / 20.0, abs=1e-3)
    assert full["cpu_s"] == {"origin": 1.0, "peer1": 2.0}
    assert out["full_ratio_vs_shardcast"] == pytest.approx(0.6)
    assert out["delta_ratio_vs_shardcast"] == pytest.approx(0.15)


def test_subset_is_a_valid_checkpoint_of_the_same_files(tmp_path: Path) -> None:
    sizes = {f"model-0000{i}-of-00004.safetensors": 1000 * i for i in range(1, 5)}
    v0 = make_checkpoint(tmp_path / "v0", sizes, seed=0)
    v1 = make_checkpoint(tmp_path / "v1", sizes, seed=1)
    s0, s1, size = broadcast.subset_versions(v0, v1, tmp_path / "cache", 4500)
    names = sorted(p.name for p in s0.iterdir() if p.name.endswith(".safetensors"))
    # layer files first (00001 last), until about 4500 bytes
    assert names == ["model-00002-of-00004.safetensors", "model-00003-of-00004.safetensors"]
    for d in (s0, s1):
        assert "config.json" in check_layout(d)
    assert size == sum(p.stat().st_size for p in s0.iterdir())
    assert (s1 / names[0]).read_bytes() == (v1 / names[0]).read_bytes()


def test_operator_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert broadcast.main(["--shaped", "fast"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--shaped" in err


def test_added_node_options_must_split_like_a_shell(capsys: pytest.CaptureFixture[str]) -> None:
    assert broadcast.main(["--origin-args", "--shards-per-part '8"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--origin-args: No closing quotation" in err


def test_save_rate_needs_shaped_and_a_positive_rate(capsys: pytest.CaptureFixture[str]) -> None:
    assert broadcast.main(["--save-mb-s", "500"]) == 2
    assert "--save-mb-s need --shaped" in capsys.readouterr().err
    if OK:
        assert broadcast.main(["--shaped", "1G", "--save-mb-s", "0"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1
        assert "--save-mb-s 0.0: not a positive rate" in err


def test_a_paced_save_writes_every_file_whole_under_its_final_name(tmp_path: Path) -> None:
    src, dst = tmp_path / "v1", tmp_path / "step-1"
    src.mkdir()
    dst.mkdir()
    (src / "sub").mkdir()  # not a file of the checkpoint's top level: left out
    files = {"a.safetensors": bytes(range(256)) * 300, "config.json": b"{}", "empty": b""}
    for name, data in files.items():
        (src / name).write_bytes(data)
    seconds = broadcast.save_paced(src, dst, bytes_per_s=1e12, block=1000)
    assert seconds >= 0
    assert {p.name: p.read_bytes() for p in dst.iterdir()} == files
    assert all(p.stat().st_ino != (src / p.name).stat().st_ino for p in dst.iterdir())


@needs_netns
def test_shardcast_venv_under_tmp_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    # each SHARDCAST process gets a private /tmp in --shaped mode: a venv there is not found
    assert broadcast.main(["--shaped", "1G", "--shardcast-venv", "/tmp/sc-venv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "--shardcast-venv /tmp/sc-venv" in err


def test_default_shardcast_venv_is_outside_tmp() -> None:
    from bench import shardcast_baseline

    assert not Path(shardcast_baseline.FALLBACK_VENV).resolve().is_relative_to("/tmp")


@needs_netns
def test_interrupted_shaped_run_removes_every_namespace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v0 = make_checkpoint(tmp_path / "v0", {"model.safetensors": 100}, seed=0)
    v1 = make_checkpoint(tmp_path / "v1", {"model.safetensors": 100}, seed=1)
    monkeypatch.setattr(broadcast, "prepare_checkpoints", lambda *a: (v0, v1, {"size_bytes": 1}))
    seen: list[str] = []

    async def interrupted(lab: netns.Lab, *args: Any) -> None:
        seen.extend(n for n in netns.namespaces() if n.startswith(f"{netns.PREFIX}{lab.id}-"))
        raise KeyboardInterrupt  # Ctrl-C while the nodes run

    monkeypatch.setattr(broadcast, "_shaped_runs", interrupted)
    before = set(netns.namespaces())
    rc = broadcast.main(["--shaped", "1G", "--workdir", str(tmp_path / "work")])
    assert rc == 130
    assert len(seen) == 1 + len(broadcast.SHAPED_NODES)  # the bridge and one per node
    assert set(netns.namespaces()) <= before
    assert not any((tmp_path / "work").iterdir())  # run directories removed


def test_each_system_goes_first_in_turn() -> None:
    systems = ["shardnet", "shardnet-nodelta", "shardcast"]
    orders = [broadcast.rotated(systems, rep) for rep in range(3)]
    assert [o[0] for o in orders] == systems
    assert all(sorted(o) == sorted(systems) for o in orders)


def test_scaled_preset_is_at_least_four_real_1b_and_5_3_gb() -> None:
    from bench import scaled

    big, small = scaled.preset_bytes("real-6b"), scaled.preset_bytes("real-1b")
    assert small == 1_319_211_008  # 659.6 M bf16 parameters
    assert big >= 4 * small
    assert big >= 5.3e9


def test_scaled_next_version_changes_exactly_the_count_asked(tmp_path: Path) -> None:
    from bench import scaled
    from rollout.model import load_model

    v0, v1 = tmp_path / "v0", tmp_path / "v1"
    size = scaled.write_checkpoint("tiny", v0, max_shard_bytes=400_000, seed=0)
    assert size == sum(p.stat().st_size for p in v0.iterdir())
    assert len(list(v0.glob("*.safetensors"))) > 1  # several weight files, with an index
    assert scaled.write_next(v0, v1, 5000, seed=1) == 5000
    assert scaled.changed_elements(v0, v1) == 5000
    assert sorted(p.name for p in v0.iterdir()) == sorted(p.name for p in v1.iterdir())
    for p in v0.iterdir():
        assert p.stat().st_size == (v1 / p.name).stat().st_size
    a, b = load_model(v0), load_model(v1)  # both load as checkpoints of the preset
    moved = {
        n: int((x.view(torch.int16) != b.state_dict()[n].view(torch.int16)).sum())
        for n, x in a.state_dict().items()
    }
    assert sum(moved.values()) == 5000
    assert sum(1 for k in moved.values() if k) > len(moved) // 2  # spread over the tensors
    with pytest.raises(ValueError, match="changed"):
        scaled.write_next(v0, tmp_path / "v1c", 10**12)


METRICS = """# HELP shardnet_http_sent_bytes_total lane body bytes
shardnet_http_sent_bytes_total 1.5e+06
shardnet_stage_cpu_seconds_total{stage="receive"} 0.5
shardnet_stage_cpu_seconds_total{stage="apply"} 1.25
shardnet_http_requests_total{code="2xx",route="have"} 40.0
shardnet_http_requests_total{code="4xx",route="have"} 2.0
shardnet_http_requests_total{code="2xx",route="blobs"} 0.0
"""


def test_scrape_reads_sent_bytes_and_stage_cpu() -> None:
    before = broadcast.Scrape.parse(METRICS)
    assert before.sent_bytes == 1_500_000
    assert before.stage_cpu_s == {"receive": 0.5, "apply": 1.25}
    after = broadcast.Scrape.parse(METRICS.replace("1.25", "2.0"))
    assert after.stage_delta(before) == {"receive": 0.0, "apply": 0.75}
    assert before.served == {"have": 42, "blobs": 0}  # every status class of a route
    later = broadcast.Scrape.parse(METRICS.replace("40.0", "45.0").replace("0.0\n", "3.0\n"))
    assert later.served_delta(before) == {"have": 5, "blobs": 3}
    assert before.served_delta(before) == {}
    assert broadcast.Scrape.parse("") == broadcast.Scrape(0, {}, {})


def _seeded(system: str, last: float, stages: dict[str, float] | None) -> dict[str, Any]:
    v: dict[str, Any] = {
        "step": 1,
        "first_s": last - 1,
        "last_s": last,
        "origin_bytes": 100,
        "cpu_s": {"origin": 1.0, "peer1": 2.0},
    }
    if stages is not None:
        v["stage_cpu_s"] = {"peer1": stages, "origin": {"apply": 0.0}}
        v["served"] = {"peer1": {"have": 10 * last}, "origin": {"part": 8}}
        v["least_bytes"], v["shards"] = 1_000_000, 10
    return {"system": system, "versions": [v], "seeded": True}


def test_seeded_runs_summarize_the_next_version_only_with_its_stages(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = {
        "shardnet": [
            _seeded("shardnet", 3.0, {"apply": 0.2, "write": 0.4}),
            _seeded("shardnet", 5.0, {"apply": 0.4, "write": 0.6}),
        ],
        "shardcast": [_seeded("shardcast", 30.0, None)],
    }
    out = broadcast.summarize_shaped(runs, 10_000_000, 8e6, 1_000_000)
    full, nxt = out["systems"]["shardnet"]
    assert out["seeded"]
    assert full["last_s"] is None
    assert nxt["last_s"] == 4.0
    assert nxt["stage_cpu_s"]["peer1"] == {"apply": pytest.approx(0.3), "write": 0.5}
    assert out["delta_ratio_vs_shardcast"] == pytest.approx(4.0 / 30.0, abs=1e-4)
    small = broadcast.summarize_shaped(
        {"shardnet": [_seeded("shardnet", 2.0, {"apply": 0.1})]}, 1, 8e6, 1
    )
    infos = {
        "real-1b": {"size_bytes": 1000, "changed_elements": 7},
        "real-6b": {"size_bytes": 4600, "changed_elements": 7},
    }
    sc = broadcast.scaling({"real-1b": small, "real-6b": out}, infos)
    assert sc["shardnet"] == {
        "next_s": {"real-1b": 2.0, "real-6b": 4.0},
        "ratio_last_over_first": 2.0,
    }
    assert sc["size_ratio"] == 4.6
    broadcast.print_shaped_table(
        {
            "checkpoints": infos,
            "machine": {
                "cores": 2,
                "write_bytes": 1 << 30,
                "write_s": 0.5,
                "write_cpu_s": 0.25,
                "create_ms": 0.4,
            },
            "seed_base": True,
            "rates": {"200 Mb/s": {"real-1b": small, "real-6b": out}},
            "scaling": {"200 Mb/s": sc},
        }
    )
    text = capsys.readouterr().out
    assert "base seeded" in text
    assert "(not run: base seeded)" in text
    assert "next(last)/next(first)=2.0" in text
    assert "CPU-s by stage" in text
    assert "next version, lane requests served by route" in text
    assert "  peer1           40         0        40" in text  # median of 30 and 50 have
    assert "machine: 2 cores for all nodes; writing 1 GiB into the page cache took 0.50 s" in text
    assert "; creating a 100 KB file there 0.400 ms of CPU" in text
    # the two seeded repeats spent 3.0 CPU-s each over the nodes: 1.5 s on 2 cores, of 4 s
    assert "200 Mb/s real-6b shardnet next: all nodes 3.00 CPU-s, at least 1.50 s on 2" in text
    assert "last peer 4.00 s (38% of it)" in text


def test_machine_probe_writes_then_removes_its_file(tmp_path: Path) -> None:
    got = broadcast.machine_probe(tmp_path, size=4 << 20, block=1 << 20)
    assert got["cores"] >= 1
    assert got["write_bytes"] == 4 << 20
    assert got["write_s"] >= 0
    assert got["write_cpu_s"] >= 0
    assert got["create_ms"] >= 0
    assert list(tmp_path.iterdir()) == []  # the file and the created files are gone
    with pytest.raises(FileNotFoundError):
        broadcast.machine_probe(tmp_path / "missing", size=1 << 20, block=1 << 20)


def test_seed_store_places_hard_links_of_the_verified_copy(tmp_path: Path) -> None:
    src = tmp_path / "origin" / "versions" / "bench" / "step-0"
    (src / ".enc").mkdir(parents=True)
    (src / "manifest.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"w" * 10)
    (src / ".enc" / "3.sparse").write_bytes(b"b")
    broadcast.seed_store(src, tmp_path / "peer1", 0)
    dst = tmp_path / "peer1" / "versions" / broadcast.RUN_ID / "step-0"
    for rel in ("manifest.json", "model.safetensors", ".enc/3.sparse"):
        assert (dst / rel).stat().st_ino == (src / rel).stat().st_ino


async def test_shardcast_only_next_publishes_the_next_version_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: dict[str, Any] = {}

    class FakeBaseline:
        @staticmethod
        async def arun_shardcast(first: Path, workdir: Path, **kw: Any) -> dict[str, Any]:
            seen["first"], seen["next"] = first, kw["next_checkpoints"]
            one = {"last_client_s": 9.0, "first_client_s": 8.0, "cpu_s": {"origin": 1.0}}
            return {"versions": [one] * (1 + len(kw["next_checkpoints"]))}

    monkeypatch.setattr(broadcast, "_baseline", lambda: FakeBaseline)
    v0, v1 = tmp_path / "v0", tmp_path / "v1"
    r = await broadcast.run_shardcast(v0, v1, tmp_path / "w", 10.0, tmp_path, only_next=True)
    assert (seen["first"], seen["next"]) == (v1, [])
    assert [v["step"] for v in r["versions"]] == [1]
    assert r["seeded"]
    r = await broadcast.run_shardcast(v0, v1, tmp_path / "w", 10.0, tmp_path)
    assert (seen["first"], seen["next"]) == (v0, [v1])
    assert [v["step"] for v in r["versions"]] == [0, 1]
