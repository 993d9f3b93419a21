"""Wire format of TOPLOC proofs: the byte layout, strict parsing and base64 (TOPLOC.md §5).

One proof is ``2 + 2k`` bytes, every field an unsigned 16-bit **big-endian** integer::

    offset  size  content
    0       2     m, the injective modulus (0xFFD9 when m = 65497; 0 only in a null proof)
    2+2j    2     c_j, j = 0 .. k-1, ascending degree (c_0 is the constant term), each < 65497
    total   2 + 2k bytes (258 bytes for k = 128; 344 base64 characters, no padding)

The reference (toploc 0.1.6) parser accepts any length, any ``m`` and any coefficient, and its
base64 decoder ignores characters outside the alphabet (TOPLOC.md §5, §7). This module fails
closed instead, as TOPLOC.md recommends: exactly ``2 + 2k`` bytes, ``k <= m <= 65497``, every
coefficient ``< 65497``, canonical base64 only. The reference's *null proof* (``m = 0`` and zero
coefficients, emitted when its builder hit an error) is rejected with reason ``proof_null``.

Rejections raise :class:`p2p.errors.VerificationError` with a stable ``reason``:
``proof_malformed``, ``proof_null`` or ``proof_base64``. Everything here is pure and thread-safe.
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass

import numpy as np

from p2p.errors import ConfigError, LocalProtocolError, VerificationError
from rollout.toploc_field import FIELD_PRIME

__all__ = [
    "Proof",
    "check_topk",
    "decode_proof_base64",
    "encode_proof_base64",
    "parse_proof",
    "proof_size_bytes",
]


def check_topk(topk: int, field: str = "topk") -> None:
    """Check that ``topk`` (values per chunk, ``k``) is an int in ``[1, 65497]``.

    Args:
        topk: the value to check.
        field: the config field name to report.

    Raises:
        ConfigError: it is not (``k`` points need ``k`` distinct field elements).
    """
    if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= FIELD_PRIME:
        raise ConfigError(field, f"must be an int in [1, {FIELD_PRIME}], got {topk!r}")


def proof_size_bytes(topk: int) -> int:
    """Size of one proof in bytes: ``2 + 2 * topk`` (258 for ``topk = 128``).

    Raises:
        ConfigError: ``topk`` is not an int in ``[1, 65497]``.
    """
    check_topk(topk)
    return 2 + 2 * topk


@dataclass(frozen=True)
class Proof:
    """A parsed, well-formed proof: ``P`` over GF(65497) and the modulus of its points.

    Attributes:
        modulus: ``m``, with ``len(coeffs) <= m <= 65497``.
        coeffs: ``c_0 … c_{k-1}``, ascending degree, each in ``[0, 65497)``; ``k = len(coeffs)``.

    Raises:
        VerificationError: ``proof_null`` if ``modulus == 0``, else ``proof_malformed`` if a
            field is out of range.
    """

    modulus: int
    coeffs: tuple[int, ...]

    def __post_init__(self) -> None:
        k = len(self.coeffs)
        if self.modulus == 0:
            raise VerificationError("proof_null", "modulus 0 marks a null proof")
        if k == 0 or not k <= self.modulus <= FIELD_PRIME:
            raise VerificationError(
                "proof_malformed", f"modulus {self.modulus} outside [{k}, {FIELD_PRIME}]"
            )
        if not all(0 <= c < FIELD_PRIME for c in self.coeffs):
            raise VerificationError("proof_malformed", f"a coefficient is >= {FIELD_PRIME}")

    def to_bytes(self) -> bytes:
        """The ``2 + 2k``-byte big-endian encoding (module docstring, TOPLOC.md §5)."""
        return np.array((self.modulus, *self.coeffs), dtype=">u2").tobytes()


def parse_proof(data: bytes | bytearray | memoryview, topk: int) -> Proof:
    """Parse and validate one proof strictly (fail closed, TOPLOC.md §5 recommendation).

    Args:
        data: the proof bytes.
        topk: ``k`` the verifier expects.

    Returns:
        The parsed :class:`Proof`.

    Raises:
        VerificationError: ``proof_malformed`` (length is not ``2 + 2k``, ``m`` outside
            ``[k, 65497]``, or a coefficient ``>= 65497``) or ``proof_null`` (``m = 0``).
        LocalProtocolError: ``data`` is not bytes-like.
        ConfigError: ``topk`` is out of range.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise LocalProtocolError(f"proof must be bytes, got {type(data).__name__}")
    expected = proof_size_bytes(topk)
    raw = bytes(data)
    if len(raw) != expected:
        raise VerificationError("proof_malformed", f"{len(raw)} bytes, expected {expected}")
    fields = np.frombuffer(raw, dtype=">u2").astype(np.int64).tolist()
    return Proof(modulus=fields[0], coeffs=tuple(fields[1:]))


def encode_proof_base64(data: bytes) -> str:
    """RFC 4648 standard base64 with ``=`` padding (TOPLOC.md §5); 258 bytes give 344 chars."""
    return base64.b64encode(data).decode("ascii")


def decode_proof_base64(text: str, topk: int | None = None) -> bytes:
    """Decode base64 strictly: standard alphabet, correct padding, canonical form only.

    Args:
        text: the base64 string.
        topk: if given, ``text`` must be exactly as long as a ``2 + 2k``-byte proof's encoding
            (checked before decoding, so input size is bounded).

    Returns:
        The decoded bytes (still to be checked by :func:`parse_proof`).

    Raises:
        VerificationError: ``proof_base64`` for anything but the canonical encoding.
    """
    if not isinstance(text, str) or not text or not text.isascii():
        raise VerificationError("proof_base64", "not a non-empty ASCII string")
    if topk is not None:
        want = 4 * math.ceil(proof_size_bytes(topk) / 3)
        if len(text) != want:
            raise VerificationError("proof_base64", f"{len(text)} chars, expected {want}")
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except binascii.Error as exc:
        raise VerificationError("proof_base64", str(exc)) from None
    if base64.b64encode(raw).decode("ascii") != text:
        raise VerificationError("proof_base64", "non-canonical encoding")
    return raw
