"""A world of real shardnet nodes on the in-memory network, for scenarios in virtual time.

Theory of operation
-------------------
:class:`World` runs the production code of every role on one :class:`p2p.memnet.MemNetwork`:
the trainer's node (a :class:`~shardcast.node.node.ShardcastNode` with an
:class:`~shardcast.publish.origin.Origin` and the rollout :class:`~rollout.inbox.RolloutInbox` with
the
real :class:`~rollout.verify.Validator`, model checks off), relays and inference peers (a node
and a :class:`~shardcast.download.follower.Follower` each; peers also submit a fake rollout batch
per
committed version through the real :class:`~rollout.exchange.RolloutSender`), and sybils
(a bare host and lane that flood adverts, announcements and rollout batches and serve random
bytes). Nothing of the nodes is patched: faults come from the network's policy (partitions,
tampering lanes, loss) and from cancelling a node's scope (a crash).

One thing is swapped for determinism of virtual time: ``trio.to_thread.run_sync`` runs the
function inline (:func:`inline_threads`). Under ``MockClock(autojump_threshold=0)`` a task
waiting for a worker thread counts as blocked, so the clock would jump past every pending
timeout while a file is written; inline, the clock stands still during local work. The files
are small (checkpoints of a few hundred KiB), so blocking the loop costs nothing real.

And trio's scheduler is seeded (:func:`seeded_scheduler`). Trio runs each batch of runnable tasks
in an order it draws from an unseeded ``random.Random`` on purpose, so that code never comes to
rely on one order; the same scenario and seed could then take another interleaving on each run
(two relays answering in the same virtual instant, in either order) and a sweep failure could
not be replayed. Seeded, each run's interleaving follows from its seed: the sweep still explores
one interleaving per seed, and a failing seed fails the same way every time.

Every record here is in virtual seconds (``trio.current_time()``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import shutil
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import LocalProtocolError, ShardnetError
from p2p.host import HostConfig
from p2p.http_server import HttpRequest, HttpResponse, HttpServerConfig
from p2p.identity import Identity
from p2p.memnet import SEEN_CAP, Endpoint, MemHost, MemNetwork
from p2p.trust import TrustList
from rollout.exchange import Ack, RolloutSender, SenderConfig
from rollout.inbox import InboxConfig, RolloutInbox
from rollout.reputation import Reputation
from rollout.schema import Group, RolloutAnnouncement, RolloutBatch, Sample, rollouts_topic
from rollout.task import DEFAULT_TASK
from rollout.verify import Validator, ValidatorConfig
from shardcast.download import (
    DownloadConfig,
    FollowConfig,
    Follower,
    NodeAdvert,
    VersionRecord,
    nodes_topic,
)
from shardcast.node import NodeConfig, ShardcastNode
from shardcast.publish import Origin, OriginConfig
from shardcast.wire import Manifest, VersionAnnouncement, sign_whoami, versions_topic

if TYPE_CHECKING:
    from trio_typing import TaskStatus

log = logging.getLogger(__name__)

RUN = "sim"
TRAINER = Identity.from_seed("sim-trainer")
N_PROMPTS, GROUP, CAP = 2, 2, 4
SHARD_BYTES = 16 * 1024


@contextlib.contextmanager
def inline_threads() -> Iterator[None]:
    """Run ``trio.to_thread.run_sync`` inline for the duration (see module docstring)."""
    real, real_back = trio.to_thread.run_sync, trio.from_thread.run_sync

    async def inline(fn: Callable[..., Any], *args: Any, **_: Any) -> Any:
        await trio.lowlevel.checkpoint()
        return fn(*args)

    def back(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            trio.lowlevel.current_task()
        except RuntimeError:  # a real worker thread
            return real_back(fn, *args, **kwargs)
        return fn(*args)  # called from an inlined "thread": already on the trio thread

    trio.to_thread.run_sync = inline  # type: ignore[assignment]
    trio.from_thread.run_sync = back
    try:
        yield
    finally:
        trio.to_thread.run_sync = real
        trio.from_thread.run_sync = real_back


@contextlib.contextmanager
def seeded_scheduler(seed: int | str) -> Iterator[None]:
    """Make trio's task order a function of ``seed`` for the duration (see module docstring).

    This is the switch trio itself throws for Hypothesis (``trio._core._run``'s
    ``_hypothesis_plugin_setup``): sort each batch of runnable tasks by creation order, then
    shuffle it with trio's scheduler RNG, here seeded. Both are private to trio (checked against
    trio 0.35): if they move, this raises ``LocalProtocolError`` rather than silently running
    unseeded.

    Raises:
        LocalProtocolError: this trio has no such switch.
    """
    run = getattr(getattr(trio, "_core", None), "_run", None)
    rng = getattr(run, "_r", None)
    if run is None or not isinstance(rng, random.Random):
        raise LocalProtocolError("trio has no seedable scheduler (trio._core._run._r)")
    if not hasattr(run, "_ALLOW_DETERMINISTIC_SCHEDULING"):
        raise LocalProtocolError("trio has no _ALLOW_DETERMINISTIC_SCHEDULING switch")
    was, state = run._ALLOW_DETERMINISTIC_SCHEDULING, rng.getstate()
    run._ALLOW_DETERMINISTIC_SCHEDULING = True
    rng.seed(f"scheduler:{seed}")
    try:
        yield
    finally:
        run._ALLOW_DETERMINISTIC_SCHEDULING = was
        rng.setstate(state)


class SimOracle:
    """The policy facts the validator needs, without a model or tokenizer
    (:class:`rollout.verify.PolicyOracle`)."""

    vocab_size = 128
    eos_id = 1

    def __init__(self) -> None:
        self.digests: dict[int, str] = {}

    def manifest_digest(self, step: int) -> str | None:
        """Digest of the published version ``step`` (the newest publication of the step)."""
        return self.digests.get(step)

    def prompt_ids(self, submitter: str, step: int, n: int) -> list[list[int]]:
        """Seeded prompts per (submitter, step)."""
        rng = random.Random(f"{submitter}:{step}")
        return [[rng.randrange(4, 100) for _ in range(3)] for _ in range(n)]

    def reward(
        self,
        completion_ids: Sequence[int],
        *,
        submitter: str,
        step: int,
        prompt_index: int,
        n_prompts: int,
    ) -> float:
        """A cheap deterministic reward in [0, 1]."""
        return (sum(completion_ids) % 5) / 4

    def prefill_batch(self, *args: Any, **kwargs: Any) -> list[Any]:
        """Never called: the simulated validator runs without model checks.

        Raises:
            LocalProtocolError: always.
        """
        raise LocalProtocolError("the simulation has no model")


def fake_batch(oracle: SimOracle, submitter: str, step: int, *, honest: bool = True) -> bytes:
    """An encoded rollout batch for ``step`` that passes the validator's model-free checks
    (``honest=False``: wrong rewards, rejected)."""
    digest = oracle.manifest_digest(step) or "00" * 32
    rng = random.Random(f"batch:{submitter}:{step}")
    groups = []
    for i, prompt in enumerate(oracle.prompt_ids(submitter, step, N_PROMPTS)):
        samples = []
        for _ in range(GROUP):
            ids = tuple(rng.randrange(4, 100) for _ in range(CAP))
            reward = oracle.reward(
                ids, submitter=submitter, step=step, prompt_index=i, n_prompts=N_PROMPTS
            )
            samples.append(Sample(ids, (-1.0,) * CAP, reward + (0 if honest else 7), "length", b""))
        groups.append(Group(i, tuple(prompt), tuple(samples)))
    return RolloutBatch(
        RUN, submitter, step, digest, DEFAULT_TASK.name, N_PROMPTS, 1, 1.0, CAP, tuple(groups)
    ).encode()


def write_checkpoint(directory: Path, seed: int, sizes: Sequence[int]) -> Path:
    """A fake checkpoint directory: config.json and seeded random ``.safetensors`` files."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "seed": seed}))
    names = [f"model-{i + 1:05d}-of-{len(sizes):05d}.safetensors" for i in range(len(sizes))]
    for name, size in zip(names, sizes, strict=True):
        (directory / name).write_bytes(rng.randbytes(size))
    if len(names) > 1:
        wm = {f"layer.{i}.weight": n for i, n in enumerate(names)}
        (directory / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": sum(sizes)}, "weight_map": wm})
        )
    return directory


@dataclass
class NodeHandle:
    """One honest node of the world (alive while its scope runs)."""

    name: str
    role: str
    ident: Identity
    endpoint: Endpoint
    upstreams: tuple[str, ...] = ()
    scope: trio.CancelScope | None = None
    node: ShardcastNode | None = None
    follower: Follower | None = None
    sender: RolloutSender | None = None
    commits: list[tuple[int, str]] = field(default_factory=list)
    submitted: dict[str, int] = field(default_factory=dict)  # batch id -> step
    alive: bool = False
    starts: int = 0
    banned_seen: set[str] = field(default_factory=set)
    crashes: int = 0
    old_acks: list[Ack] = field(default_factory=list)
    stopped: trio.Event = field(default_factory=trio.Event)

    def all_acks(self) -> list[Ack]:
        """The trainer's final answers to this node's batches, over all its lives."""
        return [*self.old_acks, *(self.sender.acks if self.sender is not None else [])]

    @property
    def peer_id(self) -> str:
        return self.ident.peer_id

    def held(self) -> dict[int, str]:
        """Committed versions on disk now: step -> manifest digest (of its latest commit)."""
        if self.node is None:
            return {}
        digests = dict(self.commits)
        return {s: digests[s] for s in self.node.store.committed_steps() if s in digests}

    def banned(self) -> set[str]:
        """Sources this node's downloader banned at some point (sampled by the world)."""
        return set(self.banned_seen)


@dataclass
class Sybil:
    """A hostile identity: a bare host and lane."""

    ident: Identity
    endpoint: Endpoint
    host: MemHost | None = None
    url: str = ""


class World:
    """Builds and runs the nodes of one scenario (see module docstring).

    Args:
        net: the in-memory network (entered).
        root: a directory for the nodes' data.
        seed: seeds every RNG of the world.
        sizes: checkpoint file sizes, bytes.
    """

    def __init__(self, net: MemNetwork, root: Path, seed: int, sizes: Sequence[int]) -> None:
        self.net = net
        self.root = root
        self.seed = seed
        self.sizes = tuple(sizes)
        self.trust = TrustList(trainer=TRAINER.peer_id)
        self.oracle = SimOracle()
        self.trainer: NodeHandle | None = None
        self.origin: Origin | None = None
        self.inbox: RolloutInbox | None = None
        self.relays: list[NodeHandle] = []
        self.peers: list[NodeHandle] = []
        self.sybils: list[Sybil] = []
        self.published: dict[int, str] = {}
        self.latest: tuple[int, str] | None = None
        self.trained: Counter[tuple[str, str]] = Counter()  # (submitter, batch id) -> times
        self.current_step = 0
        self.max_held_versions = 0
        self.published_at = 0.0
        self._nursery: trio.Nursery | None = None
        self._changed = trio.Event()
        self.wall_deadline: float | None = None
        """``time.perf_counter()`` after which waits for convergence give up (None: never)."""

    def notify(self) -> None:
        """Wake :meth:`changed` waiters (a commit, a crash, a restart)."""
        self._changed.set()
        self._changed = trio.Event()

    def out_of_wall_time(self) -> bool:
        """Whether the real-time budget (:attr:`wall_deadline`) is spent: a run that cannot
        converge spends its virtual deadline slowly (every retry is real work), so the wall
        clock, not virtual time, is what bounds it."""
        return self.wall_deadline is not None and time.perf_counter() > self.wall_deadline

    async def changed(self, at_most_s: float = 1.0) -> None:
        """Wait for a change, or ``at_most_s`` virtual seconds."""
        with trio.move_on_after(at_most_s):
            await self._changed.wait()

    # -- node lifecycles -------------------------------------------------------------------------

    def _config(self, h: NodeHandle, role: str) -> NodeConfig:
        return NodeConfig(
            role,
            RUN,
            self.root / h.name,
            keep_last=3,
            host=HostConfig((f"/ip4/{h.endpoint.ip}/tcp/4001",), dial_timeout_s=5.0),
            http=HttpServerConfig(host=h.endpoint.ip, port=8001),
            serve_wait_s=5.0,
            info_timeout_s=5.0,
            durable=False,
        )

    async def start(self, nursery: trio.Nursery) -> None:
        """Start the trainer (origin, inbox and a training loop) in ``nursery``."""
        self._nursery = nursery
        h = NodeHandle("trainer", "trainer", TRAINER, self.net.endpoint())
        self.trainer = h
        await nursery.start(self._run_trainer, h)

    async def restart_trainer(self, *, wipe: bool) -> None:
        """Crash the trainer and start it again (``wipe``: with an empty data directory)."""
        h = self.trainer
        assert h is not None
        assert self._nursery is not None
        self.kill(h)
        await h.stopped.wait()
        if wipe:
            shutil.rmtree(self.root / h.name)
        h.stopped = trio.Event()
        await self._nursery.start(self._run_trainer, h)

    async def _run_trainer(
        self, h: NodeHandle, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        h.scope = trio.CancelScope()
        try:
            await self._trainer_body(h, task_status)
        finally:
            h.alive = False
            h.stopped.set()

    async def _trainer_body(self, h: NodeHandle, task_status: TaskStatus[None]) -> None:
        assert h.scope is not None
        with h.scope:
            async with (
                ShardcastNode.open(
                    h.ident, self.trust, self._config(h, "trainer"), network=h.endpoint
                ) as node,
                trio.open_nursery() as nursery,
            ):
                h.node, h.alive = node, True
                self.origin = Origin(node, OriginConfig(shard_size=SHARD_BYTES, shards_per_part=4))
                vcfg = ValidatorConfig(
                    run_id=RUN,
                    task=DEFAULT_TASK.name,
                    n_prompts=N_PROMPTS,
                    group_size=GROUP,
                    max_new_tokens=CAP,
                    temperature=1.0,
                    check_model=False,
                )
                self.inbox = RolloutInbox(
                    node.p2p,
                    RUN,
                    Validator(vcfg, self.oracle),
                    Reputation(),
                    current_step=lambda: self.current_step,
                    config=InboxConfig(fetch_timeout_s=20.0, handler_timeout_s=60.0),
                )
                await nursery.start(self.inbox.run)
                nursery.start_soon(self._train)
                task_status.started()
                await trio.sleep_forever()

    async def _train(self) -> None:
        """The trainer's loop without a model: take what the inbox accepted, count it."""
        assert self.inbox is not None
        while True:
            got = await self.inbox.take(min_batches=1, step=self.current_step, timeout_s=1.0)
            for b in got:
                self.trained[(b.announcement.submitter, b.announcement.batch_id)] += 1

    async def publish(self, step: int, seed: int) -> str:
        """Publish a fresh checkpoint as ``step`` (again, if it was published); its digest."""
        assert self.origin is not None
        ck = write_checkpoint(self.root / "ck" / f"{step}-{seed}", seed, self.sizes)
        result = await self.origin.publish(ck, step)
        digest = result.manifest.digest
        self.published[step] = digest
        self.oracle.digests[step] = digest
        self.latest = (step, digest)
        self.published_at = trio.current_time()
        self.current_step = max(self.current_step, step)
        return digest

    def add_relay(self, upstreams: Sequence[str]) -> NodeHandle:
        return self._add("relay", self.relays, upstreams)

    def add_peer(self, upstreams: Sequence[str]) -> NodeHandle:
        return self._add("peer", self.peers, upstreams)

    def _add(self, role: str, handles: list[NodeHandle], upstreams: Sequence[str]) -> NodeHandle:
        n = len(handles)
        h = NodeHandle(
            f"{role}{n}",
            role,
            Identity.from_seed(f"sim-{role}-{n}"),
            self.net.endpoint(),
            tuple(upstreams),
        )
        handles.append(h)
        return h

    async def run_node(self, h: NodeHandle) -> None:
        """Start ``h`` (again, after a crash) in the world's nursery; returns once it serves."""
        assert self._nursery is not None
        await self._nursery.start(self._run_follower, h)

    def kill(self, h: NodeHandle) -> None:
        """Crash ``h`` now: its connections and transfers drop (its data dir stays)."""
        if h.scope is not None:
            h.scope.cancel()
        h.alive = False
        h.crashes += 1
        self.notify()

    async def _run_follower(
        self, h: NodeHandle, *, task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        h.scope = trio.CancelScope()
        h.starts += 1
        h.stopped = trio.Event()
        try:
            await self._follower_body(h, task_status)
        finally:
            h.alive = False
            if h.sender is not None:
                h.old_acks.extend(h.sender.acks)
                h.sender = None
            h.stopped.set()

    async def _follower_body(self, h: NodeHandle, task_status: TaskStatus[None]) -> None:
        assert h.scope is not None
        role = "relay" if h.role == "relay" else "peer"
        with h.scope:
            async with (
                ShardcastNode.open(
                    h.ident, self.trust, self._config(h, role), network=h.endpoint
                ) as node,
                trio.open_nursery() as nursery,
            ):
                h.node, h.alive = node, True
                follower = Follower(
                    node,
                    FollowConfig(
                        upstreams=h.upstreams,
                        poll_interval_s=1.0,
                        max_backoff_s=4.0,
                        advert_interval_s=2.0,
                        max_extra_sources=4,
                        download=DownloadConfig(stall_timeout_s=10.0, no_source_grace_s=30.0),
                    ),
                    random.Random(f"{self.seed}:{h.name}:{h.starts}"),
                    on_commit=self._committed(h),
                )
                h.follower = follower
                if role == "peer":
                    h.sender = RolloutSender(
                        node.p2p,
                        h.ident,
                        RUN,
                        TRAINER.peer_id,
                        SenderConfig(backoff_initial_s=0.5, backoff_max_s=4.0),
                        random.Random(f"{self.seed}:{h.name}:send"),
                    )
                    nursery.start_soon(self._stay_connected, h)
                await nursery.start(follower.run)
                nursery.start_soon(self._watch_bans, h)
                task_status.started()
                await trio.sleep_forever()

    async def _stay_connected(self, h: NodeHandle) -> None:
        """A peer keeps a connection to the trainer (rollouts go there directly)."""
        assert self.trainer is not None
        addr = f"/ip4/{self.trainer.endpoint.ip}/tcp/4001/p2p/{TRAINER.peer_id}"
        while True:
            if h.node is not None and TRAINER.peer_id not in h.node.p2p.connected_peers():
                with contextlib.suppress(ShardnetError):
                    await h.node.p2p.connect(addr)
            await trio.sleep(2.0)

    async def _watch_bans(self, h: NodeHandle) -> None:
        """Sample the downloader's bans (its table forgets them after the ban period)."""
        while True:
            bans = getattr(getattr(h.follower, "downloader", None), "bans", None)
            if bans is not None:
                h.banned_seen.update(bans.banned(trio.current_time()))
            await trio.sleep(1.0)

    def _committed(self, h: NodeHandle) -> Callable[[Manifest, Path, VersionRecord], Any]:
        async def on_commit(m: Manifest, path: Path, rec: VersionRecord) -> None:
            h.commits.append((m.step, m.digest))
            self.notify()
            if h.node is not None:
                self.max_held_versions = max(
                    self.max_held_versions, len(h.node.store.committed_steps())
                )
            if h.sender is not None and self._nursery is not None:
                payload = fake_batch(self.oracle, h.peer_id, m.step)
                ann = await h.sender.submit(payload, m.step, self._nursery)
                h.submitted[ann.batch_id] = m.step

        return on_commit

    # -- sybils ------------------------------------------------------------------------------

    def add_sybil(self) -> Sybil:
        n = len(self.sybils)
        s = Sybil(Identity.from_seed(f"sim-sybil-{n}"), self.net.endpoint())
        self.sybils.append(s)
        return s

    async def run_sybil(self, s: Sybil, targets: Sequence[str], flood_interval_s: float) -> None:
        """Run ``s`` in the world's nursery: connect to ``targets``, then flood forever."""
        assert self._nursery is not None
        await self._nursery.start(self._run_sybil, s, tuple(targets), flood_interval_s)

    async def _run_sybil(
        self,
        s: Sybil,
        targets: tuple[str, ...],
        interval_s: float,
        *,
        task_status: TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        rng = random.Random(f"{self.seed}:{s.ident.peer_id}")
        async with (
            s.endpoint.open_host(s.ident, HostConfig((f"/ip4/{s.endpoint.ip}/tcp/4001",))) as host,
            s.endpoint.open_http_server(
                self._sybil_lane(s, rng), HttpServerConfig(host=s.endpoint.ip, port=8001)
            ) as server,
        ):
            s.host, s.url = host, server.url
            for t in targets:
                with contextlib.suppress(ShardnetError):
                    await host.connect(t)
            for topic in (versions_topic(RUN), nodes_topic(RUN), rollouts_topic(RUN)):
                await host.subscribe(topic, lambda o, d: None)
            task_status.started()
            n = 0
            while True:
                n += 1
                steps = tuple(sorted(self.published)) or (0,)
                with contextlib.suppress(ShardnetError):
                    advert = NodeAdvert(s.ident.peer_id, "relay", s.url, steps, ())
                    await host.publish(nodes_topic(RUN), advert.encode())
                    fake = VersionAnnouncement.create(
                        s.ident, RUN, max(steps) + 1, "ee" * 32, tuple(host.multiaddrs())
                    )
                    await host.publish(versions_topic(RUN), fake.encode())
                    payload = fake_batch(self.oracle, s.ident.peer_id, max(steps), honest=False)
                    ann = RolloutAnnouncement.for_payload(s.ident, RUN, max(steps), payload)
                    if n % 4 == 0:  # the payload would be served by a full sender; flood only
                        await host.publish(rollouts_topic(RUN), ann.encode())
                await trio.sleep(interval_s * (0.5 + rng.random()))

    def _sybil_lane(self, s: Sybil, rng: random.Random) -> Callable[[HttpRequest], Any]:
        async def handle(req: HttpRequest) -> HttpResponse:
            if req.path.startswith("/shardnet/v1/whoami/"):
                nonce = req.path.rsplit("/", 1)[1]
                host = req.headers.get("host", "")
                return HttpResponse(200, [], sign_whoami(s.ident, nonce, f"http://{host}"))
            spec = req.range
            first = getattr(spec, "first", 0) or 0
            last = getattr(spec, "last", None)
            if last is not None:
                n = last - first + 1
                total = first + n + 1024
                return HttpResponse(
                    206,
                    [("content-range", f"bytes {first}-{last}/{total}")],
                    rng.randbytes(n),
                )
            return HttpResponse(200, [], rng.randbytes(512))

        return handle

    # -- bounds ------------------------------------------------------------------------------

    def memory_report(self) -> tuple[bool, list[str]]:
        """Whether every per-node structure that grows with traffic is within its bound."""
        notes = []
        worst_seen = worst_queue = 0
        for host in list(self.net._hosts.values()):
            worst_seen = max(worst_seen, len(host._seen))
            for topic in host._topics.values():
                worst_queue = max(worst_queue, len(topic.sub._pending))
                if len(topic.sub._pending) > host.config.gossip.queue_size:
                    notes.append(f"queue over bound on {host.peer_id[-6:]}")
        if worst_seen > SEEN_CAP:
            notes.append(f"gossip seen-cache {worst_seen} > {SEEN_CAP}")
        if self.inbox is not None:
            buffered = len(self.inbox._buffer)
            if buffered > self.inbox.config.max_buffer_batches:
                notes.append(f"inbox buffer {buffered}")
        if self.max_held_versions > 3 + 1:
            notes.append(f"{self.max_held_versions} versions held on one node")
        for h in [*self.relays, *self.peers]:
            n = h.node
            if n is not None and len(n._reported) > 1024:
                notes.append(f"{h.name} report table {len(n._reported)}")
        return not notes, notes
