"""Shard plan, pipelined hashing, digest checks, atomic commit and retention of the store."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from p2p.errors import IntegrityError, LocalProtocolError
from shardcast.publish.layout import CheckpointLayoutError, check_layout, plan_shards
from shardcast.publish.plan import build_manifest, hash_parts, make_header
from shardcast.store import VersionStore, file_matches
from shardcast.wire.manifest import Manifest
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


def test_parts_come_out_in_order_as_hashed(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "c", {**SIZES, "empty.bin": 0})
    header = make_header(ck, "run", 0, shard_size=1000, shards_per_part=2)
    seen: list[int] = []
    parts = hash_parts(ck, header, header.digest(), on_part=lambda p: seen.append(p.index))
    assert seen == list(range(header.n_parts)) == [p.index for p in parts]
    # every file digest is carried by exactly one part; the empty file by part 0
    carried = [n for p in parts for n, _ in p.file_digests]
    assert sorted(carried) == sorted(f.name for f in header.files)
    assert "empty.bin" in dict(parts[0].file_digests)


def _partial(tmp_path: Path, step: int = 1, keep: int = 2, schema: int = 3):  # type: ignore[no-untyped-def]
    ck = make_checkpoint(tmp_path / f"src{step}", SIZES, seed=step)
    m = build_manifest(ck, "run", step, TRAINER, shard_size=1000, shards_per_part=3, schema=schema)
    store = VersionStore(tmp_path / "store", "run", keep_last=keep)
    return ck, m, store


def _bytes(ck: Path, m: Manifest, i: int) -> bytes:
    s = m.header.shards[i]
    return (ck / s.file).read_bytes()[s.offset : s.offset + s.length]


def test_write_verify_commit(tmp_path: Path) -> None:
    ck, m, store = _partial(tmp_path)
    # parts arrive while the download runs: start from the header alone
    growing = Manifest(m.signed_header)
    part = store.begin(growing)
    with pytest.raises(LocalProtocolError, match="part has not arrived"):
        part.write_shard(0, _bytes(ck, m, 0))
    for k in sorted(m.parts):
        growing.add_part(m.parts[k])
    bad = bytearray(_bytes(ck, m, 0))
    bad[0] ^= 1
    with pytest.raises(IntegrityError, match="digest mismatch"):
        part.write_shard(0, bad, "http://evil")
    assert not part.has(0)
    assert (part.dir / m.header.shards[0].file).read_bytes()[:1] == b"\0"
    with pytest.raises(IntegrityError, match="bytes, expected"):
        part.write_shard(0, b"short")
    with pytest.raises(LocalProtocolError, match="missing"):
        part.commit()
    assert not store.version_dir(1).exists()
    for i in reversed(range(len(m.header.shards))):  # any order
        assert part.write_shard(i, _bytes(ck, m, i))
    assert not part.write_shard(0, _bytes(ck, m, 0))
    final = part.commit()
    assert final == store.version_dir(1)
    assert store.committed_steps() == [1]
    for f in m.header.files:
        assert (final / f.name).read_bytes() == (ck / f.name).read_bytes()
    assert store.load_manifest(1, trust()).digest == m.digest
    assert not part.dir.exists()


def test_commit_refuses_corrupted_file(tmp_path: Path) -> None:
    # schema 2 (whole-file digests): commit re-hashes every file and catches it
    ck, m, store = _partial(tmp_path, schema=2)
    part = store.begin(m)
    for i in range(len(m.header.shards)):
        part.write_shard(i, _bytes(ck, m, i))
    name = m.header.files[-1].name
    with open(part.dir / name, "r+b") as fh:  # on-disk corruption after the shard checks
        fh.seek(3)
        fh.write(b"\xff")
    with pytest.raises(IntegrityError, match="digest mismatch"):
        part.commit()
    assert store.committed_steps() == []
    assert not part.dir.exists()
    assert not store.version_dir(1).exists()


def test_rooted_commit_reads_no_file_and_recovery_catches_rot(tmp_path: Path) -> None:
    # schema 3 (hash-list roots): commit derives the roots from the checked shard digests
    # and reads no file; bytes damaged at rest are caught where files are checked at rest
    ck, m, store = _partial(tmp_path, schema=3)
    assert m.rooted
    part = store.begin(m)
    for i in range(len(m.header.shards)):
        part.write_shard(i, _bytes(ck, m, i))
    for f in m.header.files:
        assert m.shard_root(f.name) == m.file_digest(f.name)
    final = part.commit()
    name = m.header.files[-1].name
    assert file_matches(final / name, m, name)
    with open(final / name, "r+b") as fh:
        fh.seek(3)
        fh.write(b"\xff")
    assert not file_matches(final / name, m, name)
    assert store.recover() == [1]


def test_crash_leaves_no_version(tmp_path: Path) -> None:
    """A crash commits nothing; the partial version stays only to be resumed (its journal
    of verified shards; see tests/unit/test_journal.py)."""
    ck, m, store = _partial(tmp_path)
    part = store.begin(m)
    part.write_shard(0, _bytes(ck, m, 0))
    store2 = VersionStore(tmp_path / "store", "run", keep_last=2)  # after a crash
    assert store2.committed_steps() == []
    assert [p.name for p in store2.run_dir.iterdir() if p.name.startswith(".partial")] == [
        ".partial-step-1"
    ]
    assert store2.begin(m).missing == len(m.header.shards) - 1


def test_retention_and_pins(tmp_path: Path) -> None:
    store = VersionStore(tmp_path / "store", "run", keep_last=2)
    for step in range(1, 5):
        ck = make_checkpoint(tmp_path / f"c{step}", SIZES, seed=step)
        m = build_manifest(ck, "run", step, TRAINER, shard_size=1000)
        if step == 2:
            with store.pinned(1):
                store.adopt(ck, m)
                assert store.committed_steps() == [1, 2]
        elif step == 3:
            with store.pinned(2):
                store.adopt(ck, m)
                assert store.committed_steps() == [2, 3]  # 1 pruned once unpinned
        else:
            store.adopt(ck, m)
    assert store.committed_steps() == [3, 4]


def test_adopt_checks_digests(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "c", SIZES)
    m = build_manifest(ck, "run", 0, TRAINER, shard_size=1000)
    with open(ck / "config.json", "a") as fh:
        fh.write(" ")
    store = VersionStore(tmp_path / "store", "run", keep_last=2)
    with pytest.raises(IntegrityError):
        store.adopt(ck, m)
    assert store.committed_steps() == []
    assert os.path.exists(ck)


def test_retention_policy_is_pure() -> None:
    from shardcast.core.retention import versions_to_prune

    assert versions_to_prune([1, 2, 3, 4, 5], 2, []) == [1, 2, 3]
    assert versions_to_prune([1, 2, 3, 4, 5], 2, [2]) == [1, 3]
    assert versions_to_prune([1], 3, []) == []


def test_super_seeding_policy() -> None:
    from shardcast.serve.superseeding import SuperSeeding

    s = SuperSeeding(window_s=5.0)
    assert s.allow("relay1", 0, [1, 2], now=0.0)
    assert s.allow("relay1", 0, [1], now=1.0)  # the same requester retrying
    assert not s.allow("relay2", 0, [2], now=1.0)  # someone else: fetch it from relay1
    assert s.allow("relay2", 0, [3], now=1.0)
    assert s.allow("relay2", 0, [2], now=5.5)  # the window passed
    assert s.refused == 1
    assert SuperSeeding(None).allow("x", 0, [1], 0.0)


def test_super_seeding_repeat_budget_and_persistence() -> None:
    from shardcast.serve.superseeding import SuperSeeding

    s = SuperSeeding(window_s=5.0, repeat_budget=0.1, persist_s=60.0)
    for i in range(20):  # first serves are free
        assert s.allow("relay1", 0, [i], now=0.0, total_shards=20)
    # after the window, repeats come out of a budget of 10 % of 20 shards = 2
    assert s.allow("relay2", 0, [0], now=10.0, total_shards=20)
    assert s.allow("relay3", 0, [1], now=10.0, total_shards=20)
    assert not s.allow("relay2", 0, [2], now=10.0, total_shards=20)
    assert s.repeats == 2
    # the budget is per step: another version starts afresh
    assert s.allow("relay1", 1, [0], now=10.0, total_shards=20)
    assert s.allow("relay2", 1, [0], now=20.0, total_shards=20)
    # over budget, a requester that keeps asking for persist_s gets it (nobody else serves it)
    assert not s.allow("relay2", 0, [2], now=69.0, total_shards=20)
    assert s.allow("relay2", 0, [2], now=70.5, total_shards=20)
    # ... and one that asks for the first time after the window is refused
    assert not s.allow("relay3", 0, [3], now=71.0, total_shards=20)
    # without a shard count there is no budget (window only)
    assert s.allow("relay3", 0, [3], now=71.0)


async def test_a_version_being_served_is_not_pruned(tmp_path: Path) -> None:
    from p2p.http_range import ByteRange
    from p2p.http_server import FileSlice, HttpRequest
    from shardcast.serve.server import VersionServer

    store = VersionStore(tmp_path / "store", "run", keep_last=1)
    ck = make_checkpoint(tmp_path / "c1", SIZES, seed=1)
    m1 = build_manifest(ck, "run", 1, TRAINER, shard_size=1000)
    store.adopt(ck, m1)
    server = VersionServer(store, trust())
    name = m1.header.files[0].name
    path = f"/shardnet/v1/run/1/{m1.digest}/files/{name}"
    req = HttpRequest("GET", path, {}, {}, ByteRange(0, 99))
    resp = await server.handle(req)
    assert isinstance(resp.body, FileSlice)
    assert resp.body.on_done is not None
    ck2 = make_checkpoint(tmp_path / "c2", SIZES, seed=2)
    store.adopt(ck2, build_manifest(ck2, "run", 2, TRAINER, shard_size=1000))
    assert store.committed_steps() == [1, 2]  # version 1 is pinned while the send is pending
    resp.body.on_done()
    assert store.prune() == [1]


def test_unclean_stop_of_a_non_durable_store_is_recovered(tmp_path: Path) -> None:
    ck, m, store = _partial(tmp_path)
    fast = VersionStore(tmp_path / "fast", "run", keep_last=3, durable=False)
    for step in (1, 2):
        cks = make_checkpoint(tmp_path / f"f{step}", SIZES, seed=10 + step)
        fast.adopt(cks, build_manifest(cks, "run", step, TRAINER, shard_size=1000))
    # the process dies without close(); a committed file was damaged (lost writeback)
    victim = fast.version_dir(2) / m.header.files[0].name
    victim.write_bytes(b"\0" * victim.stat().st_size)
    again = VersionStore(tmp_path / "fast", "run", keep_last=3, durable=False)
    assert again.committed_steps() == [1]
    again.close()
    assert VersionStore(tmp_path / "fast", "run", keep_last=3).committed_steps() == [1]
    del ck, store


def test_pwrite_all_writes_in_bounded_calls_and_survives_short_writes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shardcast.store import files as store_mod

    data = bytes(range(256)) * 40  # 10 240 bytes
    calls: list[int] = []
    real = os.pwrite

    def short(fd: int, buf: memoryview, off: int) -> int:
        calls.append(len(buf))
        return real(fd, buf[: max(1, len(buf) // 2)], off)  # the kernel may write less

    monkeypatch.setattr(store_mod, "WRITE_BYTES", 4096)
    monkeypatch.setattr(store_mod.os, "pwrite", short)
    path = tmp_path / "f"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        store_mod.pwrite_all(fd, data, 7)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\0" * 7 + data
    assert max(calls) == 4096
