"""Versions kept as chains (shardcast.store.chains): committed without reading the base or
writing the model, read verified, materialized on demand, kept by retention, found intact
(or discarded) on restart; a base damaged at rest is caught before any byte leaves."""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import trio

from p2p.http_range import ByteRange
from p2p.http_server import FileSlice, HttpRequest, HttpResponse
from shardcast.core import should_materialize
from shardcast.download.receive import BaseVersion, ShardSink, verify_and_write
from shardcast.publish.plan import Base, build_manifest
from shardcast.serve.mirror import PREFIX, export_mirror
from shardcast.serve.server import VersionServer
from shardcast.store import BLOB_DIR, PartialVersion, VersionStore
from shardcast.store.blobpack import PACK_FILE, PACK_INDEX, read_index
from shardcast.store.chains import CHAIN_DIR, CHAIN_FILE, MATERIALIZE_DIR, ChainBroken
from shardcast.wire import codecs, full_bits
from shardcast.wire.manifest import Manifest
from shardnet.engine_update import swap_weights
from tests.helpers import TRAINER, make_checkpoint, rot_blob, trust

SHARD = 8192
NAME = "model.safetensors"
RUN = "run"


class Trainer:
    """Versions 1..n of one checkpoint: 1 full, each next one 2 % of its words +1, offered as
    sparse deltas against the previous one (what the trainer signs and the origin serves)."""

    def __init__(self, tmp: Path, steps: int) -> None:
        rng = np.random.default_rng(7)
        words = rng.integers(0, 1 << 16, 4 * SHARD // 2, dtype=np.uint16)
        self.dirs: dict[int, Path] = {}
        self.manifests: dict[int, Manifest] = {}
        for step in range(1, steps + 1):
            d = make_checkpoint(tmp / f"v{step}", {NAME: 0})
            if step > 1:
                words = words.copy()
                moved = rng.random(words.size) < 0.02
                moved[: SHARD // 2] = False  # shard 0 never changes: an identity delta
                words[moved] += 1
            words.tofile(d / NAME)
            prev = self.manifests.get(step - 1)
            self.manifests[step] = build_manifest(
                d,
                RUN,
                step,
                TRAINER,
                shard_size=SHARD,
                encodings=[codecs.SPARSE] if prev else [],
                base=Base(step - 1, prev.digest, self.dirs[step - 1]) if prev else None,
                blob_dir=d / BLOB_DIR if prev else None,
            )
            self.dirs[step] = d

    def bytes_of(self, step: int, name: str = NAME) -> bytes:
        return (self.dirs[step] / name).read_bytes()


def _sink(data: bytes) -> ShardSink:
    sink = ShardSink(bytearray(data), len(data))
    sink.advance(len(data))
    return sink


def _receive(store: VersionStore, t: Trainer, step: int, *, chain: bool = True) -> Path:
    """What a follower does with ``step``: every offered delta, raw elsewhere; commit."""
    m = t.manifests[step]
    base_step = m.header.base_step
    part = store.begin(m, base_step if chain else None)
    base = BaseVersion(store, base_step) if base_step is not None and not chain else None
    try:
        for ref in m.header.shards:
            entry = m.shard(ref.index)
            if entry.offered(codecs.SPARSE) is not None:
                blob = (t.dirs[step] / BLOB_DIR / f"{ref.index}.{codecs.SPARSE}").read_bytes()
                assert verify_and_write(part, entry, codecs.SPARSE, _sink(blob), base, "src")
            else:
                raw = t.bytes_of(step, ref.file)[ref.offset : ref.offset + ref.length]
                assert verify_and_write(part, entry, codecs.RAW, _sink(raw), None, "src")
    finally:
        if base is not None:
            base.close()
    return part.commit()


def _store(tmp: Path, t: Trainer, keep_last: int = 8) -> VersionStore:
    store = VersionStore(tmp / "recv", RUN, keep_last=keep_last, durable=False)
    copy = tmp / "v1copy"
    shutil.copytree(t.dirs[1], copy, ignore=shutil.ignore_patterns(BLOB_DIR))
    store.adopt(copy, t.manifests[1])
    return store


def _corrupt(store: VersionStore, step: int, offset: int) -> None:
    with open(store.version_dir(step) / NAME, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(1)
        fh.seek(offset)
        fh.write(bytes([old[0] ^ 0x40]))


def test_chain_commit_writes_no_full_file_and_reads_no_base(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    base_file = store.version_dir(1) / NAME
    hidden = tmp_path / "hidden"
    os.rename(base_file, hidden)  # any read of the base during receive or commit would fail
    try:
        final = _receive(store, t, 2)
    finally:
        os.rename(hidden, base_file)
    assert store.chains.reads == 0
    assert (final / CHAIN_FILE).is_file()
    assert not (final / NAME).exists()  # the model was not written
    unchanged = (final / "config.json").stat()  # an unchanged file: the base's, linked
    assert unchanged.st_ino == (store.version_dir(1) / "config.json").stat().st_ino
    rec = store.chain_of(2)
    assert rec is not None
    assert (rec.base_step, rec.base_digest) == (1, t.manifests[1].digest)
    assert rec.files == {NAME}
    assert set(rec.deltas.values()) == {codecs.SPARSE}
    assert store.chained_files(2) == rec.files
    assert store.holds(2, t.manifests[2].digest)
    assert store.chain_depth(2) == 1


def test_verified_read_equals_the_trainer_bytes_and_materialization(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    _receive(store, t, 2)
    want = t.bytes_of(2)
    for ref in t.manifests[2].header.shards:
        got = store.read_shard(2, ref.index)
        assert got == t.bytes_of(2, ref.file)[ref.offset : ref.offset + ref.length]
    assert store.chains.reads > 0
    assert store.read_file_range(2, NAME, 100, 3 * SHARD) == want[100 : 100 + 3 * SHARD]
    assert store.materialize(2)
    assert not store.materialize(2)  # full already
    d = store.version_dir(2)
    assert (d / NAME).read_bytes() == want
    assert (d / "config.json").read_bytes() == t.bytes_of(2, "config.json")
    assert not (d / CHAIN_FILE).exists()
    assert not (d / CHAIN_DIR).exists()
    assert not (d / MATERIALIZE_DIR).exists()
    assert store.blob_ref(2, 1, codecs.SPARSE) is not None  # blobs stay (in-place updates)
    assert store.chained_files(2) == frozenset()


def test_a_chain_of_chains_reads_through_every_level(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 4)
    store = _store(tmp_path, t)
    for step in (2, 3, 4):
        _receive(store, t, step)
    assert [store.chain_depth(s) for s in (1, 2, 3, 4)] == [0, 1, 2, 3]
    assert store.read_file_range(4, NAME, 0, 4 * SHARD) == t.bytes_of(4)
    assert store.materialize(3)  # the middle flips to full: 4 now reads through it
    assert store.chain_depth(4) == 1
    assert store.read_file_range(4, NAME, 0, 4 * SHARD) == t.bytes_of(4)
    assert (store.version_dir(3) / NAME).read_bytes() == t.bytes_of(3)


def test_a_raw_shard_in_a_chain_is_kept_in_the_chain_file(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    m = t.manifests[2]
    part = store.begin(m, 1)
    for ref in m.header.shards:
        entry = m.shard(ref.index)
        if ref.file == NAME and ref.index == m.header.first_shard(NAME) + 2:  # fetched raw
            raw = t.bytes_of(2)[ref.offset : ref.offset + ref.length]
            assert verify_and_write(part, entry, codecs.RAW, _sink(raw), None, "src")
        else:
            blob = (t.dirs[2] / BLOB_DIR / f"{ref.index}.{codecs.SPARSE}").read_bytes()
            assert verify_and_write(part, entry, codecs.SPARSE, _sink(blob), None, "src")
        assert part.read_shard(ref.index) == t.bytes_of(2, ref.file)[ref.offset :][: ref.length]
    part.commit()
    rec = store.chain_of(2)
    assert rec is not None
    assert m.header.first_shard(NAME) + 2 not in rec.deltas
    assert store.read_file_range(2, NAME, 0, 4 * SHARD) == t.bytes_of(2)


class _LoadCounter:
    """An engine that only counts full loads (no in-place updates)."""

    def __init__(self) -> None:
        self.loads = 0

    def load(self, checkpoint_dir: str | Path) -> None:
        self.loads += 1


def _serve(server: VersionServer, m: Manifest, first: int, last: int) -> HttpResponse:
    path = f"/shardnet/v1/{RUN}/{m.step}/{m.digest}/files/{NAME}"
    req = HttpRequest("GET", path, {}, {"range": f"bytes={first}-{last}"}, ByteRange(first, last))
    return trio.run(server.handle, req)


@pytest.mark.parametrize("use", ["serve", "materialize", "load", "read"])
def test_a_base_corrupted_under_a_delta_is_caught_before_any_byte_leaves(
    tmp_path: Path, use: str
) -> None:
    t = Trainer(tmp_path, 3)
    store = _store(tmp_path, t)
    _receive(store, t, 2)
    _receive(store, t, 3)
    server = VersionServer(store, trust())
    m2 = t.manifests[2]
    shard = m2.header.first_shard(NAME) + 1
    ok = _serve(server, m2, 0, 99)  # over a sound base range: built, verified, served
    assert (ok.status, ok.body) == (206, t.bytes_of(2)[:100])
    _corrupt(store, 1, SHARD + 10)  # the base rots at rest, after the chain committed
    engine = _LoadCounter()
    if use == "serve":
        resp = _serve(server, m2, SHARD, 2 * SHARD - 1)
        assert (resp.status, resp.body) == (404, b"")  # not one byte
    else:

        def load() -> object:
            return swap_weights(engine, store, m2, store.version_dir(2), None)  # type: ignore[arg-type]

        act: Callable[[], object] = {
            "materialize": lambda: store.materialize(2),
            "load": load,
            "read": lambda: store.read_shard(3, shard),
        }[use]
        with pytest.raises(ChainBroken) as caught:
            act()
        assert caught.value.step == 1  # the lowest level that did not verify: the base
        assert caught.value.shard == shard
    assert engine.loads == 0  # nothing loaded
    assert sorted(store.damaged) == [1, 2, 3]  # the base and every chain on it
    assert store.committed_versions() == []
    assert server.versions() == []  # none is offered any more
    assert not store.version_dir(2).exists()


def test_a_damaged_blob_is_the_chain_version_s_fault_not_the_base_s(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    _receive(store, t, 2)
    shard = t.manifests[2].header.first_shard(NAME) + 1
    blob = store.blob_ref(2, shard, codecs.SPARSE)
    assert blob is not None
    assert blob.path.name == PACK_FILE  # kept in the version's pack
    rot_blob(blob)  # the kept blob rots at rest
    with pytest.raises(ChainBroken) as caught:
        store.read_shard(2, shard)
    assert caught.value.step == 2
    assert store.committed_steps() == [1]  # the sound base stays


def test_retention_keeps_the_bases_chains_need(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 4)
    store = _store(tmp_path, t, keep_last=1)
    for step in (2, 3):
        _receive(store, t, step)
    assert store.committed_steps() == [1, 2, 3]  # 3 is kept, and it is built from 2 and 1
    assert store.materialize(3)
    assert store.prune() == [1, 2]
    _receive(store, t, 4)
    assert store.committed_steps() == [3, 4]
    assert store.read_file_range(4, NAME, 0, 4 * SHARD) == t.bytes_of(4)


def _chain_of_2(tmp_path: Path) -> tuple[Trainer, VersionStore, Manifest]:
    """Version 2 received as a chain over version 1, as a follower keeps it."""
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    _receive(store, t, 2)
    return t, store, t.manifests[2]


def test_a_chain_version_keeps_its_blobs_in_one_pack(tmp_path: Path) -> None:
    t, store, m = _chain_of_2(tmp_path)
    enc_dir = store.version_dir(2) / BLOB_DIR
    assert sorted(p.name for p in enc_dir.iterdir()) == [PACK_FILE, PACK_INDEX]  # no file each
    for ref in m.header.shards:
        blob = store.blob_ref(2, ref.index, codecs.SPARSE)
        assert blob is not None
        want = (t.dirs[2] / BLOB_DIR / f"{ref.index}.{codecs.SPARSE}").read_bytes()
        assert blob.read() == want  # the blob as the origin signed it
    assert store.read_file_range(2, NAME, 0, 4 * SHARD) == t.bytes_of(2)


def test_a_mirror_export_writes_out_each_packed_blob(tmp_path: Path) -> None:
    t, store, m = _chain_of_2(tmp_path)
    r = export_mirror(store, tmp_path / "www", trainer_id=TRAINER.peer_id)
    assert r.exported == [1, 2]
    shard_dir = tmp_path / "www" / PREFIX / RUN / "2" / m.digest / "shard"
    for ref in m.header.shards:
        want = (t.dirs[2] / BLOB_DIR / f"{ref.index}.{codecs.SPARSE}").read_bytes()
        assert (shard_dir / str(ref.index) / codecs.SPARSE).read_bytes() == want


def test_a_durable_chain_commit_syncs_its_blobs_and_chained_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    store.durable = True
    synced: list[str] = []
    real = os.fsync

    def fsync(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    _receive(store, t, 2)
    assert store.chained_files(2)  # some shards came raw: kept in .chain/
    for rel in (f"{BLOB_DIR}/{PACK_FILE}", f"{BLOB_DIR}/{PACK_INDEX}", f"{CHAIN_DIR}/{NAME}"):
        assert any(p.endswith(f"/{rel}") for p in synced), rel  # blobs, the raw shards
    assert any(p.endswith(f"/{CHAIN_DIR}") for p in synced)  # and the entries of both dirs
    assert any(p.endswith(f"/{BLOB_DIR}") for p in synced)


def test_a_resumed_download_drops_a_blob_that_rotted_in_its_pack(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    m = t.manifests[2]
    part = store.begin(m, 1)
    blobs = {}
    for ref in m.header.shards:
        blobs[ref.index] = (t.dirs[2] / BLOB_DIR / f"{ref.index}.{codecs.SPARSE}").read_bytes()
        verify_and_write(part, m.shard(ref.index), codecs.SPARSE, _sink(blobs[ref.index]),
                         None, "src")  # fmt: skip
    victim = part.blob_ref(1, codecs.SPARSE)
    assert victim is not None
    part.close()
    rot_blob(victim)  # at rest, while the node was down
    again = VersionStore(tmp_path / "recv", RUN, keep_last=8, durable=False)
    resumed = again.begin(m, 1)
    n = len(m.header.shards)
    assert resumed.restored == n - 1  # the rotten blob's shard is fetched again
    assert not resumed.has(1)
    assert resumed.blob_ref(1, codecs.SPARSE) is None  # and never served
    assert (1, codecs.SPARSE) not in read_index(resumed.dir / BLOB_DIR)
    verify_and_write(resumed, m.shard(1), codecs.SPARSE, _sink(blobs[1]), None, "src")
    resumed.commit()
    assert again.read_file_range(2, NAME, 0, 4 * SHARD) == t.bytes_of(2)


def test_a_crash_mid_commit_leaves_no_version_and_the_download_resumes(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    m = t.manifests[2]
    part = store.begin(m, 1)
    for ref in m.header.shards:
        blob = (t.dirs[2] / BLOB_DIR / f"{ref.index}.{codecs.SPARSE}").read_bytes()
        verify_and_write(part, m.shard(ref.index), codecs.SPARSE, _sink(blob), None, "src")
    n = len(m.header.shards)
    assert part.have_bits() == full_bits(n)  # kept deltas count as held
    part.close()  # stopped before the commit: blobs and journal kept
    again = VersionStore(tmp_path / "recv", RUN, keep_last=8, durable=False)  # unclean: recover
    assert again.committed_steps() == [1]
    resumed = again.begin(m, 1)
    assert resumed.restored == n  # the kept blobs, journaled, re-checked
    assert resumed.have_bits() == full_bits(n)
    resumed.commit()
    assert again.read_file_range(2, NAME, 0, 4 * SHARD) == t.bytes_of(2)
    # a crash inside the commit, after chain.json was written in the partial, before the
    # rename: the partial's files moved aside, so it is dropped and fetched again
    t3 = Trainer(tmp_path / "b", 2)
    s3 = _store(tmp_path / "b", t3)
    p3 = s3.begin(t3.manifests[2], 1)
    for ref in t3.manifests[2].header.shards:
        blob = (t3.dirs[2] / BLOB_DIR / f"{ref.index}.{codecs.SPARSE}").read_bytes()
        verify_and_write(p3, t3.manifests[2].shard(ref.index), codecs.SPARSE, _sink(blob),
                         None, "src")  # fmt: skip
    p3._close_fds()
    p3._write_chain()
    reopened = VersionStore(tmp_path / "b" / "recv", RUN, keep_last=8, durable=False)
    assert reopened.committed_steps() == [1]
    assert not reopened.has(2)
    fresh = reopened.begin(t3.manifests[2], 1)
    assert isinstance(fresh, PartialVersion)
    assert fresh.restored == 0


def test_a_crash_mid_materialization_leaves_the_chain_intact(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    _receive(store, t, 2)
    d = store.version_dir(2)
    (d / MATERIALIZE_DIR).mkdir()
    (d / MATERIALIZE_DIR / NAME).write_bytes(b"half")  # stopped while building
    again = VersionStore(tmp_path / "recv", RUN, keep_last=8, durable=False)
    assert again.committed_steps() == [1, 2]
    assert not (d / MATERIALIZE_DIR).exists()
    assert again.chain_of(2) is not None
    assert again.read_file_range(2, NAME, 0, 4 * SHARD) == t.bytes_of(2)


def test_a_chain_whose_base_is_gone_is_discarded_at_restart(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 3)
    store = _store(tmp_path, t)
    _receive(store, t, 2)
    _receive(store, t, 3)
    store.close()  # a clean stop: the next open only checks the chains' structure
    shutil.rmtree(store.version_dir(1))  # deleted behind the node's back
    again = VersionStore(tmp_path / "recv", RUN, keep_last=8, durable=False)
    assert again.committed_steps() == []  # 2 lost its base, 3 with it: never served
    assert sorted(again.damaged) == [2, 3]


def test_recovery_after_an_unclean_stop_verifies_chains(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    _receive(store, t, 2)
    assert (store.run_dir / ".open").exists()  # not closed: the next open recovers
    _corrupt(store, 1, 3 * SHARD + 1)
    again = VersionStore(tmp_path / "recv", RUN, keep_last=8, durable=False)
    assert again.committed_steps() == []  # 1 fails its file digest; 2 is built on it


def test_the_eager_switch_writes_full_files_as_before(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    final = _receive(store, t, 2, chain=False)
    assert not (final / CHAIN_FILE).exists()
    assert (final / NAME).read_bytes() == t.bytes_of(2)
    assert store.chained_files(2) == frozenset()
    ref = t.manifests[2].header.shards[1]
    assert store.read_shard(2, 1) == t.bytes_of(2, ref.file)[ref.offset :][: ref.length]


def test_a_partial_chain_serves_full_ranges_built_and_verified(tmp_path: Path) -> None:
    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    m = t.manifests[2]
    part = store.begin(m, 1)
    server = VersionServer(store, trust())
    server.add_live(part)
    for ref in m.header.shards:
        blob = (t.dirs[2] / BLOB_DIR / f"{ref.index}.{codecs.SPARSE}").read_bytes()
        verify_and_write(part, m.shard(ref.index), codecs.SPARSE, _sink(blob), None, "src")
    resp = _serve(server, m, SHARD - 5, 2 * SHARD + 4)
    assert getattr(resp, "status", None) == 206
    assert getattr(resp, "body", None) == t.bytes_of(2)[SHARD - 5 : 2 * SHARD + 5]
    path = f"/shardnet/v1/{RUN}/2/{m.digest}/shard/1/{codecs.SPARSE}"
    blob_resp = trio.run(server.handle, HttpRequest("GET", path, {}, {}, None))
    assert isinstance(blob_resp.body, FileSlice)  # the blob as received, from its file
    part.abort()


def test_anchors_materialize_in_a_low_priority_thread_and_keep_chains_short(
    tmp_path: Path,
) -> None:
    assert [should_materialize(d, 8) for d in (0, 7, 8, 9)] == [False, False, True, True]
    assert not should_materialize(100, 0)  # 0: only on demand
    t = Trainer(tmp_path, 3)
    store = _store(tmp_path, t, keep_last=1)
    _receive(store, t, 2)
    _receive(store, t, 3)
    assert store.materialize_low_priority(3)  # same result as materialize, own thread
    assert not store.materialize_low_priority(3)
    assert store.chain_depth(3) == 0
    assert store.prune() == [1, 2]  # the bases under the anchor can go now
    assert (store.version_dir(3) / NAME).read_bytes() == t.bytes_of(3)


def test_a_large_range_of_a_chain_is_served_after_materializing_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shardcast.serve.server as server_module

    t = Trainer(tmp_path, 2)
    store = _store(tmp_path, t)
    _receive(store, t, 2)
    monkeypatch.setattr(server_module, "MAX_BUILT_BYTES", SHARD)  # larger: not in memory
    server = VersionServer(store, trust())
    small = _serve(server, t.manifests[2], 0, SHARD - 1)
    assert (small.status, small.body) == (206, t.bytes_of(2)[:SHARD])
    assert store.chained_files(2) == {NAME}
    big = _serve(server, t.manifests[2], 0, 4 * SHARD - 1)
    assert big.status == 206
    assert isinstance(big.body, FileSlice)  # sent from the file, once it was built
    assert store.chained_files(2) == frozenset()
    assert (store.version_dir(2) / NAME).read_bytes() == t.bytes_of(2)
    assert big.body.on_done is not None
    big.body.on_done()  # the pin is released
