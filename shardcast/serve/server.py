"""serve: serving versions over the HTTP lane: committed ones and ones still filling up.

Routes (``GET``/``HEAD``; paths built by :mod:`shardcast.wire.lane_urls`)::

    /shardnet/v1/<run>/versions                          committed versions and those in
                                                         progress (JSON, with their digests;
                                                         ``?known=`` long-polls it)
    /shardnet/v1/<run>/<step>/<digest>/manifest          the manifest document so far
    /shardnet/v1/<run>/<step>/<digest>/manifest/part/<k> one signed part (waits until it exists)
    /shardnet/v1/<run>/<step>/<digest>/have              one bit per served shard, MSB first
    /shardnet/v1/<run>/<step>/<digest>/files/<name>      file bytes, Range requests (206)
    /shardnet/v1/<run>/<step>/<digest>/shard/<i>/<enc>   an encoded shard blob (zstd, xor-zstd,
                                                         sparse)
    /shardnet/v1/<run>/<step>/<digest>/blobs/<enc>/<i>,.. a batch: several shards' blobs, one
                                                         after the other (at most 64, 8 MiB)
    /shardnet/v1/whoami/<nonce>                          the node's PeerID and its signature of
                                                         the nonce and this URL

A version is ``(step, manifest digest)``: a request for a step this node holds (or fills)
under another digest is answered ``409`` with the digest it holds in
``X-Shardnet-Held-Digest``, one for a step it does not hold ``404``, one in the older
step-only form ``404`` with a one-line explanation (:mod:`shardcast.wire.lane_urls`).

Theory of operation
-------------------
A *live* version is one whose bytes are still arriving: a download (a relay or peer
registers its :class:`~shardcast.store.partial.PartialVersion` as soon as the manifest header is
verified) or the origin's own version while it is still being hashed. A request for a part,
a range or a blob that is not verified yet is answered at once with ``503``, ``Retry-After``
and ``Cache-Control: no-store`` — what an HTTP cache or a plain client understands. A shardnet
downloader may instead ask to be held (request header ``X-Shardnet-Hold-S: <seconds>``, sent by
every node's HTTP client, :data:`HOLD_HEADER`): the request then waits, up to the smaller of
that and ``wait_s``, for the shard to be verified, and receives it the moment it is — so
downstream nodes pipeline from a live relay without polling. Holding is opt-in rather than
tied to an authenticated identity because it grants nothing but a delayed answer (the wait is
bounded and a held request costs one parked connection, which the server bounds anyway).
Unverified bytes are never served, so the lane needs no trust.

Partial shards (the swarm): a download verifies each 1 MiB chunk of a raw shard as it arrives
and writes it at once (:mod:`shardcast.download.receive`); its live version reports the verified
prefix
of every shard (``prefix``). A held file-range request starts as soon as its first byte is
verified and its body then follows the verified prefix: each run of verified bytes is sent
as it appears, and the response waits (up to the hold) for the next chunk, or is cut short
if none comes: the client keeps what arrived and takes the cut, which ends right after a
whole chunk, as this node's late ``503`` (``HOLD_ENDED``: no blame, asked again for the
shard once ``/have`` shows more). A request that is not
held still waits for whole shards, as before. ``/have?prefix=1`` appends to the bitmap the
verified prefix of each shard being received (:func:`encode_prefixes`), so downloaders know
whom to ask. ``/have`` is a long-poll for a held request that names the last answer's token
(``?known=``, :func:`have_token`): it is answered when the bitmap or the set of shards with a
verified prefix changes (at most :data:`HAVE_HOLD_S` later), so downloaders learn of a shard
the moment a source holds or starts it, without polling. A long-poll that also names the
shards its requester lacks (``?want=`` and ``?wknown=``, :func:`wanted_token`) is held until
a change among those: a source does not answer a poller with shards it holds already.

Cache semantics. A version is immutable and content-addressed, so every answer with content
has a strong ``ETag`` taken from the signed manifest: a file's signed whole-file digest, an
encoded blob's signed digest, the manifest digest for the manifest document and its parts.
Committed content also has ``Last-Modified`` (when this node committed the version) and
``Cache-Control: public, max-age=31536000, immutable``; content of a live version is
``no-cache`` (its bytes are final, but the manifest document grows); lists (``versions``,
``have``) are ``no-store``. ``If-Range`` and ``If-None-Match`` are honoured, ``Range`` is decided
as nginx decides it (:func:`p2p.http_range.choose_range`), JSON is ``application/json``.

Origin super-seeding (``serve_once_s``): the origin answers a shard's bytes to the first
requester only; another requester within ``serve_once_s`` gets ``429`` (with ``Retry-After``,
distinct from the ``503`` of "not verified yet", so requesters can count refusals) and fetches
it from a relay that already has it. This keeps the origin's egress near one copy of each version
whatever the number of relays. The requester is the PeerID proven by the request's signed
``X-Shardnet-Auth`` header (:mod:`shardcast.wire.lane_auth`); a request without a valid one is
anonymous (curl, a mirror) and is served from a bounded share without ever reserving a shard,
so it cannot delay the nodes. A requester that names the holder of a shard in
``X-Shardnet-Failed`` (it failed that shard for it) is served at once
(:class:`~shardcast.serve.superseeding.SuperSeeding` rule 6). A ``429`` names the holders of
the refused shards in ``X-Shardnet-Holder`` (at most 4 PeerIDs); a requester with no lane to
one (a node behind a NAT that it cannot punch through) names it in ``X-Shardnet-Unreachable``
on its next request and is served at once, from its own bounded share (rule 11). Older
requesters ignore the holder; older servers ignore the unreachable ones. A version offering at most
``serve_once_min_bytes`` in all (:func:`offered_bytes`: a delta, usually) is served to every
requester (rule 9): a refusal would cost each requester a round trip and the bytes a hop.
Relays super-seed to their downloaders the same way (``shardnet relay``'s default).

Batches (the ``blobs`` route: a next version's delta blobs, several per request) are
streamed: a held batch request is answered as soon as every shard of it is known (its signed
part gives the blob sizes, hence the ``Content-Length``) and its first blob is verified here,
and each later blob goes out the moment it is verified here (a
:class:`~p2p.http_body.StreamedBody`). So a batch is no longer the unit of forwarding through
a relay: the relay's downloader hands each blob of its own batch out as soon as it is whole
(:meth:`~shardcast.download.driver.DownloadDriver.fetch_batch`), and its peers' batches
follow blob by blob. A blob not verified within the request's hold ends the body short (the
requester keeps the whole blobs before it and asks for the rest again).

A version being served is pinned in the store until the response is sent (a streamed batch:
while each of its blobs is read), so retention never deletes a file under a reader.
"""

from __future__ import annotations

import dataclasses
import email.utils
import functools
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from pathlib import Path
from typing import Protocol

import trio

from p2p.http_range import UnsatisfiableRange, choose_range, if_range_holds
from p2p.http_server import FileSlice, HttpRequest, HttpResponse, StreamedBody, file_response
from p2p.identity import Identity
from p2p.trust import TrustList
from shardcast.core import MAX_BATCH_BYTES
from shardcast.serve.superseeding import Requester, SuperSeeding
from shardcast.store import BLOB_DIR, BlobRef, ChainBroken, VersionStore
from shardcast.wire import (
    AUTH_HEADER,
    ENCODINGS,
    FAILED_HEADER,
    HAVE_HOLD_S,
    HAVE_TOKEN_HEADER,
    HELD_DIGEST_HEADER,
    HOLD_HEADER,
    MANIFEST_FILE,
    RAW,
    ROUTE,
    STEP_ONLY_BODY,
    STEP_ONLY_ROUTE,
    UNREACHABLE_HEADER,
    VERSIONS_HOLD_S,
    VERSIONS_ROUTE,
    WHOAMI_ROUTE,
    Manifest,
    decode_want,
    encode_prefixes,
    full_bits,
    have_token,
    holder_header,
    parse_failed,
    parse_shards,
    parse_unreachable,
    shard_bits,
    sign_whoami,
    verify_request,
    versions_token,
    wanted_token,
)

log = logging.getLogger(__name__)

IMMUTABLE = "public, max-age=31536000, immutable"
MAX_BUILT_BYTES = 64 << 20
"""Largest range of a chain version built in memory per request (larger ones of a committed
chain materialize it first), bytes."""
_JSON = "application/json"


class LiveVersion(Protocol):
    """A version whose bytes are still arriving (a download, or the origin hashing).

    Two methods are optional, looked up where used: ``have_bits()`` (its ``/have`` bitmap,
    kept as shards arrive; without it the server makes one :meth:`has` call per shard) and
    ``prefixes()`` (the verified prefixes of shards being received)."""

    manifest: Manifest
    dir: Path

    def has(self, index: int) -> bool:
        """True if shard ``index`` can be served."""
        ...

    def blob_ref(self, index: int, encoding: str) -> BlobRef | None:
        """Where shard ``index``'s ``encoding`` blob is (None: not kept here)."""
        ...


class _Live:
    """A version being received or published, and what its held requests wait for:
    ``progress`` (any new byte: held file ranges follow a growing prefix) and ``changed``
    (its ``/have`` answer may differ: a shard started or completed; long-polls wait on this
    one, so a chunk in the middle of a shard does not make every held ``/have`` rebuild its
    answer)."""

    def __init__(self, version: LiveVersion) -> None:
        self.version = version
        self.digest = version.manifest.digest
        self.progress = trio.Event()
        self.changed = trio.Event()
        self.started: set[int] = set()  # shards seen with a verified prefix or whole
        self.whole: set[int] = set()  # shards seen whole

    def wake(self, shard: int | None = None, whole: bool = False) -> None:
        """Bytes arrived (of ``shard``, whole now if ``whole``; None: unknown, e.g. parts)."""
        self.progress.set()
        self.progress = trio.Event()
        if shard is None or shard not in self.started or (whole and shard not in self.whole):
            if shard is not None:
                self.started.add(shard)
                if whole:
                    self.whole.add(shard)
            self.changed.set()
            self.changed = trio.Event()


class VersionServer:
    """HTTP handler serving one run's versions from a store (see module docstring).

    Args:
        store: the node's version store.
        trust: used to re-verify manifests read back from disk.
        wait_s: longest wait for a part or shard that is not verified yet, seconds.
        serve_once_s: origin super-seeding window, seconds (None: off).
        serve_once_min_bytes: versions offering at most this many bytes in all (a delta,
            usually) are served to every requester, not super-seeded (rule 9 of
            :class:`~shardcast.serve.superseeding.SuperSeeding`).
        clock: wall-clock seconds, for the time window of signed requests.
        identity: the node's key, to answer identity challenges (None: no ``whoami``).
        first_copies_first: refuse repeats while first copies go out (rule 13 of
            :class:`~shardcast.serve.superseeding.SuperSeeding`: the origin's).
    """

    def __init__(
        self,
        store: VersionStore,
        trust: TrustList,
        wait_s: float = 10.0,
        serve_once_s: float | None = None,
        clock: Callable[[], float] = time.time,
        identity: Identity | None = None,
        serve_once_min_bytes: int = 0,
        first_copies_first: bool = False,
    ) -> None:
        self.store = store
        self.trust = trust
        self.wait_s = wait_s
        self.serve_once_s = serve_once_s
        self._live: dict[int, _Live] = {}
        self._versions_changed = trio.Event()
        self._manifests: dict[int, tuple[Manifest, str]] = {}  # step -> (manifest, digest)
        self._seeding = SuperSeeding(
            serve_once_s,
            small_version_bytes=serve_once_min_bytes,
            first_copies_first=first_copies_first,
        )
        self._offered: dict[str, tuple[int, int]] = {}  # digest -> (parts known, offered bytes)
        self._clock = clock
        self.identity = identity
        self.requester_kind: Callable[[str], Requester] | None = None
        """What this node knows of an authenticated requester (PeerID) for super-seeding
        (:class:`~shardcast.serve.superseeding.Requester`); set by a follower from the signed
        adverts it heard (None: every requester is :attr:`Requester.SERVING`). The kinds are
        the requester's own claims: one that lies is served as if this node did not
        super-seed to it (sibling) or without holding anything (download-only), which costs
        efficiency, never integrity."""
        self.bytes_by_step: dict[int, int] = {}
        """Body bytes of GET responses started, per step (what was promised, for reports)."""
        self.sent_by_codec: dict[str, int] = {}
        """Shard bytes actually sent, by codec (``raw`` file ranges, encoded blobs)."""

    # -- registration -----------------------------------------------------------------------

    def add_live(self, version: LiveVersion) -> None:
        """Start serving a version whose bytes are still arriving."""
        self._live[version.manifest.step] = _Live(version)
        self.versions_changed()

    def progress(self, step: int, shard: int | None = None) -> None:
        """New bytes of ``step`` are available (of ``shard``, if given: a verified chunk, or
        the shard whole; None: parts or shards, unspecified): wake waiting requests."""
        live = self._live.get(step)
        if live is not None:
            live.wake(shard, shard is not None and self._has(step, shard))

    def live_done(self, step: int) -> None:
        """The live version was committed or aborted: serve it from the store from now on."""
        live = self._live.pop(step, None)
        self._manifests.pop(step, None)  # the committed one may differ from a cached older one
        if live is not None:
            live.wake()
        self.versions_changed()

    def holder_gone(self, peer_id: str) -> None:
        """``peer_id``'s last libp2p connection closed: it no longer holds super-seeded
        shards (:class:`shardcast.serve.superseeding.SuperSeeding` rule 8)."""
        self._seeding.holder_gone(peer_id, trio.current_time())

    @property
    def refused_once(self) -> int:
        """Requests refused by super-seeding so far."""
        return self._seeding.refused

    def in_progress(self) -> list[int]:
        """Steps being filled."""
        return sorted(self._live)

    # -- lookups ----------------------------------------------------------------------------

    def _manifest(self, step: int) -> tuple[Manifest, str] | None:
        """The manifest of the version of ``step`` served now, and its digest."""
        live = self._live.get(step)
        if live is not None:
            return live.version.manifest, live.digest
        held = self.store.digest_of(step)
        if held is None:
            self._manifests.pop(step, None)
            return None
        cached = self._manifests.get(step)
        if cached is None or cached[1] != held:  # first use, or the step was replaced
            try:
                m = self.store.load_manifest(step, self.trust)
            except (OSError, ValueError) as exc:
                log.warning("manifest_unreadable step=%d error=%s", step, exc)
                return None
            cached = self._manifests[step] = (m, m.digest)
        return cached

    def versions(self) -> list[tuple[int, str]]:
        """``(step, digest)`` of the committed versions served and those being filled."""
        out = dict(self.store.committed_versions())
        out.update((step, live.digest) for step, live in self._live.items())
        return sorted(out.items())

    def _has(self, step: int, index: int) -> bool:
        live = self._live.get(step)
        return self.store.has(step) if live is None else live.version.has(index)

    async def _wait(self, req: HttpRequest, step: int, ready: Callable[[], bool]) -> bool:
        """Wait until ``ready()``, for as long as the request asked to be held (at most
        ``wait_s``; not at all without :data:`HOLD_HEADER`). False on timeout or if the version
        vanished."""
        return await self._wait_until(step, ready, trio.current_time() + _hold_s(req, self.wait_s))

    async def _wait_until(self, step: int, ready: Callable[[], bool], deadline: float) -> bool:
        """Wait until ``ready()`` or ``deadline`` (seconds, trio's clock), as :meth:`_wait`."""
        while not ready():
            live = self._live.get(step)
            if live is None:
                return bool(ready())
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                return False
            with trio.move_on_after(remaining):
                await live.progress.wait()
        return True

    # -- the handler ------------------------------------------------------------------------

    async def handle(self, req: HttpRequest) -> HttpResponse:
        """Answer one HTTP request (see the routes in the module docstring)."""
        if req.method not in ("GET", "HEAD"):
            return HttpResponse(405, [("allow", "GET, HEAD")])
        mw = WHOAMI_ROUTE.match(req.path)
        if mw and self.identity is not None:
            host = req.headers.get("host", "")
            body = sign_whoami(self.identity, mw["nonce"], f"http://{host}")
            return HttpResponse(200, [("content-type", "text/plain")], body)
        mv = VERSIONS_ROUTE.match(req.path)
        if mv:
            if mv["run"] != self.store.run_id:
                return HttpResponse(404)
            return await self._versions(req)
        mr = ROUTE.match(req.path)
        if not mr or mr["run"] != self.store.run_id:
            if STEP_ONLY_ROUTE.match(req.path):  # an older node: clean "not held", no blame
                return HttpResponse(404, [("content-type", "text/plain")], STEP_ONLY_BODY)
            return HttpResponse(404)
        step = int(mr["step"])
        held = self._manifest(step)
        if held is None:
            return HttpResponse(404)
        m, digest = held
        if digest != mr["digest"]:
            return HttpResponse(409, [(HELD_DIGEST_HEADER, digest), _NO_STORE])
        if mr["kind"] == "manifest":
            if step in self._live or not m.complete:
                return HttpResponse(200, [("content-type", _JSON), _NO_CACHE], m.encode())
            return self._document(req, step, m.encode(), f'"{m.digest}"')
        if mr["kind"] == "have":
            return await self._have(req, step, m)
        if mr["part"] is not None:
            k = int(mr["part"])
            if k >= m.header.n_parts:
                return HttpResponse(404)
            if not await self._wait(req, step, lambda: k in m.parts):
                return _retry()
            part = m.parts[k]
            ctype = _JSON if part.legacy else "application/cbor"  # a p2p.envelope
            return self._document(req, step, part.encode(), f'"{m.digest}.p{k}"', ctype)
        if mr["shard"] is not None:
            return await self._blob(req, step, m, int(mr["shard"]), mr["enc"])
        if mr["benc"] is not None:
            return await self._blobs(req, step, m, mr["shards"], mr["benc"])
        return await self._file(req, step, m, mr["name"] or "")

    async def _versions(self, req: HttpRequest) -> HttpResponse:
        """``/versions``; with ``?known=TOKEN`` and :data:`HOLD_HEADER`, a long-poll: held
        (at most :data:`VERSIONS_HOLD_S` and ``wait_s``) until the set of versions served
        differs from the one ``TOKEN`` names (:func:`versions_token`). The answer's
        ``hold_s`` says how long this node holds such a request (a client that sees none
        is talking to an older node, which answers at once)."""
        hold_s = min(_hold_s(req, self.wait_s), VERSIONS_HOLD_S)
        known = req.query.get("known")
        versions = self.versions()
        digests = {str(s): d for s, d in versions}
        if known is not None and hold_s > 0:
            with trio.move_on_after(hold_s):
                while versions_token(digests) == known:
                    await self._versions_changed.wait()
                    versions = self.versions()
                    digests = {str(s): d for s, d in versions}
        body = json.dumps(
            {
                "committed": [s for s, _ in versions if s not in self._live],
                "in_progress": self.in_progress(),
                "digests": digests,
                "hold_s": VERSIONS_HOLD_S,
            }
        ).encode()
        return HttpResponse(200, [("content-type", _JSON), _NO_STORE], body)

    def versions_changed(self) -> None:
        """The set of versions served may have changed (one added, committed, replaced or
        removed): answer the held ``/versions`` long-polls."""
        self._versions_changed.set()
        self._versions_changed = trio.Event()

    def _have_now(
        self, req: HttpRequest, step: int, m: Manifest
    ) -> tuple[bytes, bytes, dict[int, int]]:
        """The ``/have`` body now (with the verified prefixes if asked), its bitmap and the
        verified prefixes (bytes) of the shards being received here."""
        bits = self._have_bits(step, m)
        live = self._live.get(step)
        prefixes: dict[int, int] = {}
        if live is not None:
            get = getattr(live.version, "prefixes", None)
            prefixes = get() if get is not None else {}
        body = bits + encode_prefixes(prefixes) if req.query.get("prefix") == "1" else bits
        return body, bits, prefixes

    async def _have(self, req: HttpRequest, step: int, m: Manifest) -> HttpResponse:
        """``/have``; with ``?known=TOKEN`` and :data:`HOLD_HEADER`, a long-poll: held (at
        most :data:`HAVE_HOLD_S`) until the answer's token differs from ``TOKEN``. With
        ``?want=`` (the shards the requester lacks) and ``?wknown=``, held instead until
        the answer's :func:`~shardcast.wire.have.wanted_token` differs from ``wknown``: news
        for the requester. ``400`` for a ``want`` that is not a bitmap of this version."""
        want: bytes | None = None
        if "want" in req.query and "wknown" in req.query:
            try:
                want = decode_want(req.query["want"], len(m.header.shards))
            except ValueError:
                return HttpResponse(400)

        def key(bits: bytes, prefixes: dict[int, int]) -> str:
            if want is None:
                return have_token(bits, prefixes)
            return wanted_token(bits, prefixes, want)

        body, bits, prefixes = self._have_now(req, step, m)
        known = req.query.get("known") if want is None else req.query.get("wknown")
        if known is not None and key(bits, prefixes) == known and step in self._live:
            deadline = trio.current_time() + min(_hold_s(req, self.wait_s), HAVE_HOLD_S)
            while key(bits, prefixes) == known and step in self._live:
                remaining = deadline - trio.current_time()
                if remaining <= 0:
                    break
                with trio.move_on_after(remaining):
                    await self._live[step].changed.wait()
                held = self._manifest(step)
                if held is None or held[1] != m.digest:
                    break
                body, bits, prefixes = self._have_now(req, step, m)
        headers = [("content-type", "application/octet-stream"), _NO_STORE]
        token = have_token(bits, prefixes)
        return HttpResponse(200, [*headers, (HAVE_TOKEN_HEADER, token)], body)

    def _validators(self, step: int) -> tuple[str | None, list[tuple[str, str]]]:
        """``(Last-Modified, cache headers)`` of version ``step`` as served now."""
        if step in self._live:
            return None, [_NO_CACHE]
        try:
            mtime = (self.store.version_dir(step) / MANIFEST_FILE).stat().st_mtime
        except OSError:
            return None, [_NO_CACHE]
        return email.utils.formatdate(mtime, usegmt=True), [("cache-control", IMMUTABLE)]

    def _document(
        self, req: HttpRequest, step: int, body: bytes, etag: str, content_type: str = _JSON
    ) -> HttpResponse:
        """A small immutable document (a complete manifest or a part) with validators."""
        last_modified, cache = self._validators(step)
        headers = [("content-type", content_type), ("etag", etag), *cache]
        if last_modified is not None:
            headers.append(("last-modified", last_modified))
        inm = req.headers.get("if-none-match", "")
        if etag in (t.strip() for t in inm.split(",")) or inm.strip() == "*":
            return HttpResponse(304, [h for h in headers if h[0] != "content-type"])
        return HttpResponse(200, headers, body)

    def _have_bits(self, step: int, m: Manifest) -> bytes:
        """The ``/have`` bitmap of ``step`` now: a live version's own (``have_bits()``,
        O(shards / 8)) where it keeps one, else one :meth:`_has` per shard."""
        n = len(m.header.shards)
        live = self._live.get(step)
        if live is None:
            return full_bits(n) if self.store.has(step) else bytes((n + 7) // 8)
        kept = getattr(live.version, "have_bits", None)
        return kept() if kept is not None else shard_bits(n, live.version.has)

    def _refuse_repeat(
        self, req: HttpRequest, step: int, m: Manifest, shards: Iterable[int]
    ) -> HttpResponse | None:
        """Origin super-seeding (:class:`shardcast.serve.superseeding.SuperSeeding`): the
        ``429`` to answer if these shards must be fetched from another node (naming their
        holders), else None."""
        if self.serve_once_s is None:
            return None
        requester = verify_request(req.headers.get(AUTH_HEADER), req.path, self._clock())
        kind = Requester.SERVING
        if requester is not None and self.requester_kind is not None:
            kind = self.requester_kind(requester)
        decision = self._seeding.decide(
            requester,
            step,
            shards,
            trio.current_time(),
            len(m.header.shards),
            failed=parse_failed(req.headers.get(FAILED_HEADER)) if requester else (),
            version_bytes=self._offered_bytes(m),
            kind=kind,
            unreachable=parse_unreachable(req.headers.get(UNREACHABLE_HEADER)) if requester else (),
        )
        return None if decision.allowed else _refused(decision.holders)

    def _offered_bytes(self, m: Manifest) -> int:
        """What version ``m`` offers in all, bytes: per shard its smallest encoding (raw
        length where its part has not arrived yet)."""
        cached = self._offered.get(m.digest)
        if cached is not None and cached[0] == len(m.parts):  # it changes as parts arrive
            return cached[1]
        total = offered_bytes(m)  # O(shards): once per version and number of parts known
        self._offered[m.digest] = (len(m.parts), total)
        while len(self._offered) > 64:
            self._offered.pop(next(iter(self._offered)))
        return total

    async def _file(self, req: HttpRequest, step: int, m: Manifest, name: str) -> HttpResponse:
        try:
            entry = m.header.file(name)
        except KeyError:
            return HttpResponse(404)
        digest = m.file_digest(name)
        etag = f'"{digest}"' if digest is not None else f'"{m.digest}.{name}"'
        last_modified, cache = self._validators(step)
        first, last = 0, entry.size - 1
        value = req.headers.get("range")
        if value is not None and "if-range" in req.headers:
            if not if_range_holds(req.headers["if-range"], etag, last_modified):
                value = None
        try:
            chosen = choose_range(value, entry.size)
        except UnsatisfiableRange:
            chosen = (0, 0)  # file_response answers 416 without touching any shard
        if chosen is not None:
            first, last = chosen[0], chosen[0] + chosen[1] - 1
        if entry.size and last >= first:
            base = m.header.first_shard(name)
            shards = range(
                base + first // m.header.shard_size, base + last // m.header.shard_size + 1
            )
        else:
            shards = range(0)
        live = self._live.get(step)
        ready = None
        if self._chained(step, live, name, shards):  # bytes built from blobs, verified
            if not await self._wait(req, step, lambda: all(self._has(step, i) for i in shards)):
                return _retry()
            if (refused := self._refuse_repeat(req, step, m, shards)) is not None:
                return refused
            return await self._built(req, step, name, entry.size, etag, last_modified, cache)
        if live is not None and shards and _hold_s(req, self.wait_s) > 0:
            # stream the verified prefix as it grows (module docstring): start at the first byte
            start, stop = first, last + 1

            def servable() -> bool:
                return self._servable_end(step, m, name, start, stop) > start

            if not await self._wait(req, step, servable):
                return _retry()

            async def ready_fn(pos: int) -> int:
                ok = await self._wait(
                    req, step, lambda: self._servable_end(step, m, name, pos, stop) > pos
                )
                return self._servable_end(step, m, name, pos, stop) if ok else pos

            ready = ready_fn
        elif not await self._wait(req, step, lambda: all(self._has(step, i) for i in shards)):
            return _retry()
        if (refused := self._refuse_repeat(req, step, m, shards)) is not None:
            return refused
        committed = self.store.version_dir(step) / name
        return self._slice(
            req,
            step,
            RAW,
            entry.size,
            live.version.dir / name if live is not None else committed,
            committed,
            etag=etag,
            last_modified=last_modified,
            headers=cache,
            content_type=_JSON if name.endswith(".json") else "application/octet-stream",
            ready=ready,
        )

    def _chained(self, step: int, live: _Live | None, name: str, shards: range) -> bool:
        """True if some bytes of ``shards`` (of file ``name``) are kept as delta blobs, not
        in a file: a version kept as a chain (:mod:`shardcast.store.chains`)."""
        if live is None:
            return name in self.store.chained_files(step)
        in_file = getattr(live.version, "in_file", None)
        return in_file is not None and not all(in_file(i) for i in shards)

    async def _built(
        self,
        req: HttpRequest,
        step: int,
        name: str,
        size: int,
        etag: str,
        last_modified: str | None,
        cache: list[tuple[str, str]],
    ) -> HttpResponse:
        """A range of a chain version's file, built shard by shard and verified before any
        byte is sent (:meth:`~shardcast.store.store.VersionStore.read_file_range`); a range
        over :data:`MAX_BUILT_BYTES` of a committed chain materializes it first and is sent
        from the file. A shard that does not verify is never sent (the store removes the
        version; ``404``)."""
        ctype = _JSON if name.endswith(".json") else "application/octet-stream"
        resp = file_response(
            req, Path(name), size, content_type=ctype, headers=cache, etag=etag,
            last_modified=last_modified,
        )  # fmt: skip
        if not isinstance(resp.body, FileSlice):
            return resp
        sl, live = resp.body, self._live.get(step)
        try:
            if sl.length > MAX_BUILT_BYTES and live is None:
                await trio.to_thread.run_sync(self.store.materialize, step)
                path = self.store.version_dir(step) / name
                return self._slice(
                    req, step, RAW, size, path, path, etag=etag, last_modified=last_modified,
                    headers=cache, content_type=ctype,
                )  # fmt: skip
            if sl.length > MAX_BUILT_BYTES:
                return _retry()
            read = live.version.read_file_range if live is not None else None  # type: ignore[attr-defined]
            with self.store.pinned(step):
                if read is None:
                    data = await trio.to_thread.run_sync(
                        self.store.read_file_range, step, name, sl.offset, sl.length
                    )
                else:
                    data = await trio.to_thread.run_sync(read, name, sl.offset, sl.length)
        except ChainBroken as exc:
            log.error("chain_read_refused step=%d file=%s error=%s", step, name, exc)
            return HttpResponse(404 if live is None else 503, [_NO_STORE])
        if req.method == "GET" and resp.status < 300:
            self.bytes_by_step[step] = self.bytes_by_step.get(step, 0) + len(data)
            self.sent_by_codec[RAW] = self.sent_by_codec.get(RAW, 0) + len(data)
        return dataclasses.replace(resp, body=data)

    def _servable_end(self, step: int, m: Manifest, name: str, pos: int, stop: int) -> int:
        """Where the run of verified bytes of file ``name`` from ``pos`` ends (at most
        ``stop``): whole shards held, then the verified prefix of the next one."""
        live = self._live.get(step)
        if live is None:  # committed meanwhile (every byte verified) or dropped (none)
            return stop if self.store.digest_of(step) == m.digest else pos
        prefix = getattr(live.version, "prefix", None)
        base, size = m.header.first_shard(name), m.header.shard_size
        end = pos
        while end < stop:
            i = base + end // size
            shard_start = end - end % size
            length = m.header.shards[i].length
            n = length if live.version.has(i) else (prefix(i) if prefix is not None else 0)
            if shard_start + n <= end:
                break
            end = min(stop, shard_start + n)
            if n < length:
                break
        return end

    def _blob_ref(self, step: int, index: int, encoding: str) -> tuple[BlobRef, Path] | None:
        """Where the ``encoding`` blob of shard ``index`` of ``step`` is: in the version's
        live directory while it is arriving (else the committed one), and the same file in
        the committed directory (the live directory is renamed to it at the commit, the
        blob at the same offset); None if this node does not keep it."""
        live = self._live.get(step)
        ref = live.version.blob_ref(index, encoding) if live is not None else None
        if ref is None:
            ref = self.store.blob_ref(step, index, encoding)
        if ref is None:
            return None
        return ref, self.store.version_dir(step) / BLOB_DIR / ref.path.name

    async def _blob(
        self, req: HttpRequest, step: int, m: Manifest, index: int, encoding: str
    ) -> HttpResponse:
        if index >= len(m.header.shards):
            return HttpResponse(404)
        if not await self._wait(req, step, lambda: m.known(index) and self._has(step, index)):
            return _retry()
        offered = m.shard(index).offered(encoding)
        if offered is None:
            return HttpResponse(404)
        found = self._blob_ref(step, index, encoding)
        if found is None or found[0].length != offered.size:
            return HttpResponse(404)  # this node did not keep that encoding
        ref, committed = found
        if (refused := self._refuse_repeat(req, step, m, range(index, index + 1))) is not None:
            return refused
        last_modified, cache = self._validators(step)
        return self._slice(
            req,
            step,
            encoding,
            offered.size,
            ref.path,
            committed,
            base=ref.offset,
            etag=f'"{offered.digest}"',
            last_modified=last_modified,
            headers=cache,
        )

    async def _blobs(
        self, req: HttpRequest, step: int, m: Manifest, listed: str, encoding: str
    ) -> HttpResponse:
        """A batch (:func:`~shardcast.wire.lane_urls.blobs_url`): the ``encoding`` blobs of
        ``shards``, one after the other, each exactly its signed size (the requester splits
        the body by the sizes its manifest lists and checks each blob against its signed
        digest as soon as it is whole).

        Streamed (module docstring): a held request is answered once every shard of the
        batch is known (its manifest part, for the sizes) and the first is verified here;
        each later blob is sent the moment it is verified here, within the request's hold,
        and the body is cut short right after the last blob sent if one is not (the requester
        keeps the whole blobs before it, and takes the cut as this node's late ``503`` for the
        rest: :func:`~shardcast.core.batch.cut_between_blobs`). A request that is not held
        is answered only with every blob verified. ``404`` if a shard is not offered in
        ``encoding`` or the first blobs are not kept here (the requester then asks one blob
        at a time); ``413`` above
        :data:`~shardcast.core.batch.MAX_BATCH_BYTES`; super-seeding decides for the batch as
        a whole; ``400`` for a shard named twice in ``listed`` (the route's ``i,j,..``)."""
        try:
            shards = parse_shards(listed)
        except ValueError:
            return HttpResponse(400)
        n = len(m.header.shards)
        if not shards or any(i >= n for i in shards):
            return HttpResponse(404)
        hold_s = _hold_s(req, self.wait_s)
        deadline = trio.current_time() + hold_s  # for the whole body (_blob_pieces)
        first = shards[:1] if hold_s > 0 else shards  # not held: every blob, as before
        if not await self._wait_until(
            step,
            lambda: all(m.known(i) for i in shards) and all(self._has(step, i) for i in first),
            deadline,
        ):
            return _retry()
        sizes = []
        for i in shards:
            offered = m.shard(i).offered(encoding)
            if offered is None:
                return HttpResponse(404)
            sizes.append(offered.size)
        if sum(sizes) > MAX_BATCH_BYTES:
            return HttpResponse(413)
        if (refused := self._refuse_repeat(req, step, m, shards)) is not None:
            return refused
        head = await self._read_held(step, shards, sizes, encoding)
        if head is None:
            return HttpResponse(404)  # this node did not keep that encoding of a shard
        last_modified, cache = self._validators(step)
        headers = [("content-type", "application/octet-stream"), *cache]
        if last_modified is not None:
            headers.append(("last-modified", last_modified))
        if req.method == "GET":
            self.bytes_by_step[step] = self.bytes_by_step.get(step, 0) + sum(sizes)

        def sent(count: int) -> None:
            self.sent_by_codec[encoding] = self.sent_by_codec.get(encoding, 0) + count

        pieces = self._blob_pieces(step, shards, sizes, encoding, head, deadline)
        return HttpResponse(200, headers, StreamedBody(sum(sizes), pieces, on_sent=sent))

    async def _blob_pieces(
        self,
        step: int,
        shards: list[int],
        sizes: list[int],
        encoding: str,
        head: tuple[int, bytes],
        deadline: float,
    ) -> AsyncGenerator[bytes, None]:
        """A batch's body (:meth:`_blobs`): ``head`` (its first ``head[0]`` blobs, read), then
        each run of blobs verified here, read as it appears; it ends early (the server cuts
        the body short) if the next blob is not verified by ``deadline`` (seconds, trio's
        clock), the version is gone, or this node did not keep the blob."""
        done, data = head
        yield data
        while done < len(shards):
            held = functools.partial(self._has, step, shards[done])
            if not await self._wait_until(step, held, deadline):
                return
            got = await self._read_held(step, shards[done:], sizes[done:], encoding)
            if got is None:
                return
            done += got[0]
            yield got[1]

    async def _read_held(
        self, step: int, shards: list[int], sizes: list[int], encoding: str
    ) -> tuple[int, bytes] | None:
        """Read the leading run of ``shards`` whose blobs are verified here (at least the
        first, which must be), in one worker-thread hop: ``(count, bytes)``, or None if this
        node did not keep one of them in ``encoding`` (or its size is not ``sizes``')."""
        count = 1
        while count < len(shards) and self._has(step, shards[count]):
            count += 1
        refs = [self._blob_ref(step, i, encoding) for i in shards[:count]]
        with self.store.pinned(step):
            body = await trio.to_thread.run_sync(_read_blobs, refs, sizes[:count])
        return None if body is None else (count, body)

    def _slice(
        self,
        req: HttpRequest,
        step: int,
        codec: str,
        size: int,
        primary: Path,
        committed: Path,
        *,
        etag: str,
        last_modified: str | None,
        headers: list[tuple[str, str]],
        content_type: str = "application/octet-stream",
        ready: Callable[[int], Awaitable[int]] | None = None,
        base: int = 0,
    ) -> HttpResponse:
        """A (ranged) file response for ``primary`` (the representation starting at its byte
        ``base``), falling back to the committed path if the live directory was renamed
        meanwhile, with the step pinned until it is sent."""
        resp = file_response(
            req,
            primary,
            size,
            content_type=content_type,
            headers=headers,
            etag=etag,
            last_modified=last_modified,
        )
        if not isinstance(resp.body, FileSlice):
            return resp
        pin = self.store.pinned(step)
        pin.__enter__()

        def release() -> None:
            pin.__exit__(None, None, None)

        def sent(n: int) -> None:
            self.sent_by_codec[codec] = self.sent_by_codec.get(codec, 0) + n

        body = dataclasses.replace(
            resp.body, fallbacks=(committed,), on_done=release, on_sent=sent, ready=ready, base=base
        )
        if req.method == "GET" and resp.status < 300:
            self.bytes_by_step[step] = self.bytes_by_step.get(step, 0) + body.length
        return dataclasses.replace(resp, body=body)


_NO_STORE = ("cache-control", "no-store")
_NO_CACHE = ("cache-control", "no-cache")


def offered_bytes(m: Manifest) -> int:
    """Bytes a downloader of ``m`` fetches: each shard's smallest offered form. While parts
    are missing (a version still being published), the shards not known yet are counted at
    the ratio of the known ones (a delta's first part already tells it is small); with no
    part at all, at their raw length."""
    known = smallest = unknown = 0
    for i, ref in enumerate(m.header.shards):
        if m.known(i):
            known += ref.length
            smallest += min([ref.length, *(e.size for e in m.shard(i).encodings)])
        else:
            unknown += ref.length
    if not known:
        return unknown
    return smallest + -(-unknown * smallest // known)


def _read_blobs(refs: list[tuple[BlobRef, Path] | None], sizes: list[int]) -> bytes | None:
    """The blobs at ``refs`` (each where it lies, then at the same offset of the committed
    path if the live directory was renamed meanwhile) concatenated, or None if one is not
    kept, missing or not its size. Blocking: run it in a worker thread."""
    out = bytearray()
    for found, size in zip(refs, sizes, strict=True):
        if found is None or found[0].length != size:
            return None
        ref, committed = found
        for at in (ref, dataclasses.replace(ref, path=committed)):
            try:
                data = at.read()
            except FileNotFoundError:
                continue
            break
        else:
            return None
        if len(data) != size:
            return None
        out += data
    return bytes(out)


def _retry() -> HttpResponse:
    return HttpResponse(503, [("retry-after", "1"), _NO_STORE])


def _hold_s(req: HttpRequest, limit_s: float) -> float:
    """How long the request may be held: its :data:`HOLD_HEADER` capped at ``limit_s``."""
    try:
        asked = float(req.headers.get(HOLD_HEADER, "0"))
    except ValueError:
        return 0.0
    return max(0.0, min(asked, limit_s)) if asked == asked else 0.0


def _refused(holders: tuple[str, ...] = ()) -> HttpResponse:
    """Super-seeding: fetch these bytes from another node (429 + Retry-After), naming the
    nodes that hold them (``X-Shardnet-Holder``, none for an anonymous requester)."""
    return HttpResponse(429, [("retry-after", "1"), *holder_header(holders)])


OFFERED_ENCODINGS = tuple(e for e in ENCODINGS if e != RAW)
