"""Reports: a run's summary as JSON, a Markdown table and PNG plots; two runs side by side.

:func:`write` makes ``OUT/summary.json`` (the schema of :mod:`simulations.summary`),
``OUT/summary.md`` and three plots (matplotlib, Agg backend, no display needed):

- ``cdf.png``: CDF of the time honest peers took to commit each version (from publication),
  its x axis starting near the first commit, the lower bound drawn as a dashed line;
- ``bytes_per_tier.png``: bytes sent and received by the origin, the relays and the peers;
- ``timeline.png``: fraction of version 0's shards verified over time across honest peers:
  median line, 10th–90th percentile and min–max bands, and the bound.

``summary.md`` holds percentiles per version and the slowest peers, so it stays short at
thousands of peers; ``summary.json`` keeps every node.

:func:`compare` puts two report directories side by side (``compare.md``, ``compare_cdf.png``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from p2p.errors import ShardnetError

GB = 1e9


def _mpl() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _fmt_s(v: float | None) -> str:
    return "—" if v is None else f"{v:,.1f}"


def durations(summary: dict[str, Any], step: str) -> list[float]:
    """Commit durations of honest peers for ``step``, seconds, sorted."""
    out = []
    for n in summary["nodes"].values():
        if n["role"] == "peer" and n["behavior"] == "honest":
            v = n["versions"].get(step)
            if v and v.get("duration_s") is not None:
                out.append(float(v["duration_s"]))
    return sorted(out)


SLOWEST = 10  # peers listed by name in summary.md


def _pct_cells(run: dict[str, Any], step: str) -> str:
    p = run.get("peer_percentiles_s", {}).get(step, {})
    return " | ".join(_fmt_s(p.get(k)) for k in ("p50", "p90", "p99"))


def _slowest(summary: dict[str, Any], k: int) -> list[tuple[str, str, dict[str, Any]]]:
    """The ``k`` (peer, version) pairs of honest peers with the longest durations."""
    rows = [
        (name, step, v)
        for name, n in summary["nodes"].items()
        if n["role"] == "peer" and n["behavior"] == "honest"
        for step, v in n["versions"].items()
        if v.get("duration_s") is not None
    ]
    rows.sort(key=lambda r: -float(r[2]["duration_s"]))
    return rows[:k]


def _peers_left_out(
    nodes: dict[str, Any], peers: dict[str, Any], honest: dict[str, Any], last_step: str
) -> list[str]:
    """Report lines on the peers not in the tables: dishonest ones by count per behaviour,
    and the honest ones without the last version (the first ``SLOWEST`` by name)."""
    lines: list[str] = []
    others: dict[str, int] = {}
    for n in peers.values():
        if n["behavior"] != "honest":
            others[n["behavior"]] = others.get(n["behavior"], 0) + 1
    if others:
        lines += ["", "Other peers: " + ", ".join(f"{c} {b}" for b, c in sorted(others.items()))]
    missing = sorted(
        k for k, n in honest.items() if n["versions"].get(last_step, {}).get("commit_s") is None
    )
    if missing:
        names = [m + (" (left)" if nodes[m].get("alive_at_end") is False else "") for m in missing]
        shown = ", ".join(names[:SLOWEST]) + (", …" if len(missing) > SLOWEST else "")
        lines += ["", f"Honest peers without version {last_step}: {len(missing)} ({shown})"]
    return lines


def markdown(summary: dict[str, Any]) -> str:
    """The Markdown report of one run: per-version percentiles, tiers, the slowest peers.

    Its length does not grow with the number of peers: peers appear by name only among the
    ``SLOWEST`` slowest, among the honest peers that never committed (first few), and by
    count per behaviour otherwise.
    """
    run = summary["run"]
    ck = summary["checkpoint"]
    nodes = summary["nodes"]
    peers = {k: n for k, n in nodes.items() if n["role"] == "peer"}
    honest = {k: n for k, n in peers.items() if n["behavior"] == "honest"}
    lines = [
        f"# {summary['mode']}: {summary['topology']}",
        "",
        f"checkpoint {ck['size_bytes'] / GB:.3f} GB in {ck['n_shards']} shards of "
        f"{ck['shard_size_bytes'] / 1e6:.2f} MB, {ck['versions']} version(s), "
        f"scale {ck.get('scale', 1.0):g}; {len(honest)} honest peer(s) of {len(peers)}",
        "",
        "Seconds from each version's publication to an honest peer's commit:",
        "",
        "| version | peers committed | median s | p90 s | p99 s | last peer s | mean s |",
        "|---|---|---|---|---|---|---|",
    ]
    for step, last in run["time_to_last_peer_s"].items():
        lines.append(
            f"| {step} | {run.get('peers_committed', {}).get(step, '—')}/{len(honest)} | "
            f"{_pct_cells(run, step)} | {_fmt_s(last)} | "
            f"{_fmt_s(run['mean_peer_s'].get(step))} |"
        )
    ro = run.get("rollouts", {})
    ready = run.get("time_to_last_ready_s") or {}
    if ready:
        lines += [
            "",
            "Seconds to the last honest peer's engine holding each version: "
            + ", ".join(f"{step}: {_fmt_s(s)}" for step, s in ready.items()),
        ]
    lines += [
        "",
        f"- bound S/B + (⌈log2(N+1)⌉−1)·s/B: {_fmt_s(run.get('bound_s'))} s",
        f"- origin egress: {run['origin_egress_bytes'] / GB:.3f} GB",
        f"- rollouts sent / accepted / rejected: {ro.get('sent', 0)} / "
        f"{ro.get('accepted', 0)} / {ro.get('rejected', 0)}",
        f"- wall time: {_fmt_s(run.get('wall_s'))} s",
    ]
    lines += [f"- {n}" for n in summary.get("notes", [])]
    lines += [
        "",
        "| tier | nodes | sent GB | received GB |",
        "|---|---|---|---|",
    ]
    for role, t in summary["tiers"].items():
        lines.append(
            f"| {role} | {t.get('nodes', 0)} | {t['bytes_up'] / GB:.3f} | "
            f"{t['bytes_down'] / GB:.3f} |"
        )
    lines += _peers_left_out(nodes, peers, honest, str(ck["versions"] - 1))
    slow = _slowest(summary, SLOWEST)
    if slow:
        lines += [
            "",
            f"Slowest {len(slow)} (peer, version) of {len(honest)} honest peers:",
            "",
            "| peer | group | version | first byte s | commit s | duration s | sent GB "
            "| received GB |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, step, v in slow:
            n = nodes[name]
            lines.append(
                f"| {name} | {n['group']} | {step} | {_fmt_s(v.get('first_byte_s'))} | "
                f"{_fmt_s(v.get('commit_s'))} | {_fmt_s(v.get('duration_s'))} | "
                f"{n['bytes_up'] / GB:.3f} | {n['bytes_down'] / GB:.3f} |"
            )
    return "\n".join(lines) + "\n"


def _honest_peers(summary: dict[str, Any]) -> int:
    return sum(
        1 for n in summary["nodes"].values() if n["role"] == "peer" and n["behavior"] == "honest"
    )


def _colors(plt: Any, n: int) -> list[Any]:
    """``n`` distinct colours: tab10 up to 10, else a sequential map (no repeats)."""
    cmap = plt.get_cmap("tab10" if n <= 10 else "viridis")
    return [cmap(i if n <= 10 else i / max(1, n - 1)) for i in range(n)]


def plot_cdf(summaries: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    """CDF of honest peers' commit durations, one line per (run, version), with the bound.

    The x axis starts near the first commit (not at 0, which would squeeze the curve into
    the right edge) and includes each run's bound, drawn as a dashed vertical line.
    """
    plt = _mpl()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = [
        (label, s, step, durations(s, step))
        for label, s in summaries
        for step in s["run"]["time_to_last_peer_s"]
    ]
    lines = [ln for ln in lines if ln[3]]
    xs: list[float] = []
    styles = ("--", ":", "-.", (0, (5, 1, 1, 1)))
    for (label, s, step, d), color in zip(lines, _colors(plt, len(lines)), strict=True):
        n = max(len(d), _honest_peers(s))  # peers that never committed keep the curve below 1
        ys = [(k + 1) / n for k in range(len(d))]
        ax.step(
            [d[0], *d],
            [0.0, *ys],
            where="post",
            color=color,
            label=f"{label} v{step} ({len(d)}/{n})",
        )
        xs += [d[0], d[-1]]
    bounds = {
        (label, float(s["run"]["bound_s"]))
        for label, s in summaries
        if s["run"].get("bound_s") is not None
    }
    for k, (label, b) in enumerate(sorted(bounds, key=lambda x: x[1])):
        ax.axvline(
            b,
            color="0.3",
            ls=styles[k % len(styles)],
            lw=1,
            label=f"bound {label} (full version): {b:,.1f} s",
        )
        xs.append(b)
    if xs:
        lo, hi = min(xs), max(xs)
        pad = max(0.05 * (hi - lo), 0.01 * hi, 1e-3)
        ax.set_xlim(max(0.0, lo - pad), hi + pad)
    ax.set_xlabel("time from publication to commit (s)")
    ax.set_ylabel("fraction of honest peers committed")
    ax.set_ylim(0, 1.0)
    ax.grid(alpha=0.3)
    if len(lines) + len(bounds) <= 14:
        ax.legend(fontsize=8, loc="lower right")
    ax.set_title("completion time across peers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_tiers(summary: dict[str, Any], path: Path) -> None:
    """Bytes sent and received per tier."""
    plt = _mpl()
    tiers = summary["tiers"]
    roles = [r for r in ("origin", "relay", "peer") if r in tiers]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = range(len(roles))
    ax.bar([x - 0.2 for x in xs], [tiers[r]["bytes_up"] / GB for r in roles], 0.4, label="sent")
    ax.bar(
        [x + 0.2 for x in xs], [tiers[r]["bytes_down"] / GB for r in roles], 0.4, label="received"
    )
    ax.set_xticks(list(xs), [f"{r} ({tiers[r].get('nodes', 0)})" for r in roles])
    ax.set_ylabel("GB")
    ax.set_title("bytes per tier")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_timeline(summary: dict[str, Any], path: Path) -> None:
    """Version 0's shards verified over time across honest peers: median and bands."""
    plt = _mpl()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    prog = summary.get("progress") or {}
    q = prog.get("quantiles", {})
    if q:
        t = prog["t_s"]
        ax.fill_between(t, q["0"], q["100"], color="C0", alpha=0.15, lw=0, label="min–max")
        ax.fill_between(t, q["10"], q["90"], color="C0", alpha=0.35, lw=0, label="10th–90th pct")
        ax.plot(t, q["50"], color="C0", lw=1.5, label="median")
        b = summary["run"].get("bound_s")
        if b is not None:
            ax.axvline(b, color="0.3", ls="--", lw=1, label=f"bound (full version) {b:,.1f} s")
        ax.legend(fontsize=8, loc="upper left")
    ax.set_xlabel("time from publication of version 0 (s)")
    ax.set_ylabel("fraction of version 0's shards verified")
    ax.set_ylim(0, 1.0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    ax.set_title(f"{summary['topology']} ({summary['mode']}): {prog.get('peers', 0)} honest peers")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write(summary: dict[str, Any], out: Path) -> Path:
    """Write JSON, Markdown and PNGs of one run into ``out`` (created); returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "summary.md").write_text(markdown(summary))
    plot_cdf([(summary["mode"], summary)], out / "cdf.png")
    plot_tiers(summary, out / "bytes_per_tier.png")
    plot_timeline(summary, out / "timeline.png")
    return out


class ReportError(ShardnetError):
    """A path that is not a simulation report (a directory with ``summary.json``, or that
    file)."""


def load(path: Path) -> dict[str, Any]:
    """A summary from a report directory or a summary.json file.

    Raises:
        ReportError: missing, unreadable, or not a summary (names the path).
    """
    p = path / "summary.json" if path.is_dir() else path
    try:
        data = json.loads(p.read_text())
    except (OSError, ValueError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ReportError(f"{path} is not a simulation report ({why})") from exc
    if not isinstance(data, dict) or "run" not in data or "mode" not in data:
        raise ReportError(f"{path} is not a simulation report (no summary in {p})")
    return data


def compare(a: Path, b: Path, out: Path) -> str:
    """Two runs side by side: ``out/compare.md`` and ``out/compare_cdf.png``; returns the md."""
    sa, sb = load(a), load(b)
    la, lb = f"{sa['mode']}:{sa['topology']}", f"{sb['mode']}:{sb['topology']}"
    if la == lb:
        la, lb = f"A {la}", f"B {lb}"
    ra, rb = sa["run"], sb["run"]
    rows = [
        (
            "time to last peer (max) s",
            ra.get("time_to_last_peer_max_s"),
            rb.get("time_to_last_peer_max_s"),
        ),
        ("bound s", ra.get("bound_s"), rb.get("bound_s")),
        ("origin egress GB", ra["origin_egress_bytes"] / GB, rb["origin_egress_bytes"] / GB),
        (
            "rollouts accepted",
            ra.get("rollouts", {}).get("accepted"),
            rb.get("rollouts", {}).get("accepted"),
        ),
        ("wall s", ra.get("wall_s"), rb.get("wall_s")),
    ]
    for step in sorted(set(ra["time_to_last_peer_s"]) | set(rb["time_to_last_peer_s"]), key=int):
        rows.insert(
            1 + int(step),
            (
                f"v{step} last peer s",
                ra["time_to_last_peer_s"].get(step),
                rb["time_to_last_peer_s"].get(step),
            ),
        )
    lines = [f"# {la} vs {lb}", "", f"| metric | {la} | {lb} | B/A |", "|---|---|---|---|"]
    for name, x, y in rows:
        ratio = (
            f"{y / x:.3f}"
            if isinstance(x, int | float) and isinstance(y, int | float) and x
            else "—"
        )
        fx = "—" if x is None else f"{x:,.3f}" if isinstance(x, float) else str(x)
        fy = "—" if y is None else f"{y:,.3f}" if isinstance(y, float) else str(y)
        lines.append(f"| {name} | {fx} | {fy} | {ratio} |")
    md = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(md)
    plot_cdf([(la, sa), (lb, sb)], out / "compare_cdf.png")
    return md
