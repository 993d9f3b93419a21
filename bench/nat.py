"""NAT bench: six peers, four behind two home routers, in four modes against all-public.

Theory of operation
-------------------
Each mode is one run of the README's role commands on network namespaces
(:func:`tests.deploy.natrun.run_mode`, the topology of tests/deploy/test_nat.py grown to issue
25's six peers, four of them behind two routers), one after the other, each on a fresh lab torn
down at its end (also on failure, Ctrl-C or SIGTERM):

- ``all-public``: no routers, every peer on the public bridge (the baseline);
- ``endpoint-independent``: plain masquerade (hole punching works);
- ``symmetric``: ``masquerade fully-random`` (punches between NATed peers cannot meet);
- ``download-only``: endpoint-independent routers, NATed peers run with
  ``--no-serve-behind-nat`` (no stream lane, no relay slot: what they did before issue 25).

The relay's and the public peers' links are shaped (tc tbf, ``--public-mbit``) so that the
NATed peers' uplinks (1 Gb/s) matter. The trainer publishes ``--steps + 1`` whole versions of
its tiny model (1.65 MB in 26 shards of 64 KiB, no deltas) that the relay super-seeds.

Per mode the table gives the full-version time from publication to the last peer's commit
(version 0, and the median over the later versions), whether every peer committed every
version, rollouts accepted, the share of bytes peers (and the relay) got from peers by path
(public TCP lane, a NATed peer's outbound connection, hole-punched, LAN), punches made and
direct, and the ratio of the time to the all-public run's. Issue 25's targets: endpoint-
independent <= 1.2x all-public (median later version); symmetric no slower than download-only.

Needs root, iproute2 and nft. Takes about 2-4 minutes a mode on a 2-core machine (start:
about a minute of torch imports), 10-11 minutes in all with the default 3 steps:

    sudo .venv/bin/python bench/nat.py --json bench/results/nat.json
    sudo .venv/bin/python bench/nat.py --quick             # 2 steps, a smoke run

``--keep DIR`` keeps every host's directory (its node's ``.err`` log, reports); with
``SHARDNET_LOG_LEVEL=DEBUG`` in the environment the nodes log each transfer
(``transfer_ended``: shard, source, outcome, seconds).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.deploy.hosts import Hosts, available
from tests.deploy.natrun import PEER_PATHS, Mode, ModeResult, run_mode

EIM_TARGET = 1.2  # endpoint-independent / all-public, full-version time
BASELINE = Mode.PUBLIC.value


def _ratio(t: float | None, base: float | None) -> float | None:
    return t / base if t is not None and base else None


def table(results: list[ModeResult]) -> list[dict[str, Any]]:
    """One row per result: its times (seconds), checks, path shares and punches, and the
    ratios of its times to the ``all-public`` result's (None without one, or a time missing)."""
    base = next((r for r in results if r.mode == BASELINE), None)
    rows = []
    for r in results:
        first, later = r.first_s(), r.later_median_s()
        rows.append(
            {
                "mode": r.mode,
                "first_s": first,
                "later_median_s": later,
                "version_s": r.version_s,
                "every_version": r.every_version,
                "accepted": r.accepted,
                "shares": r.shares(),
                "bytes_by_path": r.bytes_by_path,
                "punches": r.punches,
                "phases_s": r.phases_s,
                "first_ratio": _ratio(first, base.first_s() if base else None),
                "later_ratio": _ratio(later, base.later_median_s() if base else None),
            }
        )
    return rows


def targets(rows: list[dict[str, Any]]) -> dict[str, bool | None]:
    """Issue 25's speed targets over :func:`table`'s rows (None: a run is missing):
    endpoint-independent within :data:`EIM_TARGET` of all-public, and symmetric no slower
    than download-only (median later version)."""
    by = {r["mode"]: r for r in rows}
    eim = by.get(Mode.EIM.value, {}).get("later_ratio")
    sym = by.get(Mode.SYMMETRIC.value, {}).get("later_median_s")
    dl = by.get(Mode.DOWNLOAD_ONLY.value, {}).get("later_median_s")
    return {
        "eim_within_1.2x_public": None if eim is None else eim <= EIM_TARGET,
        "symmetric_not_slower_than_download_only": (
            None if sym is None or dl is None else sym <= dl
        ),
    }


def _f(x: float | None, fmt: str) -> str:
    return "-" if x is None else format(x, fmt)


def render(rows: list[dict[str, Any]]) -> str:
    """:func:`table`'s rows as a text table."""
    head = (
        f"{'mode':<21} {'v0 s':>6} {'later s':>7} {'x pub':>6} {'all':>4} {'acc':>4} "
        + " ".join(f"{p:>8}" for p in (*PEER_PATHS, "nated"))
        + f" {'punch':>6} {'direct':>6}"
    )
    lines = [head]
    for r in rows:
        s = r["shares"]
        lines.append(
            f"{r['mode']:<21} {_f(r['first_s'], '6.2f')} {_f(r['later_median_s'], '7.2f')} "
            f"{_f(r['later_ratio'], '6.2f')} {'yes' if r['every_version'] else 'NO':>4} "
            f"{r['accepted']:>4} "
            + " ".join(f"{s[p]:>8.1%}" for p in (*PEER_PATHS, "nated"))
            + f" {r['punches'].get('started', 0):>6} {r['punches'].get('direct', 0):>6}"
        )
    return "\n".join(lines)


def _terminate(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through Hosts.__exit__: nodes stopped, lab removed


def _parser() -> argparse.ArgumentParser:
    """The bench's command line (see :func:`main`)."""
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=3, help="trainer steps (versions 0..steps)")
    ap.add_argument("--quick", action="store_true", help="2 steps (a smoke run)")
    ap.add_argument(
        "--public-mbit",
        type=float,
        default=20.0,
        help="the relay's and public peers' links, Mb/s each way",
    )
    ap.add_argument(
        "--modes",
        default=",".join(m.value for m in Mode),
        help="comma-separated modes, run in this order (a mode may repeat)",
    )
    ap.add_argument("--json", type=Path, help="also write the rows and targets here")
    ap.add_argument(
        "--keep",
        type=Path,
        help="keep each mode's host directories (the nodes' logs, reports) under this "
        "directory (it must not exist) instead of a temporary one",
    )
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the bench; 0, 2 if it cannot run here (not root, no nft), 130 if interrupted
    (SIGINT, SIGTERM: the current lab is removed first)."""
    args = _parser().parse_args(argv)
    ok, why = available()
    if not ok or shutil.which("nft") is None:
        print(f"nat bench: cannot run here: {why or 'nft (nftables) missing'}", file=sys.stderr)
        return 2
    try:
        modes = [Mode(m) for m in args.modes.split(",")]
    except ValueError as exc:
        print(f"nat bench: --modes: {exc}", file=sys.stderr)
        return 2
    steps = 2 if args.quick else args.steps
    signal.signal(signal.SIGTERM, _terminate)
    results: list[ModeResult] = []
    t0 = time.monotonic()
    if args.keep is not None:
        try:
            args.keep.mkdir(parents=True)
        except OSError as exc:
            print(f"nat bench: --keep: {exc}", file=sys.stderr)
            return 2
    with (
        contextlib.nullcontext(str(args.keep))
        if args.keep is not None
        else tempfile.TemporaryDirectory(prefix="nat-bench-")
    ) as tmp:
        for i, mode in enumerate(modes):
            t_mode = time.monotonic()
            # a mode repeated gets its own directory: reusing one would resume its trainer
            # from the previous run's last step, with nothing left to publish
            repeat = modes[:i].count(mode)
            name = mode.value if not repeat else f"{mode.value}-{repeat + 1}"
            try:
                with Hosts(Path(tmp) / name) as hosts:
                    results.append(
                        run_mode(hosts, mode, steps=steps, public_rate=args.public_mbit * 1e6 / 8)
                    )
            except KeyboardInterrupt:
                print(f"nat bench: interrupted in {mode.value}; lab removed", file=sys.stderr)
                return 130
            print(
                f"{mode.value}: {time.monotonic() - t_mode:.0f} s "
                + " ".join(f"{k}={v:.0f}" for k, v in results[-1].phases_s.items())
                + f", versions {results[-1].version_s}",
                file=sys.stderr,
            )
    rows = table(results)
    verdict = targets(rows)
    print(render(rows))
    print(" ".join(f"{k}={v}" for k, v in verdict.items()))
    print(f"total {time.monotonic() - t0:.0f} s, {steps} steps, public {args.public_mbit} Mb/s")
    if args.json:
        doc = {
            "steps": steps,
            "public_mbit": args.public_mbit,
            "wall_s": time.monotonic() - t0,
            "rows": rows,
            "targets": verdict,
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
