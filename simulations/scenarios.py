"""Many-node scenarios of the real node code in virtual time, their invariants and a runner.

Each scenario builds a :class:`~simulations.world.World` (a trainer with origin and rollout
intake, relays following the trainer, peers following two relays each) on a seeded
:class:`~p2p.memnet.MemNetwork`, runs a fault script, waits for convergence and checks:

``converged``
    every live honest relay and peer holds the newest published version with its digest;
``no_honest_banned``
    no honest node (trainer, honest relay or peer) was ever banned by an honest downloader;
``rollouts_once``
    every batch an honest peer submitted was trained on exactly once, or rejected with a
    stated honest reason (stale, or its submitter crashed before delivering it); no batch was
    trained twice and no sybil's batch was trained;
``memory_bounded``
    every per-node structure that grows with traffic stays under its bound (gossip seen-cache
    and subscription queues, the inbox buffer, versions on disk).

Run from the command line (virtual time under ``MockClock(autojump_threshold=0)``)::

    python -m simulations.scenarios                     # every scenario once, seed 1
    python -m simulations.scenarios --sweep 20 --seed 7 # 20 seeded runs per scenario
    python -m simulations.scenarios --only sybils --relays 2 --peers 4

and it prints one row per run: nodes, faults, virtual seconds from the last publication to
convergence, real seconds, and the invariants held.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import random
import shutil
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio
import trio.testing

from p2p.memnet import LinkProfile, MemNetwork
from rollout.exchange import Ack
from rollout.reasons import RejectReason
from simulations.world import TRAINER, NodeHandle, World, inline_threads, seeded_scheduler

__all__ = ["SCENARIOS", "Scenario", "ScenarioResult", "main", "run_scenario"]

INVARIANTS = ("converged", "no_honest_banned", "rollouts_once", "memory_bounded")
# stale: outside the async window; unknown_weights: the trainer replaced the version the
# batch was generated on (a republished step), which the peer could not know
HONEST_REJECTIONS = frozenset(
    {("rejected", RejectReason.STALE_STEP), ("rejected", RejectReason.UNKNOWN_WEIGHTS)}
)
SIZES = (96 * 1024, 64 * 1024, 20_001)


@dataclass
class Ctx:
    """What a fault script may use besides the world."""

    world: World
    rng: random.Random
    byzantine: set[str] = field(default_factory=set)
    faults: list[str] = field(default_factory=list)


Script = Callable[[Ctx], Awaitable[None]]


@dataclass(frozen=True)
class Scenario:
    """A named fault script and the size of the world it runs in."""

    name: str
    relays: int
    peers: int
    script: Script
    sybils_per_peer: int = 0


@dataclass(frozen=True)
class ScenarioResult:
    """One run: size, faults, virtual time to converge, invariants held."""

    name: str
    seed: int
    nodes: int
    faults: str
    converge_s: float | None
    real_s: float
    invariants: dict[str, bool]
    notes: tuple[str, ...] = ()

    @property
    def ok(self) -> bool:
        return all(self.invariants.values())


# -- fault scripts -------------------------------------------------------------------------------


async def baseline(c: Ctx) -> None:
    """Two versions, no faults."""
    w = c.world
    await w.publish(0, seed=c.rng.randrange(1 << 30))
    await converge(w, 300)
    await w.publish(1, seed=c.rng.randrange(1 << 30))


async def relay_dies(c: Ctx) -> None:
    """A relay crashes while the version is being broadcast (its peers have a second one)."""
    w = c.world
    await w.publish(0, seed=c.rng.randrange(1 << 30))
    await converge(w, 300)
    await w.publish(1, seed=c.rng.randrange(1 << 30))
    await trio.sleep(c.rng.uniform(0.02, 0.2))  # the relays are mid-download
    victim = c.rng.choice(w.relays)
    w.kill(victim)
    c.faults.append(f"kill {victim.name}@{trio.current_time():.2f}s")


async def corrupt_relays(c: Ctx) -> None:
    """20 % of the relays flip a byte in every body over 1 KiB they serve."""
    w = c.world
    k = max(1, len(w.relays) // 5)
    bad = c.rng.sample(w.relays, k)
    for r in bad:
        c.byzantine.add(r.peer_id)
        w.net.tamper(r.endpoint.ip, _flip)
    c.faults.append(f"{k} corrupt relays")
    await w.publish(0, seed=c.rng.randrange(1 << 30))
    await converge(w, 300)
    await w.publish(1, seed=c.rng.randrange(1 << 30))


def _flip(path: str, body: bytes) -> bytes:
    if len(body) < 1024:
        return body
    i = len(body) // 2
    return body[:i] + bytes([body[i] ^ 0xFF]) + body[i + 1 :]


async def partition_heals(c: Ctx) -> None:
    """Half the relays and their peers are cut off from the trainer while a version goes out;
    the partition heals 30 virtual seconds later."""
    w = c.world
    await w.publish(0, seed=c.rng.randrange(1 << 30))
    await converge(w, 300)
    assert w.trainer is not None
    cut = {r.endpoint.ip for r in w.relays[: len(w.relays) // 2]}
    side_a = [w.trainer.endpoint.ip] + [
        n.endpoint.ip for n in [*w.relays, *w.peers] if n.endpoint.ip not in cut
    ]
    side_b = sorted(cut) + [
        p.endpoint.ip for p in w.peers if any(_ip_of(u) in cut for u in p.upstreams)
    ]
    side_a = [ip for ip in side_a if ip not in side_b]
    w.net.partition(side_a, side_b)
    c.faults.append(f"partition {len(side_a)}|{len(side_b)} for 30s")
    await w.publish(1, seed=c.rng.randrange(1 << 30))
    await trio.sleep(30)
    w.net.heal()


def _ip_of(multiaddr: str) -> str:
    return multiaddr.split("/")[2]


async def churn(c: Ctx) -> None:
    """A third of the peers crash and come back while two versions go out."""
    w = c.world
    await w.publish(0, seed=c.rng.randrange(1 << 30))
    await converge(w, 300)
    victims = c.rng.sample(w.peers, max(1, len(w.peers) // 3))
    async with trio.open_nursery() as nursery:
        for v in victims:
            nursery.start_soon(_crash_and_return, w, v, c.rng.uniform(0.0, 3.0), c.rng)
        await w.publish(1, seed=c.rng.randrange(1 << 30))
        await trio.sleep(c.rng.uniform(1.0, 4.0))
        await w.publish(2, seed=c.rng.randrange(1 << 30))
    c.faults.append(f"{len(victims)} peers crash+restart")


async def _crash_and_return(w: World, h: NodeHandle, after_s: float, rng: random.Random) -> None:
    await trio.sleep(after_s)
    w.kill(h)
    await trio.sleep(rng.uniform(1.0, 10.0))
    await w.run_node(h)


async def sybils(c: Ctx) -> None:
    """Four sybils per honest peer flood adverts (pointing at lanes serving random bytes),
    self-signed announcements and rollout announcements at relays, peers and the trainer."""
    w = c.world
    assert w.trainer is not None
    assert w.trainer.node is not None
    targets = [w.trainer.node.p2p.multiaddrs()[0]] + [
        h.node.p2p.multiaddrs()[0] for h in [*w.relays, *w.peers] if h.node is not None
    ]
    n = 4 * len(w.peers)
    for _ in range(n):
        s = w.add_sybil()
        c.byzantine.add(s.ident.peer_id)
        await w.run_sybil(s, c.rng.sample(targets, min(3, len(targets))), flood_interval_s=0.5)
    c.faults.append(f"{n} sybils")
    await w.publish(0, seed=c.rng.randrange(1 << 30))
    await converge(w, 300)
    await w.publish(1, seed=c.rng.randrange(1 << 30))


async def lossy_links(c: Ctx) -> None:
    """Every link loses 3 % of gossip hops and resets 3 % of streams and HTTP exchanges."""
    w = c.world
    w.net.default_profile = dataclasses.replace(w.net.default_profile, loss=0.03)
    c.faults.append("3% loss")
    await w.publish(0, seed=c.rng.randrange(1 << 30))
    await converge(w, 300)
    await w.publish(1, seed=c.rng.randrange(1 << 30))


async def republish(c: Ctx) -> None:
    """The trainer crashes, its data directory is wiped, and step 1 is published again with
    new content: every honest node must end with the new digest."""
    w = c.world
    await w.publish(0, seed=c.rng.randrange(1 << 30))
    await w.publish(1, seed=c.rng.randrange(1 << 30))
    await converge(w, 300)
    old = w.published[1]
    await w.restart_trainer(wipe=True)
    await w.publish(0, seed=c.rng.randrange(1 << 30))
    await w.publish(1, seed=c.rng.randrange(1 << 30))
    c.faults.append(f"trainer wiped; step 1 {old[:8]}->{w.published[1][:8]}")


SCENARIOS: dict[str, Scenario] = {
    s.name: s
    for s in (
        Scenario("baseline", 4, 16, baseline),
        Scenario("relay_dies", 5, 20, relay_dies),
        Scenario("corrupt_relays", 5, 20, corrupt_relays),
        Scenario("partition_heals", 4, 16, partition_heals),
        Scenario("churn", 4, 18, churn),
        Scenario("sybils", 3, 8, sybils, sybils_per_peer=4),
        Scenario("lossy_links", 4, 16, lossy_links),
        Scenario("republish", 4, 16, republish),
    )
}


# -- convergence and invariants -----------------------------------------------------------------


def honest_followers(w: World) -> list[NodeHandle]:
    return [*w.relays, *w.peers]


def converged(w: World, byzantine: set[str]) -> bool:
    """Every live honest follower holds the newest version with its digest."""
    if w.latest is None:
        return False
    step, digest = w.latest
    for h in honest_followers(w):
        if h.peer_id in byzantine or not h.alive:
            continue
        if h.held().get(step) != digest:
            return False
    return True


async def converge(w: World, deadline_s: float, byzantine: set[str] | None = None) -> bool:
    """Wait (virtual time) until :func:`converged`; False after ``deadline_s`` or once the
    world's wall-clock budget is spent (:meth:`World.out_of_wall_time`)."""
    with trio.move_on_after(deadline_s):
        while not converged(w, byzantine or set()):
            if w.out_of_wall_time():
                return False
            await w.changed()
        return True
    return False


async def settle_rollouts(w: World, deadline_s: float) -> None:
    """Wait until every live peer's sender has no batch pending."""
    with trio.move_on_after(deadline_s):
        for p in w.peers:
            if p.alive and p.sender is not None:
                await p.sender.wait_idle()
        await trio.sleep(2.0)  # the training loop takes what was accepted last


def check_invariants(w: World, byzantine: set[str]) -> tuple[dict[str, bool], list[str]]:
    notes: list[str] = []
    honest = {h.peer_id for h in honest_followers(w)} | {TRAINER.peer_id}
    honest -= byzantine
    banned_honest = set()
    for h in honest_followers(w):
        if h.peer_id in byzantine:
            continue
        banned_honest |= h.banned() & honest
    if banned_honest:
        notes.append(f"honest banned: {sorted(b[-6:] for b in banned_honest)}")
    # rollouts
    ok_rollouts = True
    acks: dict[str, Ack] = {}
    for p in w.peers:
        for ack in p.all_acks():
            acks[ack.batch_id] = ack
    submitted = {bid: (p, step) for p in w.peers for bid, step in p.submitted.items()}
    for (submitter, bid), times in w.trained.items():
        if times > 1:
            ok_rollouts = False
            notes.append(f"batch {bid[:8]} trained {times}x")
        if submitter in byzantine or submitter not in honest:
            ok_rollouts = False
            notes.append(f"sybil batch {bid[:8]} trained")
    for bid, (p, _step) in submitted.items():
        times = w.trained.get((p.peer_id, bid), 0)
        if times == 1:
            continue
        final = acks.get(bid)
        if final is not None and (final.status, final.reason) in HONEST_REJECTIONS:
            continue
        if final is None and p.crashes:
            continue  # the submitter crashed before the trainer decided
        ok_rollouts = False
        what = f"{final.status}/{final.reason}" if final else "no ack"
        notes.append(f"honest batch {bid[:8]} of {p.name} trained {times}x, {what}")
    bounded, why = w.memory_report()
    notes.extend(why)
    byz_banned = set()
    for h in honest_followers(w):
        byz_banned |= h.banned() & byzantine
    honest_trained = sum(1 for (sub, _), t in w.trained.items() if sub in honest and t)
    notes.append(
        f"stats: honest batches trained {honest_trained}/{len(submitted)}, "
        f"byzantine sources banned {len(byz_banned)}/{len(byzantine)}, "
        f"net messages {w.net.statistics().messages} dropped {w.net.statistics().dropped}"
    )
    return {
        "converged": converged(w, byzantine),
        "no_honest_banned": not banned_honest,
        "rollouts_once": ok_rollouts,
        "memory_bounded": bounded,
    }, notes


# -- running ------------------------------------------------------------------------------------


def run_scenario(
    spec: Scenario,
    seed: int,
    *,
    relays: int | None = None,
    peers: int | None = None,
    root: Path | None = None,
    deadline_s: float = 600.0,
    wall_s: float = 600.0,
) -> ScenarioResult:
    """Run one scenario under ``MockClock(autojump_threshold=0)`` and check its invariants.

    Args:
        relays, peers: override the scenario's size.
        root: where node data goes (default: a temporary directory, removed after).
        deadline_s: virtual seconds allowed to converge after the script.
        wall_s: real seconds allowed for the whole run; past them every wait for convergence
            gives up and the result fails its ``within_wall_clock`` invariant (a run that
            cannot converge fails instead of hanging).
    """
    n_relays = relays if relays is not None else spec.relays
    n_peers = peers if peers is not None else spec.peers
    tmp = Path(tempfile.mkdtemp(prefix=f"sim-{spec.name}-")) if root is None else root
    out: list[ScenarioResult] = []
    started = time.perf_counter()

    async def body() -> None:
        rng = random.Random(f"{spec.name}:{seed}")
        profile = LinkProfile(latency_s=0.01, jitter_s=0.01, bandwidth_bytes_per_s=20e6)
        async with MemNetwork(random.Random(seed), profile) as net, trio.open_nursery() as n:
            w = World(net, tmp, seed, SIZES)
            w.wall_deadline = started + wall_s
            await w.start(n)
            assert w.trainer is not None
            assert w.trainer.node is not None
            trainer_addr = w.trainer.node.p2p.multiaddrs()[0]
            for _ in range(n_relays):
                w.add_relay([trainer_addr])
            for r in w.relays:
                await w.run_node(r)
            relay_addrs = [r.node.p2p.multiaddrs()[0] for r in w.relays if r.node is not None]
            for _ in range(n_peers):
                w.add_peer(rng.sample(relay_addrs, min(2, len(relay_addrs))))
            for p in w.peers:
                await w.run_node(p)
            ctx = Ctx(w, rng)
            await spec.script(ctx)
            done = await converge(w, deadline_s, ctx.byzantine)
            converge_s = trio.current_time() - w.published_at if done else None
            out_of_time = w.out_of_wall_time()
            if not out_of_time:
                await settle_rollouts(w, 120.0)
            invariants, notes = check_invariants(w, ctx.byzantine)
            invariants["within_wall_clock"] = not out_of_time
            if out_of_time:
                notes.append(
                    f"wall-clock limit of {wall_s:g} s spent at {trio.current_time():.0f} virtual s"
                )
            nodes = 1 + len(w.relays) + len(w.peers) + len(w.sybils)
            out.append(
                ScenarioResult(
                    spec.name,
                    seed,
                    nodes,
                    "; ".join(ctx.faults) or "none",
                    converge_s,
                    time.perf_counter() - started,
                    invariants,
                    tuple(notes),
                )
            )
            n.cancel_scope.cancel()

    try:
        with inline_threads(), seeded_scheduler(f"{spec.name}:{seed}"):
            trio.run(body, clock=trio.testing.MockClock(autojump_threshold=0))
    finally:
        if root is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return out[0]


SWEPT = tuple(SCENARIOS)
"""Scenarios of the seeded sweep: all of them, in turn."""


def sweep_case(seed: int) -> tuple[str, int, int]:
    """The scenario and tiny world size (relays, peers) of sweep run ``seed``."""
    name = SWEPT[seed % len(SWEPT)]
    return (name, 5, 5) if name == "corrupt_relays" else (name, 2, 3)


def summarize(results: list[ScenarioResult]) -> str:
    """Per scenario: runs, runs holding every invariant, median and max virtual seconds to
    converge, mean real seconds per run."""
    lines = [
        f"{'scenario':16} {'runs':>5} {'held':>5} {'conv_med_s':>10} {'conv_max_s':>10} "
        f"{'real_s/run':>10}"
    ]
    for name in sorted({r.name for r in results}):
        rs = [r for r in results if r.name == name]
        conv = sorted(r.converge_s for r in rs if r.converge_s is not None)
        med = f"{conv[len(conv) // 2]:.2f}" if conv else "-"
        top = f"{conv[-1]:.2f}" if conv else "-"
        real = sum(r.real_s for r in rs) / len(rs)
        held = sum(r.ok for r in rs)
        lines.append(f"{name:16} {len(rs):>5} {held:>5} {med:>10} {top:>10} {real:>10.2f}")
    return "\n".join(lines)


def format_table(results: list[ScenarioResult]) -> str:
    """A fixed-width table, one row per run."""
    head = f"{'scenario':16} {'seed':>5} {'nodes':>5} {'conv_s':>8} {'real_s':>7}  "
    head += " ".join(f"{i[:12]:>12}" for i in INVARIANTS) + "  faults"
    rows = [head]
    for r in results:
        conv = f"{r.converge_s:.2f}" if r.converge_s is not None else "never"
        row = f"{r.name:16} {r.seed:>5} {r.nodes:>5} {conv:>8} {r.real_s:>7.1f}  "
        row += " ".join(f"{'yes' if r.invariants[i] else 'NO':>12}" for i in INVARIANTS)
        rows.append(row + f"  {r.faults}")
        rows.extend(f"    note: {n}" for n in r.notes[:5])
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    """``python -m simulations.scenarios``: run scenarios, print the table; exit 1 on a
    broken invariant."""
    ap = argparse.ArgumentParser(prog="python -m simulations.scenarios", description=__doc__)
    ap.add_argument("--sweep", type=int, default=1, help="seeded runs per scenario")
    ap.add_argument("--seed", type=int, default=1, help="first seed")
    ap.add_argument("--only", action="append", choices=sorted(SCENARIOS), help="scenario")
    ap.add_argument("--relays", type=int, default=None, help="override relays per world")
    ap.add_argument("--peers", type=int, default=None, help="override peers per world")
    ap.add_argument(
        "--cycle",
        type=int,
        default=0,
        help="run the CI sweep instead: N tiny runs cycling through the scenarios",
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.CRITICAL)
    results = []
    if args.cycle:
        for seed in range(args.seed, args.seed + args.cycle):
            name, relays, peers = sweep_case(seed)
            r = run_scenario(SCENARIOS[name], seed, relays=relays, peers=peers)
            results.append(r)
            if not r.ok:
                print(format_table([r]), flush=True)
        print(summarize(results))
        failed = [r for r in results if not r.ok]
        print(f"\n{len(results) - len(failed)}/{len(results)} runs held every invariant")
        return 1 if failed else 0
    for name in args.only or list(SCENARIOS):
        for seed in range(args.seed, args.seed + args.sweep):
            r = run_scenario(SCENARIOS[name], seed, relays=args.relays, peers=args.peers)
            results.append(r)
            print(format_table([r]).splitlines()[-1 - min(len(r.notes), 5)], flush=True)
    print()
    print(format_table(results))
    failed = [r for r in results if not r.ok]
    print(f"\n{len(results) - len(failed)}/{len(results)} runs held every invariant")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
