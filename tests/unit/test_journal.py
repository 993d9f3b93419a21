"""Restarts keep verified work: the journal of verified shards of a partial version."""

from __future__ import annotations

import os
from pathlib import Path

from shardcast.publish.plan import build_manifest
from shardcast.store import VersionStore
from shardcast.store.partial import JOURNAL_FILE
from shardcast.wire.have import shard_bits
from shardcast.wire.manifest import Manifest
from tests.helpers import TRAINER, make_checkpoint

SIZES = {"model-00001-of-00002.safetensors": 4096, "model-00002-of-00002.safetensors": 2500}


def _setup(tmp_path: Path, step: int = 1) -> tuple[Path, Manifest]:
    ck = make_checkpoint(tmp_path / f"src{step}", SIZES, seed=step)
    return ck, build_manifest(ck, "run", step, TRAINER, shard_size=1000, shards_per_part=3)


def _bytes(ck: Path, m: Manifest, i: int) -> bytes:
    s = m.header.shards[i]
    return (ck / s.file).read_bytes()[s.offset : s.offset + s.length]


def _store(tmp_path: Path) -> VersionStore:
    return VersionStore(tmp_path / "store", "run", keep_last=2, durable=False)


def test_restart_keeps_journaled_shards_and_commits(tmp_path: Path) -> None:
    ck, m = _setup(tmp_path)
    part = _store(tmp_path).begin(m)
    for i in (0, 2, 5):
        assert part.write_shard(i, _bytes(ck, m, i))
    # SIGKILL: nothing is closed; a new process opens the store and begins the same version
    part2 = _store(tmp_path).begin(m)
    assert part2.restored == 3
    assert [i for i, ok in enumerate(part2.have_bitmap()) if ok] == [0, 2, 5]
    for i in range(len(m.header.shards)):
        part2.write_shard(i, _bytes(ck, m, i))  # the kept ones are not written again
    final = part2.commit()
    assert not (final / JOURNAL_FILE).exists()
    for f in m.header.files:
        assert (final / f.name).read_bytes() == (ck / f.name).read_bytes()


def test_the_have_bitmap_follows_every_shard_written_and_restored(tmp_path: Path) -> None:
    ck, m = _setup(tmp_path)
    n = len(m.header.shards)
    part = _store(tmp_path).begin(m)
    assert part.have_bits() == bytes((n + 7) // 8)
    for i in (7, 0, 5):
        assert part.write_shard(i, _bytes(ck, m, i))
        assert part.have_bits() == shard_bits(n, part.has)  # what one has() per shard gives
    assert part.have_bits() == shard_bits(n, {0, 5, 7}.__contains__)
    part2 = _store(tmp_path).begin(m)  # restored from the journal
    assert part2.have_bits() == shard_bits(n, {0, 5, 7}.__contains__)


def test_journaled_shard_whose_bytes_changed_is_fetched_again(tmp_path: Path) -> None:
    ck, m = _setup(tmp_path)
    part = _store(tmp_path).begin(m)
    for i in (0, 1):
        part.write_shard(i, _bytes(ck, m, i))
    part.close()
    s = m.header.shards[1]
    with open(part.dir / s.file, "r+b") as fh:  # torn write / disk damage after the journal
        fh.seek(s.offset)
        fh.write(b"\x00" * 8)
    part2 = _store(tmp_path).begin(m)
    assert part2.have_bitmap()[:2] == [True, False]
    assert part2.restored == 1


def test_torn_journal_and_wrong_file_size(tmp_path: Path) -> None:
    ck, m = _setup(tmp_path)
    part = _store(tmp_path).begin(m)
    part.write_shard(0, _bytes(ck, m, 0))
    part.close()
    with open(part.dir / JOURNAL_FILE, "a") as fh:
        fh.write("3 abc")  # a torn last line is ignored
    assert _store(tmp_path).begin(m).restored == 1
    os.truncate(part.dir / m.header.files[0].name, 10)  # inconsistent: start afresh
    part3 = _store(tmp_path).begin(m)
    assert part3.restored == 0
    assert part3.missing == len(m.header.shards)


def test_other_publication_or_older_partials_are_not_resumed(tmp_path: Path) -> None:
    ck, m = _setup(tmp_path)
    part = _store(tmp_path).begin(m)
    part.write_shard(0, _bytes(ck, m, 0))
    _ck2, other = _setup(tmp_path / "again")  # same step, another publication (digest)
    assert other.digest != m.digest
    assert _store(tmp_path).begin(other).restored == 0
    # a partial without a journal is removed when the store opens
    (part.dir / JOURNAL_FILE).unlink()
    store = _store(tmp_path)
    assert not part.dir.exists()
    # beginning a newer version removes partials of older ones that are not open
    _ck2, m2 = _setup(tmp_path, step=2)
    p1 = store.begin(m)
    p1.write_shard(0, _bytes(ck, m, 0))
    p1.close()
    store.begin(m2)
    assert not p1.dir.exists()


def test_vanished_data_directory_starts_over(tmp_path: Path) -> None:
    import shutil

    ck, m = _setup(tmp_path)
    store = _store(tmp_path)
    part = store.begin(m)
    part.write_shard(0, _bytes(ck, m, 0))
    shutil.rmtree(tmp_path / "store")
    part.abort()
    part2 = store.begin(m)  # recreates the run directory (and the open marker)
    for i in range(len(m.header.shards)):
        part2.write_shard(i, _bytes(ck, m, i))
    assert part2.commit() == store.version_dir(1)
    assert (store.run_dir / ".open").exists()


def test_origin_republishing_unchanged_files_keeps_the_digest(tmp_path: Path) -> None:
    """An origin restarted mid-publish signs the same header (same digest) for the same,
    unchanged directory; a changed directory gets a new digest."""
    from shardcast.publish.origin import stable_header
    from shardcast.publish.plan import make_header
    from shardcast.wire.manifest import sign_header

    ck = make_checkpoint(tmp_path / "ck", SIZES, seed=1)
    record = tmp_path / ".publishing-step-1.json"
    first = stable_header(record, ck, make_header(ck, "run", 1, 1000, 3))
    again = stable_header(record, ck, make_header(ck, "run", 1, 1000, 3))  # after a restart
    assert sign_header(again, TRAINER).digest == sign_header(first, TRAINER).digest
    name = next(iter(SIZES))
    os.utime(ck / name, ns=(1, 1))  # rewritten by the trainer meanwhile
    changed = stable_header(record, ck, make_header(ck, "run", 1, 1000, 3))
    assert changed.nonce != first.nonce
