"""A version's kept blobs in one pack file (shardcast.store.blobpack)."""

from __future__ import annotations

import os
import random
from pathlib import Path

from shardcast.store.blobpack import (
    PACK_FILE,
    PACK_INDEX,
    BlobPack,
    BlobRef,
    find_blob,
    read_index,
)


def _blobs(n: int) -> list[bytes]:
    rng = random.Random(3)
    return [rng.randbytes(rng.randrange(1, 5000)) for _ in range(n)]


def test_blobs_are_appended_to_one_file_and_found_where_they_lie(tmp_path: Path) -> None:
    enc = tmp_path / ".enc"
    pack = BlobPack(enc)
    blobs = _blobs(20)
    refs = [pack.append(i, "sparse", b) for i, b in enumerate(blobs)]
    assert sorted(p.name for p in enc.iterdir()) == [PACK_FILE, PACK_INDEX]  # no file per blob
    for i, (ref, data) in enumerate(zip(refs, blobs, strict=True)):
        assert ref is not None
        assert ref.read() == data
        assert pack.ref(i, "sparse") == ref
        assert find_blob(enc, i, "sparse") == ref
    assert pack.ref(0, "xor-zstd") is None
    assert find_blob(enc, 0, "xor-zstd") is None
    pack.close()
    assert pack.append(99, "sparse", b"late") is None  # closed: nothing written
    assert find_blob(enc, 99, "sparse") is None


def test_a_blob_in_a_file_of_its_own_is_still_found(tmp_path: Path) -> None:
    enc = tmp_path / ".enc"
    enc.mkdir()
    (enc / "7.sparse").write_bytes(b"alone")  # an origin's blob, or a store from before packs
    assert find_blob(enc, 7, "sparse") == BlobRef(enc / "7.sparse", 0, 5)
    pack = BlobPack(enc)
    pack.append(8, "sparse", b"packed")
    assert find_blob(enc, 7, "sparse") == BlobRef(enc / "7.sparse", 0, 5)
    assert find_blob(enc, 8, "sparse") == BlobRef(enc / PACK_FILE, 0, 6)


def test_torn_lines_and_entries_past_the_pack_are_ignored(tmp_path: Path) -> None:
    enc = tmp_path / ".enc"
    pack = BlobPack(enc)
    pack.append(0, "sparse", b"a" * 10)
    pack.append(1, "sparse", b"b" * 10)
    pack.close()
    with open(enc / PACK_INDEX, "a") as fh:
        fh.write("2 sparse 20 10\n")  # listed, but its bytes never reached the pack
        fh.write("3 sparse x 1\nnot a line\n4 sp")  # garbage, then a torn last line
    assert read_index(enc) == {(0, "sparse"): (0, 10), (1, "sparse"): (10, 10)}
    os.truncate(enc / PACK_FILE, 15)  # cut inside blob 1
    assert read_index(enc) == {(0, "sparse"): (0, 10)}


def test_a_rewritten_index_is_read_again(tmp_path: Path) -> None:
    enc = tmp_path / ".enc"
    pack = BlobPack(enc)
    first = pack.append(0, "sparse", b"first")
    assert find_blob(enc, 0, "sparse") == first  # parsed, and kept
    pack.append(1, "sparse", b"second")
    assert find_blob(enc, 1, "sparse") is not None  # the index grew: parsed again
    pack.close()
    kept = {(1, "sparse"): read_index(enc)[(1, "sparse")]}
    BlobPack(enc, kept).close()  # a resumed download keeps only what it verified
    assert read_index(enc) == kept
    assert find_blob(enc, 0, "sparse") is None
    again = BlobPack(enc, kept)
    ref = again.append(2, "sparse", b"third")  # appended after what is there
    assert ref == BlobRef(enc / PACK_FILE, len(b"firstsecond"), 5)
    assert ref.read() == b"third"
