"""Presets, tokenizer and checkpoint layout: save → load round trips and strict loading."""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from p2p.errors import ConfigError, IntegrityError, LocalProtocolError
from rollout.model import (
    INDEX_NAME,
    SINGLE_WEIGHTS_NAME,
    TOKENIZER_VOCAB_SIZE,
    CheckpointMismatch,
    build_model,
    build_tokenizer,
    load_model,
    load_weights,
    shard_name,
)
from trainer.checkpoint import plan_shards, save_checkpoint


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def tiny32() -> torch.nn.Module:
    return build_model("tiny", seed=0, dtype=torch.float32)


def _same_state(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(
        sa[k].dtype == sb[k].dtype and torch.equal(sa[k], sb[k]) for k in sa
    )


def test_tokenizer_ids_and_offline_reload(tmp_path: Path) -> None:
    tok = build_tokenizer()
    assert len(tok) == TOKENIZER_VOCAB_SIZE
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("ab 7\n")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert len(ids) == 6
    assert tok.decode(ids, skip_special_tokens=True) == "ab 7\n"
    assert tok("é")["input_ids"] == [1, 3]
    tok.save_pretrained(str(tmp_path))
    again = AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert again("count 3 keys:")["input_ids"] == tok("count 3 keys:")["input_ids"]
    assert again.eos_token_id == tok.eos_token_id


def test_build_model_seeded_and_rng_restored(tiny32: torch.nn.Module) -> None:
    torch_state, py_state = torch.random.get_rng_state(), random.getstate()
    again = build_model("tiny", seed=0, dtype=torch.float32)
    other = build_model("tiny", seed=1, dtype=torch.float32)
    assert torch.equal(torch_state, torch.random.get_rng_state())
    assert py_state == random.getstate()
    assert _same_state(tiny32, again)
    assert not torch.equal(
        tiny32.state_dict()["lm_head.weight"], other.state_dict()["lm_head.weight"]
    )
    bf16: Any = build_model("tiny", seed=0)
    for name, tensor in bf16.state_dict().items():
        assert tensor.dtype == torch.bfloat16
        assert torch.equal(tensor, tiny32.state_dict()[name].to(torch.bfloat16))
    assert bf16.model.rotary_emb.inv_freq.dtype == torch.float32  # not rounded to bf16
    params = sum(p.numel() for p in tiny32.parameters())
    assert params == 820_352
    assert bf16.config.hidden_size >= 128  # TOPLOC: >= k = 128 values per chunk


def test_unknown_preset() -> None:
    with pytest.raises(ConfigError) as info:
        build_model("huge", seed=0)
    assert info.value.field == "model.preset"


def test_single_file_round_trip_bit_identical(tmp_path: Path, tiny32: torch.nn.Module) -> None:
    files = save_checkpoint(tiny32, build_tokenizer(), tmp_path / "c", max_shard_bytes=1 << 30)
    names = [p.name for p in files]
    assert names == sorted(names)
    assert {"config.json", "generation_config.json", SINGLE_WEIGHTS_NAME, "tokenizer.json"} <= set(
        names
    )
    assert INDEX_NAME not in names
    loaded = load_model(tmp_path / "c")
    assert _same_state(loaded, build_model("tiny", seed=0))
    assert json.loads((tmp_path / "c" / "config.json").read_text())["dtype"] == "bfloat16"
    # transformers reads the same directory as is
    auto: Any = AutoModelForCausalLM
    hf, info = auto.from_pretrained(
        str(tmp_path / "c"), dtype=torch.bfloat16, output_loading_info=True
    )
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]
    assert not info["mismatched_keys"]
    assert _same_state(hf, loaded)
    assert _same_state(load_model(tmp_path / "c", dtype=torch.float32), loaded.float())


def test_sharded_layout_and_deterministic_bytes(tmp_path: Path, tiny32: torch.nn.Module) -> None:
    tok = build_tokenizer()
    first = save_checkpoint(tiny32, tok, tmp_path / "a", max_shard_bytes=300_000)
    second = save_checkpoint(tiny32, tok, tmp_path / "b", max_shard_bytes=300_000)
    shards = [p.name for p in first if p.name.startswith("model-")]
    assert shards == [shard_name(k, 6) for k in range(1, 7)]
    assert (tmp_path / "a" / INDEX_NAME).is_file()
    assert not (tmp_path / "a" / SINGLE_WEIGHTS_NAME).exists()
    for a, b in zip(first, second, strict=True):
        assert a.name == b.name
        assert a.read_bytes() == b.read_bytes(), a.name
    index = json.loads((tmp_path / "a" / INDEX_NAME).read_text())
    state = build_model("tiny", seed=0).state_dict()
    assert set(index["weight_map"]) == set(state)
    assert index["metadata"]["total_size"] == sum(t.numel() * 2 for t in state.values())
    for name in shards:
        # tensor bytes per shard stay under the cap (every tensor here is below it)
        assert sum(t.numel() * 2 for t in load_file(tmp_path / "a" / name).values()) <= 300_000
    assert _same_state(load_model(tmp_path / "a"), build_model("tiny", seed=0))


def test_plan_shards() -> None:
    sizes = [("a", 4), ("b", 4), ("c", 10), ("d", 1), ("e", 1)]
    assert plan_shards(sizes, 8) == [["a", "b"], ["c"], ["d", "e"]]
    assert plan_shards(sizes, 100) == [["a", "b", "c", "d", "e"]]
    assert plan_shards([], 8) == []
    with pytest.raises(LocalProtocolError):
        plan_shards(sizes, 0)


def test_save_refuses_non_empty_directory(tmp_path: Path, tiny32: torch.nn.Module) -> None:
    (tmp_path / "stale.safetensors").write_bytes(b"x")
    with pytest.raises(LocalProtocolError):
        save_checkpoint(tiny32, build_tokenizer(), tmp_path, max_shard_bytes=1 << 30)


@pytest.fixture
def sharded(tmp_path: Path, tiny32: torch.nn.Module) -> Path:
    directory = tmp_path / "ckpt"
    save_checkpoint(tiny32, build_tokenizer(), directory, max_shard_bytes=300_000)
    return directory


def _rewrite_shard(directory: Path, edit: str) -> None:
    """Edit the shard holding ``lm_head.weight``: drop it, reshape it, or add a stray tensor."""
    index = json.loads((directory / INDEX_NAME).read_text())
    path = directory / index["weight_map"]["lm_head.weight"]
    tensors = dict(load_file(path))
    if edit == "missing":
        del tensors["lm_head.weight"]
    elif edit == "shape":
        tensors["lm_head.weight"] = tensors["lm_head.weight"][:, :64].contiguous()
    elif edit == "unexpected":
        tensors["extra.weight"] = torch.zeros(2, dtype=torch.bfloat16)
    path.unlink()
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.mark.parametrize("edit", ["missing", "shape", "unexpected"])
def test_load_rejects_edited_shard(sharded: Path, edit: str) -> None:
    _rewrite_shard(sharded, edit)
    with pytest.raises(CheckpointMismatch):
        load_model(sharded)


def test_single_file_rejects_stray_and_missing(tmp_path: Path, tiny32: torch.nn.Module) -> None:
    save_checkpoint(tiny32, build_tokenizer(), tmp_path, max_shard_bytes=1 << 30)
    path = tmp_path / SINGLE_WEIGHTS_NAME
    tensors = dict(load_file(path))
    save_file({**tensors, "extra.bias": torch.zeros(1)}, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match="unexpected"):
        load_model(tmp_path)
    del tensors["model.norm.weight"]
    save_file(tensors, str(path), metadata={"format": "pt"})
    with pytest.raises(CheckpointMismatch, match="missing"):
        load_model(tmp_path)


def test_load_rejects_inconsistent_index_and_files(sharded: Path, tiny32: torch.nn.Module) -> None:
    index_path = sharded / INDEX_NAME
    index = json.loads(index_path.read_text())
    # index entry removed although the shard still holds the tensor
    del index["weight_map"]["lm_head.weight"]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointMismatch):
        load_model(sharded)
    # a listed shard is gone
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = "model-00099-of-00099.safetensors"
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointMismatch):
        load_model(sharded)
    index_path.write_text("{not json")
    with pytest.raises(CheckpointMismatch):
        load_model(sharded)
    index_path.unlink()  # no index and no model.safetensors
    with pytest.raises(CheckpointMismatch):
        load_model(sharded)


def test_load_rejects_missing_config_and_garbage(sharded: Path) -> None:
    shard = sharded / shard_name(1, 6)
    shard.write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(CheckpointMismatch):
        load_model(sharded)
    (sharded / "config.json").unlink()
    with pytest.raises(IntegrityError):  # CheckpointMismatch is an IntegrityError
        load_model(sharded)


def test_load_weights_in_place(tmp_path: Path, tiny32: torch.nn.Module) -> None:
    tok = build_tokenizer()
    save_checkpoint(build_model("tiny", 1, torch.float32), tok, tmp_path / "v1", 1 << 30)
    model = build_model("tiny", seed=0)
    load_weights(model, tmp_path / "v1")
    assert _same_state(model, build_model("tiny", seed=1))


@pytest.mark.slow
def test_real_1b_build_save_load() -> None:
    root = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    directory = root / f"shardnet-real1b-{time.monotonic_ns()}"
    try:
        start = time.perf_counter()
        model = build_model("real-1b", seed=0)
        build_s = time.perf_counter() - start
        param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert param_bytes >= 1 << 30
        start = time.perf_counter()
        files = save_checkpoint(model, build_tokenizer(), directory, max_shard_bytes=256 << 20)
        save_s = time.perf_counter() - start
        weight_bytes = sum(p.stat().st_size for p in files if p.suffix == ".safetensors")
        del model
        start = time.perf_counter()
        loaded: Any = load_model(directory)
        load_s = time.perf_counter() - start
        assert loaded.config.vocab_size == 32000
        print(
            f"real-1b: params_bytes={param_bytes} weight_files={weight_bytes} "
            f"shards={sum(p.suffix == '.safetensors' for p in files)} build_s={build_s:.1f} "
            f"save_s={save_s:.1f} load_s={load_s:.1f}"
        )
    finally:
        shutil.rmtree(directory, ignore_errors=True)
