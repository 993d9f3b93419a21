"""Model presets, the local tokenizer, and checked checkpoint loading.

Theory of operation
-------------------
No model hub is reachable, so every model is a transformers causal LM built from a config
with seeded random weights, and the tokenizer is built locally:

* :func:`build_tokenizer` makes a character-level tokenizer over printable ASCII plus ``\\n``,
  four specials (``<pad>`` = 0, ``<bos>`` = 1, ``<eos>`` = 2, ``<unk>`` = 3) and reserved
  filler tokens up to :data:`TOKENIZER_VOCAB_SIZE` (128). Encoding prepends ``<bos>``. It saves with
  ``save_pretrained`` and reloads offline with ``AutoTokenizer.from_pretrained(dir)``.
* :func:`build_model` makes a preset (``"tiny"``, ``"real-1b"``, ``"real-2b"`` or
  ``"real-6b"``, all Llama architecture)
  with weights initialized in float32 from ``seed`` (global RNG state forked and restored),
  then cast to the requested dtype. Floating buffers (RoPE ``inv_freq``) stay float32, as
  ``from_pretrained`` leaves them.
* A checkpoint directory has the Hugging Face layout (``config.json``, either one
  ``model.safetensors`` or ``model-0000k-of-0000N.safetensors`` shards with
  ``model.safetensors.index.json``, tokenizer files). The trainer writes it
  (``trainer/checkpoint.py``); peers and validators read it with :func:`load_model`, or
  :func:`load_weights` to swap weights into a model that already has the right config.
  Loading is strict: the set of tensor names and every shape must equal the model's
  persistent state dict, and the index must agree with the shard contents; any difference
  raises :class:`CheckpointMismatch` *before* any weight is overwritten.

``load_model`` constructs the module under ``transformers.initialization.no_init_weights``
(skipping the random init that every weight would overwrite; 0.7 s instead of 11 s for
``real-1b``). That context manager patches ``torch.nn.init`` process-wide while it runs, so
do not construct models concurrently from several threads.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast
from transformers.initialization import no_init_weights

from p2p.errors import ConfigError, IntegrityError

__all__ = [
    "BOS",
    "CONFIG_NAME",
    "CONSTRUCT_LOCK",
    "EOS",
    "INDEX_NAME",
    "PAD",
    "PRESETS",
    "SINGLE_WEIGHTS_NAME",
    "TOKENIZER_VOCAB_SIZE",
    "UNK",
    "CheckpointMismatch",
    "build_model",
    "build_tokenizer",
    "compare_shapes",
    "indexed_shapes",
    "load_model",
    "load_weights",
    "preset_config",
    "read_tensor_shapes",
    "shard_name",
    "stored_state",
    "tensor_files",
]

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
TOKENIZER_VOCAB_SIZE = 128
"""Size of :func:`build_tokenizer`'s vocabulary: 4 specials, 96 characters, 28 reserved."""

CONFIG_NAME = "config.json"
SINGLE_WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"

_COMMON: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
PRESETS: dict[str, dict[str, Any]] = {
    # 0.69 M parameters, 1.4 MB in bf16: 3 peers and a trainer step in seconds on 2 cores.
    "tiny": {
        "vocab_size": TOKENIZER_VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 1024,
    },
    # TinyLlama-1.1B's shape with 12 instead of 22 layers: 659.6 M parameters, 1.23 GiB in bf16.
    # Only ids < TOKENIZER_VOCAB_SIZE decode to text; the rest is padding to a realistic size.
    "real-1b": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 12,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
    },
    # TinyLlama-1.1B's shape (22 layers): 1.10 G parameters, 2.05 GiB in bf16 — the
    # "real-architecture checkpoint of at least 2 GiB" of the broadcast benchmark.
    "real-2b": {
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 5632,
        "num_hidden_layers": 22,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "max_position_embeddings": 2048,
    },
    # Llama-3.2-3B's layer shape (hidden 3072, 24 heads of 128, 8 KV heads, MLP 8192, 28
    # layers) with the 32k vocabulary: 3.01 G parameters, 6.03 GB (5.62 GiB) in bf16, 4.6x
    # ``real-1b``: the larger checkpoint of the broadcast benchmark's scaling run. Built by
    # ``bench/scaled.py`` tensor by tensor (an fp32 build would need ~12 GB of memory).
    "real-6b": {
        "vocab_size": 32000,
        "hidden_size": 3072,
        "intermediate_size": 8192,
        "num_hidden_layers": 28,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
        "max_position_embeddings": 2048,
    },
}
"""Preset name → ``LlamaConfig`` keyword arguments (in addition to the shared ones)."""

_AUTO_MODEL: Any = AutoModelForCausalLM  # transformers' factory methods are untyped


class CheckpointMismatch(IntegrityError):
    """A checkpoint's tensors do not match the model: missing, unexpected or mis-shaped
    names, an index that disagrees with its shards, or an unreadable/missing file."""


def shard_name(index: int, count: int) -> str:
    """The Hugging Face shard file name: ``model-00002-of-00005.safetensors`` (1-based)."""
    return f"model-{index:05d}-of-{count:05d}.safetensors"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Build the deterministic character-level tokenizer.

    Ids: ``<pad>`` 0, ``<bos>`` 1, ``<eos>`` 2, ``<unk>`` 3 (any character outside the
    alphabet), then ``chr(32)..chr(126)`` and ``"\\n"`` (ids 4..99), then ``<reserved_0>``..
    ``<reserved_27>`` (ids 100..127, never produced by encoding, decoded as their names).
    ``tokenizer(text)`` prepends ``<bos>``. Pure function of nothing: same bytes every call.

    Returns:
        A ``PreTrainedTokenizerFast`` with bos/eos/pad set; ``len(tok) == 128``.
    """
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    specials = [PAD, BOS, EOS, UNK]
    reserved = [f"<reserved_{i}>" for i in range(TOKENIZER_VOCAB_SIZE - 4 - len(chars))]
    vocab = {tok: i for i, tok in enumerate(specials + chars + reserved)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    core.decoder = decoders.Fuse()
    core.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, 1)]
    )
    tokenizer_class: Any = PreTrainedTokenizerFast  # untyped constructor
    return cast(
        PreTrainedTokenizerFast,
        tokenizer_class(
            tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK
        ),
    )


def preset_config(preset: str) -> LlamaConfig:
    """The ``LlamaConfig`` of a preset.

    Raises:
        ConfigError: unknown preset name (field ``model.preset``).
    """
    if preset not in PRESETS:
        raise ConfigError("model.preset", f"unknown preset {preset!r}; known: {sorted(PRESETS)}")
    return LlamaConfig(**_COMMON, **PRESETS[preset])


CONSTRUCT_LOCK = threading.Lock()
"""Model construction patches process-wide state (transformers' ``no_init_weights`` replaces
``torch.nn.init`` functions, ``from_config(dtype=…)`` sets the default dtype), so models are
built one at a time per process, whatever thread asks."""


def build_model(preset: str, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Build a preset causal LM with seeded random weights.

    Weights are initialized in float32 under ``torch.random.fork_rng`` seeded with ``seed``
    (the caller's global RNG state is restored afterwards), then cast to ``dtype``, so the
    bf16 model of a seed is exactly the bf16 cast of its float32 (trainer master) model.

    Args:
        preset: a key of :data:`PRESETS`.
        seed: the init seed.
        dtype: parameter dtype; ``torch.bfloat16`` for inference, ``torch.float32`` for the
            trainer's master weights.

    Returns:
        A ``LlamaForCausalLM`` in eval mode, on CPU.

    Raises:
        ConfigError: unknown preset.
    """
    config = preset_config(preset)
    with CONSTRUCT_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        master = _AUTO_MODEL.from_config(config, dtype=torch.float32)
    if dtype == torch.float32:
        return cast(torch.nn.Module, master.eval())
    model = _empty_model(master.config, dtype)
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            tensor.copy_(master.state_dict()[name])
    return model


def load_model(directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> torch.nn.Module:
    """Load a checkpoint directory strictly.

    Args:
        directory: a Hugging Face layout directory (see module docstring).
        dtype: parameter dtype of the returned model (tensors are cast on copy).

    Returns:
        A causal LM in eval mode whose persistent state dict equals the checkpoint's tensors
        (cast to ``dtype``).

    Raises:
        CheckpointMismatch: missing/unreadable ``config.json`` or weights, or any tensor
            name/shape difference between the checkpoint and the model built from its config.
    """
    directory = Path(directory)
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointMismatch(f"{directory / CONFIG_NAME}: {exc}", str(directory)) from exc
    model = _empty_model(config, dtype)
    load_weights(model, directory)
    return model


def load_weights(model: torch.nn.Module, directory: str | Path) -> None:
    """Copy a checkpoint's tensors into ``model`` in place (hot swap), strictly.

    All names, shapes and the index are checked against the model before anything is
    copied. If reading fails during the copy (a shard changed on disk), the model is left
    partly updated: the caller must discard it.

    Args:
        model: a module whose persistent ``state_dict()`` names the expected tensors.
        directory: the checkpoint directory.

    Raises:
        CheckpointMismatch: see :func:`load_model`.
    """
    copy_weights(model, check_weights(model, directory))


def check_weights(model: torch.nn.Module, directory: str | Path) -> list[Path]:
    """Validate a checkpoint against ``model`` without touching the model.

    Returns:
        the weight files, for :func:`copy_weights`.

    Raises:
        CheckpointMismatch: any name, shape or index difference (see :func:`load_model`).
    """
    directory = Path(directory)
    expected = {name: tuple(t.shape) for name, t in stored_state(model).items()}
    files = tensor_files(directory)
    compare_shapes(expected, indexed_shapes(directory, files), directory)
    return list(files)


def stored_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The persistent state dict as stored in a checkpoint: tensors that share storage with an
    earlier one (tied weights, e.g. ``lm_head.weight`` tied to the input embeddings) are
    dropped, keeping the first name in state-dict order, as ``save_pretrained`` does."""
    out: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int, tuple[int, ...]]] = set()
    for name, tensor in model.state_dict().items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        out[name] = tensor
    return out


def indexed_shapes(
    directory: Path, files: dict[Path, set[str] | None]
) -> dict[str, tuple[int, ...]]:
    """Tensor name → shape over the weight ``files`` of :func:`tensor_files`, read from the
    safetensors headers, checked against the index.

    Raises:
        CheckpointMismatch: a tensor stored twice, one a file holds but the index does not
            assign to it, one the index assigns to a file that lacks it, or an unreadable file.
    """
    found: dict[str, tuple[int, ...]] = {}
    for path, names in files.items():
        for name, shape in read_tensor_shapes(path).items():
            if name in found:
                raise CheckpointMismatch(f"tensor {name} stored twice", str(directory))
            if names is not None and name not in names:
                raise CheckpointMismatch(f"{name} in {path.name} but not indexed there", "")
            found[name] = shape
        if names is not None and not names <= found.keys():
            missing = sorted(names - found.keys())[:5]
            raise CheckpointMismatch(f"{path.name} lacks indexed tensors {missing}", "")
    return found


def copy_weights(model: torch.nn.Module, files: list[Path]) -> None:
    """Copy validated weight files into ``model`` in place.

    Raises:
        CheckpointMismatch: a file became unreadable; the model is then partly updated and
            must be discarded.
    """
    target = model.state_dict()
    with torch.no_grad():
        for path in files:
            for name, tensor in _load_file(path).items():
                target[name].copy_(tensor)


def compare_shapes(
    expected: dict[str, tuple[int, ...]], found: dict[str, tuple[int, ...]], directory: Path
) -> None:
    """Raise :class:`CheckpointMismatch` unless ``found`` has exactly ``expected``'s tensor
    names and shapes (shared by every engine, so "strict" means the same everywhere)."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    if missing or unexpected:
        raise CheckpointMismatch(
            f"{directory}: missing tensors {missing[:5]} ({len(missing)}), "
            f"unexpected tensors {unexpected[:5]} ({len(unexpected)})"
        )
    for name, shape in expected.items():
        if found[name] != shape:
            raise CheckpointMismatch(f"{directory}: {name} has shape {found[name]}, want {shape}")


def tensor_files(directory: Path) -> dict[Path, set[str] | None]:
    """Weight files of a checkpoint → the names the index assigns to them (None: no index)."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointMismatch(f"{index_path}: {exc}") from exc
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointMismatch(f"{index_path}: weight_map is not a non-empty object")
        files: dict[Path, set[str] | None] = {}
        for name, file_name in sorted(weight_map.items(), key=lambda kv: (str(kv[1]), kv[0])):
            if not isinstance(file_name, str) or Path(file_name).name != file_name:
                raise CheckpointMismatch(f"{index_path}: bad file name {file_name!r}")
            names = files.setdefault(directory / file_name, set())
            assert names is not None
            names.add(name)
        return files
    single = directory / SINGLE_WEIGHTS_NAME
    if single.is_file():
        return {single: None}
    raise CheckpointMismatch(f"{directory}: neither {INDEX_NAME} nor {SINGLE_WEIGHTS_NAME}")


def read_tensor_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes of one safetensors file (reads the header only)."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            return {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except (OSError, SafetensorError) as exc:
        raise CheckpointMismatch(f"{path}: {exc}") from exc


def _load_file(path: Path) -> dict[str, torch.Tensor]:
    try:
        tensors: dict[str, torch.Tensor] = load_file(str(path))
        return tensors
    except (OSError, SafetensorError) as exc:
        raise CheckpointMismatch(f"{path}: {exc}") from exc


def _empty_model(config: Any, dtype: torch.dtype) -> torch.nn.Module:
    """Construct ``config``'s causal LM with uninitialized parameters of ``dtype``."""
    with CONSTRUCT_LOCK, no_init_weights():
        model = _AUTO_MODEL.from_config(config, dtype=dtype)
        model.tie_weights()  # tied embeddings (``tie_word_embeddings``) share one tensor
    return cast(torch.nn.Module, model.eval())
