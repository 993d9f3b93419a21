"""The port-mapping policy (shardcast.core.portmap), driven with a fake clock."""

from __future__ import annotations

import pytest

from p2p.errors import ConfigError
from shardcast.core.portmap import MapFailure, Mapping, MapState, PortMapConfig, PortMapPolicy

LANE = Mapping("http", 8003, 8003)
P2P = Mapping("libp2p", 4003, 4003)


def _state(policy: PortMapPolicy) -> MapState:
    return policy.state  # read afresh (mypy narrows an attribute across calls)


def _wall(t: float) -> str:
    return f"t={t:g}"


def test_untried_is_due_at_once() -> None:
    policy = PortMapPolicy()
    assert policy.state is MapState.UNTRIED
    assert policy.due(0.0)
    assert policy.next_due(0.0) == 0.0


def test_mapping_is_renewed_at_half_the_lease() -> None:
    policy = PortMapPolicy(PortMapConfig(lease_s=3600))
    assert policy.mapped("203.0.113.7", [LANE, P2P], 3600, now=10.0)
    assert policy.state is MapState.MAPPED
    assert policy.external_port("http") == 8003
    assert not policy.due(10.0 + 1799.0)
    assert policy.due(10.0 + 1800.0)
    assert policy.lease_left_s(10.0 + 600.0) == pytest.approx(3000.0)
    # a renewal with the same ports changes nothing to advertise
    assert not policy.mapped("203.0.113.7", [LANE, P2P], 3600, now=1810.0)
    # a router that gave another port this time does
    assert policy.mapped("203.0.113.7", [Mapping("http", 8003, 40001), P2P], 3600, now=3610.0)


def test_a_granted_lease_shorter_than_asked_renews_sooner() -> None:
    policy = PortMapPolicy(PortMapConfig(lease_s=3600))
    policy.mapped("203.0.113.7", [LANE], 120, now=0.0)
    assert policy.next_due(0.0) == 60.0


def test_permanent_mapping_is_refreshed() -> None:
    policy = PortMapPolicy(PortMapConfig(permanent_refresh_s=900.0))
    policy.mapped("203.0.113.7", [LANE], 0, now=0.0)
    assert policy.lease_left_s(5.0) is None
    assert policy.next_due(0.0) == 900.0


def test_refusals_back_off_exponentially_and_warn_once() -> None:
    cfg = PortMapConfig(backoff_initial_s=30.0, backoff_max_s=100.0)
    policy = PortMapPolicy(cfg)
    now, waits, warnings = 0.0, [], []
    for _ in range(4):
        warnings.append(policy.failed(MapFailure.REFUSED, "ConflictInMappingEntry", now))
        waits.append(policy.next_due(now))
        now += policy.next_due(now)
    assert waits == [30.0, 60.0, 100.0, 100.0]
    assert warnings == [True, False, False, False]
    assert policy.state is MapState.FAILED
    assert policy.status(now, _wall)["last_error"] == "refused: ConflictInMappingEntry"
    # a success ends the streak: the next refusal warns again, from the initial backoff
    policy.mapped("203.0.113.7", [LANE], 3600, now)
    assert policy.failed(MapFailure.REFUSED, "NotAuthorized", now + 1800.0)
    assert policy.next_due(now + 1800.0) == 30.0


def test_a_failed_renewal_drops_the_mapping() -> None:
    policy = PortMapPolicy()
    policy.mapped("203.0.113.7", [LANE], 3600, now=0.0)
    policy.failed(MapFailure.ERROR, "timed out", now=1800.0)
    assert policy.state is MapState.FAILED
    assert policy.external_port("http") is None
    assert policy.external_host == ""
    assert policy.lease_left_s(1800.0) is None


def test_no_gateway_gives_up_quietly_and_retries_rarely() -> None:
    cfg = PortMapConfig(no_gateway_attempts=2, backoff_initial_s=30.0, no_gateway_retry_s=3600.0)
    policy = PortMapPolicy(cfg)
    assert not policy.failed(MapFailure.NO_GATEWAY, "no IGD found", 0.0)
    assert policy.state is MapState.FAILED
    assert policy.next_due(0.0) == 30.0
    assert not policy.failed(MapFailure.NO_GATEWAY, "no IGD found", 30.0)
    assert _state(policy) is MapState.NO_GATEWAY
    assert policy.next_due(30.0) == 3600.0
    assert not policy.failed(MapFailure.NO_GATEWAY, "no IGD found", 3630.0)
    assert _state(policy) is MapState.NO_GATEWAY
    assert policy.attempts == {"no_gateway": 3}
    # a gateway that appears (the host moved to a LAN with one) is used
    policy.mapped("203.0.113.7", [LANE], 3600, now=7230.0)
    assert _state(policy) is MapState.MAPPED


def test_a_refusal_after_no_gateway_warns() -> None:
    policy = PortMapPolicy(PortMapConfig(no_gateway_attempts=3))
    assert not policy.failed(MapFailure.NO_GATEWAY, "none", 0.0)
    # the gateway answered this time but refused: that is news for the operator
    assert policy.failed(MapFailure.REFUSED, "NotAuthorized", 30.0)
    assert policy.state is MapState.FAILED
    assert not policy.failed(MapFailure.REFUSED, "NotAuthorized", 90.0)


def test_status_section() -> None:
    policy = PortMapPolicy()
    policy.mapped("203.0.113.7", [LANE, P2P], 3600, now=100.0)
    out = policy.status(700.0, _wall)
    assert out["state"] == "mapped"
    assert out["external_host"] == "203.0.113.7"
    assert out["mappings"]["http"] == {"internal_port": 8003, "external_port": 8003}
    assert out["lease_left_s"] == 3000.0
    assert out["mapped_at"] == "t=100"
    assert out["next_attempt_at"] == "t=1900"
    assert out["last_error"] is None


def test_mapped_rejects_driver_bugs() -> None:
    with pytest.raises(ValueError, match="ports"):
        PortMapPolicy().mapped("203.0.113.7", [], 3600, now=0.0)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("discovery_delay_s", 0.0),
        ("backoff_initial_s", -1.0),
        ("backoff_max_s", 1.0),
        ("lease_s", -5),
        ("no_gateway_attempts", 0),
        ("delete_timeout_s", 0.0),
    ],
)
def test_config_names_the_bad_field(field: str, value: float) -> None:
    with pytest.raises(ConfigError, match=f"port_mapping.{field}"):
        PortMapConfig(**{field: value})  # type: ignore[arg-type]


def test_default_is_off() -> None:
    assert PortMapConfig().enabled is False
