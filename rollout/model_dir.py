"""Model directories: any Hugging Face causal LM on disk, its tokenizer, and the presets.

Theory of operation
-------------------
A *model directory* is what ``save_pretrained`` writes: ``config.json`` of any architecture
that ``AutoModelForCausalLM`` builds, the weights (``model.safetensors``, or shards plus
``model.safetensors.index.json``), the tokenizer (``tokenizer.json`` — a fast tokenizer —
with ``tokenizer_config.json``), and optionally ``chat_template.jinja`` and
``generation_config.json``. The trainer starts from one (``--model PATH``); the presets
(``tiny``, ``real-1b``) are written as one by ``trainer.checkpoint.write_preset_dir``, so
every run takes the same path.

The files that are not weights (:data:`ASSET_NAMES`) travel verbatim with every published
version (``trainer.checkpoint.save_checkpoint(assets_from=...)``): the shard plan carries every
regular file of a version, so peers and the validator read the tokenizer, chat template and
generation config *of the checkpoint they judge* (:func:`load_tokenizer`), never a built-in one.

The stop token of a run is the tokenizer's ``eos_token`` (:func:`stop_token_id`); peers and the
validator agree on it because both read it from the same file.

Errors: a model directory given by an operator that cannot be used raises
:class:`~p2p.errors.ConfigError` naming the file (:func:`check_model_dir`); a received
checkpoint that lacks a usable tokenizer raises :class:`~rollout.model.CheckpointMismatch`.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any, cast

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

from p2p.errors import ConfigError
from rollout.model import (
    CONFIG_NAME,
    CheckpointMismatch,
    load_model,
    read_tensor_shapes,
    tensor_files,
)

__all__ = [
    "ASSET_NAMES",
    "CHAT_TEMPLATE_NAME",
    "GENERATION_CONFIG_NAME",
    "TOKENIZER_CONFIG_NAME",
    "TOKENIZER_NAME",
    "check_model_dir",
    "load_tokenizer",
    "load_trainable",
    "stop_token_id",
    "train_bpe_tokenizer",
]

TOKENIZER_NAME = "tokenizer.json"
TOKENIZER_CONFIG_NAME = "tokenizer_config.json"
CHAT_TEMPLATE_NAME = "chat_template.jinja"
GENERATION_CONFIG_NAME = "generation_config.json"
ASSET_NAMES = (
    TOKENIZER_NAME,
    TOKENIZER_CONFIG_NAME,
    CHAT_TEMPLATE_NAME,
    GENERATION_CONFIG_NAME,
    "special_tokens_map.json",
    "added_tokens.json",
)
"""Files of a model directory copied verbatim into every published version."""

_AUTO_TOKENIZER: Any = AutoTokenizer  # untyped factory


def load_tokenizer(directory: str | Path) -> PreTrainedTokenizerFast:
    """The fast tokenizer saved in a checkpoint or model directory (offline).

    Args:
        directory: holds ``tokenizer.json`` (and usually ``tokenizer_config.json``).

    Returns:
        the tokenizer, with an ``eos_token`` (see :func:`stop_token_id`).

    Raises:
        CheckpointMismatch: ``tokenizer.json`` missing, unreadable, or no eos token; the
            message names the file.
    """
    directory = Path(directory)
    path = directory / TOKENIZER_NAME
    if not path.is_file():
        raise CheckpointMismatch(f"{path}: missing (a fast tokenizer file is required)")
    try:
        tok = _AUTO_TOKENIZER.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError, json.JSONDecodeError) as exc:
        raise CheckpointMismatch(f"{path}: {_one_line(exc)}") from None
    if getattr(tok, "eos_token_id", None) is None:
        raise CheckpointMismatch(f"{directory / TOKENIZER_CONFIG_NAME}: no eos_token set")
    return cast(PreTrainedTokenizerFast, tok)


def stop_token_id(tokenizer: Any) -> int:
    """The run's stop token: the tokenizer's ``eos_token_id``."""
    return int(tokenizer.eos_token_id)


def pad_token_id(tokenizer: Any) -> int:
    """Padding id for training batches: ``pad_token_id``, else the stop token."""
    pad = tokenizer.pad_token_id
    return int(pad) if pad is not None else stop_token_id(tokenizer)


def check_model_dir(directory: str | Path, field: str = "model") -> None:
    """Check, without building the model, that a model directory can start a run.

    Checks that ``config.json`` parses and names a causal-LM architecture transformers knows,
    that the weight files exist with readable headers, and that the tokenizer loads.

    Raises:
        ConfigError: on ``field``, naming the offending file.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(field, f"{directory} is not a directory")
    config_path = directory / CONFIG_NAME
    if not config_path.is_file():
        raise ConfigError(field, f"{config_path}: missing")
    try:
        config = AutoConfig.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ConfigError(field, f"{config_path}: {_one_line(exc)}") from None
    if _causal_lm_class(config) is None:
        raise ConfigError(
            field, f"{config_path}: model_type {config.model_type!r} has no causal-LM class"
        )
    try:
        for path in tensor_files(directory):
            if not path.is_file():
                raise CheckpointMismatch(f"{path}: missing")
            read_tensor_shapes(path)
        load_tokenizer(directory)
    except CheckpointMismatch as exc:
        raise ConfigError(field, _one_line(exc).removeprefix("integrity check failed: ")) from None


def load_trainable(directory: str | Path, field: str = "model") -> tuple[Any, Any]:
    """The trainer's start: ``(fp32 causal LM, tokenizer)`` from a model directory.

    The weights are loaded strictly (every tensor name and shape must match the config's
    model; tied weights are stored once).

    Raises:
        ConfigError: on ``field``, naming the file that cannot be used.
    """
    check_model_dir(directory, field)
    try:
        model = load_model(directory, dtype=torch.float32)
        tokenizer = load_tokenizer(directory)
    except CheckpointMismatch as exc:
        raise ConfigError(field, _one_line(exc).removeprefix("integrity check failed: ")) from None
    return model, tokenizer


def train_bpe_tokenizer(
    corpus: Iterable[str],
    vocab_size: int,
    *,
    eos: str = "<|im_end|>",
    pad: str = "<|endoftext|>",
    extra_specials: tuple[str, ...] = ("<|im_start|>",),
    chat_template: str | None = None,
) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2/Qwen style) on ``corpus``, deterministically.

    Args:
        corpus: training texts.
        vocab_size: target vocabulary size (specials and the 256 byte symbols included).
        eos, pad, extra_specials: special tokens (ids 0.. in order pad, eos, extras).
        chat_template: a Jinja chat template to attach (saved as ``chat_template.jinja``).

    Returns:
        a fast tokenizer with ``eos_token`` and ``pad_token`` set; no BOS is added.
    """
    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[pad, eos, *extra_specials],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(list(corpus), trainer)
    cls: Any = PreTrainedTokenizerFast  # untyped constructor
    tok = cls(tokenizer_object=core, eos_token=eos, pad_token=pad)
    if chat_template is not None:
        tok.chat_template = chat_template
    return cast(PreTrainedTokenizerFast, tok)


def _causal_lm_class(config: Any) -> Any:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        return None


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300] or type(exc).__name__
