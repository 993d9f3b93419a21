"""Node identity: an Ed25519 key file and the libp2p PeerID derived from it.

Theory of operation
-------------------
Every node (trainer, relay, peer) owns one Ed25519 key. Its PeerID is the libp2p identity
multihash of the public key (``12D3KooW…``), so the public key can be recovered from the PeerID
string alone: a signature by "PeerID X" is checked without any key exchange. The key file holds
the libp2p protobuf encoding of the private key (the format go-libp2p and py-libp2p use), mode
0600, created atomically on first use.

Signatures are domain-separated: ``sign(domain, body)`` signs
``b"shardnet/" + domain + b"\\0" + body``, so a signature over a manifest can never be replayed
as a signature over a rollout batch. Signed messages are sealed with :mod:`p2p.envelope` using
:attr:`Identity.key`. PeerID parsing and signature checks live in :mod:`p2p.keys` (no libp2p,
re-exported here); this module imports libp2p only because the host needs its key pair.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from libp2p.crypto.ed25519 import Ed25519PrivateKey
from libp2p.crypto.keys import KeyPair, KeyType
from libp2p.crypto.serialization import deserialize_private_key
from libp2p.peer.id import ID

from p2p.errors import ConfigError, IntegrityError, UntrustedSigner
from p2p.keys import (
    SIGNATURE_BYTES,
    SigningKey,
    is_valid_peer_id,
    public_key_of,
    verify,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Identity:
    """A node's Ed25519 key pair and PeerID.

    Attributes:
        key_pair: the libp2p key pair (given to the libp2p host).
        peer_id: the PeerID as a base58 string (``12D3KooW…``).
        key: the same private key as a libp2p-free :class:`p2p.keys.SigningKey` (what
            :func:`p2p.envelope.seal` takes).
    """

    key_pair: KeyPair
    peer_id: str
    key: SigningKey = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        priv = self.key_pair.private_key
        if not isinstance(priv, Ed25519PrivateKey):
            raise ConfigError("key", "identity key is not Ed25519")
        object.__setattr__(self, "key", SigningKey(bytes(priv.impl)))

    @classmethod
    def generate(cls) -> Identity:
        """Create a fresh random identity (not saved anywhere)."""
        return cls._from_private(Ed25519PrivateKey.new())

    @classmethod
    def from_seed(cls, seed: bytes | str) -> Identity:
        """Deterministic identity for tests and simulations.

        Args:
            seed: any bytes/str; hashed with SHA-256 into the 32-byte Ed25519 seed.
        """
        raw = seed.encode() if isinstance(seed, str) else seed
        return cls._from_private(Ed25519PrivateKey.new(hashlib.sha256(raw).digest()))

    @classmethod
    def _from_private(cls, priv: Ed25519PrivateKey) -> Identity:
        kp = KeyPair(priv, priv.get_public_key())
        return cls(key_pair=kp, peer_id=ID.from_pubkey(kp.public_key).to_base58())

    @classmethod
    def load_or_create(cls, path: Path) -> Identity:
        """Load the key at ``path``, or create it (mode 0600) if the file does not exist.

        Creation uses ``O_CREAT | O_EXCL`` on a temporary name and a rename, so two processes
        racing on the same path never end up with a half-written key.

        Raises:
            ConfigError: the file exists but is not a libp2p Ed25519 private key, or it is
                readable by group/others.
        """
        if path.exists():
            return cls.load(path)
        priv = Ed25519PrivateKey.new()
        data = priv.serialize()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)  # fails if another process created it meanwhile
        except FileExistsError:
            os.unlink(tmp)
            return cls.load(path)
        os.unlink(tmp)
        ident = cls._from_private(priv)
        log.info("identity_created path=%s peer_id=%s", path, ident.peer_id)
        return ident

    @classmethod
    def load(cls, path: Path) -> Identity:
        """Load an existing key file.

        Raises:
            ConfigError: missing, unreadable, wrong key type, or too permissive mode.
        """
        if str(path) in ("", "."):
            raise ConfigError("key", f"{str(path)!r} names no key file: give the key file's path")
        if path.is_dir():
            raise ConfigError("key", f"{path} is a directory, not a key file")
        try:
            st = path.stat()
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError("key", f"cannot read {path}: {exc.strerror or exc}") from exc
        if not data:
            raise ConfigError(
                "key", f"{path} is empty (make a key with `shardnet keygen --key {path}`)"
            )
        if st.st_mode & 0o077:
            raise ConfigError(
                "key",
                f"{path} is accessible by group/others (mode {st.st_mode & 0o777:o}); "
                "run: chmod 600 " + str(path),
            )
        try:
            priv = deserialize_private_key(data)
        except Exception as exc:  # protobuf/nacl raise assorted types on garbage
            raise ConfigError("key", f"{path} is not a libp2p private key: {exc}") from exc
        if priv.get_type() != KeyType.Ed25519 or not isinstance(priv, Ed25519PrivateKey):
            raise ConfigError("key", f"{path} holds a {priv.get_type().name} key, need Ed25519")
        return cls._from_private(priv)

    def sign(self, domain: str, body: bytes) -> bytes:
        """Sign ``body`` under ``domain``; returns the 64-byte Ed25519 signature."""
        return self.key.sign(domain, body)


__all__ = [
    "SIGNATURE_BYTES",
    "Identity",
    "IntegrityError",
    "UntrustedSigner",
    "is_valid_peer_id",
    "public_key_of",
    "verify",
]
