"""``shardnet origin --watch`` and the trainer's markers, with real processes on 127.0.0.1.

* A step whose weights file is cut short, and a step holding only the ready marker, are
  refused before anything of them is signed (one WARNING each, however often the directory is
  polled); the origin keeps running and publishes newer steps, and a refused step is published
  once its files are whole. The ready marker itself is never published.
* The finished marker in ``WATCH`` ends the run (a relay takes the signed end); removing it
  continues the run (the relay takes the continuation and the next step); an origin restarted
  with the marker there signs the end again.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import trio
from safetensors.numpy import save_file

from p2p.identity import Identity
from shardcast.wire.runcard import DEFAULT_ASYNC_LEVEL
from shardnet import roles
from shardnet.config import OriginSettings
from tests.integration.procs import LOOPBACK_ANY, Node, free_port, nodes
from tests.observability import BY_ROLE, families

__all__ = ["nodes"]  # the fixture

RUN = "refusals"


def _origin_args(watch: Path, data: Path, *extra: str) -> list[str]:
    """``shardnet origin`` on ``watch`` with data in ``data``, scanning every 0.1 s."""
    return [
        *("origin", "--watch", str(watch), "--data-dir", str(data), "--run-id", RUN),
        *("--poll-interval-s", "0.1", "--no-pre-encode", *extra),
    ]


def _origin_with_step_0(tmp_path: Path, nodes: list[Node]) -> tuple[Path, Path, Node]:
    """An origin on ``<tmp>/watch`` (data in ``<tmp>/origin``) that has published step 0."""
    watch, data = tmp_path / "watch", tmp_path / "origin"
    _write(watch, 0)
    origin = Node("origin", _origin_args(watch, data, *LOOPBACK_ANY), tmp_path / "logs", {})
    nodes.append(origin)
    origin.wait_for(r"version_published step=0 ")
    return watch, data, origin


def _write(watch: Path, step: int, *, cut: bool = False, marker: bool = True) -> None:
    """``watch/step-<step>/`` as a trainer writes it: config, weights (temp file, rename),
    then the ready marker; ``cut``: the weights cut to half their size."""
    d = watch / f"step-{step}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "step": step}))
    tmp = d / ".model.safetensors.tmp"
    save_file({"w": np.full(20_000, step, dtype=np.float32)}, str(tmp))
    if cut:
        tmp.write_bytes(tmp.read_bytes()[:40_000])
    os.replace(tmp, d / "model.safetensors")
    if marker:
        (d / "DONE").write_text("")


def _linked_or_skip(watch: Path, data: Path, step: int) -> None:
    """Skip the test where the origin copied ``step``'s weights file into its store instead
    of hard-linking it (another file system: nothing is shared)."""
    name = Path(f"step-{step}") / "model.safetensors"
    if (data / "versions" / RUN / name).stat().st_ino != (watch / name).stat().st_ino:
        pytest.skip("the origin copied the files (another file system): nothing is shared")


def _rewrite_in_place(watch: Path, step: int) -> None:
    """Rewrite bytes of ``watch/step-<step>/model.safetensors`` in place (the same inode, as
    a trainer's in-place save)."""
    with (watch / f"step-{step}" / "model.safetensors").open("r+b") as f:
        f.seek(200)
        f.write(b"\x01" * 64)


def _origin(name: str, watch: Path, data: Path, tmp_path: Path, nodes: list[Node]) -> Node:
    """Start ``shardnet origin`` on ``watch`` with data in ``data`` (again, after a stop)."""
    node = Node(name, _origin_args(watch, data, *LOOPBACK_ANY), tmp_path / "logs", {})
    nodes.append(node)
    return node


def test_refused_steps_are_never_signed_and_the_origin_goes_on(
    tmp_path: Path, nodes: list[Node]
) -> None:
    watch, data, origin = _origin_with_step_0(tmp_path, nodes)
    # the marker before the weights are whole, and a marker alone
    _write(watch, 1, cut=True)
    (watch / "step-2").mkdir()
    (watch / "step-2" / "DONE").write_text("")
    origin.wait_for(r"WARNING .*checkpoint_refused step=1 error=.*not fully covered", 60)
    # the error names the operator's directory, not the origin's staged copy of it
    step_2 = re.escape(str(watch / "step-2"))
    origin.wait_for(rf"WARNING .*checkpoint_refused step=2 error={step_2} .*config\.json", 60)
    # a zero-padded name is not a step: said once, never published
    _write(watch, 5)
    (watch / "step-5").rename(watch / "step-05")
    origin.wait_for(r"WARNING .*watch_dir_misnamed dir=\S*step-05 .*\(step-5\)", 60)
    # a newer whole step is published meanwhile
    _write(watch, 3)
    origin.wait_for(r"version_published step=3 ", 60)
    assert origin.count(r"watch_dir_misnamed") == 1
    assert origin.count(r"step=5 ") == 0
    assert origin.count(r"checkpoint_refused step=1 ") == 1  # said once, not at every poll
    assert origin.count(r"checkpoint_refused step=2 ") == 1
    assert origin.count(r"version_announced .*step=[12] ") == 0  # nothing of them signed
    assert not (data / "versions" / RUN / "step-1").exists()
    # step 4 refused, then written whole: tried again because its files changed
    _write(watch, 4, cut=True)
    origin.wait_for(r"checkpoint_refused step=4 ", 60)
    url = re.search(r"http_url=(\S+)", origin.wait_for(r"node_ready role=origin")).group(1)
    with urllib.request.urlopen(f"{url}/status", timeout=10) as r:
        doc = json.loads(r.read())
    watched = doc["watch"]
    # no --rollouts-out: the run's async window only (the peers' lag alert reads it)
    assert doc["intake"] == {"async_window_versions": DEFAULT_ASYNC_LEVEL, "rollouts_out": None}
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        fams = families(r.read().decode())
    assert {f for f in fams if f.startswith("shardnet_") and not f.endswith("_created")} == {
        f for f in BY_ROLE["origin"] if f.startswith("shardnet_")
    }
    # 1 and 2 are older than the published 3: never published now, no longer listed
    assert (watched["refused"], watched["latest_published"]) == ([4], 3)
    _write(watch, 4)
    origin.wait_for(r"version_published step=4 ", 60)
    published = sorted(p.name for p in (data / "versions" / RUN / "step-4").iterdir())
    assert "DONE" not in published
    assert "model.safetensors" in published
    assert origin.proc.poll() is None  # still running
    assert origin.stop(signal.SIGTERM) == 0


def test_the_finished_marker_ends_the_run_and_removing_it_continues_it(
    tmp_path: Path, nodes: list[Node]
) -> None:
    watch, data, logs = tmp_path / "watch", tmp_path / "origin", tmp_path / "logs"
    origin_id = Identity.load_or_create(data / "node.key").peer_id
    port = free_port()
    args = _origin_args(
        watch,
        data,
        *("--key", str(data / "node.key"), "--listen", f"/ip4/127.0.0.1/tcp/{port}"),
        *("--http-host", "127.0.0.1", "--http-port", "0"),
    )
    _write(watch, 0)
    origin = Node("origin", args, logs, {})
    nodes.append(origin)
    origin.wait_for(r"version_published step=0 ")
    relay = Node(
        "relay",
        [
            *("relay", "--data-dir", str(tmp_path / "relay"), "--run-id", RUN),
            *("--upstream", f"/ip4/127.0.0.1/tcp/{port}/p2p/{origin_id}"),
            *("--trainer-id", origin_id),
            *LOOPBACK_ANY,
        ],
        logs,
        {},
    )
    nodes.append(relay)
    relay.wait_for(r"version_committed run=refusals step=0 ", 60)
    _write(watch, 1)
    (watch / "FINISHED").write_text("")
    origin.wait_for(r"run_finished_announced step=1 seq=1 ", 60)
    relay.wait_for(r"run_finished run=refusals step=1 ", 60)
    assert origin.count(r"version_published step=1 ") == 1  # published before the end
    (watch / "FINISHED").unlink()
    origin.wait_for(r"run_continued_announced step=1 seq=2", 60)
    relay.wait_for(r"run_continued run=refusals step=1 lifted_end=True", 60)
    _write(watch, 2)
    relay.wait_for(r"version_committed run=refusals step=2 ", 60)
    # restarted with the marker there: the end is signed again, above the continuation
    assert origin.stop(signal.SIGTERM) == 0
    (watch / "FINISHED").write_text("")
    origin2 = Node("origin2", args, logs, {})
    nodes.append(origin2)
    origin2.wait_for(r"run_finished_announced step=2 seq=3 ", 60)
    relay.wait_for(r"run_finished run=refusals step=2 ", 60)
    assert origin2.count(r"run_continued_announced") == 0
    assert relay.stop(signal.SIGTERM) == 0
    assert origin2.stop(signal.SIGTERM) == 0


def test_a_published_step_rewritten_in_place_is_no_longer_served(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """The origin hard-links WATCH files into its store: a trainer that rewrites one of a
    published step in place changes the bytes served under the signed manifest. The origin
    sees it at its next scan, says so at ERROR and stops serving that version; the next step
    is published as usual."""
    watch, data, origin = _origin_with_step_0(tmp_path, nodes)
    _linked_or_skip(watch, data, 0)
    _rewrite_in_place(watch, 0)
    origin.wait_for(r"ERROR .*published_files_changed step=0 files=model\.safetensors", 60)
    origin.wait_for(r"versions_quarantined run=refusals steps=\[0\]", 60)
    assert not (data / "versions" / RUN / "step-0").exists()
    _write(watch, 1)
    origin.wait_for(r"version_published step=1 ", 60)
    assert origin.count(r"published_files_changed") == 1
    assert origin.stop(signal.SIGTERM) == 0


def test_a_step_rewritten_while_the_origin_was_down_is_found_at_start(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """A touched file (same bytes) is re-hashed and served on; a file rewritten in place while
    the origin was stopped is found when it starts again, before it serves the version."""
    watch, data, origin = _origin_with_step_0(tmp_path, nodes)
    _write(watch, 1)
    origin.wait_for(r"version_published step=1 ", 60)
    _linked_or_skip(watch, data, 0)
    os.utime(watch / "step-1" / "model.safetensors", ns=(10**9, 10**9))  # no byte changed
    origin.wait_for(r"published_files_touched step=1 files=model\.safetensors", 60)
    assert origin.count(r"published_files_touched step=0 ") == 0  # publishing changes nothing
    assert origin.stop(signal.SIGTERM) == 0
    _rewrite_in_place(watch, 0)  # while it is down
    again = _origin("origin-again", watch, data, tmp_path, nodes)
    again.wait_for(r"ERROR .*published_files_changed step=0 files=model\.safetensors", 60)
    # said once the version is removed (published_files_changed comes just before it)
    again.wait_for(r"versions_quarantined run=refusals steps=\[0\]", 60)
    assert not (data / "versions" / RUN / "step-0").exists()
    # ... before the lane listened: no follower could be served the changed bytes
    again.wait_for(r"node_ready role=origin")
    lines = again.drain()
    first = next(i for i, ln in enumerate(lines) if "versions_quarantined" in ln)
    assert first < next(i for i, ln in enumerate(lines) if "http_server_listening" in ln)
    assert (data / "versions" / RUN / "step-1").exists()
    assert again.count(r"published_files_changed") == 1
    assert origin.count(r"published_files_changed") == 0
    assert again.stop(signal.SIGTERM) == 0


def test_a_quarantined_step_is_never_published_again_under_its_number(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """The newest step rewritten in place while the origin was down is quarantined at start;
    the origin must not then take the step before it as where it stands and publish the
    rewritten ``WATCH/step-1/`` again (followers hold step 1 with the old bytes). The next
    step is published as usual, and the restart after that keeps both facts."""
    watch, data, origin = _origin_with_step_0(tmp_path, nodes)
    _write(watch, 1)
    origin.wait_for(r"version_published step=1 ", 60)
    _linked_or_skip(watch, data, 1)
    assert origin.stop(signal.SIGTERM) == 0
    _rewrite_in_place(watch, 1)  # while it is down
    again = _origin("origin-again", watch, data, tmp_path, nodes)
    again.wait_for(r"ERROR .*published_files_changed step=1 files=model\.safetensors", 60)
    _write(watch, 2)  # the scan that publishes step 2 has passed step-1/DONE
    again.wait_for(r"version_published step=2 ", 60)
    assert again.count(r"version_published step=1 ") == 0
    assert not (data / "versions" / RUN / "step-1").exists()
    assert again.stop(signal.SIGTERM) == 0
    third = _origin("origin-third", watch, data, tmp_path, nodes)
    third.wait_for(r"node_ready role=origin")
    _write(watch, 3)
    third.wait_for(r"version_published step=3 ", 60)
    assert third.count(r"version_published step=[12] ") == 0
    assert third.stop(signal.SIGTERM) == 0


def test_the_origin_waits_for_a_watch_directory_created_later_and_says_when_it_goes(
    tmp_path: Path, nodes: list[Node]
) -> None:
    """The README starts the origin before the trainer, which creates ``WATCH``: the origin
    says once that it waits for it (and ``/status`` shows it), publishes once it is there,
    and says at WARNING, once, when it goes away."""
    watch, data = tmp_path / "watch", tmp_path / "origin"
    origin = Node("origin", _origin_args(watch, data, *LOOPBACK_ANY), tmp_path / "logs", {})
    nodes.append(origin)
    url = re.search(r"http_url=(\S+)", origin.wait_for(r"node_ready role=origin")).group(1)
    origin.wait_for(r"INFO .*watch_dir_missing dir=\S*watch hint=waiting for the trainer")
    with urllib.request.urlopen(f"{url}/status", timeout=10) as r:
        assert json.load(r)["watch"]["dir_present"] is False
    _write(watch, 0)
    origin.wait_for(r"version_published step=0 ", 60)
    assert origin.count(r"watch_dir_found") == 1
    watch.rename(tmp_path / "moved")
    origin.wait_for(r"WARNING .*watch_dir_gone dir=\S*watch", 60)
    (tmp_path / "moved").rename(watch)
    origin.wait_for(r"watch_dir_found", 60, count=2)
    assert origin.count(r"watch_dir_missing") == 1
    assert origin.count(r"watch_dir_gone") == 1
    assert origin.stop(signal.SIGTERM) == 0


async def _origin_passes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    during_scan: Callable[[int | None], None],
    done: Callable[[int | None, bool | None], bool],
    *,
    after_listing: bool,
) -> list[int | None]:
    """Run ``shardnet origin`` in process on ``<tmp>/watch`` (step 0 written) with
    ``during_scan(newest)`` called inside each scan of ``WATCH``, before or after it lists
    the ready steps, until ``done(latest, ended)`` after a pass; returns the step of each
    end signed."""
    _write(tmp_path / "watch", 0)
    real_scan, real_follow = roles._ready_steps, roles._follow_finished_marker
    ends: list[int | None] = []
    finished = trio.Event()

    def scan(s: OriginSettings, presence: object, newest: int | None) -> list[int]:
        if not after_listing:
            during_scan(newest)
        steps = real_scan(s, presence, newest)  # type: ignore[arg-type]
        if after_listing:
            during_scan(newest)
        return steps

    async def follow(*args: object) -> bool | None:
        *_, latest, ended = args
        signed = await real_follow(*args)  # type: ignore[arg-type]
        if signed is True and ended is not True:  # an end signed in this pass
            ends.append(latest)  # type: ignore[arg-type]
        if done(latest, signed):  # type: ignore[arg-type]
            finished.set()
        return signed

    monkeypatch.setattr(roles, "_ready_steps", scan)
    monkeypatch.setattr(roles, "_follow_finished_marker", follow)
    settings = OriginSettings(
        watch=tmp_path / "watch",
        data_dir=tmp_path / "origin",
        run_id=RUN,
        listen=["/ip4/127.0.0.1/tcp/0"],
        http_host="127.0.0.1",
        http_port=0,
        poll_interval_s=0.05,
        pre_encode=False,
    )
    async with trio.open_nursery() as nursery:
        nursery.start_soon(roles.run_origin, settings)
        with trio.fail_after(60):
            await finished.wait()
        nursery.cancel_scope.cancel()
    return ends


async def test_a_step_made_ready_just_before_the_marker_is_published_before_the_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The trainer writes its last step, then the finished marker, while the origin scans
    ``WATCH``, after its listing: the end is signed once, at that step. (With the marker read
    after the scan, the run ended at the step before, so ``--exit-on-finish`` followers left
    without the last step, and the end was signed again once it was published.)"""
    watch = tmp_path / "watch"

    def during_scan(newest: int | None) -> None:
        if newest == 0 and not (watch / "FINISHED").exists():  # step 0 is out: the last
            _write(watch, 1)  # step and the marker come now (the listing still lacks them)
            (watch / "FINISHED").write_text("")

    ends = await _origin_passes(
        tmp_path, monkeypatch, during_scan, lambda _, e: e is True, after_listing=True
    )
    assert ends == [1]


async def test_a_marker_removed_as_the_next_step_comes_does_not_end_the_run_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run ended at step 0; a restarted trainer removes the marker and writes step 1
    while the origin scans ``WATCH``, before its listing: step 1 is published and no end is
    signed at it, in that pass or the next three. (With the marker read only before the
    scan, the run ended at step 1.)"""
    watch = tmp_path / "watch"
    (watch / "FINISHED").parent.mkdir(parents=True, exist_ok=True)
    (watch / "FINISHED").write_text("")
    passes_at_1: list[int] = []

    def during_scan(newest: int | None) -> None:
        if newest == 0 and (watch / "FINISHED").exists() and not (watch / "step-1").exists():
            (watch / "FINISHED").unlink()  # the restarted trainer: no end, then its next step
            _write(watch, 1)

    def done(latest: int | None, _ended: bool | None) -> bool:
        if latest == 1:
            passes_at_1.append(1)
        return len(passes_at_1) >= 4

    ends = await _origin_passes(tmp_path, monkeypatch, during_scan, done, after_listing=False)
    assert ends == [0]
