"""wire: URLs of the HTTP lane: every version is named by its step *and* its manifest digest.

One place builds the lane's paths (downloaders, followers, mirrors) and one regular
expression parses them (:mod:`shardcast.serve.server`)::

    /shardnet/v1/<run>/versions                               committed and filling versions
    /shardnet/v1/<run>/<step>/<digest>/manifest               the manifest document
    /shardnet/v1/<run>/<step>/<digest>/manifest/part/<k>      one signed part
    /shardnet/v1/<run>/<step>/<digest>/have                   the have-bitmap
    /shardnet/v1/<run>/<step>/<digest>/files/<name>           file bytes (Range)
    /shardnet/v1/<run>/<step>/<digest>/shard/<i>/<enc>        an encoded shard blob
    /shardnet/v1/<run>/<step>/<digest>/blobs/<enc>/<i>,<j>,.. several shards' blobs,
                                                              one after the other

``<digest>`` is the manifest header's BLAKE3 hex digest (64 lowercase hex characters), the
version's identity in the trainer's signed announcement. A step can be published twice with
different content (an origin restarted on a rewritten directory); naming the digest in every
request means a node never serves, and a downloader never receives, bytes of a version other
than the one asked for. A node holding the step under another digest answers ``409`` (and its
digest in :data:`HELD_DIGEST_HEADER`), one not holding the step ``404``; neither is a fault
of the node (:func:`lane_answer`).

Nodes of a release that named versions by step alone ask for ``/<run>/<step>/files/...``; a
node of this release answers such a request ``404`` with a one-line explanation, which an old
downloader takes as "not held here" (it never bans a source for a ``404``), so mixed versions
fail cleanly: nobody is blamed, the download ends as "gone from every source". A new
downloader asking an old node gets the same ``404``.

Pure string work; no I/O.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence

from p2p.addresses import check_http_url
from shardcast.wire.canonical import DIGEST_RE

PREFIX = "/shardnet/v1"
HELD_DIGEST_HEADER = "x-shardnet-held-digest"
"""Response header of a ``409``: the manifest digest this node holds the step under."""

MAX_BATCH_BLOBS = 64
"""Most shards one batch route names (:func:`blobs_url`; the server accepts no more)."""

ROUTE = re.compile(
    r"^/shardnet/v1/(?P<run>[^/]+)/(?P<step>\d{1,18})/(?P<digest>[0-9a-f]{64})/"
    r"(?:(?P<kind>manifest|have)"
    r"|manifest/part/(?P<part>\d{1,9})|files/(?P<name>[^/]+)"
    r"|shard/(?P<shard>\d{1,9})/(?P<enc>zstd|xor-zstd|sparse)"
    r"|blobs/(?P<benc>zstd|xor-zstd|sparse)/(?P<shards>\d{1,9}(?:,\d{1,9})"
    rf"{{0,{MAX_BATCH_BLOBS - 1}}}))$"
)
"""A version route; groups ``run``, ``step``, ``digest`` and one of ``kind``, ``part``,
``name``, ``shard``+``enc``, ``benc``+``shards`` (a batch: at most 64 shard indices)."""

VERSIONS_ROUTE = re.compile(r"^/shardnet/v1/(?P<run>[^/]+)/versions$")
"""The ``/versions`` route (:func:`versions_url`); group ``run``."""

WHOAMI_ROUTE = re.compile(r"^/shardnet/v1/whoami/(?P<nonce>[0-9a-f]{32})$")
"""The signed dial-back challenge (:func:`shardcast.wire.lane_auth.whoami_path`)."""

STEP_ONLY_ROUTE = re.compile(
    r"^/shardnet/v1/[^/]+/\d{1,18}/(?:manifest|have|manifest/part/\d+|files/[^/]+|shard/.+)$"
)
"""A version route of the older lane that named versions by step alone (answered ``404``)."""

STEP_ONLY_BODY = (
    b"this shardnet lane names versions by step and manifest digest: "
    b"/shardnet/v1/<run>/<step>/<digest>/...; upgrade the requesting node\n"
)


def _check(digest: str) -> str:
    if not DIGEST_RE.match(digest):
        raise ValueError(f"manifest digest {digest!r} is not 64 lowercase hex characters")
    return digest


def versions_url(base_url: str, run_id: str) -> str:
    """URL of a node's (or mirror's) list of versions."""
    return f"{base_url}{PREFIX}/{run_id}/versions"


def version_url(base_url: str, run_id: str, step: int, digest: str) -> str:
    """Base URL of version ``(step, digest)`` on a node's HTTP lane.

    Raises:
        ValueError: ``digest`` is not a 64-hex BLAKE3 digest (a caller bug).
    """
    return f"{base_url}{PREFIX}/{run_id}/{step}/{_check(digest)}"


def manifest_url(base_url: str, run_id: str, step: int, digest: str) -> str:
    """URL of a version's manifest document."""
    return f"{version_url(base_url, run_id, step, digest)}/manifest"


def part_url(base_url: str, run_id: str, step: int, digest: str, part: int) -> str:
    """URL of one signed manifest part."""
    return f"{version_url(base_url, run_id, step, digest)}/manifest/part/{part}"


def have_url(base_url: str, run_id: str, step: int, digest: str) -> str:
    """URL of a version's have-bitmap."""
    return f"{version_url(base_url, run_id, step, digest)}/have"


def file_url(base_url: str, run_id: str, step: int, digest: str, name: str) -> str:
    """URL of one file of a version."""
    return f"{version_url(base_url, run_id, step, digest)}/files/{name}"


def blob_url(base_url: str, run_id: str, step: int, digest: str, shard: int, enc: str) -> str:
    """URL of shard ``shard``'s ``enc`` blob."""
    return f"{version_url(base_url, run_id, step, digest)}/shard/{shard}/{enc}"


def blobs_url(
    base_url: str, run_id: str, step: int, digest: str, shards: Sequence[int], enc: str
) -> str:
    """URL of a batch: the ``enc`` blobs of ``shards`` (1 to 64 distinct indices, in the
    order given), answered as one body, each blob after the other at its signed size
    (:mod:`shardcast.core.batch`). A node of an older release answers it ``404``.

    Raises:
        ValueError: no shard, more than 64, or a shard named twice (a caller bug).
    """
    if not 1 <= len(shards) <= MAX_BATCH_BLOBS or len(set(shards)) != len(shards):
        raise ValueError(f"a batch names 1-64 distinct shards, not {list(shards)}")
    listed = ",".join(str(i) for i in shards)
    return f"{version_url(base_url, run_id, step, digest)}/blobs/{enc}/{listed}"


def parse_shards(text: str) -> list[int]:
    """The shard indices of a batch route's ``shards`` group (``"3,4,9"``).

    Raises:
        ValueError: a shard named twice.
    """
    shards = [int(x) for x in text.split(",")]
    if len(set(shards)) != len(shards):
        raise ValueError(f"shards named twice in {text!r}")
    return shards


class LaneAnswer(enum.Enum):
    """What a source's non-content answer says about it; none is a fault of the source."""

    NOT_HELD = "not_held"
    """``404``: it does not hold the step (yet, or any more)."""
    OTHER_DIGEST = "other_digest"
    """``409``: it holds the step under another manifest digest."""
    BUSY = "busy"
    """``503``/``429``: it holds the version but cannot answer this request now."""


def lane_answer(status: int) -> LaneAnswer:
    """Classify a ``404``/``409``/``429``/``503`` answer (any other status: ``BUSY``)."""
    if status == 404:
        return LaneAnswer.NOT_HELD
    if status == 409:
        return LaneAnswer.OTHER_DIGEST
    return LaneAnswer.BUSY


class LaneRoute(enum.Enum):
    """The route of a lane request, the ``route`` label of ``shardnet_http_requests_total``
    (a fixed set: a path cannot add series)."""

    VERSIONS = "versions"
    WHOAMI = "whoami"
    MANIFEST = "manifest"
    PART = "part"
    HAVE = "have"
    FILE = "file"
    SHARD = "shard"
    """one encoded shard blob"""
    BLOBS = "blobs"
    """a batch of blobs"""
    OTHER = "other"
    """anything else (answered ``404`` or ``405``)"""


def lane_route(path: str) -> LaneRoute:
    """The :class:`LaneRoute` of a request path (its query removed); pure."""
    m = ROUTE.match(path)
    if m is None:
        if VERSIONS_ROUTE.match(path):
            return LaneRoute.VERSIONS
        return LaneRoute.WHOAMI if WHOAMI_ROUTE.match(path) else LaneRoute.OTHER
    if m["kind"] is not None:
        return LaneRoute(m["kind"])
    if m["part"] is not None:
        return LaneRoute.PART
    if m["name"] is not None:
        return LaneRoute.FILE
    return LaneRoute.SHARD if m["shard"] is not None else LaneRoute.BLOBS


def check_mirror_url(text: str, option: str) -> str:
    """Check a mirror's base URL: ``http://HOST[:PORT][/PATH]`` (port 80 by default).

    Returns:
        the URL without a trailing ``/``.

    Raises:
        ConfigError: naming ``option`` (see :func:`p2p.addresses.check_http_url`).
    """
    return check_http_url(text, option, base_path=True)
