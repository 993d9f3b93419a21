"""The trainer's, the standalone origin's and the inference peer's own ``/status`` sections
and metric families.

:func:`attach_trainer`, :func:`attach_origin` and :func:`attach_peer` register them on the
role's running :class:`~shardcast.node.node.ShardcastNode` (the role runners call them once the
node is up; tests that run a role in-process call them too). Everything is read at scrape or
request time from the statistics objects the role already keeps, so nothing here can drift
from the reports.

Trainer families: ``shardnet_trainer_step``, ``shardnet_trainer_async_window_versions``,
``shardnet_trainer_mean_reward``, ``shardnet_trainer_peers{state}`` (``current``/``lagging``:
more than the async window behind), ``shardnet_rollouts_announced_total``,
``shardnet_rollouts_fetched_bytes_total``, ``shardnet_rollout_batches_buffered``,
``shardnet_rollout_batches_accepted_total``, ``shardnet_rollout_batches_rejected_total``,
``shardnet_rollout_samples_accepted_total``, ``shardnet_rollout_samples_rejected_total{reason}``,
``shardnet_submitters_refused``, ``shardnet_rollout_rate_limited_total``,
``shardnet_rollout_batches_fetched_total`` (payloads fetched from submitters),
``shardnet_trainer_optimizer_step_seconds`` (histogram: one optimizer step, in its thread),
``shardnet_rollout_batches_decided_total{length}``, ``…_admitted_total{length}``,
``…_trained_total{length}`` and ``…_late_total{length}`` (per rollout-length bucket, mean
completion tokens per sample rounded up to a power of two: whether long rollouts are lost). The
same counts per submitter PeerID, with the acceptance and trained-on rates, are in ``/status``
(``rollouts.acceptance``), not in metrics (one label value per PeerID is unbounded).

Standalone origin (``shardnet origin``, an external trainer):
``shardnet_trainer_async_window_versions`` always; with ``--rollouts-out``, once its intake
started, the trainer's rollout-side families above (all but ``shardnet_trainer_step``,
``…_mean_reward`` and ``…_optimizer_step_seconds``: it does not train) plus
``shardnet_rollouts_out_files_total`` and ``shardnet_rollouts_out_rows_total``. The same names
as the trainer's, so the alert rules and dashboards in ``deploy/`` hold under either.

Peer families: ``shardnet_rollout_batches_submitted_total``,
``shardnet_rollout_batches_acked_total{status}``, ``shardnet_rollout_retries_total``,
``shardnet_rollout_batches_given_up_total``, ``shardnet_rollout_batches_pending``,
``shardnet_peer_versions_generated_total``, ``shardnet_peer_mean_reward``,
``shardnet_peer_weight_swap_seconds`` (histogram: loading a committed version into the
engine), ``shardnet_peer_generation_seconds`` (histogram: generating one batch),
``shardnet_peer_generated_tokens_total`` and ``shardnet_peer_generation_tokens_per_second``
(completion tokens of the newest batch over its generation time; NaN: none yet). Rates over
many batches: ``rate(…generated_tokens_total) / rate(…generation_seconds_sum)``.

The duration families are event families: :func:`attach_trainer` and :func:`attach_peer`
set the role's ``on_*`` hooks to observe them as the durations happen.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import trio
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shardcast.node import iso, wall_of

if TYPE_CHECKING:
    from rollout.inbox import InboxStats, RolloutInbox
    from rollout.intake import Acceptance
    from rollout.reputation import Reputation
    from rollout.verify import Validator, ValidatorStats
    from shardcast.node import ShardcastNode
    from shardnet.peer import InferencePeer
    from trainer.dataplane import OriginDataPlane
    from trainer.trainer import Trainer


# optimizer steps, weight loads and batch generation: CPU seconds to tens of minutes
_STEP_BUCKETS_S = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800)


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _counter_by(name: str, doc: str, label: str, counts: Mapping[str, int]) -> CounterMetricFamily:
    """A counter family with one ``label`` value per key of ``counts`` (sorted)."""
    family = CounterMetricFamily(name, doc, labels=[label])
    for key, n in sorted(counts.items()):
        family.add_metric([key], n)
    return family


# -- the rollout side: the trainer, or the origin on an external trainer's behalf -------------


def network_view(inbox: RolloutInbox | None, published: int) -> list[dict[str, Any]]:
    """Per peer that said hello to ``inbox``: newest version it reported, lag in versions
    behind ``published`` (the newest published step; -1: none), last heard (ISO 8601 UTC)."""
    if inbox is None:
        return []
    now, wall = trio.current_time(), time.time()
    out = []
    for peer in sorted(set(inbox.joined) | set(inbox.statuses)):
        versions = inbox.statuses.get(peer, {})
        latest = max(versions) if versions else None
        heard = max((t for _, t in versions.values()), default=inbox.joined.get(peer))
        out.append(
            {
                "peer_id": peer,
                "latest_step": latest,
                "lag_versions": (
                    published - latest if latest is not None and published >= 0 else None
                ),
                "last_heard": iso(wall_of(heard, now, wall)) if heard is not None else None,
            }
        )
    return out


def rollouts_view(inbox: RolloutInbox | None, validator: Validator | None) -> dict[str, Any]:
    """Rollouts announced, pending, accepted and rejected by reason; acceptance per submitter
    and per rollout length (``/status`` ``rollouts``)."""
    out: dict[str, Any] = {}
    if inbox is not None:
        st = inbox.statistics()
        out.update(
            announced=st.announcements,
            duplicates=st.duplicates,
            redelivered=st.redelivered,
            fetched_bytes=st.fetched_bytes,
            pending_batches=st.buffered,
            expired_samples=st.expired_samples,
            acks=st.acks,
            acceptance={
                "by_submitter": {k: _acceptance(a) for k, a in sorted(st.by_submitter.items())},
                "by_length": {k: _acceptance(a) for k, a in sorted(st.by_length.items())},
            },
        )
    if validator is not None:
        vs = validator.statistics()
        out.update(
            accepted_batches=vs.accepted_batches,
            accepted_samples=vs.accepted_samples,
            rejected_batches=vs.rejected_batches,
            rejected_samples_by_reason=dict(vs.rejected_samples),
        )
    return out


def _acceptance(a: Acceptance) -> dict[str, Any]:
    """One submitter's or one length bucket's counts and rates (``/status``)."""
    return {
        "decided": a.decided,
        "accepted": a.accepted,
        "trained": a.trained,
        "late": a.late,
        "acceptance_rate": round(a.acceptance_rate, 4),
        "trained_rate": round(a.trained_rate, 4),
    }


def reputation_view(reputation: Reputation) -> dict[str, Any]:
    """Submitter scores, refused submitters and rate-limited announcements."""
    rs = reputation.statistics()
    return {
        "scores": dict(sorted(rs.scores.items())),
        "refused": list(rs.refused),
        "rate_limited": rs.rate_limited,
    }


def _async_window(async_level: int) -> GaugeMetricFamily:
    """``shardnet_trainer_async_window_versions``: the run's async level (versions)."""
    return _gauge(
        "shardnet_trainer_async_window_versions",
        "how many versions behind a rollout's policy may be",
        async_level,
    )


def rollout_side_families(
    inbox: RolloutInbox | None,
    validator: Validator | None,
    reputation: Reputation,
    published: int,
    async_level: int,
) -> list[Metric]:
    """The families of whoever takes the run's rollouts (the trainer, or ``shardnet origin
    --rollouts-out`` for an external trainer): peers by state, the async window, refused
    submitters, rate limits, the inbox's and the validator's counts. The same names from
    both, so the alert rules in ``deploy/alerts.yml`` hold under either."""
    network = network_view(inbox, published)
    lagging = sum(
        1 for p in network if p["latest_step"] is None or (p["lag_versions"] or 0) > async_level
    )
    peers = GaugeMetricFamily(
        "shardnet_trainer_peers",
        "peers that said hello, by state (lagging: more than the async window behind)",
        labels=["state"],
    )
    peers.add_metric(["current"], len(network) - lagging)
    peers.add_metric(["lagging"], lagging)
    rs = reputation.statistics()
    out: list[Metric] = [
        _async_window(async_level),
        peers,
        _gauge(
            "shardnet_submitters_refused", "submitters refused for low reputation", len(rs.refused)
        ),
        _counter(
            "shardnet_rollout_rate_limited", "announcements dropped by rate limits", rs.rate_limited
        ),
    ]
    if inbox is not None:
        out += _inbox_families(inbox.statistics())
    if validator is not None:
        out += _validator_families(validator.statistics())
    return out


def _inbox_families(st: InboxStats) -> list[Metric]:
    """The rollout inbox's families: announcements, fetches, buffered and batches by length."""
    out: list[Metric] = [
        _counter(
            "shardnet_rollouts_announced",
            "rollout batch announcements received",
            st.announcements,
        ),
        _counter(
            "shardnet_rollouts_fetched_bytes", "rollout payload bytes fetched", st.fetched_bytes
        ),
        _counter(
            "shardnet_rollout_batches_fetched",
            "rollout batch payloads fetched from submitters",
            st.fetched_batches,
        ),
        _gauge(
            "shardnet_rollout_batches_buffered",
            "verified batches waiting for a step",
            st.buffered,
        ),
    ]
    by_length = st.by_length
    for what, doc in (
        ("decided", "batches with a final verdict"),
        ("accepted", "batches admitted to the training buffer"),
        ("trained", "admitted batches handed to the optimizer"),
        ("late", "batches admitted in the late grace window"),
    ):
        name = "admitted" if what == "accepted" else what
        out.append(
            _counter_by(
                f"shardnet_rollout_batches_{name}",
                f"{doc}, by rollout length bucket (mean completion tokens per sample)",
                "length",
                {k: getattr(a, what) for k, a in by_length.items()},
            )
        )
    return out


def _validator_families(vs: ValidatorStats) -> list[Metric]:
    """The validator's families: batches and samples accepted and rejected (by reason)."""
    rejected = _counter_by(
        "shardnet_rollout_samples_rejected",
        "samples rejected, by reason",
        "reason",
        vs.rejected_samples,
    )
    return [
        _counter("shardnet_rollout_batches_accepted", "batches accepted", vs.accepted_batches),
        _counter("shardnet_rollout_batches_rejected", "batches rejected", vs.rejected_batches),
        _counter("shardnet_rollout_samples_accepted", "samples accepted", vs.accepted_samples),
        rejected,
    ]


# -- trainer --------------------------------------------------------------------------------


def trainer_section(trainer: Trainer) -> dict[str, Any]:
    """The trainer's own state: step, window, newest mean reward, reputation."""
    rewards = [r.mean_reward for r in trainer.records if r.mean_reward is not None]
    return {
        "published_step": trainer.published if trainer.published >= 0 else None,
        "steps": trainer.config.steps,
        "async_window_versions": trainer.config.async_level,
        "mean_reward": rewards[-1] if rewards else None,
        "reputation": reputation_view(trainer.reputation),
    }


def trainer_families(trainer: Trainer) -> list[Metric]:
    """The trainer's families (see module docstring)."""
    rewards = [r.mean_reward for r in trainer.records if r.mean_reward is not None]
    return [
        _gauge("shardnet_trainer_step", "newest published step (-1: none)", trainer.published),
        _gauge(
            "shardnet_trainer_mean_reward",
            "mean recomputed reward of the newest trained step (NaN: none yet)",
            rewards[-1] if rewards else float("nan"),
        ),
        *rollout_side_families(
            trainer.inbox,
            trainer.validator,
            trainer.reputation,
            trainer.published,
            trainer.config.async_level,
        ),
    ]


def attach_trainer(trainer: Trainer, node: ShardcastNode) -> None:
    """Add the trainer's ``/status`` sections and metric families to ``node``."""
    node.status_sections.update(
        trainer=lambda: trainer_section(trainer),
        network=lambda: network_view(trainer.inbox, trainer.published),
        rollouts=lambda: {
            **rollouts_view(trainer.inbox, trainer.validator),
            "trained_samples": trainer.trained_samples,
        },
    )
    node.metrics.add_collector(lambda: trainer_families(trainer))
    trainer.on_optimizer_step = Histogram(
        "shardnet_trainer_optimizer_step_seconds",
        "duration of one optimizer step (loss, backward, update), seconds",
        buckets=_STEP_BUCKETS_S,
        registry=node.metrics.registry,
    ).observe


# -- standalone origin (an external trainer) -------------------------------------------------


def _origin_published(node: ShardcastNode) -> int:
    latest = node.store.latest()
    return latest if latest is not None else -1


def origin_intake_section(
    node: ShardcastNode, plane: OriginDataPlane | None, async_level: int
) -> dict[str, Any]:
    """The standalone origin's ``intake`` section: the run's async window and, with
    ``--rollouts-out``, where verified rollouts go, what was written, submitter reputation."""
    out: dict[str, Any] = {"async_window_versions": async_level, "rollouts_out": None}
    if plane is not None:
        out["rollouts_out"] = str(plane.out_dir)
        out["started"] = plane.intake is not None
        if plane.sink is not None:
            out["files_written"] = plane.sink.stats.files
            out["rows_written"] = plane.sink.stats.rows
        if plane.intake is not None:
            out["reputation"] = reputation_view(plane.intake.reputation)
    return out


def origin_families(
    node: ShardcastNode, plane: OriginDataPlane | None, async_level: int
) -> list[Metric]:
    """The standalone origin's rollout-side families: the async window always (peers' lag
    alerts compare against it); with ``--rollouts-out`` once its intake started, the same
    families as the trainer's rollout side (:func:`rollout_side_families`) plus
    ``shardnet_rollouts_out_files_total`` and ``shardnet_rollouts_out_rows_total``."""
    if plane is None or plane.intake is None:
        return [_async_window(async_level)]
    intake = plane.intake
    out = rollout_side_families(
        intake.inbox, intake.validator, intake.reputation, _origin_published(node), async_level
    )
    if plane.sink is not None:
        st = plane.sink.stats
        out += [
            _counter(
                "shardnet_rollouts_out_files", "Parquet files written to --rollouts-out", st.files
            ),
            _counter(
                "shardnet_rollouts_out_rows",
                "verified rollout samples written to --rollouts-out",
                st.rows,
            ),
        ]
    return out


def attach_origin(node: ShardcastNode, plane: OriginDataPlane | None, async_level: int) -> None:
    """Add the standalone origin's rollout side to ``node``'s ``/status`` (``intake``, and
    with ``--rollouts-out`` ``network`` and ``rollouts`` as the trainer has them) and
    metrics (:func:`origin_families`). ``plane`` may start later (with the first version):
    everything is read at request time."""

    node.status_sections["intake"] = lambda: origin_intake_section(node, plane, async_level)
    if plane is not None:

        def network() -> list[dict[str, Any]]:
            i = plane.intake
            return network_view(i.inbox, _origin_published(node)) if i is not None else []

        def rollouts() -> dict[str, Any]:
            i = plane.intake
            return rollouts_view(i.inbox, i.validator) if i is not None else {}

        node.status_sections.update(network=network, rollouts=rollouts)
    node.metrics.add_collector(lambda: origin_families(node, plane, async_level))


# -- inference peer -------------------------------------------------------------------------


def peer_rollouts(peer: InferencePeer) -> dict[str, Any]:
    """Batches submitted, acknowledged by status, pending, retried, given up."""
    generated = [r for r in peer.records if r.generated]
    out: dict[str, Any] = {
        "versions_generated": len(generated),
        "mean_reward": generated[-1].mean_reward if generated else None,
    }
    if peer.sender is not None:
        st = peer.sender.statistics()
        out.update(
            submitted=st.submitted,
            acked=dict(st.acked),
            pending=st.pending,
            retries=st.retries,
            given_up=st.given_up,
        )
    return out


def peer_families(peer: InferencePeer) -> list[Metric]:
    """The peer's families (see module docstring)."""
    generated = [r for r in peer.records if r.generated]
    reward = generated[-1].mean_reward if generated else None
    out: list[Metric] = [
        _counter(
            "shardnet_peer_versions_generated",
            "versions this peer generated rollouts on",
            len(generated),
        ),
        _gauge(
            "shardnet_peer_mean_reward",
            "own mean reward of the newest batch (NaN: none)",
            reward if reward is not None else float("nan"),
        ),
    ]
    if peer.sender is not None:
        st = peer.sender.statistics()
        acked = _counter_by(
            "shardnet_rollout_batches_acked", "batches acknowledged, by status", "status", st.acked
        )
        out += [
            _counter(
                "shardnet_rollout_batches_submitted", "batches handed to the sender", st.submitted
            ),
            acked,
            _counter("shardnet_rollout_retries", "announcement retries", st.retries),
            _counter(
                "shardnet_rollout_batches_given_up", "batches abandoned unacknowledged", st.given_up
            ),
            _gauge("shardnet_rollout_batches_pending", "batches not acknowledged yet", st.pending),
        ]
    return out


def attach_peer(peer: InferencePeer, node: ShardcastNode) -> None:
    """Add the peer's ``/status`` section and metric families to ``node``."""
    node.status_sections["rollouts"] = lambda: peer_rollouts(peer)
    node.metrics.add_collector(lambda: peer_families(peer))
    reg = node.metrics.registry
    peer.on_weight_swap = Histogram(
        "shardnet_peer_weight_swap_seconds",
        "time to load a committed version's weights into the inference engine, seconds",
        buckets=_STEP_BUCKETS_S,
        registry=reg,
    ).observe
    generation = Histogram(
        "shardnet_peer_generation_seconds",
        "time to generate one rollout batch (all groups), seconds",
        buckets=_STEP_BUCKETS_S,
        registry=reg,
    )
    tokens = Counter("shardnet_peer_generated_tokens", "completion tokens generated", registry=reg)
    rate = Gauge(
        "shardnet_peer_generation_tokens_per_second",
        "completion tokens per second of the newest batch (NaN: none yet)",
        registry=reg,
    )
    rate.set(float("nan"))

    def on_generation(n_tokens: int, seconds: float) -> None:
        generation.observe(seconds)
        tokens.inc(n_tokens)
        rate.set(n_tokens / seconds if seconds > 0 else float("nan"))

    peer.on_generation = on_generation
