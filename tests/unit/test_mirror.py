"""Static mirror export (layout, permissions, atomic and incremental), mirror polls, URLs."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from typer.testing import CliRunner

from p2p.errors import ConfigError
from p2p.identity import Identity
from shardcast.core.mirrorpoll import MirrorPoll
from shardcast.publish.plan import build_manifest
from shardcast.serve.mirror import PREFIX, export_mirror
from shardcast.store.store import VersionStore
from shardcast.wire.lane_auth import FAILED_HEADER, failed_header
from shardcast.wire.lane_urls import check_mirror_url
from shardcast.wire.manifest import Manifest
from tests.helpers import TRAINER, make_checkpoint, trust

SIZES = {"model-00001-of-00002.safetensors": 4096, "model-00002-of-00002.safetensors": 2500}


def _store(root: Path, steps: range, keep_last: int = 4) -> VersionStore:
    store = VersionStore(root / "versions", "run", keep_last=keep_last)
    for step in steps:
        _publish(store, root, step)
    return store


def _publish(store: VersionStore, root: Path, step: int) -> Manifest:
    ck = make_checkpoint(root / f"ck{step}", SIZES, seed=step)
    m = build_manifest(ck, "run", step, TRAINER, shard_size=1000)
    store.adopt(ck, m)
    return m


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def test_export_layout_is_the_lane_url_layout(tmp_path: Path) -> None:
    store = _store(tmp_path, range(2))
    out = tmp_path / "www"
    r = export_mirror(store, out, trainer_id=TRAINER.peer_id)
    assert (r.exported, r.skipped, r.copied) == ([0, 1], {}, 0)
    run = out / PREFIX / "run"
    assert r.run_dir == run
    digests = {str(s): store.load_manifest(s, trust()).digest for s in (0, 1)}
    assert json.loads((run / "versions").read_bytes()) == {
        "committed": [0, 1],
        "in_progress": [],
        "digests": digests,
    }
    for step in (0, 1):
        m = store.load_manifest(step, trust())
        v = run / str(step) / m.digest  # a version is (step, digest), as on the lane
        assert [p.name for p in (run / str(step)).iterdir()] == [m.digest]
        assert Manifest.decode((v / "manifest").read_bytes(), trust=trust()).digest == m.digest
        n = len(m.header.shards)
        bits = (v / "have").read_bytes()
        assert len(bits) == (n + 7) // 8
        assert sum(bin(b).count("1") for b in bits) == n  # every shard, MSB first
        assert bits[-1] & 1 == (1 if n % 8 == 0 else 0)
        for f in m.header.files:
            served = v / "files" / f.name
            held = store.version_dir(step) / f.name
            assert served.read_bytes() == held.read_bytes()
            assert served.stat().st_ino == held.stat().st_ino  # a hard link, no copy
            assert _mode(served) == 0o644
    v0 = run / "0" / digests["0"]
    for d in (out, out / "shardnet", out / PREFIX, run, run / "0", v0, v0 / "files"):
        assert _mode(d) == 0o755, d
    assert not list(run.glob(".tmp-*"))


def test_export_is_incremental_replaces_and_prunes(tmp_path: Path) -> None:
    store = _store(tmp_path, range(2), keep_last=2)
    out = tmp_path / "www"
    export_mirror(store, out)
    run = out / PREFIX / "run"
    d1 = store.load_manifest(1, trust()).digest
    before = (run / "1" / d1 / "manifest").stat().st_ino
    # a step exported with another manifest is replaced, the same one left alone
    (run / "0" / store.load_manifest(0, trust()).digest / "manifest").write_bytes(b"{}")
    _publish(store, tmp_path, 2)  # keep_last=2: step 0 leaves the store
    r = export_mirror(store, out)
    assert (r.exported, r.unchanged, r.pruned) == ([2], [1], [0])
    assert (run / "1" / d1 / "manifest").stat().st_ino == before
    assert not (run / "0").exists()
    assert json.loads((run / "versions").read_bytes())["committed"] == [1, 2]
    r = export_mirror(store, out, prune=False)
    assert (r.exported, r.unchanged) == ([], [1, 2])


def test_a_step_republished_under_another_digest_replaces_the_old_one(tmp_path: Path) -> None:
    store = _store(tmp_path, range(1))
    out = tmp_path / "www"
    old = store.load_manifest(0, trust()).digest
    export_mirror(store, out)
    store.discard(0)
    ck = make_checkpoint(tmp_path / "other0", SIZES, seed=99)  # step 0 again, other content
    new = store.adopt(ck, build_manifest(ck, "run", 0, TRAINER, shard_size=1000))
    assert new == store.version_dir(0)
    digest = store.load_manifest(0, trust()).digest
    assert digest != old
    r = export_mirror(store, out)
    assert (r.exported, r.digests) == ([0], {0: digest})
    run = out / PREFIX / "run"
    assert [p.name for p in (run / "0").iterdir()] == [digest]  # the old digest is gone
    assert json.loads((run / "versions").read_bytes())["digests"] == {"0": digest}


def test_damaged_or_foreign_versions_are_never_exported(tmp_path: Path) -> None:
    store = _store(tmp_path, range(2))
    name = sorted(SIZES)[0]
    with open(store.version_dir(1) / name, "r+b") as fh:  # damaged after commit
        fh.write(b"\x00" * 10)
    out = tmp_path / "www"
    r = export_mirror(store, out)
    assert r.steps == [0]
    assert "does not match" in r.skipped[1]
    assert not (out / PREFIX / "run" / "1").exists()  # no directory of any digest
    assert json.loads((out / PREFIX / "run" / "versions").read_bytes())["committed"] == [0]
    other = Identity.from_seed("someone-else").peer_id
    r = export_mirror(store, tmp_path / "www2", trainer_id=other)
    assert (r.steps, sorted(r.skipped)) == ([], [0, 1])


def test_unreadable_files_are_copied_readable(tmp_path: Path) -> None:
    store = _store(tmp_path, range(1))
    name = sorted(SIZES)[0]
    held = store.version_dir(0) / name
    os.chmod(held, 0o600)
    r = export_mirror(store, tmp_path / "www")
    digest = store.load_manifest(0, trust()).digest
    served = tmp_path / "www" / PREFIX / "run" / "0" / digest / "files" / name
    assert r.copied == 1
    assert (_mode(served), _mode(held)) == (0o644, 0o600)  # the store is left as it was
    assert served.read_bytes() == held.read_bytes()


def test_cli_export(tmp_path: Path) -> None:
    from shardnet.cli import app

    _store(tmp_path / "data", range(1))
    out = tmp_path / "www"
    runner = CliRunner()
    result = runner.invoke(
        app, ["mirror", "export", "--data-dir", str(tmp_path / "data"), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "steps [0]" in result.output
    assert len(list((out / PREFIX / "run" / "0").glob("*/manifest"))) == 1
    for args, msg in [
        (["--data-dir", str(tmp_path / "nope")], "--data-dir"),
        (["--data-dir", str(tmp_path / "data"), "--run-id", "other"], "holds no versions"),
        (["--data-dir", str(tmp_path / "data"), "--trainer-id", "x"], "--trainer-id"),
    ]:
        result = runner.invoke(app, ["mirror", "export", "--out", str(out), *args])
        assert result.exit_code == 2, result.output
        assert msg in result.output
        assert "Traceback" not in result.output


def test_mirror_poll() -> None:
    poll = MirrorPoll("http://m:80")
    assert poll.answered(b'{"committed": [3, 1], "in_progress": []}', 100.0)
    assert (poll.steps, poll.heard, poll.error) == (frozenset({1, 3}), 100.0, None)
    assert not poll.answered(b'{"committed": [1, 3]}', 101.0)  # nothing changed
    for bad in (
        b"nope",
        b'{"committed": 3}',
        b'{"committed": ["1"]}',
        b'{"committed": [-1]}',
        b'{"committed": [true]}',
        b"[]",
    ):
        poll = MirrorPoll("http://m:80", steps=frozenset({1}))
        assert poll.answered(bad, 1.0)  # first failure in a row: report it
        assert (poll.steps, poll.failures) == (frozenset({1}), 1)  # kept: verified when used
        assert poll.error is not None
        assert not poll.failed("again")
    assert poll.answered(b'{"committed": [1]}', 2.0)  # recovered
    assert poll.failures == 0
    assert not poll.holds(1, "a" * 64)  # an older export names no digest: no source of it


def test_mirror_poll_digests() -> None:
    poll = MirrorPoll("http://m:80")
    doc = {"committed": [1, 2], "in_progress": [], "digests": {"1": "a" * 64, "2": "b" * 64}}
    assert poll.answered(json.dumps(doc).encode(), 1.0)
    assert poll.holds(1, "a" * 64)
    assert not poll.holds(1, "b" * 64)  # the step under another digest: not a source
    assert not poll.holds(3, "a" * 64)
    doc["digests"] = {"1": "c" * 64, "2": "b" * 64}
    assert poll.answered(json.dumps(doc).encode(), 2.0)  # a republished step is a change
    assert poll.holds(1, "c" * 64)
    for bad in ({"1": "A" * 64}, {"x": "a" * 64}, {"1": 5}, ["a"]):
        poll = MirrorPoll("http://m:80")
        assert poll.answered(json.dumps({"committed": [1], "digests": bad}).encode(), 1.0)
        assert poll.error is not None


@pytest.mark.parametrize(
    ("url", "ok"),
    [
        ("http://127.0.0.1:8080", "http://127.0.0.1:8080"),
        ("http://mirror.example/", "http://mirror.example"),
        ("http://cdn.example/relay-a/", "http://cdn.example/relay-a"),
        ("https://cdn.example", None),
        ("http://0.0.0.0:80", None),
        ("http://cdn.example/?x=1", None),
        ("http://u:p@cdn.example", None),
        ("http://cdn.example:99999", None),
        ("cdn.example", None),
    ],
)
def test_mirror_urls(url: str, ok: str | None) -> None:
    if ok is None:
        with pytest.raises(ConfigError):
            check_mirror_url(url, "mirror")
    else:
        assert check_mirror_url(url, "mirror") == ok


def test_failed_header_names_nodes_only() -> None:
    pid = TRAINER.peer_id
    assert failed_header(["http://127.0.0.1:8080", pid]) == [(FAILED_HEADER, pid)]
    assert failed_header(["http://127.0.0.1:8080"]) == []
