"""Manifest v2 (header + signed parts): round trip, canonical bytes, signatures, tampering,
hostile input."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from p2p import envelope
from p2p.envelope import Kind
from p2p.errors import BadSignature, IntegrityError, UntrustedSigner
from p2p.identity import Identity
from shardcast.publish.plan import build_manifest
from shardcast.wire.canonical import canonical_json
from shardcast.wire.manifest import (
    HEADER_DOMAIN,
    PART_DOMAIN,
    Header,
    Manifest,
    ManifestError,
    Part,
    SignedPart,
    check_file_name,
    decode_part,
    sign_header,
    sign_part,
)
from tests.helpers import TRAINER, make_checkpoint, trust

SIZES = {"model-00001-of-00002.safetensors": 5000, "model-00002-of-00002.safetensors": 3001}


@pytest.fixture
def manifest(tmp_path: Path) -> Manifest:
    ckpt = make_checkpoint(tmp_path / "ckpt", SIZES)
    return build_manifest(ckpt, "run1", 3, TRAINER, shard_size=1024, shards_per_part=3)


def test_round_trip_and_canonical(manifest: Manifest, tmp_path: Path) -> None:
    assert manifest.complete
    assert manifest.header.n_parts == 4  # config 1 + 5 + 3 + index 1 = 10 shards, 3 per part
    data = manifest.encode()
    back = Manifest.decode(data, trust=trust())
    assert back.encode() == data
    assert back.digest == manifest.digest
    assert b" " not in data
    assert b"\n" not in data
    obj = json.loads(data)
    assert list(obj) == sorted(obj)
    # every shard's digest and every file digest are present
    on_disk = {p.name: p.stat().st_size for p in (tmp_path / "ckpt").iterdir()}
    assert {f.name: f.size for f in manifest.header.files} == on_disk
    for f in manifest.header.files:
        assert manifest.file_digest(f.name) is not None
    covered = {}
    for s in manifest.header.shards:
        covered[s.file] = covered.get(s.file, 0) + s.length
        assert len(manifest.shard(s.index).digest) == 64
    assert covered == {n: sz for n, sz in on_disk.items() if sz}


def test_sealed_bytes_are_the_verified_ones_and_encode_once(manifest: Manifest) -> None:
    """A decoded part or header serves (and stores) the envelope bytes it was verified from,
    which are what encoding it again gives; a signed one encodes once."""
    header = manifest.signed_header
    for k, signed in manifest.parts.items():
        data = signed.sealed()
        assert signed.sealed() is data  # encoded once
        back = decode_part(data, header.header, trust=trust())
        assert back.sealed() == data
        assert back == signed
        fresh = SignedPart(back.part, back.signer, back.signature)
        assert fresh.sealed() == data, k  # the verified bytes are the canonical encoding
    data = header.sealed()
    back_header = Manifest.decode(manifest.encode(), trust=trust()).signed_header
    assert back_header.sealed() == data
    assert header.sealed() is data


def test_header_digest_is_the_identity(manifest: Manifest) -> None:
    h = manifest.header
    permuted = dict(reversed(list(h.to_obj().items())))
    assert Header.from_obj(permuted).digest() == manifest.digest


def _resealed(kind: Kind, sealed: bytes, mutate: Callable[[dict[str, Any]], None]) -> str:
    """``sealed`` with its JSON body mutated and the original signature kept, base64."""
    env = cbor2.loads(sealed)
    body = json.loads(env["body"])
    mutate(body)
    raw = envelope.encode_sealed(kind, canonical_json(body), env["signer"], env["sig"])
    return base64.b64encode(raw).decode()


def test_tampered_header_or_part_detected(manifest: Manifest) -> None:
    doc = json.loads(manifest.encode())
    assert doc["v"] == 3
    doc["header"] = _resealed(
        Kind.MANIFEST_HEADER, manifest.signed_header.sealed(), lambda b: b.update(step=4)
    )
    with pytest.raises(BadSignature):
        Manifest.decode(json.dumps(doc).encode(), trust=trust())
    doc = json.loads(manifest.encode())
    doc["parts"][1] = _resealed(
        Kind.MANIFEST_PART,
        manifest.parts[1].sealed(),
        lambda b: b["shards"][0].__setitem__(0, "0" * 64),
    )
    with pytest.raises(IntegrityError):
        Manifest.decode(json.dumps(doc).encode(), trust=trust())
    # a part sealed as a header (or the reverse) is refused by its kind
    doc = json.loads(manifest.encode())
    doc["header"] = doc["parts"][0]
    with pytest.raises(ManifestError, match="kind"):
        Manifest.decode(json.dumps(doc).encode(), trust=trust())
    doc = json.loads(manifest.encode())
    doc["header"] = doc["header"].rstrip("=") + "A"  # not canonical base64
    with pytest.raises(ManifestError):
        Manifest.decode(json.dumps(doc).encode(), trust=trust())


def _legacy_document(manifest: Manifest) -> bytes:
    """``manifest`` in the old format (signed under the v2 domains), as stored before."""

    def env(body: bytes, domain: str) -> dict[str, Any]:
        sig = TRAINER.sign(domain, body)
        return {"body": json.loads(body), "signer": TRAINER.peer_id, "signature": sig.hex()}

    return canonical_json(
        {
            "header": env(manifest.header.canonical_bytes(), HEADER_DOMAIN),
            "parts": [
                env(manifest.parts[k].part.canonical_bytes(), PART_DOMAIN)
                for k in sorted(manifest.parts)
            ],
        }
    )


def test_old_format_still_read_and_kept(manifest: Manifest) -> None:
    data = _legacy_document(manifest)
    back = Manifest.decode(data, trust=trust())
    assert back.signed_header.legacy
    assert back.digest == manifest.digest  # the version's identity does not change
    assert back.encode() == data  # written and served in its own format
    one = back.parts[1].encode()
    assert one.startswith(b"{")
    assert decode_part(one, back.header, trust=trust()) == back.parts[1]
    # a new-format part cannot join an old-format header (nor the reverse)
    with pytest.raises(ManifestError, match="format"):
        Manifest(back.signed_header).add_part(manifest.parts[0])
    with pytest.raises(ManifestError, match="format"):
        Manifest(manifest.signed_header).add_part(back.parts[0])
    # old-format signatures are checked too
    doc = json.loads(data)
    doc["header"]["body"]["step"] = 4
    with pytest.raises(IntegrityError):
        Manifest.decode(json.dumps(doc).encode(), trust=trust())


def test_untrusted_signer(manifest: Manifest) -> None:
    mallory = Identity.from_seed("mallory")
    forged = Manifest(sign_header(manifest.header, mallory))
    with pytest.raises(UntrustedSigner):
        Manifest.decode(forged.encode(), trust=trust())
    # a part re-signed by someone else, attached to the genuine header
    part = manifest.parts[0].part
    bad = sign_part(part, mallory)
    with pytest.raises(UntrustedSigner):
        decode_part(bad.encode(), manifest.header, trust=trust())


def test_part_of_another_version_rejected(manifest: Manifest, tmp_path: Path) -> None:
    other = build_manifest(
        make_checkpoint(tmp_path / "other", SIZES, seed=9),
        "run1",
        3,
        TRAINER,
        shard_size=1024,
        shards_per_part=3,
    )
    with pytest.raises(ManifestError, match="another version"):
        decode_part(other.parts[0].encode(), manifest.header, trust=trust())


def test_equivocating_part_rejected(manifest: Manifest) -> None:
    p = manifest.parts[0].part
    twisted = Part(
        p.run_id,
        p.step,
        p.header_digest,
        p.index,
        ("1" * 64, *p.digests[1:]),
        p.encodings,
        p.file_digests,
    )
    with pytest.raises(ManifestError, match="two different"):
        manifest.add_part(sign_part(twisted, TRAINER))


@pytest.mark.parametrize(
    "name",
    ["../x", "/etc/passwd", "a/b", "..", ".hidden", "", "manifest.json", "x" * 300, "a\\b", "ok\0"],
)
def test_unsafe_names_rejected(name: str) -> None:
    with pytest.raises(ManifestError):
        check_file_name(name)


def test_escaping_name_in_header_rejected(manifest: Manifest) -> None:
    obj = manifest.header.to_obj()
    obj["files"][0]["name"] = "../../evil"
    with pytest.raises(ManifestError, match="unsafe"):
        Header.from_obj(obj)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(v=1),
        lambda o: o.update(step=-1),
        lambda o: o.update(step=True),
        lambda o: o.update(shards_per_part=0),
        lambda o: o["files"].reverse(),
        lambda o: o["files"][0].update(size=-1),
        lambda o: o.update(files=[]),
        lambda o: o.update(extra=1),
        lambda o: o.update(base_step=7),  # base must be older, and come with a digest
    ],
)
def test_inconsistent_header_rejected(manifest: Manifest, mutate: object) -> None:
    obj = manifest.header.to_obj()
    mutate(obj)  # type: ignore[operator]
    with pytest.raises(ManifestError):
        Header.from_obj(obj)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o["shards"].pop(),  # wrong shard count
        lambda o: o["shards"][0].__setitem__(0, "XYZ"),  # bad digest
        lambda o: o["shards"][0][1].append(["xor-zstd", 10, "a" * 64]),  # delta without base
        lambda o: o["shards"][0][1].append(["gzip", 10, "a" * 64]),
        lambda o: o.update(files={}),  # missing file digest
        lambda o: o.update(part=99),
    ],
)
def test_inconsistent_part_rejected(manifest: Manifest, mutate: object) -> None:
    obj = manifest.parts[2].part.to_obj()
    mutate(obj)  # type: ignore[operator]
    with pytest.raises(ManifestError):
        Part.from_obj(obj, manifest.header)


def test_garbage_and_oversize() -> None:
    for data in (b"", b"{", b"[]", b'{"header": 1, "parts": []}', b"\xff\xfe", b'{"a":1}'):
        with pytest.raises(ManifestError):
            Manifest.decode(data, trust=trust())
    with pytest.raises(ManifestError, match="exceeds"):
        Manifest.decode(b"x" * 100, trust=trust(), max_bytes=10)


@settings(max_examples=200)
@given(st.binary(max_size=300))
def test_fuzz_never_crashes(data: bytes) -> None:
    with pytest.raises((ManifestError, IntegrityError)):
        Manifest.decode(data, trust=trust())


def test_byte_at_a_time_truncation(manifest: Manifest) -> None:
    data = manifest.encode()
    for cut in range(0, len(data), max(1, len(data) // 60)):
        with pytest.raises((ManifestError, IntegrityError)):
            Manifest.decode(data[:cut], trust=trust())


def test_incomplete_document_is_valid_and_grows(manifest: Manifest) -> None:
    partial = Manifest(manifest.signed_header)
    partial.add_part(manifest.parts[1])
    back = Manifest.decode(partial.encode(), trust=trust())
    assert not back.complete
    assert sorted(back.parts) == [1]
    assert not back.known(0)
    assert back.known(3)
    assert isinstance(manifest.parts[0], SignedPart)
