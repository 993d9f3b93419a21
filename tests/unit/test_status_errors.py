"""``shardnet status`` names an unreachable target once, with what failed."""

from __future__ import annotations

import pytest

from shardnet.status import StatusError, fetch_status
from tests.helpers import closed_port


async def test_an_unreachable_target_is_named_once() -> None:
    target = f"http://127.0.0.1:{closed_port()}"
    with pytest.raises(StatusError) as err:
        await fetch_status(target)
    msg = str(err.value)
    assert msg.startswith(f"{target}: connect failed"), msg
    assert msg.count(target) == 1, msg
