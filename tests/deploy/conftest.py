"""Fixtures for tests that deploy shardnet on hosts made of network namespaces."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.deploy.hosts import Hosts, available


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Hosts]:
    """A fresh set of hosts; every node is stopped and every namespace removed at the end,
    whatever the outcome. Skips (with the reason) without root or ``ip netns``."""
    ok, why = available()
    if not ok:
        pytest.skip(f"network namespaces unavailable: {why}")
    with Hosts(tmp_path) as h:
        yield h
