"""Any Hugging Face causal LM from a local directory: load, publish, generate, verify.

Models are built here (Qwen2 and Llama architectures, seeded random weights) with a BPE
tokenizer trained here; see ``tests/byo_models.py``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from p2p.errors import ConfigError
from rollout.batch import SamplingConfig, build_batch
from rollout.engine import TransformersEngine
from rollout.model import CheckpointMismatch, build_model, load_model
from rollout.model_dir import (
    CHAT_TEMPLATE_NAME,
    GENERATION_CONFIG_NAME,
    TOKENIZER_NAME,
    check_model_dir,
    load_tokenizer,
    load_trainable,
)
from rollout.task import Prompt, encode_prompt, load_task
from rollout.tasks.arithmetic import DATASET
from rollout.verify import Validator, ValidatorConfig
from shardcast.publish.layout import list_files
from tests.byo_models import write_model_dir
from trainer.checkpoint import save_checkpoint, write_preset_dir
from trainer.oracle import TrainerOracle

SAMPLING = SamplingConfig(n_prompts=2, group_size=3, max_new_tokens=12)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Any:
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.mark.parametrize(("arch", "tied"), [("qwen2", False), ("qwen2", True), ("llama", False)])
def test_model_dir_publishes_and_verifies(tmp_path: Path, arch: str, tied: bool) -> None:
    src = write_model_dir(tmp_path / "src", arch, tied=tied)
    model, tok = load_trainable(src)
    assert type(model).__name__ == ("Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM")
    assert next(model.parameters()).dtype == torch.float32
    # published like the trainer does: bf16 weights, the source's assets verbatim
    pub = tmp_path / "v0"
    save_checkpoint(model, tok, pub, 1 << 30, assets_from=src)
    for name in (TOKENIZER_NAME, CHAT_TEMPLATE_NAME, GENERATION_CONFIG_NAME):
        assert (pub / name).read_bytes() == (src / name).read_bytes(), name
        assert name in list_files(pub)  # the shard plan carries them to every peer
    assert json.loads((pub / GENERATION_CONFIG_NAME).read_text())["top_p"] == 0.9
    # transformers loads the published directory as is
    again = load_model(pub)
    assert type(again) is type(model)
    # a peer: the checkpoint's own tokenizer, chat prompts, its eos as the stop token
    engine = TransformersEngine()
    engine.load(pub)
    peer_tok = load_tokenizer(pub)
    assert len(peer_tok) == len(tok) > 128
    assert peer_tok.eos_token == "<|im_end|>"
    task = load_task(str(DATASET), "numeric:0")
    batch = build_batch(
        engine,
        peer_tok,
        task,
        peer_id="peer-a",
        run_id="r",
        step=0,
        manifest_digest="ab" * 32,
        cfg=SAMPLING,
    )
    assert peer_tok.decode(batch.groups[0].prompt_ids).startswith("<|im_start|>user\nWhat is")
    # the validator recomputes prompts and rewards with the version's tokenizer
    oracle = TrainerOracle(tok, task, keep=2)
    oracle.set_vocab_size(int(model.config.vocab_size))
    oracle.add_version(0, "ab" * 32, pub)
    vcfg = ValidatorConfig(
        run_id="r",
        task=task.name,
        n_prompts=SAMPLING.n_prompts,
        group_size=SAMPLING.group_size,
        max_new_tokens=SAMPLING.max_new_tokens,
        temperature=SAMPLING.temperature,
    )
    verdict = Validator(vcfg, oracle).check(batch, sender="peer-a", current_step=0)
    assert verdict.accepted, verdict


def test_chat_prompt_uses_the_template(tmp_path: Path) -> None:
    tok = load_tokenizer(write_model_dir(tmp_path / "m"))
    chat = Prompt(text="1 + 2 =", messages=(("user", "What is 1 + 2?"),))
    assert tok.decode(encode_prompt(chat, tok)) == (
        "<|im_start|>user\nWhat is 1 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(encode_prompt(Prompt(text="1 + 2 ="), tok)) == "1 + 2 ="


def test_preset_is_an_ordinary_model_dir(tmp_path: Path) -> None:
    d = write_preset_dir("tiny", 3, tmp_path / "tiny")
    assert write_preset_dir("tiny", 3, d) == d  # reused
    model, tok = load_trainable(d)
    ref = build_model("tiny", 3, dtype=torch.float32)
    assert all(
        torch.equal(a, b)
        for a, b in zip(model.state_dict().values(), ref.state_dict().values(), strict=True)
    )
    assert len(tok) == 128
    assert not list(tmp_path.glob(".tiny.*"))  # no temporary left behind


def _broken(tmp_path: Path, how: str) -> Path:
    d = write_model_dir(tmp_path / how)
    if how == "no_tokenizer":
        (d / TOKENIZER_NAME).unlink()
    elif how == "bad_config":
        (d / "config.json").write_text("{not json")
    elif how == "unknown_arch":
        (d / "config.json").write_text(json.dumps({"model_type": "no-such-model"}))
    elif how == "no_weights":
        (d / "model.safetensors").unlink()
    elif how == "bad_tokenizer":
        (d / TOKENIZER_NAME).write_text("[1, 2")
    elif how == "not_a_dir":
        shutil.rmtree(d)
    return d


@pytest.mark.parametrize(
    ("how", "names"),
    [
        ("no_tokenizer", TOKENIZER_NAME),
        ("bad_config", "config.json"),
        ("unknown_arch", "config.json"),
        ("no_weights", "model.safetensors"),
        ("bad_tokenizer", TOKENIZER_NAME),
        ("not_a_dir", "not_a_dir"),
    ],
)
def test_bad_model_dir_is_one_line_naming_the_file(tmp_path: Path, how: str, names: str) -> None:
    d = _broken(tmp_path, how)
    with pytest.raises(ConfigError) as err:
        check_model_dir(d)
    assert err.value.field == "model"
    assert names in str(err.value)
    assert "\n" not in str(err.value)
    with pytest.raises(ConfigError):
        load_trainable(d)


def test_checkpoint_without_tokenizer_is_refused_by_peers(tmp_path: Path) -> None:
    d = write_model_dir(tmp_path / "m")
    (d / TOKENIZER_NAME).unlink()
    with pytest.raises(CheckpointMismatch, match=r"tokenizer\.json"):
        TransformersEngine().load(d)
