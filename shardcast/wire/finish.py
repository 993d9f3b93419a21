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

A trainer restarted on a finished run with more steps to go cannot wait for that: its next
version needs rollouts, and peers that hold the run end generate none and say no hello. So it
first signs :class:`RunContinued` ("run R goes on from version N"), sent the same two ways
(gossip, and the ``continued`` field of info records), which lifts the run end at followers at
once. Which of the two is in force is decided by the newer one, ordered by
:func:`end_order` (step, then the trainer's ``seq``: a counter the origin keeps in its data
directory, one higher for every run end or continuation it signs), so an old run end replayed
after a continuation is refused, and so is an old continuation replayed after the run ended
again at the same step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from p2p import envelope, wire
from p2p.envelope import Kind
from p2p.errors import RemoteProtocolError
from p2p.fields import opt_int
from p2p.keys import KeyHolder
from p2p.trust import TrustList
from shardcast.wire.canonical import RUN_ID_RE
from shardcast.wire.messages import MAX_ANNOUNCEMENT_BYTES, TrainerSigned, VersionAnnouncement

__all__ = [
    "CONTINUED_KIND",
    "FINISHED_KIND",
    "RunContinued",
    "RunFinished",
    "check_versions_gossip",
    "decode_versions_message",
    "end_order",
]

FINISHED_KIND = Kind.RUN_FINISHED
CONTINUED_KIND = Kind.RUN_CONTINUED
MAX_SEQ = 1 << 62


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
        seq: the origin's run-end counter when it signed this (0: signed by an origin that
            kept none; see :func:`end_order`).
    """

    run_id: str
    step: int
    manifest_digest: str
    signer: str
    signature: bytes
    seq: int = 0

    KIND: ClassVar[Kind] = FINISHED_KIND
    NAME: ClassVar[str] = "run-finished"

    def _body(self) -> bytes:
        body: dict[str, Any] = {
            "v": 1,
            "run_id": self.run_id,
            "step": self.step,
            "manifest_digest": self.manifest_digest,
        }
        if self.seq:
            body["seq"] = self.seq
        return wire.encode(body)

    @classmethod
    def create(
        cls, identity: KeyHolder, run_id: str, step: int, manifest_digest: str, seq: int = 0
    ) -> RunFinished:
        """Build and sign the message with the trainer's identity (or its signing key)."""
        unsigned = cls(run_id, step, manifest_digest, identity.key.peer_id, b"", seq)
        return dataclasses.replace(unsigned, signature=unsigned._signature_by(identity))

    @classmethod
    def _from_body(
        cls, body: dict[str, Any], signer: str, signature: bytes, sender: str
    ) -> RunFinished:
        seq = opt_int(body, "seq", 1, MAX_SEQ, 0, sender)  # absent: signed without a counter
        return cls(
            wire.need_str(body, "run_id", 128, sender, pattern=RUN_ID_RE),
            wire.need_int(body, "step", 0, 1 << 62, sender),
            wire.need_str(body, "manifest_digest", 64, sender),
            signer,
            signature,
            seq,
        )


@dataclass(frozen=True)
class RunContinued(TrainerSigned):
    """The trainer's signed "this run goes on after version ``step``", which lifts an earlier
    :class:`RunFinished` of that step (the trainer was restarted with more steps to go).

    Attributes:
        run_id: the run.
        step: the version the run continues from (the run end's step).
        seq: the origin's run-end counter when it signed this (>= 1; see :func:`end_order`).
        signer: the trainer's PeerID.
        signature: the trainer's Ed25519 signature of the body (envelope kind
            ``run-continued``).
    """

    run_id: str
    step: int
    seq: int
    signer: str
    signature: bytes

    KIND: ClassVar[Kind] = CONTINUED_KIND
    NAME: ClassVar[str] = "run-continued"

    def _body(self) -> bytes:
        return wire.encode({"v": 1, "run_id": self.run_id, "step": self.step, "seq": self.seq})

    @classmethod
    def create(cls, identity: KeyHolder, run_id: str, step: int, seq: int) -> RunContinued:
        """Build and sign the message with the trainer's identity (or its signing key).

        Raises:
            ValueError: ``seq`` is not in [1, 2**62].
        """
        if not 1 <= seq <= MAX_SEQ:
            raise ValueError(f"seq must be in [1, 2**62], not {seq}")
        unsigned = cls(run_id, step, seq, identity.key.peer_id, b"")
        return dataclasses.replace(unsigned, signature=unsigned._signature_by(identity))

    @classmethod
    def _from_body(
        cls, body: dict[str, Any], signer: str, signature: bytes, sender: str
    ) -> RunContinued:
        return cls(
            wire.need_str(body, "run_id", 128, sender, pattern=RUN_ID_RE),
            wire.need_int(body, "step", 0, 1 << 62, sender),
            wire.need_int(body, "seq", 1, MAX_SEQ, sender),
            signer,
            signature,
        )


def end_order(msg: RunFinished | RunContinued) -> tuple[int, int]:
    """The order of run ends and continuations: by step, then by the origin's ``seq``. Of
    the two kinds, the message with the greater key is in force."""
    return (msg.step, msg.seq)


def decode_versions_message(
    data: bytes, *, trust: TrustList, sender: str = ""
) -> VersionAnnouncement | RunFinished | RunContinued:
    """Parse and verify a message of the versions topic: an announcement, a run end or a
    run continuation.

    Raises:
        RemoteProtocolError, IntegrityError, UntrustedSigner: as the two decoders do.
    """
    kind = envelope.peek_kind(data, max_bytes=MAX_ANNOUNCEMENT_BYTES, sender=sender)
    if kind is FINISHED_KIND:
        return RunFinished.decode(data, trust=trust, sender=sender)
    if kind is CONTINUED_KIND:
        return RunContinued.decode(data, trust=trust, sender=sender)
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
