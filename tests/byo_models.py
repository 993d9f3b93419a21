"""Locally built Hugging Face model directories for tests (no hub is reachable).

A Qwen2- or Llama-architecture causal LM with seeded random weights, saved with
``save_pretrained`` together with a byte-level BPE tokenizer trained here with ``tokenizers``,
a chat template and a generation config: what a researcher's ``--model PATH`` looks like.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, Qwen2Config

from rollout.model_dir import train_bpe_tokenizer

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [f"What is {a} + {b}? {a + b}. {a} - {b} = {a - b}" for a in range(20) for b in range(20)]


def bpe_tokenizer(vocab_size: int = 320) -> Any:
    """A deterministic byte-level BPE tokenizer with a chat template (eos ``<|im_end|>``)."""
    return train_bpe_tokenizer(CORPUS, vocab_size, chat_template=CHAT_TEMPLATE)


def write_model_dir(
    directory: Path, arch: str = "qwen2", seed: int = 0, tied: bool = False
) -> Path:
    """Write a small ``arch`` (``qwen2`` or ``llama``) model directory and return it."""
    tok = bpe_tokenizer()
    common: dict[str, Any] = {
        "vocab_size": len(tok),
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "eos_token_id": tok.eos_token_id,
        "pad_token_id": tok.pad_token_id,
        "tie_word_embeddings": tied,
    }
    config = Qwen2Config(**common) if arch == "qwen2" else LlamaConfig(**common)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model: Any = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(
        eos_token_id=tok.eos_token_id, do_sample=True, temperature=0.7, top_p=0.9
    )
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(directory))
    tok.save_pretrained(str(directory))
    return directory
