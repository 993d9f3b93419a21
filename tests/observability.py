"""The metric families each role exports (name -> Prometheus type), shared by the live
scrape test and the dashboard/alert-rule test, plus helpers to parse and check scrapes."""

from __future__ import annotations

import shutil
import subprocess

from prometheus_client.parser import text_string_to_metric_families

COMMON = {
    "shardnet_build_info": "gauge",
    "shardnet_http_requests": "counter",
    "shardnet_http_client_errors": "counter",
    "shardnet_http_sent_bytes": "counter",
    "shardnet_sent_bytes": "counter",
    "shardnet_http_open_connections": "gauge",
    "shardnet_http_errors": "counter",
    "shardnet_http_received_bytes": "counter",
    "shardnet_versions_held": "gauge",
    "shardnet_latest_step": "gauge",
    "shardnet_announced_step": "gauge",
    "shardnet_versions_in_progress": "gauge",
    "shardnet_versions_committed": "counter",
    "shardnet_libp2p_connected_peers": "gauge",
    "shardnet_gossip_mesh_peers": "gauge",
    "shardnet_event_loop_lag_seconds": "counter",
    "shardnet_event_loop_lag_max_seconds": "gauge",
    "shardnet_peer_offences": "counter",
    "shardnet_banned_peers": "gauge",
    "shardnet_dead_connections": "counter",
    "shardnet_redials": "counter",
    "shardnet_stage_cpu_seconds": "counter",
    "process_cpu_seconds": "counter",
    "process_resident_memory_bytes": "gauge",
    "python_info": "gauge",
}
ORIGIN = {
    "shardnet_superseeding_refusals": "counter",
    "shardnet_publish_hash_seconds": "histogram",
}
FOLLOWER = {
    "shardnet_received_bytes": "counter",
    "shardnet_shards_verified": "counter",
    "shardnet_shards_corrupt": "counter",
    "shardnet_superseeding_refusals_seen": "counter",
    "shardnet_transfers_cut": "counter",
    "shardnet_version_commit_latency_seconds": "histogram",
    "shardnet_version_download_seconds": "histogram",
    "shardnet_shard_fetch_seconds": "histogram",
    "shardnet_shard_verify_write_seconds": "histogram",
    "shardnet_upstreams": "gauge",
    "shardnet_known_nodes": "gauge",
    "shardnet_lane_reachability": "gauge",
    "shardnet_dialback_answers": "counter",
    "shardnet_advert_checks": "counter",
    "shardnet_adverts_out_of_scope": "counter",
    "shardnet_refusal_holders": "counter",
}
ROLLOUT_SIDE = {  # whoever takes the rollouts: the trainer, or the origin for an external one
    "shardnet_trainer_async_window_versions": "gauge",
    "shardnet_trainer_peers": "gauge",
    "shardnet_submitters_refused": "gauge",
    "shardnet_rollout_rate_limited": "counter",
    "shardnet_rollouts_announced": "counter",
    "shardnet_rollouts_fetched_bytes": "counter",
    "shardnet_rollout_batches_buffered": "gauge",
    "shardnet_rollout_batches_accepted": "counter",
    "shardnet_rollout_batches_rejected": "counter",
    "shardnet_rollout_samples_accepted": "counter",
    "shardnet_rollout_samples_rejected": "counter",
    "shardnet_rollout_batches_fetched": "counter",
    "shardnet_rollout_batches_decided": "counter",
    "shardnet_rollout_batches_admitted": "counter",
    "shardnet_rollout_batches_trained": "counter",
    "shardnet_rollout_batches_late": "counter",
}
TRAINER = ROLLOUT_SIDE | {
    "shardnet_trainer_step": "gauge",
    "shardnet_trainer_mean_reward": "gauge",
    "shardnet_trainer_optimizer_step_seconds": "histogram",
}
ROLLOUTS_OUT = ROLLOUT_SIDE | {
    "shardnet_rollouts_out_files": "counter",
    "shardnet_rollouts_out_rows": "counter",
}
PEER = {
    "shardnet_peer_versions_generated": "counter",
    "shardnet_peer_mean_reward": "gauge",
    "shardnet_rollout_batches_submitted": "counter",
    "shardnet_rollout_batches_acked": "counter",
    "shardnet_rollout_retries": "counter",
    "shardnet_rollout_batches_given_up": "counter",
    "shardnet_rollout_batches_pending": "gauge",
    "shardnet_peer_weight_swap_seconds": "histogram",
    "shardnet_peer_generation_seconds": "histogram",
    "shardnet_peer_generated_tokens": "counter",
    "shardnet_peer_generation_tokens_per_second": "gauge",
}
BY_ROLE = {
    "trainer": COMMON | ORIGIN | TRAINER,
    # shardnet origin for an external trainer: without --rollouts-out, and with it
    "origin": COMMON | ORIGIN | {"shardnet_trainer_async_window_versions": "gauge"},
    "origin_rollouts": COMMON | ORIGIN | ROLLOUTS_OUT,
    "relay": COMMON | FOLLOWER,
    "peer": COMMON | FOLLOWER | PEER,
}


def families(text: str) -> dict[str, str]:
    """Family name (``_total`` stripped from counters, as the parser does) -> type."""
    return {f.name: f.type for f in text_string_to_metric_families(text)}


def sample_names() -> set[str]:
    """Every series name a node can export (counters with ``_total``/``_created``,
    histograms with ``_bucket``/``_sum``/``_count``), over all roles."""
    out: set[str] = set()
    for fams in BY_ROLE.values():
        for name, kind in fams.items():
            if kind == "counter":
                out |= {f"{name}_total", f"{name}_created"}
            elif kind == "histogram":
                out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count", f"{name}_created"}
            else:
                out.add(name)
    out |= {"up"}  # Prometheus' own series for every target
    return out


def promtool() -> str | None:
    """Path of ``promtool`` (Debian package ``prometheus``), or None."""
    return shutil.which("promtool")


def promtool_check_metrics(text: str) -> str:
    """Run ``promtool check metrics`` on ``text``; returns its output (lint problems).

    Raises:
        AssertionError: promtool failed (exit status not 0).
    """
    tool = promtool()
    assert tool is not None
    proc = subprocess.run(
        [tool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=30
    )
    output = (proc.stdout + proc.stderr).decode()
    assert proc.returncode == 0, output
    return output
