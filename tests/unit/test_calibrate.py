"""Validator profile files (:mod:`rollout.calibrate`): round trip, typed errors, the
architecture check, and what the run card says about a profile."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from p2p.errors import ConfigError
from rollout.calibrate import (
    THRESHOLD_NAMES,
    Provenance,
    ValidatorProfile,
    card_profile,
    engine_profile_from_chosen,
    load_profile,
    profile_thresholds,
    write_profile,
)
from rollout.toploc_judge import ToplocThresholds
from rollout.verify import VLLM_BF16_PROFILE, EngineProfile
from shardcast.wire.canonical import blake3_hex
from shardcast.wire.runcard import PROFILE_THRESHOLD_KEYS

ARCH = "cd" * 32
H512_LIKE = EngineProfile(  # tighter than the defaults on the prefill chunk, as h512's own
    toploc_thresholds=ToplocThresholds(10, 1.41, 1.0),
    toploc_prefill_thresholds=ToplocThresholds(5, 0.282, 1.0),
    logprob_tolerance=0.0405,
    logprob_max_tolerance=0.1545,
    replay_margin=0.1695,
    eos_min_prob=1e-6,
)


def make_profile(**engines: EngineProfile) -> ValidatorProfile:
    return ValidatorProfile(
        ARCH,
        engines or {"transformers-bf16": H512_LIKE},
        Provenance("h512", 184, 1, "2026-12-01T20:00:00Z"),
    )


def test_round_trip_and_digest(tmp_path: Path) -> None:
    p = make_profile(**{"transformers-bf16": H512_LIKE, "vllm-bf16": VLLM_BF16_PROFILE})
    path = tmp_path / "sub" / "h512.json"
    write_profile(path, p)
    back = load_profile(path)
    assert back == p
    assert back.digest() == p.digest() == blake3_hex(path.read_bytes())
    assert dict(back.engines) == {"transformers-bf16": H512_LIKE, "vllm-bf16": VLLM_BF16_PROFILE}
    # a hand-edited (pretty-printed) file reads the same and has the same digest
    path.write_text(json.dumps(p.to_obj(), indent=2))
    assert load_profile(path).digest() == p.digest()
    assert set(THRESHOLD_NAMES) == PROFILE_THRESHOLD_KEYS


def _doc() -> dict[str, Any]:
    return make_profile().to_obj()


def _set(doc: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    *path, last = dotted.split(".")
    node = doc
    for k in path:
        node = node[k]
    if value is KeyError:
        del node[last]
    else:
        node[last] = value
    return doc


E = "engines.transformers-bf16"


@pytest.mark.parametrize(
    ("dotted", "value", "needle"),
    [
        ("v", 2, "field v: schema 2"),
        ("architecture_digest", "xyz", "field architecture_digest"),
        ("engines", {}, "field engines"),
        (f"{E}.replay_margin", -0.1, f"field {E}.replay_margin: -0.1 is not a number >= 0"),
        (f"{E}.replay_margin", "0.1", f"field {E}.replay_margin"),
        (f"{E}.logprob_tolerance", KeyError, f"field {E}: missing ['logprob_tolerance']"),
        (f"{E}.eos_min_prob", 2.0, f"field {E}.eos_min_prob"),
        (
            f"{E}.toploc_thresholds.max_exp_mismatches",
            1.5,
            f"field {E}.toploc_thresholds.max_exp_mismatches: 1.5 is not an integer",
        ),
        (f"{E}.extra", 1, "unknown ['extra']"),
        ("provenance.honest_rollouts", 0, "field provenance.honest_rollouts"),
        ("provenance.model", "", "field provenance.model"),
    ],
)
def test_bad_fields_are_one_line_config_errors(
    tmp_path: Path, dotted: str, value: Any, needle: str
) -> None:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(_set(_doc(), dotted, value)))
    with pytest.raises(ConfigError) as info:
        load_profile(path)
    assert info.value.field == "validator_profile"
    assert needle in str(info.value), str(info.value)
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)


def test_bad_engine_id_missing_file_and_not_json(tmp_path: Path) -> None:
    doc = _doc()
    doc["engines"] = {"nope": doc["engines"]["transformers-bf16"]}
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ConfigError, match=r"field engines\.nope"):
        load_profile(path)
    with pytest.raises(ConfigError, match="No such file") as info:
        load_profile(tmp_path / "missing.json")
    assert info.value.field == "validator_profile"
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="not JSON"):
        load_profile(path)


def test_architecture_mismatch_is_refused() -> None:
    p = make_profile()
    p.check_architecture(ARCH)
    with pytest.raises(ConfigError, match="calibrated on model architecture cdcd") as info:
        p.check_architecture("ef" * 32)
    assert info.value.field == "validator_profile"


def test_for_engines_keeps_the_runs_and_needs_one() -> None:
    p = make_profile(**{"transformers-bf16": H512_LIKE, "vllm-bf16": VLLM_BF16_PROFILE})
    assert p.for_engines(("transformers-bf16",)) == {"transformers-bf16": H512_LIKE}
    with pytest.raises(ConfigError, match="none of the run's engines"):
        make_profile(**{"vllm-bf16": VLLM_BF16_PROFILE}).for_engines(("transformers-bf16",))


def test_card_profile_has_digest_and_every_threshold() -> None:
    p = make_profile()
    card = card_profile(p, p.for_engines(("transformers-bf16",)))
    assert card.digest == p.digest()
    assert card.thresholds() == {"transformers-bf16": profile_thresholds(H512_LIKE)}
    assert card.thresholds()["transformers-bf16"]["prefill_max_mant_err_mean"] == 0.282


def test_engine_profile_from_the_bench_choice() -> None:
    chosen = {
        "prefill_exp_mismatches": 5.0,
        "prefill_mant_err_mean": 0.28213,
        "prefill_mant_err_median": 1.0,
        "decode_exp_mismatches": 10.5,
        "decode_mant_err_mean": 1.41,
        "decode_mant_err_median": 1.0,
        "logprob_mean_abs_diff": 0.04049,
        "logprob_max_abs_diff": 0.15449,
        "replay_max_gap": 0.16951,
        "eos_prob": 4.5e-5,
    }
    assert engine_profile_from_chosen(chosen) == H512_LIKE  # EOS floor: at most the default
