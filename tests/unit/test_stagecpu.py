"""A node's CPU account by stage (shardcast.core.stagecpu) and its metric family, with a fake
CPU clock: nesting is counted once, threads keep their own sections, a coroutine is charged
only for its own steps, and the data path charges the stages it runs."""

from __future__ import annotations

import threading

import trio
import trio.testing

from shardcast.core import Stage, StageCpu
from shardcast.node.metrics import NodeMetrics


class FakeClock:
    """A CPU clock that reads ``now`` (seconds), optionally ticking ``tick`` per reading."""

    def __init__(self, tick: float = 0.0) -> None:
        self.now = 0.0
        self.tick = tick

    def __call__(self) -> float:
        t = self.now
        self.now += self.tick
        return t


def test_measure_charges_each_stage_and_nested_sections_once() -> None:
    clock = FakeClock()
    cpu = StageCpu(clock)
    with cpu.measure(Stage.VERIFY):
        clock.now += 2.0
        with cpu.measure(Stage.WRITE):  # a chunk written while its bytes are hashed
            clock.now += 3.0
        clock.now += 1.0
    s = cpu.statistics()
    assert s.seconds[Stage.VERIFY] == 3.0
    assert s.seconds[Stage.WRITE] == 3.0
    assert s.total_s == 6.0
    assert set(s.seconds) == set(Stage)
    assert s.seconds[Stage.RECEIVE] == 0.0


def test_an_exception_still_charges_and_unwinds() -> None:
    clock = FakeClock()
    cpu = StageCpu(clock)
    try:
        with cpu.measure(Stage.APPLY):
            clock.now += 1.5
            raise ValueError("bad blob")
    except ValueError:
        pass
    with cpu.measure(Stage.WRITE):  # not nested in the failed section
        clock.now += 1.0
    s = cpu.statistics().seconds
    assert (s[Stage.APPLY], s[Stage.WRITE]) == (1.5, 1.0)


def test_wrap_and_threads_keep_their_own_sections() -> None:
    clocks = {"MainThread": FakeClock(), "worker": FakeClock()}

    def clock() -> float:  # each thread its own CPU clock
        return clocks[threading.current_thread().name]()

    cpu = StageCpu(clock)

    def decode(seconds: float) -> str:
        clocks["worker"].now += seconds
        return "decoded"

    def worker() -> None:
        assert cpu.wrap(Stage.ENGINE_UPDATE, decode)(4.0) == "decoded"

    with cpu.measure(Stage.ENGINE_UPDATE):
        clocks["MainThread"].now += 1.0
        t = threading.Thread(target=worker, name="worker")
        t.start()
        t.join()
    # the worker's section is not nested in the main thread's: both count in full
    assert cpu.statistics().seconds[Stage.ENGINE_UPDATE] == 5.0


async def test_steps_charge_only_the_coroutines_own_steps() -> None:
    clock = FakeClock()
    cpu = StageCpu(clock)

    async def reads() -> int:
        clock.now += 1.0  # step 1
        await trio.testing.wait_all_tasks_blocked()
        clock.now += 2.0  # step 2
        await trio.lowlevel.checkpoint()
        clock.now += 4.0  # step 3
        return 7

    async def busy_neighbour() -> None:
        for _ in range(3):
            clock.now += 100.0  # another task's CPU on the loop thread: never charged
            await trio.lowlevel.checkpoint()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(busy_neighbour)
        assert await cpu.steps(Stage.RECEIVE, reads()) == 7
    assert cpu.statistics().seconds[Stage.RECEIVE] == 7.0
    assert clock.now == 307.0  # the neighbour did run in between


async def test_steps_pass_cancellation_through_and_charge_the_steps_run() -> None:
    clock = FakeClock()
    cpu = StageCpu(clock)
    cleaned = []

    async def forever() -> None:
        clock.now += 1.0
        try:
            await trio.sleep_forever()
        finally:
            clock.now += 0.5
            cleaned.append(True)

    with trio.move_on_after(1) as scope:
        await cpu.steps(Stage.RECEIVE, forever())
    assert scope.cancelled_caught
    assert cleaned == [True]
    assert cpu.statistics().seconds[Stage.RECEIVE] == 1.5


async def test_steps_of_an_async_generator_step(autojump_clock: trio.abc.Clock) -> None:
    clock = FakeClock()
    cpu = StageCpu(clock)

    async def pieces():  # type: ignore[no-untyped-def]
        for n in (3, 5):
            clock.now += 1.0
            await trio.sleep(1)
            yield n

    got = []
    it = pieces()
    while True:
        try:
            got.append(await cpu.steps(Stage.RECEIVE, anext(it)))
        except StopAsyncIteration:
            break
    assert got == [3, 5]
    assert cpu.statistics().seconds[Stage.RECEIVE] == 2.0


def test_metric_family_has_every_stage_and_the_seconds() -> None:
    clock = FakeClock()
    m = NodeMetrics("relay", "run", "12D3KooWtest", process=False, stage_cpu=StageCpu(clock))
    text = m.render().decode()
    for stage in Stage:
        assert f'shardnet_stage_cpu_seconds_total{{stage="{stage.value}"}} 0.0' in text
    with m.stage_cpu.measure(Stage.APPLY):
        clock.now += 0.25
    text = m.render().decode()
    assert 'shardnet_stage_cpu_seconds_total{stage="apply"} 0.25' in text
    lines = [x for x in text.splitlines() if x.startswith("shardnet_stage_cpu_seconds_total")]
    assert len(lines) == len(Stage)  # a bounded label set: one series per stage


def test_nodes_in_one_process_keep_separate_accounts() -> None:
    a = NodeMetrics("relay", "run", "a", process=False)
    b = NodeMetrics("peer", "run", "b", process=False)
    a.stage_cpu.add(Stage.WRITE, 1.0)
    assert b.stage_cpu.statistics().seconds[Stage.WRITE] == 0.0
    assert a.stage_cpu is not b.stage_cpu
