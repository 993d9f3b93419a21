"""node: the trio side of the dial-back reachability check (the rules are in
:mod:`shardcast.core.reachability`).

:func:`serve_dialback` registers :data:`~shardcast.core.reachability.DIALBACK_PROTOCOL` on a node:
it dials a requester's lane only at the address the requester's connection comes from, rate
limited by :class:`~shardcast.core.reachability.DialbackLimiter`. :func:`keep_reachability` runs
on a node that advertises: it asks a few connected nodes per round, feeds their answers to a
:class:`~shardcast.core.reachability.Reachability` and calls back when the URL to advertise
changes.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence

import trio

from p2p.addresses import interface_subnets
from p2p.errors import ShardnetError, TransportError, short_id
from p2p.lanes import Host, HttpLaneClient
from shardcast.core import (
    DIALBACK_PROTOCOL,
    MAX_DIALBACK_BYTES,
    DialbackAnswer,
    DialbackLimiter,
    DialbackLimits,
    DialbackRequest,
    DialbackResult,
    Interface,
    LaneCheck,
    Reachability,
    judge_request,
    lan_asker,
)
from shardcast.wire import check_whoami, whoami_path

log = logging.getLogger(__name__)


def serve_dialback(host: Host, client: HttpLaneClient, limits: DialbackLimits) -> DialbackLimiter:
    """Answer dial-back requests on ``host``, dialling with ``client``; the limiter (for
    statistics). Safe to call once per host."""
    limiter = DialbackLimiter(limits)

    async def handle(sender: str, request: bytes) -> bytes:
        req = DialbackRequest.decode(request, sender)
        observed = host.remote_hosts(sender)
        result = judge_request(req.url, observed)
        seen = observed[0] if observed else ""
        if result is None:
            if limiter.admit(sender, seen, trio.current_time()):
                try:
                    result = await _dial(client, sender, req, limits.dial_timeout_s)
                finally:
                    limiter.done()
            else:
                result = DialbackResult.REFUSED
        log.info(
            "dialback_answered asker=%s http_url=%s result=%s",
            short_id(sender),
            req.url,
            result.value,
        )
        return DialbackAnswer(result, seen).encode()

    host.serve(
        DIALBACK_PROTOCOL,
        handle,
        max_request_bytes=MAX_DIALBACK_BYTES,
        max_response_bytes=MAX_DIALBACK_BYTES,
        timeout_s=limits.dial_timeout_s + 5.0,
        max_concurrent=2 * limits.max_concurrent,
    )
    return limiter


async def challenge_lane(
    client: HttpLaneClient, url: str, peer_id: str, nonce: str, timeout_s: float
) -> LaneCheck:
    """Ask the lane at ``url`` to sign ``nonce`` (``/shardnet/v1/whoami/<nonce>``) and check
    that ``peer_id``'s key did (:func:`shardcast.wire.check_whoami`). Used both to verify an
    advertised URL and to dial a node back.

    Args:
        nonce: a fresh random hex string (the challenger's, or the dial-back asker's).
        timeout_s: bound of the whole fetch, seconds.

    Returns:
        ``VERIFIED``; ``BAD_ANSWER`` (an answer that does not prove ``peer_id``'s key); or
        ``UNREACHABLE`` (refused, timed out, not HTTP). Raises nothing on a bad lane.
    """
    try:
        answer = await client.get_bytes(
            url + whoami_path(nonce), max_bytes=512, timeout_s=timeout_s
        )
    except (TransportError, ShardnetError):
        return LaneCheck.UNREACHABLE
    if check_whoami(answer, peer_id, nonce, url):
        return LaneCheck.VERIFIED
    return LaneCheck.BAD_ANSWER


async def _dial(
    client: HttpLaneClient, asker: str, req: DialbackRequest, timeout_s: float
) -> DialbackResult:
    checked = await challenge_lane(client, req.url, asker, req.nonce, timeout_s)
    return DialbackResult.REACHED if checked is LaneCheck.VERIFIED else DialbackResult.NOT_REACHED


async def ask(host: Host, peer_id: str, url: str, timeout_s: float) -> DialbackResult:
    """Ask ``peer_id`` to dial ``url`` back; its answer, or ``FAILED`` if there was none (no
    connection, a timeout, a node that does not speak the protocol, a bad answer)."""
    req = DialbackRequest(url, secrets.token_hex(16))
    try:
        data = await host.request(
            peer_id,
            DIALBACK_PROTOCOL,
            req.encode(),
            max_response_bytes=MAX_DIALBACK_BYTES,
            timeout_s=timeout_s,
        )
        return DialbackAnswer.decode(data, peer_id).result
    except ShardnetError as exc:
        log.info("dialback_ask_failed peer=%s error=%s", short_id(peer_id), exc)
        return DialbackResult.FAILED


async def _round(
    host: Host, reach: Reachability, peers: list[str]
) -> list[tuple[DialbackResult, str]]:
    answers: list[tuple[DialbackResult, str]] = []

    async def one(pid: str) -> None:
        answers.append((await ask(host, pid, reach.url, reach.config.ask_timeout_s), pid))

    async with trio.open_nursery() as nursery:
        for pid in peers:
            nursery.start_soon(one, pid)
    return answers


async def keep_reachability(
    host: Host,
    reach: Reachability,
    askers: Callable[[], list[str]],
    on_change: Callable[[], None],
    interfaces: Sequence[Interface] | None = None,
) -> None:
    """Check ``reach.url`` whenever due, forever: ask up to ``reach.config.askers`` of
    ``askers()`` (connected PeerIDs, best first) at once, record the round (each answer
    marked as a neighbour's or not, :func:`~shardcast.core.lan_asker`, from the addresses
    the asker's connections come from and this host's ``interfaces``, read here if None),
    and call ``on_change()`` when the URL to advertise changed. Logs each new state once."""
    nets = interface_subnets() if interfaces is None else interfaces
    public = reach.config.networks()
    while True:
        await trio.sleep(reach.next_due(trio.current_time()))
        got = await _round(host, reach, askers()[: reach.config.askers])
        answers = [a for a, _ in got]
        lan = [lan_asker(reach.url, host.remote_hosts(pid), nets, public) for _, pid in got]
        before = reach.state
        changed = reach.observe(answers, trio.current_time(), lan)
        if answers and (reach.state is not before or reach.rounds == 1):
            log.info(
                "reachability http_url=%s state=%s advertised=%s answers=%s",
                reach.url,
                reach.state.value,
                bool(reach.advertised()),
                ",".join(
                    a.value + ("(lan)" if m else "") for a, m in zip(answers, lan, strict=True)
                ),
            )
        if changed:
            on_change()
