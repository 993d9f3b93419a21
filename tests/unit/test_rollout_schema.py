"""Rollout batch and announcement encoding: round trips, bounds, signatures, hostile input."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p import envelope, wire
from p2p.envelope import Kind
from p2p.errors import IntegrityError, MalformedEnvelope, RemoteProtocolError, UntrustedSigner
from p2p.identity import Identity
from rollout.exchange import Ack
from rollout.reasons import AckReason, AckStatus
from rollout.reputation import Reputation, ReputationConfig
from rollout.schema import (
    ANNOUNCE_KIND,
    Group,
    RolloutAnnouncement,
    RolloutBatch,
    Sample,
    batch_id_for,
)

PEER = Identity.from_seed("schema-peer")


def _batch(n_groups: int = 2, ids: tuple[int, ...] = (5, 6, 2)) -> RolloutBatch:
    sample = Sample(ids, tuple(-0.5 for _ in ids), 0.25, "stop", b"\x01" * 258)
    groups = tuple(Group(i, (1, 40 + i), (sample, sample)) for i in range(n_groups))
    return RolloutBatch("run", PEER.peer_id, 3, "ab" * 32, "digits/1", n_groups, 7, 1.0, 16, groups)


def test_round_trip_is_canonical() -> None:
    b = _batch()
    data = b.encode()
    back = RolloutBatch.decode(data, vocab_size=128)
    assert back == b
    assert back.encode() == data


def test_engine_id_round_trip_and_schema_1() -> None:
    b = dataclasses.replace(_batch(), engine="vllm-bf16")
    assert RolloutBatch.decode(b.encode(), vocab_size=128).engine == "vllm-bf16"
    old = wire.decode(b.encode(), max_bytes=1 << 20)
    old["v"] = 1
    del old["engine"]
    # a batch of a peer from before engine ids decodes, naming no engine (wrong_run later)
    assert RolloutBatch.decode(wire.encode(old), vocab_size=128).engine == ""
    for bad in ({"engine": None}, {"engine": "x" * 41}):
        obj = wire.decode(b.encode(), max_bytes=1 << 20)
        obj.update(bad)
        with pytest.raises(RemoteProtocolError):
            RolloutBatch.decode(wire.encode(obj), vocab_size=128)
    obj = wire.decode(b.encode(), max_bytes=1 << 20)
    del obj["engine"]
    with pytest.raises(RemoteProtocolError):
        RolloutBatch.decode(wire.encode(obj), vocab_size=128)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(v=3),
        lambda o: o["groups"][0]["samples"][0].update(ids=[500]),  # token id out of vocab
        lambda o: o["groups"][0]["samples"][0].update(ids=[-1]),
        lambda o: o["groups"][0]["samples"][0].update(lp=[0.5, 0.1, 0.2]),  # logprob > 0
        lambda o: o["groups"][0]["samples"][0].update(lp=[float("nan")] * 3),
        lambda o: o["groups"][0]["samples"][0].update(lp=[-1.0]),  # length mismatch
        lambda o: o["groups"][0]["samples"][0].update(fin="maybe"),
        lambda o: o["groups"][0]["samples"][0].update(ids=list(range(17)), lp=[-1.0] * 17),  # > cap
        lambda o: o["groups"][0].update(prompt=[]),
        lambda o: o["groups"][0].update(samples=[]),
        lambda o: o.update(temperature=0.0),
        lambda o: o.pop("submitter"),
        lambda o: o.update(policy_step=True),
    ],
)
def test_bounds_rejected(mutate: object) -> None:
    obj = wire.decode(_batch().encode(), max_bytes=1 << 20)
    mutate(obj)  # type: ignore[operator]
    with pytest.raises(RemoteProtocolError):
        RolloutBatch.decode(wire.encode(obj), vocab_size=128)


@settings(max_examples=200)
@given(st.binary(max_size=400))
def test_garbage_never_crashes(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        RolloutBatch.decode(data, vocab_size=128)


def test_announcement_signature_and_payload_binding() -> None:
    payload = _batch().encode()
    ann = RolloutAnnouncement.for_payload(PEER, "run", 3, payload)
    back = RolloutAnnouncement.decode(ann.encode())
    assert back == ann
    back.check_payload(payload)
    with pytest.raises(IntegrityError):
        back.check_payload(payload + b"x")
    with pytest.raises(IntegrityError):
        back.check_payload(payload[:-1] + bytes([payload[-1] ^ 1]))
    # a third party re-signing someone else's announcement under the submitter's name
    mallory = Identity.from_seed("mallory")
    forged = dataclasses.replace(
        ann, signature=envelope.sign(ANNOUNCE_KIND, ann._body(), mallory.key)
    )
    with pytest.raises(IntegrityError):
        RolloutAnnouncement.decode(forged.encode())
    # ... or sealing it with its own key: a valid envelope whose signer is not the submitter
    with pytest.raises(UntrustedSigner):
        RolloutAnnouncement.decode(envelope.seal(ANNOUNCE_KIND, ann._body(), mallory.key))
    # the same body sealed as another kind of message is refused
    with pytest.raises(MalformedEnvelope):
        RolloutAnnouncement.decode(envelope.seal(Kind.RUN_CARD, ann._body(), PEER.key))
    # tampered step
    env = wire.decode(ann.encode(), max_bytes=4096)
    body = wire.decode(env["body"], max_bytes=4096)
    body["step"] = 4
    env["body"] = wire.encode(body)
    with pytest.raises(IntegrityError):
        RolloutAnnouncement.decode(wire.encode(env))


def test_ack_round_trip_and_validation() -> None:
    a = Ack("ab" * 16, AckStatus.ACCEPTED, AckReason.OK, 3, 0)
    assert Ack.decode(a.encode()) == a
    assert a.final
    assert not Ack("x", AckStatus.RETRY, AckReason.BUSY).final
    bad = wire.decode(a.encode(), max_bytes=4096)
    bad["status"] = "maybe"
    with pytest.raises(RemoteProtocolError):
        Ack.decode(wire.encode(bad))


def test_reputation_honest_never_loses_and_forger_is_refused() -> None:
    r = Reputation(ReputationConfig())
    honest, forger = "12D3KooWhonest", "12D3KooWforger"
    for _ in range(10):
        r.record(honest, True, "ok")
    assert r.score(honest) == 1.0
    r.record(forger, False, "toploc")
    assert not r.refused(forger)
    r.record(forger, False, "toploc")
    assert r.refused(forger)
    assert r.statistics().refused == (forger,)
    # a stale honest batch costs little and is recovered by the next accepted one
    r.record(honest, False, "stale_step")
    r.record(honest, True, "ok")
    assert r.score(honest) == 1.0


def test_rate_limit_is_per_submitter() -> None:
    r = Reputation(ReputationConfig(rate_per_s=1.0, burst=3.0))
    assert [r.allow_announcement("a", 0.0) for _ in range(4)] == [True, True, True, False]
    assert r.allow_announcement("b", 0.0)
    assert r.allow_announcement("a", 1.0)  # refilled one token
    assert r.statistics().rate_limited == 1


def test_batch_id_binds_the_submitter() -> None:
    """Two submitters announcing the same bytes name two batches; an id that does not bind
    the submitter (the old ``digest[:32]``) is refused."""
    a, b = Identity.from_seed("bind-a"), Identity.from_seed("bind-b")
    ann_a = RolloutAnnouncement.for_payload(a, "run", 1, b"same bytes")
    ann_b = RolloutAnnouncement.for_payload(b, "run", 1, b"same bytes")
    assert ann_a.digest == ann_b.digest
    assert ann_a.batch_id != ann_b.batch_id == batch_id_for(b.peer_id, ann_b.digest)
    assert RolloutAnnouncement.decode(ann_a.encode()).batch_id == ann_a.batch_id
    old = RolloutAnnouncement("run", ann_a.digest[:32], ann_a.digest, ann_a.size, 1, a.peer_id, b"")
    forged = RolloutAnnouncement(
        *[getattr(old, f) for f in ("run_id", "batch_id", "digest", "size", "step", "submitter")],
        envelope.sign(ANNOUNCE_KIND, old._body(), a.key),
    )
    with pytest.raises(RemoteProtocolError, match="batch_id"):
        RolloutAnnouncement.decode(forged.encode())
