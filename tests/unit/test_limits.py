"""The boundary's resource manager and misbehaviour ledger (pure logic), and the library pin."""

from __future__ import annotations

import pytest

from p2p.boundary import check_library, message_problem
from p2p.errors import ConfigError
from p2p.limits import (
    LedgerConfig,
    Offence,
    PeerLedger,
    Refusal,
    ResourceLimits,
    ResourceManager,
    ScopeLimit,
    Ticket,
)


def test_per_peer_cap_leaves_room_for_others() -> None:
    rm = ResourceManager()
    rm.set_limit("info", ScopeLimit(per_peer=2, total=3))
    a1, a2 = rm.try_acquire("info", "A"), rm.try_acquire("info", "A")
    assert isinstance(a1, Ticket)
    assert isinstance(a2, Ticket)
    assert rm.try_acquire("info", "A") is Refusal.PEER_LIMIT
    b1 = rm.try_acquire("info", "B")
    assert isinstance(b1, Ticket)
    assert rm.try_acquire("info", "C") is Refusal.GLOBAL_LIMIT
    rm.release(a1)
    assert rm.open_streams("info", "A") == 1
    assert isinstance(rm.try_acquire("info", "C"), Ticket)
    stats = rm.statistics()["info"]
    assert (stats.open, stats.admitted) == (3, 4)
    assert stats.refused == {"peer_limit": 1, "global_limit": 1}


def test_release_forgets_idle_peers_and_unknown_scopes_admit() -> None:
    rm = ResourceManager()
    t = rm.try_acquire("x", "A")
    assert isinstance(t, Ticket)
    rm.release(t)
    assert rm.open_streams("x") == 0
    assert rm.open_streams("x", "A") == 0
    assert rm._open["x"] == {}


def test_bad_limits_are_config_errors() -> None:
    with pytest.raises(ConfigError):
        ScopeLimit(per_peer=5, total=4)
    with pytest.raises(ConfigError):
        ResourceLimits(request_read_timeout_s=0)
    with pytest.raises(ConfigError):
        LedgerConfig(ban_score=1)


def test_ledger_bans_repeat_offenders_and_forgives_with_time() -> None:
    ledger = PeerLedger(LedgerConfig(ban_score=-100, recovery_per_s=1.0, ban_s=60))
    assert not ledger.offend("A", Offence.MALFORMED_FRAME, now=0.0)
    assert ledger.score("A", now=0.0) == -60
    assert ledger.score("A", now=30.0) == -30
    # a second offence long after the first does not ban...
    assert not ledger.offend("A", Offence.MALFORMED_FRAME, now=60.0)
    # ...a third soon after does
    assert ledger.offend("A", Offence.MALFORMED_FRAME, now=61.0)
    assert ledger.is_banned("A", now=61.0)
    assert ledger.is_banned("A", now=120.9)
    assert not ledger.is_banned("A", now=121.0)
    assert ledger.statistics(now=61.0).banned == ("A",)
    assert ledger.statistics(now=61.0).offences == {"malformed_frame": 3}
    # many small offences add up too
    bans = [ledger.offend("B", Offence.OVER_LIMIT, now=0.0) for _ in range(100)]
    assert bans == [False] * 99 + [True]
    assert ledger.is_banned("B", now=1.0)


def test_a_never_banned_peer_is_counted_but_not_banned() -> None:
    ledger = PeerLedger(LedgerConfig(ban_score=-100, ban_s=60, never_ban=frozenset({"T"})))
    bans = [ledger.offend("T", Offence.BAD_REQUEST, now=0.0) for _ in range(20)]
    assert bans == [False] * 20
    assert ledger.score("T", now=0.0) == 0.0
    assert not ledger.is_banned("T", now=0.0)
    assert ledger.statistics(now=0.0).offences == {"bad_request": 20}
    assert ledger.statistics(now=0.0).banned == ()


def test_ledger_is_bounded() -> None:
    ledger = PeerLedger(LedgerConfig(max_peers=3))
    for p in "ABCD":
        ledger.offend(p, Offence.INVALID_GOSSIP, now=0.0)
    assert ledger.score("A", now=0.0) == 0.0  # forgotten: the least recently touched
    assert ledger.score("D", now=0.0) == -10.0


def test_installed_libp2p_is_the_guarded_one() -> None:
    check_library()


def test_message_shape_checks() -> None:
    from libp2p.peer.id import ID
    from libp2p.pubsub.pb import rpc_pb2

    from p2p.identity import Identity

    good_from = ID.from_base58(Identity.from_seed("shape").peer_id).to_bytes()

    def msg(**kw: object) -> rpc_pb2.Message:
        fields: dict[str, object] = {
            "from_id": good_from,
            "data": b"x",
            "seqno": b"\x00" * 8,
            "topicIDs": ["t"],
            "signature": b"s" * 64,
        }
        fields.update(kw)
        return rpc_pb2.Message(**fields)

    assert message_problem(msg(), 100) is None
    assert message_problem(msg(topicIDs=["a", "b"]), 100) == "2 topics"
    assert message_problem(msg(data=b"x" * 101), 100) == "data of 101 bytes"
    assert message_problem(msg(signature=b"s"), 100) == "no 64-byte signature"
    assert message_problem(msg(key=b"k" * 65), 100) == "oversized seqno or key"
    assert message_problem(msg(from_id=b"\x00\x05junk!"), 100) == "from is not an Ed25519 PeerID"
