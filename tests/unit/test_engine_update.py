"""In-place engine updates on TransformersEngine: bit-exact against loading the materialized
version over several delta steps, and every refusal keeps the old weights (a full load then
gives the right version)."""

from __future__ import annotations

import itertools
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from rollout.delta_plan import DeltaMismatch, MismatchReason, TensorPatch, UpdatePlan
from rollout.engine import TransformersEngine
from rollout.model import build_model, build_tokenizer, load_model, stored_state, tensor_files
from shardcast.core import Stage, StageCpu
from shardcast.store.store import BLOB_DIR, VersionStore
from shardcast.wire import codecs
from shardnet.engine_update import HeldVersion, SwapPath, gather_changes, swap_weights
from tests.delta_chain import RUN, Chain, evolve, publish, receive_as_chain
from tests.helpers import drop_blob, rot_blob
from trainer.checkpoint import save_checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def bits(model: torch.nn.Module) -> dict[str, bytes]:
    return {
        n: t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        for n, t in stored_state(model).items()
    }


def assert_holds(engine: TransformersEngine, directory: Path, dtype: torch.dtype) -> None:
    want = bits(load_model(directory, dtype))
    got = bits(engine.model)
    assert got.keys() == want.keys()
    assert [n for n in want if got[n] != want[n]] == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_in_place_updates_are_bit_identical_to_loading_each_version(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    chain = Chain(tmp_path, dtype, steps=3)
    assert len(tensor_files(chain.store.version_dir(0))) > 1  # several weight files
    engine = TransformersEngine(dtype)
    first = chain.swap(engine, 0, None)
    assert (first.path, first.fallback) == (SwapPath.FULL, None)
    held = first.held
    for step in (1, 2, 3):
        result = chain.swap(engine, step, held)
        assert result.path is SwapPath.IN_PLACE, result.fallback
        assert result.changed_words > 0
        assert engine.checkpoint_dir == chain.store.version_dir(step)
        assert_holds(engine, chain.store.version_dir(step), dtype)
        held = result.held


def test_a_swap_charges_engine_update_on_the_nodes_account(tmp_path: Path) -> None:
    chain = Chain(tmp_path, torch.bfloat16, steps=1)
    engine = TransformersEngine(torch.bfloat16)
    readings = itertools.count()  # a fake CPU clock, 1 s per reading (safe across threads)
    cpu = StageCpu(lambda: float(next(readings)))
    held = None
    for step in (0, 1):  # a full load, then in place (decoding threads wrapped as well)
        m = chain.manifests[step]
        result = swap_weights(engine, chain.store, m, chain.store.version_dir(step), held, cpu)
        held = result.held
        charged = cpu.statistics().seconds
        assert charged[Stage.ENGINE_UPDATE] > 0
        assert sum(charged.values()) == charged[Stage.ENGINE_UPDATE]
    assert result.path is SwapPath.IN_PLACE


def test_a_skipped_version_falls_back_to_a_full_load(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    chain = Chain(tmp_path, torch.bfloat16, steps=2)
    engine = TransformersEngine()
    held = chain.swap(engine, 0, None).held
    assert held is not None
    before = bits(engine.model)
    with pytest.raises(DeltaMismatch) as err:  # a delta of 1; the engine holds 0
        gather_changes(chain.store, chain.manifests[2], held)
    assert err.value.reason is MismatchReason.BASE
    assert err.value.what == "step 2 is a delta of 1, the engine holds 0"
    assert bits(engine.model) == before
    with caplog.at_level("INFO", logger="shardnet.engine_update"):
        result = chain.swap(engine, 2, held)
    assert (result.path, result.fallback) == (SwapPath.FULL, MismatchReason.BASE)
    assert_holds(engine, chain.store.version_dir(2), torch.bfloat16)
    # an expected fallback is said plainly: the reason code, then the detail, no "integrity"
    (line,) = [r.getMessage() for r in caplog.records if "in_place_update_refused" in r.msg]
    assert line == (
        "in_place_update_refused step=2 reason=base detail=step 2 is a delta of 1, "
        "the engine holds 0"
    )
    # a full version (an anchor: no delta base) is named as one
    assert result.held is not None
    with pytest.raises(DeltaMismatch) as err:
        gather_changes(chain.store, chain.manifests[0], result.held)
    assert (err.value.reason, err.value.what) == (
        MismatchReason.BASE,
        "step 0 is a full version (no delta base)",
    )


@pytest.mark.parametrize(
    ("damage", "reason"),
    [("remove", MismatchReason.ENCODING), ("flip", MismatchReason.BLOB)],
)
def test_a_missing_or_damaged_blob_falls_back_to_a_full_load(
    tmp_path: Path, damage: str, reason: MismatchReason
) -> None:
    chain = Chain(tmp_path, torch.bfloat16, steps=1)
    engine = TransformersEngine()
    held = chain.swap(engine, 0, None).held
    enc_dir = chain.store.version_dir(1) / BLOB_DIR
    m = chain.manifests[1]
    sparse = [r.index for r in m.header.shards if m.shard(r.index).offered(codecs.SPARSE)]
    index = sparse[len(sparse) // 2]
    if damage == "remove":
        drop_blob(enc_dir, index, codecs.SPARSE)  # as if that shard had been received raw
    else:
        ref = chain.store.blob_ref(1, index, codecs.SPARSE)
        assert ref is not None
        rot_blob(ref)
    result = chain.swap(engine, 1, held)
    assert (result.path, result.fallback) == (SwapPath.FULL, reason)
    assert_holds(engine, chain.store.version_dir(1), torch.bfloat16)


def test_a_checkpoint_dtype_the_engine_casts_falls_back_to_a_full_load(tmp_path: Path) -> None:
    chain = Chain(tmp_path, torch.float32, steps=1)  # fp32 checkpoint, bf16 engine
    engine = TransformersEngine(torch.bfloat16)
    held = chain.swap(engine, 0, None).held
    result = chain.swap(engine, 1, held)
    assert (result.path, result.fallback) == (SwapPath.FULL, MismatchReason.DTYPE)
    assert_holds(engine, chain.store.version_dir(1), torch.bfloat16)


def test_a_changed_tokenizer_falls_back_to_a_full_load(tmp_path: Path) -> None:
    chain = Chain(tmp_path, torch.bfloat16, steps=0)
    engine = TransformersEngine()
    held = chain.swap(engine, 0, None).held
    nxt = tmp_path / "src-1"
    evolve(chain.store.version_dir(0), nxt, random.Random(1), 0.01)
    config = nxt / "tokenizer_config.json"
    config.write_text(config.read_text().replace('"backend"', '"Backend"'))  # same size
    chain.manifests.append(publish(chain.store, nxt, 1, chain.manifests[0]))
    result = chain.swap(engine, 1, held)
    assert (result.path, result.fallback) == (SwapPath.FULL, MismatchReason.OTHER_FILE)
    assert_holds(engine, chain.store.version_dir(1), torch.bfloat16)


def _patch(name: str, shape: tuple[int, ...], dtype: str = "BF16") -> TensorPatch:
    empty = np.zeros(0, np.int64)
    return TensorPatch(
        name, dtype, shape, np.array([0], np.int64), np.array([1], np.uint16), empty,
        np.zeros(0, np.uint8),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("bad", "reason"),
    [
        (_patch("model.layers.9.mlp.up_proj.weight", (384, 128)), MismatchReason.MISSING_TENSOR),
        (_patch("model.norm.weight", (64,)), MismatchReason.SHAPE),
        (_patch("model.norm.weight", (128,), "F32"), MismatchReason.DTYPE),
    ],
)
def test_a_plan_that_does_not_fit_keeps_the_old_weights(
    tmp_path: Path, bad: TensorPatch, reason: MismatchReason
) -> None:
    directory = tmp_path / "v0"
    save_checkpoint(build_model("tiny", 0, torch.float32), build_tokenizer(), directory, 1 << 30)
    engine = TransformersEngine()
    engine.load(directory)
    before = bits(engine.model)
    good = _patch("model.embed_tokens.weight", (128, 128))  # valid, listed first
    with pytest.raises(DeltaMismatch) as err:
        engine.apply_update(UpdatePlan((good, bad)), tmp_path / "v1")
    assert err.value.reason is reason
    assert bits(engine.model) == before
    assert engine.checkpoint_dir == directory


def test_a_layout_the_engine_does_not_hold_is_refused_before_any_write(tmp_path: Path) -> None:
    chain = Chain(tmp_path, torch.bfloat16, steps=1)
    engine = TransformersEngine()
    held = chain.swap(engine, 0, None).held
    assert held is not None
    name, layout = next(iter(held.layouts.items()))
    t = layout.tensors[0]
    other = type(t)(f"{t.name}.extra", t.dtype, t.shape, t.start, t.end)
    forged = HeldVersion(held.manifest, {**held.layouts, name: type(layout)(
        layout.size, layout.data_start, (other, *layout.tensors[1:]))})  # fmt: skip
    result = chain.swap(engine, 1, forged)
    assert (result.path, result.fallback) == (SwapPath.FULL, MismatchReason.MISSING_TENSOR)
    assert_holds(engine, chain.store.version_dir(1), torch.bfloat16)


def test_versions_kept_as_chains_update_in_place_from_blobs_and_load_materialized(
    tmp_path: Path,
) -> None:
    """A peer's store keeps each next version as a chain (no full file written): the in-place
    update reads only its blobs (the chain stays a chain); a version the engine cannot take in
    place (a skipped one) is materialized, every shard verified, then loaded in full."""
    chain = Chain(tmp_path, torch.bfloat16, steps=3)
    peer = VersionStore(tmp_path / "peer", RUN, keep_last=8, durable=False)
    shutil.copytree(
        chain.store.version_dir(0), tmp_path / "v0", ignore=shutil.ignore_patterns(BLOB_DIR)
    )
    peer.adopt(tmp_path / "v0", chain.manifests[0])
    for step in (1, 2, 3):
        receive_as_chain(chain.store, chain.manifests[step], peer)
        assert peer.chained_files(step)  # the weights: blobs only
    engine = TransformersEngine(torch.bfloat16)
    held = swap_weights(engine, peer, chain.manifests[0], peer.version_dir(0), None).held
    one = swap_weights(engine, peer, chain.manifests[1], peer.version_dir(1), held)
    assert one.path is SwapPath.IN_PLACE, one.fallback
    assert peer.chained_files(1)  # not materialized: no base byte read, no file written
    assert_holds(engine, chain.store.version_dir(1), torch.bfloat16)
    three = swap_weights(engine, peer, chain.manifests[3], peer.version_dir(3), one.held)
    assert (three.path, three.fallback) == (SwapPath.FULL, MismatchReason.BASE)
    assert peer.chained_files(3) == frozenset()  # materialized for the full load
    assert_holds(engine, chain.store.version_dir(3), torch.bfloat16)
