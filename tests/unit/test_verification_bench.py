"""The adversarial verification bench (``bench/verification.py``) on a tiny corpus.

18 honest rollouts (2 prompts × 4 samples, one batch by the engine and one left-padded
multi-prompt batch, and the two attacker peers' honest 1 × 1 rollouts) and 2 of each attack,
through the real ``Validator`` with seeded Gumbel-max sampling. With the shipped defaults
nothing honest is rejected and every class is caught except the ones the near-uniform
``tiny`` model cannot separate from honest numerics (``precision``, some ``finetuned_*``,
``other_temperature``, some one-digit ``tampered_prompt`` edits): the bench reports those per
class with their margins, and the ``strict_hf`` profile catches ``precision``.
"""

from __future__ import annotations

import dataclasses
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bench.verification import (
    ATTACKS,
    BenchConfig,
    Layout,
    engine_calibration,
    generate_batch,
    main,
    make_world,
    print_engine_calibration,
    print_table,
    run,
    submit,
)
from rollout.toploc import ToplocThresholds

LAYOUTS = (Layout("g4", 2, 4, 32), Layout("multi", 2, 4, 32, "multi"))
TINY = BenchConfig(
    rounds=1, layouts=LAYOUTS, attacks_per_round=2, probes_per_round=1, finetune_lrs=(1e-4,)
)
CAUGHT_ON_TINY = (  # with the shipped defaults, whatever the model's numerics
    "other_model_seed",
    "greedy",
    "tampered_completion",
    "tampered_last_token",
    "forced_stop",
    "inflated_reward",
    "replayed_batch",
    "stale_step",
    "wrong_signer",
    "truncated_proof",
    "corrupted_proof",
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def kept() -> dict[str, dict[str, Any]]:
    return {"default": {}, "strict_hf": {}}


@pytest.fixture(scope="module")
def reports(kept: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {
        "default": run(TINY, kept["default"]),
        "strict_hf": run(dataclasses.replace(TINY, profile="strict_hf"), kept["strict_hf"]),
    }


def test_default_profile(reports: dict[str, dict[str, Any]]) -> None:
    report = reports["default"]
    assert (report["honest_total"], report["false_rejects"]) == (18, 0)
    for name in ATTACKS:
        attack = report["attacks"][name]
        assert attack["total"] > 0, name
        if name in CAUGHT_ON_TINY:
            assert attack["missed"] == 0, (name, report["details"]["attacks"][name]["outcomes"])
    outcomes = report["details"]["attacks"]
    # only the seeded replay sees these: proofs and logprobs are the published model's
    for name in ("greedy", "forced_stop"):
        assert outcomes[name]["outcomes"] == {"replay": 2}, name
    # the envelope's signer must be the named submitter: an announcement naming another PeerID
    # fails its signature check while decoding
    assert outcomes["wrong_signer"]["outcomes"].keys() == {"integrity", "prompt", "untrusted"}
    assert outcomes["replayed_batch"]["outcomes"].keys() == {"duplicate"}


def test_strict_profile_catches_precision(reports: dict[str, dict[str, Any]]) -> None:
    report = reports["strict_hf"]
    assert (report["honest_total"], report["false_rejects"]) == (18, 0)
    assert report["attacks"]["precision"]["missed"] == 0
    assert report["details"]["attacks"]["precision"]["outcomes"] == {"toploc": 2}


def test_report_shape_and_table(reports: dict[str, dict[str, Any]]) -> None:
    report = reports["default"]
    assert set(report) == {
        "honest_total",
        "false_rejects",
        "attacks",
        "verify_s_per_rollout",
        "generate_s_per_rollout",
        "details",
    }
    assert set(report["attacks"]) == set(ATTACKS)
    assert report["verify_s_per_rollout"] > 0 < report["generate_s_per_rollout"]
    d = report["details"]
    assert d["honest"]["toploc"]["prefill"]["chunks"] == 18
    assert d["honest"]["accepted_under_profile"] == {
        "default": 18,
        "paper": 18,
        "strict_hf": 18,
        "calibrated": 18,
    }
    batching = d["timing"]["batching"]
    assert batching["verdicts_agree"] == batching["rollouts"] == 8
    cal = d["calibration"]
    assert cal["honest"]["replay_max_gap"]["n"] == 18
    assert cal["margins_under_calibrated"]["honest"]["accepted"] == 18
    assert cal["margins_under_calibrated"]["greedy"]["caught_by"] == {"replay_max_gap": 2}
    table = io.StringIO()
    print_table(report, table)
    assert all(name in table.getvalue() for name in ATTACKS)


def test_engine_calibration(kept: dict[str, dict[str, Any]]) -> None:
    """Thresholds chosen from the honest maxima with headroom pass every honest rollout."""
    cal = engine_calibration({"tiny": kept["default"]}, TINY.temperature)
    margins = cal["margins"]["tiny"]
    assert margins["honest"]["accepted"] == margins["honest"]["judged"] == 18
    assert margins["honest"]["closest_ratio"] <= 1 / 1.5 + 1e-9
    assert margins["greedy"]["accepted"] == 0
    out = io.StringIO()
    print_engine_calibration(cal, out)
    assert "transformers-bf16" in out.getvalue()


def test_corpus_is_deterministic(reports: dict[str, dict[str, Any]]) -> None:
    """The two runs differ only in the validator profile: same rollouts, same statistics."""
    default, strict = (reports[p]["details"] for p in ("default", "strict_hf"))
    assert default["honest"]["toploc"] == strict["honest"]["toploc"]
    assert default["honest"]["replay"] == strict["honest"]["replay"]
    for name in ("other_model_seed", "precision", "tampered_prompt", "greedy"):
        assert default["attacks"][name]["toploc"] == strict["attacks"][name]["toploc"], name
        assert default["attacks"][name]["replay"] == strict["attacks"][name]["replay"], name


def test_prefill_and_decode_chunks_have_their_own_thresholds(tmp_path: Path) -> None:
    """``toploc_prefill_thresholds`` judges chunk 0 only, ``toploc_thresholds`` the rest."""
    world = make_world(TINY, tmp_path)
    batch, _ = generate_batch(world, LAYOUTS[1], 0)  # padded batch: both chunk kinds drift
    exact = ToplocThresholds(0, 0.0, 0.0)
    loose = ToplocThresholds(128, 2.0**64, 2.0**64)
    for prefill, decode, where in [(exact, loose, "prefill"), (loose, exact, "decode")]:
        validator = world.validator(LAYOUTS[1])
        validator.config = dataclasses.replace(
            validator.config, toploc_prefill_thresholds=prefill, toploc_thresholds=decode
        )
        verdict = validator.check(batch, sender=world.peers[0].peer_id, current_step=0)
        assert verdict.reason == "toploc", verdict
        assert ("in chunk 0:" in verdict.detail) == (where == "prefill"), verdict.detail
    assert submit(world, world.validator(LAYOUTS[1]), batch, world.peers[0]).accepted


@pytest.mark.parametrize(
    "argv",
    [
        ["--models", "nope"],
        ["--rounds", "tiny=x"],
        ["--rounds", "huge=1"],
        ["--attacks", "1"],
        ["--models", "tiny,h512", "--write-profile", "p.json"],
    ],
)
def test_usage_errors_exit_2(argv: list[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2


def test_profile_of_a_model(reports: dict[str, dict[str, Any]], tmp_path: Path) -> None:
    """``--write-profile``: the model's own calibrated limits, its architecture digest and
    the honest count, readable by the trainer's ``--validator-profile``."""
    from bench.verification import profile_of
    from rollout.calibrate import load_profile, write_profile

    report = reports["default"]
    profile = profile_of({"transformers-bf16": report}, "tiny", 0)
    assert profile.architecture_digest == report["details"]["model"]["architecture_digest"]
    assert profile.provenance.honest_rollouts == 18
    own = report["details"]["calibration"]["calibrated_profile"]
    p = profile.engines["transformers-bf16"]
    assert p.replay_margin == own["replay_margin"]
    assert dataclasses.asdict(p.toploc_prefill_thresholds) == own["toploc_prefill_thresholds"]
    assert p.eos_min_prob <= 1e-6
    write_profile(tmp_path / "tiny.json", profile)
    assert load_profile(tmp_path / "tiny.json") == profile
