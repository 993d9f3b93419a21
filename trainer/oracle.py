"""The trainer's view of the published policy versions, for the rollout validator.

Implements :class:`rollout.verify.PolicyOracle`: the manifest digest of each recent version,
the prompts the task assigns to a (PeerID, step), the task's reward, and one teacher-forced
forward pass with the *published* bf16 weights of a version (loaded back from the committed
checkpoint files, so the validator runs exactly the bytes the peers received, not the
trainer's fp32 master weights).

Only the versions inside the async window are kept in memory (``keep`` models). Methods may
be called from a worker thread while the trio thread adds versions; a lock guards the tables.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from transformers import PreTrainedTokenizerFast

from p2p.errors import LocalProtocolError
from rollout.engine import prefill_activations, prefill_activations_group
from rollout.model import load_model
from rollout.task import Task

Bits = npt.NDArray[np.uint16]


class TrainerOracle:
    """Versions, prompts and rewards for validation (see module docstring).

    Args:
        tokenizer: the run's tokenizer.
        task: the run's task.
        keep: how many versions (models) to keep; async_level + 1 suffices.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerFast, task: Task, keep: int) -> None:
        self.tokenizer = tokenizer
        self.task = task
        self.keep = keep
        self.vocab_size = len(tokenizer)
        self.eos_id = int(tokenizer.eos_token_id)
        self._lock = threading.Lock()
        self._digests: OrderedDict[int, str] = OrderedDict()
        self._models: OrderedDict[int, Any] = OrderedDict()
        self._dirs: dict[int, Path] = {}

    def add_version(
        self, step: int, digest: str, checkpoint_dir: Path, preload: bool = True
    ) -> None:
        """Register a published version and (with ``preload``) load its model now.

        Loading right away, from the caller's thread, keeps model construction (which changes
        process-wide torch defaults while it runs) out of the validator's worker thread.
        """
        model = load_model(checkpoint_dir) if preload else None
        with self._lock:
            self._digests[step] = digest
            self._dirs[step] = checkpoint_dir
            if model is not None:
                self._models[step] = model
            while len(self._digests) > self.keep:
                old, _ = self._digests.popitem(last=False)
                self._models.pop(old, None)
                self._dirs.pop(old, None)

    def set_vocab_size(self, vocab_size: int) -> None:
        """Use the model's vocabulary size (may exceed the tokenizer's, e.g. padded)."""
        self.vocab_size = vocab_size

    def manifest_digest(self, step: int) -> str | None:
        """Digest of version ``step``, or None if unknown or no longer kept."""
        with self._lock:
            return self._digests.get(step)

    def prompt_ids(self, submitter: str, step: int, n: int) -> list[list[int]]:
        """Token ids of the prompts the task assigns to ``submitter`` at ``step``."""
        return [
            list(self.tokenizer(text)["input_ids"])
            for text in self.task.prompts_for(submitter, step, n)
        ]

    def reward(self, completion_ids: Sequence[int]) -> float:
        """The task's reward of one completion."""
        return float(self.task.reward(completion_ids, self.tokenizer))

    def _model(self, step: int) -> Any:
        with self._lock:
            model = self._models.get(step)
            path = self._dirs.get(step)
        if model is not None:
            return model
        if path is None:
            raise LocalProtocolError(f"version {step} is not kept for validation")
        model = load_model(path)
        with self._lock:
            if step in self._dirs:
                self._models[step] = model
        return model

    def prefill(
        self,
        step: int,
        prompt_ids: Sequence[int],
        completion_ids: Sequence[int],
        temperature: float,
    ) -> tuple[Bits, Bits, list[float]]:
        """One teacher-forced pass with version ``step``'s published weights."""
        return prefill_activations(self._model(step), prompt_ids, completion_ids, temperature)

    def prefill_group(
        self,
        step: int,
        prompt_ids: Sequence[int],
        completions: Sequence[Sequence[int]],
        temperature: float,
    ) -> list[tuple[Bits, Bits, list[float]]]:
        """Teacher-forced passes of a whole GRPO group in one batched forward."""
        return prefill_activations_group(self._model(step), prompt_ids, completions, temperature)
