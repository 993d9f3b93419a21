"""Serving versions over the HTTP lane: committed ones and ones still filling up.

Routes (``GET``/``HEAD``)::

    /shardnet/v1/<run>/versions                   committed steps and those in progress (JSON)
    /shardnet/v1/<run>/<step>/manifest            the manifest document so far (header + parts)
    /shardnet/v1/<run>/<step>/manifest/part/<k>   one signed part (waits until it exists)
    /shardnet/v1/<run>/<step>/have                one bit per served shard, MSB of byte 0 first
    /shardnet/v1/<run>/<step>/files/<name>        file bytes, Range requests (206)
    /shardnet/v1/<run>/<step>/shard/<i>/<enc>     an encoded shard blob (zstd, xor-zstd), Range

Theory of operation
-------------------
A *live* version is one whose bytes are still arriving: a download (a relay or peer
registers its :class:`~shardcast.store.PartialVersion` as soon as the manifest header is
verified) or the origin's own version while it is still being hashed. A request for a part,
a range or a blob that is not verified yet waits (up to ``wait_s``) for progress, then gets
``503`` with ``Retry-After``; so downstream nodes can ask for shard *i* before this node has it
and receive it the moment it is verified — pipelining without polling. Unverified bytes are
never served, so the lane needs no trust.

Origin super-seeding (``serve_once_s``): the origin answers a shard's bytes to the first
requester only; another requester within ``serve_once_s`` gets ``503`` and fetches it from a
relay that already has it. The requester is the ``X-Shardnet-Peer`` header, which only steers
this optimisation (lying only costs the origin bandwidth). This keeps the origin's egress near
one copy of each version whatever the number of relays.

A version being served is pinned in the store until the response is sent, so retention never
deletes a file under a reader.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from pathlib import Path
from typing import Protocol

import trio

from p2p.http_range import resolve_range
from p2p.http_server import FileSlice, HttpRequest, HttpResponse, file_response
from p2p.trust import TrustList
from shardcast.codecs import XOR_ZSTD, ZSTD
from shardcast.manifest import Manifest
from shardcast.policy import SuperSeeding
from shardcast.store import VersionStore

log = logging.getLogger(__name__)

PEER_HEADER = "x-shardnet-peer"
_ROUTE = re.compile(
    r"^/shardnet/v1/(?P<run>[^/]+)/(?P<step>\d{1,18})/(?:(?P<kind>manifest|have)"
    r"|manifest/part/(?P<part>\d{1,9})|files/(?P<name>[^/]+)"
    r"|shard/(?P<shard>\d{1,9})/(?P<enc>zstd|xor-zstd))$"
)
_VERSIONS = re.compile(r"^/shardnet/v1/(?P<run>[^/]+)/versions$")


class LiveVersion(Protocol):
    """A version whose bytes are still arriving (a download, or the origin hashing)."""

    manifest: Manifest
    dir: Path

    def has(self, index: int) -> bool:
        """True if shard ``index`` can be served."""
        ...

    def blob_path(self, index: int, encoding: str) -> Path:
        """Where shard ``index``'s ``encoding`` blob is (it may not exist)."""
        ...


class _Live:
    def __init__(self, version: LiveVersion) -> None:
        self.version = version
        self.progress = trio.Event()

    def wake(self) -> None:
        self.progress.set()
        self.progress = trio.Event()


class VersionServer:
    """HTTP handler serving one run's versions from a store (see module docstring).

    Args:
        store: the node's version store.
        trust: used to re-verify manifests read back from disk.
        wait_s: longest wait for a part or shard that is not verified yet, seconds.
        serve_once_s: origin super-seeding window, seconds (None: off).
    """

    def __init__(
        self,
        store: VersionStore,
        trust: TrustList,
        wait_s: float = 10.0,
        serve_once_s: float | None = None,
    ) -> None:
        self.store = store
        self.trust = trust
        self.wait_s = wait_s
        self.serve_once_s = serve_once_s
        self._live: dict[int, _Live] = {}
        self._manifests: dict[int, Manifest] = {}
        self._seeding = SuperSeeding(serve_once_s)
        self.bytes_by_step: dict[int, int] = {}

    # -- registration -----------------------------------------------------------------------

    def add_live(self, version: LiveVersion) -> None:
        """Start serving a version whose bytes are still arriving."""
        self._live[version.manifest.step] = _Live(version)

    def progress(self, step: int) -> None:
        """New shards or parts of ``step`` are available: wake waiting requests."""
        live = self._live.get(step)
        if live is not None:
            live.wake()

    def live_done(self, step: int) -> None:
        """The live version was committed or aborted: serve it from the store from now on."""
        live = self._live.pop(step, None)
        self._manifests.pop(step, None)  # the committed one may differ from a cached older one
        if live is not None:
            live.wake()

    @property
    def refused_once(self) -> int:
        """Requests refused by super-seeding so far."""
        return self._seeding.refused

    def in_progress(self) -> list[int]:
        """Steps being filled."""
        return sorted(self._live)

    # -- lookups ----------------------------------------------------------------------------

    def _manifest(self, step: int) -> Manifest | None:
        live = self._live.get(step)
        if live is not None:
            return live.version.manifest
        if not self.store.has(step):
            self._manifests.pop(step, None)
            return None
        if step not in self._manifests:
            try:
                self._manifests[step] = self.store.load_manifest(step, self.trust)
            except (OSError, ValueError) as exc:
                log.warning("manifest_unreadable step=%d error=%s", step, exc)
                return None
        return self._manifests[step]

    def _has(self, step: int, index: int) -> bool:
        live = self._live.get(step)
        return self.store.has(step) if live is None else live.version.has(index)

    async def _wait(self, step: int, ready: object) -> bool:
        """Wait until ``ready()`` or ``wait_s``; False on timeout or if the version vanished."""
        deadline = trio.current_time() + self.wait_s
        while not ready():  # type: ignore[operator]
            live = self._live.get(step)
            if live is None:
                return bool(ready())  # type: ignore[operator]
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
        mv = _VERSIONS.match(req.path)
        if mv:
            if mv["run"] != self.store.run_id:
                return HttpResponse(404)
            body = json.dumps(
                {"committed": self.store.committed_steps(), "in_progress": self.in_progress()}
            ).encode()
            return HttpResponse(200, [("content-type", "application/json")], body)
        mr = _ROUTE.match(req.path)
        if not mr or mr["run"] != self.store.run_id:
            return HttpResponse(404)
        step = int(mr["step"])
        m = self._manifest(step)
        if m is None:
            return HttpResponse(404)
        if mr["kind"] == "manifest":
            return HttpResponse(200, [("content-type", "application/json")], m.encode())
        if mr["kind"] == "have":
            return HttpResponse(
                200, [("content-type", "application/octet-stream")], self._have_bits(step, m)
            )
        if mr["part"] is not None:
            k = int(mr["part"])
            if k >= m.header.n_parts:
                return HttpResponse(404)
            if not await self._wait(step, lambda: k in m.parts):
                return _retry()
            return HttpResponse(200, [("content-type", "application/json")], m.parts[k].encode())
        if mr["shard"] is not None:
            return await self._blob(req, step, m, int(mr["shard"]), mr["enc"])
        return await self._file(req, step, m, mr["name"] or "")

    def _have_bits(self, step: int, m: Manifest) -> bytes:
        n = len(m.header.shards)
        out = bytearray((n + 7) // 8)
        for i in range(n):
            if self._has(step, i):
                out[i // 8] |= 0x80 >> (i % 8)
        return bytes(out)

    def _refuse_repeat(self, req: HttpRequest, step: int, m: Manifest, shards: range) -> bool:
        """Origin super-seeding (:class:`shardcast.policy.SuperSeeding`): True if these
        shards must be fetched from another node."""
        return not self._seeding.allow(
            req.headers.get(PEER_HEADER, ""),
            step,
            shards,
            trio.current_time(),
            len(m.header.shards),
        )

    async def _file(self, req: HttpRequest, step: int, m: Manifest, name: str) -> HttpResponse:
        try:
            entry = m.header.file(name)
        except KeyError:
            return HttpResponse(404)
        first, last = 0, entry.size - 1
        if req.range is not None and "if-range" not in req.headers and entry.size:
            try:
                first, length = resolve_range(req.range, entry.size)
                last = first + length - 1
            except ValueError:
                return file_response(req, self.store.version_dir(step) / name, entry.size)
        if entry.size:
            base = m.header.first_shard(name)
            shards = range(
                base + first // m.header.shard_size, base + last // m.header.shard_size + 1
            )
        else:
            shards = range(0)
        if not await self._wait(step, lambda: all(self._has(step, i) for i in shards)):
            return _retry()
        if self._refuse_repeat(req, step, m, shards):
            return _retry()
        live = self._live.get(step)
        committed = self.store.version_dir(step) / name
        return self._slice(
            req,
            step,
            entry.size,
            live.version.dir / name if live is not None else committed,
            committed,
        )

    async def _blob(
        self, req: HttpRequest, step: int, m: Manifest, index: int, encoding: str
    ) -> HttpResponse:
        if index >= len(m.header.shards):
            return HttpResponse(404)
        if not await self._wait(step, lambda: m.known(index) and self._has(step, index)):
            return _retry()
        offered = m.shard(index).offered(encoding)
        if offered is None:
            return HttpResponse(404)
        live = self._live.get(step)
        committed = self.store.blob_path(step, index, encoding)
        primary = live.version.blob_path(index, encoding) if live is not None else committed
        if not primary.exists() and not committed.exists():
            return HttpResponse(404)  # this node did not keep that encoding
        if self._refuse_repeat(req, step, m, range(index, index + 1)):
            return _retry()
        return self._slice(req, step, offered.size, primary, committed)

    def _slice(
        self, req: HttpRequest, step: int, size: int, primary: Path, committed: Path
    ) -> HttpResponse:
        """A (ranged) file response for ``primary``, falling back to the committed path if the
        live directory was renamed meanwhile, with the step pinned until it is sent."""
        resp = file_response(req, primary, size)
        if not isinstance(resp.body, FileSlice):
            return resp
        pin = self.store.pinned(step)
        pin.__enter__()

        def release() -> None:
            pin.__exit__(None, None, None)

        body = dataclasses.replace(resp.body, fallbacks=(committed,), on_done=release)
        if req.method == "GET" and resp.status < 300:
            self.bytes_by_step[step] = self.bytes_by_step.get(step, 0) + body.length
        return dataclasses.replace(resp, body=body)


def _retry() -> HttpResponse:
    return HttpResponse(503, [("retry-after", "1")])


OFFERED_ENCODINGS = (ZSTD, XOR_ZSTD)
