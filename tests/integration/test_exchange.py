"""Rollout exchange over real libp2p hosts on 127.0.0.1: exactly-once ingestion, retries,
rate limits, refusals, bad signatures."""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from p2p import wire
from p2p.errors import TransportError
from p2p.host import HostConfig, P2PNode
from p2p.identity import Identity
from rollout.exchange import ANNOUNCE_PROTOCOL, FETCH_PROTOCOL, Ack, RolloutSender, SenderConfig
from rollout.inbox import AnnounceRoute, InboxConfig, RolloutInbox
from rollout.model import build_tokenizer
from rollout.reasons import AckReason, AckStatus
from rollout.reputation import Reputation, ReputationConfig
from rollout.schema import (
    MAX_BATCH_BYTES,
    Group,
    RolloutAnnouncement,
    RolloutBatch,
    Sample,
    check_announcement_gossip,
    rollouts_topic,
)
from rollout.task import DEFAULT_TASK
from rollout.verify import Validator, ValidatorConfig
from trainer.oracle import TrainerOracle

RUN = "xchg"
DIGEST = "ab" * 32
N_PROMPTS, GROUP, CAP = 2, 2, 4
TRAINER = Identity.from_seed("xchg-trainer")
PEER = Identity.from_seed("xchg-peer")


@dataclass
class World:
    trainer: P2PNode
    peer: P2PNode
    inbox: RolloutInbox
    sender: RolloutSender
    oracle: TrainerOracle
    step: list[int]


def make_batch(
    oracle: TrainerOracle, submitter: str, step: int, reward_bias: float = 0.0
) -> RolloutBatch:
    rng = random.Random(step)
    groups = []
    for i, prompt in enumerate(oracle.prompt_ids(submitter, step, N_PROMPTS)):
        samples = []
        for _ in range(GROUP):
            ids = tuple(rng.randrange(4, 100) for _ in range(CAP))
            samples.append(
                Sample(ids, (-1.0,) * CAP, oracle.reward(ids) + reward_bias, "length", b"")
            )
        groups.append(Group(i, tuple(prompt), tuple(samples)))
    return RolloutBatch(
        RUN, submitter, step, DIGEST, DEFAULT_TASK.name, N_PROMPTS, 1, 1.0, CAP, tuple(groups)
    )


@asynccontextmanager
async def world(
    tmp: Path, inbox_cfg: InboxConfig | None = None, rep: ReputationConfig | None = None
) -> AsyncIterator[World]:
    oracle = TrainerOracle(build_tokenizer(), DEFAULT_TASK, keep=8)
    for s in range(4):
        oracle.add_version(s, DIGEST, tmp, preload=False)
    vcfg = ValidatorConfig(
        run_id=RUN,
        task=DEFAULT_TASK.name,
        n_prompts=N_PROMPTS,
        group_size=GROUP,
        max_new_tokens=CAP,
        temperature=1.0,
        check_model=False,
    )
    step = [0]
    async with (
        P2PNode.open(TRAINER, HostConfig()) as t,
        P2PNode.open(PEER, HostConfig()) as p,
        trio.open_nursery() as nursery,
    ):
        inbox = RolloutInbox(
            t,
            RUN,
            Validator(vcfg, oracle),
            Reputation(rep),
            current_step=lambda: step[0],
            config=inbox_cfg,
        )
        await nursery.start(inbox.run)
        await p.connect(t.multiaddrs()[0])
        await p.subscribe(rollouts_topic(RUN), check_announcement_gossip(RUN))
        await p.wait_for_subscriber(TRAINER.peer_id, rollouts_topic(RUN), timeout_s=10)
        sender = RolloutSender(
            p,
            PEER,
            RUN,
            TRAINER.peer_id,
            SenderConfig(backoff_initial_s=0.05, backoff_max_s=0.2),
            random.Random(0),
        )
        yield World(t, p, inbox, sender, oracle, step)
        nursery.cancel_scope.cancel()


async def test_batch_is_ingested_exactly_once_across_routes(tmp_path: Path) -> None:
    async with world(tmp_path) as w, trio.open_nursery() as n:
        payload = make_batch(w.oracle, PEER.peer_id, 0).encode()
        ann = await w.sender.submit(payload, 0, n)  # gossip + direct announce
        with trio.fail_after(20):
            await w.sender.wait_idle()
        assert [a.status for a in w.sender.acks] == ["accepted"]
        assert w.sender.statistics().fetches_served == 1  # payload fetched once
        # a replay of the same announcement (any route) returns the stored ack, no fetch
        again = await w.inbox.ingest(ann.encode(), PEER.peer_id, route=AnnounceRoute.DIRECT)
        assert again == w.sender.acks[0]
        assert w.sender.statistics().fetches_served == 1
        batches = await w.inbox.take(min_batches=1, step=0, timeout_s=5)
        assert len(batches) == 1
        assert batches[0].announcement.batch_id == ann.batch_id
        assert w.inbox.statistics().duplicates >= 1


async def test_busy_trainer_makes_the_peer_retry(tmp_path: Path) -> None:
    async with world(tmp_path, InboxConfig(max_buffer_batches=1)) as w, trio.open_nursery() as n:
        w.step[0] = 1
        await w.sender.submit(make_batch(w.oracle, PEER.peer_id, 0).encode(), 0, n)
        with trio.fail_after(20):
            await w.inbox.wait_answers("accepted:ok", 1)
        await w.sender.submit(make_batch(w.oracle, PEER.peer_id, 1).encode(), 1, n)
        with trio.fail_after(20):
            await w.inbox.wait_answers("retry:busy", 1)  # the buffer (1 batch) is full
        first = await w.inbox.take(min_batches=1, step=1, timeout_s=20)
        second = await w.inbox.take(min_batches=1, step=1, timeout_s=20)
        with trio.fail_after(20):
            await w.sender.wait_idle()
        assert {b.batch.policy_step for b in first + second} == {0, 1}
        assert [a.status for a in w.sender.acks] == ["accepted", "accepted"]
        # the "busy" answer (to whichever route came first) did not lose the batch
        assert w.inbox.statistics().answers["retry:busy"] >= 1


async def test_stale_and_forged_batches_rejected(tmp_path: Path) -> None:
    async with world(tmp_path) as w, trio.open_nursery() as n:
        w.step[0] = 4  # lag 4 > async_level 2 + late_grace_steps 1
        await w.sender.submit(make_batch(w.oracle, PEER.peer_id, 0).encode(), 0, n)
        await w.sender.submit(make_batch(w.oracle, PEER.peer_id, 2, reward_bias=0.5).encode(), 2, n)
        with trio.fail_after(20):
            await w.sender.wait_idle()
        assert sorted((a.status, a.reason) for a in w.sender.acks) == [
            ("rejected", "reward"),
            ("rejected", "stale_step"),
        ]
        # the stale one was refused without fetching its payload
        assert w.sender.statistics().fetches_served == 1
        assert w.inbox.reputation.score(PEER.peer_id) < 1.0
        # the verified-and-rejected batch (policy step 2) counts as this peer's answer for the
        # steps whose window holds it (readiness); the unfetched stale one does not
        assert w.inbox.rejected_within(4) == frozenset({PEER.peer_id})
        assert w.inbox.rejected_within(5) == frozenset()
        assert w.inbox.usable(4) == (0, frozenset())


async def test_batch_for_a_version_not_yet_current_is_retried_then_accepted(
    tmp_path: Path,
) -> None:
    # the peer can hold version 1 before the trainer has registered it (it announces first)
    async with world(tmp_path) as w, trio.open_nursery() as n:
        await w.sender.submit(make_batch(w.oracle, PEER.peer_id, 1).encode(), 1, n)
        with trio.fail_after(20):
            await w.inbox.wait_answers("retry:ahead", 1)
        w.step[0] = 1
        with trio.fail_after(20):
            await w.sender.wait_idle()
        assert [(a.status, a.reason) for a in w.sender.acks] == [("accepted", "ok")]
        assert w.inbox.usable(1) == (1, frozenset({PEER.peer_id}))


async def test_refused_submitter_is_ignored_without_fetch(tmp_path: Path) -> None:
    async with world(tmp_path) as w, trio.open_nursery() as n:
        for _ in range(3):
            w.inbox.reputation.record(PEER.peer_id, False, "toploc")
        await w.sender.submit(make_batch(w.oracle, PEER.peer_id, 0).encode(), 0, n)
        with trio.fail_after(20):
            await w.sender.wait_idle()
        assert [(a.status, a.reason) for a in w.sender.acks] == [("ignored", "refused")]
        assert w.sender.statistics().fetches_served == 0
        assert w.inbox.reputation.statistics().refused_announcements >= 1


async def test_flooding_peer_is_rate_limited(tmp_path: Path) -> None:
    rep = ReputationConfig(rate_per_s=0.001, burst=3)
    async with world(tmp_path, rep=rep) as w:
        acks = []
        for i in range(10):  # announcements of payloads the trainer cannot even fetch
            ann = RolloutAnnouncement.for_payload(PEER, RUN, 0, b"junk%d" % i)
            acks.append(
                await w.inbox.ingest(ann.encode(), PEER.peer_id, route=AnnounceRoute.DIRECT)
            )
        reasons = [a.reason for a in acks if a is not None]
        assert reasons.count("rate_limited") == 7
        assert w.inbox.reputation.statistics().rate_limited == 7


async def test_bad_signature_is_dropped(tmp_path: Path) -> None:
    async with world(tmp_path) as w:
        ann = RolloutAnnouncement.for_payload(PEER, RUN, 0, b"payload")
        forged = RolloutAnnouncement(
            ann.run_id, ann.batch_id, ann.digest, ann.size, ann.step, ann.submitter, bytes(64)
        )
        assert (
            await w.inbox.ingest(forged.encode(), PEER.peer_id, route=AnnounceRoute.GOSSIP) is None
        )
        from p2p.errors import StreamBroken

        with pytest.raises(StreamBroken):  # the direct route answers by resetting the stream
            await w.peer.request(
                TRAINER.peer_id,
                ANNOUNCE_PROTOCOL,
                forged.encode(),
                max_response_bytes=4096,
                timeout_s=10,
            )
        assert w.inbox.statistics().acks == {}
        assert isinstance(Ack("x", AckStatus.RETRY, AckReason.BUSY), Ack)


async def test_decisions_are_per_submitter(tmp_path: Path) -> None:
    """A sybil announcing an honest peer's payload (seen on gossip) names another batch: its
    stale announcement is rejected without touching the honest batch, which is accepted once;
    the honest peer's replay is a duplicate answered from memory."""
    sybil = Identity.from_seed("xchg-sybil")
    async with world(tmp_path) as w, trio.open_nursery() as n:
        w.step[0] = 4
        payload = make_batch(w.oracle, PEER.peer_id, 3).encode()
        copy = RolloutAnnouncement.for_payload(sybil, RUN, 0, payload)  # lag 4: too old
        honest = RolloutAnnouncement.for_payload(PEER, RUN, 3, payload)
        assert copy.digest == honest.digest
        assert copy.batch_id != honest.batch_id
        ack = await w.inbox.ingest(copy.encode(), sybil.peer_id, route=AnnounceRoute.GOSSIP)
        assert ack is not None
        assert (ack.status, ack.reason) == ("rejected", "stale_step")
        assert w.inbox.reputation.score(sybil.peer_id) == 1.0  # late is no fault
        await w.sender.submit(payload, 3, n)
        with trio.fail_after(20):
            await w.sender.wait_idle()
        assert [(a.status, a.reason) for a in w.sender.acks] == [("accepted", "ok")]
        before = w.inbox.statistics().duplicates
        replay = await w.inbox.ingest(honest.encode(), PEER.peer_id, route=AnnounceRoute.DIRECT)
        assert replay is not None
        assert (replay.status, replay.batch_id) == ("accepted", honest.batch_id)
        stats = w.inbox.statistics()
        assert stats.duplicates == before + 1
        assert stats.by_submitter[PEER.peer_id].accepted == 1
        assert stats.by_submitter[sybil.peer_id].accepted == 0
        assert len(await w.inbox.take(min_batches=1, step=4, timeout_s=1)) == 1
        assert w.inbox.statistics().by_submitter[PEER.peer_id].trained == 1


async def test_batch_in_the_grace_window_is_admitted_and_trained(tmp_path: Path) -> None:
    async with world(tmp_path) as w, trio.open_nursery() as n:
        w.step[0] = 3  # lag 3 = async_level 2 + late_grace_steps 1
        await w.sender.submit(make_batch(w.oracle, PEER.peer_id, 0).encode(), 0, n)
        with trio.fail_after(20):
            await w.sender.wait_idle()
        assert [(a.status, a.reason) for a in w.sender.acks] == [("accepted", "ok")]
        assert len(await w.inbox.take(min_batches=1, step=3, timeout_s=1)) == 1
        (acc,) = w.inbox.statistics().by_submitter.values()
        assert (acc.accepted, acc.late, acc.trained) == (1, 1, 1)


async def test_second_route_is_redelivery_not_duplicate(tmp_path: Path) -> None:
    """An honest peer announces by gossip and directly: the second copy is ``redelivered``;
    only a repeat on a route that already brought the batch is a ``duplicate``."""
    async with world(tmp_path) as w:
        w.step[0] = 4
        payload = make_batch(w.oracle, PEER.peer_id, 0).encode()
        ann = RolloutAnnouncement.for_payload(PEER, RUN, 0, payload)  # too old: decided unfetched
        acks = [
            await w.inbox.ingest(ann.encode(), PEER.peer_id, route=route)
            for route in (
                AnnounceRoute.GOSSIP,
                AnnounceRoute.DIRECT,
                AnnounceRoute.DIRECT,
                AnnounceRoute.GOSSIP,
            )
        ]
        assert [(a.status, a.reason) for a in acks if a is not None] == [
            ("rejected", "stale_step")
        ] * 4
        stats = w.inbox.statistics()
        assert (stats.redelivered, stats.duplicates) == (1, 2)
        assert stats.by_submitter[PEER.peer_id].decided == 1  # still decided exactly once


async def test_a_delivered_batch_asked_for_again_is_not_held_and_no_offence(
    tmp_path: Path,
) -> None:
    """A restarted trainer hears an old announcement again (gossip) and asks for a batch its
    previous process acknowledged: the peer no longer holds it and says so without charging
    the trainer. An id this process never sent is not charged either: it can be a batch the
    peer announced before it restarted, or one announced by another node with this peer's key
    (a helper's trial: ten such asks made the peer ban its own trainer and leave the run)."""
    async with world(tmp_path) as w, trio.open_nursery() as n:
        ann = await w.sender.submit(make_batch(w.oracle, PEER.peer_id, 0).encode(), 0, n)
        with trio.fail_after(20):
            await w.sender.wait_idle()

        async def fetch(batch_id: str) -> None:
            await w.trainer.request(
                PEER.peer_id,
                FETCH_PROTOCOL,
                wire.encode({"v": 1, "batch_id": batch_id}),
                max_response_bytes=MAX_BATCH_BYTES,
                timeout_s=10,
            )

        with pytest.raises(TransportError):
            await fetch(ann.batch_id)
        assert w.peer.boundary_statistics().peers.offences.get("bad_request", 0) == 0
        for _ in range(12):  # more than the ban score's worth of bad requests
            with pytest.raises(TransportError):
                await fetch("00" * 16)
        stats = w.peer.boundary_statistics().peers
        assert stats.offences.get("bad_request", 0) == 0
        assert stats.banned == ()
