"""Validator profile files: per-engine thresholds calibrated for one model, with provenance.

Theory of operation
-------------------
The validator's model-dependent thresholds (:class:`rollout.verify.EngineProfile`) depend on
the engine *and* on the model: the honest spread of a statistic grows with the model (bf16
ulps of larger logits, deeper stacks), so one engine-wide limit either admits attacks on a
small model or rejects honest rollouts of a large one. Measured (issue 13,
``bench/results/verification-seed1.txt``): the engine-wide ``transformers-bf16`` limits miss
the fp32-compute (``precision``) attack on ``h512`` 5 times in 16 because ``m100``'s honest
prefill statistic is larger; each model's own calibrated limits catch it on all three models.

So a run of a given model can ship its own thresholds: ``bench/verification.py
--write-profile FILE`` calibrates them (1.5x the worst honest value, at least the bench's
minimum steps; ``bench.verification.calibrate``) and writes a *validator profile* file; the
trainer (or an origin with ``--rollouts-out``) loads it with ``--validator-profile FILE``,
refuses it when its architecture digest is not the run's model's, judges every engine the
file names with the file's thresholds (they override :data:`rollout.verify.DEFAULT_PROFILES`
and the built-in defaults for those engines), and puts the file's digest and thresholds on the
signed run card (:class:`shardcast.wire.runcard.CardProfile`) so peers and auditors see which
thresholds the run uses.

File format (JSON, schema ``v`` = 1)::

    {"v": 1,
     "architecture_digest": "<64 hex>",      # shardcast.wire.runcard.architecture_digest
     "engines": {"transformers-bf16": {
         "toploc_thresholds": {"max_exp_mismatches": 12, "max_mant_err_mean": 3.4,
                               "max_mant_err_median": 2.0},
         "toploc_prefill_thresholds": {...},
         "logprob_tolerance": 0.05, "logprob_max_tolerance": 0.21,
         "replay_margin": 0.18, "eos_min_prob": 1e-06}},
     "provenance": {"model": "h512", "honest_rollouts": 184, "seed": 1,
                    "created": "2026-12-01T20:00:00Z", "tool": "bench/verification.py"}}

The profile's digest (:meth:`ValidatorProfile.digest`) is the BLAKE3 of the document with
sorted keys, no whitespace and Python's shortest round-trip float repr (what
:func:`write_profile` writes, plus a newline): ``b3sum`` of a file written by this module.

Every failure to read a file is a :class:`~p2p.errors.ConfigError` on the option that named it
(``validator_profile``), one line naming the file and the bad field.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from p2p.errors import ConfigError
from rollout.gumbel import DEFAULT_EOS_MIN_PROB
from rollout.toploc_judge import ToplocThresholds
from rollout.verify import EngineProfile
from shardcast.wire import DIGEST_RE, CardProfile, EngineSpec, blake3_hex

__all__ = [
    "MAX_PROFILE_BYTES",
    "PROFILE_SCHEMA",
    "THRESHOLD_NAMES",
    "Provenance",
    "ValidatorProfile",
    "card_profile",
    "engine_profile_from_chosen",
    "load_profile",
    "profile_thresholds",
    "write_profile",
]

PROFILE_SCHEMA = 1
MAX_PROFILE_BYTES = 64 * 1024
OPTION = "validator_profile"
_TOPLOC_KEYS = ("max_exp_mismatches", "max_mant_err_mean", "max_mant_err_median")
_SCALARS = ("logprob_tolerance", "logprob_max_tolerance", "replay_margin", "eos_min_prob")
THRESHOLD_NAMES = (
    *(f"prefill_{k}" for k in _TOPLOC_KEYS),
    *(f"decode_{k}" for k in _TOPLOC_KEYS),
    *_SCALARS,
)
"""The flat threshold names of :func:`profile_thresholds` (the run card's keys)."""


@dataclass(frozen=True)
class Provenance:
    """Where a profile's thresholds come from.

    Attributes:
        model: the model's name or path as the calibrating tool knew it.
        honest_rollouts: honest rollouts the thresholds were chosen from (>= 1).
        seed: the calibration run's seed.
        created: UTC time of writing, ISO 8601 (``2026-12-01T20:00:00Z``).
        tool: what calibrated (``bench/verification.py``).
    """

    model: str
    honest_rollouts: int
    seed: int
    created: str
    tool: str = "bench/verification.py"


@dataclass(frozen=True)
class ValidatorProfile:
    """A validator profile file (see the module docstring).

    Attributes:
        architecture_digest: :func:`shardcast.wire.runcard.architecture_digest` of the model the
            thresholds were calibrated on.
        engines: engine id (``transformers-bf16``) -> its thresholds, at least one.
        provenance: how they were calibrated.
    """

    architecture_digest: str
    engines: Mapping[str, EngineProfile]
    provenance: Provenance

    def to_obj(self) -> dict[str, Any]:
        """The JSON document."""
        return {
            "v": PROFILE_SCHEMA,
            "architecture_digest": self.architecture_digest,
            "engines": {e: _engine_obj(p) for e, p in sorted(self.engines.items())},
            "provenance": asdict(self.provenance),
        }

    def encode(self) -> bytes:
        """The normalized bytes (sorted keys, no whitespace, float repr, newline)."""
        return json.dumps(self.to_obj(), sort_keys=True, separators=(",", ":")).encode() + b"\n"

    def digest(self) -> str:
        """BLAKE3 hex of :meth:`encode`: the profile's identity on the run card."""
        return blake3_hex(self.encode())

    def check_architecture(self, run_digest: str, option: str = OPTION) -> None:
        """Refuse a profile calibrated on another model.

        Raises:
            ConfigError: on ``option``, when ``run_digest`` (the run's model's architecture
                digest) differs from the profile's.
        """
        if run_digest != self.architecture_digest:
            raise ConfigError(
                option,
                f"calibrated on model architecture {self.architecture_digest[:16]}… "
                f"({self.provenance.model}), this run's model is {run_digest[:16]}…: "
                "calibrate for this model (bench/verification.py --write-profile)",
            )

    def for_engines(
        self, engines: tuple[str, ...], option: str = OPTION
    ) -> dict[str, EngineProfile]:
        """The profiles of the run's ``engines`` (others in the file are ignored).

        Raises:
            ConfigError: on ``option``, when the file has none of ``engines``.
        """
        out = {e: p for e, p in self.engines.items() if e in engines}
        if not out:
            raise ConfigError(
                option,
                f"has thresholds for {sorted(self.engines)}, none of the run's engines "
                f"{list(engines)}",
            )
        return out


def card_profile(profile: ValidatorProfile, engines: Mapping[str, EngineProfile]) -> CardProfile:
    """What the run card says about ``profile``: its digest and the thresholds of ``engines``
    (the run's engines the profile covers, :meth:`ValidatorProfile.for_engines`)."""
    return CardProfile.of(profile.digest(), {e: profile_thresholds(p) for e, p in engines.items()})


def profile_thresholds(p: EngineProfile) -> dict[str, float]:
    """The thresholds of ``p`` by :data:`THRESHOLD_NAMES` (flat, as on the run card)."""
    out: dict[str, float] = {}
    for part, th in (("prefill", p.toploc_prefill_thresholds), ("decode", p.toploc_thresholds)):
        for k in _TOPLOC_KEYS:
            out[f"{part}_{k}"] = float(getattr(th, k))
    for k in _SCALARS:
        out[k] = float(getattr(p, k))
    return out


def engine_profile_from_chosen(chosen: Mapping[str, float]) -> EngineProfile:
    """An :class:`EngineProfile` from the bench's chosen per-statistic limits
    (``calibrate(...)["chosen"]`` of ``bench/verification.py``: 1.5x the worst honest value,
    at least the minimum steps). Counts are rounded down (a count passes at or below its
    limit). The EOS floor is the smaller of the calibrated one and
    :data:`~rollout.gumbel.DEFAULT_EOS_MIN_PROB` (the floor is kept low on purpose: an honest
    completion fails a floor ``f`` with probability up to ``N * f``).

    Raises:
        KeyError: a statistic is missing from ``chosen``.
    """

    def th(part: str) -> ToplocThresholds:
        return ToplocThresholds(
            int(chosen[f"{part}_exp_mismatches"]),
            round(chosen[f"{part}_mant_err_mean"], 3),
            float(int(chosen[f"{part}_mant_err_median"])),
        )

    eos = (
        min(float(f"{chosen['eos_prob']:.2g}"), DEFAULT_EOS_MIN_PROB)
        if "eos_prob" in chosen
        else DEFAULT_EOS_MIN_PROB
    )
    return EngineProfile(
        toploc_thresholds=th("decode"),
        toploc_prefill_thresholds=th("prefill"),
        logprob_tolerance=round(chosen["logprob_mean_abs_diff"], 4),
        logprob_max_tolerance=round(chosen["logprob_max_abs_diff"], 4),
        replay_margin=round(chosen["replay_max_gap"], 4),
        eos_min_prob=eos,
    )


def now_utc() -> str:
    """The current UTC time as ``YYYY-MM-DDTHH:MM:SSZ``."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def write_profile(path: Path, profile: ValidatorProfile) -> None:
    """Write ``profile`` to ``path`` (:meth:`ValidatorProfile.encode`; parents created).

    Raises:
        OSError: the file cannot be written.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(profile.encode())
    tmp.replace(path)


def load_profile(path: Path, option: str = OPTION) -> ValidatorProfile:
    """Read and validate a profile file.

    Raises:
        ConfigError: on ``option``: unreadable, too large, not JSON, or a bad field (named).
    """
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(option, f"{path}: {exc.strerror or exc}") from None
    if len(data) > MAX_PROFILE_BYTES:
        raise ConfigError(option, f"{path}: {len(data)} bytes exceed {MAX_PROFILE_BYTES}")
    try:
        obj = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ConfigError(option, f"{path}: not JSON ({exc})") from None
    return profile_from_obj(obj, f"{path}", option)


def profile_from_obj(obj: Any, source: str, option: str = OPTION) -> ValidatorProfile:
    """Validate a parsed profile document.

    Raises:
        ConfigError: on ``option``, ``"<source>: field <name>: <why>"``.
    """

    def fail(name: str, why: str) -> ConfigError:
        return ConfigError(option, f"{source}: field {name}: {why}")

    def keys(o: Any, name: str, want: set[str]) -> Mapping[str, Any]:
        if not isinstance(o, dict):
            raise fail(name, "is not an object")
        if set(o) != want:
            missing, extra = sorted(want - set(o)), sorted(set(o) - want)
            raise fail(name, f"missing {missing}, unknown {extra}")
        return o

    def number(o: Mapping[str, Any], key: str, name: str, integer: bool = False) -> float:
        v = o[key]
        ok = isinstance(v, int) if integer else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok or not math.isfinite(v) or v < 0:
            kind = "an integer" if integer else "a number"
            raise fail(f"{name}.{key}", f"{v!r} is not {kind} >= 0")
        return float(v)

    top = keys(obj, "document", {"v", "architecture_digest", "engines", "provenance"})
    if top["v"] != PROFILE_SCHEMA:
        raise fail("v", f"schema {top['v']!r}, this node reads {PROFILE_SCHEMA}")
    arch = top["architecture_digest"]
    if not isinstance(arch, str) or not DIGEST_RE.match(arch):
        raise fail("architecture_digest", "is not 64 lowercase hex characters")
    engines = top["engines"]
    if not isinstance(engines, dict) or not 1 <= len(engines) <= 8:
        raise fail("engines", "must map 1 to 8 engine ids to thresholds")
    parsed: dict[str, EngineProfile] = {}
    for eid, e in engines.items():
        name = f"engines.{eid}"
        try:
            EngineSpec.parse(eid, name)
        except ConfigError as exc:
            raise fail(name, str(exc).removeprefix(f"{name}: ")) from None
        e = keys(e, name, {"toploc_thresholds", "toploc_prefill_thresholds", *_SCALARS})
        ths = []
        for part in ("toploc_thresholds", "toploc_prefill_thresholds"):
            t = keys(e[part], f"{name}.{part}", set(_TOPLOC_KEYS))
            ths.append(
                ToplocThresholds(
                    int(number(t, "max_exp_mismatches", f"{name}.{part}", integer=True)),
                    number(t, "max_mant_err_mean", f"{name}.{part}"),
                    number(t, "max_mant_err_median", f"{name}.{part}"),
                )
            )
        scalars = {k: number(e, k, name) for k in _SCALARS}
        if scalars["eos_min_prob"] > 1:
            raise fail(f"{name}.eos_min_prob", f"{scalars['eos_min_prob']} is not in [0, 1]")
        parsed[eid] = EngineProfile(ths[0], ths[1], **scalars)
    p = keys(
        top["provenance"], "provenance", {"model", "honest_rollouts", "seed", "created", "tool"}
    )
    for k in ("model", "created", "tool"):
        if not isinstance(p[k], str) or not 0 < len(p[k]) <= 256:
            raise fail(f"provenance.{k}", "is not a string of 1 to 256 characters")
    for k in ("honest_rollouts", "seed"):
        if isinstance(p[k], bool) or not isinstance(p[k], int):
            raise fail(f"provenance.{k}", f"{p[k]!r} is not an integer")
    if p["honest_rollouts"] < 1:
        raise fail("provenance.honest_rollouts", "must be >= 1")
    return ValidatorProfile(
        arch,
        MappingProxyType(parsed),
        Provenance(p["model"], p["honest_rollouts"], p["seed"], p["created"], p["tool"]),
    )


def _engine_obj(p: EngineProfile) -> dict[str, Any]:
    return {
        "toploc_thresholds": asdict(p.toploc_thresholds),
        "toploc_prefill_thresholds": asdict(p.toploc_prefill_thresholds),
        **{k: float(getattr(p, k)) for k in _SCALARS},
    }
