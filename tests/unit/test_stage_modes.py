"""The origin's staging of ``--watch`` checkpoints: files 0644, the directory 0755.

A web server (nginx serving a mirror, say) running as another user must be able to read what
the origin commits; a file whose mode cannot be set gets one warning naming it.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from shardnet.roles import stage_checkpoint


def _mode(p: Path) -> int:
    return stat.S_IMODE(p.stat().st_mode)


def _watch_dir(tmp: Path) -> Path:
    src = tmp / "watch" / "step-3"
    src.mkdir(parents=True)
    for name, mode in (("model.safetensors", 0o600), ("config.json", 0o755), ("ok.json", 0o644)):
        (src / name).write_text(name)
        os.chmod(src / name, mode)
    (src / ".hidden").write_text("x")
    (src / "sub").mkdir()
    os.chmod(src, 0o700)
    return src


def test_staged_files_are_0644_links_and_dir_0755(tmp_path: Path) -> None:
    src = _watch_dir(tmp_path)
    old = os.umask(0o077)  # a trainer's private umask must not leak into the store
    try:
        dst = tmp_path / "data" / "staging" / "step-3"
        assert stage_checkpoint(src, dst) == []
    finally:
        os.umask(old)
    assert sorted(p.name for p in dst.iterdir()) == ["config.json", "model.safetensors", "ok.json"]
    assert _mode(dst) == 0o755
    for p in dst.iterdir():
        assert _mode(p) == 0o644, p
        assert p.stat().st_ino == (src / p.name).stat().st_ino  # linked, not copied
        assert p.read_text() == p.name


def test_a_linked_file_that_cannot_be_changed_is_copied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _watch_dir(tmp_path)
    real_chmod, refused = os.chmod, []

    def chmod(path: object, mode: int) -> None:  # the trainer's inode belongs to another user
        target = Path(str(path))
        if target.parent.name == "step-3" and target.stat().st_nlink > 1:
            refused.append(target.name)
            raise PermissionError(1, "Operation not permitted", str(path))
        real_chmod(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "chmod", chmod)
    dst = tmp_path / "staging" / "step-3"
    assert stage_checkpoint(src, dst) == []
    assert sorted(refused) == ["config.json", "model.safetensors"]
    for name in ("config.json", "model.safetensors"):
        assert _mode(dst / name) == 0o644
        assert (dst / name).stat().st_ino != (src / name).stat().st_ino  # a copy
        assert _mode(src / name) != 0o644  # the trainer's file is untouched
        assert (dst / name).read_text() == name


def test_a_mode_that_cannot_be_set_is_one_warning_naming_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    src = _watch_dir(tmp_path)
    real_chmod = os.chmod

    def chmod(path: object, mode: int) -> None:  # e.g. a file system without Unix modes
        if Path(str(path)).name == "model.safetensors":
            raise PermissionError(1, "Operation not permitted", str(path))
        real_chmod(path, mode)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "chmod", chmod)
    dst = tmp_path / "staging" / "step-3"
    old = os.umask(0o077)  # the copy made instead of the link is private too
    try:
        with caplog.at_level(logging.WARNING, logger="shardnet.roles"):
            assert stage_checkpoint(src, dst) == [dst / "model.safetensors"]
    finally:
        os.umask(old)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1, warnings
    assert "staged_file_mode" in warnings[0]
    assert str(dst / "model.safetensors") in warnings[0]
    assert "mode=0600" in warnings[0]
    assert (dst / "model.safetensors").read_text() == "model.safetensors"
    assert _mode(dst / "config.json") == 0o644
