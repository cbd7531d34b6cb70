"""Every kubelet RPC is counted and timed, with the kubelet's trace as exemplar; per-claim
results are counted by outcome."""

from __future__ import annotations

import pytest
from grpclib import GRPCError
from grpclib.const import Status

from agent.kubelet import api
from agent.kubelet.dra_service import claim_error_reason
from tests.support.metrics import reading
from tests.unit.kubelet.conftest import DRIVER, RunningPlugin

pytestmark = pytest.mark.anyio

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{TRACE_ID}-00f067aa0ba902b7-01"
PREPARE = {"driver": DRIVER, "method": "NodePrepareResources"}
UID = "0b6e1c2a-4f4e-4a7e-9d55-3c1d2e6f7a80"


async def test_a_prepare_is_counted_timed_and_its_claims_counted(running: RunningPlugin) -> None:
    metrics = reading()
    before = {
        "ok": metrics.value("gpu_dra_rpc_requests", code="OK", **PREPARE),
        "timed": metrics.count("gpu_dra_rpc_duration", **PREPARE),
        "claims": metrics.value("gpu_dra_claims_prepared", driver=DRIVER),
        "devices": metrics.value("gpu_dra_devices_prepared", driver=DRIVER, type="gpu"),
        "invalid": metrics.value(
            "gpu_dra_claim_errors", driver=DRIVER, operation="prepare", reason="invalid_claim"
        ),
        "refused": metrics.value(
            "gpu_dra_claim_errors", driver=DRIVER, operation="prepare", reason="not_allocated"
        ),
    }
    running.engine.fail["uid-bad"] = "ResourceClaim default/c (uid-bad) is not allocated"
    claims = [
        api.dra_v1.Claim(namespace="default", uid=UID, name="a"),
        api.dra_v1.Claim(namespace="default", uid="uid-bad", name="c"),
        api.dra_v1.Claim(namespace="default", uid="", name="no-uid"),
    ]
    channel = running.dra_channel()
    try:
        stub = api.dra_v1.DraPluginStub(channel)
        await stub.node_prepare_resources(
            api.dra_v1.NodePrepareResourcesRequest(claims=claims),
            metadata={"traceparent": TRACEPARENT},
        )
    finally:
        channel.close()

    # the kubelet's trace is the latency's exemplar, even with no tracing SDK of our own (the
    # SDK hands each exemplar out once, so this reads it first)
    point = metrics.point("gpu_dra_rpc_duration", **PREPARE)
    assert TRACE_ID in {format(e.trace_id, "032x") for e in point.exemplars}
    assert metrics.value("gpu_dra_rpc_requests", code="OK", **PREPARE) - before["ok"] == 1
    assert metrics.count("gpu_dra_rpc_duration", **PREPARE) - before["timed"] == 1
    assert metrics.value("gpu_dra_claims_prepared", driver=DRIVER) - before["claims"] == 1
    devices = metrics.value("gpu_dra_devices_prepared", driver=DRIVER, type="gpu")
    assert devices - before["devices"] == 1
    errors = {
        reason: metrics.value(
            "gpu_dra_claim_errors", driver=DRIVER, operation="prepare", reason=reason
        )
        for reason in ("invalid_claim", "not_allocated")
    }
    assert errors["invalid_claim"] - before["invalid"] == 1
    assert errors["not_allocated"] - before["refused"] == 1


async def test_failed_calls_are_counted_by_status_code(running: RunningPlugin) -> None:
    metrics = reading()
    labels = {"driver": DRIVER, "method": "NodeUnprepareResources", "code": "FAILED_PRECONDITION"}
    before = metrics.value("gpu_dra_rpc_requests", **labels)
    unprepared = metrics.value("gpu_dra_claims_unprepared", driver=DRIVER)
    channel = running.dra_channel()
    try:
        stub = api.dra_v1.DraPluginStub(channel)
        claim = api.dra_v1.Claim(namespace="default", uid=UID, name="a")
        await stub.node_unprepare_resources(api.dra_v1.NodeUnprepareResourcesRequest([claim]))
        running.engine.raise_error = GRPCError(Status.FAILED_PRECONDITION, "refused")
        with pytest.raises(GRPCError):
            await stub.node_unprepare_resources(api.dra_v1.NodeUnprepareResourcesRequest([claim]))
    finally:
        channel.close()
    assert metrics.value("gpu_dra_claims_unprepared", driver=DRIVER) - unprepared == 1
    assert metrics.value("gpu_dra_rpc_requests", **labels) - before == 1


async def test_registration_calls_are_counted_too(running: RunningPlugin) -> None:
    metrics = reading()
    labels = {"driver": DRIVER, "method": "GetInfo", "code": "OK"}
    before = metrics.value("gpu_dra_rpc_requests", **labels)
    channel = running.registration_channel()
    try:
        stub = api.pluginregistration.RegistrationStub(channel)
        await stub.get_info(api.pluginregistration.InfoRequest())
    finally:
        channel.close()
    assert metrics.value("gpu_dra_rpc_requests", **labels) - before == 1


@pytest.mark.parametrize(
    ("message", "reason"),
    [
        ("ResourceClaim a/b (u) is not allocated", "not_allocated"),
        ("cannot read ResourceClaim a/b: 500 boom", "claim_read_failed"),
        ("node lock /x held by pid 7 for 10 s", "lock_timeout"),
        ("something new", "prepare_failed"),
    ],
)
def test_claim_error_reasons_are_bounded(message: str, reason: str) -> None:
    assert claim_error_reason(message) == reason
