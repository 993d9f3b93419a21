"""TOPLOC proofs: commit to hidden states and check them (byte-compatible with toploc 0.1.6).

Theory of operation
-------------------
TOPLOC (Ong et al., "TOPLOC: A Locality Sensitive Hashing Scheme for Trustless Verifiable
Inference", arXiv 2501.16007, ICML 2025) lets an inference worker commit to the activations it
computed, cheaply enough to attach to every rollout, so that a verifier who re-runs one
teacher-forced forward pass can tell honest generation from a different model, prompt or
precision. This module implements the normative spec ``shared/TOPLOC.md``:

1. **Activations** (§2) are the final-norm hidden states in bf16, given here as their raw 16-bit
   patterns (``np.uint16``): a prefill matrix ``[L, H]`` and decode rows ``[T, H]``.
2. **Chunks** (§3): the whole prefill, flattened row by row, is chunk 0 (unless
   ``skip_prefill``); then the decode rows in consecutive groups of ``decode_batching_size``
   (the last may be shorter), each flattened row by row. One proof per chunk.
3. **Proof of a chunk** (§4): pick the ``k`` largest magnitudes (``bits & 0x7FFF``, ties by
   lowest index), find the largest modulus ``m <= 65497`` under which their flat indices are
   distinct, and interpolate the polynomial ``P`` of degree ``< k`` over GF(65497) through the
   points ``(i mod m, bits[i])``. The proof is ``m`` and the ``k`` coefficients of ``P``.
4. **Verification** (§6, tensor-path rules of §8): the verifier selects the top-``k`` of *its
   own* chunk, evaluates ``P(i mod m)`` at those indices and compares the claimed bf16 patterns
   with its own: the number of exponent mismatches, and the mean and median
   (``sorted[n // 2]``) absolute mantissa difference over exponent matches (``2**64`` if none).
   Small numeric drift (other GPU, kernel order) keeps the top-``k`` set and the exponents and
   moves mantissas by an ulp or two. Where the sets differ, ``P`` is evaluated off its committed
   points and returns an essentially random field element, so a different model, prompt or
   precision mismatches nearly every exponent. :func:`judge` applies thresholds (§9).

Byte layout of one proof (§5), all fields unsigned 16-bit **big-endian**::

    offset  size  content
    0       2     m, the injective modulus (0xFFD9 when m = 65497; 0 only in a null proof)
    2+2j    2     c_j, j = 0 .. k-1, ascending degree (c_0 is the constant term), each < 65497
    total   2 + 2k bytes (258 bytes for k = 128; 344 base64 characters, no padding)

Parsing fails closed (§5 recommendation, §7): exactly ``2 + 2k`` bytes, ``k <= m <= 65497``, every
coefficient ``< 65497``; the reference's "null proof" (``m = 0``, produced when its builder hit
an error) is rejected with reason ``proof_null``, and this builder never produces one.

Ties at the top-``k`` boundary: the reference (``torch.topk``) breaks them unspecifiedly, so
byte-identical proofs are only guaranteed for chunks without a boundary tie (§4 step 1); this
implementation breaks them by lowest index, deterministically.

Layout: GF(p) arithmetic lives in :mod:`rollout.toploc_field`, the wire codec (:class:`Proof`,
:func:`parse_proof`, base64) in :mod:`rollout.toploc_codec`, and the per-chunk statistics and
acceptance policy (:class:`ChunkResult`, :func:`judge`) in :mod:`rollout.toploc_judge`. All are
re-exported here, so callers import only this module.

No torch import happens at module import time; :func:`bf16_bits` imports it lazily to convert a
tensor. All functions are pure and safe to call concurrently from several threads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from p2p.errors import ConfigError, LocalProtocolError, VerificationError
from rollout.toploc_codec import (
    Proof,
    check_topk,
    decode_proof_base64,
    encode_proof_base64,
    parse_proof,
    proof_size_bytes,
)
from rollout.toploc_field import FIELD_PRIME, evaluate, find_injective_modulus, interpolate
from rollout.toploc_judge import (
    NO_MATCH_ERROR,
    ChunkResult,
    ToplocThresholds,
    ToplocVerdict,
    judge,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "FIELD_PRIME",
    "NO_MATCH_ERROR",
    "ChunkResult",
    "Proof",
    "ToplocConfig",
    "ToplocThresholds",
    "ToplocVerdict",
    "bf16_bits",
    "build_chunk_proof",
    "build_proofs",
    "chunk_activations",
    "decode_proof_base64",
    "encode_proof_base64",
    "judge",
    "parse_proof",
    "proof_size_bytes",
    "topk_indices",
    "verify_chunk",
    "verify_proofs",
]

Bits = NDArray[np.uint16]


@dataclass(frozen=True)
class ToplocConfig:
    """Parameters shared by prover and verifier; both must use the same values.

    Attributes:
        topk: values committed per chunk, ``k`` (paper and INTELLECT-2: 128). ``1 <= k <= 65497``.
        decode_batching_size: decode steps (rows) per decode chunk, ``B`` (paper: 32), ``>= 1``.
        skip_prefill: if true, the prefill is not committed and only decode chunks are proven
            (prime-rl's setting, TOPLOC.md §2).

    Raises:
        ConfigError: a field is out of range or of the wrong type.
    """

    topk: int = 128
    decode_batching_size: int = 32
    skip_prefill: bool = False

    def __post_init__(self) -> None:
        check_topk(self.topk, "toploc.topk")
        b = self.decode_batching_size
        if isinstance(b, bool) or not isinstance(b, int) or b < 1:
            raise ConfigError("toploc.decode_batching_size", f"must be an int >= 1, got {b!r}")
        if not isinstance(self.skip_prefill, bool):
            raise ConfigError("toploc.skip_prefill", f"must be a bool, got {self.skip_prefill!r}")


def bf16_bits(tensor: torch.Tensor) -> Bits:
    """Raw bit patterns of a bf16 torch tensor, as ``np.uint16`` of the same shape.

    Imports torch lazily. The tensor is detached and copied to host memory if needed; for a
    contiguous CPU tensor the result shares its memory.

    Raises:
        LocalProtocolError: ``tensor`` is not a torch tensor or its dtype is not ``bfloat16``.
    """
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise LocalProtocolError(f"expected a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype != torch.bfloat16:
        raise LocalProtocolError(f"TOPLOC commits bf16 activations only, got {tensor.dtype}")
    host = tensor.detach().cpu().contiguous()
    bits: Bits = host.view(torch.int16).numpy().view(np.uint16)
    return bits


def _check_bits(arr: object, name: str, ndim: int) -> Bits:
    if not isinstance(arr, np.ndarray) or arr.dtype != np.uint16 or arr.ndim != ndim:
        what = f"{arr.dtype}{arr.shape}" if isinstance(arr, np.ndarray) else type(arr).__name__
        raise LocalProtocolError(f"{name} must be a {ndim}-D np.uint16 array of bf16 bits: {what}")
    return arr


def chunk_activations(prefill: Bits | None, decode: Bits, cfg: ToplocConfig) -> list[Bits]:
    """Cut activations into the flat chunks that proofs cover (TOPLOC.md §3).

    Args:
        prefill: ``[L, H]`` ``np.uint16`` bf16 bits of the prompt positions; ignored (may be
            ``None``) when ``cfg.skip_prefill``.
        decode: ``[T, H]`` ``np.uint16`` bf16 bits, row ``t`` is decode step ``t + 1`` (may have
            ``T = 0``).
        cfg: chunking parameters.

    Returns:
        1-D ``np.uint16`` arrays (views where possible): the flattened prefill (``L·H`` values)
        unless skipped, then ``ceil(T / B)`` decode chunks of ``B·H`` values (the last may hold
        fewer rows). Flat index ``t·H + h`` is row ``t``, hidden dimension ``h``.

    Raises:
        LocalProtocolError: an array has the wrong type, dtype or rank, the prefill is missing,
            or the hidden sizes of prefill and decode differ.
    """
    dec = _check_bits(decode, "decode", 2)
    chunks: list[Bits] = []
    if not cfg.skip_prefill:
        if prefill is None:
            raise LocalProtocolError("prefill is required unless skip_prefill is set")
        pre = _check_bits(prefill, "prefill", 2)
        if dec.shape[0] and pre.shape[1] != dec.shape[1]:
            raise LocalProtocolError(f"hidden sizes differ: {pre.shape[1]} vs {dec.shape[1]}")
        chunks.append(pre.reshape(-1))
    b = cfg.decode_batching_size
    chunks.extend(dec[start : start + b].reshape(-1) for start in range(0, dec.shape[0], b))
    return chunks


def topk_indices(chunk_bits: Bits, topk: int) -> NDArray[np.int64]:
    """Flat indices of the ``topk`` largest magnitudes, ties broken by lowest index (§4 step 1).

    Magnitude is ``bits & 0x7FFF`` as an unsigned integer (sign ignored, NaN above infinity).

    Args:
        chunk_bits: ``[n]`` ``np.uint16`` bf16 bits with ``n >= topk``.
        topk: ``k``.

    Returns:
        ``[k]`` ``int64`` indices in ascending order.

    Raises:
        LocalProtocolError: ``chunk_bits`` is not a 1-D ``np.uint16`` array or ``n < k``.
        ConfigError: ``topk`` is out of range.
    """
    check_topk(topk)
    bits = _check_bits(chunk_bits, "chunk_bits", 1)
    n = bits.size
    if n < topk:
        raise LocalProtocolError(f"chunk has {n} values, fewer than topk={topk}")
    if n == topk:
        return np.arange(n, dtype=np.int64)
    keys = bits & np.uint16(0x7FFF)
    # The k-th largest magnitude, from a histogram of the 2**15 possible keys: O(n), and about
    # 4x faster than np.argpartition at n = 32·4096.
    at_or_above = np.cumsum(np.bincount(keys, minlength=0x8000)[::-1])
    kth = np.uint16(0x7FFF - int(np.searchsorted(at_or_above, topk)))
    above = np.flatnonzero(keys > kth)
    tied = np.flatnonzero(keys == kth)[: topk - above.size]
    return np.sort(np.concatenate((above, tied))).astype(np.int64)


def build_chunk_proof(chunk_bits: Bits, topk: int) -> bytes:
    """Build the proof of one chunk (TOPLOC.md §4), ``2 + 2 * topk`` bytes.

    Args:
        chunk_bits: ``[n]`` ``np.uint16`` bf16 bits of the flattened chunk, ``n >= topk``.
        topk: ``k``.

    Returns:
        The proof bytes, laid out as in the module docstring (never a null proof).

    Raises:
        LocalProtocolError: the chunk is not a 1-D ``np.uint16`` array, has fewer than ``k``
            values, or has no injective modulus ``>= k`` (practically impossible).
        ConfigError: ``topk`` is out of range.
    """
    idx = topk_indices(chunk_bits, topk)
    modulus = find_injective_modulus(idx)
    xs = idx % modulus
    ys = chunk_bits[idx].astype(np.int64) % FIELD_PRIME
    coeffs = interpolate(xs, ys)
    out = np.empty(1 + topk, dtype=">u2")
    out[0] = modulus
    out[1:] = coeffs
    return out.tobytes()


def build_proofs(prefill: Bits | None, decode: Bits, cfg: ToplocConfig) -> list[bytes]:
    """Build one proof per chunk of :func:`chunk_activations` (prover side).

    Args and shapes as in :func:`chunk_activations`.

    Returns:
        ``[1 + ] ceil(T / B)`` proofs of ``2 + 2k`` bytes each, in chunk order.

    Raises:
        LocalProtocolError: bad arrays, or a chunk with fewer than ``k`` values.
    """
    return [build_chunk_proof(chunk, cfg.topk) for chunk in chunk_activations(prefill, decode, cfg)]


def _as_proof(proof: Proof | bytes, topk: int) -> Proof:
    if isinstance(proof, Proof):
        if len(proof.coeffs) != topk:
            raise VerificationError(
                "proof_malformed", f"{len(proof.coeffs)} coefficients, expected {topk}"
            )
        return proof
    return parse_proof(proof, topk)


def verify_chunk(chunk_bits: Bits, proof: Proof | bytes, topk: int) -> ChunkResult:
    """Check one proof against the verifier's own chunk (TOPLOC.md §6, tensor-path rules).

    Args:
        chunk_bits: ``[n]`` ``np.uint16`` bf16 bits of the verifier's flattened chunk.
        proof: the prover's proof, parsed or as bytes.
        topk: ``k``.

    Returns:
        The chunk's :class:`ChunkResult` (judge it with :func:`judge`).

    Raises:
        VerificationError: the proof is malformed or null (see :func:`parse_proof`), or
            ``chunk_too_small`` if the chunk has fewer than ``k`` values (no honest proof exists).
        LocalProtocolError: ``chunk_bits`` is not a 1-D ``np.uint16`` array.
    """
    parsed = _as_proof(proof, topk)
    bits = _check_bits(chunk_bits, "chunk_bits", 1)
    if bits.size < topk:
        raise VerificationError("chunk_too_small", f"{bits.size} values, fewer than k={topk}")
    idx = topk_indices(bits, topk)
    claimed = evaluate(np.array(parsed.coeffs, dtype=np.int64), idx % parsed.modulus)
    mine = bits[idx].astype(np.int64)
    exp_match = ((claimed >> 7) & 0xFF) == ((mine >> 7) & 0xFF)
    errors = np.abs((claimed & 0x7F) - (mine & 0x7F))[exp_match]
    mismatches = topk - int(exp_match.sum())
    if errors.size == 0:
        return ChunkResult(mismatches, NO_MATCH_ERROR, NO_MATCH_ERROR)
    mean = int(errors.sum()) / int(errors.size)  # exact sum, correctly rounded division
    median = float(np.sort(errors)[errors.size // 2])
    return ChunkResult(mismatches, mean, median)


def verify_proofs(
    prefill: Bits | None, decode: Bits, proofs: Sequence[Proof | bytes], cfg: ToplocConfig
) -> list[ChunkResult]:
    """Verify one rollout's proofs against the verifier's own activations (TOPLOC.md §6–§8).

    Every proof is parsed before any chunk is evaluated, so a malformed proof costs no work.

    Args:
        prefill, decode, cfg: the verifier's activations, as in :func:`chunk_activations`.
        proofs: the prover's proofs in chunk order.

    Returns:
        One :class:`ChunkResult` per chunk, in chunk order.

    Raises:
        VerificationError: ``proof_count`` if ``len(proofs)`` differs from the number of
            chunks; ``proof_malformed``/``proof_null``/``chunk_too_small`` as in
            :func:`verify_chunk` (the detail names the chunk).
        LocalProtocolError: the activation arrays are invalid, or ``proofs`` is a single
            bytes object rather than a sequence of proofs.
    """
    if isinstance(proofs, bytes | bytearray | memoryview | str):
        raise LocalProtocolError("proofs must be a sequence of proofs, not one proof's bytes")
    chunks = chunk_activations(prefill, decode, cfg)
    if len(proofs) != len(chunks):
        raise VerificationError("proof_count", f"{len(proofs)} proofs for {len(chunks)} chunks")
    parsed: list[Proof] = []
    for n, proof in enumerate(proofs):
        try:
            parsed.append(_as_proof(proof, cfg.topk))
        except VerificationError as exc:
            raise VerificationError(exc.reason, f"chunk {n}: {exc.detail}") from None
    results = []
    for n, (chunk, proof) in enumerate(zip(chunks, parsed, strict=True)):
        try:
            results.append(verify_chunk(chunk, proof, cfg.topk))
        except VerificationError as exc:
            raise VerificationError(exc.reason, f"chunk {n}: {exc.detail}") from None
    return results
