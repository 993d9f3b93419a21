"""short_id shortens PeerIDs in logs and errors and keeps every other label whole."""

from __future__ import annotations

from p2p.errors import IntegrityError, short_id
from p2p.identity import Identity


def test_a_peer_id_is_shortened_to_its_last_eight_characters() -> None:
    pid = Identity.from_seed("short").peer_id
    assert short_id(pid) == "*" + pid[-8:]


def test_urls_paths_and_short_labels_are_kept_whole() -> None:
    for label in (
        "http://[fd00:77::3]:8003",
        "../peer2/peer-data/runcard.json",
        "/var/lib/shardnet/relay-data/runcard.json",
        "relay.example.org",
        "peer1",
        "",
    ):
        assert short_id(label) == label


def test_an_integrity_error_names_a_path_source_whole() -> None:
    err = IntegrityError("signature does not verify", "../peer2/peer-data/runcard.json")
    assert str(err) == (
        "integrity check failed: signature does not verify (from ../peer2/peer-data/runcard.json)"
    )
