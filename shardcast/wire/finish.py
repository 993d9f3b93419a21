"""wire: the end of a run: the trainer's signed "run finished" message.

Theory of operation
-------------------
When the trainer has published its last version it signs :class:`RunFinished` ("run R ended
at version N, manifest digest D") and sends it on the path version announcements take: the
run's versions gossip topic, and the ``finished`` field of every node's info record, which
downstream nodes poll. So a relay or peer learns it from gossip, or at its next info poll of
any upstream that knows it, even after the trainer has exited.

On the versions topic both message kinds arrive; :func:`decode_versions_message` tells them
apart by the kind of their :mod:`p2p.envelope` (``run-finished`` or ``version-announcement``)
and verifies either.

A follower that knows the run finished and holds its final version has nothing left to fetch:
:func:`shardcast.core.pollpolicy.poll_delay` (pure) then stretches its upstream polls and
retries from seconds to minutes, so a node left serving after the run does not retry a
departed trainer every 10 s forever. A newer version announcement (the trainer resumed with
more steps) lifts the finished state.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from p2p import envelope, wire
from p2p.envelope import Kind
from p2p.errors import RemoteProtocolError
from p2p.keys import KeyHolder
from p2p.trust import TrustList
from shardcast.wire.canonical import RUN_ID_RE
from shardcast.wire.messages import MAX_ANNOUNCEMENT_BYTES, TrainerSigned, VersionAnnouncement

__all__ = ["FINISHED_KIND", "RunFinished", "check_versions_gossip", "decode_versions_message"]

FINISHED_KIND = Kind.RUN_FINISHED


@dataclass(frozen=True)
class RunFinished(TrainerSigned):
    """The trainer's signed "this run is over" statement.

    Attributes:
        run_id: the run.
        step: the final version's step.
        manifest_digest: the final version's manifest digest.
        signer: the trainer's PeerID.
        signature: the trainer's Ed25519 signature of the body (envelope kind
            ``run-finished``).
    """

    run_id: str
    step: int
    manifest_digest: str
    signer: str
    signature: bytes

    KIND: ClassVar[Kind] = FINISHED_KIND
    NAME: ClassVar[str] = "run-finished"

    def _body(self) -> bytes:
        return wire.encode(
            {
                "v": 1,
                "run_id": self.run_id,
                "step": self.step,
                "manifest_digest": self.manifest_digest,
            }
        )

    @classmethod
    def create(
        cls, identity: KeyHolder, run_id: str, step: int, manifest_digest: str
    ) -> RunFinished:
        """Build and sign the message with the trainer's identity (or its signing key)."""
        unsigned = cls(run_id, step, manifest_digest, identity.key.peer_id, b"")
        return dataclasses.replace(unsigned, signature=unsigned._signature_by(identity))

    @classmethod
    def _from_body(
        cls, body: dict[str, Any], signer: str, signature: bytes, sender: str
    ) -> RunFinished:
        return cls(
            wire.need_str(body, "run_id", 128, sender, pattern=RUN_ID_RE),
            wire.need_int(body, "step", 0, 1 << 62, sender),
            wire.need_str(body, "manifest_digest", 64, sender),
            signer,
            signature,
        )


def decode_versions_message(
    data: bytes, *, trust: TrustList, sender: str = ""
) -> VersionAnnouncement | RunFinished:
    """Parse and verify a message of the versions topic: an announcement or a run end.

    Raises:
        RemoteProtocolError, IntegrityError, UntrustedSigner: as the two decoders do.
    """
    kind = envelope.peek_kind(data, max_bytes=MAX_ANNOUNCEMENT_BYTES, sender=sender)
    if kind is FINISHED_KIND:
        return RunFinished.decode(data, trust=trust, sender=sender)
    return VersionAnnouncement.decode(data, trust=trust, sender=sender)


def check_versions_gossip(trust: TrustList, run_id: str) -> Callable[[str, bytes], None]:
    """Gossip check of the versions topic: a well-formed announcement or run end of
    ``run_id`` signed by the pinned trainer (run before the message is delivered or forwarded).

    The returned function raises RemoteProtocolError, IntegrityError or UntrustedSigner.
    """

    def check(origin: str, data: bytes) -> None:
        msg = decode_versions_message(data, trust=trust, sender=origin)
        if msg.run_id != run_id:
            raise RemoteProtocolError(origin, f"versions message of run {msg.run_id!r}")

    return check
