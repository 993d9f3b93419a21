"""The peer's weight swap (:meth:`shardnet.peer.InferencePeer._swap_in`): a version the engine
already holds (regenerating for a restarted or continued trainer) is not loaded again."""

from __future__ import annotations

import contextlib
import logging
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import pytest

import shardnet.peer as peer_module
from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.download.follower import FollowConfig
from shardcast.node.node import NodeConfig
from shardnet.engine_update import HeldVersion, SwapPath, SwapResult
from shardnet.peer import InferencePeer, PeerConfig

PEER = Identity.from_seed("swap-peer")
TRAINER = Identity.from_seed("swap-trainer")


class Store:
    """What ``_swap_in`` reads of the version store: version 0, whole files."""

    @contextlib.contextmanager
    def pinned(self, step: int) -> Iterator[None]:
        yield

    def has(self, step: int) -> bool:
        return step == 0

    def chained_files(self, step: int) -> list[str]:
        return []


async def test_a_version_the_engine_holds_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    swaps: list[str] = []

    def fake_swap(engine: Any, store: Any, signed: Any, path: Path, held: Any, cpu: Any) -> Any:
        swaps.append(signed.digest)
        return SwapResult(SwapPath.FULL, 0.1, HeldVersion(signed, {}))

    monkeypatch.setattr(peer_module, "swap_weights", fake_swap)
    monkeypatch.setattr(peer_module, "_architecture_matches", lambda card, path: True)
    tokenizer: Any = object()
    monkeypatch.setattr(peer_module, "load_tokenizer", lambda path: tokenizer)
    cfg = PeerConfig(
        node=NodeConfig("peer", "r", tmp_path / "peer"),
        follow=FollowConfig((f"/ip4/127.0.0.1/tcp/1/p2p/{TRAINER.peer_id}",)),
    )
    peer = InferencePeer(PEER, TrustList(TRAINER.peer_id), cfg, engine=cast(Any, object()))
    peer.node = cast(
        Any,
        types.SimpleNamespace(store=Store(), metrics=types.SimpleNamespace(stage_cpu=None)),
    )
    v0 = cast(Any, types.SimpleNamespace(step=0, digest="d0"))
    card = cast(Any, None)
    with caplog.at_level(logging.INFO, logger="shardnet.peer"):
        assert await peer._swap_in(v0, tmp_path, card) is tokenizer
        assert await peer._swap_in(v0, tmp_path, card) is tokenizer  # again: kept
        other = cast(Any, types.SimpleNamespace(step=0, digest="e0"))  # republished step
        assert await peer._swap_in(other, tmp_path, card) is tokenizer
    assert swaps == ["d0", "e0"]
    assert "engine_weights_kept step=0 reason=already_loaded" in caplog.text
