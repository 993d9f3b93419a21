"""Replayable sampling: seeded Gumbel-max noise, the replay check and the termination check.

Theory of operation
-------------------
An inference peer does not draw its tokens from a private random stream: every draw is
**Gumbel-max** with noise that anyone can regenerate. For sample ``i`` of prompt ``p`` that
peer ``P`` produced at policy step ``s`` of run ``r``, the token at completion position ``j``
(``o_j``, counted from 0 after the prompt) is::

    o_j = argmax_v ( float32(logits_j[v]) / T + g(key, j, v) )
    key = NoiseKey(group_seed(r, P, s, p), i)

where ``logits_j`` are the model's LM-head outputs that produce ``o_j`` (bf16, widened to
float32) and ``g`` is standard Gumbel noise. Because ``argmax(z + g)`` with i.i.d. Gumbel(0, 1)
``g`` is distributed as ``softmax(z)``, this samples exactly ``softmax(logits / T)`` — the
sampling distribution of the engines before this module — while making every token a
deterministic function of (key, position, logits). A validator that recomputes the logits with
a teacher-forced pass regenerates ``g`` and checks that each submitted token is the argmax
within a margin (:func:`check_replay`). This is the scheme of TOPLOC2 (PrimeIntellect prime-rl
PR #360, used for SYNTHETIC-2) and of Token-DiFR (arXiv 2511.20621, "Token-level
Divergence-From-Reference"), both of which seed the sampler so that the verifier can replay it;
GRAIL (the Bittensor "grail" verifier) adds the termination rule of :func:`check_termination`.

**The noise generator** is counter-based, so the noise of one (key, position, vocabulary
range) never depends on which other samples share a batch, on the engine, on the order of
calls, or on the machine:

- ``group_seed`` is the first 16 bytes of BLAKE3 over a domain tag and the length-prefixed
  run id, submitter PeerID, policy step and prompt index; :meth:`NoiseKey.philox_key` hashes
  ``(group seed, sample index)`` the same way into a 128-bit Philox key (two ``uint64``).
- Position ``j``'s noise over a vocabulary of ``V`` entries is made of ``ceil(V / CHUNK)``
  chunks of :data:`CHUNK` values. Chunk ``c`` is ``CHUNK`` raw outputs of numpy's
  ``Philox`` (Philox4x64-10, Salmon et al., SC'11 "Parallel random numbers: as easy as
  1, 2, 3") with that key and counter ``[0, c, j, 0]`` (numpy increments word 0 before each
  block; bit generators keep their streams stable across numpy versions, unlike
  ``Generator`` methods, and ``tests/unit/test_gumbel.py`` pins known values). Vocabulary
  entry ``v`` takes value ``v mod CHUNK`` of chunk ``v // CHUNK``: the noise of a vocabulary
  range is the same whatever the vocabulary size or which range is generated.
- Each raw 64-bit ``x`` becomes ``u = ((x >> 11) + 0.5) / 2**53`` (float64, strictly inside
  (0, 1)), then ``g = -log(-log(u))`` in float64, rounded to float32. The integer steps are
  exact everywhere; ``log`` may differ by one float64 ulp between libm/SIMD builds, which
  almost never changes the float32 result and is far inside any margin.

The score ``float32(logits) / float32(T) + g`` is computed in float32 with numpy by both
engines and the validator (:func:`gumbel_scores`), so that an engine's own arithmetic (a
fused or reciprocal division, say) does not enter.

**The replay check** (:func:`replay_gaps`, :func:`judge_replay`, :func:`check_replay`): with
the validator's scores ``S_j`` at position ``j``, the *gap* of the submitted token is
``max(S_j) - S_j[o_j] >= 0``; it is 0 when the validator agrees with the peer. An honest peer's
gap is non-zero only where its logits and the validator's differ enough to swap the top two
scores, so gaps stay of the order of the numeric difference between the two forward passes
(a few bf16 ulps of a logit, divided by ``T``). A tampered token has the gap of a random
token (several units), and a completion sampled greedily, at another temperature or with other
noise disagrees with the replay at many positions. A rollout passes when every gap is at or
below ``margin`` (score units: nats of ``softmax(logits / T)``). The check covers every
completion token, the last one included, whose hidden state TOPLOC never commits.

**The termination check** (:func:`check_termination`): a ``"stop"`` completion must end on
EOS, have no EOS before, and the validator's probability of EOS at the last position under the
sampling distribution ``softmax(logits / T)`` must be at least ``eos_min_prob`` (GRAIL uses
0.02; this project's provisional default is lower, see :data:`DEFAULT_EOS_MIN_PROB`); a
``"length"`` completion must have exactly ``max_new_tokens`` tokens and no EOS.

Pure numpy and the standard library (plus ``blake3``); thread-safe (one bit generator per
thread); no engine imports.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import blake3
import numpy as np
import numpy.typing as npt

from p2p.errors import LocalProtocolError

__all__ = [
    "CHUNK",
    "DEFAULT_EOS_MIN_PROB",
    "GRAIL_EOS_MIN_PROB",
    "NOISE_DOMAIN",
    "NoiseKey",
    "ReplayResult",
    "TerminationFailure",
    "TerminationResult",
    "check_replay",
    "check_termination",
    "group_seed",
    "gumbel_argmax",
    "gumbel_noise",
    "gumbel_noise_rows",
    "gumbel_scores",
    "judge_replay",
    "replay_gaps",
    "sample_key",
]

NOISE_DOMAIN = b"shardnet/gumbel-noise/v1\x00"
"""Domain tag of every hash in this module (changing the scheme means a new tag)."""
CHUNK = 4096
"""Noise values per Philox counter (one chunk of the vocabulary)."""
GRAIL_EOS_MIN_PROB = 0.02
"""GRAIL's floor on the validator's EOS probability at a ``"stop"`` completion's last token."""
DEFAULT_EOS_MIN_PROB = 1e-6
"""This project's provisional floor. An honest sample fails a floor ``f`` only by drawing EOS
where its probability is below ``f``, which happens with probability below ``f`` per
position: at most ``N * f`` per completion of ``N`` tokens, whatever the model. GRAIL's 0.02
rejects every honest ``"stop"`` completion of an untrained model whose EOS probability is near
``1 / V`` everywhere (the ``tiny`` preset, ``V = 128``: measured 0.0039–0.0067 at every
position; the small Qwen2 test model: 0.0008), and a trained model's EOS probability away from
an ending is often below 0.02 yet drawn now and then. With the replay check in place the floor
is a second line (an EOS forced where it is improbable also has a large replay gap); calibrate
it with ``bench/verification.py`` before raising it.

There is no default replay margin here: the margin depends on the engine, the model's logit
scale and the temperature, so it is part of each engine's calibrated profile
(``rollout.verify.EngineProfile.replay_margin``; ``ValidatorConfig.replay_margin`` for
``transformers-bf16``), and :func:`check_replay` / :func:`judge_replay` take it explicitly."""

_F32 = npt.NDArray[np.float32]
_MAX_POSITION = 1 << 62


def _field(h: blake3.blake3, value: str | int) -> None:
    data = value.encode() if isinstance(value, str) else value.to_bytes(16, "big", signed=True)
    h.update(len(data).to_bytes(4, "big"))
    h.update(data)


def group_seed(run_id: str, submitter: str, policy_step: int, prompt_index: int) -> int:
    """The 128-bit noise seed of one prompt's group.

    Args:
        run_id: the run id.
        submitter: the producing peer's PeerID (base58 string).
        policy_step: the policy version that samples.
        prompt_index: the prompt's position among the peer's prompts of that step.

    Returns:
        an integer in ``[0, 2**128)``: the first 16 bytes (big-endian) of BLAKE3 over
        :data:`NOISE_DOMAIN`, ``b"group"`` and the four fields, each length-prefixed.
    """
    h = blake3.blake3(NOISE_DOMAIN + b"group")
    for value in (run_id, submitter, policy_step, prompt_index):
        _field(h, value)
    return int.from_bytes(h.digest(16), "big")


@dataclass(frozen=True)
class NoiseKey:
    """The key of one sample's noise stream.

    Attributes:
        seed: the group seed, :func:`group_seed` (any non-negative int below ``2**128``; a
            plain small integer works for tests and local runs).
        sample_index: the sample's index in its group, ``>= 0``.

    Raises:
        LocalProtocolError: a field is out of range.
    """

    seed: int
    sample_index: int

    def __post_init__(self) -> None:
        if not 0 <= self.seed < 1 << 128 or not 0 <= self.sample_index < 1 << 62:
            raise LocalProtocolError(
                f"noise key out of range: seed {self.seed}, sample {self.sample_index}"
            )

    def philox_key(self) -> npt.NDArray[np.uint64]:
        """The 128-bit Philox key: BLAKE3 over :data:`NOISE_DOMAIN`, ``b"sample"``, the seed
        and the sample index, first 16 bytes as two big-endian ``uint64``."""
        h = blake3.blake3(NOISE_DOMAIN + b"sample")
        _field(h, self.seed - (1 << 127))  # fits the signed 16-byte field
        _field(h, self.sample_index)
        d = h.digest(16)
        return np.array(
            [int.from_bytes(d[:8], "big"), int.from_bytes(d[8:], "big")], dtype=np.uint64
        )


def sample_key(
    run_id: str, submitter: str, policy_step: int, prompt_index: int, sample_index: int
) -> NoiseKey:
    """The noise key of sample ``sample_index`` of prompt ``prompt_index`` (see module doc)."""
    return NoiseKey(group_seed(run_id, submitter, policy_step, prompt_index), sample_index)


_LOCAL = threading.local()


def _philox() -> np.random.Philox:
    """This thread's reusable bit generator (its state is always set before use; building
    one per call would also read OS entropy for a seed that the key then overrides)."""
    gen: np.random.Philox | None = getattr(_LOCAL, "philox", None)
    if gen is None:
        gen = _LOCAL.philox = np.random.Philox(0)
    return gen


class _Stream:
    """Raw Philox output of one key at any (position, chunk) counter: the thread's bit
    generator with its state set per counter (the same values as
    ``Philox(key=k, counter=c).random_raw``, without building a generator each time)."""

    def __init__(self, key: NoiseKey) -> None:
        self.key = key.philox_key()
        self.gen = _philox()
        self.empty = np.zeros(4, dtype=np.uint64)

    def raw(self, position: int, start: int, stop: int, out: npt.NDArray[np.uint64]) -> None:
        """Write the raw values of vocabulary entries ``start .. stop-1`` at ``position``
        into ``out`` (``stop - start`` values)."""
        done = 0
        for chunk in range(start // CHUNK, (stop - 1) // CHUNK + 1):
            lo = max(start, chunk * CHUNK) - chunk * CHUNK
            hi = min(stop, (chunk + 1) * CHUNK) - chunk * CHUNK
            self.gen.state = {
                "bit_generator": "Philox",
                "state": {
                    "counter": np.array([0, chunk, position, 0], dtype=np.uint64),
                    "key": self.key,
                },
                "buffer": self.empty,
                "buffer_pos": 4,
                "has_uint32": 0,
                "uinteger": 0,
            }
            values = self.gen.random_raw(hi)  # a chunk's prefix: only what is needed
            out[done : done + hi - lo] = values[lo:]
            done += hi - lo


def _gumbel(raw: npt.NDArray[np.uint64]) -> _F32:
    """``-log(-log(u))`` with ``u = ((x >> 11) + 0.5) / 2**53``, float64 then float32."""
    u = ((raw >> np.uint64(11)).astype(np.float64) + 0.5) * (2.0**-53)
    return (-np.log(-np.log(u))).astype(np.float32)


_BLOCK_VALUES = 1 << 20  # values generated at once (bounds the float64 temporaries)


def gumbel_noise(key: NoiseKey, position: int, vocab_size: int, start: int = 0) -> _F32:
    """Gumbel(0, 1) noise of ``key`` at completion position ``position`` for vocabulary
    entries ``start .. vocab_size - 1``.

    Args:
        key: the sample's key.
        position: completion position ``j >= 0`` (``o_0`` is position 0).
        vocab_size: one past the last vocabulary entry, ``> start``.
        start: first vocabulary entry, ``>= 0``.

    Returns:
        ``[vocab_size - start]`` float32; entry ``v - start`` depends only on
        ``(key, position, v)``.

    Raises:
        LocalProtocolError: a negative position or an empty range.
    """
    row: _F32 = gumbel_noise_rows([key], [position], vocab_size, start)[0]
    return row


def gumbel_noise_rows(
    keys: Sequence[NoiseKey], positions: Sequence[int], vocab_size: int, start: int = 0
) -> _F32:
    """:func:`gumbel_noise` of several (key, position) pairs at once: row ``r`` is
    ``gumbel_noise(keys[r], positions[r], vocab_size, start)``.

    Args:
        keys: one key per row (repeat a key for several positions of one sample).
        positions: one completion position per row, ``>= 0``.
        vocab_size, start: the vocabulary range, as :func:`gumbel_noise`.

    Returns:
        ``[rows, vocab_size - start]`` float32.

    Raises:
        LocalProtocolError: lengths differ, a negative position or an empty range.
    """
    if len(keys) != len(positions):
        raise LocalProtocolError(f"{len(keys)} keys for {len(positions)} positions")
    if not 0 <= start < vocab_size or any(not 0 <= p < _MAX_POSITION for p in positions):
        raise LocalProtocolError(f"bad noise range: positions {positions}, [{start}, {vocab_size})")
    width = vocab_size - start
    out = np.empty((len(keys), width), dtype=np.float32)
    streams: dict[NoiseKey, _Stream] = {}
    block = max(1, _BLOCK_VALUES // width)
    for first in range(0, len(keys), block):
        rows = range(first, min(first + block, len(keys)))
        raw = np.empty((len(rows), width), dtype=np.uint64)
        for i, r in enumerate(rows):
            stream = streams.get(keys[r])
            if stream is None:
                stream = streams[keys[r]] = _Stream(keys[r])
            stream.raw(positions[r], start, vocab_size, raw[i])
        out[first : first + len(rows)] = _gumbel(raw)
    return out


def gumbel_scores(logits: npt.ArrayLike, noise: npt.ArrayLike, temperature: float) -> _F32:
    """``float32(logits) / float32(T) + noise`` in float32 (the Gumbel-max scores).

    Args:
        logits: ``[..., V]`` LM-head outputs (any real dtype; bf16 tensors must be widened
            by the caller, e.g. ``tensor.float().numpy()``).
        noise: ``[..., V]`` Gumbel noise (broadcastable to ``logits``).
        temperature: ``T > 0``.

    Raises:
        LocalProtocolError: ``T`` is not a positive finite number.
    """
    if not (temperature > 0 and math.isfinite(temperature)):
        raise LocalProtocolError(f"temperature must be > 0, got {temperature}")
    z = np.asarray(logits, dtype=np.float32) / np.float32(temperature)
    return (z + np.asarray(noise, dtype=np.float32)).astype(np.float32, copy=False)


def gumbel_argmax(
    logits: npt.ArrayLike, keys: Sequence[NoiseKey], position: int, temperature: float
) -> npt.NDArray[np.int64]:
    """Sample one token per row: ``argmax(logits[i] / T + g(keys[i], position))``.

    This is the sampler of both engines (TOPLOC2 / prime-rl #360, Token-DiFR): row ``i`` is
    sample ``keys[i]``, whatever else is in the batch.

    Args:
        logits: ``[n, V]`` float logits of ``n`` samples at the same completion position.
        keys: ``n`` noise keys, one per row.
        position: the completion position ``j`` all rows are at.
        temperature: ``T > 0``.

    Returns:
        ``[n]`` int64 token ids (lowest id on an exact tie).

    Raises:
        LocalProtocolError: shapes disagree, or a bad temperature/position.
    """
    z = np.asarray(logits, dtype=np.float32)
    if z.ndim != 2 or z.shape[0] != len(keys):
        raise LocalProtocolError(f"logits of shape {z.shape} for {len(keys)} keys")
    noise = gumbel_noise_rows(keys, [position] * len(keys), z.shape[1]) if keys else z
    winners: npt.NDArray[np.int64] = np.argmax(gumbel_scores(z, noise, temperature), axis=1)
    return winners.astype(np.int64, copy=False)


def replay_gaps(
    logits: npt.ArrayLike,
    completion_ids: Sequence[int],
    key: NoiseKey,
    temperature: float,
    first_position: int = 0,
) -> _F32:
    """Per-position gap of each submitted token below the replayed Gumbel-max winner.

    Args:
        logits: ``[N, V]`` the validator's logits; row ``j`` is the one that produces
            ``completion_ids[j]`` (teacher-forced position ``L - 1 + j``).
        completion_ids: ``N`` submitted token ids, each in ``[0, V)``.
        key: the sample's noise key.
        temperature: the run's ``T > 0``.
        first_position: completion position of row 0 (to check a slice of a completion).

    Returns:
        ``[N]`` float32, ``max(S_j) - S_j[o_j] >= 0`` with ``S_j`` the scores at position
        ``first_position + j``.

    Raises:
        LocalProtocolError: shapes disagree or an id is outside the vocabulary.
    """
    z = np.asarray(logits, dtype=np.float32)
    ids = np.asarray(list(completion_ids), dtype=np.int64)
    if z.ndim != 2 or z.shape[0] != ids.shape[0]:
        raise LocalProtocolError(f"logits of shape {z.shape} for {ids.shape[0]} tokens")
    vocab = z.shape[1]
    if ids.size and not (0 <= int(ids.min()) and int(ids.max()) < vocab):
        raise LocalProtocolError(f"token id outside [0, {vocab})")
    n = ids.shape[0]
    gaps = np.empty(n, dtype=np.float32)
    block = max(1, _BLOCK_VALUES // max(vocab, 1))
    for lo in range(0, n, block):
        hi = min(n, lo + block)
        rows = range(first_position + lo, first_position + hi)
        noise = gumbel_noise_rows([key] * len(rows), list(rows), vocab)
        scores = gumbel_scores(z[lo:hi], noise, temperature)
        gaps[lo:hi] = scores.max(axis=1) - scores[np.arange(hi - lo), ids[lo:hi]]
    return gaps


@dataclass(frozen=True)
class ReplayResult:
    """Outcome of the replay check of one completion.

    Attributes:
        passed: every gap is at or below the margin (and there was at least one token).
        worst_gap: the largest gap (score units), ``nan`` when there were no tokens.
        worst_position: completion position of the largest gap (first one on a tie), or -1.
        positions: how many positions were checked.
        margin: the margin applied.
    """

    passed: bool
    worst_gap: float
    worst_position: int
    positions: int
    margin: float


def judge_replay(gaps: npt.ArrayLike, margin: float, first_position: int = 0) -> ReplayResult:
    """Judge per-position gaps (from :func:`replay_gaps`) against ``margin`` (fails closed:
    no tokens, or a NaN gap, is a failure).

    Raises:
        LocalProtocolError: ``margin`` is negative or NaN.
    """
    if not margin >= 0:
        raise LocalProtocolError(f"replay margin must be >= 0, got {margin}")
    g = np.asarray(gaps, dtype=np.float64).reshape(-1)
    if g.size == 0:
        return ReplayResult(False, math.nan, -1, 0, margin)
    if np.isnan(g).any():
        j = int(np.flatnonzero(np.isnan(g))[0])
        return ReplayResult(False, math.nan, first_position + j, int(g.size), margin)
    j = int(np.argmax(g))
    worst = float(g[j])
    return ReplayResult(worst <= margin, worst, first_position + j, int(g.size), margin)


def check_replay(
    logits: npt.ArrayLike,
    completion_ids: Sequence[int],
    key: NoiseKey,
    temperature: float,
    margin: float,
) -> ReplayResult:
    """The replay check of one completion: each token must be the seeded Gumbel-max choice
    of the validator's logits within ``margin`` (see module docstring; TOPLOC2 / prime-rl
    #360, Token-DiFR arXiv 2511.20621).

    Args:
        logits: ``[N, V]`` validator logits, row ``j`` producing ``completion_ids[j]``.
        completion_ids: ``N >= 1`` submitted ids.
        key: the sample's noise key (:func:`sample_key`).
        temperature: the run's ``T``.
        margin: the largest accepted gap, score units (nats at temperature ``T``), ``>= 0``.

    Raises:
        LocalProtocolError: bad shapes, ids, temperature or margin.
    """
    return judge_replay(replay_gaps(logits, completion_ids, key, temperature), margin)


class TerminationFailure(enum.Enum):
    """Why a completion's ending is rejected (the value is the detail string)."""

    EOS_INSIDE = "eos_inside"
    STOP_WITHOUT_EOS = "stop_without_eos"
    EOS_IMPROBABLE = "eos_improbable"
    LENGTH_NOT_AT_CAP = "length_not_at_cap"
    UNKNOWN_FINISH = "unknown_finish"


@dataclass(frozen=True)
class TerminationResult:
    """Outcome of :func:`check_termination`.

    Attributes:
        passed: the ending is valid.
        failure: why not (``None`` when passed).
        eos_prob: the validator's EOS probability at the last position (``"stop"`` only, when
            given), else ``None``.
    """

    passed: bool
    failure: TerminationFailure | None
    eos_prob: float | None


def check_termination(
    completion_ids: Sequence[int],
    finish_reason: str,
    *,
    eos_id: int,
    max_new_tokens: int,
    eos_logprob: float | None = None,
    eos_min_prob: float = DEFAULT_EOS_MIN_PROB,
) -> TerminationResult:
    """Check how a completion ended (GRAIL's rule for ``"stop"``).

    Args:
        completion_ids: the ``N >= 1`` submitted ids.
        finish_reason: ``"stop"`` or ``"length"``.
        eos_id: the stop token.
        max_new_tokens: the run's cap.
        eos_logprob: the validator's ``log softmax(logits / T)[eos]`` at the last position
            (for ``"stop"``: the recomputed logprob of the last token); ``None`` skips the
            probability floor (structure only).
        eos_min_prob: the floor on ``exp(eos_logprob)``, in ``[0, 1]``.

    Returns:
        the result; a ``"stop"`` completion must end on its only EOS with probability
        ``>= eos_min_prob``, a ``"length"`` one must have exactly ``max_new_tokens`` ids and
        no EOS.
    """
    ids = list(completion_ids)
    if eos_id in ids[:-1]:
        return TerminationResult(False, TerminationFailure.EOS_INSIDE, None)
    if finish_reason == "stop":
        if not ids or ids[-1] != eos_id:
            return TerminationResult(False, TerminationFailure.STOP_WITHOUT_EOS, None)
        if eos_logprob is None:
            return TerminationResult(True, None, None)
        prob = math.exp(eos_logprob) if eos_logprob <= 0 else math.nan
        if not prob >= eos_min_prob:  # NaN fails
            return TerminationResult(False, TerminationFailure.EOS_IMPROBABLE, prob)
        return TerminationResult(True, None, prob)
    if finish_reason == "length":
        if len(ids) != max_new_tokens or ids[-1:] == [eos_id]:
            return TerminationResult(False, TerminationFailure.LENGTH_NOT_AT_CAP, None)
        return TerminationResult(True, None, None)
    return TerminationResult(False, TerminationFailure.UNKNOWN_FINISH, None)
