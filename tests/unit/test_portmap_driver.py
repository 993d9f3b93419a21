"""The port-mapping driver (shardcast.node.portmap) against fake gateways, in virtual time."""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing

from p2p.errors import ConfigError
from shardcast.core.portmap import MapFailure, MapState, PortMapConfig, PortMapPolicy
from shardcast.core.reachability import (
    DialbackAnswer,
    DialbackRequest,
    DialbackResult,
    ReachabilityConfig,
)
from shardcast.node.portmap import (
    GatewayError,
    MiniupnpcGateway,
    PortMapping,
    in_thread,
    keep_port_mappings,
    tcp_port,
)

PORTS = {"libp2p": 4003, "http": 8003}


class FakeGateway:
    """A gateway that maps what it is asked, or fails as told."""

    def __init__(self, *, fail: GatewayError | None = None, taken: frozenset[int] = frozenset()):
        self.fail = fail
        self.taken = taken
        self.lease_s = 120
        self.table: dict[int, int] = {}  # external -> internal
        self.adds: list[tuple[int, int]] = []
        self.deleted: list[int] = []
        self.hang_on_delete = False  # the gateway stops answering when asked to delete

    def open(self, delay_s: float) -> tuple[str, str]:
        assert delay_s == 2.0
        if self.fail is not None and self.fail.reason is MapFailure.NO_GATEWAY:
            raise self.fail
        return "203.0.113.7", "192.168.1.20"

    def add(
        self, external_port: int, internal_port: int, lan: str, lease_s: int, description: str
    ) -> tuple[int, int]:
        assert lan == "192.168.1.20"
        assert description == "shardnet"
        self.adds.append((external_port, internal_port))
        if self.fail is not None:
            raise self.fail
        if external_port in self.taken:
            external_port += 30000
        self.table[external_port] = internal_port
        return external_port, min(lease_s, self.lease_s)

    def delete(self, external_port: int) -> None:
        self.deleted.append(external_port)
        self.table.pop(external_port, None)


async def _inline(gateway: FakeGateway, fn: Callable[..., Any], *args: Any) -> Any:
    """Run a gateway call inline (deterministic in virtual time); a hanging delete waits
    until cancelled, as an abandoned worker thread would."""
    await trio.lowlevel.checkpoint()
    if gateway.hang_on_delete and fn == gateway.delete:
        await trio.sleep_forever()
    return fn(*args)


async def _run_for(
    gateway: FakeGateway, policy: PortMapPolicy, seconds: float, changes: list[int]
) -> None:
    def changed() -> None:
        changes.append(policy.external_port("http") or 0)

    with trio.move_on_after(seconds):
        await keep_port_mappings(
            lambda: gateway,
            policy,
            PORTS,
            changed,
            run_sync=lambda fn, *args: _inline(gateway, fn, *args),
        )


async def test_maps_both_ports_renews_at_half_lease_and_deletes_at_shutdown(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gateway = FakeGateway()
    policy = PortMapPolicy(PortMapConfig(enabled=True))
    changes: list[int] = []
    await _run_for(gateway, policy, 130.0, changes)
    # mapped at 0 (lease 120 granted), renewed at 60 and 120
    assert gateway.adds == [(4003, 4003), (8003, 8003)] * 3
    assert changes == [8003]  # renewals with the same ports hand nothing new on
    assert policy.state is MapState.MAPPED
    assert policy.lease_s == 120
    assert sorted(gateway.deleted) == [4003, 8003]
    assert gateway.table == {}


async def test_a_taken_port_is_mapped_to_the_one_the_gateway_gives(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gateway = FakeGateway(taken=frozenset({8003}))
    policy = PortMapPolicy(PortMapConfig(enabled=True))
    changes: list[int] = []
    await _run_for(gateway, policy, 1.0, changes)
    assert changes == [38003]
    assert policy.mappings["http"].internal_port == 8003


async def test_a_refusal_is_one_warning_then_backoff(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = FakeGateway(fail=GatewayError(MapFailure.REFUSED, "ConflictInMappingEntry"))
    policy = PortMapPolicy(PortMapConfig(enabled=True, backoff_initial_s=30.0))
    changes: list[int] = []
    with caplog.at_level(logging.INFO, logger="shardcast.node.portmap"):
        await _run_for(gateway, policy, 100.0, changes)
    failed = [r for r in caplog.records if r.message.startswith("port_mapping_failed")]
    assert [r.levelno for r in failed] == [logging.WARNING, logging.INFO, logging.INFO]
    assert all(r.exc_info is None for r in failed)
    assert "reason=refused error=ConflictInMappingEntry" in failed[0].message
    assert len(gateway.adds) == 3  # at 0, 30 and 90 s
    assert changes == []
    assert policy.state is MapState.FAILED


async def test_no_gateway_is_quiet(
    autojump_clock: trio.testing.MockClock, caplog: pytest.LogCaptureFixture
) -> None:
    gateway = FakeGateway(fail=GatewayError(MapFailure.NO_GATEWAY, "no UPnP device"))
    policy = PortMapPolicy(PortMapConfig(enabled=True))
    with caplog.at_level(logging.INFO, logger="shardcast.node.portmap"):
        await _run_for(gateway, policy, 600.0, [])
    assert policy.state is MapState.NO_GATEWAY
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert gateway.deleted == []


async def test_a_lost_mapping_is_handed_on(autojump_clock: trio.testing.MockClock) -> None:
    gateway = FakeGateway()
    policy = PortMapPolicy(PortMapConfig(enabled=True))
    changes: list[int] = []

    async def router_forgets() -> None:
        await trio.sleep(30.0)
        gateway.fail = GatewayError(MapFailure.ERROR, "HTTP error")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(router_forgets)
        await _run_for(gateway, policy, 70.0, changes)
    assert changes == [8003, 0]  # mapped, then lost at the renewal at 60 s
    assert policy.state is MapState.FAILED


async def test_delete_never_holds_shutdown_up(autojump_clock: trio.testing.MockClock) -> None:
    gateway = FakeGateway()
    gateway.hang_on_delete = True
    policy = PortMapPolicy(PortMapConfig(enabled=True, delete_timeout_s=2.0))
    start = trio.current_time()
    await _run_for(gateway, policy, 10.0, [])
    assert trio.current_time() - start == pytest.approx(12.0)
    assert gateway.deleted == []


class FakeUPnP:
    """miniupnpc.UPnP's surface, failing like it (bare Exception with the UPnP error text)."""

    def __init__(self, add_errors: list[str], any_port: int = 40123) -> None:
        self.add_errors = add_errors
        self.any_port = any_port
        self.calls: list[tuple[Any, ...]] = []

    def addportmapping(self, *args: Any) -> bool:
        self.calls.append(("add", *args))
        if self.add_errors:
            raise Exception(self.add_errors.pop(0))  # as miniupnpc does
        return True

    def addanyportmapping(self, *args: Any) -> int:
        assert len(args) == 6  # extPort, proto, intClient, intPort, desc, remoteHost: no lease
        self.calls.append(("any", *args))
        return self.any_port

    def getspecificportmapping(self, port: int, proto: str) -> tuple[Any, ...]:
        return ("192.168.1.20", 8003, "shardnet", "1", 600)


def _gateway(upnp: FakeUPnP) -> MiniupnpcGateway:
    gw = MiniupnpcGateway.__new__(MiniupnpcGateway)
    gw._upnp = upnp
    return gw


def test_miniupnpc_conflict_takes_any_port() -> None:
    upnp = FakeUPnP(["ConflictInMappingEntry"])
    assert _gateway(upnp).add(8003, 8003, "192.168.1.20", 3600, "shardnet") == (40123, 600)
    assert [c[0] for c in upnp.calls] == ["add", "any"]


def test_miniupnpc_permanent_only_retries_with_lease_0() -> None:
    upnp = FakeUPnP(["OnlyPermanentLeasesSupported"])
    _gateway(upnp).add(8003, 8003, "192.168.1.20", 3600, "shardnet")
    assert upnp.calls[-1][-1] == 0


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("Action not authorized", MapFailure.REFUSED),
        ("Action Failed", MapFailure.REFUSED),
        ("NoPortMapsAvailable", MapFailure.REFUSED),
        ("Miniupnpc HTTP error", MapFailure.ERROR),
    ],
)
def test_miniupnpc_errors_are_classified(text: str, reason: MapFailure) -> None:
    with pytest.raises(GatewayError) as info:
        _gateway(FakeUPnP([text])).add(8003, 8003, "192.168.1.20", 3600, "shardnet")
    assert info.value.reason is reason
    assert str(info.value) == text


async def test_in_thread_runs_the_call_in_a_worker_thread() -> None:
    import threading

    main = threading.get_ident()
    assert await in_thread(threading.get_ident) != main


class FakeHost:
    """The libp2p host surface the dial-back check uses: every asked peer answers
    ``answer`` about the URL it was asked to dial."""

    def __init__(self, answer: DialbackResult) -> None:
        self.answer = answer
        self.asked: list[str] = []

    async def request(
        self, peer_id: str, protocol: str, data: bytes, max_response_bytes: int, timeout_s: float
    ) -> bytes:
        self.asked.append(DialbackRequest.decode(data, "me").url)
        return DialbackAnswer(self.answer, "203.0.113.7").encode()

    def remote_hosts(self, peer_id: str) -> list[str]:
        return ["203.0.113.7"]  # every asker outside the gateway's LAN


async def _run_mapping(
    answer: DialbackResult, seconds: float, gateway: FakeGateway | None = None
) -> tuple[PortMapping, FakeHost, list[str]]:
    gateway = gateway or FakeGateway()
    host = FakeHost(answer)
    adverts: list[str] = []
    mapping: PortMapping

    def readvertise() -> None:
        adverts.append(mapping.advertised())

    mapping = PortMapping(
        host,  # type: ignore[arg-type]
        PORTS,
        PortMapConfig(enabled=True),
        ReachabilityConfig(),
        lambda: ["relay"],
        readvertise,
        gateway_factory=lambda: gateway,
        run_sync=lambda fn, *args: _inline(gateway, fn, *args),
    )
    with trio.move_on_after(seconds):
        await mapping.run()
    return mapping, host, adverts


async def test_the_mapped_url_is_advertised_once_a_dial_back_reached_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    mapping, host, adverts = await _run_mapping(DialbackResult.REACHED, 10.0)
    assert host.asked[0] == "http://203.0.113.7:8003"
    assert adverts == ["", "http://203.0.113.7:8003"]  # mapped (not proven yet), then reached
    assert mapping.advertised() == "http://203.0.113.7:8003"
    doc = mapping.status(trio.current_time(), str)
    assert doc["candidate_state"] == "reachable"
    assert doc["advertised"] is True


async def test_a_mapped_url_no_one_reaches_is_not_advertised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    # a router behind a carrier-grade NAT maps ports no one outside can open
    mapping, host, adverts = await _run_mapping(DialbackResult.NOT_REACHED, 10.0)
    assert host.asked == ["http://203.0.113.7:8003"]
    assert set(adverts) == {""}
    assert mapping.candidate is not None
    assert mapping.candidate.state.value == "unreachable"
    assert mapping.advertised() == ""


async def test_a_lost_mapping_is_no_longer_advertised(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gateway = FakeGateway()

    async def router_forgets() -> None:
        await trio.sleep(30.0)
        gateway.fail = GatewayError(MapFailure.ERROR, "HTTP error")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(router_forgets)
        mapping, _, adverts = await _run_mapping(DialbackResult.REACHED, 70.0, gateway)
    assert adverts[-1] == ""  # the renewal at 60 s failed: withdrawn at once
    assert mapping.candidate is None
    assert mapping.candidate_url() == ""


def test_tcp_port_of_multiaddrs() -> None:
    assert tcp_port(["/ip4/10.0.0.2/tcp/4003"]) == 4003
    assert tcp_port(["/ip4/10.0.0.2/udp/4003/quic", "/ip6/::/tcp/4013"]) == 4013
    assert tcp_port([]) is None


def test_a_missing_miniupnpc_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="port_mapping: needs the miniupnpc package"):
        MiniupnpcGateway.check_installed()
