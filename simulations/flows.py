"""Flow-level bandwidth sharing: weighted max-min fairness, and a time-stepped flow network.

Theory of operation
-------------------
A *flow* moves bytes from one node to another and crosses a few *resources*: the sender's
uplink, the receiver's downlink, and optionally a declared link between the two. Each resource
has a capacity (bytes/s); each flow may also have its own cap (e.g. TCP's window/RTT or the
Mathis loss bound). Rates are the weighted max-min fair allocation (progressive filling): raise
every flow's rate in proportion to its weight until a resource saturates or a flow hits its cap,
freeze those flows, repeat. This is the sharing of SimGrid's CM02 network model without its
latency-dependent weights (DESIGN.md: such a solver matched SimGrid to 1e-6).

:func:`maxmin` freezes, per round, every resource whose fair level is no larger than that of any
resource sharing a flow with it (such a resource saturates at that level whatever happens
elsewhere: the others' levels only rise as flows freeze), so the number of rounds is the depth
of the bottleneck graph rather than the number of distinct levels; each round is a few numpy
passes over the flows.

:class:`FlowNetwork` advances all flows in steps of ``dt`` seconds: rates are recomputed at each
step boundary; a flow that completes inside a step gets its exact completion time, and a flow
that starts inside a step starts moving at the next boundary (error <= dt per transfer; the
model picks dt much smaller than a shard's transfer time).

Cut-through: a flow may *follow* another (:meth:`FlowNetwork.add`'s ``follows``), as a node
serves the verified prefix of a shard it is still receiving (:mod:`shardcast.serve.server`):
the follower never has moved more than its leader plus a fixed ``slack`` (the bytes the
leader's receiver held before the leader started, less the follower's own start). While a
follower is caught up it is capped at its leader's rate (two max-min passes: the first gives
the leaders' rates, the second the followers' capped ones, so an idle follower leaves its share
of the sender's uplink to others); the bound itself is applied after each step, down chains of
followers until nothing changes. When a leader completes, its followers are free; when it is
cancelled, they are bound by what it moved (they stall until the caller ends them or
:meth:`FlowNetwork.refollow` binds them to another leader).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

FArr = npt.NDArray[np.float64]
IArr = npt.NDArray[np.int64]
INF = math.inf


def maxmin(
    capacity: FArr,
    flow_res: IArr,
    weight: FArr | None = None,
    cap: FArr | None = None,
) -> FArr:
    """Weighted max-min fair rates.

    Args:
        capacity: (R,) capacity of each resource, bytes/s (>= 0).
        flow_res: (F, K) resource indices of each flow, ``-1`` for unused slots.
        weight: (F,) weights (> 0); default 1.
        cap: (F,) per-flow rate caps, bytes/s (``inf``: none); default none.

    Returns:
        (F,) rates, bytes/s.
    """
    nf = flow_res.shape[0]
    rate = np.zeros(nf)
    if nf == 0:
        return rate
    w_all = np.ones(nf) if weight is None else np.asarray(weight, dtype=np.float64)
    cap_all = np.full(nf, INF) if cap is None else np.asarray(cap, dtype=np.float64)
    nres = capacity.shape[0]
    k = flow_res.shape[1]
    fr_all = np.where(flow_res >= 0, flow_res, nres)  # slot nres: a dummy of infinite capacity
    remaining = np.append(capacity.astype(np.float64), INF)
    ai = np.arange(nf)  # the flows still rising, compressed every round
    for _ in range(nf + nres + 1):
        if ai.size == 0:
            break
        fr, w = fr_all[ai], w_all[ai]
        flat = fr.ravel()
        wsum = np.bincount(flat, weights=np.repeat(w, k), minlength=nres + 1)
        with np.errstate(divide="ignore", invalid="ignore"):
            level = np.where(wsum > 0, remaining / wsum, INF)
        level[nres] = INF
        level = np.maximum(level, 0.0)
        flevel = level[fr].min(axis=1)  # each flow's tightest resource level
        ocap = cap_all[ai] / w  # the level at which a flow hits its own cap
        fmin = np.minimum(flevel, ocap)
        # a resource is locally minimal if no flow crossing it has a lower level elsewhere
        order = np.argsort(flat, kind="stable")
        sflat = flat[order]
        starts = np.flatnonzero(np.r_[True, sflat[1:] != sflat[:-1]])
        neigh = np.full(nres + 1, INF)
        neigh[sflat[starts]] = np.minimum.reduceat(np.repeat(fmin, k)[order], starts)
        tight_res = (level <= neigh * (1 + 1e-12)) & (wsum > 0)
        tight_res[nres] = False
        on_tight = tight_res[fr].any(axis=1)
        capped = ocap <= flevel * (1 + 1e-12)
        freeze = on_tight | capped
        if not freeze.any():  # numerical corner: freeze the globally smallest
            freeze = fmin <= fmin.min() * (1 + 1e-12)
        got = w * np.where(capped, ocap, flevel)
        rate[ai[freeze]] = got[freeze]
        with np.errstate(invalid="ignore"):
            remaining -= np.bincount(
                fr[freeze].ravel(), weights=np.repeat(got[freeze], k), minlength=nres + 1
            )
        remaining[nres] = INF
        ai = ai[~freeze]
    return np.where(np.isfinite(rate), rate, 0.0)


DoneFn = Callable[[int, float], None]
"""``done(flow_id, completion_time_s)``."""


@dataclass
class _Pending:
    fid: int
    start_at: float


class FlowNetwork:
    """Flows over capacitated resources, advanced in time steps (see module docstring).

    Args:
        capacity: initial capacity per resource, bytes/s.
        max_res: resources per flow (K).

    Not thread-safe; callbacks run inside :meth:`advance`.
    """

    def __init__(self, capacity: list[float], max_res: int = 3) -> None:
        self.capacity = np.array(capacity, dtype=np.float64)
        self.k = max_res
        n = 1024
        self._res = np.full((n, max_res), -1, dtype=np.int64)
        self._left = np.zeros(n)
        self._cap = np.full(n, INF)
        self._rate = np.zeros(n)
        self._active = np.zeros(n, dtype=bool)
        self._live = np.zeros(n, dtype=bool)  # added, neither done nor cancelled
        self._size = np.zeros(n)
        self._moved = np.zeros(n)
        self._lag = np.zeros(n)
        self._leader = np.full(n, -1, dtype=np.int64)  # slot of the flow it follows, or -1
        self._limit = np.full(n, INF)  # a follower whose leader ended: bytes it may move
        self._bound = np.zeros(n, dtype=bool)  # follows a live leader, or has a finite limit
        self._free_rate = np.zeros(n)  # max-min rate before followers' caps (last computed)
        self._slack = np.zeros(n)
        self._free = list(range(n - 1, -1, -1))
        self._slot: dict[int, int] = {}
        self._flow_of_slot: dict[int, int] = {}
        self._cb: dict[int, tuple[DoneFn, Callable[[int, float], None] | None]] = {}
        self._pending: list[_Pending] = []
        self._n_bound = 0  # flows bound by a leader or a limit (cut-through)
        self._caught = np.zeros(0, dtype=np.int64)  # bound slots capped at the last rates
        self._next_id = 0
        self.dirty = True

    def __len__(self) -> int:
        return len(self._slot)

    def _grow(self) -> None:
        n = self._left.shape[0]
        self._res = np.vstack([self._res, np.full((n, self.k), -1, dtype=np.int64)])
        for name in ("_left", "_rate", "_moved", "_lag", "_size", "_slack", "_free_rate"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros(n)]))
        self._cap = np.concatenate([self._cap, np.full(n, INF)])
        self._limit = np.concatenate([self._limit, np.full(n, INF)])
        self._leader = np.concatenate([self._leader, np.full(n, -1, dtype=np.int64)])
        self._bound = np.concatenate([self._bound, np.zeros(n, dtype=bool)])
        self._active = np.concatenate([self._active, np.zeros(n, dtype=bool)])
        self._live = np.concatenate([self._live, np.zeros(n, dtype=bool)])
        self._free.extend(range(2 * n - 1, n - 1, -1))

    def add(
        self,
        resources: tuple[int, ...],
        size_bytes: float,
        start_at: float,
        on_done: DoneFn,
        on_start: Callable[[int, float], None] | None = None,
        cap_bps: float = INF,
        follows: int | None = None,
        slack: float = 0.0,
    ) -> int:
        """Add a flow that starts moving at ``start_at`` (s); returns its id.

        Args:
            resources: the resources it crosses (at most ``max_res``).
            size_bytes: bytes to move.
            start_at: when it starts moving, s.
            on_done: called with its id and completion time, s.
            on_start: called with its id and the time it started moving, s.
            cap_bps: its own rate cap, bytes/s.
            follows: a live flow's id: this flow never moves more than that flow's bytes
                plus ``slack`` (cut-through; see the module docstring). An id that is not live
                (done or cancelled) binds nothing.
            slack: bytes this flow may be ahead of the flow it follows.
        """
        if not self._free:
            self._grow()
        slot = self._free.pop()
        fid = self._next_id
        self._next_id += 1
        self._res[slot] = -1
        self._res[slot, : len(resources)] = resources
        self._left[slot] = max(float(size_bytes), 0.0)
        self._size[slot] = self._left[slot]
        self._live[slot] = True
        self._cap[slot] = cap_bps
        self._rate[slot] = 0.0
        self._moved[slot] = 0.0
        self._leader[slot] = -1
        self._limit[slot] = INF
        self._slack[slot] = slack
        lead = self._live_slot(follows)
        if lead is not None:
            self._leader[slot] = lead
            self._set_bound(slot, True)
        self._slot[fid] = slot
        self._flow_of_slot[slot] = fid
        self._cb[fid] = (on_done, on_start)
        self._pending.append(_Pending(fid, start_at))
        return fid

    def cancel(self, fid: int) -> float:
        """Stop a flow; returns the bytes it moved. Unknown ids return 0."""
        slot = self._slot.pop(fid, None)
        if slot is None:
            return 0.0
        moved = float(self._moved[slot])
        self._active[slot] = False
        self._live[slot] = False
        self._release(slot, float(self._moved[slot]))
        self._set_bound(slot, False)
        del self._flow_of_slot[slot]
        self._cb.pop(fid, None)
        self._free.append(slot)
        self.dirty = True
        return moved

    def _set_bound(self, slot: int, bound: bool) -> None:
        if bool(self._bound[slot]) != bound:
            self._bound[slot] = bound
            self._n_bound += 1 if bound else -1
            self.dirty = True

    def _bound_view(self, act: IArr) -> tuple[IArr, IArr, IArr, IArr] | None:
        """The moving flows bound by a leader or a limit: ``(k, slots, lead, j)``, their
        indices in ``act``, their slots, their leaders' slots (-1: a limit) and their leaders'
        indices in ``act`` (-1: a limit, or a leader not moving yet). None if there are none."""
        if self._n_bound == 0:
            return None
        k = np.flatnonzero(self._bound[act])
        if k.size == 0:
            return None
        slots = act[k]
        lead = self._leader[slots]
        pos = np.full(self._left.shape[0], -1, dtype=np.int64)
        pos[act] = np.arange(act.size)
        j = np.where(lead >= 0, pos[np.maximum(lead, 0)], -1)
        return k, slots, lead, j

    def _room(self, view: tuple[IArr, IArr, IArr, IArr], step: FArr | None) -> FArr:
        """Bytes each bound flow of ``view`` may still move (counting its leader's ``step``,
        if given)."""
        _, slots, lead, j = view
        ahead = self._moved[np.maximum(lead, 0)] + self._slack[slots]
        if step is not None:
            ahead = ahead + np.where(j >= 0, step[np.maximum(j, 0)], 0.0)
        return np.where(lead >= 0, ahead, self._limit[slots]) - self._moved[slots]

    def _rates(self, act: IArr, view: tuple[IArr, IArr, IArr, IArr] | None, dt: float) -> FArr:
        """Max-min rates of the flows ``act``; a bound flow that would reach its bound within
        ``dt`` is capped at its leader's rate (0 if its leader ended or does not move yet):
        a second max-min pass gives the others what it leaves."""
        cap = self._cap[act]
        rate = maxmin(self.capacity, self._res[act], None, cap)
        if view is None:
            self._caught = np.zeros(0, dtype=np.int64)
            return rate
        k, slots, _, j = view
        self._free_rate[act] = rate  # what _recheck compares with
        caught = self._caught_up(view, dt)
        self._caught = slots[caught]
        if not caught.any():
            return rate
        capped = rate.copy()
        for _ in range(self._n_bound + 1):  # down chains: a leader's cap passes to its own
            lead_rate = np.where(j >= 0, capped[np.maximum(j, 0)], 0.0)
            new = np.where(caught, np.minimum(capped[k], lead_rate), capped[k])
            if np.array_equal(new, capped[k]):
                break
            capped[k] = new
        cap = cap.copy()
        cap[k[caught]] = capped[k[caught]]
        return maxmin(self.capacity, self._res[act], None, cap)

    def _recheck(self, act: IArr, view: tuple[IArr, IArr, IArr, IArr] | None, dt: float) -> bool:
        """True if the set of bound flows that caught up with their bound changed since the
        rates were computed (their caps must change)."""
        if view is None:
            return self._caught.size > 0
        caught = view[1][self._caught_up(view, dt)]
        return not np.array_equal(np.sort(caught), np.sort(self._caught))

    def _caught_up(self, view: tuple[IArr, IArr, IArr, IArr], dt: float) -> npt.NDArray[np.bool_]:
        """Which bound flows of ``view`` would reach their bound within ``dt`` at their
        uncapped max-min rate (short of their own end)."""
        slots = view[1]
        room = self._room(view, None)
        return (room < self._left[slots] - 1e-6) & (room <= self._free_rate[slots] * dt)

    def _clamp(self, view: tuple[IArr, IArr, IArr, IArr], step: FArr) -> None:
        """Cut each bound flow's ``step`` (bytes, in place) to what its leader or limit allows,
        down chains of followers until nothing changes."""
        k = view[0]
        for _ in range(self._n_bound + 1):  # each round settles one more level of a chain
            new = np.minimum(step[k], np.maximum(self._room(view, step), 0.0))
            if np.array_equal(new, step[k]):
                return
            step[k] = new

    def _release(self, slot: int, reached: float) -> None:
        """``slot``'s flow ended having moved ``reached`` bytes (``inf``: it completed): its
        followers are bound by that from now on."""
        if self._n_bound == 0:
            return
        for f in np.flatnonzero(self._bound & (self._leader == slot)).tolist():
            self._leader[f] = -1
            if reached + self._slack[f] < self._moved[f] + self._left[f] - 1e-6:
                self._limit[f] = reached + self._slack[f]
            else:
                self._set_bound(f, False)

    def refollow(self, fid: int, leader: int | None, slack: float = 0.0) -> bool:
        """Bind flow ``fid`` to another live flow ``leader`` (its source now receives the
        shard through that one) with a new ``slack`` (see :meth:`add`), or to nothing (None,
        or a ``leader`` that is not live: its source holds the whole range now).

        Returns:
            False, changing nothing, if ``fid`` is not live or ``leader`` follows ``fid``
            (directly or down a chain): the two would wait for each other forever.
        """
        slot = self._live_slot(fid)
        if slot is None:
            return False
        lead = self._live_slot(leader)
        if lead is not None and (lead == slot or slot in self._leaders_of(lead)):
            return False
        self._leader[slot] = -1 if lead is None else lead
        self._slack[slot] = slack
        self._limit[slot] = INF
        self._set_bound(slot, lead is not None)
        return True

    def _leaders_of(self, slot: int) -> Iterator[int]:
        """The slots of the flows ``slot``'s flow follows, nearest first, down its chain (at
        most as many as there are bound flows)."""
        for _ in range(self._n_bound):
            if not self._bound[slot] or self._leader[slot] < 0:
                return
            slot = int(self._leader[slot])
            yield slot

    def _depths(self, slots: IArr) -> IArr:
        """How many leaders each of ``slots`` follows, down its chain (0: none)."""
        depth = np.zeros(slots.size, dtype=np.int64)
        if self._n_bound:
            for n, slot in enumerate(slots.tolist()):
                depth[n] = sum(1 for _ in self._leaders_of(slot))
        return depth

    def _live_slot(self, fid: int | None) -> int | None:
        """The slot of flow ``fid`` if it is live (added, neither done nor cancelled; a flow
        that finished in the step being advanced keeps its slot until its callback ran)."""
        slot = self._slot.get(fid) if fid is not None else None
        return slot if slot is not None and self._live[slot] else None

    def moved(self, fid: int) -> float:
        """Bytes a flow has moved so far."""
        slot = self._slot.get(fid)
        return 0.0 if slot is None else float(self._moved[slot])

    def set_capacity(self, resource: int, bps: float) -> None:
        """Change a resource's capacity (takes effect at the next step)."""
        self.capacity[resource] = bps
        self.dirty = True

    def idle(self) -> bool:
        """True when no flow exists."""
        return not self._slot

    def smallest_size(self) -> float:
        """Bytes of the smallest flow added and not yet done or cancelled (inf: none)."""
        sizes = self._size[self._live]
        return float(sizes.min()) if sizes.size else INF

    def next_start(self) -> float:
        """Earliest start time of a flow not yet moving (inf: none)."""
        return min((p.start_at for p in self._pending if p.fid in self._slot), default=INF)

    def advance(self, t0: float, dt: float) -> None:
        """Move every flow from ``t0`` to ``t0 + dt``; call back completed flows in order."""
        t1 = t0 + dt
        if self._pending:
            keep = []
            for p in self._pending:
                if p.fid not in self._slot:
                    continue
                if p.start_at <= t0 + 1e-12:
                    slot = self._slot[p.fid]
                    self._active[slot] = True
                    # it should have started inside the last step: back-date it (it moves
                    # for dt + lag now), using the capacity that completions freed there
                    lag = min(max(t0 - p.start_at, 0.0), dt)
                    self._lag[slot] = lag
                    self.dirty = True
                    on_start = self._cb[p.fid][1]
                    if on_start is not None:
                        on_start(p.fid, t0 - lag)
                else:
                    keep.append(p)
            self._pending = keep
        act = np.flatnonzero(self._active)
        if act.size == 0:
            return
        view = self._bound_view(act)
        if self.dirty or self._recheck(act, view, dt):
            self._rate[act] = self._rates(act, view, dt)
            self.dirty = False
        rate = self._rate[act]
        left = self._left[act]
        lags = self._lag[act]
        self._lag[act] = 0.0
        step = np.minimum(rate * (dt + lags), left)
        if view is not None:
            self._clamp(view, step)
        self._left[act] = left - step
        self._moved[act] += step
        fin = (left - step <= 1e-6) & ((rate > 0) | (left <= 1e-6))
        done = act[fin]
        if done.size == 0:
            return
        with np.errstate(divide="ignore", invalid="ignore"):
            t_done = t0 - lags[fin] + np.where(rate[fin] > 0, left[fin] / rate[fin], 0.0)
        t_done = np.maximum(t_done, t0)
        depth = self._depths(done)
        order = np.lexsort((depth, t_done))  # by time, leaders before their followers
        finished = [(self._flow_of_slot[int(done[i])], float(min(t_done[i], t1))) for i in order]
        for fid, _ in finished:
            slot = self._slot[fid]
            self._active[slot] = False
            self._live[slot] = False
            self._release(slot, INF)  # its receiver holds the rest of the range: no bound
            self._set_bound(slot, False)
        self.dirty = True
        for fid, t in finished:
            cbs = self._cb.pop(fid, None)
            live = self._slot.pop(fid, None)
            if live is None or cbs is None:
                continue  # cancelled by an earlier callback of this step
            del self._flow_of_slot[live]
            self._free.append(live)
            cbs[0](fid, t)
