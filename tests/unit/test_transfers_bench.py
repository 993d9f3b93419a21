"""bench/transfers.py: reading nodes' DEBUG logs into per-link rates and the tail."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.transfers import Transfer, binned, load, report, tail

ORIGIN_ID = "12D3KooWOriginAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAorigin01"
RELAY_ID = "12D3KooWRelayBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBrelay001"


def _line(t: str, level: str, role: str, module: str, msg: str) -> str:
    return f"2026-12-04T22:08:{t}Z {level} {role} {module} {msg}\n"


def _logs(tmp_path: Path) -> Path:
    """An origin and a relay, as the nodes log them: the relay takes shard 0 from the origin
    (16 MB in 2 s, from 1 s after the announcement), is refused shard 1, then commits."""
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "origin.log").write_text(
        _line("30.000", "INFO", "origin", "p2p.host", f"host_started peer_id={ORIGIN_ID} addrs=x")
        + _line("31.000", "INFO", "origin", "shardcast.node.node",
                "version_announced run=b step=0 digest=ab")
    )  # fmt: skip
    ended = "shardcast.download.downloader"
    (logs / "relay1.log").write_text(
        _line("30.100", "INFO", "relay", "p2p.host", f"host_started peer_id={RELAY_ID} addrs=y")
        + _line("34.000", "DEBUG", "relay", ended, "transfer_ended step=0 shard=0 encoding=raw "
                "source=*origin01 start=0 length=16000000 outcome=OK bytes=16000000 s=2.000")
        + _line("34.100", "DEBUG", "relay", ended, "transfer_ended step=0 shard=1 encoding=raw "
                "source=*origin01 start=0 length=16000000 outcome=REFUSED bytes=0 s=0.100")
        + _line("34.200", "DEBUG", "relay", ended, "transfer_ended step=1 shard=0 encoding=raw "
                "source=*origin01 start=0 length=5 outcome=OK bytes=5 s=0.100")
        + _line("35.500", "INFO", "relay", "shardcast.store.store",
                "version_committed run=b step=0 files=1")
    )  # fmt: skip
    return logs


def test_load_names_the_sources_and_times_from_the_announcement(tmp_path: Path) -> None:
    transfers, commits = load(_logs(tmp_path), 0)
    assert [(t.receiver, t.source, t.shard, t.outcome, t.bytes) for t in transfers] == [
        ("relay1", "origin", 0, "OK", 16_000_000),
        ("relay1", "origin", 1, "REFUSED", 0),
    ]  # step 1's transfer is not step 0's
    assert transfers[0].t0 == pytest.approx(1.0)
    assert transfers[0].t1 == pytest.approx(3.0)
    assert commits == {"relay1": pytest.approx(4.5)}


def test_load_without_the_announcement_says_so(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no version_announced step=7"):
        load(_logs(tmp_path), 7)


def test_bytes_are_spread_over_the_transfer() -> None:
    t = Transfer("r", "o", 0, 0, 10, "OK", 10_000_000, 1.0, 3.0)  # 5 MB/s from 1 s to 3 s
    assert binned([t], 2.0) == {0: pytest.approx(5e6), 1: pytest.approx(5e6)}
    refused = Transfer("r", "o", 1, 0, 10, "REFUSED", 0, 3.0, 3.1)
    assert binned([refused], 2.0) == {}


def test_report_and_tail(tmp_path: Path) -> None:
    transfers, commits = load(_logs(tmp_path), 0)
    text = "\n".join(report(transfers, commits, 2.0))
    assert "relay1   commit=4.50   4.0   4.0" in text  # 16 MB over 2 s, half in each bin
    assert "MB by source origin=16; outcomes OK=1, REFUSED=1" in text
    assert "origin   total=    16 MB" in text
    lines = tail(transfers, "relay1", 2.5)
    assert len(lines) == 3  # the heading and both transfers ending after 2.5 s
    assert "shard=  0 src=origin " in lines[1]
