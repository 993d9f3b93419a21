"""rollout.delta_plan: safetensors layouts, sparse shard changes → per-tensor patches, and the
typed refusals (pure: numpy only, no torch)."""

from __future__ import annotations

import json
import random
import struct

import numpy as np
import pytest

from rollout.delta_plan import (
    DeltaMismatch,
    FileLayout,
    MismatchReason,
    ShardChanges,
    TensorSpec,
    parse_layout,
    plan_update,
)
from shardcast.wire import codecs


def safetensors_bytes(tensors: list[tuple[str, str, tuple[int, ...], int]], seed: int = 0) -> bytes:
    """A safetensors file of ``(name, dtype, shape, itemsize)`` in order, random contents,
    header padded to 8 bytes (as safetensors writes it)."""
    rng = random.Random(seed)
    header, off = {}, 0
    for name, dtype, shape, size in tensors:
        n = int(np.prod(shape)) * size
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + rng.randbytes(off)


def specs_of(layout: FileLayout) -> dict[str, TensorSpec]:
    return {t.name: TensorSpec(t.dtype, t.shape) for t in layout.tensors}


def shard_changes(name: str, old: bytes, new: bytes, shard: int) -> list[ShardChanges]:
    """Encode ``new`` against ``old`` as sparse shards of ``shard`` bytes and decode them."""
    out = []
    for off in range(0, len(new), shard):
        a, b = new[off : off + shard], old[off : off + shard]
        blob = codecs.encode(codecs.SPARSE, a, b)
        out.append(ShardChanges.from_sparse(name, off, len(a), blob))
    return out


def apply(layout: FileLayout, data: bytes, plan_patches: object) -> bytes:
    """Apply a plan to a copy of the file's bytes (what an engine does to its tensors)."""
    buf = bytearray(data)
    by_name = {t.name: t for t in layout.tensors}
    for p in plan_patches:  # type: ignore[attr-defined]
        span = by_name[p.name]
        raw = np.frombuffer(memoryview(buf)[span.start : span.end], dtype=np.uint8)
        if len(p.words):
            w = raw.view("<u2")
            w[p.words] += p.diffs
        raw[p.byte_index] = p.byte_value
    return bytes(buf)


TENSORS = [
    ("a", "BF16", (3, 5), 2),
    ("b", "F32", (7,), 4),
    ("c", "I64", (2, 3), 8),
    ("d", "BF16", (1,), 2),
    ("e", "F16", (11,), 2),
]


@pytest.mark.parametrize("shard", [2, 6, 16, 64, 4096])
def test_plan_reproduces_the_new_bytes_for_every_dtype_and_edge(shard: int) -> None:
    old = safetensors_bytes(TENSORS)
    layout = parse_layout(old, len(old))
    new = bytearray(old)
    rng = random.Random(shard)
    for t in layout.tensors:  # first and last word of every tensor, and a random one
        for at in (t.start, t.end - 2, rng.randrange(t.start, t.end, 2)):
            struct.pack_into("<H", new, at, (struct.unpack_from("<H", new, at)[0] + 1) % 65536)
    plan = plan_update({"m": layout}, shard_changes("m", old, bytes(new), shard), specs_of(layout))
    assert {p.name for p in plan.patches} == {t.name for t in layout.tensors}
    assert apply(layout, old, plan.patches) == bytes(new)


def test_unchanged_shards_plan_nothing() -> None:
    old = safetensors_bytes(TENSORS)
    layout = parse_layout(old, len(old))
    plan = plan_update({"m": layout}, shard_changes("m", old, old, 32), specs_of(layout))
    assert plan.patches == ()
    assert plan.changed_words == 0


def test_tail_byte_of_an_odd_file_becomes_a_byte_patch() -> None:
    old = safetensors_bytes([("x", "BF16", (4,), 2), ("y", "U8", (5,), 1)])
    assert len(old) % 2 == 1
    layout = parse_layout(old, len(old))
    new = bytearray(old)
    new[-1] ^= 0xFF
    plan = plan_update({"m": layout}, shard_changes("m", old, bytes(new), 8), specs_of(layout))
    assert apply(layout, old, plan.patches) == bytes(new)
    (patch,) = plan.patches
    assert (patch.name, list(patch.byte_index)) == ("y", [4])


def test_a_changed_header_word_is_a_layout_change() -> None:
    old = safetensors_bytes(TENSORS)
    layout = parse_layout(old, len(old))
    new = bytearray(old)
    new[10] ^= 1
    with pytest.raises(DeltaMismatch) as err:
        plan_update({"m": layout}, shard_changes("m", old, bytes(new), 64), specs_of(layout))
    assert err.value.reason is MismatchReason.LAYOUT


def test_a_word_straddling_tensors_is_refused() -> None:
    # "u" has 3 bytes, so "v" starts at an odd offset: its words are not whole words of the file
    old = safetensors_bytes([("u", "U8", (3,), 1), ("v", "BF16", (4,), 2)])
    layout = parse_layout(old, len(old))
    new = bytearray(old)
    new[layout.tensors[1].start + 2] ^= 1
    with pytest.raises(DeltaMismatch) as err:
        plan_update({"m": layout}, shard_changes("m", old, bytes(new), 64), specs_of(layout))
    assert err.value.reason is MismatchReason.LAYOUT


@pytest.mark.parametrize(
    ("specs", "reason"),
    [
        ({"a": TensorSpec("BF16", (3, 5))}, MismatchReason.MISSING_TENSOR),
        ({**{t[0]: TensorSpec(t[1], t[2]) for t in TENSORS}, "a": TensorSpec("BF16", (5, 3))},
         MismatchReason.SHAPE),
        ({**{t[0]: TensorSpec(t[1], t[2]) for t in TENSORS}, "b": TensorSpec("BF16", (7,))},
         MismatchReason.DTYPE),
    ],
)  # fmt: skip
def test_a_delta_that_does_not_fit_the_loaded_model_is_refused(
    specs: dict[str, TensorSpec], reason: MismatchReason
) -> None:
    old = safetensors_bytes(TENSORS)
    layout = parse_layout(old, len(old))
    new = bytearray(old)
    for t in layout.tensors:
        new[t.start] ^= 1
    with pytest.raises(DeltaMismatch) as err:
        plan_update({"m": layout}, shard_changes("m", old, bytes(new), 64), specs)
    assert err.value.reason is reason


def test_a_dtype_difference_in_an_unchanged_tensor_does_not_matter() -> None:
    old = safetensors_bytes(TENSORS)
    layout = parse_layout(old, len(old))
    new = bytearray(old)
    new[layout.tensors[0].start] ^= 1  # only "a" changes; "b" is held as bf16 (cast on load)
    specs = {**specs_of(layout), "b": TensorSpec("BF16", (7,))}
    plan = plan_update({"m": layout}, shard_changes("m", old, bytes(new), 64), specs)
    assert [p.name for p in plan.patches] == ["a"]


def test_shards_of_unknown_files_or_outside_the_file_are_refused() -> None:
    old = safetensors_bytes(TENSORS)
    layout = parse_layout(old, len(old))
    (ch,) = shard_changes("m", old, old, len(old))
    with pytest.raises(DeltaMismatch) as err:
        plan_update({"other": layout}, [ch], specs_of(layout))
    assert err.value.reason is MismatchReason.FILES
    moved = ShardChanges("m", 2, len(old), ch.index, ch.diff)
    with pytest.raises(DeltaMismatch) as err:
        plan_update({"m": layout}, [moved], specs_of(layout))
    assert err.value.reason is MismatchReason.FILES


def test_overlapping_shards_are_refused() -> None:
    old = safetensors_bytes(TENSORS)
    layout = parse_layout(old, len(old))
    new = bytearray(old)
    new[layout.tensors[0].start] ^= 1
    twice = shard_changes("m", old, bytes(new), len(old)) * 2
    with pytest.raises(DeltaMismatch) as err:
        plan_update({"m": layout}, twice, specs_of(layout))
    assert err.value.reason is MismatchReason.LAYOUT


@pytest.mark.parametrize(
    "prefix",
    [
        b"\x01",
        struct.pack("<Q", 1 << 40),
        struct.pack("<Q", 4) + b"nope",
        struct.pack("<Q", 2) + b"[]",
        struct.pack("<Q", 64)
        + json.dumps({"t": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 1]}}).encode(),
        struct.pack("<Q", 64)
        + json.dumps({"t": {"dtype": "BF16", "shape": [2], "data_offsets": [0, 2]}}).encode(),
    ],
)
def test_malformed_headers_are_layout_errors(prefix: bytes) -> None:
    with pytest.raises(DeltaMismatch) as err:
        parse_layout(prefix.ljust(72, b" "), 1000)
    assert err.value.reason is MismatchReason.LAYOUT


def test_a_sparse_blob_that_does_not_decode_is_a_blob_error() -> None:
    with pytest.raises(DeltaMismatch) as err:
        ShardChanges.from_sparse("m", 0, 100, b"SPD1garbage")
    assert err.value.reason is MismatchReason.BLOB
