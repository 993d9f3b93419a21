"""p2p.whole_frames: a muxer frame is written whole even when its writer is cancelled, and a
frame the peer never takes closes the connection after the bound."""

from __future__ import annotations

import pytest
import trio
import trio.testing
from libp2p.network.connection.exceptions import RawConnError
from libp2p.stream_muxer.yamux.yamux import Yamux

from p2p.whole_frames import write_frames_whole


class _SlowConn:
    """A secured connection whose socket takes half of each write, then waits for room
    (``room``) before taking the rest."""

    def __init__(self) -> None:
        self.sent = b""
        self.room = trio.Event()
        self.closed = False

    async def write(self, data: bytes) -> None:
        half = len(data) // 2
        self.sent += data[:half]
        await self.room.wait()
        self.sent += data[half:]

    async def close(self) -> None:
        self.closed = True


def _muxer(conn: _SlowConn) -> Yamux:
    muxer = Yamux.__new__(Yamux)  # only the write path: no connection, no tasks
    muxer._write_lock = trio.Lock()
    muxer.secured_conn = conn  # type: ignore[assignment]  # a stand-in: write and close
    muxer.peer_id = "peer"  # type: ignore[assignment]  # logged only
    muxer.is_initiator_value = True  # logged by the library's own write
    return muxer


async def test_a_cancelled_frame_write_still_sends_the_whole_frame() -> None:
    conn = _SlowConn()
    muxer = _muxer(conn)
    assert write_frames_whole(muxer, 30.0)
    assert write_frames_whole(muxer, 30.0)  # idempotent
    frame = bytes(range(200))
    cancelled = False

    scope = trio.CancelScope()

    async def writer() -> None:
        nonlocal cancelled
        with scope:
            try:
                await muxer._write_frame(frame)
            except trio.Cancelled:
                cancelled = True
                raise

    async with trio.open_nursery() as nursery:
        nursery.start_soon(writer)
        await trio.testing.wait_all_tasks_blocked()
        assert conn.sent == frame[:100]  # half written, waiting for room
        scope.cancel()  # a download completed: its other requests are cancelled
        await trio.testing.wait_all_tasks_blocked()
        assert conn.sent == frame[:100]
        conn.room.set()
    assert conn.sent == frame  # the frame went out whole, then the cancellation landed
    assert cancelled


async def test_a_frame_the_peer_never_takes_closes_the_connection(
    autojump_clock: trio.abc.Clock,
) -> None:
    conn = _SlowConn()
    muxer = _muxer(conn)
    write_frames_whole(muxer, 30.0)
    start = trio.current_time()
    with pytest.raises(RawConnError, match=r"within 30\.0s"):
        await muxer._write_frame(b"x" * 10)
    assert trio.current_time() - start == pytest.approx(30.0)
    assert conn.closed


def test_other_muxers_are_left_alone() -> None:
    assert not write_frames_whole(object(), 30.0)
