"""``shardnet status`` names an unreachable target once, with what failed."""

from __future__ import annotations

import socket

import pytest

from shardnet.status import StatusError, fetch_status


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_an_unreachable_target_is_named_once() -> None:
    target = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(StatusError) as err:
        await fetch_status(target)
    msg = str(err.value)
    assert msg.startswith(f"{target}: connect failed"), msg
    assert msg.count(target) == 1, msg
