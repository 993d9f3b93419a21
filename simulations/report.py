"""Reports: a run's summary as JSON, a Markdown table and PNG plots; two runs side by side.

:func:`write` makes ``OUT/summary.json`` (the schema of :mod:`simulations.summary`),
``OUT/summary.md`` and three plots (matplotlib, Agg backend, no display needed):

- ``cdf.png``: CDF of the time honest peers took to commit each version (from publication);
- ``bytes_per_tier.png``: bytes sent and received by the origin, the relays and the peers;
- ``timeline.png``: fraction of version 0's shards verified over time, for a sample of peers,
  with first-byte and commit marks.

:func:`compare` puts two report directories side by side (``compare.md``, ``compare_cdf.png``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def markdown(summary: dict[str, Any]) -> str:
    """The Markdown report of one run."""
    run = summary["run"]
    ck = summary["checkpoint"]
    lines = [
        f"# {summary['mode']}: {summary['topology']}",
        "",
        f"checkpoint {ck['size_bytes'] / GB:.3f} GB in {ck['n_shards']} shards of "
        f"{ck['shard_size_bytes'] / 1e6:.2f} MB, {ck['versions']} version(s), "
        f"scale {ck.get('scale', 1.0):g}",
        "",
        "| version | time to last peer s | mean peer s | peers committed |",
        "|---|---|---|---|",
    ]
    for step, last in run["time_to_last_peer_s"].items():
        lines.append(
            f"| {step} | {_fmt_s(last)} | {_fmt_s(run['mean_peer_s'].get(step))} | "
            f"{run.get('peers_committed', {}).get(step, '—')} |"
        )
    ro = run.get("rollouts", {})
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
    lines += [
        "",
        "| node | role | behavior | version | first byte s | commit s | duration s | sent GB "
        "| received GB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, n in summary["nodes"].items():
        for step, v in n["versions"].items():
            lines.append(
                f"| {name} | {n['role']} | {n['behavior']} | {step} | "
                f"{_fmt_s(v.get('first_byte_s'))} | {_fmt_s(v.get('commit_s'))} | "
                f"{_fmt_s(v.get('duration_s'))} | {n['bytes_up'] / GB:.3f} | "
                f"{n['bytes_down'] / GB:.3f} |"
            )
    return "\n".join(lines) + "\n"


def plot_cdf(summaries: list[tuple[str, dict[str, Any]]], path: Path) -> None:
    """CDF of peers' commit durations, one line per (run, version)."""
    plt = _mpl()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, s in summaries:
        for step in s["run"]["time_to_last_peer_s"]:
            d = durations(s, step)
            if d:
                ys = [(k + 1) / len(d) for k in range(len(d))]
                ax.step([0.0, *d], [0.0, *ys], where="post", label=f"{label} v{step}")
    ax.set_xlabel("time from publication to commit (s)")
    ax.set_ylabel("fraction of honest peers")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
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
    """Shards verified over time for the sampled peers (version 0)."""
    plt = _mpl()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, curve in sorted(summary.get("progress", {}).items()):
        if curve:
            ax.plot([p[0] for p in curve], [p[1] for p in curve], lw=1, label=name)
    ax.set_xlabel("time from publication of version 0 (s)")
    ax.set_ylabel("fraction of shards verified")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    if summary.get("progress"):
        ax.legend(fontsize=7, ncol=2)
    ax.set_title(f"timeline: {summary['topology']} ({summary['mode']})")
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


def load(path: Path) -> dict[str, Any]:
    """A summary from a report directory or a summary.json file."""
    p = path / "summary.json" if path.is_dir() else path
    data: dict[str, Any] = json.loads(p.read_text())
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
