"""The pure decision half of prepare (``agent.node.plan``) and the per-claim locks."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agent.node.locks import ClaimLocks
from agent.node.plan import PrepareRefused, node_devices, plan_claim
from agent.node.types import ClaimRef
from tests.support.inventories import h100_mixed_mig_node

DRIVER, POOL = "gpu.nvidia.com", "node-1"
REF = ClaimRef("ns", "0f1e2d3c-4b5a-4697-8877-665544332211", "claim")
DEVICES = node_devices(h100_mixed_mig_node())
MIG = "gpu-1-mig-3g40gb-9-0"


def claim(results: list[dict[str, Any]], configs: list[dict[str, Any]] | None = None) -> Any:
    devices: dict[str, Any] = {"results": results}
    if configs is not None:
        devices["config"] = configs
    return {"metadata": {"uid": REF.uid}, "status": {"allocation": {"devices": devices}}}


def result(request: str, device: str, **extra: Any) -> dict[str, Any]:
    return {"request": request, "driver": DRIVER, "pool": POOL, "device": device, **extra}


def config(parameters: dict[str, Any], requests: list[str] | None = None) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "source": "FromClaim",
        "opaque": {"driver": DRIVER, "parameters": parameters},
    }
    if requests is not None:
        entry["requests"] = requests
    return entry


def plan(document: Any) -> Any:
    return plan_claim(REF, document, driver=DRIVER, pool=POOL, devices=DEVICES)


def test_node_devices_follow_the_mig_mode() -> None:
    assert set(DEVICES) == {"gpu-0", MIG, "gpu-1-mig-2g20gb-14-4", "gpu-1-mig-1g10gb-19-6"}
    assert DEVICES[MIG].kind == "mig" and DEVICES[MIG].mig is not None
    assert DEVICES["gpu-0"].kind == "gpu"


def test_a_device_of_two_requests_is_planned_once_with_both_base_names() -> None:
    planned = plan(
        claim(
            [
                result("train/big", "gpu-0"),
                result("eval", "gpu-0"),
                result("eval", MIG, adminAccess=True),
                {**result("other", "gpu-0"), "driver": "other.example.com"},
            ]
        )
    )
    assert [(p.device.name, p.request_names, p.admin_access) for p in planned.devices] == [
        ("gpu-0", ("train", "eval"), False),
        (MIG, ("eval",), True),
    ]


def test_configs_apply_by_kind_and_request() -> None:
    gpu = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
    mig = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "MigDeviceConfig"}
    planned = plan(claim([result("a", "gpu-0"), result("b", MIG)], [config(gpu), config(mig)]))
    assert [type(p.config).__name__ for p in planned.devices] == ["GpuConfig", "MigDeviceConfig"]
    with pytest.raises(PrepareRefused, match="GpuConfig cannot be applied to request 'b'"):
        plan(claim([result("b", MIG)], [config(gpu, ["b"])]))


def test_sharing_is_refused_with_a_way_out() -> None:
    shared = {
        "apiVersion": "resource.nvidia.com/v1beta1",
        "kind": "GpuConfig",
        "sharing": {"strategy": "TimeSlicing"},
    }
    with pytest.raises(PrepareRefused, match=r"TimeSlicing.*remove the sharing section"):
        plan(claim([result("a", "gpu-0")], [config(shared)]))


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ({"metadata": {"uid": "other"}}, "got replaced"),
        ({"metadata": {"uid": REF.uid}, "status": {}}, "is not allocated"),
        (claim([{**result("a", "gpu-0"), "pool": "node-2"}]), "allocated for another node"),
        (claim([result("a", "gpu-9")]), "gpu-9 of pool node-1 do not exist"),
        (claim([{"request": "a"}]), r"devices\.results\[0\]"),
    ],
)
def test_refusals(document: Any, message: str) -> None:
    with pytest.raises(PrepareRefused, match=message) as caught:
        plan(document)
    assert "ns/claim" in str(caught.value)


@pytest.mark.anyio
async def test_claim_locks_serialize_one_claim_and_never_deadlock() -> None:
    locks = ClaimLocks()
    order: list[str] = []

    async def hold(name: str, uids: list[str]) -> None:
        async with locks.hold(uids):
            order.append(f"{name}+")
            await anyio.sleep(0.01)
            order.append(f"{name}-")

    async with anyio.create_task_group() as group:
        group.start_soon(hold, "ab", ["a", "b"])
        group.start_soon(hold, "ba", ["b", "a", "b"])  # reversed, with a duplicate
        group.start_soon(hold, "c", ["c"])
    assert order.index("ab-") < order.index("ba+") or order.index("ba-") < order.index("ab+")
    assert order.index("c+") < max(order.index("ab-"), order.index("ba-"))  # c did not wait
    assert len(locks) == 0
