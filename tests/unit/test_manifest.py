"""Manifest: round trip, canonical bytes, signature, tampering, hostile input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from p2p.errors import IntegrityError, UntrustedSigner
from p2p.identity import Identity
from shardcast.manifest import (
    Manifest,
    ManifestError,
    SignedManifest,
    check_file_name,
    sign_manifest,
)
from shardcast.plan import build_manifest
from tests.helpers import TRAINER, make_checkpoint, trust

SIZES = {"model-00001-of-00002.safetensors": 5000, "model-00002-of-00002.safetensors": 3001}


@pytest.fixture
def signed(tmp_path: Path) -> SignedManifest:
    ckpt = make_checkpoint(tmp_path / "ckpt", SIZES)
    return sign_manifest(build_manifest(ckpt, "run1", 3, shard_size=1024), TRAINER)


def test_round_trip_and_canonical(signed: SignedManifest) -> None:
    data = signed.encode()
    back = SignedManifest.decode(data, trust=trust())
    assert back == signed
    assert back.encode() == data
    # canonical: sorted keys, no whitespace
    assert b" " not in data
    assert b"\n" not in data
    obj = json.loads(data)
    assert list(obj) == sorted(obj)
    # re-serialising a permuted object yields the same bytes
    permuted = json.dumps(dict(reversed(list(obj["manifest"].items()))))
    assert (
        Manifest.from_obj(json.loads(permuted)).canonical_bytes()
        == signed.manifest.canonical_bytes()
    )
    assert signed.digest == back.manifest.digest()


def test_shards_tile_files(signed: SignedManifest, tmp_path: Path) -> None:
    m = signed.manifest
    on_disk = {p.name: p.stat().st_size for p in (tmp_path / "ckpt").iterdir()}
    assert {f.name: f.size for f in m.files} == on_disk
    assert m.total_bytes == sum(on_disk.values())
    for f in m.files:
        shards = [s for s in m.shards if s.file == f.name]
        assert sum(s.length for s in shards) == f.size
    assert [s.index for s in m.shards] == list(range(len(m.shards)))


def test_tampering_detected(signed: SignedManifest) -> None:
    obj = json.loads(signed.encode())
    obj["manifest"]["step"] = 4
    with pytest.raises(IntegrityError):
        SignedManifest.decode(json.dumps(obj).encode(), trust=trust())
    obj = json.loads(signed.encode())
    obj["manifest"]["shards"][0][3] = "0" * 64
    with pytest.raises(IntegrityError):
        SignedManifest.decode(json.dumps(obj).encode(), trust=trust())


def test_untrusted_signer(signed: SignedManifest) -> None:
    other = Identity.from_seed("mallory")
    forged = sign_manifest(signed.manifest, other)
    with pytest.raises(UntrustedSigner):
        SignedManifest.decode(forged.encode(), trust=trust())


@pytest.mark.parametrize(
    "name",
    ["../x", "/etc/passwd", "a/b", "..", ".hidden", "", "manifest.json", "x" * 300, "a\\b", "ok\0"],
)
def test_unsafe_names_rejected(name: str) -> None:
    with pytest.raises(ManifestError):
        check_file_name(name)


def test_escaping_name_in_manifest_rejected(signed: SignedManifest) -> None:
    obj = signed.manifest.to_obj()
    obj["files"][0]["name"] = "../../evil"
    with pytest.raises(ManifestError, match="unsafe"):
        Manifest.from_obj(obj)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda o: o.update(v=2),
        lambda o: o.update(step=-1),
        lambda o: o.update(step=True),
        lambda o: o["shards"].pop(),  # gap at the end
        lambda o: o["shards"].__setitem__(0, o["shards"][1]),  # overlap / wrong offset
        lambda o: o["shards"][0].__setitem__(2, 0),
        lambda o: o["files"].reverse(),
        lambda o: o["files"][0].__setitem__("digest", "XYZ"),
        lambda o: o.update(files=[]),
    ],
)
def test_inconsistent_manifest_rejected(signed: SignedManifest, mutate: object) -> None:
    obj = signed.manifest.to_obj()
    mutate(obj)  # type: ignore[operator]
    with pytest.raises(ManifestError):
        Manifest.from_obj(obj)


def test_garbage_and_oversize() -> None:
    for data in (b"", b"{", b"[]", b'{"manifest": 1}', b"\xff\xfe", b'{"a":1,"b":2,"c":3}'):
        with pytest.raises(ManifestError):
            SignedManifest.decode(data, trust=trust())
    with pytest.raises(ManifestError, match="exceeds"):
        SignedManifest.decode(b"x" * 100, trust=trust(), max_bytes=10)


@given(st.binary(max_size=300))
def test_fuzz_never_crashes(data: bytes) -> None:
    with pytest.raises((ManifestError, IntegrityError)):
        SignedManifest.decode(data, trust=trust())


def test_byte_at_a_time_truncation(signed: SignedManifest) -> None:
    data = signed.encode()
    for cut in range(0, len(data), max(1, len(data) // 50)):
        with pytest.raises((ManifestError, IntegrityError)):
            SignedManifest.decode(data[:cut], trust=trust())
