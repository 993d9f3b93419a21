"""The standalone origin's watched directory: which steps are ready, which were refused, and
the check that a safetensors file is whole before anything of it is signed."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from shardcast.publish.layout import CheckpointLayoutError, check_layout, check_weights_file
from shardcast.publish.watchdir import (
    EndAction,
    RefusedSteps,
    WatchChange,
    WatchPresence,
    changed_files,
    end_action,
    fingerprint,
    ready_steps,
)
from shardnet.roles import stage_checkpoint


def _weights(path: Path) -> bytes:
    save_file({"a": np.arange(1000, dtype=np.float32), "b": np.ones(7, np.int64)}, str(path))
    return path.read_bytes()


def test_a_whole_safetensors_file_passes_and_a_cut_one_is_refused(tmp_path: Path) -> None:
    whole = _weights(tmp_path / "w.safetensors")
    check_weights_file(tmp_path / "w.safetensors")
    cases = {
        "tail": (whole[:-100], "not fully covered"),
        "header": (whole[:40], "cut short inside its safetensors header"),
        "empty": (b"", "holds 0 bytes"),
        "longer": (whole + b"xx", "not fully covered"),
    }
    for name, (data, why) in cases.items():
        p = tmp_path / f"{name}.safetensors"
        p.write_bytes(data)
        with pytest.raises(CheckpointLayoutError, match=why):
            check_weights_file(p)


def test_bytes_that_declare_no_header_are_not_parsed(tmp_path: Path) -> None:
    """Seeded random bytes (test and benchmark checkpoints) declare no plausible header."""
    p = tmp_path / "r.safetensors"
    p.write_bytes(b"x" * 100)
    check_weights_file(p)


def test_check_layout_refuses_a_checkpoint_with_a_cut_weights_file(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    whole = _weights(ck / "model.safetensors")
    assert check_layout(ck) == ["config.json", "model.safetensors"]
    (ck / "model.safetensors").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(CheckpointLayoutError, match="still being written"):
        check_layout(ck)


def test_ready_steps_are_newer_ones_with_the_marker_in_order(tmp_path: Path) -> None:
    for step, marker in ((1, True), (2, False), (3, True), (10, True)):
        d = tmp_path / f"step-{step}"
        d.mkdir()
        if marker:
            (d / "DONE").write_text("")
    (tmp_path / "step-x").mkdir()
    assert ready_steps(tmp_path, "DONE", None) == [1, 3, 10]
    assert ready_steps(tmp_path, "DONE", 3) == [10]
    assert ready_steps(tmp_path / "missing", "DONE", None) == []


def test_a_refused_step_is_tried_again_only_when_its_files_change(tmp_path: Path) -> None:
    d = tmp_path / "step-4"
    d.mkdir()
    (d / "model.safetensors").write_bytes(b"cut")
    refused = RefusedSteps()
    before = fingerprint(d)
    assert refused.should_try(4, before)
    refused.refused(4, before)
    os.link(d / "model.safetensors", tmp_path / "staged")  # the origin's staging: same
    os.chmod(d / "model.safetensors", 0o644)  # ctime changed, not the fingerprint
    assert not refused.should_try(4, fingerprint(d))
    (d / "model.safetensors").write_bytes(b"whole now")
    assert refused.should_try(4, fingerprint(d))
    refused.refused(5, before)
    refused.published(4)  # 4 and older are forgotten; 5 is still refused
    assert len(refused) == 1
    assert refused.should_try(4, before)


def test_staging_leaves_the_ready_marker_out(tmp_path: Path) -> None:
    src = tmp_path / "step-0"
    src.mkdir()
    (src / "config.json").write_text("{}")
    (src / "DONE").write_text("")
    stage_checkpoint(src, tmp_path / "staged", "DONE")
    assert sorted(p.name for p in (tmp_path / "staged").iterdir()) == ["config.json"]


def test_the_finished_marker_ends_or_continues_the_run() -> None:
    finish, cont, none = EndAction.FINISH, EndAction.CONTINUE, EndAction.NONE
    table = {
        # (marker, ended, latest): action
        (True, None, None): none,  # nothing published: nothing to end
        (True, None, 3): finish,  # just started: sign what the marker says
        (True, False, 3): finish,
        (True, True, 3): none,  # already signed
        (False, None, 3): cont,  # just started: an earlier end may be in force
        (False, True, 3): cont,  # the marker was removed
        (False, False, 3): none,
    }
    for (marker, ended, latest), want in table.items():
        assert end_action(marker, marker, ended, latest) is want, (marker, ended, latest)
    for ended in (None, False, True):  # it came or went during the pass: the next one decides
        assert end_action(False, True, ended, 3) is none
        assert end_action(True, False, ended, 3) is none


def test_changed_files_of_a_published_version(tmp_path: Path) -> None:
    d = tmp_path / "step-0"
    d.mkdir()
    (d / "a.safetensors").write_bytes(b"a" * 10)
    (d / "config.json").write_text("{}")
    published = fingerprint(d)
    (d / ".tmp").write_bytes(b"x")  # hidden files are not the version's
    (d / "extra.json").write_text("{}")  # nor files added since
    os.chmod(d / "a.safetensors", 0o600)  # nor a new ctime
    assert changed_files(published, fingerprint(d)) == []
    with (d / "a.safetensors").open("r+b") as f:  # in place: new mtime
        f.write(b"b")
    os.utime(d / "a.safetensors", ns=(1, 1))
    (d / "config.json").unlink()
    assert changed_files(published, fingerprint(d)) == ["a.safetensors", "config.json"]


def test_the_watch_directory_missing_found_and_gone_is_said_once_each() -> None:
    p = WatchPresence()
    assert p.present is None
    assert p.seen(False) is WatchChange.MISSING  # the trainer creates it later
    assert p.seen(False) is None
    assert p.seen(True) is WatchChange.FOUND
    assert p.seen(True) is None
    assert p.seen(False) is WatchChange.GONE
    assert p.seen(False) is None
    assert p.seen(True) is WatchChange.FOUND
    there = WatchPresence()
    assert there.seen(True) is None  # present from the start: nothing to say
    assert there.seen(False) is WatchChange.GONE


def test_zero_padded_step_directories_are_not_steps_and_are_reported(tmp_path: Path) -> None:
    """``step-020`` was read as step 20 and then looked for as ``step-20`` (refused: no such
    directory). It is not a step; :func:`ready_steps` names it for the origin to say so once."""
    for name in ("step-0", "step-020", "step-7", "step-00"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "DONE").write_text("")
    (tmp_path / "step-030").write_text("")  # a file: not a step directory either way
    padded: set[str] = set()
    assert ready_steps(tmp_path, "DONE", None, padded) == [0, 7]
    assert padded == {"step-020", "step-00"}
    p = WatchPresence()
    assert p.padded(padded) == ["step-00", "step-020"]
    assert p.padded(padded | {"step-05"}) == ["step-05"]
    assert p.padded(padded) == []
