"""The standalone origin's watch over the files it published (shardcast/publish/published.py):
kept on disk, re-hashed when their fingerprint changes, quarantined only when bytes differ."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest

from shardcast.publish.plan import build_manifest
from shardcast.publish.published import (
    FINGERPRINTS_FILE,
    PublishedFiles,
    decode_fingerprints,
    encode_fingerprints,
)
from shardcast.store.store import VersionStore
from tests.helpers import TRAINER, make_checkpoint, trust

WEIGHTS = "model-00001-of-00001.safetensors"


def _store(root: Path, steps: range) -> VersionStore:
    store = VersionStore(root / "versions", "run", keep_last=4)
    for step in steps:
        ck = make_checkpoint(root / f"ck{step}", {WEIGHTS: 5000}, seed=step)
        store.adopt(ck, build_manifest(ck, "run", step, TRAINER, shard_size=1000))
    return store


def _rewrite(path: Path, at: int, data: bytes) -> None:
    with path.open("r+b") as f:  # in place: the same inode, as a trainer's in-place save
        f.seek(at)
        f.write(data)


def test_fingerprints_round_trip_and_bad_files_are_refused() -> None:
    held = {3: frozenset({("a", 1, 2, 3), ("b", 4, 5, 6)}), 1: frozenset()}
    assert decode_fingerprints(encode_fingerprints(held)) == (held, None)
    assert decode_fingerprints(encode_fingerprints(held, 7)) == (held, 7)
    for bad in (b"[]", b'{"schema": 2}', b'{"schema": 1, "steps": {"0": [["a", 1, 2]]}}',
                b'{"schema": 1, "steps": {"0": [["a", 1, true, 3]]}}', b"{",
                b'{"schema": 1, "steps": {}, "newest": -1}',
                b'{"schema": 1, "steps": {}, "newest": true}'):  # fmt: skip
        with pytest.raises(ValueError, match="bad fingerprint file"):
            decode_fingerprints(bad)


def test_a_file_changed_in_place_is_quarantined_a_touched_one_is_not(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    store = _store(tmp_path, range(2))
    files = PublishedFiles(store, trust())
    assert files.start() == []
    assert set(files.held) == {0, 1}
    # touched: a new mtime, the same bytes
    os.utime(store.version_dir(0) / WEIGHTS, ns=(1, 1))
    with caplog.at_level(logging.INFO):
        assert files.check() == []
    assert "published_files_touched step=0" in caplog.text
    assert store.has(0)
    # rewritten in place: other bytes
    _rewrite(store.version_dir(1) / WEIGHTS, 100, b"\x01" * 8)
    with caplog.at_level(logging.ERROR):
        assert files.check() == [1]
    assert f"published_files_changed step=1 files={WEIGHTS}" in caplog.text
    assert not store.has(1)
    assert set(files.held) == {0}
    held, newest = decode_fingerprints((store.run_dir / FINGERPRINTS_FILE).read_bytes())
    assert set(held) == {0}
    assert newest == files.newest == 1  # a quarantine does not lower it


def test_a_change_while_the_origin_was_down_is_found_at_start(tmp_path: Path) -> None:
    store = _store(tmp_path, range(3))
    PublishedFiles(store, trust()).start()  # the origin ran, kept its fingerprints, stopped
    _rewrite(store.version_dir(2) / WEIGHTS, 0, b"\x00" * 4)  # while it was down
    os.utime(store.version_dir(1) / WEIGHTS, ns=(5, 5))  # touched while down: no byte changed
    restarted = PublishedFiles(VersionStore(tmp_path / "versions", "run", keep_last=4), trust())
    assert restarted.start() == [2]
    assert set(restarted.held) == {0, 1}
    assert restarted.newest == 2


def test_the_newest_step_published_outlives_its_quarantine_across_restarts(
    tmp_path: Path,
) -> None:
    """The origin publishes WATCH steps after :attr:`PublishedFiles.newest`: a version
    quarantined at start must not lower it, or the rewritten step would be published again
    under its number (followers hold it with other bytes)."""
    store = _store(tmp_path, range(3))
    first = PublishedFiles(store, trust())
    first.start()
    assert first.newest == 2
    _rewrite(store.version_dir(2) / WEIGHTS, 0, b"\x00" * 4)  # while it was down
    second = PublishedFiles(VersionStore(tmp_path / "versions", "run", keep_last=4), trust())
    assert second.start() == [2]
    assert second.store.latest() == 1
    assert second.newest == 2
    third = PublishedFiles(VersionStore(tmp_path / "versions", "run", keep_last=4), trust())
    assert third.start() == []  # nothing held remembers step 2: only the file does
    assert third.newest == 2
    third.add(1)  # adding an older step (never done by the origin) does not lower it
    assert third.newest == 2


def test_a_copied_data_directory_serves_on(tmp_path: Path) -> None:
    """New inodes (the data directory copied elsewhere), the same bytes: nothing quarantined."""
    store = _store(tmp_path / "a", range(2))
    PublishedFiles(store, trust()).start()
    shutil.copytree(tmp_path / "a" / "versions", tmp_path / "b" / "versions")
    copied = VersionStore(tmp_path / "b" / "versions", "run", keep_last=4)
    files = PublishedFiles(copied, trust())
    assert files.start() == []
    assert copied.committed_steps() == [0, 1]


def test_an_unreadable_fingerprint_file_is_ignored(tmp_path: Path) -> None:
    store = _store(tmp_path, range(1))
    (store.run_dir / FINGERPRINTS_FILE).write_bytes(b"not json")
    files = PublishedFiles(store, trust())
    assert files.start() == []  # fingerprinted as the files are now, and kept
    held, newest = decode_fingerprints((store.run_dir / FINGERPRINTS_FILE).read_bytes())
    assert set(held) == {0}
    assert newest == files.newest == 0
