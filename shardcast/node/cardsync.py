"""node: keeping and fetching the run card (:mod:`shardcast.wire.runcard`): disk, libp2p, bootstrap.

Theory of operation
-------------------
Every node keeps the newest run card it verified in ``<data_dir>/runcard.json`` and serves it
(the node does, see :mod:`shardcast.node.node`). A node started on a data directory checks that
directory first (:func:`check_data_dir`): a stored card or stored versions of another run are
an operator error, reported before anything is served. Followers learn of a newer card from
the info records of their upstreams and from version announcements (both carry the card's
version and digest) and fetch it with :func:`fetch_card` on ``/shardnet/runcard/1.0.0``. A
relay or peer started with no run id and no stored card gets its first card with
:func:`bootstrap_card` through a short-lived libp2p host, before it opens its node.

A card that fails verification is never stored or served. A joining node whose bootstrap
nodes only offer cards signed by another key, or with bad signatures, stops with one error:
retrying would not change the answer, while an unreachable node or one without a card yet
is retried with a bounded backoff, each failure logged once per attempt.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import trio

from p2p import wire
from p2p.errors import ConfigError, IntegrityError, ShardnetError, short_id
from p2p.host import HostConfig, P2PNode, peer_id_of
from p2p.identity import Identity
from p2p.lanes import Host
from shardcast.store import replace_file
from shardcast.wire import (
    CARD_FILE,
    MAX_CARD_BYTES,
    NO_RUNCARD,
    RUNCARD_PROTOCOL,
    BadRunCardSignature,
    MalformedRunCard,
    SignedRunCard,
    WrongRunCardKey,
)

log = logging.getLogger(__name__)

__all__ = ["bootstrap_card", "check_data_dir", "fetch_card", "save_card"]


def card_path(data_dir: Path) -> Path:
    """Where a node keeps its run card."""
    return data_dir / CARD_FILE


def check_data_dir(data_dir: Path, run_id: str | None, trainer: str) -> SignedRunCard | None:
    """The card stored in ``data_dir`` (verified), after checking the directory is this run's.

    Args:
        data_dir: the node's data directory.
        run_id: the run the node is configured for, or None (a follower adopting the card's).
        trainer: the pinned trainer PeerID.

    Raises:
        ConfigError: the stored card is unreadable, not signed by ``trainer``, or for another
            run (field ``run_id``); or ``data_dir/versions`` holds another run's versions
            (field ``data_dir``). The message names the path and what to do.
    """
    path = card_path(data_dir)
    try:
        card = SignedRunCard.load(path, trainer=trainer)
    except (MalformedRunCard, IntegrityError) as exc:
        raise ConfigError(
            "data_dir", f"{path} is not a run card of trainer {short_id(trainer)}: {exc}"
        ) from exc
    except OSError as exc:
        raise ConfigError("data_dir", f"cannot read {path}: {exc}") from exc
    want = run_id if run_id is not None else (card.card.run_id if card else None)
    if card is not None and want != card.card.run_id:
        raise ConfigError(
            "run_id",
            f"{data_dir} holds run {card.card.run_id!r} (card v{card.version}), not {want!r}: "
            f"use another --data-dir, or --run-id {card.card.run_id}",
        )
    versions = data_dir / "versions"
    if versions.is_dir():
        others = sorted(
            e.name for e in os.scandir(versions) if e.is_dir() and e.name != want and want
        )
        if others:
            raise ConfigError(
                "data_dir",
                f"{data_dir} holds versions of run(s) {', '.join(others)}, not {want!r}: "
                "use another --data-dir",
            )
    return card


def save_card(data_dir: Path, card: SignedRunCard, durable: bool) -> None:
    """Store ``card`` as ``data_dir/runcard.json`` (temporary file, rename; fsync if durable)."""
    path = card_path(data_dir)
    path.parent.mkdir(parents=True, exist_ok=True)
    replace_file(path, card.encode(), durable=durable)


async def fetch_card(
    p2p: Host, peer_id: str, trainer: str, timeout_s: float = 10.0
) -> SignedRunCard | None:
    """Ask ``peer_id`` for its run card and verify it against ``trainer``.

    Returns:
        the card, or None if that node has none yet.

    Raises:
        PeerUnreachable, StreamBroken, RemoteProtocolError: transport or protocol failure.
        MalformedRunCard, BadRunCardSignature, WrongRunCardKey: the card does not verify.
    """
    data = await p2p.request(
        peer_id,
        RUNCARD_PROTOCOL,
        wire.encode({"v": 1}),
        max_response_bytes=MAX_CARD_BYTES,
        timeout_s=timeout_s,
    )
    if not data or data == NO_RUNCARD:
        return None
    return SignedRunCard.decode(data, trainer=trainer, source=peer_id)


async def bootstrap_card(
    identity: Identity,
    addrs: tuple[str, ...],
    trainer: str,
    *,
    retry_s: float = 1.0,
    max_retry_s: float = 10.0,
) -> SignedRunCard:
    """Fetch the run card from any of ``addrs`` through a short-lived libp2p host.

    Tries each address in turn until one serves a card that verifies. An unreachable node,
    or one without a card yet, is retried with a backoff from ``retry_s`` to ``max_retry_s``.

    Raises:
        ConfigError: every address answered, and none with a card signed by ``trainer``
            (field ``trainer_id``: a card by another key; ``bootstrap``: bad signature or a
            malformed card), or an address is malformed.
    """
    pids = [peer_id_of(a) for a in addrs]
    delay = retry_s
    async with P2PNode.open(identity, HostConfig(("/ip4/127.0.0.1/tcp/0",)), helper=True) as p2p:
        while True:
            refused: list[ShardnetError] = []
            for addr, pid in zip(addrs, pids, strict=True):
                try:
                    if pid not in p2p.connected_peers():
                        await p2p.connect(addr)
                    card = await fetch_card(p2p, pid, trainer)
                except (WrongRunCardKey, BadRunCardSignature, MalformedRunCard) as exc:
                    log.warning("runcard_refused upstream=%s error=%s", short_id(pid), exc)
                    refused.append(exc)
                    continue
                except ShardnetError as exc:
                    log.info("runcard_unavailable upstream=%s error=%s", short_id(pid), exc)
                    continue
                if card is None:
                    log.info("runcard_not_yet upstream=%s retry_s=%.1f", short_id(pid), delay)
                    continue
                log.info(
                    "runcard_fetched upstream=%s run=%s version=%d digest=%s",
                    short_id(pid),
                    card.card.run_id,
                    card.version,
                    card.digest[:16],
                )
                return card
            if len(refused) == len(addrs):
                first = refused[0]
                if isinstance(first, WrongRunCardKey):
                    raise ConfigError("trainer_id", f"{first}; check --trainer-id") from first
                raise ConfigError("bootstrap", f"{first}") from first
            await trio.sleep(delay)
            delay = min(2 * delay, max_retry_s)
