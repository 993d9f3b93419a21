"""The validator's engine paths: which engine reproduces the teacher-forced pass of a batch.

Theory of operation
-------------------
A run card lists the engine ids (``family-dtype``) whose rollouts the run accepts (issue 13);
the validator reproduces each batch's teacher-forced pass with the *same engine family* that
the batch names, and judges it with that engine's :class:`~rollout.verify.EngineProfile`:

=================  ======================================================================
engine id          validator path
=================  ======================================================================
transformers-bf16  :func:`rollout.engine.prefill_activations_batch` on the published bf16
                   weights loaded by transformers (:class:`trainer.oracle.TrainerOracle`)
vllm-bf16          :class:`VllmTeacher`: one in-process :class:`~rollout.engine_vllm.VllmEngine`
                   on the claimed version (hot-swapped between versions),
                   :meth:`~rollout.engine_vllm.VllmEngine.teacher_forced`: vLLM's own prefill
                   of ``prompt + completion[:-1]`` with the TOPLOC capture hooks, and vLLM's
                   LM head for the logprobs and the Gumbel replay gaps
=================  ======================================================================

:func:`require_validator_engines` is called when a validator is built: a run card listing an
engine this machine cannot reproduce is a configuration error (:class:`ValidatorEngineUnavailable`,
one line, exit 2), never a silent fallback to another engine's numerics (a single threshold
across engines cannot separate precision attacks, issue 13). vLLM is imported lazily, on the
first teacher-forced pass: this module imports neither vLLM nor torch.

vLLM keeps process-global state: one live ``VllmEngine`` per process. A process that also
samples with vLLM (a test, the bench) passes its engine to :class:`VllmTeacher`; the teacher
then loads the claimed version into it before each pass (vLLM instances on the same weights,
prompt and thread count give identical results, ``rollout/engine_vllm.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from p2p.errors import ConfigError, LocalProtocolError

if TYPE_CHECKING:
    from rollout.engine import TeacherForced
    from rollout.gumbel import NoiseKey

__all__ = [
    "TRANSFORMERS_BF16",
    "VALIDATOR_ENGINES",
    "VLLM_BF16",
    "Teacher",
    "ValidatorEngineUnavailable",
    "VllmTeacher",
    "require_validator_engines",
]

TRANSFORMERS_BF16 = "transformers-bf16"
VLLM_BF16 = "vllm-bf16"
VALIDATOR_ENGINES = (TRANSFORMERS_BF16, VLLM_BF16)
"""Engine ids that have a validator path (and a calibrated profile)."""


class Teacher(Protocol):
    """A validator path for one engine family: teacher-forced passes on a checkpoint."""

    def prefill_batch(
        self,
        checkpoint_dir: str | Path,
        items: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float,
        keys: Sequence[NoiseKey] | None = None,
    ) -> list[TeacherForced]:
        """One :class:`~rollout.engine.TeacherForced` per ``(prompt_ids, completion_ids)``."""
        ...

    def close(self) -> None:
        """Free what the path holds (idempotent)."""
        ...


class ValidatorEngineUnavailable(ConfigError):
    """The run accepts rollouts of an engine that this validator cannot reproduce (field
    ``engines``): vLLM is not installed here, or the engine has no validator path."""

    def __init__(self, message: str) -> None:
        super().__init__("engines", message)


def _vllm_installed() -> bool:
    from rollout.engine_vllm import vllm_available

    return vllm_available()


def require_validator_engines(
    engines: Sequence[str], vllm_installed: Callable[[], bool] = _vllm_installed
) -> None:
    """Check that every engine id the run accepts has a validator path on this machine.

    Args:
        engines: the run's engine ids (``ValidatorConfig.engines``, the run card's).
        vllm_installed: whether vLLM can be imported here (injectable for tests).

    Raises:
        ValidatorEngineUnavailable: an id without a validator path, or ``vllm-bf16`` on a
            machine without vLLM.
    """
    for engine in engines:
        if engine not in VALIDATOR_ENGINES:
            raise ValidatorEngineUnavailable(
                f"no validator path for engine {engine!r} (have: {', '.join(VALIDATOR_ENGINES)})"
            )
        if engine == VLLM_BF16 and not vllm_installed():
            raise ValidatorEngineUnavailable(
                "the run accepts vllm-bf16 rollouts but vLLM is not installed on the "
                "validating node; install it (.ci/install-vllm, a venv of its own) or remove "
                "vllm-bf16 from the run's engines"
            )


class VllmTeacher:
    """Teacher-forced passes with vLLM for ``vllm-bf16`` batches (see module docstring).

    Args:
        engine: a :class:`~rollout.engine_vllm.VllmEngine` to use (shared with a sampler in
            the same process; not closed by :meth:`close`), or ``None`` to start one on the
            first pass.
        engine_options: keyword arguments of the ``VllmEngine`` started here.

    Thread-safe (a lock serializes passes and version switches).
    """

    def __init__(self, engine: Any = None, **engine_options: Any) -> None:
        self._engine = engine
        self._owned = engine is None
        self._options = engine_options
        self._lock = threading.Lock()
        self.switches = 0
        """Version switches (loads) done by this teacher."""

    def prefill_batch(
        self,
        checkpoint_dir: str | Path,
        items: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float,
        keys: Sequence[NoiseKey] | None = None,
    ) -> list[TeacherForced]:
        """vLLM's teacher-forced passes of ``items`` with the version in ``checkpoint_dir``.

        Raises:
            VllmEngineError: vLLM failed (not installed, start, reload or capture).
            CheckpointMismatch: the version cannot be loaded.
            LocalProtocolError: bad items (see ``VllmEngine.teacher_forced``).
        """
        with self._lock:
            engine = self._engine
            if engine is None:
                from rollout.engine_vllm import VllmEngine

                engine = self._engine = VllmEngine(**self._options)
            directory = Path(checkpoint_dir)
            if engine.checkpoint_dir is None or Path(engine.checkpoint_dir) != directory:
                engine.load(directory)
                self.switches += 1
            out: list[TeacherForced] = engine.teacher_forced(items, temperature, keys)
            return out

    def close(self) -> None:
        """Shut down the engine this teacher started (idempotent; a shared one stays)."""
        with self._lock:
            engine, self._engine = self._engine, None
            if engine is not None and self._owned:
                engine.close()
            elif engine is not None:
                self._engine = engine


def no_teacher(engine: str) -> LocalProtocolError:
    """The error of a teacher-forced request for an engine without a validator path here."""
    return LocalProtocolError(f"no validator path for engine {engine!r} on this node")
