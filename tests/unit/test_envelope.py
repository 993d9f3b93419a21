"""The signed-envelope layer (p2p/envelope.py), libp2p-free keys (p2p/keys.py) and the field
validators (p2p/fields.py)."""

from __future__ import annotations

import subprocess
import sys

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p import envelope, fields, keys
from p2p.envelope import ANY_SIGNER, Kind
from p2p.errors import (
    BadSignature,
    FieldError,
    IntegrityError,
    MalformedEnvelope,
    MessageTooLarge,
    UntrustedSigner,
)

ALICE = keys.SigningKey(bytes(range(32)))
BOB = keys.SigningKey(bytes(range(1, 33)))


def test_peer_id_matches_libp2p() -> None:
    from libp2p.crypto.ed25519 import Ed25519PrivateKey
    from libp2p.peer.id import ID

    from p2p.identity import Identity

    for seed in (bytes(32), bytes(range(32)), b"\xff" * 32, bytes(range(100, 132))):
        priv = Ed25519PrivateKey.new(seed)
        ours = keys.SigningKey(seed)
        theirs = ID.from_pubkey(priv.get_public_key())
        assert ours.peer_id == theirs.to_base58()
        assert ours.public_key == priv.get_public_key().to_bytes()
        assert keys.public_key_of(theirs.to_base58()) == ours.public_key
        # the same signature bytes (Ed25519 is deterministic)
        assert ours.sign_raw(b"m") == priv.sign(b"m")
    ident = Identity.from_seed("envelope")
    assert ident.key.peer_id == ident.peer_id
    assert ident.sign("d", b"x") == ident.key_pair.private_key.sign(keys.domain_message("d", b"x"))


@pytest.mark.parametrize(
    "bad",
    ["", "x", "12D3KooW", "0OIl", "Qm" + "a" * 44, "1" + ALICE.peer_id, ALICE.peer_id[:-1], "é"],
)
def test_bad_peer_ids(bad: str) -> None:
    assert not keys.is_valid_peer_id(bad)
    with pytest.raises(IntegrityError):
        keys.public_key_of(bad)


def test_verify_domain() -> None:
    sig = ALICE.sign("announce/v1", b"body")
    keys.verify(ALICE.peer_id, "announce/v1", b"body", sig)
    with pytest.raises(IntegrityError):
        keys.verify(ALICE.peer_id, "finished/v1", b"body", sig)
    with pytest.raises(IntegrityError):
        keys.verify(BOB.peer_id, "announce/v1", b"body", sig)
    with pytest.raises(IntegrityError):
        keys.verify(ALICE.peer_id, "announce/v1", b"body", sig[:10])


def test_seal_open_roundtrip() -> None:
    data = envelope.seal(Kind.RUN_CARD, b"{}", ALICE)
    assert data == envelope.seal(Kind.RUN_CARD, b"{}", ALICE)  # deterministic
    opened = envelope.open(Kind.RUN_CARD, data, ALICE.peer_id, 1024)
    assert (opened.signer, opened.body, opened.kind) == (ALICE.peer_id, b"{}", Kind.RUN_CARD)
    assert envelope.encode_sealed(Kind.RUN_CARD, b"{}", ALICE.public_key, opened.signature) == data
    assert envelope.open(Kind.RUN_CARD, data, {BOB.peer_id, ALICE.peer_id}, 1024) == opened
    assert envelope.open(Kind.RUN_CARD, data, ANY_SIGNER, 1024) == opened
    assert envelope.peek_kind(data, max_bytes=1024) is Kind.RUN_CARD


def test_domain_tag_binds_the_kind() -> None:
    data = envelope.seal(Kind.VERSION_ANNOUNCEMENT, b"x", ALICE)
    with pytest.raises(MalformedEnvelope, match="kind"):
        envelope.open(Kind.RUN_FINISHED, data, ANY_SIGNER, 1024)
    # relabelling the kind breaks the signature
    obj = cbor2.loads(data)
    obj["kind"] = Kind.RUN_FINISHED.value
    with pytest.raises(BadSignature):
        envelope.open(Kind.RUN_FINISHED, cbor2.dumps(obj, canonical=True), ANY_SIGNER, 1024)
    # and an old-scheme signature over the same body does not verify as an envelope
    obj["sig"] = ALICE.sign("run-finished", b"x")
    with pytest.raises(BadSignature):
        envelope.open(Kind.RUN_FINISHED, cbor2.dumps(obj, canonical=True), ANY_SIGNER, 1024)


def test_trust_rule() -> None:
    data = envelope.seal(Kind.MANIFEST_HEADER, b"h", BOB)
    with pytest.raises(UntrustedSigner):
        envelope.open(Kind.MANIFEST_HEADER, data, ALICE.peer_id, 1024)
    with pytest.raises(UntrustedSigner):
        envelope.open(Kind.MANIFEST_HEADER, data, frozenset(), 1024)


def test_size_bound() -> None:
    data = envelope.seal(Kind.MANIFEST_PART, b"x" * 1000, ALICE)
    with pytest.raises(MessageTooLarge):
        envelope.open(Kind.MANIFEST_PART, data, ANY_SIGNER, 999)
    with pytest.raises(MessageTooLarge):
        envelope.open(Kind.MANIFEST_PART, b"\0" * 5000, ANY_SIGNER, 999)


def test_strict_decoding() -> None:
    data = envelope.seal(Kind.RUN_CARD, b"body", ALICE)
    obj = cbor2.loads(data)
    variants = [
        {**obj, "extra": 1},
        {k: v for k, v in obj.items() if k != "sig"},
        {**obj, "v": 2},
        {**obj, "v": True},
        {**obj, "kind": "nope"},
        {**obj, "signer": obj["signer"][:31]},
        {**obj, "sig": obj["sig"] + b"\0"},
        {**obj, "body": "body"},
    ]
    for v in variants:
        with pytest.raises(MalformedEnvelope):
            envelope.open(Kind.RUN_CARD, cbor2.dumps(v, canonical=True), ANY_SIGNER, 1024)
    # the same map in a non-canonical encoding (unsorted keys) is refused
    with pytest.raises(MalformedEnvelope, match="canonical"):
        envelope.open(Kind.RUN_CARD, cbor2.dumps(dict(reversed(obj.items()))), ANY_SIGNER, 1024)
    for cut in range(len(data)):
        with pytest.raises(MalformedEnvelope):
            envelope.open(Kind.RUN_CARD, data[:cut], ANY_SIGNER, 1024)
    flipped = bytearray(data)
    flipped[-1] ^= 1
    with pytest.raises(BadSignature):
        envelope.open(Kind.RUN_CARD, bytes(flipped), ANY_SIGNER, 1024)


def test_fields() -> None:
    msg = {"i": 5, "b": True, "s": "abc", "x": b"\0" * 4, "l": [1, 2], "f": 1, "d": "0" * 64}
    assert fields.need_int(msg, "i", 0, 9) == 5
    assert fields.need_float(msg, "f", 0, 2) == 1.0
    assert fields.need_digest(msg, "d") == "0" * 64
    assert fields.opt_int(msg, "missing", 0, 9, 7) == 7
    for call in (
        lambda: fields.need_int(msg, "b", 0, 9),  # bool is not an int
        lambda: fields.need_int(msg, "i", 6, 9),
        lambda: fields.need_int(msg, "missing", 0, 9),
        lambda: fields.need_str(msg, "s", 2),
        lambda: fields.need_bytes(msg, "x", 8, exact=3),
        lambda: fields.need_list(msg, "l", 1),
        lambda: fields.need_digest(msg, "s"),
        lambda: fields.need_version(msg, 1, "thing"),
        lambda: fields.need_map(msg, "i", {"a"}),
    ):
        with pytest.raises(FieldError):
            call()

    class Custom(FieldError):
        pass

    with pytest.raises(Custom) as info:
        fields.need_int(msg, "s", 0, 1, "peer", error=Custom, prefix="outer.")
    assert info.value.field == "outer.s"


def test_imports_without_libp2p() -> None:
    """The envelope, keys, validators and the codecs/verifiers built on them never import
    libp2p (it costs a second or more)."""
    modules = [
        "p2p.envelope",
        "p2p.trust",
        "shardcast.wire.codecs",
        "shardcast.wire.manifest",
        "shardcast.wire.messages",
        "shardcast.wire.runcard",
        "shardcast.wire.finish",
        "rollout.schema",
    ]
    code = (
        "import sys\n"
        f"for m in {modules!r}: __import__(m)\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] == 'libp2p')\n"
        "assert not bad, bad[:5]\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@settings(max_examples=100)
@given(
    kind=st.sampled_from(list(Kind)),
    body=st.binary(max_size=300),
    seed=st.binary(min_size=32, max_size=32),
)
def test_round_trip_any_body(kind: Kind, body: bytes, seed: bytes) -> None:
    key = keys.SigningKey(seed)
    data = envelope.seal(kind, body, key)
    opened = envelope.open(kind, data, key.peer_id, 300)
    assert (opened.signer, opened.body) == (key.peer_id, body)
    assert envelope.peek_signer(data, max_bytes=300) == key.peer_id
    for other in Kind:
        if other is not kind:
            with pytest.raises(MalformedEnvelope):
                envelope.open(other, data, key.peer_id, 300)
