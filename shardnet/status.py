"""``shardnet status [ADDR|URL]``: ask a node how it and the network are doing.

A target is an HTTP lane URL (``http://host:8002``, ``host:8002``; ``/status`` is appended) or
a libp2p multiaddr with ``/p2p/<PeerID>``: then a throwaway identity asks the node's info
record over ``/shardnet/info/1.0.0`` for its HTTP lane URL, and reads ``/status`` there. The
document is :mod:`shardcast.node.nodestatus`'s.

Output: a set of tables (role, versions with progress, upstreams, known nodes; for the
trainer the network's versions at a glance and the rollouts), ``--json`` the document itself
(one object per line with ``--watch``), ``--watch`` a live view refreshed every
``interval_s`` seconds until Ctrl-C (written to a file or a pipe: one view after another,
each under a time rule).

Exit status: 0; 1 when the node cannot be reached or answers garbage (one line on stderr);
2 for a target that is neither a URL nor a multiaddr with a PeerID.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from typing import Any
from urllib.parse import urlsplit

import trio
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from p2p.errors import ConfigError, ShardnetError, short_id

DEFAULT_TARGET = "http://127.0.0.1:8001"
MAX_STATUS_BYTES = 16 << 20
TIMEOUT_S = 10.0


class StatusError(Exception):
    """The node could not be asked (unreachable, not a shardnet node, bad answer)."""


def status_url(target: str) -> str | None:
    """The ``/status`` URL for an HTTP target, or None if ``target`` is a multiaddr.

    Raises:
        ConfigError: neither an ``http://`` URL, ``host:port`` nor a ``/p2p/`` multiaddr, or
            the multiaddr's PeerID is malformed.
    """
    t = target.strip()
    if t.startswith("/"):
        if "/p2p/" not in t:
            raise ConfigError("target", f"{target!r}: a multiaddr needs /p2p/<PeerID>")
        from p2p.keys import is_valid_peer_id

        pid = t.split("/p2p/", 1)[1].split("/", 1)[0]
        if not is_valid_peer_id(pid):
            raise ConfigError("target", f"{pid!r} is not a PeerID (12D3KooW…, base58)")
        return None
    if "://" not in t:
        t = "http://" + t
    parts = urlsplit(t)
    try:
        port = parts.port
    except ValueError:  # an unbracketed IPv6 address: urllib reads its last group as a port
        port = None
    if parts.scheme != "http" or not parts.hostname or port is None:
        hint = " (an IPv6 address goes in brackets: [fd77::3]:8003)" if t.count(":") > 2 else ""
        raise ConfigError("target", f"{target!r} is not http://HOST:PORT or a multiaddr{hint}")
    path = parts.path.rstrip("/")
    if not path.endswith("/status"):
        path += "/status"
    return f"http://{parts.netloc}{path}"


async def fetch_status(target: str) -> dict[str, Any]:
    """The status document of ``target`` (see :func:`status_url`).

    Raises:
        ConfigError: malformed target.
        StatusError: unreachable, or not a status document.
    """
    from p2p.http_client import HttpClient

    url = status_url(target)
    try:
        if url is None:
            url = await _url_over_libp2p(target)
        async with HttpClient() as client:
            data = await client.get_bytes(url, max_bytes=MAX_STATUS_BYTES, timeout_s=TIMEOUT_S)
    except ShardnetError as exc:  # named once: a transport error already names the URL
        msg = str(exc)
        raise StatusError(msg if msg.startswith(target) else f"{target}: {msg}") from exc
    except trio.TooSlowError as exc:  # the libp2p dial (a node behind a NAT, say)
        raise StatusError(f"{target}: connect timed out after {TIMEOUT_S:g}s") from exc
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise StatusError(f"{url}: not JSON ({exc})") from exc
    if not isinstance(doc, dict) or "schema" not in doc or "role" not in doc:
        raise StatusError(f"{url}: not a shardnet status document")
    return doc


async def _url_over_libp2p(addr: str) -> str:
    """Ask the node at ``addr`` for its info record; its HTTP lane's ``/status`` URL."""
    from p2p import wire
    from p2p.host import HostConfig, P2PNode, peer_id_of
    from p2p.identity import Identity
    from shardcast.wire import INFO_PROTOCOL, MAX_INFO_BYTES, NodeInfo

    pid = peer_id_of(addr)
    async with P2PNode.open(Identity.generate(), HostConfig()) as p2p:
        with trio.fail_after(TIMEOUT_S):
            await p2p.connect(addr, keep=False)  # one question, then gone
        data = await p2p.request(
            pid,
            INFO_PROTOCOL,
            wire.encode({"v": 1}),
            max_response_bytes=MAX_INFO_BYTES,
            timeout_s=TIMEOUT_S,
        )
    info = NodeInfo.decode(data, sender=pid)
    return info.http_url.rstrip("/") + "/status"


# -- rendering ------------------------------------------------------------------------------


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n}"


def _secs(s: float | None) -> str:
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "-"
    if s < 60:
        return f"{s:.1f}s"
    m, sec = divmod(int(s), 60)
    return f"{m}m{sec:02d}s" if m < 60 else f"{m // 60}h{m % 60:02d}m"


def _time(iso: str | None) -> str:
    """``hh:mm:ss`` of an ISO time (the date is the status's own)."""
    return iso[11:19] if iso else "-"


def _steps(steps: list[int]) -> str:
    if not steps:
        return "none"
    if len(steps) > 6:
        return f"{steps[0]}…{steps[-1]} ({len(steps)})"
    return ", ".join(map(str, steps))


def _step_list(steps: list[int]) -> str:
    """``none``, ``step 3`` or ``steps 3, 4`` (a count alone would read as a step number)."""
    if not steps:
        return "none"
    return f"step {steps[0]}" if len(steps) == 1 else f"steps {_steps(steps)}"


CLIENT_ERROR_LABELS = {
    "400": "bad request",
    "404": "not held",
    "405": "bad method",
    "409": "other digest",
    "413": "too large",
    "416": "bad range",
    "429": "sent elsewhere",
}
"""What each 4xx of the lane means to an operator (see :mod:`shardcast.serve.server`)."""


def _requests_line(by_class: dict[str, int], client_errors: dict[str, int]) -> str:
    """Lane answers by class, then the 4xx by code with their meaning, most frequent first."""
    line = " ".join(f"{k}={n}" for k, n in by_class.items() if n) or "none"
    if client_errors:
        top = sorted(client_errors.items(), key=lambda i: (-i[1], i[0]))
        named = (" ".join(filter(None, (c, CLIENT_ERROR_LABELS.get(c), str(n)))) for c, n in top)
        line += f" ({', '.join(named)})"
    return line


def _watch_line(watch: dict[str, Any]) -> str:
    """The standalone origin's watched directory: what it published, refused, and whether
    the trainer ended the run."""
    line = f"{watch.get('dir')}: published {_opt(watch.get('latest_published'))}"
    if watch.get("dir_present") is False:
        return line + "; the directory does not exist (waiting for the trainer to create it)"
    refused = watch.get("refused") or []
    if refused:
        line += f"; refused {_steps(refused)} (see checkpoint_refused in the log)"
    else:
        line += f"; waiting for step-<N>/{watch.get('ready_marker')}"
    if watch.get("finished_marker_present"):
        line += f"; {watch.get('finished_marker')} present: run ended"
    return line


def _intake_line(intake: dict[str, Any]) -> str:
    """The standalone origin's rollout intake: the async window, and where verified rollouts
    go (``--rollouts-out``) with what was written there."""
    line = f"async window {intake.get('async_window_versions')}"
    out = intake.get("rollouts_out")
    if out is None:
        return line + "; rollouts not taken (no --rollouts-out)"
    if not intake.get("started"):
        return line + f"; rollouts to {out} once the first version is published"
    return (
        line + f"; rollouts to {out}: {intake.get('files_written', 0)} files, "
        f"{intake.get('rows_written', 0)} samples"
    )


def _chains_line(chained: dict[str, int], versions: dict[str, Any]) -> str:
    """The versions kept as chains (delta on a base), and why more versions are held than
    ``--keep-last`` says: the bases those chains are built from."""
    items = sorted((int(s), d) for s, d in chained.items())
    if len(items) <= 4:
        line = ", ".join(f"{s} (depth {d})" for s, d in items)
    else:
        line = f"{len(items)} (steps {items[0][0]}…{items[-1][0]}), "
        line += f"up to {max(d for _, d in items)} links"
    beyond = versions.get("beyond_keep_last") or []
    if beyond:
        line += f"; +{len(beyond)} bases beyond keep-last {versions.get('keep_last')}"
    return line


def _reach_line(reach: dict[str, Any]) -> str:
    """This node's own lane: its dial-back verdict and whether it is advertised; the relays
    it holds a reservation on and its hole punches, when there are any."""
    answers = ",".join(reach.get("last_answers", [])) or "none yet"
    said = "advertised" if reach.get("advertised") else "not advertised (download-only)"
    line = (
        f"{reach.get('state')} since {_time(reach.get('since'))}; {said}; "
        f"last check {_time(reach.get('checked_at'))} ({answers})"
    )
    if reach.get("relays"):
        line += f"; reserved on {len(reach['relays'])} relay(s)"
    punches = reach.get("punches") or {}
    if punches.get("started"):
        line += (
            f"; punches {punches.get('started')} started"
            + (f" ({punches['ahead']} ahead of need)" if punches.get("ahead") else "")
            + f", {punches.get('direct', 0)} direct, {punches.get('failed', 0)} failed"
        )
    return line


def _port_map_line(pm: dict[str, Any]) -> str:
    """This node's port mappings: state, external address and ports, lease left, whether the
    external lane URL was reached by a dial-back, and the last error."""
    line = str(pm.get("state"))
    ports = pm.get("mappings") or {}
    if ports:
        line += " " + ", ".join(
            f"{name} {m['internal_port']}->{pm.get('external_host')}:{m['external_port']}"
            for name, m in sorted(ports.items())
        )
        left = pm.get("lease_left_s")
        line += f"; lease left {_secs(left)}" if left is not None else "; permanent lease"
        if pm.get("candidate_url"):
            line += f"; lane {pm.get('candidate_state')}"
            line += " (advertised)" if pm.get("advertised") else ""
    if pm.get("last_error"):
        line += f"; last error {pm['last_error']}"
    return line


def _lane(node: dict[str, Any]) -> str:
    """A known node's lane as this node found it: ``verified``, ``unreachable x2``,
    ``dropped``, ``untried``, or ``none`` (a download-only node)."""
    lane = str(node.get("lane", "-"))
    if node.get("lane_dropped"):
        return f"dropped ({lane})"
    failures = node.get("lane_failures", 0)
    return f"{lane} x{failures}" if failures > 1 else lane


def _row(table: Table, *cells: RenderableType) -> None:
    """Add a row whose text cells are plain text, never rich markup: the document is the
    node's (its URLs, errors, names), and an IPv6 lane URL's ``[host]`` or a hostile node's
    ``[link=...]`` must print as written, not be read as a style tag."""
    table.add_row(*(Text(c) if isinstance(c, str) else c for c in cells))


def _upstreams(upstreams: list[dict[str, Any]]) -> list[RenderableType]:
    """The upstreams table, then each upstream's error on a line of its own."""
    t = Table(title="upstreams", title_justify="left")
    for col in ("peer", "state", "role", "latest", "last heard"):
        t.add_column(col, no_wrap=True)
    for u in upstreams:
        state, style = u["state"], "green" if u["state"] == "ready" else "red"
        if state != "ready" and u.get("expected") == "run_finished":
            state, style = "left (run over)", "yellow"  # the trainer exits after its end
        _row(
            t,
            short_id(u["peer_id"]),
            Text(state, style=style),
            u.get("role") or "-",
            _opt(u.get("latest_step")),
            _time(u.get("last_heard")),
        )
    parts: list[RenderableType] = [t]
    # errors below the table, one line each, clipped at the terminal's width (an error
    # column squeezed every other column to nothing in 80 columns)
    for u in upstreams:
        if u.get("error"):
            line = Text(no_wrap=True, overflow="ellipsis")
            line.append(f"  {short_id(u['peer_id'])} error: ", style="red")
            line.append(str(u["error"]))
            parts.append(line)
    return parts


ROLLOUT_LABELS = {
    # a batch announced directly and then again by gossip (every batch, in a clean run)
    "redelivered": "also by 2nd route",
    # the same batch again by a route that had carried it (a retry after a lost ack)
    "duplicates": "repeats",
}
"""Labels of the trainer's rollout counters in the table, where the JSON key reads like a
fault (the JSON keeps its keys)."""


def render(doc: dict[str, Any]) -> RenderableType:
    """Tables for one status document."""
    parts: list[RenderableType] = []
    v = doc.get("versions", {})
    ann = v.get("announced")
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    _row(head, "node", f"{doc['role']}  {doc.get('peer_id', '?')}")
    _row(head, "run", f"{doc.get('run_id')}  (shardnet {doc.get('version')})")
    _row(head, "lane", f"{doc.get('http_url')}  up {_secs(doc.get('uptime_s'))}")
    _row(
        head,
        "versions",
        f"held {_step_list(v.get('committed', []))}; announced "
        f"{_step_list([ann['step']] if ann else [])}; in progress "
        f"{_step_list(v.get('in_progress', []))}"
        + (f"; run finished at step {fin['step']}" if (fin := v.get("finished")) else ""),
    )
    chained = v.get("chained") or {}
    if chained:
        _row(head, "chains", _chains_line(chained, v))
    http, p2p = doc.get("http", {}), doc.get("libp2p", {})
    req = http.get("requests", {})
    _row(
        head,
        "traffic",
        f"sent {_bytes(http.get('sent_bytes'))}, received {_bytes(http.get('received_bytes'))}"
        f"; libp2p peers {p2p.get('connected_peers', 0)}",
    )
    _row(head, "requests", _requests_line(req, http.get("client_errors") or {}))
    for key, label, line in (
        ("reachability", "reachable", _reach_line),
        ("port_mapping", "port map", _port_map_line),
        ("watch", "watch", _watch_line),
        ("intake", "intake", _intake_line),
    ):
        if doc.get(key):
            _row(head, label, line(doc[key]))
    tr = doc.get("trainer")
    if tr:
        _row(
            head,
            "trainer",
            f"published step {tr.get('published_step')} of {tr.get('steps')}; async window "
            f"{tr.get('async_window_versions')}; mean reward {_num(tr.get('mean_reward'))}",
        )
    parts.append(head)
    if doc.get("downloads"):
        t = Table(title="versions in progress", title_justify="left")
        for col in ("step", "done", "size", "rate", "ETA", "corrupt", "sources"):
            t.add_column(col, justify="right" if col not in ("sources",) else "left")
        for d in doc["downloads"]:
            _row(
                t,
                str(d["step"]),
                f"{d['percent']:.1f}%",
                _bytes(d["total_bytes"]),
                f"{_bytes(d['rate_bytes_per_s'])}/s",
                _secs(d.get("eta_s")),
                str(d.get("corrupt_shards", 0)),
                ", ".join(
                    f"{short_id(s['peer_id'])}({s['kind']}) {_bytes(s['bytes'])}"
                    for s in d.get("sources", [])[:4]
                ),
            )
        parts.append(t)
    if doc.get("upstreams"):
        parts.extend(_upstreams(doc["upstreams"]))
    # whoever takes the rollouts: the trainer, or a standalone origin for an external one
    taker = tr or doc.get("intake") or {}
    if doc.get("network"):
        latest = tr.get("published_step") if tr else v.get("latest")
        window = taker.get("async_window_versions")
        title = "peers reporting to the " + ("trainer" if tr else doc["role"])
        t = Table(title=f"network ({title})", title_justify="left")
        for col in ("peer", "latest", "behind", "last heard"):
            t.add_column(col)
        for p in doc["network"]:
            lag = p.get("lag_versions")
            bad = lag is None or (window is not None and lag > window)
            _row(
                t,
                short_id(p["peer_id"]),
                _opt(p.get("latest_step")),
                Text(_opt(lag), style="red" if bad and latest is not None else ""),
                _time(p.get("last_heard")),
            )
        parts.append(t)
    if doc.get("known_nodes"):
        t = Table(title="known nodes (adverts)", title_justify="left")
        for col in ("peer", "role", "latest", "filling", "last heard", "lane", "last check"):
            t.add_column(col)
        for n in doc["known_nodes"][:20]:
            _row(
                t,
                short_id(n["peer_id"]),
                n["role"],
                _opt(n.get("latest_step")),
                _steps(n.get("filling", [])),
                _time(n.get("last_heard")),
                _lane(n),
                _time(n.get("lane_checked")),
            )
        parts.append(t)
    ro = doc.get("rollouts")
    if ro:
        t = Table(title="rollouts", title_justify="left", show_header=False)
        t.add_column(style="bold")
        t.add_column()
        for k, val in ro.items():
            if k == "acceptance" and isinstance(val, dict):
                for label, rows in _acceptance_rows(val):
                    _row(t, label, rows)
                continue
            _row(t, ROLLOUT_LABELS.get(k, k.replace("_", " ")), _fmt(val))
        if (taker.get("reputation") or {}).get("scores"):
            rep = taker["reputation"]
            _row(
                t,
                "reputation",
                ", ".join(f"{short_id(p)}={s:.2f}" for p, s in rep["scores"].items()),
            )
            if rep.get("refused"):
                _row(t, "refused", ", ".join(short_id(p) for p in rep["refused"]))
        parts.append(t)
    card = doc.get("run_card")
    if card:
        t = Table(title="run card", title_justify="left", show_header=False)
        t.add_column(style="bold")
        t.add_column()
        for k, val in card.items() if isinstance(card, dict) else []:
            _row(t, str(k), _fmt(val))
        parts.append(t)
    return Group(*parts)


def _acceptance_rows(acc: dict[str, Any]) -> list[tuple[str, str]]:
    """``rollouts.acceptance`` as (label, text) rows: one line per length bucket / submitter.

    Each line reads ``<bucket>: <decided> decided, <accepted> admitted, <trained> trained
    (<rate> admitted)``, with ``, <late> late`` when some were.
    """
    out = []
    for section, label, key in (
        ("by_length", "acceptance by length", str),
        ("by_submitter", "acceptance by submitter", short_id),
    ):
        entries = acc.get(section) or {}
        if not isinstance(entries, dict):
            continue
        lines = [_acceptance_line(key(name), a) for name, a in entries.items()]
        out.append((label, "\n".join(lines) if lines else "none"))
    return out


def _acceptance_line(name: str, a: object) -> str:
    if not isinstance(a, dict):
        return f"{name}: {_opt(a)}"
    line = (
        f"{name}: {a.get('decided', 0)} decided, {a.get('accepted', 0)} admitted, "
        f"{a.get('trained', 0)} trained"
    )
    if a.get("late"):
        line += f", {a['late']} late"
    rate = a.get("acceptance_rate")
    if isinstance(rate, (int, float)) and a.get("decided"):
        line += f" ({rate:.0%} admitted)"
    return line


def _opt(x: object) -> str:
    return "-" if x is None else str(x)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _fmt(val: object) -> str:
    if isinstance(val, dict):
        return ", ".join(f"{k}={v}" for k, v in val.items()) or "none"
    if isinstance(val, float):
        return f"{val:.4f}"
    return _opt(val)


# -- the command ----------------------------------------------------------------------------


def run_status(
    target: str | None,
    json_out: bool = False,
    watch: bool = False,
    interval_s: float = 2.0,
    *,
    console: Console | None = None,
    max_refreshes: int | None = None,
) -> int:
    """``shardnet status``: print the status of ``target`` (default :data:`DEFAULT_TARGET`).

    Args:
        target: URL or multiaddr (see module docstring).
        json_out: print the document as JSON instead of tables.
        watch: refresh every ``interval_s`` seconds until Ctrl-C (``--json``: one line each).
        interval_s: refresh period, seconds (> 0).
        console: where tables go (tests); stdout by default.
        max_refreshes: stop watching after this many documents (tests).

    Returns:
        the exit status (see module docstring).
    """
    out = console or Console()
    target = target or DEFAULT_TARGET
    try:
        status_url(target)
        if interval_s <= 0:
            raise ConfigError("interval_s", "must be > 0")
    except ConfigError as exc:
        print(f"shardnet status: {exc}", file=sys.stderr)
        return 2
    if not watch:
        try:
            doc = trio.run(fetch_status, target)
        except StatusError as exc:
            print(f"shardnet status: {exc}", file=sys.stderr)
            return 1
        if json_out:
            print(json.dumps(doc, indent=2))
        else:
            out.print(render(doc))
        return 0
    try:
        trio.run(_watch, target, json_out, interval_s, out, max_refreshes)
    except KeyboardInterrupt:
        pass
    return 0


async def _watch(
    target: str, json_out: bool, interval_s: float, out: Console, max_refreshes: int | None
) -> None:
    with contextlib.ExitStack() as stack:
        live = None
        if not json_out and out.is_terminal:  # a file or a pipe: a live view draws nothing
            live = stack.enter_context(
                Live(Text("asking " + target), console=out, auto_refresh=False)
            )
        shown = 0
        while max_refreshes is None or shown < max_refreshes:
            if json_out:
                try:
                    doc: dict[str, Any] = await fetch_status(target)
                except StatusError as exc:
                    doc = {"error": str(exc)}
                print(json.dumps(doc), flush=True)
            elif live is not None:
                live.update(await _view(target, interval_s), refresh=True)
            else:  # one view after another, each under a time rule
                out.rule(time.strftime("%Y-%m-%d %H:%M:%S"))
                out.print(await _view(target, interval_s))
                out.file.flush()
            shown += 1
            await trio.sleep(interval_s)


async def _view(target: str, interval_s: float) -> RenderableType:
    """The tables of ``target``'s status now, or the error in red."""
    try:
        return render(await fetch_status(target))
    except StatusError as exc:
        return Text(f"{exc} (retrying every {interval_s:g}s)", style="red")
