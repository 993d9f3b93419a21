"""A finished run continued while a relay was cut off from the trainer: the real node code on
the in-memory network, in virtual time (:mod:`simulations.world`).

The continuation (:class:`~shardcast.wire.finish.RunContinued`) is gossip: sent once, it
reaches only the nodes connected at that instant. A relay that holds the run's end polls its
upstream minutes apart (``finished_poll_interval_s``), so without the trainer's resending
(:meth:`shardcast.publish.origin.Origin.resend_until`) it and its peers stay finished long
after the partition healed; with it, they take the continuation within a resend period.
"""

from __future__ import annotations

import logging
import random
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import trio
import trio.testing

from p2p.memnet import LinkProfile, MemNetwork
from simulations.scenarios import SIZES, converge
from simulations.world import NodeHandle, World, inline_threads, seeded_scheduler

RESEND_S = 5.0


def _finished(h: NodeHandle) -> bool:
    return h.node is not None and h.node.finished is not None


Then = Callable[[World, trio.Nursery, NodeHandle, NodeHandle | None], Awaitable[None]]


def _in_a_finished_run(seed: int, name: str, with_peer: bool, then: Then) -> None:
    """Run ``then(world, nursery, relay, peer)`` in virtual time once a trainer, a relay and
    (``with_peer``) a peer behind it hold version 0 and the run's end; then stop everything.
    ``name`` and ``seed`` seed the scheduler (:func:`seeded_scheduler`) and the network."""
    tmp = Path(tempfile.mkdtemp(prefix=f"sim-{name}-"))

    async def body() -> None:
        profile = LinkProfile(latency_s=0.01, jitter_s=0.0, bandwidth_bytes_per_s=20e6)
        async with MemNetwork(random.Random(seed), profile) as net, trio.open_nursery() as n:
            w = World(net, tmp, seed, SIZES)
            await w.start(n)
            assert w.trainer is not None
            assert w.trainer.node is not None
            relay = w.add_relay([w.trainer.node.p2p.multiaddrs()[0]])
            await w.run_node(relay)
            assert relay.node is not None
            peer = w.add_peer([relay.node.p2p.multiaddrs()[0]]) if with_peer else None
            if peer is not None:
                await w.run_node(peer)
            await w.publish(0, seed=1)
            assert await converge(w, 120)
            assert w.origin is not None
            await w.origin.announce_finished()
            with trio.fail_after(120):
                while not all(_finished(h) for h in (relay, peer) if h is not None):
                    await w.changed()
            await then(w, n, relay, peer)
            n.cancel_scope.cancel()

    try:
        with inline_threads(), seeded_scheduler(name):
            trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _run(resend: bool) -> list[float | None]:
    """Seconds after the partition healed when the relay and the peer took the continuation
    (None: not within 90 s)."""
    out: list[float | None] = []

    async def then(w: World, n: trio.Nursery, relay: NodeHandle, peer: NodeHandle | None) -> None:
        assert w.trainer is not None
        assert w.origin is not None
        assert peer is not None
        await trio.sleep(30)  # settled: polls are minutes apart now
        w.net.partition([w.trainer.endpoint.ip], [relay.endpoint.ip, peer.endpoint.ip])
        cont = await w.origin.announce_continued()  # sent to nobody
        assert cont is not None
        await trio.sleep(2)
        w.net.heal()
        healed = trio.current_time()
        if resend:
            n.start_soon(w.origin.resend_until, cont, RESEND_S, lambda: False)
        lifted: dict[str, float] = {}
        with trio.move_on_after(90):
            while len(lifted) < 2:
                for h in (relay, peer):
                    if not _finished(h):
                        lifted.setdefault(h.name, trio.current_time() - healed)
                await w.changed(0.5)
        out.extend(lifted.get(h.name) for h in (relay, peer))

    _in_a_finished_run(1, "continued", True, then)
    return out


@pytest.mark.parametrize("resend", [False, True], ids=["sent-once", "resent"])
def test_a_continuation_reaches_nodes_that_were_cut_off_when_it_was_sent(resend: bool) -> None:
    relay_s, peer_s = _run(resend)
    assert relay_s is not None
    assert peer_s is not None
    if not resend:  # learned at the relay's next settled poll of the trainer, tens of seconds
        assert relay_s > 4 * RESEND_S
        return
    # the first resend may still meet the connections the partition broke; the next one not
    assert relay_s <= 2 * RESEND_S + 1.0
    assert peer_s <= 2 * RESEND_S + 1.0


def test_an_upstream_that_leaves_after_the_run_end_shows_at_once() -> None:
    """The trainer exits after its run end: the relay's upstream row turns unreachable when
    the connection closes (and says the departure is expected), not at its next settled
    poll a minute or more later."""
    seen: list[dict[str, object]] = []

    async def then(w: World, n: trio.Nursery, relay: NodeHandle, peer: NodeHandle | None) -> None:
        assert w.trainer is not None
        assert relay.follower is not None
        await trio.sleep(30)  # settled: the next poll is a minute or more away
        [before] = relay.follower.upstreams_status()
        assert before["state"] == "ready"
        w.kill(w.trainer)
        await w.trainer.stopped.wait()
        await trio.sleep(1.0)
        seen.extend(relay.follower.upstreams_status())

    _in_a_finished_run(2, "upstream-gone", False, then)
    [after] = seen
    assert after["state"] == "unreachable"
    assert after["expected"] == "run_finished"
    assert after["error"]


def test_a_peer_restarted_after_a_continuation_does_not_take_its_old_run_end_for_news(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A peer that held the run's end is restarted after the trainer continued the run: it
    restores the end it recorded, but by the time it is started (its first upstream
    answered), the relay's continuation has lifted it: it is not settled (a peer with
    ``--exit-on-finish`` would otherwise exit at once)."""
    caplog.set_level(logging.INFO, logger="shardcast.node.node")
    seen: dict[str, object] = {}

    async def then(w: World, n: trio.Nursery, relay: NodeHandle, peer: NodeHandle | None) -> None:
        assert w.origin is not None
        assert peer is not None
        w.kill(peer)
        await peer.stopped.wait()
        await w.origin.announce_continued()
        with trio.fail_after(60):
            while _finished(relay):
                await w.changed()
        await w.run_node(peer)
        assert peer.node is not None
        assert peer.follower is not None
        seen["restored"] = peer.node.continued is not None
        seen["finished"] = peer.node.finished
        seen["settled"] = peer.follower.settled()

    _in_a_finished_run(3, "restored-end", True, then)
    assert seen == {"restored": True, "finished": None, "settled": False}
    # it did restore the end it had recorded (then the relay's continuation lifted it)
    assert "run_end_restored kind=run-finished step=0" in caplog.text
