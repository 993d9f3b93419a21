"""Role runners behind ``shardnet trainer|relay|peer``: start, announce readiness, stop cleanly.

Each runner opens its node, prints one machine-readable line on stdout once it listens::

    shardnet-ready {"role": "relay", "peer_id": "12D3KooW…", "multiaddrs": [...], "http_url": "…"}

(also written atomically to ``--ready-file`` when given), and runs until its work is done (the
trainer after its last step) or SIGINT/SIGTERM arrives, which cancels everything and closes
every connection and listener. ``--report`` receives a JSON summary on the way out, also
after a signal.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import random
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import trio

from p2p.errors import ConfigError
from p2p.host import peer_id_of
from p2p.identity import Identity
from rollout.engine_options import VllmOptions
from rollout.task import load_task, task_spec
from shardcast.node import bootstrap_card, check_data_dir, iso
from shardcast.wire import (
    RunCard,
    SamplingRules,
    SignedRunCard,
    TaskSpec,
    architecture_digest,
    choose_engine,
    next_card,
)
from shardnet.config import OriginSettings, PeerSettings, RelaySettings, TrainerSettings
from shardnet.observe import attach_origin, attach_peer, attach_trainer
from shardnet.progress import DownloadProgress

if TYPE_CHECKING:
    from p2p.trust import TrustList
    from rollout.engine import Engine
    from rollout.verify import EngineProfile
    from shardcast.node import ShardcastNode
    from shardcast.publish import Origin, PreEncoder, PublishedFiles, RefusedSteps, WatchPresence
    from shardcast.store import VersionStore
    from trainer.dataplane import OriginDataPlane

log = logging.getLogger(__name__)

READY_PREFIX = "shardnet-ready "


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file and a rename."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj, indent=2, default=str))
    os.replace(tmp, path)


def emit_ready(role: str, node: Any, ready_file: Path | None) -> dict[str, Any]:
    """Print the ready line (and write ``ready_file``).

    ``multiaddrs`` and ``http_url`` are what the node advertises to other hosts (never an
    unspecified address, see :mod:`p2p.addresses`); ``listen`` and ``http_bind`` what it bound.
    """
    info = {
        "role": role,
        "peer_id": node.identity.peer_id,
        "run_id": node.config.run_id,
        "multiaddrs": node.p2p.multiaddrs(),
        "http_url": node.http_url,
        "listen": node.p2p.listen_multiaddrs(),
        "http_bind": node.http.url,
        "pid": os.getpid(),
    }
    print(READY_PREFIX + json.dumps(info), flush=True)
    if ready_file is not None:
        write_json_atomic(ready_file, info)
    return info


async def until_signal(body: Callable[[], Awaitable[None]]) -> bool:
    """Run ``body`` until it returns or SIGINT/SIGTERM arrives; then cancel it and wait for
    its cleanup (a node's shielded store flush, :func:`shardcast.node.node._flush_on_stop`).

    The signal receiver stays installed until ``body`` has finished its cleanup: a second
    signal while stopping is logged (``shutdown_signal_repeated``) and otherwise ignored, the
    stop being bounded by the body's own deadlines; a third ends the process at once
    (``shutdown_forced``, exit status 128 + the signal's number; the store is then re-verified
    at the next start). (``timeout(1)`` and a process-group ``kill`` deliver SIGTERM twice;
    with the receiver closed after the first, trio re-raised the second under the default
    action, which killed the process before its flush and left the store's unclean-stop
    marker, so the next start re-hashed every version.)

    Returns:
        True if a signal ended it.
    """
    received = 0
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            body_scope = trio.CancelScope()

            async def watch() -> None:
                nonlocal received
                async for sig in signals:
                    name = signal.Signals(sig).name
                    received += 1
                    if received == 1:
                        log.info("shutdown signal=%s", name)
                        body_scope.cancel()
                    elif received == 2:
                        log.info("shutdown_signal_repeated signal=%s state=stopping", name)
                    else:
                        log.warning("shutdown_forced signal=%s store=unclean", name)
                        logging.shutdown()
                        os._exit(128 + sig)

            nursery.start_soon(watch)
            with body_scope:
                await body()
            nursery.cancel_scope.cancel()
    return received > 0


async def run_trainer(s: TrainerSettings) -> int:
    """``shardnet trainer``: returns the process exit code."""
    import torch

    from rollout.inbox import InboxConfig
    from trainer.config import TrainerConfig
    from trainer.trainer import Trainer

    torch.set_num_threads(s.torch_threads)
    identity = s.identity()
    check_data_dir(s.data_dir, s.run(), identity.peer_id)  # before anything listens
    cfg = TrainerConfig(
        node=dataclasses.replace(
            s.node_config(),
            serve_once_s=s.serve_once_s,
            serve_once_min_bytes=s.serve_once_min_bytes,
        ),
        steps=s.steps,
        model=s.model,
        preset=s.preset,
        task=s.task,
        task_reward=s.task_reward,
        seed=s.seed,
        lr=s.lr,
        optimizer=s.optimizer,
        async_level=s.async_level,
        n_prompts=s.n_prompts,
        group_size=s.group_size,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        engines=s.engine_specs(),
        card_mirrors=tuple(s.card_mirror),
        min_batches=s.min_batches,
        step_timeout_s=s.step_timeout_s,
        peer_timeout_s=s.peer_timeout_s,
        wait_log_interval_s=s.wait_log_interval_s,
        origin=s.origin_config(),
        max_shard_bytes=s.max_shard_bytes,
        expected_peers=tuple(s.expect_peer),
        final_wait_s=s.final_wait_s,
        start_wait_s=s.start_wait_s,
        check_model=s.check_model,
        inbox=InboxConfig(late_grace_steps=s.late_grace_steps),
        validator_profile=s.load_validator_profile(),
    )
    trainer = Trainer(identity, s.trust(identity), cfg)
    finished = False

    async def body() -> None:
        nonlocal finished
        async with trio.open_nursery() as nursery:
            node = await nursery.start(trainer.run)
            attach_trainer(trainer, node)
            emit_ready("trainer", node, s.ready_file)
        finished = True

    try:
        await until_signal(body)
    finally:
        if s.report is not None and trainer.node is not None:
            report = trainer.report()
            report["finished"] = finished
            write_json_atomic(s.report, report)
    return 0


async def run_relay(s: RelaySettings) -> int:
    """``shardnet relay``: runs until a signal; returns the exit code."""
    from shardcast.download import Follower
    from shardcast.node import ShardcastNode

    identity = s.identity()
    check_not_self(identity, s.upstream, "upstream")
    # with --run-id the relay starts at once and fetches the card from its upstreams' info;
    # without, it needs the card's run id first
    if s.run_id is None:
        card = await join_card_or_signal(s, identity, tuple(s.upstream))
        if card is None:
            return 0  # stopped (SIGINT/SIGTERM) while waiting for the run card
    else:
        card = check_data_dir(s.data_dir, s.run_id, _trainer_id(s))
    run_id = card.card.run_id if card is not None else s.run_id
    follower: Follower | None = None

    async def body() -> None:
        nonlocal follower
        node_cfg = dataclasses.replace(
            s.node_config(run_id),
            serve_once_s=s.serve_once_s or None,  # 0: off
            serve_once_min_bytes=s.serve_once_min_bytes,
        )
        async with ShardcastNode.open(identity, s.trust(), node_cfg) as node:
            if card is not None:
                node.set_card(card)
            with DownloadProgress() as progress:
                follower = Follower(
                    node,
                    s.follow_config(s.upstream),
                    random.Random(f"relay:{identity.peer_id}"),
                    progress=progress,
                )
                emit_ready("relay", node, s.ready_file)
                if not s.exit_on_finish:
                    await follower.run()
                    return
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(follower.run)
                    await follower.wait_settled()
                    log.info("relay_exiting reason=run_finished")
                    nursery.cancel_scope.cancel()

    try:
        await until_signal(body)
    finally:
        if s.report is not None and follower is not None:
            write_json_atomic(
                s.report,
                {
                    "peer_id": identity.peer_id,
                    "role": "relay",
                    "versions": [
                        {
                            "step": r.step,
                            "manifest_digest": r.digest,
                            "download_s": r.stats.elapsed_s if r.stats else None,
                            "bytes_by_source": r.stats.bytes_by_source if r.stats else {},
                        }
                        for r in follower.records
                    ],
                    "http": vars(follower.node.http.statistics())
                    | {"errors": dict(follower.node.http.statistics().errors)},
                    "bytes_by_step": follower.node.server.bytes_by_step,
                },
            )
    return 0


async def run_peer(s: PeerSettings) -> int:
    """``shardnet peer``: runs until a signal; returns the exit code."""
    import torch

    from rollout.pacing import PacingConfig
    from shardnet.peer import InferencePeer, PeerConfig, check_followable

    torch.set_num_threads(s.torch_threads)
    identity = s.identity()
    check_not_self(identity, s.bootstrap, "bootstrap")
    check_not_self(identity, s.trainer_addr, "trainer_addr")
    card = await join_card_or_signal(s, identity, tuple(s.bootstrap))
    if card is None:
        return 0  # stopped (SIGINT/SIGTERM) while waiting for the run card
    spec = choose_engine(card.card, local_engines(), s.engine)
    check_followable(card.card, load_task(s.task, s.task_reward), spec)
    engine = make_engine(spec.family, s.vllm_options())
    cfg = PeerConfig(
        node=s.node_config(card.card.run_id),
        follow=s.follow_config(s.bootstrap),
        engine_spec=spec,
        card=card,
        max_versions=s.max_versions,
        trainer_addrs=tuple(s.trainer_addr),
        task=s.task,
        task_reward=s.task_reward,
        exit_on_finish=s.exit_on_finish,
        pacing=PacingConfig(enabled=s.pacing, margin_steps=s.pacing_margin_steps),
    )
    with DownloadProgress() as progress:
        peer = InferencePeer(identity, s.trust(), cfg, engine=engine, progress=progress)

        async def body() -> None:
            async with trio.open_nursery() as nursery:
                node = await nursery.start(peer.run)
                attach_peer(peer, node)
                emit_ready("peer", node, s.ready_file)

        try:
            await until_signal(body)
        finally:
            if s.report is not None:
                write_json_atomic(s.report, peer.report())
            close_engine(engine)
    if peer.fatal is not None:  # a newer run card this peer cannot follow
        raise peer.fatal
    return 0


ENGINE_CLOSE_WAIT_S = 1.0
"""How long a stopping peer waits for its engine's running call before it closes the engine,
seconds: the stop abandoned the generating thread, and vLLM cannot be interrupted mid-call
(see :class:`rollout.engine.Interruptible`)."""


def close_engine(engine: Engine) -> None:
    """Shut an engine that has a ``close`` (vLLM's in-process engine) down, waiting at most
    :data:`ENGINE_CLOSE_WAIT_S` for a call still running in an abandoned thread; if it does
    not finish, log ``engine_close_skipped`` and leave the engine to the process exit."""
    close = getattr(engine, "close", None)
    if close is None:
        return
    if close(wait_s=ENGINE_CLOSE_WAIT_S) is False:
        log.warning("engine_close_skipped reason=busy wait_s=%.1f", ENGINE_CLOSE_WAIT_S)


def check_not_self(identity: Identity, addrs: list[str], option: str) -> None:
    """Refuse an upstream, bootstrap or trainer address naming this node's own PeerID (a swapped
    ``--key``): dialing itself would fail and be retried forever.

    Raises:
        ConfigError: naming ``option``.
    """
    for addr in addrs:
        if peer_id_of(addr) == identity.peer_id:
            raise ConfigError(
                option, f"{addr} is this node itself (the PeerID of its --key): name another node"
            )


def _trainer_id(s: RelaySettings | PeerSettings) -> str:
    """The pinned trainer PeerID (a malformed one fails here, in one line)."""
    return s.trust().trainer


def local_engines() -> dict[str, frozenset[str]]:
    """Engine family -> dtypes this machine can run (vllm only when installed)."""
    from rollout.engine_vllm import vllm_available

    out = {"transformers": frozenset({"bf16"})}
    if vllm_available():
        out["vllm"] = frozenset({"bf16"})
    return out


async def join_card_or_signal(
    s: RelaySettings | PeerSettings, identity: Identity, addrs: tuple[str, ...]
) -> SignedRunCard | None:
    """:func:`join_card`, or None if SIGINT/SIGTERM arrived first (a clean stop, exit 0)."""
    got: list[SignedRunCard] = []

    async def fetch() -> None:
        got.append(await join_card(s, identity, addrs))

    await until_signal(fetch)
    return got[0] if got else None


async def join_card(
    s: RelaySettings | PeerSettings, identity: Identity, addrs: tuple[str, ...]
) -> SignedRunCard:
    """The run card a relay or peer starts with: the one stored in its data directory, else
    one fetched from ``addrs`` (retried until one answers), checked against ``run_id``.

    Raises:
        ConfigError: the data directory holds another run or a bad card, the fetched card is
            for another run than ``run_id``, or every address offers a card that does not
            verify against ``trainer_id`` (see :func:`shardcast.node.cardsync.bootstrap_card`).
    """
    card = check_data_dir(s.data_dir, s.run_id, _trainer_id(s))
    if card is None:
        card = await bootstrap_card(identity, addrs, s.trainer_id)
        if s.run_id is not None and card.card.run_id != s.run_id:
            raise ConfigError(
                "run_id",
                f"the run card from the bootstrap nodes is for run {card.card.run_id!r}, "
                f"not {s.run_id!r}: drop --run-id or fix it",
            )
        check_data_dir(s.data_dir, card.card.run_id, s.trainer_id)
    return card


def make_engine(name: str, vllm: VllmOptions | None = None) -> Engine:
    """The inference engine called ``name``: ``transformers`` or ``vllm`` (built with
    ``vllm``, default :class:`~rollout.engine_options.VllmOptions`'s defaults).

    Raises:
        ConfigError: unknown name, or ``vllm`` without the vllm extra installed (field
            ``engine``).
    """
    if name == "transformers":
        from rollout.engine import TransformersEngine

        return TransformersEngine()
    if name == "vllm":
        from rollout.engine_vllm import VllmEngine, vllm_available

        if not vllm_available():
            raise ConfigError(
                "engine", "vllm is not installed (extra shardnet[vllm]; see rollout/engine_vllm.py)"
            )
        return VllmEngine(keep_host_copy=(vllm or VllmOptions()).keep_host_copy)
    raise ConfigError("engine", f"unknown engine {name!r} (available: transformers, vllm)")


STAGED_FILE_MODE = 0o644
"""Mode of the files the origin stages from ``--watch`` (readable by a web server)."""
STAGED_DIR_MODE = 0o755


def stage_checkpoint(src: Path, dst: Path, ready_marker: str = "") -> list[Path]:
    """Hard-link (or copy, across file systems) the regular files of ``src`` into ``dst``
    (all but the ``ready_marker`` file, which is the trainer's, not the checkpoint's).

    ``dst`` (replaced if present) becomes the version directory in the origin's store, which
    relays, ``shardnet mirror export`` and web servers read, so it is made ``0755`` and every
    file ``0644``. A hard link shares its inode with the trainer's file: setting the mode
    there changes the trainer's file too (only to ``0644``; a published checkpoint is no
    secret). A linked file whose mode cannot be set (owned by another user) is copied
    instead, the copy made ``0644``. Hidden files (``.name``) and non-regular entries are
    left out.

    Returns:
        the staged files whose mode could still not be set; one warning
        (``staged_file_mode``) naming each was logged.

    Raises:
        OSError: ``src`` cannot be read or ``dst`` cannot be written.
    """
    import shutil
    import stat

    shutil.rmtree(dst, ignore_errors=True)
    dst.mkdir(parents=True)
    unset: list[Path] = []
    try:
        os.chmod(dst, STAGED_DIR_MODE)
    except OSError as exc:
        log.warning("staged_dir_mode dir=%s error=%s", dst, exc)
    for entry in os.scandir(src):
        if not entry.is_file(follow_symlinks=False) or entry.name.startswith("."):
            continue
        if entry.name == ready_marker:
            continue
        target = dst / entry.name
        try:
            os.link(entry.path, target)
            linked = True
        except OSError:
            shutil.copy2(entry.path, target)
            linked = False
        if stat.S_IMODE(target.stat().st_mode) == STAGED_FILE_MODE:
            continue
        try:
            os.chmod(target, STAGED_FILE_MODE)
            continue
        except OSError as exc:
            error = exc
        if linked:  # not ours to change: a copy is
            target.unlink()
            shutil.copyfile(entry.path, target)
            if stat.S_IMODE(target.stat().st_mode) == STAGED_FILE_MODE:
                continue
            try:
                os.chmod(target, STAGED_FILE_MODE)
                continue
            except OSError as exc:
                error = exc
        mode = stat.S_IMODE(target.stat().st_mode)
        log.warning(
            "staged_file_mode file=%s mode=%04o error=%s: cannot make it 0644; a web server or "
            "mirror running as another user may not read it",
            target,
            mode,
            error,
        )
        unset.append(target)
    return unset


async def run_origin(s: OriginSettings) -> int:
    """``shardnet origin``: publish each complete ``WATCH/step-<N>/`` in step order; with
    ``--rollouts-out``, also receive, verify and write peers' rollouts
    (:class:`trainer.dataplane.OriginDataPlane`)."""
    from shardcast.node import ShardcastNode
    from shardcast.publish import (
        CheckpointLayoutError,
        Origin,
        RefusedSteps,
        WatchPresence,
        fingerprint,
    )

    identity = s.identity()
    trust = s.trust(identity)
    published: list[dict[str, Any]] = []
    check_data_dir(s.data_dir, s.run(), identity.peer_id)  # before anything listens
    plane = _origin_plane(s, trust) if s.rollouts_out is not None else None

    async def body() -> None:
        node_cfg = dataclasses.replace(
            s.node_config(),
            serve_once_s=s.serve_once_s,
            serve_once_min_bytes=s.serve_once_min_bytes,
        )
        checked: list[PublishedFiles] = []  # files changed while down: quarantined first
        start = functools.partial(_start_published_files, trust, checked)
        async with (
            ShardcastNode.open(identity, trust, node_cfg, before_listening=start) as node,
            trio.open_nursery() as nursery,
        ):
            origin = Origin(node, s.origin_config())
            attach_origin(node, plane, s.async_level)
            held = checked[0]
            # hash and encode files while the trainer writes the others
            pre = _start_pre_encoder(s, node, origin, nursery) if s.pre_encode else None
            emit_ready("origin", node, s.ready_file)
            latest = node.store.latest()
            if plane is not None and latest is not None:  # restarted: judge against held ones
                await _resume_plane(plane, node, trust, nursery, latest)
            await origin.reannounce()  # a restarted origin is followed at once
            refused, presence = RefusedSteps(), WatchPresence()
            node.status_sections["watch"] = lambda: _watch_status(s, node, refused, presence)
            ended: bool | None = None  # what followers hold is not known after a restart
            while True:
                # the marker is looked at before the scan and after: see end_action
                before = (s.watch / s.finished_marker).exists()
                for step in _ready_steps(s, presence, held.newest):
                    src = s.watch / f"step-{step}"
                    files = fingerprint(src)
                    if not refused.should_try(step, files):
                        continue
                    try:
                        entry = await _publish_step(
                            s, identity, node, origin, plane, pre, nursery, step, held
                        )
                    except (CheckpointLayoutError, ConfigError, FileNotFoundError) as exc:
                        refused.refused(step, files)
                        _refused_step(s, step, exc)
                        continue
                    published.append(entry)
                    refused.published(step)
                    latest, ended = step, False  # a newer version lifts an end
                await trio.to_thread.run_sync(held.check)
                ended = await _follow_finished_marker(s, origin, nursery, before, latest, ended)
                await trio.sleep(s.poll_interval_s)

    try:
        await until_signal(body)
    finally:
        if s.report is not None:
            report: dict[str, Any] = {
                "role": "origin",
                "peer_id": identity.peer_id,
                "published": published,
            }
            if plane is not None:
                report["rollouts"] = plane.report()
            write_json_atomic(s.report, report)
    return 0


def _start_published_files(
    trust: TrustList, into: list[PublishedFiles], store: VersionStore
) -> None:
    """Start the origin's watch over the files it published, on its store, before the lane
    listens (``ShardcastNode.open``'s ``before_listening``): versions whose files changed
    while it was down are quarantined before any follower could be served them; the
    :class:`~shardcast.publish.PublishedFiles` goes to ``into`` (blocking)."""
    from shardcast.publish import PublishedFiles

    held = PublishedFiles(store, trust)
    held.start()
    into.append(held)


async def _follow_finished_marker(
    s: OriginSettings,
    origin: Origin,
    nursery: trio.Nursery,
    before: bool,
    latest: int | None,
    ended: bool | None,
) -> bool | None:
    """End the run when ``WATCH/<finished_marker>`` appears, continue it when it goes
    (:func:`shardcast.publish.watchdir.end_action`, given ``before``: whether the marker
    was there before this pass's scan); returns what is signed now."""
    from shardcast.publish import EndAction, end_action

    after = (s.watch / s.finished_marker).exists()
    action = end_action(before, after, ended, latest)
    if action is EndAction.FINISH:
        fin = await origin.announce_finished()
        if fin is not None:
            log.info(
                "run_finished_announced step=%d seq=%d marker=%s",
                fin.step,
                fin.seq,
                s.watch / s.finished_marker,
            )
        return True
    if action is EndAction.CONTINUE:
        await origin.continue_run(nursery)  # logs run_continued_announced if it signed one
        return False
    return ended


def _ready_steps(s: OriginSettings, presence: WatchPresence, newest: int | None) -> list[int]:
    """The ``WATCH`` steps ready to publish: newer than ``newest``, the newest step this
    origin ever published (:attr:`~shardcast.publish.PublishedFiles.newest`, which a
    quarantine does not lower: a step number is never published twice). Says once that
    ``WATCH`` is missing (the trainer creates it later), found, or gone, and once per
    zero-padded step directory that it is not published."""
    from shardcast.publish import WatchChange, ready_steps

    change = presence.seen(s.watch.is_dir())
    if change is WatchChange.MISSING:
        log.info("watch_dir_missing dir=%s hint=waiting for the trainer to create it", s.watch)
    elif change is WatchChange.FOUND:
        log.info("watch_dir_found dir=%s", s.watch)
    elif change is WatchChange.GONE:
        log.warning(
            "watch_dir_gone dir=%s hint=nothing new is published until it is back (moved, "
            "deleted or unmounted?)",
            s.watch,
        )
    padded: set[str] = set()
    ready = ready_steps(s.watch, s.ready_marker, newest, padded)
    for name in presence.padded(padded):
        log.warning(
            "watch_dir_misnamed dir=%s hint=not published: name step directories step-<N> "
            "without leading zeros (step-%s)",
            s.watch / name,
            int(name.removeprefix("step-")),
        )
    return ready


def _watch_status(
    s: OriginSettings, node: ShardcastNode, refused: RefusedSteps, presence: WatchPresence
) -> dict[str, Any]:
    """The ``watch`` section of the origin's ``/status`` (what it waits for in ``WATCH``)."""
    return {
        "dir": str(s.watch),
        "dir_present": presence.present,
        "ready_marker": s.ready_marker,
        "finished_marker": s.finished_marker,
        "finished_marker_present": (s.watch / s.finished_marker).exists(),
        "latest_published": node.store.latest(),
        "refused": refused.steps(),
    }


def _refused_step(s: OriginSettings, step: int, exc: Exception) -> None:
    """Say once why ``WATCH/step-<step>/`` was not published (nothing of it was signed), and
    remove what was staged of it; it is tried again when its files change."""
    import shutil

    staging, src = s.data_dir / "staging" / f"step-{step}", s.watch / f"step-{step}"
    shutil.rmtree(staging, ignore_errors=True)
    log.warning(
        "checkpoint_refused step=%d error=%s hint=nothing was published; it is tried again "
        "when %s changes (write the ready marker %s last, after every file is whole)",
        step,
        str(exc).replace(str(staging), str(src)),  # the operator's files, not the staged copy
        src,
        s.ready_marker,
    )


def _start_pre_encoder(
    s: OriginSettings, node: ShardcastNode, origin: Origin, nursery: trio.Nursery
) -> PreEncoder:
    """Start hashing and encoding the files of ``WATCH`` versions ahead of their publication
    (:class:`shardcast.publish.PreEncoder`, run in ``nursery``)."""
    from shardcast.publish import Base, EncodeSettings, PreEncoder

    def plan(step: int) -> tuple[EncodeSettings, Base | None] | None:
        # step - 1 may still be published: it waits in WATCH, newer than the store
        held = node.store.latest()
        pending = (s.watch / f"step-{step - 1}").is_dir() and (held is None or step - 1 > held)
        return origin.encode_plan(step, pending)

    pre = PreEncoder(
        plan,
        s.data_dir / "staging" / ".pre",
        s.pre_encode_settle_s,
        node.store.pinned,
        workers=origin.config.workers,
    )
    nursery.start_soon(pre.run, s.watch, s.ready_marker, s.poll_interval_s)
    return pre


async def _resume_plane(
    plane: OriginDataPlane,
    node: ShardcastNode,
    trust: TrustList,
    nursery: trio.Nursery,
    latest: int,
) -> None:
    """A restarted origin's rollout plane: started on the newest version held, which
    rollouts are judged against until the next one is published."""
    await plane.start(nursery, node.p2p, node.store.version_dir(latest))
    assert plane.intake is not None
    await plane.intake.add_committed(node.store, trust, latest)
    plane.current = latest


async def _publish_step(
    s: OriginSettings,
    identity: Identity,
    node: ShardcastNode,
    origin: Origin,
    plane: OriginDataPlane | None,
    pre: PreEncoder | None,
    nursery: trio.Nursery,
    step: int,
    held: PublishedFiles,
) -> dict[str, Any]:
    """Stage ``WATCH/step-<step>/``, sign the run card for it, and publish it (the rollout
    plane, if any, serving first); returns its entry of the origin's report. The staged
    files' fingerprint, taken before they are hashed, goes to ``held``: a file rewritten
    while or after it is hashed is then found at the next check.

    Raises:
        CheckpointLayoutError: not a whole checkpoint (:func:`check_layout`); nothing signed.
        ConfigError: its ``config.json`` is not a JSON object.
        FileNotFoundError: a file vanished while it was staged.
    """
    from shardcast.publish import Ahead, check_layout, fingerprint

    staging = s.data_dir / "staging" / f"step-{step}"
    src = s.watch / f"step-{step}"
    # before staging (it may chmod the files): what was encoded ahead, unchanged
    ahead = await pre.take(step, src) if pre is not None else Ahead()
    try:
        await trio.to_thread.run_sync(stage_checkpoint, src, staging, s.ready_marker)
        await trio.to_thread.run_sync(check_layout, staging)  # before the card is signed
        files = await trio.to_thread.run_sync(fingerprint, staging)  # before hashing
        rules = origin_card_rules(s, identity.peer_id, staging)
        node.set_card(next_card(rules, node.card, identity))
        if plane is not None and plane.intake is None:  # serve before announcing
            await plane.start(nursery, node.p2p, staging)
        result = await origin.publish(staging, step, pre_encoded=ahead.files, known=ahead.known)
    finally:
        if pre is not None:
            pre.published(step)
    await trio.to_thread.run_sync(held.add, step, files)
    if plane is not None:
        await plane.published(step, result.manifest.digest, result.path)
    return {
        "step": step,
        "published_at": iso(time.time()),
        "manifest_digest": result.manifest.digest,
        "size_bytes": result.manifest.total_bytes,
        "hash_s": result.hash_s,
        "encoded_bytes": result.encoded_bytes,
    }


def _origin_plane(s: OriginSettings, trust: TrustList) -> OriginDataPlane:
    """The origin's rollout data plane for ``--rollouts-out`` (torch is imported here)."""
    import torch

    from rollout.inbox import InboxConfig
    from rollout.verify import DEFAULT_PROFILES, ValidatorConfig
    from trainer.dataplane import OriginDataPlane

    assert s.rollouts_out is not None
    torch.set_num_threads(s.torch_threads)
    task = load_task(s.task, s.task_reward)
    rules = ValidatorConfig(
        run_id=s.run(),
        task=task.name,
        n_prompts=s.n_prompts,
        group_size=s.group_size,
        max_new_tokens=s.max_new_tokens,
        temperature=s.temperature,
        async_level=s.async_level,
        check_model=s.check_model,
        engines=tuple(e.id for e in s.engine_specs()),
        profiles={**DEFAULT_PROFILES, **origin_profiles(s)},
    )
    return OriginDataPlane(
        rules,
        task,
        trust,
        InboxConfig(late_grace_steps=s.late_grace_steps),
        s.rollouts_out,
        session=os.urandom(8).hex(),
    )


def origin_profiles(s: OriginSettings) -> dict[str, EngineProfile]:
    """The ``validator_profile`` thresholds of the origin's engines (empty without one).

    Raises:
        ConfigError: on ``validator_profile`` (see :meth:`PublishSettings.load_validator_profile`).
    """
    profile = s.load_validator_profile()
    return {} if profile is None else profile.for_engines(tuple(s.engines))


def origin_card_rules(s: OriginSettings, trainer: str, version_dir: Path) -> RunCard:
    """The run card ``shardnet origin`` publishes for the version in ``version_dir``: the
    rules from the settings, the architecture digest of the version's ``config.json``.

    Raises:
        ConfigError: ``config.json`` is missing or not a JSON object (field ``watch``).
    """
    path = version_dir / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError("watch", f"{path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ConfigError("watch", f"{path} is not a JSON object")
    arch = architecture_digest(config)
    card = None
    profile = s.load_validator_profile()
    if profile is not None:
        from rollout.calibrate import card_profile

        profile.check_architecture(arch)
        card = card_profile(profile, profile.for_engines(tuple(s.engines)))
    return RunCard(
        card_version=1,
        run_id=s.run(),
        trainer=trainer,
        task=TaskSpec(*task_spec(load_task(s.task, s.task_reward))),
        sampling=SamplingRules(s.n_prompts, s.group_size, s.max_new_tokens, s.temperature),
        engines=s.engine_specs(),
        async_level=s.async_level,
        architecture_digest=arch,
        issued_at_ms=int(time.time() * 1000),
        mirrors=tuple(s.card_mirror),
        validator_profile=card,
    )
