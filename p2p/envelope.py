"""One signed-envelope format for every signed message of shardnet.

Theory of operation
-------------------
A signed message is a *body* (opaque bytes: canonical JSON for manifests and run cards,
canonical CBOR for node messages) sealed by its signer's Ed25519 key under a *kind*
(:class:`Kind`). The sealed bytes are canonical CBOR (RFC 8949 §4.2) of exactly::

    {"v": 1, "kind": "<kind>", "signer": <32-byte Ed25519 public key>,
     "body": <bytes>, "sig": <64-byte Ed25519 signature>}

and the signature covers ``b"shardnet-envelope/1\\0" + kind + b"\\0" + body``. The kind is
the domain tag: a signature over a manifest header can never be replayed as a rollout
announcement or a run card, and the prefix keeps envelope signatures disjoint from the older
``b"shardnet/<domain>\\0"`` scheme (:func:`p2p.keys.domain_message`) whose signatures are
still read from data at rest.

:func:`open_envelope` (``open`` is an alias) checks, in order and before anything is
trusted: the size bound (``max_bytes``, before parsing), that the bytes are the canonical
encoding of exactly that map (so an envelope has one byte form and its bytes can be compared
or hashed), the version and the expected kind, the signature, then the *trust rule*: the
signer must be the expected PeerID, one of a set, or :data:`ANY_SIGNER` (the caller then
binds the signer to the body itself, e.g. a rollout's submitter). The signer's PeerID is
derived from the key (:func:`p2p.keys.peer_id_of`), exactly as libp2p derives it.

Pure and quick to import: cbor2, PyNaCl and base58 (through :mod:`p2p.keys`), no libp2p.
Every function is safe to call concurrently.
"""

from __future__ import annotations

import enum
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

import cbor2

from p2p.errors import (
    BadSignature,
    IntegrityError,
    MalformedEnvelope,
    MessageTooLarge,
    UntrustedSigner,
)
from p2p.keys import (
    PUBLIC_KEY_BYTES,
    SIGNATURE_BYTES,
    SigningKey,
    peer_id_of,
    verify_raw,
)

__all__ = [
    "ANY_SIGNER",
    "ENVELOPE_VERSION",
    "AnySigner",
    "Kind",
    "Opened",
    "Trust",
    "encode_sealed",
    "open",
    "open_envelope",
    "peek_kind",
    "peek_signer",
    "seal",
    "sign",
    "signed_message",
]

ENVELOPE_VERSION = 1
_PREFIX = b"shardnet-envelope/1\0"
_KEYS = frozenset({"v", "kind", "signer", "body", "sig"})
_OVERHEAD_BYTES = 160  # the map, its keys, v, kind, signer and sig around the body


class Kind(enum.StrEnum):
    """What a sealed body is; the value is the domain tag that the signature covers."""

    MANIFEST_HEADER = "manifest-header"
    MANIFEST_PART = "manifest-part"
    VERSION_ANNOUNCEMENT = "version-announcement"
    RUN_FINISHED = "run-finished"
    RUN_CONTINUED = "run-continued"
    RUN_CARD = "run-card"
    ROLLOUT_ANNOUNCEMENT = "rollout-announcement"


class AnySigner(enum.Enum):
    """The trust rule "any valid signature": the caller binds the signer to the body."""

    ANY = "any"


ANY_SIGNER = AnySigner.ANY
Trust = str | Collection[str] | AnySigner
"""Who may sign: one PeerID, a collection of PeerIDs, or :data:`ANY_SIGNER`."""


@dataclass(frozen=True)
class Opened:
    """A verified envelope.

    Attributes:
        kind: the kind it was sealed under (the one asked for).
        signer: the signer's PeerID (base58, ``12D3KooW…``).
        body: the signed body bytes.
        signature: the 64-byte Ed25519 signature (kept to re-encode the same envelope).
    """

    kind: Kind
    signer: str
    body: bytes
    signature: bytes


def signed_message(kind: Kind, body: bytes) -> bytes:
    """The exact bytes an envelope's signature covers."""
    return _PREFIX + kind.value.encode() + b"\0" + body


def encode_sealed(kind: Kind, body: bytes, public_key: bytes, signature: bytes) -> bytes:
    """The canonical envelope bytes for an existing signature (no signing, no checks beyond
    lengths): what :func:`seal` returns, rebuilt from an :class:`Opened`.

    Raises:
        ValueError: key or signature of the wrong length (a caller bug).
    """
    if len(public_key) != PUBLIC_KEY_BYTES or len(signature) != SIGNATURE_BYTES:
        raise ValueError("envelope key or signature of the wrong length")
    return cbor2.dumps(
        {
            "v": ENVELOPE_VERSION,
            "kind": kind.value,
            "signer": public_key,
            "body": body,
            "sig": signature,
        },
        canonical=True,
    )


def sign(kind: Kind, body: bytes, key: SigningKey) -> bytes:
    """The 64-byte signature :func:`seal` puts in the envelope (for message types that keep
    signer and signature as fields and rebuild the envelope with :func:`encode_sealed`)."""
    return key.sign_raw(signed_message(kind, body))


def seal(kind: Kind, body: bytes, key: SigningKey) -> bytes:
    """Sign ``body`` as a message of ``kind`` with ``key``; returns the envelope bytes
    (deterministic: Ed25519 signatures are)."""
    return encode_sealed(kind, body, key.public_key, sign(kind, body, key))


def _parse(data: bytes, max_bytes: int, sender: str) -> dict[str, Any]:
    """Size, canonical CBOR and field checks; returns the map (signature unchecked)."""
    if len(data) > max_bytes + _OVERHEAD_BYTES:
        raise MessageTooLarge(sender, f"envelope of {len(data)} bytes exceeds {max_bytes}")
    try:
        obj = cbor2.loads(data)
    except Exception as exc:  # cbor2 raises CBORDecodeError, ValueError, RecursionError...
        raise MalformedEnvelope(sender, f"envelope is not CBOR: {exc}") from exc
    if not isinstance(obj, dict) or set(obj) != _KEYS:
        raise MalformedEnvelope(sender, f"envelope must be a map of exactly {sorted(_KEYS)}")
    v, kind, signer, body, sig = obj["v"], obj["kind"], obj["signer"], obj["body"], obj["sig"]
    if type(v) is not int or v != ENVELOPE_VERSION:
        raise MalformedEnvelope(sender, f"envelope version {v!r:.20}, this node reads 1")
    if not isinstance(kind, str) or kind not in Kind._value2member_map_:
        raise MalformedEnvelope(sender, f"unknown envelope kind {kind!r:.40}")
    if not isinstance(signer, bytes) or len(signer) != PUBLIC_KEY_BYTES:
        raise MalformedEnvelope(sender, "envelope signer is not a 32-byte Ed25519 key")
    if not isinstance(sig, bytes) or len(sig) != SIGNATURE_BYTES:
        raise MalformedEnvelope(sender, "envelope sig is not 64 bytes")
    if not isinstance(body, bytes):
        raise MalformedEnvelope(sender, "envelope body is not bytes")
    if len(body) > max_bytes:
        raise MessageTooLarge(sender, f"envelope body of {len(body)} bytes exceeds {max_bytes}")
    if encode_sealed(Kind(kind), body, signer, sig) != data:
        raise MalformedEnvelope(sender, "envelope is not canonical CBOR")
    return obj


def peek_kind(data: bytes, *, max_bytes: int, sender: str = "") -> Kind:
    """The kind of an envelope, for dispatch (the signature is NOT checked: open it next).

    Raises:
        MessageTooLarge, MalformedEnvelope: as :func:`open_envelope`.
    """
    return Kind(_parse(data, max_bytes, sender)["kind"])


def peek_signer(data: bytes, *, max_bytes: int, sender: str = "") -> str:
    """The PeerID named as signer of an envelope (the signature is NOT checked).

    Raises:
        MessageTooLarge, MalformedEnvelope: as :func:`open_envelope`.
    """
    return peer_id_of(_parse(data, max_bytes, sender)["signer"])


def _trusted(signer: str, trust: Trust) -> bool:
    if isinstance(trust, AnySigner):
        return True
    if isinstance(trust, str):
        return signer == trust
    return signer in trust


def open_envelope(
    kind: Kind, data: bytes, trust: Trust, max_bytes: int, *, sender: str = ""
) -> Opened:
    """Verify an envelope of ``kind`` from an untrusted source.

    Args:
        kind: the kind expected here; any other is refused.
        data: the envelope bytes.
        trust: who may have signed it (see :data:`Trust`).
        max_bytes: bound on the body, bytes (the envelope may add its fixed overhead).
        sender: PeerID, URL or path the bytes came from, for errors.

    Returns:
        the signer's PeerID, the body and the signature.

    Raises:
        MessageTooLarge: over ``max_bytes`` (checked before parsing).
        MalformedEnvelope: not a canonical envelope, another version or another kind.
        BadSignature: the signature does not verify.
        UntrustedSigner: a valid signature by a PeerID that ``trust`` does not allow (its
            ``source`` is that PeerID).
    """
    obj = _parse(data, max_bytes, sender)
    if obj["kind"] != kind.value:
        raise MalformedEnvelope(sender, f"envelope of kind {obj['kind']}, expected {kind.value}")
    body: bytes = obj["body"]
    signer = peer_id_of(obj["signer"])
    try:
        verify_raw(obj["signer"], signed_message(kind, body), obj["sig"], what=kind.value)
    except IntegrityError as exc:
        raise BadSignature(f"{kind.value} signature by {signer}", sender) from exc
    if not _trusted(signer, trust):
        # source = the signer, as TrustList.require_trainer does (logs name the wrong key)
        raise UntrustedSigner(f"{kind.value} signed by {signer}, which is not trusted", signer)
    return Opened(kind, signer, body, obj["sig"])


open = open_envelope
"""The layer's verb: ``envelope.open(kind, data, trust, max_bytes)``."""
