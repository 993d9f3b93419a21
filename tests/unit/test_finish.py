"""The run's end: the signed RunFinished message and the followers' poll backoff."""

from __future__ import annotations

import dataclasses

import pytest

from p2p import wire
from p2p.errors import IntegrityError, MalformedEnvelope, RemoteProtocolError, UntrustedSigner
from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.core.pollpolicy import PollPolicy, poll_delay
from shardcast.wire.finish import RunFinished, decode_versions_message
from shardcast.wire.messages import NodeInfo, VersionAnnouncement
from tests.helpers import TRAINER, trust

DIGEST = "ab" * 32


def test_roundtrip_and_dispatch() -> None:
    msg = RunFinished.create(TRAINER, "run-1", 7, DIGEST)
    data = msg.encode()
    assert RunFinished.decode(data, trust=trust()) == msg
    assert decode_versions_message(data, trust=trust()) == msg
    ann = VersionAnnouncement.create(TRAINER, "run-1", 7, DIGEST, ())
    assert decode_versions_message(ann.encode(), trust=trust()) == ann


def test_other_signer_and_tampering_are_refused() -> None:
    other = Identity.from_seed("not-the-trainer")
    with pytest.raises(UntrustedSigner):
        RunFinished.decode(RunFinished.create(other, "run-1", 7, DIGEST).encode(), trust=trust())
    env = wire.decode(RunFinished.create(TRAINER, "run-1", 7, DIGEST).encode(), max_bytes=8192)
    body = wire.decode(env["body"], max_bytes=8192)
    env["body"] = wire.encode({**body, "step": 8})
    with pytest.raises(IntegrityError):
        RunFinished.decode(wire.encode(env), trust=trust())
    # an announcement is not a run end: the envelope's kind says so
    ann = VersionAnnouncement.create(TRAINER, "run-1", 7, DIGEST, ())
    with pytest.raises(MalformedEnvelope, match="kind"):
        RunFinished.decode(ann.encode(), trust=trust())
    with pytest.raises(RemoteProtocolError):
        decode_versions_message(b"\xff garbage", trust=TrustList(trainer=TRAINER.peer_id))


def test_node_info_carries_it() -> None:
    fin = RunFinished.create(TRAINER, "run-1", 7, DIGEST).encode()
    info = NodeInfo(
        TRAINER.peer_id, "trainer", "run-1", "http://127.0.0.1:1", (7,), None, finished=fin
    )
    assert NodeInfo.decode(info.encode(), sender=TRAINER.peer_id).finished == fin
    old = NodeInfo(TRAINER.peer_id, "relay", "run-1", "http://127.0.0.1:1", (), None)
    assert NodeInfo.decode(old.encode()).finished is None


def test_poll_delay_live_and_settled() -> None:
    p = PollPolicy(poll_interval_s=1.0, max_backoff_s=10.0)
    assert [poll_delay(p, n, False) for n in range(6)] == [1.0, 1.0, 2.0, 4.0, 8.0, 10.0]
    assert poll_delay(p, 1000, False) == 10.0
    assert poll_delay(p, 0, True) == 60.0
    assert [poll_delay(p, n, True) for n in (1, 2, 4, 5, 50)] == [60, 120, 480, 600, 600]


@pytest.mark.parametrize(
    "msg",
    [
        RunFinished.create(TRAINER, "run-1", 7, "ab" * 32),
        VersionAnnouncement.create(TRAINER, "run-1", 7, "ab" * 32, ("/ip4/127.0.0.1/tcp/1",)),
    ],
    ids=["run-finished", "announcement"],
)
def test_trainer_signed_messages_share_one_decoder(msg: RunFinished | VersionAnnouncement) -> None:
    """Both trainer-signed messages round-trip through :class:`TrainerSigned` and refuse a
    body whose fields were changed after signing (the signature no longer matches)."""
    assert type(msg).decode(msg.encode(), trust=trust()) == msg
    forged = dataclasses.replace(msg, step=8)  # same signature, other body
    with pytest.raises(IntegrityError):
        type(msg).decode(forged.encode(), trust=trust())
    other = RunFinished if isinstance(msg, VersionAnnouncement) else VersionAnnouncement
    with pytest.raises(RemoteProtocolError):  # another kind of envelope
        other.decode(msg.encode(), trust=trust())
