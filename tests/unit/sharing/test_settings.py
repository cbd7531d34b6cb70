"""Tests of agent/sharing/settings.py: a KEP-5075 share's consumed memory becomes its MPS
daemon's pinned device memory limit (environment and control command)."""

from __future__ import annotations

from agent.dra.config import GpuConfig, MpsConfig, Sharing, SharingStrategy
from agent.node import checkpoint as cp
from agent.sharing.mps import limit_commands
from agent.sharing.settings import MPS_SHARED, PINNED_LIMIT_ENV, mps_plan, setting

LIMITS = MpsConfig(50, "10Gi", (("0", "4Gi"),))


def device(uuid: str, share: str | None = None, memory: str | None = None) -> cp.PreparedDevice:
    return cp.PreparedDevice(
        requests=("gpu",),
        pool="node-a",
        device=f"gpu-{uuid[-1]}",
        cdi_device_ids=("x",),
        kind="gpu",
        uuid=uuid,
        gpu_minor=int(uuid[-1]),
        config=GpuConfig(Sharing(SharingStrategy.MPS, mps=LIMITS)),
        share_id=share,
        consumed=(("memory", memory),) if memory else (),
    )


def test_a_claim_without_shares_keeps_its_config() -> None:
    plan = mps_plan([device("GPU-1"), device("GPU-0")])
    assert plan.uuids == ["GPU-0", "GPU-1"] and plan.environment == {}
    assert plan.config == LIMITS


def test_a_share_is_limited_to_its_consumed_memory() -> None:
    plan = mps_plan([device("GPU-3", "s1", "20Gi")])
    assert plan.environment == {PINNED_LIMIT_ENV: "0=20480M"}
    assert limit_commands(plan.config, plan.uuids) == [
        "set_default_active_thread_percentage 50",
        "set_default_device_pinned_mem_limit 0 20480M",  # not the config's 4Gi for index 0
    ]


def test_two_shares_of_one_gpu_in_a_claim_add_up() -> None:
    plan = mps_plan([device("GPU-2", "a", "1Gi"), device("GPU-2", "b", "2Gi")])
    assert plan.uuids == ["GPU-2"]
    assert plan.environment == {PINNED_LIMIT_ENV: "0=3072M"}


def test_an_mps_share_holds_the_default_mode_setting() -> None:
    intent = cp.Intent("sharing", "gpu-0", (("strategy", "MPS"), ("kind", "gpu"), ("share", "s")))
    assert setting(intent) == MPS_SHARED
