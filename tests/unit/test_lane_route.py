"""The ``route`` label of ``shardnet_http_requests_total``: every lane path the URL builders
make is classified as its route, anything else as ``other``, and a node's request counts stay
a fixed set of series whatever paths it is sent."""

from __future__ import annotations

from shardcast.node.metrics import CODE_CLASSES, NodeMetrics
from shardcast.wire import (
    LaneRoute,
    blob_url,
    blobs_url,
    file_url,
    have_url,
    lane_route,
    manifest_url,
    part_url,
    versions_url,
)
from shardcast.wire.lane_auth import whoami_path

BASE = "http://node:8001"
RUN, STEP, DIGEST = "run-1", 7, "ab" * 32


def _path(url: str) -> str:
    return url.removeprefix(BASE)


def test_every_built_path_has_its_route() -> None:
    paths = {
        LaneRoute.VERSIONS: _path(versions_url(BASE, RUN)),
        LaneRoute.WHOAMI: whoami_path("0f" * 16),
        LaneRoute.MANIFEST: _path(manifest_url(BASE, RUN, STEP, DIGEST)),
        LaneRoute.PART: _path(part_url(BASE, RUN, STEP, DIGEST, 3)),
        LaneRoute.HAVE: _path(have_url(BASE, RUN, STEP, DIGEST)),
        LaneRoute.FILE: _path(file_url(BASE, RUN, STEP, DIGEST, "model.safetensors")),
        LaneRoute.SHARD: _path(blob_url(BASE, RUN, STEP, DIGEST, 12, "sparse")),
        LaneRoute.BLOBS: _path(blobs_url(BASE, RUN, STEP, DIGEST, [1, 2, 5], "sparse")),
    }
    assert set(paths) == set(LaneRoute) - {LaneRoute.OTHER}
    for route, path in paths.items():
        assert lane_route(path) is route, path


def test_anything_else_is_other() -> None:
    for path in (
        "/",
        "/metrics",
        f"/shardnet/v1/{RUN}/{STEP}/have",  # an older node's step-only route
        f"/shardnet/v1/{RUN}/{STEP}/{'AB' * 32}/have",  # not a lowercase digest
        f"/shardnet/v1/{RUN}/{STEP}/{DIGEST}/shard/1/gzip",  # no such encoding
        f"/shardnet/v1/{RUN}/{STEP}/{DIGEST}/blobs/sparse/" + ",".join(map(str, range(65))),
        "/shardnet/v1/whoami/short",
    ):
        assert lane_route(path) is LaneRoute.OTHER, path


def test_requests_are_counted_by_route_and_class_in_a_fixed_set_of_series() -> None:
    m = NodeMetrics("relay", "run", "12D3KooWtest", process=False)
    keys = set(m.requests)
    assert keys == {(r, c) for r in LaneRoute for c in CODE_CLASSES}
    m.count_request(200, lane_route(_path(have_url(BASE, RUN, STEP, DIGEST))))
    m.count_request(200, LaneRoute.HAVE)
    m.count_request(404, lane_route("/no/such/path/" + "x" * 500))
    m.count_request(999, LaneRoute.OTHER)  # out of range: counted as 5xx
    assert m.requests[LaneRoute.HAVE, "2xx"] == 2
    assert m.requests[LaneRoute.OTHER, "4xx"] == 1
    assert m.requests[LaneRoute.OTHER, "5xx"] == 1
    assert m.requests_by_class == {"1xx": 0, "2xx": 2, "3xx": 0, "4xx": 1, "5xx": 1}
    assert m.client_errors == {404: 1}
    assert set(m.requests) == keys  # no path adds a series
