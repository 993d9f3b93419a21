"""Ed25519 keys and libp2p PeerIDs without libp2p (PyNaCl and base58 only).

Theory of operation
-------------------
A node's PeerID is what py-libp2p's ``ID.from_pubkey`` computes for an Ed25519 key: the
libp2p protobuf encoding of the public key (``PublicKey{Type: Ed25519 (1), Data: <32
bytes>}``, i.e. ``08 01 12 20`` followed by the key), wrapped in an *identity* multihash
(code ``0x00``, length ``0x24``: the key is inline because it is at most 42 bytes), written
in base58btc (``12D3KooW…``). So the 32-byte public key is recovered from the PeerID string
alone, and a signature by "PeerID X" is checked without any key exchange, and without
importing libp2p (which costs one to two seconds): codecs and verifiers import this module.

:class:`SigningKey` is the private half (a 32-byte seed). Raw signatures here are over the
exact bytes given; domain separation is the caller's job (:mod:`p2p.envelope` and
:func:`domain_message`).
"""

from __future__ import annotations

from typing import Protocol

import base58
import nacl.exceptions
import nacl.signing

from p2p.errors import IntegrityError

PUBLIC_KEY_BYTES = 32
SEED_BYTES = 32
SIGNATURE_BYTES = 64
_PB_PREFIX = b"\x08\x01\x12\x20"  # protobuf: field 1 (Type) = 1 (Ed25519), field 2 = 32 bytes
_MH_PREFIX = b"\x00" + bytes([len(_PB_PREFIX) + PUBLIC_KEY_BYTES])  # identity multihash, len 36
_PEER_ID_BYTES = len(_MH_PREFIX) + len(_PB_PREFIX) + PUBLIC_KEY_BYTES
MAX_PEER_ID_CHARS = 64


def peer_id_of(public_key: bytes) -> str:
    """The base58 PeerID of a raw 32-byte Ed25519 public key (as libp2p derives it).

    Raises:
        ValueError: ``public_key`` is not 32 bytes (a caller bug).
    """
    if len(public_key) != PUBLIC_KEY_BYTES:
        raise ValueError(f"Ed25519 public key of {len(public_key)} bytes")
    return base58.b58encode(_MH_PREFIX + _PB_PREFIX + public_key).decode("ascii")


def public_key_of(peer_id: str) -> bytes:
    """The raw 32-byte Ed25519 public key inlined in ``peer_id``.

    Raises:
        IntegrityError: not a base58 PeerID with an inline Ed25519 key.
    """
    if not isinstance(peer_id, str) or not 0 < len(peer_id) <= MAX_PEER_ID_CHARS:
        raise IntegrityError(f"malformed PeerID {peer_id!r}")
    try:
        raw = base58.b58decode(peer_id.encode("ascii"))
    except ValueError as exc:  # non-alphabet characters (UnicodeEncodeError is a ValueError)
        raise IntegrityError(f"malformed PeerID {peer_id!r}") from exc
    if len(raw) != _PEER_ID_BYTES or not raw.startswith(_MH_PREFIX + _PB_PREFIX):
        raise IntegrityError(f"PeerID {peer_id!r} does not embed an Ed25519 key")
    key = raw[len(_MH_PREFIX) + len(_PB_PREFIX) :]
    if peer_id_of(key) != peer_id:  # leading-zero or other non-canonical base58 spellings
        raise IntegrityError(f"PeerID {peer_id!r} is not in canonical form")
    return key


def is_valid_peer_id(peer_id: str) -> bool:
    """True if ``peer_id`` is a canonical base58 PeerID with an inline Ed25519 key."""
    try:
        public_key_of(peer_id)
    except IntegrityError:
        return False
    return True


def domain_message(domain: str, body: bytes) -> bytes:
    """``b"shardnet/" + domain + b"\\0" + body``: the bytes a domain-tagged signature covers
    (the scheme of node messages before :mod:`p2p.envelope`, still used by HTTP lane tokens
    and to read data at rest in the old formats).

    Raises:
        ValueError: empty domain or one containing NUL (a caller bug).
    """
    if not domain or "\0" in domain:
        raise ValueError(f"bad signature domain {domain!r}")
    return b"shardnet/" + domain.encode() + b"\0" + body


def verify_raw(public_key: bytes, message: bytes, signature: bytes, *, what: str = "") -> None:
    """Check an Ed25519 ``signature`` of exactly ``message`` by ``public_key``.

    Raises:
        IntegrityError: wrong lengths, an invalid key, or a signature that does not verify.
    """
    if len(signature) != SIGNATURE_BYTES or len(public_key) != PUBLIC_KEY_BYTES:
        raise IntegrityError(f"bad {what or 'message'} signature or key length")
    try:
        nacl.signing.VerifyKey(public_key).verify(message, signature)
    except (nacl.exceptions.BadSignatureError, nacl.exceptions.ValueError) as exc:
        raise IntegrityError(f"bad {what or 'message'} signature") from exc


def verify(peer_id: str, domain: str, body: bytes, signature: bytes) -> None:
    """Check ``peer_id``'s signature of ``body`` under ``domain`` (:func:`domain_message`).

    Raises:
        IntegrityError: malformed PeerID or signature, or the signature does not verify.
    """
    if len(signature) != SIGNATURE_BYTES:
        raise IntegrityError(f"signature of {len(signature)} bytes, expected {SIGNATURE_BYTES}")
    try:
        verify_raw(public_key_of(peer_id), domain_message(domain, body), signature, what=domain)
    except IntegrityError as exc:
        raise IntegrityError(f"bad {domain} signature", peer_id) from exc


class SigningKey:
    """An Ed25519 private key (PyNaCl), its raw public key and PeerID.

    Immutable; safe to share between tasks and threads.
    """

    __slots__ = ("_key", "peer_id", "public_key")

    def __init__(self, seed: bytes) -> None:
        """Build from a 32-byte seed (the libp2p/NaCl private key form).

        Raises:
            ValueError: ``seed`` is not 32 bytes.
        """
        if len(seed) != SEED_BYTES:
            raise ValueError(f"Ed25519 seed of {len(seed)} bytes, need {SEED_BYTES}")
        self._key = nacl.signing.SigningKey(seed)
        self.public_key: bytes = bytes(self._key.verify_key)
        self.peer_id: str = peer_id_of(self.public_key)

    @classmethod
    def generate(cls) -> SigningKey:
        """A fresh random key (from the OS CSPRNG)."""
        return cls(bytes(nacl.signing.SigningKey.generate()))

    def sign_raw(self, message: bytes) -> bytes:
        """The 64-byte Ed25519 signature of exactly ``message``."""
        return bytes(self._key.sign(message).signature)

    def sign(self, domain: str, body: bytes) -> bytes:
        """The signature of ``body`` under ``domain`` (:func:`domain_message`)."""
        return self.sign_raw(domain_message(domain, body))

    @property
    def key(self) -> SigningKey:
        """Itself, so that a bare key is a :class:`KeyHolder` like an ``Identity``."""
        return self

    def __repr__(self) -> str:
        return f"SigningKey(peer_id={self.peer_id!r})"


class DomainSigner(Protocol):
    """What signs with :func:`domain_message` (HTTP lane tokens): an ``Identity`` or a
    :class:`SigningKey`."""

    @property
    def peer_id(self) -> str:
        """The signer's PeerID."""
        ...

    def sign(self, domain: str, body: bytes) -> bytes:
        """The signature of ``body`` under ``domain``."""
        ...


class KeyHolder(Protocol):
    """Anything that holds a signing key: :class:`p2p.identity.Identity` or a
    :class:`SigningKey` itself (what message constructors take, without importing libp2p)."""

    @property
    def key(self) -> SigningKey:
        """The Ed25519 signing key."""
        ...


__all__ = [
    "PUBLIC_KEY_BYTES",
    "SIGNATURE_BYTES",
    "KeyHolder",
    "SigningKey",
    "domain_message",
    "is_valid_peer_id",
    "peer_id_of",
    "public_key_of",
    "verify",
    "verify_raw",
]
