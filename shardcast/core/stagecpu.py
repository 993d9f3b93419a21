"""core: the CPU-seconds a node spends on versions, by stage of its data path.

Theory of operation
-------------------
What a next version costs a follower is CPU on that follower, spent in a few stages:
receiving bytes, hashing them, applying deltas, writing files, building full files of a
version kept as a delta chain, and (on a peer) bringing the weights into the engine.
:class:`StageCpu` is one node's account of them (:class:`Stage`: a bounded set, the values
are the ``stage`` label of ``shardnet_stage_cpu_seconds_total``). The node owns one (its
:class:`~shardcast.node.metrics.NodeMetrics` does, and exports it) and hands it down the way
the download observer is handed down; nothing is process-wide, so several nodes in one
process (tests) keep separate accounts.

What is charged is the CPU time of the thread doing the work (``time.thread_time()``: user
plus system time of the calling thread, so a ``pwrite`` counts its kernel copy), read around
**synchronous** sections only:

- in worker threads, around the blocking call (:meth:`StageCpu.measure`,
  :meth:`StageCpu.wrap`);
- on the event-loop thread, around code that does not await, or step by step of a coroutine
  (:meth:`StageCpu.steps`: each resumption of the coroutine until it next suspends is one
  synchronous section), never across an ``await`` of other code: other tasks run there and
  their CPU would be charged to the stage.

A section measured inside another section of the same account on the same thread is charged
to its own stage and subtracted from the enclosing one, so each CPU-second is counted once
(a chunk written while its bytes are hashed is ``write``, not ``verify``).

Not counted: CPU of threads that the measured code starts or hands work to on its own
(BLAKE3's ``max_threads``, torch's intra-op pool, a ``ThreadPoolExecutor`` whose function is
not wrapped with :meth:`StageCpu.wrap`); callers wrap such pool functions where they can.

The clock is injected (tests pass a fake one); no I/O.
"""

from __future__ import annotations

import enum
import threading
import time
import types
from collections.abc import Awaitable, Callable, Generator, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ParamSpec, TypeVar

__all__ = ["Stage", "StageCpu", "StageCpuStatistics"]

P = ParamSpec("P")
R = TypeVar("R")


class Stage(enum.StrEnum):
    """A stage of a node's data path (value: the ``stage`` metric label)."""

    RECEIVE = "receive"
    """Reading shard and blob bytes from sockets into buffers (requests, heads, bodies)."""
    VERIFY = "verify"
    """Hashing bytes to check them against signed digests."""
    APPLY = "apply"
    """Decoding encoded shards: delta decode and patch, decompression, reading the base."""
    WRITE = "write"
    """Writing verified bytes to the store (``pwrite``, range copies, blobs, commit)."""
    MATERIALIZE = "materialize"
    """Building the full files of a version kept as a delta chain."""
    ENGINE_UPDATE = "engine_update"
    """A peer bringing a version's weights into its engine, in place or by a full load."""


@dataclass(frozen=True)
class StageCpuStatistics:
    """CPU-seconds charged so far, by stage (every :class:`Stage` present, 0.0 if none)."""

    seconds: Mapping[Stage, float]

    @property
    def total_s(self) -> float:
        """The sum over stages, seconds."""
        return sum(self.seconds.values())


class _Frame:
    __slots__ = ("inner", "stage", "start")

    def __init__(self, stage: Stage, start: float) -> None:
        self.stage = stage
        self.start = start
        self.inner = 0.0  # seconds charged to sections nested in this one


class StageCpu:
    """One node's CPU-seconds by :class:`Stage` (see the module docstring).

    Args:
        clock: the CPU clock of the calling thread, seconds (``time.thread_time``; tests
            inject a fake).

    Thread-safe: any thread may measure and read at any time.
    """

    def __init__(self, clock: Callable[[], float] = time.thread_time) -> None:
        self._clock = clock
        self._seconds: dict[Stage, float] = dict.fromkeys(Stage, 0.0)
        self._lock = threading.Lock()
        self._local = threading.local()

    def add(self, stage: Stage, seconds: float) -> None:
        """Charge ``seconds`` (>= 0; negative amounts are ignored) to ``stage``."""
        if seconds > 0:
            with self._lock:
                self._seconds[stage] += seconds

    def statistics(self) -> StageCpuStatistics:
        """The seconds charged so far, by stage."""
        with self._lock:
            return StageCpuStatistics(dict(self._seconds))

    def _stack(self) -> list[_Frame]:
        stack: list[_Frame] | None = getattr(self._local, "stack", None)
        if stack is None:
            stack = self._local.stack = []
        return stack

    def _enter(self, stage: Stage) -> _Frame:
        frame = _Frame(stage, self._clock())
        self._stack().append(frame)
        return frame

    def _leave(self, frame: _Frame) -> None:
        elapsed = max(0.0, self._clock() - frame.start)
        stack = self._stack()
        if stack and stack[-1] is frame:
            stack.pop()
        else:  # left out of order (misuse across an await): never break the caller
            stack.remove(frame)
        if stack:
            stack[-1].inner += elapsed
        self.add(frame.stage, elapsed - frame.inner)

    @contextmanager
    def measure(self, stage: Stage) -> Iterator[None]:
        """Charge the calling thread's CPU time inside the block to ``stage`` (minus what
        nested sections charged to theirs). The block must not await."""
        frame = self._enter(stage)
        try:
            yield
        finally:
            self._leave(frame)

    def wrap(self, stage: Stage, fn: Callable[P, R]) -> Callable[P, R]:
        """``fn``, measured as :meth:`measure` each time it is called (in whatever thread:
        for worker threads and pools)."""

        def measured(*args: P.args, **kwargs: P.kwargs) -> R:
            with self.measure(stage):
                return fn(*args, **kwargs)

        return measured

    def steps(self, stage: Stage, awaitable: Awaitable[R]) -> Awaitable[R]:
        """``awaitable``, with the CPU time of each of its synchronous steps (from a
        resumption to the next suspension) charged to ``stage``; time while it is suspended
        (other tasks running) is not."""
        return self._steps(stage, awaitable.__await__())

    @types.coroutine
    def _steps(self, stage: Stage, inner: Generator[Any, Any, R]) -> Generator[Any, Any, R]:
        sent: Any = None
        thrown: BaseException | None = None
        while True:
            frame = self._enter(stage)
            try:
                if thrown is not None:
                    yielded = inner.throw(thrown)
                else:
                    yielded = inner.send(sent)
            except StopIteration as stop:
                return stop.value  # type: ignore[no-any-return]
            finally:
                self._leave(frame)
                thrown = None
            try:
                sent = yield yielded
            except GeneratorExit:
                inner.close()
                raise
            except BaseException as exc:  # delivered into the inner coroutine (cancellation)
                sent, thrown = None, exc
