"""download: a version's manifest document, and the chain of delta manifests below it.

Theory of operation
-------------------
A follower learns of a version as ``(step, manifest digest)`` from a trainer-signed
announcement; before downloading it needs the manifest document (its signed header and the
parts signed so far). :func:`fetch_manifest` asks each source in turn (its upstreams, then the
static mirrors that list the version) and keeps the first document that decodes against the
pinned trainer (:meth:`shardcast.wire.Manifest.decode`: every signature checked) and names the
very run, step and digest asked for; a source that does not hold it is skipped quietly, one
that fails or answers something else is logged with its short PeerID. Between rounds it waits
:func:`shardcast.core.manifest_retry_s` (capped), until the caller gives up or a deadline.

A delta version names its base by step and digest: :func:`fetch_chain` walks those links down
from a target, fetching each base manifest by the digest its child names, so the catch-up plan
(:func:`shardcast.core.plan`) and the decision to abandon a superseded download
(:func:`shardcast.core.abandons`) see exactly the chain the trainer signed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import trio

from p2p.errors import ShardnetError, TransportError, short_id
from p2p.http_errors import NotAvailable
from p2p.lanes import HttpLaneClient
from p2p.trust import TrustList
from shardcast.core import manifest_retry_s
from shardcast.download.types import Source
from shardcast.wire import MAX_MANIFEST_BYTES, Manifest, manifest_url

log = logging.getLogger(__name__)

__all__ = ["MAX_CHAIN", "fetch_chain", "fetch_manifest"]

#: seconds one source may take to answer a manifest request
MANIFEST_TIMEOUT_S = 10.0
#: the longest delta chain walked below a target (links)
MAX_CHAIN = 32


async def fetch_manifest(
    client: HttpLaneClient,
    trust: TrustList,
    sources: Callable[[], list[Source]],
    run_id: str,
    step: int,
    digest: str,
    give_up: Callable[[], bool],
    timeout_s: float | None = None,
) -> Manifest | None:
    """The manifest document of version ``(step, digest)`` of ``run_id`` from any of
    ``sources()`` (read at each round) that holds it; its parts may be missing.

    Args:
        client: the node's lane client.
        trust: the pinned trainer every signature is checked against.
        digest: the header digest (from a signed announcement, or the base digest a newer
            version names).
        give_up: polled between rounds; True abandons the fetch (returns None).
        timeout_s: give up after this long too, seconds (None: only ``give_up``).

    Returns:
        the verified manifest, or None if abandoned.
    """
    attempt = 0
    until = None if timeout_s is None else trio.current_time() + timeout_s
    while True:
        for src in sources():
            url = manifest_url(src.base_url, run_id, step, digest)
            try:
                data = await client.get_bytes(
                    url,
                    max_bytes=MAX_MANIFEST_BYTES,
                    timeout_s=MANIFEST_TIMEOUT_S,
                    anonymous=src.anonymous,
                )
                m = Manifest.decode(data, trust=trust, source=src.id)
            except NotAvailable:
                continue
            except (TransportError, ShardnetError) as exc:
                log.warning(
                    "manifest_fetch_failed source=%s step=%d error=%s",
                    short_id(src.id),
                    step,
                    exc,
                )
                continue
            if m.step != step or m.run_id != run_id or m.digest != digest:
                log.warning("manifest_mismatch source=%s step=%d", short_id(src.id), step)
                continue
            return m
        if give_up() or (until is not None and trio.current_time() >= until):
            return None
        await trio.sleep(manifest_retry_s(attempt))
        attempt += 1


async def fetch_chain(
    fetch: Callable[[str, int, str], Awaitable[Manifest | None]],
    target: Manifest,
    down_to: int,
) -> dict[int, Manifest]:
    """Manifests of the delta chain below ``target``, newest first, by the base digest each
    link names, down to (not including) step ``down_to``; at most :data:`MAX_CHAIN` links.
    Stops at an anchor (no base), a gap, or a manifest no source has.

    Args:
        fetch: ``(run_id, step, digest)`` -> that manifest, or None (one round of
            :func:`fetch_manifest`).
    """
    chain: dict[int, Manifest] = {}
    link = target
    while len(chain) < MAX_CHAIN:
        h = link.header
        if h.base_step is None or h.base_digest is None or h.base_step != link.step - 1:
            break
        if h.base_step <= down_to:
            break
        got = await fetch(target.run_id, h.base_step, h.base_digest)
        if got is None:
            break
        chain[got.step] = link = got
    return chain
