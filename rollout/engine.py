"""Inference engines: sample completions and capture the TOPLOC activations.

Theory of operation
-------------------
An :class:`Engine` holds one policy version at a time. ``load(dir)`` swaps in a checkpoint
(strictly checked, see ``rollout.model``); ``generate`` samples ``n`` completions of one
prompt as one batch (same prompt, so no padding):

1. **Prefill**: one forward pass of the base model over the prompt (batch 1) gives the last
   hidden state ``h`` (the output of the final RMSNorm, the LM-head input; ``TOPLOC.md`` §2)
   for every prompt position: ``prefill_bits [L, H]``. Its last row gives the first token
   ``o_0``. The KV cache is then repeated ``n`` times.
2. **Decode**: pass ``j = 1..N-1`` feeds ``o_{j-1}`` and yields row ``d_j``, which gives
   ``o_j``: ``decode_bits [N-1, H]``. The last token's hidden state is never computed.
3. **Sampling**: ``logits = lm_head(h)`` in the model dtype (bf16), widened to float32;
   the token of sample ``i`` at completion position ``j`` is the seeded Gumbel-max choice
   ``argmax(logits / T + g(NoiseKey(seed, i), j))`` (:func:`rollout.gumbel.gumbel_argmax`,
   TOPLOC2 / Token-DiFR), so the validator can replay every draw and the draws do not
   depend on the batch. ``seed`` is the group seed (:func:`rollout.gumbel.group_seed` of run,
   PeerID, step and prompt index in a rollout). The reported ``logprobs`` are
   ``logp = log_softmax(logits / T)`` at the sampled token: log-probabilities under the
   *sampling* distribution at temperature ``T`` (the policy's own at ``T = 1``). A sequence
   stops after sampling ``eos`` (kept in the completion, ``finish_reason="stop"``) or at
   ``max_new_tokens`` (``"length"``); finished rows keep running in the batch until all are
   done, and their extra tokens are dropped.

:func:`prefill_activations` is the validator's side: one teacher-forced pass over
``prompt + completion[:-1]`` returning the same layout and the recomputed logprobs (and,
given the noise keys, each token's replay gap, :func:`rollout.gumbel.replay_gaps`). It
matches generation closely but not bit for bit (batch size and the KV cache change the
order of float operations); ``tests/unit/test_engine.py`` measures the difference.

Same weights, prompt, arguments, seed and thread count → identical generations.

**In-place updates** (:class:`InPlaceEngine`): ``apply_update(plan, dir)`` applies a next
version's changed 16-bit words (:func:`rollout.delta_plan.plan_update`) to the parameter storage
directly: the engine must hold the plan's base version byte for byte; afterwards it holds
exactly what ``load(dir)`` would have loaded, having read nothing from disk. Every patched
tensor is checked (present, dtype, shape, contiguous on the CPU, indices in range) before the
first one is touched, so an update that does not fit raises
:class:`~rollout.delta_plan.DeltaMismatch` and keeps the old weights.

Stopping: :meth:`TransformersEngine.interrupt` (the :class:`Interruptible` protocol) makes a
``generate`` running in another thread raise :class:`GenerationInterrupted` before its next
token, and every later one at once. A peer that is shutting down abandons the generating
thread and interrupts the engine, so the thread ends within one decode pass instead of
finishing the group.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt
import torch
from transformers import AutoConfig, DynamicCache

from p2p.errors import LocalProtocolError
from rollout.delta_plan import (
    UPDATE_THREADS,
    DeltaMismatch,
    MismatchReason,
    TensorPatch,
    TensorSpec,
    UpdatePlan,
)
from rollout.gumbel import NoiseKey, gumbel_argmax, replay_gaps
from rollout.model import check_weights, copy_weights, load_model, stored_state
from rollout.model_dir import load_tokenizer, stop_token_id

__all__ = [
    "Engine",
    "EngineStats",
    "Generation",
    "InPlaceEngine",
    "TeacherForced",
    "TransformersEngine",
    "bf16_bits",
    "prefill_activations",
    "prefill_activations_batch",
    "prefill_activations_group",
    "sample_group",
]

FinishReason = Literal["stop", "length"]


@dataclass(frozen=True, eq=False)
class Generation:
    """One sampled completion and its proof material (arrays are read-only; compare fields,
    not instances).

    Attributes:
        prompt_ids: the prompt's token ids (``L`` of them, ``<bos>`` included).
        completion_ids: sampled ids ``o_0..o_{N-1}``, ``N >= 1``; ends with ``eos`` iff
            ``finish_reason == "stop"``.
        logprobs: ``N`` floats, natural log, of each sampled token under the sampling
            distribution ``softmax(float32(bf16 logits) / T)``.
        finish_reason: ``"stop"`` (sampled ``eos``) or ``"length"`` (hit the cap).
        prefill_bits: ``[L, H]`` ``uint16``, bf16 bit patterns of the last hidden state at
            the prompt positions.
        decode_bits: ``[N-1, H]`` ``uint16``, row ``j-1`` is decode pass ``j`` (the hidden
            state that produced ``o_j``).
    """

    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    prefill_bits: npt.NDArray[np.uint16]
    decode_bits: npt.NDArray[np.uint16]


@dataclass(frozen=True)
class EngineStats:
    """Counters of one engine since construction."""

    loads: int
    generated_tokens: int
    generate_s: float


class Engine(Protocol):
    """An inference engine holding one policy version. Not safe for concurrent calls."""

    def load(self, checkpoint_dir: str | Path) -> None:
        """Swap to the checkpoint in ``checkpoint_dir``. Raises ``CheckpointMismatch``."""
        ...

    def generate(
        self,
        prompt_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> list[Generation]:
        """Sample ``n`` completions of one prompt; sample ``i`` with the Gumbel-max noise of
        ``NoiseKey(seed, i)`` (:mod:`rollout.gumbel`; ``seed`` is the group seed)."""
        ...


class GenerationInterrupted(LocalProtocolError):
    """``generate`` was stopped by :meth:`Interruptible.interrupt` (the engine is shutting
    down); nothing was generated."""


@runtime_checkable
class Interruptible(Protocol):
    """An engine whose running ``generate`` can be stopped from another thread."""

    def interrupt(self) -> None:
        """Make a running ``generate`` raise :class:`GenerationInterrupted` before its next
        token, and every later call at once (for a shutdown; there is no undo). Safe from any
        thread; returns at once."""
        ...


@runtime_checkable
class InPlaceEngine(Protocol):
    """An engine that can apply a next version to the weights it holds (module docstring)."""

    def weight_specs(self) -> dict[str, TensorSpec]:
        """Checkpoint tensor name → dtype and shape as held now (empty when unloaded)."""
        ...

    def apply_update(self, plan: UpdatePlan, checkpoint_dir: str | Path) -> None:
        """Apply ``plan`` (made against the version held now); the engine then serves the
        version in ``checkpoint_dir`` (read for nothing). Raises ``DeltaMismatch`` and keeps
        the old weights if the plan does not fit."""
        ...


TORCH_TO_SAFETENSORS: dict[torch.dtype, str] = {
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float32: "F32",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
"""torch dtype → safetensors dtype name (those a checkpoint of ours can hold)."""


def tensor_spec(t: torch.Tensor) -> TensorSpec:
    """How ``t`` is held, in safetensors terms (dtype ``"?"`` for one without a name)."""
    return TensorSpec(TORCH_TO_SAFETENSORS.get(t.dtype, "?"), tuple(t.shape))


def check_patch_targets(
    plan: UpdatePlan, held: dict[str, torch.Tensor]
) -> list[tuple[torch.Tensor, TensorPatch]]:
    """Pair each patch of ``plan`` with the tensor it changes, checking all first.

    Args:
        plan: the update.
        held: checkpoint tensor name → the tensor holding it (CPU, contiguous).

    Returns:
        ``(tensor, patch)`` pairs, for :func:`apply_patches`.

    Raises:
        DeltaMismatch: a tensor missing, of another dtype or shape, not a contiguous CPU
            tensor, or an index past its end.
    """
    pairs = []
    for p in plan.patches:
        t = held.get(p.name)
        if t is None:
            raise DeltaMismatch(MismatchReason.MISSING_TENSOR, f"{p.name} is not held")
        spec = tensor_spec(t)
        if spec.shape != p.shape:
            raise DeltaMismatch(MismatchReason.SHAPE, f"{p.name}: {p.shape}, held {spec.shape}")
        if spec.dtype != p.dtype:
            raise DeltaMismatch(MismatchReason.DTYPE, f"{p.name}: {p.dtype}, held {spec.dtype}")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise DeltaMismatch(MismatchReason.LAYOUT, f"{p.name} is not a contiguous CPU tensor")
        nbytes = t.numel() * t.element_size()
        if (len(p.words) and (nbytes % 2 or int(p.words[-1]) >= nbytes // 2)) or (
            len(p.byte_index) and int(p.byte_index.max()) >= nbytes
        ):
            raise DeltaMismatch(MismatchReason.LAYOUT, f"{p.name}: patch past its {nbytes} bytes")
        pairs.append((t, p))
    return pairs


def apply_patches(
    pairs: list[tuple[torch.Tensor, TensorPatch]], threads: int = UPDATE_THREADS
) -> None:
    """Apply checked patches (:func:`check_patch_targets`) to the tensors' storage in place:
    each changed little-endian 16-bit word moves by its difference modulo 2**16, each tail byte
    is set. Touches only the changed words; ``threads`` tensors at a time (tensors do not
    overlap)."""

    def patch(pair: tuple[torch.Tensor, TensorPatch]) -> None:
        t, p = pair
        raw = t.detach().view(-1).view(torch.uint8).numpy()
        if len(p.words):  # np.add.at: ~2x faster than words[idx] += d here (numpy 2.4)
            np.add.at(raw.view("<u2"), p.words, p.diffs)  # uint16: wraps modulo 2**16
        if len(p.byte_index):
            raw[p.byte_index] = p.byte_value

    if threads <= 1 or len(pairs) <= 1:
        for pair in pairs:
            patch(pair)
        return
    with ThreadPoolExecutor(min(threads, len(pairs))) as pool:
        list(pool.map(patch, pairs))


class TeacherForced(NamedTuple):
    """The validator's recomputation for one completion (:func:`prefill_activations_group`).

    Attributes:
        prefill_bits: ``[L, H]`` ``uint16`` bf16 bits of the last hidden state at the prompt.
        decode_bits: ``[N-1, H]`` ``uint16``, the rows that produced ``o_1..o_{N-1}``.
        logprobs: ``N`` floats, ``log_softmax(float32(logits) / T)`` of each ``o_j``.
        replay_gaps: ``[N]`` float32 Gumbel-max gaps (:func:`rollout.gumbel.replay_gaps`)
            when a noise key was given, else ``None``.
    """

    prefill_bits: npt.NDArray[np.uint16]
    decode_bits: npt.NDArray[np.uint16]
    logprobs: list[float]
    replay_gaps: npt.NDArray[np.float32] | None


def bf16_bits(t: torch.Tensor) -> npt.NDArray[np.uint16]:
    """Bit patterns of ``t`` rounded to bf16, as a read-only ``uint16`` array, same shape."""
    bits = t.detach().to(torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
    bits.setflags(write=False)  # shared by every Generation of a group
    return bits


def _check_args(prompt_ids: Sequence[int], temperature: float, vocab_size: int) -> None:
    if not prompt_ids:
        raise LocalProtocolError("empty prompt")
    if not temperature > 0.0:
        raise LocalProtocolError(f"temperature must be > 0, got {temperature}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise LocalProtocolError(f"prompt token id outside [0, {vocab_size})")


def _logits(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """``float32(lm_head(hidden))``: ``[..., H]`` → ``[..., V]`` float32."""
    logits: torch.Tensor = model.get_output_embeddings()(hidden).float()
    return logits


def _logprobs(model: Any, hidden: torch.Tensor, temperature: float) -> torch.Tensor:
    """``log_softmax(float32(lm_head(hidden)) / T)``: ``[..., H]`` → ``[..., V]`` float32."""
    return torch.log_softmax(_logits(model, hidden) / temperature, dim=-1)


def _base(model: Any) -> Any:
    """The decoder stack of a causal LM (``model.model`` for Llama/Qwen2): its
    ``last_hidden_state`` is the LM-head input, after the final norm."""
    return model.get_decoder()


@torch.inference_mode()
def sample_group(
    model: Any,
    prompt_ids: Sequence[int],
    n: int,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    eos_token_id: int,
    interrupted: threading.Event | None = None,
) -> list[Generation]:
    """Sample ``n`` completions of one prompt with a KV cache (see module docstring).

    Args:
        model: a transformers causal LM (``get_decoder()`` and ``get_output_embeddings()``).
        prompt_ids: ``L >= 1`` token ids.
        n: group size (>= 1), one batch.
        max_new_tokens: length cap ``N_max >= 1``.
        temperature: ``T > 0``.
        seed: the group seed; sample ``i`` draws with ``NoiseKey(seed, i)`` (any int in
            ``[0, 2**128)``).
        eos_token_id: the stop token.
        interrupted: checked before the prefill and before each decode pass; once set, the call
            raises :class:`GenerationInterrupted`.

    Returns:
        ``n`` generations, in sample order.

    Raises:
        LocalProtocolError: empty prompt, bad id, ``n < 1``, ``max_new_tokens < 1`` or
            ``temperature <= 0``.
        GenerationInterrupted: ``interrupted`` was set.
    """
    _check_args(prompt_ids, temperature, int(model.config.vocab_size))
    if n < 1 or max_new_tokens < 1:
        raise LocalProtocolError(f"need n >= 1 and max_new_tokens >= 1, got {n}, {max_new_tokens}")
    keys = [NoiseKey(seed, i) for i in range(n)]
    _check_stop(interrupted)
    cache = DynamicCache(config=model.config)
    out = _base(model)(input_ids=torch.tensor([list(prompt_ids)]), cache=cache, use_cache=True)
    hidden = out.last_hidden_state  # [1, L, H]
    prefill_bits = bf16_bits(hidden[0])
    cache.batch_repeat_interleave(n)
    last = hidden[:, -1].expand(n, -1)  # [n, H]
    tokens: list[torch.Tensor] = []  # each [n] int64
    token_logprobs: list[torch.Tensor] = []  # each [n] float32
    decode_rows: list[torch.Tensor] = []  # row j-1 = decode pass j, each [n, H]
    done = torch.zeros(n, dtype=torch.bool)
    for step in range(max_new_tokens):
        logits = _logits(model, last)  # [n, V]
        logp = torch.log_softmax(logits / temperature, dim=-1)
        chosen = gumbel_argmax(logits.numpy(), keys, step, temperature)
        token = torch.from_numpy(chosen).unsqueeze(1)  # [n, 1]
        tokens.append(token[:, 0])
        token_logprobs.append(logp.gather(1, token)[:, 0])
        done |= token[:, 0] == eos_token_id
        if bool(done.all()) or step == max_new_tokens - 1:
            break
        _check_stop(interrupted)
        last = _base(model)(input_ids=token, cache=cache, use_cache=True).last_hidden_state[:, -1]
        decode_rows.append(last)
    all_tokens = torch.stack(tokens, dim=1)  # [n, steps]
    all_logprobs = torch.stack(token_logprobs, dim=1)
    all_rows = torch.stack(decode_rows, dim=1) if decode_rows else hidden.new_empty(n, 0, 0)
    generations = []
    for i in range(n):
        row = all_tokens[i].tolist()
        stop = row.index(eos_token_id) + 1 if eos_token_id in row else len(row)
        generations.append(
            Generation(
                prompt_ids=list(prompt_ids),
                completion_ids=row[:stop],
                logprobs=all_logprobs[i, :stop].tolist(),
                finish_reason="stop" if row[stop - 1] == eos_token_id else "length",
                prefill_bits=prefill_bits,
                decode_bits=_decode_bits(all_rows, i, stop - 1, hidden.shape[-1]),
            )
        )
    return generations


def _check_stop(interrupted: threading.Event | None) -> None:
    if interrupted is not None and interrupted.is_set():
        raise GenerationInterrupted("the engine was interrupted (shutting down)")


def _decode_bits(
    rows: torch.Tensor, i: int, count: int, hidden_size: int
) -> npt.NDArray[np.uint16]:
    if count == 0:
        empty = np.zeros((0, hidden_size), dtype=np.uint16)
        empty.setflags(write=False)
        return empty
    return bf16_bits(rows[i, :count])


@torch.inference_mode()
def prefill_activations(
    model: Any,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    temperature: float = 1.0,
) -> tuple[npt.NDArray[np.uint16], npt.NDArray[np.uint16], list[float]]:
    """The validator's teacher-forced pass over ``prompt + completion[:-1]``.

    Args:
        model: the causal LM of the claimed policy version (bf16 for TOPLOC).
        prompt_ids: ``L >= 1`` ids.
        completion_ids: ``N >= 1`` ids as submitted.
        temperature: the claimed sampling temperature ``T > 0``.

    Returns:
        ``(prefill_bits [L, H] uint16, decode_bits [N-1, H] uint16, logprobs [N])``: the
        same layout as :class:`Generation`; ``logprobs[j]`` is ``log_softmax(float32(logits)
        / T)`` of ``o_j`` at position ``L-1+j``.

    Raises:
        LocalProtocolError: empty prompt or completion, bad id, ``temperature <= 0``.
    """
    if not completion_ids:
        raise LocalProtocolError("empty completion")
    ids = [*prompt_ids, *completion_ids]
    _check_args(ids, temperature, int(model.config.vocab_size))
    length = len(prompt_ids)
    inputs = torch.tensor([ids[:-1]])
    hidden = _base(model)(input_ids=inputs, use_cache=False).last_hidden_state[0]  # [L+N-1, H]
    logp = _logprobs(model, hidden[length - 1 :], temperature)  # [N, V]
    targets = torch.tensor(list(completion_ids)).unsqueeze(1)
    logprobs = logp.gather(1, targets)[:, 0].tolist()
    return bf16_bits(hidden[:length]), bf16_bits(hidden[length:]), logprobs


@torch.inference_mode()
def prefill_activations_group(
    model: Any,
    prompt_ids: Sequence[int],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
    keys: Sequence[NoiseKey] | None = None,
) -> list[TeacherForced]:
    """:func:`prefill_activations_batch` for a GRPO group (one prompt, several completions).

    Args:
        model, prompt_ids, temperature: as :func:`prefill_activations`.
        completions: the group's completions, each ``N >= 1`` ids.
        keys: the noise key of each completion (:func:`rollout.gumbel.sample_key`), to
            compute its replay gaps from the logits while they are in memory; ``None``: no
            gaps.

    Returns:
        one :class:`TeacherForced` per completion, in order.

    Raises:
        LocalProtocolError: as :func:`prefill_activations`, or ``keys`` of the wrong length.
    """
    items = [(prompt_ids, c) for c in completions]
    return prefill_activations_batch(model, items, temperature, keys)


DEFAULT_BATCH_TOKENS = 512
"""Padded tokens per forward of :func:`prefill_activations_batch` (rows x width). On this
project's CPU (one thread, bf16) 512 was the fastest of 256..8192 for every bench model
(CPU ms per rollout of ~100 tokens, 512 vs 8192: ``tiny`` 1.8 vs 3.0, ``h512`` 10.6 vs 16.5,
``m100`` 76 vs 96): a few rows per pass already fill the matrix units, and larger activations
fall out of cache. A GPU wants far larger batches."""


@torch.inference_mode()
def prefill_activations_batch(
    model: Any,
    items: Sequence[tuple[Sequence[int], Sequence[int]]],
    temperature: float = 1.0,
    keys: Sequence[NoiseKey] | None = None,
    max_batch_tokens: int = DEFAULT_BATCH_TOKENS,
) -> list[TeacherForced]:
    """:func:`prefill_activations` for many ``(prompt_ids, completion_ids)`` pairs (a whole
    rollout batch: every group, every sample) in as few forward passes as fit the budget.

    The sequences ``prompt + completion[:-1]`` are sorted by length (longest first), cut into
    sub-batches of at most ``max_batch_tokens`` padded tokens (at least one row each) and each
    sub-batch is right-padded with id 0 into one ``[B, T]`` forward *without* an attention
    mask: causal attention means a real position never sees the padding after it and position
    ids count from 0 in every row, so each row is the same computation as alone, up to the
    float rounding that a different batch shape can change (kernels block ``[B·T, H]`` matmuls
    and attention differently). ``bench/verification.py`` measures that difference
    (``details.timing.batching``) and calibrates the thresholds on this path. On CPU a
    batched pass saves the per-call overhead of small models; sorting keeps padding small.

    Args:
        model: the causal LM of the claimed policy version (bf16 for TOPLOC).
        items: ``(prompt_ids, completion_ids)`` pairs, ``L >= 1`` and ``N >= 1`` ids each.
        temperature: the claimed sampling temperature ``T > 0``.
        keys: each item's Gumbel noise key (:func:`rollout.gumbel.sample_key`), to compute its
            replay gaps while the logits are in memory; ``None``: no gaps.
        max_batch_tokens: padded-token budget per forward pass (rows x width), >= 1.

    Returns:
        one :class:`TeacherForced` per item, in order (gaps:
        :func:`rollout.gumbel.replay_gaps` of the float32 logits).

    Raises:
        LocalProtocolError: an empty prompt or completion, a bad id, ``temperature <= 0``,
            or ``keys`` of the wrong length.
    """
    if keys is not None and len(keys) != len(items):
        raise LocalProtocolError(f"{len(keys)} noise keys for {len(items)} completions")
    seqs = []
    for prompt_ids, completion_ids in items:
        if not prompt_ids or not completion_ids:
            raise LocalProtocolError("empty prompt or completion")
        ids = [*prompt_ids, *completion_ids]
        _check_args(ids, temperature, int(model.config.vocab_size))
        seqs.append(ids[:-1])
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i]))
    out: list[Any] = [None] * len(seqs)
    start = 0
    while start < len(order):
        width = len(seqs[order[start]])
        rows = order[start : start + max(1, max_batch_tokens // width)]
        start += len(rows)
        inputs = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            inputs[r, : len(seqs[i])] = torch.tensor(seqs[i])
        hidden = _base(model)(input_ids=inputs, use_cache=False).last_hidden_state
        for r, i in enumerate(rows):
            prompt_ids, completion_ids = items[i]
            key = None if keys is None else keys[i]
            h = hidden[r, : len(seqs[i])]
            out[i] = _teacher_forced(model, h, prompt_ids, completion_ids, temperature, key)
    return out


def _teacher_forced(
    model: Any,
    hidden: torch.Tensor,
    prompt_ids: Sequence[int],
    completion_ids: Sequence[int],
    temperature: float,
    key: NoiseKey | None,
) -> TeacherForced:
    """One completion's :class:`TeacherForced` from its rows ``hidden [L+N-1, H]``."""
    length = len(prompt_ids)
    logits = _logits(model, hidden[length - 1 :])  # [N, V]
    logp = torch.log_softmax(logits / temperature, dim=-1)
    logprobs = logp.gather(1, torch.tensor(list(completion_ids)).unsqueeze(1))[:, 0].tolist()
    gaps = None
    if key is not None:
        gaps = replay_gaps(logits.numpy(), completion_ids, key, temperature)
    return TeacherForced(bf16_bits(hidden[:length]), bf16_bits(hidden[length:]), logprobs, gaps)


class TransformersEngine:
    """CPU inference with transformers and a hand-written sampling loop.

    Args:
        dtype: parameter dtype of the loaded model; bf16 (the TOPLOC precision).

    Not safe for concurrent calls; ``load`` and ``generate`` must not overlap.
    :meth:`interrupt` is safe from any thread.
    """

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self._dtype = dtype
        self._model: Any = None
        self._checkpoint: Path | None = None
        self._eos: int | None = None
        self._loads = 0
        self._tokens = 0
        self._generate_s = 0.0
        self._stop = threading.Event()

    @property
    def model(self) -> Any:
        """The loaded model (``None`` before the first load or after a failed swap)."""
        return self._model

    @property
    def checkpoint_dir(self) -> Path | None:
        """The directory the current weights came from."""
        return self._checkpoint

    def load(self, checkpoint_dir: str | Path) -> None:
        """Load a checkpoint, in place when the architecture is unchanged.

        Raises:
            CheckpointMismatch: the checkpoint is incomplete, malformed, lacks a tokenizer
                (``tokenizer.json`` with an eos token), or does not fit the config.
                Everything is checked before any weight is touched, so the engine keeps
                serving the last good version. Only if a file becomes unreadable in the
                middle of the copy is the engine left unloaded (``model is None``; fail
                closed, the weights being half swapped) until a later ``load`` succeeds.
        """
        checkpoint_dir = Path(checkpoint_dir)
        eos = stop_token_id(load_tokenizer(checkpoint_dir))  # the checkpoint's own stop token
        model = self._model
        if model is None or _config_changed(model, checkpoint_dir):
            model = load_model(checkpoint_dir, self._dtype)  # the old one serves until here
        else:
            files = check_weights(model, checkpoint_dir)
            try:
                copy_weights(model, files)
            except BaseException:
                self._model = self._checkpoint = None
                raise
        self._model = model
        self._checkpoint = checkpoint_dir
        self._eos = eos
        self._loads += 1

    def weight_specs(self) -> dict[str, TensorSpec]:
        """Checkpoint tensor name → dtype and shape as held (empty when unloaded)."""
        if self._model is None:
            return {}
        return {name: tensor_spec(t) for name, t in stored_state(self._model).items()}

    def apply_update(self, plan: UpdatePlan, checkpoint_dir: str | Path) -> None:
        """Apply ``plan`` to the weights held (see module docstring); then serve
        ``checkpoint_dir``'s version. Nothing is read from ``checkpoint_dir``: its config and
        tokenizer must be the held version's (the caller checks). No cache outlives a
        ``generate`` call here, so there is none to reset.

        Raises:
            LocalProtocolError: nothing loaded.
            DeltaMismatch: the plan does not fit the model (checked before any write: the old
                weights keep serving).
        """
        if self._model is None:
            raise LocalProtocolError("apply_update() before a successful load()")
        apply_patches(check_patch_targets(plan, stored_state(self._model)))
        self._checkpoint = Path(checkpoint_dir)
        self._loads += 1

    def generate(
        self,
        prompt_ids: Sequence[int],
        n: int,
        max_new_tokens: int,
        temperature: float,
        seed: int,
    ) -> list[Generation]:
        """:func:`sample_group` with the loaded model.

        Raises:
            LocalProtocolError: nothing loaded, or bad arguments.
            GenerationInterrupted: :meth:`interrupt` was called (before or during the call).
        """
        if self._model is None or self._eos is None:
            raise LocalProtocolError("generate() before a successful load()")
        start = time.perf_counter()
        gens = sample_group(
            self._model, prompt_ids, n, max_new_tokens, temperature, seed, self._eos, self._stop
        )
        self._generate_s += time.perf_counter() - start
        self._tokens += sum(len(g.completion_ids) for g in gens)
        return gens

    def interrupt(self) -> None:
        """See :meth:`Interruptible.interrupt`: a running ``generate`` stops before its next
        decode pass (one forward pass of the group at most)."""
        self._stop.set()

    def statistics(self) -> EngineStats:
        """Counters since construction."""
        return EngineStats(self._loads, self._tokens, self._generate_s)


def _config_changed(model: Any, checkpoint_dir: Path) -> bool:
    """Whether ``checkpoint_dir``'s config.json describes a different model than ``model``'s."""
    try:
        new = AutoConfig.from_pretrained(checkpoint_dir, local_files_only=True)
    except (OSError, ValueError, KeyError):
        return True  # let load_model raise the typed error
    old_dict, new_dict = model.config.to_dict(), new.to_dict()
    ignored = {"dtype", "transformers_version", "architectures", "_name_or_path"}
    return {k: v for k, v in old_dict.items() if k not in ignored} != {
        k: v for k, v in new_dict.items() if k not in ignored
    }
