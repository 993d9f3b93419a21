"""The receiving data path (shardcast.download.receive) and the schema-3 hash-list roots it
commits."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import blake3
import numpy as np
import pytest

from p2p.errors import IntegrityError, LocalProtocolError
from shardcast.core import Stage, StageCpu
from shardcast.download.receive import (
    BaseMismatch,
    BaseVersion,
    BufferPool,
    ShardSink,
    verify_and_write,
)
from shardcast.publish.plan import Base, build_manifest
from shardcast.store import BLOB_DIR, VersionStore, copy_range, file_matches
from shardcast.wire import codecs
from shardcast.wire.manifest import FILE_ROOT_CONTEXT, Header, Manifest, ManifestError, file_root
from shardcast.wire.sparse import is_identity
from tests.helpers import TRAINER, make_checkpoint

SHARD = 8192
NAME = "model.safetensors"


def test_sink_hashes_as_bytes_arrive_and_resumes_without_rehashing() -> None:
    data = os.urandom(10_000)
    pool = BufferPool(keep=1)
    sink = ShardSink.pooled(len(data), pool)
    sink.window(4000)[:] = data[:4000]
    sink.advance(4000)
    with pytest.raises(LocalProtocolError):
        sink.digest()  # not complete
    # a broken transfer keeps the sink; the next source continues at byte 4000
    sink.window(6000)[:] = data[4000:]
    sink.advance(6000)
    assert sink.full
    assert sink.digest() == blake3.blake3(data).hexdigest()
    assert bytes(sink.data) == data
    with pytest.raises(LocalProtocolError):
        sink.window(1)  # past the end
    buf = sink.buffer
    sink.release()
    sink.release()  # idempotent
    assert pool.get(10) is not buf  # a small sink is not pooled: its buffer is its own
    big = ShardSink.pooled(8 << 20, pool)
    buf = big.buffer
    big.release()
    assert pool.get(8 << 20) is buf  # back in the pool


def test_file_root_is_domain_tagged_ordered_and_length_bound() -> None:
    a, b = blake3.blake3(b"a").hexdigest(), blake3.blake3(b"b").hexdigest()
    root = file_root([(1, a), (1, b)])
    assert root != file_root([(1, b), (1, a)])  # order matters
    assert root != file_root([(2, a), (1, b)])  # lengths are bound
    assert root != file_root([(1, a)])  # the count is bound
    assert file_root([(1, a)]) != a  # never equal to a shard digest (own context)
    plain = blake3.blake3(bytes(8) + (1).to_bytes(8, "little") + bytes.fromhex(a)).hexdigest()
    assert file_root([(1, a)]) != plain
    keyed = blake3.blake3(derive_key_context=FILE_ROOT_CONTEXT)
    keyed.update((1).to_bytes(8, "little") + (1).to_bytes(8, "little") + bytes.fromhex(a))
    assert file_root([(1, a)]) == keyed.hexdigest()  # the documented layout
    with pytest.raises(ValueError, match="32 bytes"):
        file_root([(1, "ab")])


def test_schema_2_still_reads_and_parts_carry_their_header_schema(tmp_path: Path) -> None:
    ck = make_checkpoint(tmp_path / "c", {NAME: 3 * SHARD + 5})
    old = build_manifest(ck, "run", 1, TRAINER, shard_size=SHARD, schema=2)
    new = build_manifest(ck, "run", 2, TRAINER, shard_size=SHARD)
    assert (old.header.schema, new.header.schema) == (2, 3)
    assert not old.rooted
    assert new.rooted
    assert old.file_digest(NAME) == blake3.blake3((ck / NAME).read_bytes()).hexdigest()
    assert new.file_digest(NAME) == new.shard_root(NAME)
    for m in (old, new):
        assert file_matches(ck / NAME, m, NAME)
    body = new.parts[0].part.to_obj()
    with pytest.raises(ManifestError, match="version-3"):
        type(new.parts[0].part).from_obj({**body, "v": 2}, new.header)
    with pytest.raises(ManifestError, match="schema version"):
        Header.from_obj({**new.header.to_obj(), "v": 4})


def _versions(tmp_path: Path, changed: float) -> tuple[Path, Manifest, Manifest, VersionStore]:
    """Step 1 (committed at the receiver) and step 2 (``changed`` of the words +1, offered as
    sparse deltas), both schema 3."""
    rng = np.random.default_rng(1)
    words = rng.integers(0, 1 << 16, 4 * SHARD // 2, dtype=np.uint16)
    v1 = make_checkpoint(tmp_path / "v1", {NAME: 0})
    words.tofile(v1 / NAME)
    m1 = build_manifest(v1, "run", 1, TRAINER, shard_size=SHARD)
    moved = rng.random(words.size) < changed
    moved[: SHARD // 2] = False  # the file's first shard does not change at all
    words[moved] += 1
    v2 = make_checkpoint(tmp_path / "v2", {NAME: 0})
    words.tofile(v2 / NAME)
    m2 = build_manifest(
        v2,
        "run",
        2,
        TRAINER,
        shard_size=SHARD,
        encodings=[codecs.SPARSE],
        base=Base(1, m1.digest, v1),
        blob_dir=v2 / BLOB_DIR,
    )
    store = VersionStore(tmp_path / "recv", "run", keep_last=4)
    shutil.copytree(v1, tmp_path / "v1copy")
    store.adopt(tmp_path / "v1copy", m1)
    return v2, m1, m2, store


def _sink(data: bytes) -> ShardSink:
    sink = ShardSink(bytearray(data), len(data))
    sink.advance(len(data))
    return sink


@pytest.mark.parametrize("changed", [0.02, 0.0002])  # dense: buffer pass; sparse: clone+patch
def test_deltas_apply_verify_and_commit_without_reading_files(
    tmp_path: Path, changed: float
) -> None:
    v2, _, m2, store = _versions(tmp_path, changed)
    part = store.begin(m2)
    base = BaseVersion(store, 1)
    try:
        for i in range(len(m2.header.shards)):
            entry = m2.shard(i)
            blob = (v2 / BLOB_DIR / f"{i}.{codecs.SPARSE}").read_bytes()
            assert verify_and_write(part, entry, codecs.SPARSE, _sink(blob), base, "src")
            assert not verify_and_write(part, entry, codecs.SPARSE, _sink(blob), base, "src")
    finally:
        base.close()
    final = part.commit()
    assert (final / NAME).read_bytes() == (v2 / NAME).read_bytes()
    assert file_matches(final / NAME, m2, NAME)


class _TickClock:
    """A fake CPU clock: each reading is one second after the last."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


@pytest.mark.parametrize("changed", [0.02, 0.0002])  # dense: buffer pass; sparse: clone+patch
def test_the_delta_path_charges_apply_verify_and_write(tmp_path: Path, changed: float) -> None:
    v2, _, m2, store = _versions(tmp_path, changed)
    part = store.begin(m2)
    base = BaseVersion(store, 1)
    cpu = StageCpu(_TickClock())
    try:
        for i in range(len(m2.header.shards)):
            blob = (v2 / BLOB_DIR / f"{i}.{codecs.SPARSE}").read_bytes()
            verify_and_write(part, m2.shard(i), codecs.SPARSE, _sink(blob), base, "src", cpu=cpu)
    finally:
        base.close()
    s = cpu.statistics().seconds
    assert s[Stage.APPLY] > 0
    assert s[Stage.WRITE] > 0
    if changed > 0.01:  # decoded in a buffer, hashed there (in place: hashed inside the write)
        assert s[Stage.VERIFY] > 0
    assert s[Stage.RECEIVE] == s[Stage.ENGINE_UPDATE] == s[Stage.MATERIALIZE] == 0
    raw_cpu = StageCpu(_TickClock())
    part.abort()
    part = store.begin(m2)
    for i in range(len(m2.header.shards)):
        e = m2.shard(i)
        chunk = (v2 / e.file).read_bytes()[e.offset : e.offset + e.length]
        verify_and_write(part, e, codecs.RAW, _sink(chunk), None, "src", cpu=raw_cpu)
    raw = raw_cpu.statistics().seconds
    assert raw[Stage.WRITE] > 0  # raw bytes were hashed as they arrived: only the write here
    assert raw[Stage.APPLY] == raw[Stage.VERIFY] == 0
    part.abort()


def test_a_dense_sparse_delta_takes_one_pooled_buffer_and_gives_it_back(tmp_path: Path) -> None:
    """Sparse deltas patch the base in place: no decompression buffer besides the base's
    (a second one per shard was taken for nothing, and with many checks at once the pool
    ran dry and allocated fresh shard-sized buffers every version)."""
    v2, _, m2, store = _versions(tmp_path, 0.02)
    part = store.begin(m2)
    base = BaseVersion(store, 1)
    pool = BufferPool(keep=4)
    dense = 0
    try:
        for i in range(len(m2.header.shards)):
            blob = (v2 / BLOB_DIR / f"{i}.{codecs.SPARSE}").read_bytes()
            dense += not is_identity(blob, m2.shard(i).length)
            assert verify_and_write(
                part, m2.shard(i), codecs.SPARSE, _sink(blob), base, "src", pool
            )
    finally:
        base.close()
    assert dense >= 2
    assert pool.allocated == 1  # one buffer, reused for every shard
    assert (part.commit() / NAME).read_bytes() == (v2 / NAME).read_bytes()


def test_wrong_base_is_a_base_mismatch_and_a_raw_write_repairs_it(tmp_path: Path) -> None:
    v2, _, m2, store = _versions(tmp_path, 0.0002)
    first = m2.header.first_shard(NAME)  # unchanged since step 1: its blob lists no change
    with open(store.version_dir(1) / NAME, "r+b") as fh:  # this node's base rotted at rest
        fh.seek(10)
        fh.write(b"\x00\x01")
    part = store.begin(m2)
    base = BaseVersion(store, 1)
    entry = m2.shard(first)
    blob = (v2 / BLOB_DIR / f"{first}.{codecs.SPARSE}").read_bytes()
    assert is_identity(blob, entry.length)
    with pytest.raises(BaseMismatch):  # the copied range is hashed all the same
        verify_and_write(part, entry, codecs.SPARSE, _sink(blob), base, "src")
    assert not part.has(first)
    raw = (v2 / NAME).read_bytes()[: entry.length]
    assert verify_and_write(part, entry, codecs.RAW, _sink(raw), None, "src")
    assert part.read_shard(first) == raw
    bad = bytearray((v2 / NAME).read_bytes()[entry.length : 2 * entry.length])
    bad[0] ^= 1
    with pytest.raises(IntegrityError):  # raw bytes of the wrong digest: the sender's fault
        verify_and_write(part, m2.shard(first + 1), codecs.RAW, _sink(bytes(bad)), None, "src")
    assert not part.has(first + 1)
    with pytest.raises(IntegrityError, match="blob digest"):  # not the signed blob
        verify_and_write(part, m2.shard(first + 1), codecs.SPARSE, _sink(blob), base, "src")
    base.close()
    part.abort()


def test_copy_range_falls_back_where_copy_file_range_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src, dst = tmp_path / "s", tmp_path / "d"
    data = os.urandom(100_000)
    src.write_bytes(data)
    dst.write_bytes(bytes(len(data)))

    def refuse(*args: object) -> int:
        raise OSError(errno.EXDEV, "cross-device")

    monkeypatch.setattr(os, "copy_file_range", refuse)
    s, d = os.open(src, os.O_RDONLY), os.open(dst, os.O_RDWR)
    try:
        copy_range(s, d, 1000, 50_000)
        with pytest.raises(OSError, match="source ends"):
            copy_range(s, d, 90_000, 20_000)
    finally:
        os.close(s)
        os.close(d)
    got = dst.read_bytes()
    assert got[1000:51_000] == data[1000:51_000]
    assert got[:1000] == bytes(1000)
