"""The version's signer (the origin) as a download source: it holds every shard whose part
is known, so the session asks it without a have-poll (``shardcast.core.session``)."""

from __future__ import annotations

import random

from shardcast.core import Fetch, Offer, PollHave, Session, SessionConfig
from shardcast.core.select import SchedulerConfig

SCHED = SchedulerConfig(explore=0.0)


def _session(signer: str | None) -> Session:
    """Two parts of two shards each; no part known yet."""
    return Session(1, [8] * 4, 2, [], [], [], random.Random(1), SessionConfig(SCHED), 0.0, signer)


def _fetched(s: Session) -> list[tuple[str, int]]:
    return sorted((a.source, a.shard) for a in s.poll(0.0) if isinstance(a, Fetch))


def test_the_signer_is_asked_for_the_shards_of_each_known_part_without_a_have_poll() -> None:
    s = _session("origin")
    assert s.add_source("origin", False, 0.0) == []  # no PollHave
    assert _fetched(s) == []  # no part known: nothing to ask for
    s.part_arrived(1, [Offer(2, 8), Offer(3, 8)], 0.0)
    assert _fetched(s) == [("origin", 2), ("origin", 3)]


def test_another_partial_source_waits_for_its_have_set() -> None:
    s = _session("origin")
    assert s.add_source("relay", False, 0.0) == [PollHave("relay")]
    s.part_arrived(0, [Offer(0, 8), Offer(1, 8)], 0.0)
    assert _fetched(s) == []  # the relay said nothing about holding them
    s.have_changed("relay", [1], 0.0)
    assert _fetched(s) == [("relay", 1)]


def test_without_a_signer_every_partial_source_is_polled() -> None:
    s = _session(None)
    assert s.add_source("origin", False, 0.0) == [PollHave("origin")]
