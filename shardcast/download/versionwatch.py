"""download: the trio driver of one upstream's ``/versions`` long-poll.

Theory of operation
-------------------
:func:`watch_versions` asks the upstream's HTTP lane for its list of versions, naming the
last answer's token (``?known=TOKEN``, :func:`~shardcast.wire.have.versions_token`): the
upstream holds the request until the list changes (a version added, committed or removed),
at most :data:`~shardcast.wire.have.VERSIONS_HOLD_S`. Each answer goes to the pure
:class:`~shardcast.core.pollpolicy.VersionWatch`, which says whether to wake the follower's
info poll of that upstream (the list changed: a new version is there, and its signed
announcement comes with the poll) and when to ask again. An older node answers at once and
without ``hold_s``: the watch then stops and the follower keeps polling every second.

Nothing here is trusted: the list only decides *when* the follower polls; what it learns
still comes signed in the info record. Memory: one answer at a time, at most
:data:`MAX_VERSIONS_BYTES`; every request has a timeout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from p2p.errors import LocalProtocolError, RemoteProtocolError, TransportError, short_id
from p2p.lanes import HttpLaneClient
from shardcast.core import VersionWatch
from shardcast.wire import VERSIONS_HOLD_S, loads_untrusted, versions_token, versions_url

log = logging.getLogger(__name__)

__all__ = ["MAX_VERSIONS_BYTES", "parse_versions", "watch_versions"]

MAX_VERSIONS_BYTES = 1 << 20
"""Largest ``/versions`` answer read, bytes."""


def parse_versions(data: bytes, source: str = "") -> tuple[str, bool]:
    """The token of a ``/versions`` answer and whether its node holds these requests (it
    names ``hold_s``).

    Raises:
        RemoteProtocolError: not a JSON object whose ``digests`` maps strings to strings.
    """
    try:
        doc = loads_untrusted(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RemoteProtocolError(source, f"versions: not JSON ({exc})") from exc
    digests = doc.get("digests") if isinstance(doc, dict) else None
    if not isinstance(digests, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in digests.items()
    ):
        raise RemoteProtocolError(source, "versions: no digests object")
    return versions_token(digests), isinstance(doc.get("hold_s"), int | float)


async def watch_versions(
    client: HttpLaneClient,
    peer_id: str,
    base_url: str,
    run_id: str,
    watch: VersionWatch,
    wake: Callable[[], None],
    settled: Callable[[], bool],
) -> None:
    """Long-poll ``base_url``'s ``/versions`` until cancelled; returns when it turns out not
    to hold such requests, or its URL cannot be used (malformed: the upstream's info record
    named it). ``wake`` is called when the list changed or the watch broke;
    ``watch.watching`` says whether the follower may poll seldom now.

    Cancellation closes the request in flight; nothing else is left behind.
    """
    url = versions_url(base_url, run_id)
    while True:
        query = "" if watch.token is None else f"?known={watch.token}"
        try:
            data = await client.get_bytes(
                url + query, max_bytes=MAX_VERSIONS_BYTES, timeout_s=VERSIONS_HOLD_S + 10.0
            )
            step = watch.answered(*parse_versions(data, peer_id))
        except LocalProtocolError as exc:  # a URL the client cannot use: it will not improve
            log.info("versions_watch_unusable upstream=%s error=%s", short_id(peer_id), exc)
            return
        except (TransportError, RemoteProtocolError) as exc:  # 404 etc. are transport errors
            step = watch.failed(settled())
            log.debug("versions_watch_failed upstream=%s error=%s", short_id(peer_id), exc)
        if step.wake:
            wake()
        if step.again_s is None:
            log.info("versions_watch_unsupported upstream=%s", short_id(peer_id))
            return
        await trio.sleep(step.again_s)
