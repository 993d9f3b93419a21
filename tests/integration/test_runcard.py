"""The run card over real libp2p hosts and HTTP lanes on 127.0.0.1: origin -> relay -> peer.

The peer is given only the trainer's PeerID and the relay's address; it gets the run id and
the rules from the card, follows a new card version, and refuses bad cards and data dirs.
"""

from __future__ import annotations

import json
import os
import random
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import trio

from p2p.errors import ConfigError
from p2p.host import HostConfig, P2PNode
from p2p.http_client import HttpClient
from p2p.identity import Identity
from p2p.trust import TrustList
from rollout.task import DigitTask, task_data_digest
from shardcast.download.follower import FollowConfig, Follower, VersionRecord
from shardcast.node.cardsync import bootstrap_card, check_data_dir, fetch_card, save_card
from shardcast.node.node import NodeConfig, ShardcastNode
from shardcast.publish.origin import Origin, OriginConfig
from shardcast.wire.manifest import Manifest
from shardcast.wire.runcard import (
    PROFILE_THRESHOLD_KEYS,
    CardProfile,
    EngineSpec,
    RunCard,
    SamplingRules,
    SignedRunCard,
    TaskSpec,
    UnsupportedEngine,
    architecture_digest,
    next_card,
    sign_card,
)
from tests.helpers import TRAINER, make_checkpoint, trust

if TYPE_CHECKING:
    from trio_typing import TaskStatus

SIZES = {"model.safetensors": 100_000}


def _rules(group_size: int = 4, engines: tuple[EngineSpec, ...] | None = None) -> RunCard:
    return RunCard(
        card_version=1,
        run_id="card-run",
        trainer=TRAINER.peer_id,
        task=TaskSpec(DigitTask.family, DigitTask.version, task_data_digest()),
        sampling=SamplingRules(2, group_size, 8, 0.9),
        engines=engines or (EngineSpec("transformers", "bf16"),),
        async_level=1,
        architecture_digest=architecture_digest({"model_type": "llama", "seed": 0}),
        issued_at_ms=int(time.time() * 1000),
    )


async def _serve(
    node_cfg: NodeConfig,
    ident: Identity,
    tl: TrustList,
    upstream: str | None,
    card: SignedRunCard | None = None,
    on_commit: object = None,
    *,
    task_status: TaskStatus[ShardcastNode] = trio.TASK_STATUS_IGNORED,
) -> None:
    async with ShardcastNode.open(ident, tl, node_cfg) as node, trio.open_nursery() as n:
        if card is not None:
            node.set_card(card)
        if upstream is not None:
            f = Follower(
                node,
                FollowConfig(upstreams=(upstream,), poll_interval_s=0.1, discovery=False),
                random.Random(1),
                on_commit=on_commit,  # type: ignore[arg-type]
            )
            await n.start(f.run)
        task_status.started(node)
        await trio.sleep_forever()


async def test_peer_joins_from_the_card_and_follows_a_new_version(tmp_path: Path) -> None:
    tl = trust()
    seen: list[tuple[int, int]] = []  # (step, card version held when the step committed)
    got_two = trio.Event()

    async with (
        ShardcastNode.open(TRAINER, tl, NodeConfig("trainer", "card-run", tmp_path / "o")) as o,
        trio.open_nursery() as nursery,
    ):
        card1 = next_card(_rules(), o.card, TRAINER)
        assert o.set_card(card1)
        origin = Origin(o, OriginConfig(shard_size=64 * 1024))
        relay = await nursery.start(
            _serve,
            NodeConfig("relay", "card-run", tmp_path / "r"),
            Identity.from_seed("card-relay"),
            tl,
            o.p2p.multiaddrs()[0],
        )
        relay_addr = relay.p2p.multiaddrs()[0]
        # the peer knows only the trainer's PeerID and the relay's address; no card yet there
        peer_id = Identity.from_seed("card-peer")
        with trio.fail_after(30):
            card = await bootstrap_card(peer_id, (relay_addr,), TRAINER.peer_id, retry_s=0.1)
        assert card == card1  # the relay re-serves the card it verified
        assert card.card.sampling.group_size == 4
        run_id = card.card.run_id
        assert check_data_dir(tmp_path / "p", run_id, TRAINER.peer_id) is None

        async def on_commit(m: Manifest, path: Path, rec: VersionRecord) -> None:
            assert peer.card is not None
            seen.append((m.step, peer.card.version))
            if m.step == 1:
                got_two.set()

        peer = await nursery.start(
            _serve,
            NodeConfig("peer", run_id, tmp_path / "p"),
            peer_id,
            TrustList(trainer=TRAINER.peer_id),
            relay_addr,
            card,
            on_commit,
        )
        await origin.publish(make_checkpoint(tmp_path / "ck0", SIZES, seed=0), 0)
        # the rules change: card version 2 (group size 8, calibrated validator thresholds),
        # then version 1 under it
        profile = CardProfile.of(
            "ef" * 32, {"transformers-bf16": dict.fromkeys(PROFILE_THRESHOLD_KEYS, 0.25)}
        )
        card2 = next_card(replace(_rules(group_size=8), validator_profile=profile), o.card, TRAINER)
        assert card2.version == 2
        assert o.set_card(card2)
        await origin.publish(make_checkpoint(tmp_path / "ck1", SIZES, seed=0), 1)
        with trio.fail_after(30):
            await got_two.wait()
        assert seen[-1] == (1, 2)  # the new card was held before version 1 was used
        assert peer.card == card2
        assert relay.card == card2
        assert peer.card.card.validator_profile == profile  # peers see the run's thresholds
        # stored in every data dir, served over HTTP and in the info record
        for d in ("o", "r", "p"):
            stored = SignedRunCard.load(tmp_path / d / "runcard.json", trainer=TRAINER.peer_id)
            assert stored == card2
        async with HttpClient() as client:
            body = await client.get_bytes(
                relay.http.url + "/shardnet/v1/runcard", max_bytes=1 << 16, timeout_s=5
            )
        assert body == card2.encode()
        assert json.loads(body)["v"] == 2  # {"v": 2, "sealed": <base64 p2p.envelope>}
        info = await peer.query_info(relay.identity.peer_id)
        assert (info.card_version, info.card_digest) == (2, card2.digest)
        nursery.cancel_scope.cancel()


async def test_a_node_without_a_card_yet_says_so(tmp_path: Path) -> None:
    """An origin before its first version has no card: the answer says so (it was an empty
    message, which py-libp2p's request/response reports as a broken stream, so a relay
    waiting for the origin logged ``runcard_unavailable`` instead of ``runcard_not_yet``)."""
    cfg = NodeConfig("trainer", "card-run", tmp_path / "o")
    async with (
        ShardcastNode.open(TRAINER, trust(), cfg) as o,
        P2PNode.open(Identity.from_seed("asker"), HostConfig()) as asker,
    ):
        await asker.connect(o.p2p.multiaddrs()[0])
        assert await fetch_card(asker, TRAINER.peer_id, TRAINER.peer_id) is None
        card = sign_card(_rules(), TRAINER)
        assert o.set_card(card)
        assert await fetch_card(asker, TRAINER.peer_id, TRAINER.peer_id) == card


async def test_a_data_dir_holds_one_node_at_a_time(tmp_path: Path) -> None:
    """A second node on a running node's data directory is refused before it reads or writes
    anything there (a second trainer on a live one's directory resumed its run and signed its
    end into the shared store); once the first has stopped, the directory is free again."""
    cfg = NodeConfig("trainer", "card-run", tmp_path / "o")
    async with ShardcastNode.open(TRAINER, trust(), cfg) as o:
        # and the pinned trainer is never banned by a node (see p2p.limits.LedgerConfig)
        assert o.p2p.config.ledger.never_ban == frozenset({TRAINER.peer_id})  # type: ignore[attr-defined]
        with pytest.raises(ConfigError, match="in use by another shardnet node") as info:
            async with ShardcastNode.open(TRAINER, trust(), cfg):
                pass
        assert info.value.field == "data_dir"
        assert f"(pid {os.getpid()})" in str(info.value)
    async with ShardcastNode.open(TRAINER, trust(), cfg):
        pass


async def test_bad_cards_and_data_dirs_are_refused(tmp_path: Path) -> None:
    tl = trust()
    other = Identity.from_seed("someone-else")
    async with ShardcastNode.open(
        TRAINER, tl, NodeConfig("trainer", "card-run", tmp_path / "o")
    ) as o:
        o.set_card(sign_card(_rules(), TRAINER))
        addr = o.p2p.multiaddrs()[0]
        # a peer pinning another trainer gets one error naming --trainer-id
        with trio.fail_after(30), pytest.raises(ConfigError) as info:
            await bootstrap_card(Identity.from_seed("p"), (addr,), other.peer_id)
        assert info.value.field == "trainer_id"
        assert "check --trainer-id" in str(info.value)
    # a forged card (body changed after signing) in a data dir, in the old format
    rules = _rules()
    sig = TRAINER.sign("runcard/v1", rules.canonical_bytes()).hex()
    forged = {"body": rules.to_obj(), "signer": TRAINER.peer_id, "signature": sig}
    forged["body"]["sampling"]["group_size"] = 99
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "runcard.json").write_text(json.dumps(forged))
    with pytest.raises(ConfigError, match="signature") as info:
        check_data_dir(bad, None, TRAINER.peer_id)
    assert info.value.field == "data_dir"
    # the path is named whole where it says where the card came from (not as a PeerID)
    assert str(info.value).endswith(f"(from {bad / 'runcard.json'})"), str(info.value)
    # a data dir of another run: refused at open, before anything is served
    other_run = tmp_path / "other"
    save_card(other_run, sign_card(replace(_rules(), run_id="old-run"), TRAINER), False)
    with pytest.raises(ConfigError, match="holds run 'old-run'") as info:
        async with ShardcastNode.open(TRAINER, tl, NodeConfig("relay", "card-run", other_run)):
            pass
    assert info.value.field == "run_id"
    versions = tmp_path / "v"
    (versions / "versions" / "old-run").mkdir(parents=True)
    with pytest.raises(ConfigError, match="versions of run"):
        check_data_dir(versions, "card-run", TRAINER.peer_id)


async def test_peer_without_the_cards_engine_exits(tmp_path: Path) -> None:
    from shardnet.config import PeerSettings
    from shardnet.roles import run_peer

    tl = trust()
    fp32 = (EngineSpec("transformers", "fp32"),)
    async with ShardcastNode.open(
        TRAINER, tl, NodeConfig("trainer", "card-run", tmp_path / "o")
    ) as o:
        o.set_card(sign_card(_rules(engines=fp32), TRAINER))
        s = PeerSettings(
            bootstrap=[o.p2p.multiaddrs()[0]],
            trainer_id=TRAINER.peer_id,
            data_dir=tmp_path / "p",
        )
        with trio.fail_after(30), pytest.raises(UnsupportedEngine, match="transformers-fp32"):
            await run_peer(s)
    assert not (tmp_path / "p" / "runcard.json").exists()  # nothing adopted
