"""Shard plan, digest checks, atomic commit and retention of the version store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from p2p.errors import IntegrityError, LocalProtocolError
from shardcast.manifest import sign_manifest
from shardcast.plan import CheckpointLayoutError, build_manifest, check_layout, plan_shards
from shardcast.store import VersionStore
from tests.helpers import TRAINER, make_checkpoint, trust

SIZES = {"model-00001-of-00002.safetensors": 4096, "model-00002-of-00002.safetensors": 2500}


def test_plan_tiles_exactly() -> None:
    shards = plan_shards({"b": 10, "a": 0, "c": 7}, 4)
    assert [(s.file, s.offset, s.length) for s in shards] == [
        ("b", 0, 4),
        ("b", 4, 4),
        ("b", 8, 2),
        ("c", 0, 4),
        ("c", 4, 3),
    ]


def test_layout_checks(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "ok", SIZES)
    assert "config.json" in check_layout(ck)
    (ck / "model.safetensors.index.json").unlink()
    with pytest.raises(CheckpointLayoutError, match=r"no model\.safetensors\.index\.json"):
        check_layout(ck)
    bad = make_checkpoint(tmp_path / "noconf", {"model.safetensors": 10})
    (bad / "config.json").unlink()
    with pytest.raises(CheckpointLayoutError, match=r"config\.json"):
        check_layout(bad)
    sub = make_checkpoint(tmp_path / "sub", {"model.safetensors": 10})
    (sub / "nested").mkdir()
    with pytest.raises(CheckpointLayoutError, match="regular files"):
        check_layout(sub)


def _partial(tmp_path: Path, step: int = 1, keep: int = 2):  # type: ignore[no-untyped-def]
    ck = make_checkpoint(tmp_path / f"src{step}", SIZES, seed=step)
    signed = sign_manifest(build_manifest(ck, "run", step, shard_size=1000), TRAINER)
    store = VersionStore(tmp_path / "store", "run", keep_last=keep)
    return ck, signed, store, store.begin(signed)


def test_write_verify_commit(tmp_path: Path) -> None:
    ck, signed, store, part = _partial(tmp_path)
    m = signed.manifest
    bad = bytearray((ck / m.shards[0].file).read_bytes()[: m.shards[0].length])
    bad[0] ^= 1
    with pytest.raises(IntegrityError, match="digest mismatch"):
        part.write_shard(0, bad, "http://evil")
    assert not part.has(0)
    # the bad bytes never reached the file
    assert (part.dir / m.shards[0].file).read_bytes()[:1] == b"\0"
    with pytest.raises(IntegrityError, match="bytes, expected"):
        part.write_shard(0, b"short")
    with pytest.raises(LocalProtocolError, match="missing"):
        part.commit()
    assert not store.version_dir(1).exists()
    for s in reversed(m.shards):  # any order
        data = (ck / s.file).read_bytes()[s.offset : s.offset + s.length]
        assert part.write_shard(s.index, data)
    assert not part.write_shard(0, (ck / m.shards[0].file).read_bytes()[: m.shards[0].length])
    final = part.commit()
    assert final == store.version_dir(1)
    assert store.committed_steps() == [1]
    for f in m.files:
        assert (final / f.name).read_bytes() == (ck / f.name).read_bytes()
    assert store.load_manifest(1, trust()) == signed
    assert not part.dir.exists()


def test_commit_refuses_corrupted_file(tmp_path: Path) -> None:
    ck, signed, store, part = _partial(tmp_path)
    for s in signed.manifest.shards:
        part.write_shard(s.index, (ck / s.file).read_bytes()[s.offset : s.offset + s.length])
    # simulate on-disk corruption after the shard checks (bit rot, a buggy writer)
    name = signed.manifest.files[-1].name
    with open(part.dir / name, "r+b") as fh:
        fh.seek(3)
        fh.write(b"\xff")
    with pytest.raises(IntegrityError, match="digest mismatch"):
        part.commit()
    assert store.committed_steps() == []
    assert not part.dir.exists()
    assert not store.version_dir(1).exists()


def test_crash_leaves_no_version(tmp_path: Path) -> None:
    ck, signed, _store, part = _partial(tmp_path)
    s = signed.manifest.shards[0]
    part.write_shard(0, (ck / s.file).read_bytes()[: s.length])
    # "crash": the process dies; a new store instance on the same dir cleans up
    store2 = VersionStore(tmp_path / "store", "run", keep_last=2)
    assert store2.committed_steps() == []
    assert not any(p.name.startswith(".partial") for p in store2.run_dir.iterdir())


def test_retention_and_pins(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "store", "run", keep_last=2)
    for step in range(1, 5):
        ck = make_checkpoint(tmp_path / f"c{step}", SIZES, seed=step)
        signed = sign_manifest(build_manifest(ck, "run", step, shard_size=1000), TRAINER)
        if step == 2:
            with store.pinned(1):
                store.adopt(ck, signed)
                assert store.committed_steps() == [1, 2]
        elif step == 3:
            with store.pinned(2):
                store.adopt(ck, signed)
                assert store.committed_steps() == [2, 3]  # 1 pruned once unpinned
        else:
            store.adopt(ck, signed)
    assert store.committed_steps() == [3, 4]


def test_adopt_checks_digests(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "c", SIZES)
    signed = sign_manifest(build_manifest(ck, "run", 0, shard_size=1000), TRAINER)
    with open(ck / "config.json", "a") as fh:
        fh.write(" ")
    store = VersionStore(tmp_path / "store", "run", keep_last=2)
    with pytest.raises(IntegrityError):
        store.adopt(ck, signed)
    assert store.committed_steps() == []
    assert os.path.exists(ck)
