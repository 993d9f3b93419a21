"""wire: control messages of shardcast: version announcements and node info.

Both are canonical CBOR maps (see :mod:`p2p.wire`) with a schema version field ``"v"``; an
announcement is sealed by the trainer in a :mod:`p2p.envelope` of kind
``version-announcement``.

``VersionAnnouncement`` (gossip topic :func:`versions_topic`, and inside ``NodeInfo``): the
trainer's signed statement "run R has version N with manifest digest D; submit rollouts to
these multiaddrs; it was made under run card C (version, digest)". It is small (a few
hundred bytes); the manifest itself is fetched over the HTTP lane from whichever node
announced or relays it, and checked against ``manifest_digest`` and the trainer's signature.

``NodeInfo`` (protocol ``/shardnet/info/1.0.0``): what a node tells a neighbour that asks —
its role, its HTTP lane URL, the versions it has committed, the newest announcement it
knows, and the version and digest of the run card it holds (fetched, when newer, on
``/shardnet/runcard/1.0.0``). Downstream nodes poll it (anti-entropy), so a lost gossip
message delays a version (or a card) by at most one poll interval.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from p2p import envelope, wire
from p2p.envelope import Kind
from p2p.errors import RemoteProtocolError
from p2p.fields import opt_bytes
from p2p.keys import KeyHolder, public_key_of
from p2p.trust import TrustList
from shardcast.wire.canonical import DIGEST_RE, RUN_ID_RE

INFO_PROTOCOL = "/shardnet/info/1.0.0"
RUNCARD_PROTOCOL = "/shardnet/runcard/1.0.0"
"""Request ``{"v": 1}`` (CBOR); response: the run card envelope (:mod:`shardcast.wire.runcard`),
or :data:`NO_RUNCARD` when the node has no card yet."""
NO_RUNCARD = wire.encode({"v": 1, "card": None})
"""The runcard response of a node without a card yet (an origin before its first version).
Not empty: py-libp2p 0.8.1's request/response cannot carry an empty message (the requester
saw ``request/response exchange failed while reading or writing the stream``)."""
ANNOUNCE_KIND = Kind.VERSION_ANNOUNCEMENT
MAX_ANNOUNCEMENT_BYTES = 8 * 1024
MAX_INFO_BYTES = 64 * 1024
_ROLES = ("origin", "relay", "peer", "trainer")


def versions_topic(run_id: str) -> str:
    """Gossipsub topic of version announcements for ``run_id``."""
    return f"shardnet/{run_id}/versions/1"


class TrainerSigned:
    """Base of the small messages the trainer signs (a version announcement, the run's end):
    a canonical CBOR body with ``"v": 1``, sealed in a :mod:`p2p.envelope` of the class's
    ``KIND``, at most :data:`MAX_ANNOUNCEMENT_BYTES`, accepted only from the pinned trainer.

    A subclass is a frozen dataclass with ``signer`` and ``signature`` fields; it writes its
    body (:meth:`_body`) and reads its fields back from a decoded body (:meth:`_from_body`).
    Encoding, opening the envelope, the schema version and the canonical-body check are here,
    once for every trainer-signed message.
    """

    KIND: ClassVar[Kind]
    NAME: ClassVar[str]  # in error messages: "announcement", "run-finished"
    signer: str
    signature: bytes

    def _body(self) -> bytes:
        raise NotImplementedError

    @classmethod
    def _from_body(cls, body: dict[str, Any], signer: str, signature: bytes, sender: str) -> Self:
        raise NotImplementedError

    def _signature_by(self, holder: KeyHolder) -> bytes:
        """The signature of this message's body by ``holder`` (the trainer's identity or key)."""
        return envelope.sign(self.KIND, self._body(), holder.key)

    def encode(self) -> bytes:
        """The sealed envelope bytes (:mod:`p2p.envelope`)."""
        return envelope.encode_sealed(
            self.KIND, self._body(), public_key_of(self.signer), self.signature
        )

    @classmethod
    def decode(cls, data: bytes, *, trust: TrustList, sender: str = "") -> Self:
        """Parse and verify a message from an untrusted sender.

        Raises:
            MessageTooLarge, MalformedEnvelope, FieldError (RemoteProtocolError): malformed,
                or a body that is not in canonical form.
            BadSignature (IntegrityError): bad signature.
            UntrustedSigner: signed by someone other than the pinned trainer.
        """
        opened = envelope.open(cls.KIND, data, trust.trainer, MAX_ANNOUNCEMENT_BYTES, sender=sender)
        body = wire.decode(opened.body, max_bytes=MAX_ANNOUNCEMENT_BYTES, sender=sender)
        wire.need_version(body, 1, cls.NAME, sender)
        msg = cls._from_body(body, opened.signer, opened.signature, sender)
        if msg._body() != opened.body:
            raise RemoteProtocolError(sender, f"{cls.NAME} body is not canonical")
        return msg


@dataclass(frozen=True)
class VersionAnnouncement(TrainerSigned):
    """A signed "version N is out" statement by the trainer.

    Attributes:
        run_id: the run.
        step: the policy step of the version.
        manifest_digest: BLAKE3 hex digest of the manifest's canonical bytes.
        trainer_addrs: multiaddrs where the trainer accepts rollouts.
        signer: the trainer's PeerID.
        card_version, card_digest: the run card in force for this version (0 and ``""``: none),
            so followers fetch a newer card before they use the version.
        signature: the trainer's Ed25519 signature of the body (envelope kind
            ``version-announcement``).
    """

    run_id: str
    step: int
    manifest_digest: str
    trainer_addrs: tuple[str, ...]
    signer: str
    signature: bytes
    card_version: int = 0
    card_digest: str = ""

    KIND: ClassVar[Kind] = ANNOUNCE_KIND
    NAME: ClassVar[str] = "announcement"

    def _body(self) -> bytes:
        body: dict[str, Any] = {
            "v": 1,
            "run_id": self.run_id,
            "step": self.step,
            "manifest_digest": self.manifest_digest,
            "trainer_addrs": list(self.trainer_addrs),
        }
        if self.card_version:
            body["card"] = [self.card_version, self.card_digest]
        return wire.encode(body)

    @classmethod
    def create(
        cls,
        identity: KeyHolder,
        run_id: str,
        step: int,
        manifest_digest: str,
        trainer_addrs: tuple[str, ...],
        card: tuple[int, str] = (0, ""),
    ) -> VersionAnnouncement:
        """Build and sign an announcement with the trainer's identity.

        Args:
            identity: the trainer's :class:`~p2p.identity.Identity` (or its signing key).
            card: ``(version, digest)`` of the run card in force, or ``(0, "")``.
        """
        unsigned = cls(
            run_id, step, manifest_digest, trainer_addrs, identity.key.peer_id, b"", *card
        )
        return dataclasses.replace(unsigned, signature=unsigned._signature_by(identity))

    @classmethod
    def _from_body(
        cls, body: dict[str, Any], signer: str, signature: bytes, sender: str
    ) -> VersionAnnouncement:
        run_id = wire.need_str(body, "run_id", 128, sender, pattern=RUN_ID_RE)
        digest = wire.need_str(body, "manifest_digest", 64, sender)
        addrs = wire.need_list(body, "trainer_addrs", 16, sender)
        if not all(isinstance(a, str) and len(a) < 512 for a in addrs):
            raise RemoteProtocolError(sender, "trainer_addrs must be short strings")
        card_version, card_digest = _card_ref(body.get("card"), sender)
        return cls(
            run_id,
            wire.need_int(body, "step", 0, 1 << 62, sender),
            digest,
            tuple(addrs),
            signer,
            signature,
            card_version,
            card_digest,
        )


def _card_ref(ref: Any, sender: str) -> tuple[int, str]:
    """Parse an optional ``[card_version, card_digest]`` pair; ``(0, "")`` when absent."""
    if ref is None:
        return 0, ""
    if (
        not isinstance(ref, list)
        or len(ref) != 2
        or not isinstance(ref[0], int)
        or isinstance(ref[0], bool)
        or not 1 <= ref[0] <= 1 << 62
        or not isinstance(ref[1], str)
        or not DIGEST_RE.match(ref[1])
    ):
        raise RemoteProtocolError(sender, "card must be [version >= 1, 64-hex digest]")
    return ref[0], ref[1]


@dataclass(frozen=True)
class NodeInfo:
    """A node's answer on ``/shardnet/info/1.0.0``.

    ``card_version``/``card_digest``: the run card the node holds (0 and ``""``: none).
    """

    peer_id: str
    role: str
    run_id: str
    http_url: str
    committed: tuple[int, ...]
    announcement: bytes | None
    card_version: int = 0
    card_digest: str = ""
    finished: bytes | None = None  # the trainer's signed RunFinished (shardcast.wire.finish)
    continued: bytes | None = None  # the trainer's signed RunContinued (shardcast.wire.finish)

    def encode(self) -> bytes:
        """Canonical CBOR bytes."""
        obj: dict[str, Any] = {
            "v": 1,
            "peer_id": self.peer_id,
            "role": self.role,
            "run_id": self.run_id,
            "http_url": self.http_url,
            "committed": list(self.committed),
        }
        if self.announcement is not None:
            obj["announcement"] = self.announcement
        if self.card_version:
            obj["card"] = [self.card_version, self.card_digest]
        if self.finished is not None:
            obj["finished"] = self.finished
        if self.continued is not None:
            obj["continued"] = self.continued
        return wire.encode(obj)

    @classmethod
    def decode(cls, data: bytes, sender: str = "") -> NodeInfo:
        """Parse an info response (the announcement inside is verified separately).

        Raises:
            RemoteProtocolError: malformed, or ``peer_id`` differs from the sender.
        """
        obj = wire.decode(data, max_bytes=MAX_INFO_BYTES, sender=sender)
        wire.need_version(obj, 1, "node info", sender)
        peer_id = wire.need_str(obj, "peer_id", 128, sender)
        if sender and peer_id != sender:
            raise RemoteProtocolError(sender, f"info claims to be {peer_id}")
        role = wire.need_str(obj, "role", 16, sender)
        if role not in _ROLES:
            raise RemoteProtocolError(sender, f"unknown role {role!r}")
        url = wire.need_str(obj, "http_url", 256, sender)
        if not url.startswith("http://"):
            raise RemoteProtocolError(sender, f"http_url {url!r} is not http://")
        committed = wire.need_list(obj, "committed", 1024, sender)
        if not all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in committed):
            raise RemoteProtocolError(sender, "committed must be non-negative integers")
        return cls(
            peer_id,
            role,
            wire.need_str(obj, "run_id", 128, sender),
            url,
            tuple(committed),
            opt_bytes(obj, "announcement", MAX_ANNOUNCEMENT_BYTES, sender),
            *_card_ref(obj.get("card"), sender),
            opt_bytes(obj, "finished", MAX_ANNOUNCEMENT_BYTES, sender),
            opt_bytes(obj, "continued", MAX_ANNOUNCEMENT_BYTES, sender),
        )
