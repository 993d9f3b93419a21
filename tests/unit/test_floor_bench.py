"""``bench/floor.py``, the loopback benchmark's floor: it moves and verifies the real bytes, its
failures are loud, and ``bench/broadcast.py`` reports its ratios against SHARDCAST."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from bench import broadcast

floor = broadcast._floor()


def _version(path: Path, rng: random.Random, sizes: dict[str, int]) -> Path:
    path.mkdir()
    for name, size in sizes.items():
        (path / name).write_bytes(rng.randbytes(size))
    return path


def test_floor_delivers_every_byte_to_every_receiver(tmp_path: Path) -> None:
    rng = random.Random(7)
    sizes = {"a.safetensors": 3 * floor.BUF_BYTES + 12345, "b.json": 17, "empty": 0}
    v0 = _version(tmp_path / "v0", rng, sizes)
    v1 = _version(tmp_path / "v1", rng, sizes)
    out = floor.run_floor(v0, v1, tmp_path / "work", timeout_s=60)
    full, nxt = out["versions"]
    assert out["system"] == "floor"
    assert full["origin_bytes"] == sum(sizes.values())
    assert set(full["peers_s"]) == {"relay1", "relay2", "peer1", "peer2", "peer3", "peer4"}
    assert 0 < full["first_s"] <= full["last_s"]
    assert set(full["cpu_s"]) == set(full["peers_s"]) | {"origin"}
    assert nxt["step"] == 1
    assert nxt["origin_bytes"] == 0
    for node in full["peers_s"]:
        for step in ("step-0", "step-1"):  # the next version's floor copies the previous one
            for name in sizes:
                got = (tmp_path / "work" / node / step / name).read_bytes()
                assert got == (v0 / name).read_bytes(), (node, step, name)


def test_floor_fails_when_a_receiver_gets_other_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    v0 = _version(tmp_path / "v0", random.Random(1), {"a": 1 << 20})
    v1 = _version(tmp_path / "v1", random.Random(2), {"a": 1 << 20})
    real = floor.blake3.blake3

    class OtherBytes:
        """The expected digest (taken in this process) is of other bytes than the file's."""

        def __init__(self) -> None:
            self.h = real()

        def update_mmap(self, path: Path) -> OtherBytes:
            self.h.update(b"not the file")
            return self

        def hexdigest(self) -> str:
            return str(self.h.hexdigest())

    monkeypatch.setattr(floor.blake3, "blake3", OtherBytes)
    with pytest.raises(RuntimeError, match="other bytes than were sent"):
        floor.run_floor(v0, v1, tmp_path / "work", timeout_s=60)


def test_floor_ratios_in_the_summary(capsys: pytest.CaptureFixture[str]) -> None:
    def run(system: str, full: float, nxt: float) -> dict[str, object]:
        return {
            "system": system,
            "versions": [
                {
                    "step": 0,
                    "first_s": full,
                    "last_s": full,
                    "origin_bytes": 10,
                    "relay_bytes": None,
                },
                {"step": 1, "first_s": nxt, "last_s": nxt, "origin_bytes": 1, "relay_bytes": None},
            ],
        }

    runs = {
        "shardcast": [run("shardcast", 40.0, 36.0), run("shardcast", 30.0, 30.0)],
        "floor": [run("floor", 12.0, 9.0), run("floor", 14.0, 9.0)],
    }
    out = broadcast.summarize(runs, 10, 1e9)  # type: ignore[arg-type]
    assert out["floor_full_ratio_vs_shardcast"] == pytest.approx(13.0 / 35.0, abs=1e-4)
    assert out["floor_delta_ratio_vs_shardcast"] == pytest.approx(9.0 / 33.0, abs=1e-4)
    out["checkpoint"] = {}
    broadcast.print_table(out)
    assert "no system can go below these ratios" in capsys.readouterr().out


def test_unknown_or_shaped_floor_is_one_line_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert broadcast.main(["--systems", "shardnet", "bittorrent"]) == 2
    err = capsys.readouterr().err
    assert "bittorrent" in err
    assert err.count("\n") == 1
    assert broadcast.main(["--shaped", "1G", "--systems", "floor"]) == 2
    err = capsys.readouterr().err
    assert "floor runs on loopback only" in err
    assert err.count("\n") == 1


def test_floor_cli_refuses_bad_dirs_without_touching_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keep = tmp_path / "keep"
    keep.mkdir()
    (keep / "data").write_text("mine")
    assert floor.main([str(tmp_path / "missing"), str(keep), str(tmp_path / "w")]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    assert floor.main([str(keep), str(keep), str(keep)]) == 2  # an existing workdir is refused
    assert "exists" in capsys.readouterr().err
    assert (keep / "data").read_text() == "mine"


def test_an_unusable_workdir_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    assert broadcast.main(["--workdir", str(blocker / "runs")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"broadcast: --workdir {blocker / 'runs'}: ")
    assert err.count("\n") == 1
    made = tmp_path / "new" / "runs"
    assert broadcast.main(["--workdir", str(made), "--systems", "nope"]) == 2
    assert not made.exists()  # argument errors come first: nothing created
