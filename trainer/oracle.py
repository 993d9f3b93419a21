"""The trainer's view of the published policy versions, for the rollout validator.

Implements :class:`rollout.verify.PolicyOracle`: the manifest digest of each recent version,
the prompts the task assigns to a (PeerID, step) encoded with that version's own tokenizer
(read from its checkpoint directory), the task's reward, and one teacher-forced
forward pass with the *published* bf16 weights of a version (loaded back from the committed
checkpoint files, so the validator runs exactly the bytes the peers received, not the
trainer's fp32 master weights).

Only the versions inside the async window are kept in memory (``keep`` models). Methods may
be called from a worker thread while the trio thread adds versions; a lock guards the tables.

The teacher-forced pass runs on the engine family the batch names
(:mod:`rollout.validator_engines`): transformers here, vLLM through a
:class:`~rollout.validator_engines.VllmTeacher` for ``vllm-bf16`` batches (started on the first
such batch). Constructing the oracle for a run that accepts an engine this machine cannot
reproduce raises :class:`~rollout.validator_engines.ValidatorEngineUnavailable`.
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
from rollout.engine import (
    TeacherForced,
    prefill_activations,
    prefill_activations_batch,
    prefill_activations_group,
)
from rollout.gumbel import NoiseKey
from rollout.model import load_model
from rollout.model_dir import TOKENIZER_NAME, load_tokenizer, stop_token_id
from rollout.schema import DEFAULT_ENGINE_ID
from rollout.task import Prompt, Task, encode_prompt, task_prompts
from rollout.validator_engines import (
    TRANSFORMERS_BF16,
    VLLM_BF16,
    Teacher,
    VllmTeacher,
    no_teacher,
    require_validator_engines,
)

Bits = npt.NDArray[np.uint16]


class TrainerOracle:
    """Versions, prompts and rewards for validation (see module docstring).

    Args:
        tokenizer: the run's tokenizer, used for steps whose checkpoint is not registered
            (each registered version's own tokenizer is used for its step).
        task: the run's task.
        keep: how many versions (models) to keep; async_level + 1 suffices.
        engines: the engine ids the run accepts (the run card's); each needs a validator path
            on this machine.
        vllm_teacher: the ``vllm-bf16`` path to use (e.g. one sharing a sampler's engine);
            default: a :class:`VllmTeacher` that starts its own engine when first needed. Any
            :class:`~rollout.validator_engines.Teacher` works (tests inject stand-ins).

    Raises:
        ValidatorEngineUnavailable: an engine of ``engines`` cannot be reproduced here (vLLM
            not installed for ``vllm-bf16``).
    """

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerFast,
        task: Task,
        keep: int,
        engines: Sequence[str] = (DEFAULT_ENGINE_ID,),
        vllm_teacher: Teacher | None = None,
    ) -> None:
        if vllm_teacher is None:  # an injected path needs no local vLLM install
            require_validator_engines(engines)
        else:
            require_validator_engines(engines, vllm_installed=lambda: True)
        self.engines = tuple(engines)
        self.vllm_teacher = vllm_teacher or (VllmTeacher() if VLLM_BF16 in engines else None)
        self.tokenizer = tokenizer
        self.task = task
        self.keep = keep
        self.vocab_size = len(tokenizer)
        self.eos_id = stop_token_id(tokenizer)
        self._lock = threading.Lock()
        self._tokenizers: dict[int, Any] = {}
        self._digests: OrderedDict[int, str] = OrderedDict()
        self._models: OrderedDict[int, Any] = OrderedDict()
        self._dirs: dict[int, Path] = {}

    def add_version(
        self, step: int, digest: str, checkpoint_dir: Path, preload: bool = True
    ) -> None:
        """Register a published version and (with ``preload``) load its model now.

        Loading right away, from the caller's thread, keeps model construction (which changes
        process-wide torch defaults while it runs) out of the validator's worker thread. The
        version's own tokenizer is loaded from ``checkpoint_dir`` (the run's tokenizer is used
        if the directory has none).

        Raises:
            CheckpointMismatch: the model or the tokenizer cannot be loaded.
        """
        # a vLLM-only run never needs the transformers model (loaded on demand otherwise)
        preload = preload and TRANSFORMERS_BF16 in self.engines
        model = load_model(checkpoint_dir) if preload else None
        has_tokenizer = (Path(checkpoint_dir) / TOKENIZER_NAME).is_file()
        tokenizer = load_tokenizer(checkpoint_dir) if has_tokenizer else self.tokenizer
        with self._lock:
            self._digests[step] = digest
            self._dirs[step] = checkpoint_dir
            self._tokenizers[step] = tokenizer
            if model is not None:
                self._models[step] = model
            while len(self._digests) > self.keep:
                old, _ = self._digests.popitem(last=False)
                self._models.pop(old, None)
                self._dirs.pop(old, None)
                self._tokenizers.pop(old, None)

    def set_vocab_size(self, vocab_size: int) -> None:
        """Use the model's vocabulary size (may exceed the tokenizer's, e.g. padded)."""
        self.vocab_size = vocab_size

    def manifest_digest(self, step: int) -> str | None:
        """Digest of version ``step``, or None if unknown or no longer kept."""
        with self._lock:
            return self._digests.get(step)

    def tokenizer_for(self, step: int) -> Any:
        """Version ``step``'s own tokenizer (the run's if that version is not registered)."""
        with self._lock:
            return self._tokenizers.get(step, self.tokenizer)

    def prompts(self, submitter: str, step: int, n: int) -> list[Prompt]:
        """The prompts the task assigns to ``submitter`` at ``step``."""
        return task_prompts(self.task, submitter, step, n)

    def prompt_ids(self, submitter: str, step: int, n: int) -> list[list[int]]:
        """Token ids of the prompts the task assigns to ``submitter`` at ``step``."""
        tokenizer = self.tokenizer_for(step)
        return [encode_prompt(p, tokenizer) for p in self.prompts(submitter, step, n)]

    def reward(
        self,
        completion_ids: Sequence[int],
        *,
        submitter: str = "",
        step: int = -1,
        prompt_index: int = 0,
        n_prompts: int = 1,
    ) -> float:
        """The task's reward of one completion of prompt ``prompt_index`` of the ``n_prompts``
        assigned to ``submitter`` at ``step``, with that version's tokenizer."""
        prompt = self.prompts(submitter, max(step, 0), n_prompts)[prompt_index]
        return float(self.task.reward(completion_ids, self.tokenizer_for(step), prompt))

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
        keys: Sequence[NoiseKey] | None = None,
    ) -> list[TeacherForced]:
        """Teacher-forced passes of a whole GRPO group (with the replay gaps of ``keys``)."""
        return prefill_activations_group(
            self._model(step), prompt_ids, completions, temperature, keys
        )

    def prefill_batch(
        self,
        step: int,
        items: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float,
        keys: Sequence[NoiseKey] | None = None,
        engine: str = DEFAULT_ENGINE_ID,
    ) -> list[TeacherForced]:
        """Teacher-forced passes of a whole rollout batch (every group, every sample), and
        each one's replay gaps when ``keys`` are given, with version ``step``'s weights on
        ``engine``'s family: :func:`rollout.engine.prefill_activations_batch` for
        ``transformers-bf16``, :meth:`VllmTeacher.prefill_batch` for ``vllm-bf16``.

        Raises:
            LocalProtocolError: the version is not kept, or ``engine`` is not one of the run's.
            VllmEngineError: the vLLM pass failed.
        """
        if engine == TRANSFORMERS_BF16 and engine in self.engines:
            return prefill_activations_batch(self._model(step), items, temperature, keys)
        if engine == VLLM_BF16 and self.vllm_teacher is not None:
            return self.vllm_teacher.prefill_batch(self._dir(step), items, temperature, keys)
        raise no_teacher(engine)

    def _dir(self, step: int) -> Path:
        with self._lock:
            path = self._dirs.get(step)
        if path is None:
            raise LocalProtocolError(f"version {step} is not kept for validation")
        return path

    def close(self) -> None:
        """Shut down the vLLM engine the oracle started, if any (idempotent)."""
        if self.vllm_teacher is not None:
            self.vllm_teacher.close()
