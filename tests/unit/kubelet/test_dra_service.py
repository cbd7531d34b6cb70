"""DRAPlugin v1 and v1beta1 over a real socket: answers, per-claim errors, cancellation."""

from __future__ import annotations

from types import ModuleType
from typing import Any

import anyio
import pytest
from grpclib import GRPCError
from grpclib.client import Channel
from grpclib.const import Cardinality, Status
from grpclib.encoding.base import CodecBase

from agent.kubelet import api
from agent.node.errors import LockTimeout
from agent.sim.kubelet.grpc_calls import call_with_deadline
from tests.unit.kubelet.conftest import RunningPlugin, wait_until

pytestmark = pytest.mark.anyio

UID_A = "0b7c3f9e-1111-4c1e-9a55-000000000001"
UID_B = "0b7c3f9e-2222-4c1e-9a55-000000000002"


def claim(pb: ModuleType, uid: str, name: str = "claim-a", namespace: str = "default") -> Any:
    return pb.Claim(namespace=namespace, uid=uid, name=name)


async def prepare(running: RunningPlugin, pb: ModuleType, claims: list[Any], **kw: Any) -> Any:
    channel = running.dra_channel()
    try:
        stub = pb.DraPluginStub(channel)
        return await stub.node_prepare_resources(
            pb.NodePrepareResourcesRequest(claims=claims), **kw
        )
    finally:
        channel.close()


async def unprepare(running: RunningPlugin, pb: ModuleType, claims: list[Any]) -> Any:
    channel = running.dra_channel()
    try:
        stub = pb.DraPluginStub(channel)
        return await stub.node_unprepare_resources(pb.NodeUnprepareResourcesRequest(claims=claims))
    finally:
        channel.close()


@pytest.mark.parametrize("pb", [api.dra_v1, api.dra_v1beta1], ids=["v1", "v1beta1"])
async def test_both_versions_prepare_and_unprepare(running: RunningPlugin, pb: ModuleType) -> None:
    answer = await prepare(running, pb, [claim(pb, UID_A)])
    assert set(answer.claims) == {UID_A}
    result = answer.claims[UID_A]
    assert result.error == ""
    [device] = result.devices
    assert isinstance(device, pb.Device)
    assert device.request_names == ["gpu"]
    assert (device.pool_name, device.device_name) == ("node-a", "gpu-0")
    assert device.cdi_device_ids == [f"k8s.gpu.nvidia.com/claim={UID_A}-gpu-0"]
    assert running.engine.prepared[-1][0].uid == UID_A
    assert running.engine.prepared[-1][0].namespace == "default"

    answer = await unprepare(running, pb, [claim(pb, UID_A)])
    assert set(answer.claims) == {UID_A}
    assert answer.claims[UID_A].error == ""


async def test_empty_request_gets_empty_map_without_engine_call(running: RunningPlugin) -> None:
    answer = await prepare(running, api.dra_v1, [])
    assert dict(answer.claims) == {}
    answer = await unprepare(running, api.dra_v1, [])
    assert dict(answer.claims) == {}
    assert running.engine.prepared == [] and running.engine.unprepared == []


async def test_per_claim_errors_leave_other_claims_alone(running: RunningPlugin) -> None:
    pb = api.dra_v1
    running.engine.fail[UID_B] = "device gpu-3 is already prepared for claim x"
    answer = await prepare(
        running,
        pb,
        [claim(pb, UID_A), claim(pb, UID_B, "claim-b"), claim(pb, "../../etc", "evil")],
    )
    assert set(answer.claims) == {UID_A, UID_B, "../../etc"}
    assert answer.claims[UID_A].error == ""
    assert answer.claims[UID_B].error == "device gpu-3 is already prepared for claim x"
    assert answer.claims[UID_B].devices == []
    assert "not a Kubernetes UID" in answer.claims["../../etc"].error
    # the engine never saw the path-like uid
    assert [c.uid for c in running.engine.prepared[-1]] == [UID_A, UID_B]


async def test_invalid_identities_are_named(running: RunningPlugin) -> None:
    pb = api.dra_v1
    answer = await prepare(
        running,
        pb,
        [claim(pb, "", "no-uid"), claim(pb, UID_A, "Bad_Name"), claim(pb, UID_B, namespace="")],
    )
    assert "empty uid" in answer.claims[""].error
    assert "'Bad_Name' is not a valid ResourceClaim name" in answer.claims[UID_A].error
    assert "namespace '' is not a valid namespace name" in answer.claims[UID_B].error
    assert running.engine.prepared == []


async def test_duplicate_uids(running: RunningPlugin) -> None:
    pb = api.dra_v1
    answer = await prepare(running, pb, [claim(pb, UID_A), claim(pb, UID_A)])
    assert set(answer.claims) == {UID_A} and answer.claims[UID_A].error == ""
    assert [c.uid for c in running.engine.prepared[-1]] == [UID_A]  # asked once

    answer = await prepare(running, pb, [claim(pb, UID_B, "one"), claim(pb, UID_B, "two")])
    assert "appears twice in one request" in answer.claims[UID_B].error


async def test_missing_engine_result_becomes_an_error(running: RunningPlugin) -> None:
    pb = api.dra_v1beta1
    running.engine.omit.add(UID_A)
    answer = await prepare(running, pb, [claim(pb, UID_A)])
    assert "returned no result" in answer.claims[UID_A].error
    answer = await unprepare(running, pb, [claim(pb, UID_A)])
    assert "returned no result" in answer.claims[UID_A].error


async def test_engine_agent_error_fails_each_claim(running: RunningPlugin, tmp_path: Any) -> None:
    pb = api.dra_v1
    running.engine.raise_error = LockTimeout(tmp_path / "pu.lock", 10, 4242)
    answer = await prepare(running, pb, [claim(pb, UID_A), claim(pb, UID_B, "b")])
    for uid in (UID_A, UID_B):
        assert "could not take the node lock" in answer.claims[uid].error
        assert "process 4242" in answer.claims[uid].error


async def test_engine_bug_is_internal_and_plugin_keeps_serving(running: RunningPlugin) -> None:
    pb = api.dra_v1
    running.engine.raise_error = RuntimeError("boom")
    with pytest.raises(GRPCError) as caught:
        await prepare(running, pb, [claim(pb, UID_A)])
    assert caught.value.status == Status.INTERNAL
    assert "RuntimeError: boom" in (caught.value.message or "")
    running.engine.raise_error = None
    answer = await prepare(running, pb, [claim(pb, UID_A)])
    assert answer.claims[UID_A].error == ""


async def raw_prepare(running: RunningPlugin, data: bytes) -> Any:
    channel = Channel(path=str(running.dra_socket), codec=RawCodec())
    try:
        async with channel.request(
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            Cardinality.UNARY_UNARY,
            bytes,
            bytes,
        ) as stream:
            await stream.send_message(data, end=True)
            return api.dra_v1.NodePrepareResourcesResponse.parse(await stream.recv_message())
    finally:
        channel.close()


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\x0a\x03\x12\x01\xff", "not a valid NodePrepareResourcesRequest message"),
        (b"\x0f", "claims[0] of the request is not a Claim message"),
    ],
    ids=["invalid-utf8", "invalid-wire-type"],
)
async def test_malformed_message_is_refused_and_plugin_keeps_serving(
    running: RunningPlugin, data: bytes, expected: str
) -> None:
    with pytest.raises(GRPCError) as caught:
        await raw_prepare(running, data)
    assert caught.value.status == Status.INVALID_ARGUMENT
    assert expected in (caught.value.message or "")
    answer = await prepare(running, api.dra_v1, [claim(api.dra_v1, UID_A)])
    assert answer.claims[UID_A].error == ""


async def test_truncated_claim_is_answered_under_its_empty_uid(running: RunningPlugin) -> None:
    answer = await raw_prepare(running, b"\x0a\x05\xff\xff")
    assert "has an empty uid" in answer.claims[""].error


async def test_deadline_cancels_the_handler(running: RunningPlugin) -> None:
    pb = api.dra_v1
    running.engine.gate = anyio.Event()
    # grpclib enforces the client deadline by cancelling the calling task: run the call in a
    # task of its own (as the kubelet emulator does). What matters is the server side: the
    # handler (which got grpc-timeout) is cancelled, not left running.
    with pytest.raises(TimeoutError):
        await call_with_deadline(prepare(running, pb, [claim(pb, UID_A)], timeout=0.3), 0.3)
    await wait_until(lambda: running.engine.cancelled > 0)
    assert running.plugin.calls.running == 0
    running.engine.gate = None
    answer = await prepare(running, pb, [claim(pb, UID_A)])
    assert answer.claims[UID_A].error == ""


class RawCodec(CodecBase):
    """Puts arbitrary bytes on the wire, to send what no protobuf library would encode."""

    __content_subtype__ = "proto"

    def encode(self, message: Any, message_type: Any) -> bytes:
        return bytes(message)

    def decode(self, data: bytes, message_type: Any) -> Any:
        return data
