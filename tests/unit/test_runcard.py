"""The run card: canonical bytes, signatures, bounds and malformed fields."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from p2p import envelope
from p2p.envelope import Kind
from p2p.identity import Identity
from shardcast.wire.canonical import canonical_json
from shardcast.wire.runcard import (
    CARD_DOMAIN,
    MAX_CARD_BYTES,
    MAX_ENGINES,
    PROFILE_THRESHOLD_KEYS,
    BadRunCardSignature,
    CardProfile,
    EngineSpec,
    MalformedRunCard,
    RunCard,
    SamplingRules,
    SignedRunCard,
    TaskSpec,
    UnsupportedEngine,
    WrongRunCardKey,
    architecture_digest,
    choose_engine,
    next_card,
    sign_card,
)

TRAINER = Identity.from_seed("card-trainer")
OTHER = Identity.from_seed("card-other")
ROOT = Path(__file__).parents[2]


def _card(**kw: object) -> RunCard:
    base = RunCard(
        card_version=1,
        run_id="run-1",
        trainer=TRAINER.peer_id,
        task=TaskSpec("digits", 1, "ab" * 32),
        sampling=SamplingRules(4, 8, 16, 0.7),
        engines=(EngineSpec("transformers", "bf16"),),
        async_level=2,
        architecture_digest="cd" * 32,
        issued_at_ms=1_767_225_600_000,
    )
    return replace(base, **kw)  # type: ignore[arg-type]


def _legacy(card: RunCard, key: Identity = TRAINER) -> dict[str, object]:
    """``card`` in the old JSON envelope format (as stored before the envelope layer)."""
    sig = key.sign(CARD_DOMAIN, card.canonical_bytes())
    return {"body": card.to_obj(), "signer": key.peer_id, "signature": sig.hex()}


def _sealed_with(card_body: dict[str, object], signed: SignedRunCard) -> bytes:
    """A new-format document holding ``card_body`` under ``signed``'s signature."""
    raw = envelope.encode_sealed(
        Kind.RUN_CARD, canonical_json(card_body), TRAINER.key.public_key, signed.signature
    )
    return canonical_json({"v": 2, "sealed": base64.b64encode(raw).decode()})


def test_round_trip_and_canonical_bytes() -> None:
    signed = sign_card(_card(), TRAINER)
    data = signed.encode()
    back = SignedRunCard.decode(data, trainer=TRAINER.peer_id)
    assert back == signed
    assert back.encode() == data
    assert back.digest == _card().digest()
    # canonical: sorted keys, no whitespace, temperature as its shortest decimal
    body = _card().canonical_bytes()
    assert body == json.dumps(json.loads(body), sort_keys=True, separators=(",", ":")).encode()
    assert b'"temperature":"0.7"' in body
    assert b" " not in body
    assert json.loads(data)["v"] == 2
    # old format: a re-ordered but equal envelope still verifies (the body is re-canonicalized)
    env = _legacy(_card())
    shuffled = json.dumps(
        {"signature": env["signature"], "signer": env["signer"], "body": env["body"]}
    )
    old = SignedRunCard.decode(shuffled.encode(), trainer=TRAINER.peer_id)
    assert old.legacy
    assert old.card == signed.card
    assert old.digest == signed.digest
    assert old.encode() == canonical_json(env)  # kept (stored, served) in its own format
    # next_card reseals an old-format card as it is: same version and digest
    resealed = next_card(_card(issued_at_ms=5), old, TRAINER)
    assert not resealed.legacy
    assert (resealed.version, resealed.digest) == (old.version, old.digest)


def test_tampered_body_or_signature_fails() -> None:
    signed = sign_card(_card(), TRAINER)
    body = _card().to_obj()
    body["sampling"]["group_size"] = 9
    with pytest.raises(BadRunCardSignature):
        SignedRunCard.decode(_sealed_with(body, signed), trainer=TRAINER.peer_id)
    doc = json.loads(signed.encode())
    doc["sealed"] = doc["sealed"][:-2] + "A="  # not the canonical base64 (or another sig)
    with pytest.raises((MalformedRunCard, BadRunCardSignature)):
        SignedRunCard.decode(json.dumps(doc).encode(), trainer=TRAINER.peer_id)
    env = _legacy(_card())
    env["body"]["sampling"]["group_size"] = 9  # type: ignore[index]
    with pytest.raises(BadRunCardSignature):
        SignedRunCard.decode(json.dumps(env).encode(), trainer=TRAINER.peer_id)
    env = _legacy(_card())
    sig = bytearray(bytes.fromhex(env["signature"]))  # type: ignore[arg-type]
    sig[0] ^= 1
    env["signature"] = sig.hex()
    with pytest.raises(BadRunCardSignature):
        SignedRunCard.decode(json.dumps(env).encode(), trainer=TRAINER.peer_id)


def test_wrong_key() -> None:
    # a card validly signed by another key, naming that key as trainer
    foreign = sign_card(_card(trainer=OTHER.peer_id), OTHER)
    with pytest.raises(WrongRunCardKey, match="pinned trainer"):
        SignedRunCard.decode(foreign.encode(), trainer=TRAINER.peer_id)
    # signing a card that names someone else is refused
    with pytest.raises(Exception, match="trainer"):
        sign_card(_card(), OTHER)
    # signed by the pinned key's impostor: envelope claims TRAINER, signature by OTHER
    env = _legacy(_card())
    env["signature"] = OTHER.sign("runcard/v1", _card().canonical_bytes()).hex()
    with pytest.raises(BadRunCardSignature):
        SignedRunCard.decode(json.dumps(env).encode(), trainer=TRAINER.peer_id)


def test_size_bound_and_garbage() -> None:
    with pytest.raises(MalformedRunCard, match="exceed"):
        SignedRunCard.decode(b" " * (MAX_CARD_BYTES + 1), trainer=TRAINER.peer_id)
    for junk in (b"", b"{", b"[]", b'{"body": {}}', b"\xff\xfe"):
        with pytest.raises(MalformedRunCard):
            SignedRunCard.decode(junk, trainer=TRAINER.peer_id)
    data = sign_card(_card(), TRAINER).encode()
    for cut in range(0, len(data), 97):
        with pytest.raises(MalformedRunCard):
            SignedRunCard.decode(data[:cut], trainer=TRAINER.peer_id)


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("v",), 2, "v"),
        (("card_version",), 0, "card_version"),
        (("run_id",), "../x", "run_id"),
        (("task", "digest"), "XYZ", "task.digest"),
        (("task", "version"), True, "task.version"),
        (("sampling", "group_size"), 0, "sampling.group_size"),
        (("sampling", "temperature"), 1.0, "sampling.temperature"),
        (("sampling", "temperature"), "1.00", "sampling.temperature"),
        (("sampling", "temperature"), "nan", "sampling.temperature"),
        (("sampling", "temperature"), "-1.0", "sampling.temperature"),
        (("engines",), [], "engines"),
        (("engines",), [{"family": "vllm", "dtype": "int3"}], "engines"),
        (("engines",), [{"family": "vllm", "dtype": "bf16"}] * 2, "engines"),
        (("async_level",), -1, "async_level"),
        (("model",), {}, "model"),
        (("issued_at_ms",), "now", "issued_at_ms"),
        (("extra",), 1, ""),
    ],
)
def test_malformed_fields_are_named(path: tuple[str, ...], value: object, field: str) -> None:
    body = _card().to_obj()
    target = body
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    with pytest.raises(MalformedRunCard) as info:
        RunCard.from_obj(body, "test")
    assert info.value.field == field


def test_next_card_versions() -> None:
    first = next_card(_card(), None, TRAINER)
    assert first.version == 1
    # same rules (later issue time): the stored card is kept
    assert next_card(_card(issued_at_ms=5), first, TRAINER) is first
    # changed rules: version + 1, newly signed
    second = next_card(_card(sampling=SamplingRules(4, 4, 16, 0.7)), first, TRAINER)
    assert second.version == 2
    assert SignedRunCard.decode(second.encode(), trainer=TRAINER.peer_id) == second
    with pytest.raises(Exception, match="holds run 'run-1'"):
        next_card(_card(run_id="run-2"), first, TRAINER)


def test_choose_engine() -> None:
    card = _card(engines=(EngineSpec("vllm", "bf16"), EngineSpec("transformers", "bf16")))
    tf = {"transformers": frozenset({"bf16"})}
    both = tf | {"vllm": frozenset({"bf16"})}
    assert choose_engine(card, tf) == EngineSpec("transformers", "bf16")
    assert choose_engine(card, both) == EngineSpec("vllm", "bf16")
    assert choose_engine(card, both, "transformers") == EngineSpec("transformers", "bf16")
    only_vllm = _card(engines=(EngineSpec("vllm", "bf16"),))
    with pytest.raises(UnsupportedEngine, match=r"vllm-bf16.*transformers-bf16"):
        choose_engine(only_vllm, tf)
    with pytest.raises(UnsupportedEngine, match="not among"):
        choose_engine(_card(), both, "vllm")
    with pytest.raises(UnsupportedEngine, match="fp32"):
        choose_engine(_card(engines=(EngineSpec("transformers", "fp32"),)), tf)
    assert EngineSpec.parse("transformers-bf16") == EngineSpec("transformers", "bf16")
    with pytest.raises(Exception, match="FAMILY-DTYPE"):
        EngineSpec.parse("transformers")


def test_architecture_digest_ignores_dtype_and_versions() -> None:
    cfg = {"hidden_size": 128, "rms_norm_eps": 1e-5, "dtype": "bfloat16"}
    same = {"rms_norm_eps": 1e-5, "hidden_size": 128, "transformers_version": "9"}
    assert architecture_digest(cfg) == architecture_digest(same)
    assert architecture_digest(cfg) != architecture_digest({**cfg, "hidden_size": 256})


def test_digits_task_digest_is_pinned() -> None:
    from rollout.task import DEFAULT_TASK, task_data_digest

    assert task_data_digest() == "05f0a6230a3729c109e790cf77dad7bca1dc728ed057e86bede8fdb33373dc1d"
    assert DEFAULT_TASK.name == "digits/1"


def test_pure_import() -> None:
    code = (
        "import sys, shardcast.wire.runcard, rollout.task; "
        "bad = [m for m in ('torch', 'libp2p', 'transformers') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


MIRRORS = ("http://127.0.0.1:8080", "http://mirror.example.org/runs/a")


def test_mirrors_are_signed_and_optional() -> None:
    plain = _card()
    assert "mirrors" not in plain.to_obj()  # old cards keep their bytes and digest
    old_body = dict(plain.to_obj())
    assert RunCard.from_obj(old_body) == plain  # a card without the field reads as before
    card = _card(mirrors=MIRRORS)
    assert card.to_obj()["mirrors"] == list(MIRRORS)
    assert card.digest() != plain.digest()
    signed = sign_card(card, TRAINER)
    back = SignedRunCard.decode(signed.encode(), trainer=TRAINER.peer_id)
    assert back.card.mirrors == MIRRORS
    evil = card.to_obj()
    evil["mirrors"] = ["http://evil.example.org"]
    with pytest.raises(BadRunCardSignature):
        SignedRunCard.decode(_sealed_with(evil, signed), trainer=TRAINER.peer_id)
    # a change of mirrors is a change of rules: a new card version
    first = sign_card(plain, TRAINER)
    assert next_card(card, first, TRAINER).version == first.version + 1
    assert next_card(card, next_card(card, first, TRAINER), TRAINER).version == 2


@pytest.mark.parametrize(
    ("mirrors", "match"),
    [
        ([], "list of 1 to 8"),
        ([f"http://m{i}.example.org" for i in range(9)], "list of 1 to 8"),
        ("http://m.example.org", "list of 1 to 8"),
        (["http://m.example.org/" + "a" * 300], "257 chars|<= 256"),
        ([7], "not a URL"),
        (["https://m.example.org"], "http://HOST"),
        (["http://0.0.0.0:80"], "unspecified"),
        (["http://m.example.org/?x=1"], "no query"),
        (["http://m.example.org/"], "normal form"),
        (["http://m.example.org", "http://m.example.org"], "twice"),
    ],
)
def test_bad_mirrors_are_named(mirrors: object, match: str) -> None:
    body = _card().to_obj()
    body["mirrors"] = mirrors
    with pytest.raises(MalformedRunCard, match=match) as info:
        RunCard.from_obj(body, "relay")
    assert info.value.field == "mirrors"
    with pytest.raises(MalformedRunCard):
        _card(mirrors=tuple(mirrors) if isinstance(mirrors, list) and mirrors else ("x",))


def _thresholds(scale: float = 1.0) -> dict[str, float]:
    return {
        k: round(0.123 * (i + 1) * scale, 4) for i, k in enumerate(sorted(PROFILE_THRESHOLD_KEYS))
    }


def test_validator_profile_is_signed_and_optional() -> None:
    """The thresholds a run judges with ride on the signed card; cards without them keep
    their bytes, and a node reads both."""
    plain = _card()
    assert "validator_profile" not in plain.to_obj()
    assert RunCard.from_obj(dict(plain.to_obj())) == plain
    prof = CardProfile.of("ef" * 32, {"transformers-bf16": _thresholds()})
    card = _card(validator_profile=prof)
    body = card.to_obj()["validator_profile"]
    assert body["digest"] == "ef" * 32
    assert body["engines"]["transformers-bf16"]["replay_margin"] == repr(
        _thresholds()["replay_margin"]
    )
    signed = sign_card(card, TRAINER)
    back = SignedRunCard.decode(signed.encode(), trainer=TRAINER.peer_id)
    assert back.card == card
    assert back.card.validator_profile is not None
    assert back.card.validator_profile.thresholds() == {"transformers-bf16": _thresholds()}
    evil = card.to_obj()
    evil["validator_profile"]["engines"]["transformers-bf16"]["replay_margin"] = "9.0"
    with pytest.raises(BadRunCardSignature):
        SignedRunCard.decode(_sealed_with(evil, signed), trainer=TRAINER.peer_id)
    # new thresholds are new rules: a new card version
    first = sign_card(plain, TRAINER)
    assert next_card(card, first, TRAINER).version == first.version + 1
    # the legacy format carries it too
    legacy = SignedRunCard.decode(canonical_json(_legacy(card)), trainer=TRAINER.peer_id)
    assert legacy.card == card


def test_validator_profile_of_every_engine_fits_the_bounds() -> None:
    engines = tuple(EngineSpec(f"engine{i}", "bf16") for i in range(MAX_ENGINES))
    prof = CardProfile.of("ef" * 32, {e.id: _thresholds(1e6 / 7) for e in engines})
    card = _card(engines=engines, validator_profile=prof, mirrors=MIRRORS)
    data = sign_card(card, TRAINER).encode()
    assert len(data) <= MAX_CARD_BYTES
    assert SignedRunCard.decode(data, trainer=TRAINER.peer_id).card == card


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (lambda p: p.update(digest="xyz"), "validator_profile.digest"),
        (lambda p: p.update(engines={}), "validator_profile.engines"),
        (lambda p: p.update(extra=1), "validator_profile"),
        (
            lambda p: p["engines"].update({"vllm-bf16": p["engines"]["transformers-bf16"]}),
            "validator_profile.engines",
        ),
        (
            lambda p: p["engines"]["transformers-bf16"].pop("replay_margin"),
            "validator_profile.engines.transformers-bf16",
        ),
        (
            lambda p: p["engines"]["transformers-bf16"].update(replay_margin="0.10"),
            "validator_profile.engines.transformers-bf16.replay_margin",
        ),
        (
            lambda p: p["engines"]["transformers-bf16"].update(replay_margin=0.1),
            "validator_profile.engines.transformers-bf16.replay_margin",
        ),
        (
            lambda p: p["engines"]["transformers-bf16"].update(replay_margin="-1.0"),
            "validator_profile.engines.transformers-bf16.replay_margin",
        ),
        (
            lambda p: p["engines"]["transformers-bf16"].update(replay_margin="nan"),
            "validator_profile.engines.transformers-bf16.replay_margin",
        ),
    ],
)
def test_bad_validator_profiles_are_named(edit: Any, field: str) -> None:
    body = _card(
        validator_profile=CardProfile.of("ef" * 32, {"transformers-bf16": _thresholds()})
    ).to_obj()
    edit(body["validator_profile"])
    with pytest.raises(MalformedRunCard) as info:
        RunCard.from_obj(body, "relay")
    assert info.value.field == field, info.value
