"""The run's end: the signed RunFinished and RunContinued messages, the origin's run-end
counter and the followers' poll backoff."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from p2p import wire
from p2p.errors import IntegrityError, MalformedEnvelope, RemoteProtocolError, UntrustedSigner
from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.core.pollpolicy import PollPolicy, poll_delay
from shardcast.publish.runend import next_end_seq
from shardcast.wire.finish import RunContinued, RunFinished, decode_versions_message, end_order
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
        RunFinished.create(TRAINER, "run-1", 7, "ab" * 32, seq=3),
        RunContinued.create(TRAINER, "run-1", 7, seq=4),
        VersionAnnouncement.create(TRAINER, "run-1", 7, "ab" * 32, ("/ip4/127.0.0.1/tcp/1",)),
    ],
    ids=["run-finished", "run-finished-seq", "run-continued", "announcement"],
)
def test_trainer_signed_messages_share_one_decoder(
    msg: RunFinished | RunContinued | VersionAnnouncement,
) -> None:
    """Both trainer-signed messages round-trip through :class:`TrainerSigned` and refuse a
    body whose fields were changed after signing (the signature no longer matches)."""
    assert type(msg).decode(msg.encode(), trust=trust()) == msg
    forged = dataclasses.replace(msg, step=8)  # same signature, other body
    with pytest.raises(IntegrityError):
        type(msg).decode(forged.encode(), trust=trust())
    other = RunFinished if isinstance(msg, VersionAnnouncement) else VersionAnnouncement
    with pytest.raises(RemoteProtocolError):  # another kind of envelope
        other.decode(msg.encode(), trust=trust())


def test_a_run_continued_is_dispatched_and_ordered_after_the_end_it_lifts() -> None:
    fin = RunFinished.create(TRAINER, "run-1", 7, DIGEST, seq=1)
    cont = RunContinued.create(TRAINER, "run-1", 7, seq=2)
    assert decode_versions_message(cont.encode(), trust=trust()) == cont
    assert (
        end_order(fin)
        < end_order(cont)
        < end_order(RunFinished.create(TRAINER, "run-1", 7, DIGEST, seq=3))
    )
    assert end_order(cont) < end_order(RunFinished.create(TRAINER, "run-1", 8, DIGEST))
    # a run end signed without a counter keeps its old bytes (no "seq" key in the body)
    plain = RunFinished.create(TRAINER, "run-1", 7, DIGEST)
    assert "seq" not in wire.decode(plain._body(), max_bytes=8192)
    with pytest.raises(ValueError, match="seq"):
        RunContinued.create(TRAINER, "run-1", 7, seq=0)
    # a sealed body with seq 0 is refused (0 is never signed: it would tie with old run ends)
    zero = dataclasses.replace(cont, seq=0)
    zero = dataclasses.replace(zero, signature=zero._signature_by(TRAINER))
    with pytest.raises(RemoteProtocolError, match="seq"):
        RunContinued.decode(zero.encode(), trust=trust())


def test_node_info_carries_a_continuation() -> None:
    cont = RunContinued.create(TRAINER, "run-1", 7, seq=2).encode()
    info = NodeInfo(
        TRAINER.peer_id, "trainer", "run-1", "http://127.0.0.1:1", (7,), None, continued=cont
    )
    got = NodeInfo.decode(info.encode(), sender=TRAINER.peer_id)
    assert (got.continued, got.finished) == (cont, None)
    raw = wire.decode(info.encode(), max_bytes=8192)
    with pytest.raises(RemoteProtocolError, match="continued"):
        NodeInfo.decode(wire.encode({**raw, "continued": "text"}))


def test_the_run_end_counter_only_goes_up(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / ".run-end.json"
    assert [next_end_seq(path) for _ in range(3)] == [1, 2, 3]
    assert json.loads(path.read_text()) == {"seq": 3}
    path.write_text("{not json")  # damaged: it jumps above anything counted so far
    with caplog.at_level(logging.WARNING):
        jumped = next_end_seq(path)
    assert jumped > 10**12
    assert "run_end_seq_unreadable" in caplog.text
    assert next_end_seq(path) == jumped + 1
    path.write_text('{"seq": -4}')
    assert next_end_seq(path) > jumped
    assert [p.name for p in tmp_path.iterdir()] == [".run-end.json"]  # no temporary file left
