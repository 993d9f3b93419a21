"""Serving versions over the HTTP lane: committed versions and versions still filling up.

Routes (all ``GET``/``HEAD``)::

    /shardnet/v1/<run>/<step>/manifest        the signed manifest (JSON envelope)
    /shardnet/v1/<run>/<step>/files/<name>    file bytes; Range requests (206)
    /shardnet/v1/<run>/<step>/have            which shards are served: one bit per shard,
                                              most significant bit of byte 0 = shard 0
    /shardnet/v1/<run>/versions               committed steps and the ones in progress (JSON)

Theory of operation
-------------------
A relay (or a peer that re-serves) registers a version with :meth:`VersionServer.add_partial`
as soon as its manifest is verified, before any shard has arrived, and calls
:meth:`VersionServer.shard_ready` each time a shard has been verified and written. A range
request is answered only when every shard it overlaps is verified; until then the handler
waits (up to ``wait_s``) for progress, so a downstream node can ask for shard *i* before the
relay has it and receives it the moment it is verified — pipelining with no polling. If the
wait runs out, the answer is ``503`` with ``Retry-After``. Bytes that were not verified are
never served, so the lane needs no trust.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass

import trio

from p2p.http_range import resolve_range
from p2p.http_server import FileSlice, HttpRequest, HttpResponse, file_response
from p2p.trust import TrustList
from shardcast.manifest import MANIFEST_FILE, Manifest, SignedManifest
from shardcast.store import PartialVersion, VersionStore

log = logging.getLogger(__name__)

_ROUTE = re.compile(
    r"^/shardnet/v1/(?P<run>[^/]+)/(?P<step>\d{1,18})/(?P<kind>manifest|have|files)"
    r"(?:/(?P<name>[^/]+))?$"
)
_VERSIONS = re.compile(r"^/shardnet/v1/(?P<run>[^/]+)/versions$")


@dataclass
class _Live:
    partial: PartialVersion
    signed: SignedManifest
    first_index: dict[str, int]
    progress: trio.Event


class VersionServer:
    """HTTP handler serving one run's versions from a store (see module docstring).

    Args:
        store: the node's version store.
        trust: used to re-verify manifests read back from disk.
        wait_s: longest wait for a shard that is not verified yet, seconds.
    """

    def __init__(self, store: VersionStore, trust: TrustList, wait_s: float = 10.0) -> None:
        self.store = store
        self.trust = trust
        self.wait_s = wait_s
        self._live: dict[int, _Live] = {}
        self._manifests: dict[int, SignedManifest] = {}
        self.bytes_by_step: dict[int, int] = {}

    # -- registration (called by the node that fills the version) -----------------------------

    def add_partial(self, partial: PartialVersion) -> None:
        """Start serving a version that is being downloaded."""
        m = partial.manifest
        first: dict[str, int] = {}
        for s in m.shards:
            first.setdefault(s.file, s.index)
        self._live[m.step] = _Live(partial, partial.signed, first, trio.Event())

    def shard_ready(self, step: int, index: int) -> None:
        """Shard ``index`` of ``step`` is verified and written: wake waiting requests."""
        live = self._live.get(step)
        if live is not None:
            live.progress.set()
            live.progress = trio.Event()

    def partial_done(self, step: int) -> None:
        """The partial version was committed or aborted: stop serving it as partial."""
        live = self._live.pop(step, None)
        if live is not None:
            live.progress.set()

    def in_progress(self) -> list[int]:
        """Steps being filled."""
        return sorted(self._live)

    # -- lookups -----------------------------------------------------------------------------

    def _manifest(self, step: int) -> SignedManifest | None:
        live = self._live.get(step)
        if live is not None:
            return live.signed
        if step in self._manifests and self.store.has(step):
            return self._manifests[step]
        if not self.store.has(step):
            self._manifests.pop(step, None)
            return None
        try:
            signed = self.store.load_manifest(step, self.trust)
        except (OSError, ValueError) as exc:
            log.warning("manifest_unreadable step=%d error=%s", step, exc)
            return None
        self._manifests[step] = signed
        return signed

    @staticmethod
    def _covered(live: _Live, m: Manifest, name: str, first: int, last: int) -> bool:
        base = live.first_index[name]
        for i in range(base + first // m.shard_size, base + last // m.shard_size + 1):
            if not live.partial.has(i):
                return False
        return True

    # -- the handler -------------------------------------------------------------------------

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
        signed = self._manifest(step)
        if signed is None:
            return HttpResponse(404)
        if mr["kind"] == "manifest":
            return HttpResponse(200, [("content-type", "application/json")], signed.encode())
        if mr["kind"] == "have":
            return HttpResponse(
                200,
                [("content-type", "application/octet-stream")],
                self._have_bits(step, signed.manifest),
            )
        return await self._file(req, step, signed.manifest, mr["name"] or "")

    def _have_bits(self, step: int, m: Manifest) -> bytes:
        n = len(m.shards)
        out = bytearray((n + 7) // 8)
        live = self._live.get(step)
        for i in range(n):
            if live is None or live.partial.has(i):
                out[i // 8] |= 0x80 >> (i % 8)
        return bytes(out)

    async def _file(self, req: HttpRequest, step: int, m: Manifest, name: str) -> HttpResponse:
        try:
            entry = m.file(name)
        except KeyError:
            return HttpResponse(404)
        if entry.size == 0:
            return file_response(req, self.store.version_dir(step) / name, 0)
        deadline = trio.current_time() + self.wait_s
        while True:
            live = self._live.get(step)
            if live is None:
                if not self.store.has(step):
                    return HttpResponse(404)
                resp = file_response(req, self.store.version_dir(step) / name, entry.size)
                break
            first, last = 0, entry.size - 1
            if req.range is not None and "if-range" not in req.headers:
                try:
                    first, length = resolve_range(req.range, entry.size)
                    last = first + length - 1
                except ValueError:
                    return file_response(req, live.partial.dir / name, entry.size)  # 416
            if self._covered(live, m, name, first, last):
                resp = file_response(req, live.partial.dir / name, entry.size)
                if isinstance(resp.body, FileSlice):  # the partial may be committed meanwhile
                    resp = dataclasses.replace(
                        resp,
                        body=dataclasses.replace(
                            resp.body, fallbacks=(self.store.version_dir(step) / name,)
                        ),
                    )
                break
            remaining = deadline - trio.current_time()
            if remaining <= 0:
                return HttpResponse(503, [("retry-after", "1")])
            with trio.move_on_after(remaining):
                await live.progress.wait()
        if isinstance(resp.body, bytes) or resp.status >= 300 or req.method != "GET":
            return resp
        self.bytes_by_step[step] = self.bytes_by_step.get(step, 0) + resp.body.length
        return resp


def manifest_path(store: VersionStore, step: int) -> str:
    """Path of a committed version's manifest file (for operators and tests)."""
    return str(store.version_dir(step) / MANIFEST_FILE)
