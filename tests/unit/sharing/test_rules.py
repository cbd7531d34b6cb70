"""Sharing rules that need no hardware: the claim-level config checks (field paths), the MPS
control commands a config becomes, the shm size, and the order in which the engine's effects
undo and recover (the sharing effector after dynamic MIG: its daemon stops first)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from agent.dra.config import (
    AllocationResult,
    EffectiveConfig,
    GpuConfig,
    MigDeviceConfig,
    MpsConfig,
    Sharing,
    SharingStrategy,
    config_kind,
    decode_parameters,
    sharing_problems,
)
from agent.node import checkpoint as cp
from agent.node.effectors import Effects, Prepared, RecordIntents, StartupRecovery
from agent.sharing.mps import limit_commands, shm_size

UUIDS = {"gpu-0": "GPU-b", "gpu-1": "GPU-a", "mig": ""}


def effective(device: str, config: Any, origin: str = "devices.config[0]") -> EffectiveConfig:
    result = AllocationResult("gpu", "gpu.nvidia.com", "node-a", device)
    return EffectiveConfig(result, config_kind(config), config, origin)


def mps(**fields: Any) -> GpuConfig:
    document = {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "GpuConfig"}
    config = decode_parameters({**document, "sharing": {"strategy": "MPS", "mpsConfig": fields}})
    assert isinstance(config, GpuConfig)
    return config


def problems(*chosen: EffectiveConfig) -> list[str]:
    return sharing_problems(chosen, lambda name: UUIDS[name])


def test_one_daemon_per_claim_needs_one_mps_config() -> None:
    one, other = mps(defaultActiveThreadPercentage=10), mps(defaultActiveThreadPercentage=20)
    assert problems(effective("gpu-0", one), effective("gpu-1", one)) == []
    [problem] = problems(effective("gpu-0", one), effective("gpu-1", other, "devices.config[1]"))
    assert problem.startswith("devices.config[1].opaque.parameters.sharing.mpsConfig: device gpu-1")
    assert "one MPS control daemon serves all MPS devices of a claim" in problem


def test_per_device_keys_are_indexes_or_uuids_of_the_claims_mps_devices() -> None:
    path = "devices.config[0].opaque.parameters.sharing.mpsConfig.defaultPerDevicePinnedMemoryLimit"
    config = mps(defaultPerDevicePinnedMemoryLimit={"1": "1Gi", "GPU-a": "2Gi"})
    assert problems(effective("gpu-0", config), effective("gpu-1", config)) == []
    index, uuid = problems(effective("gpu-0", config))  # GPU-a is gpu-1, not in this claim
    assert index.startswith(f"{path}.1: index 1 is out of range; the claim has 1 MPS device")
    assert uuid == f"{path}.GPU-a: names no MPS device of this claim"
    stranger = mps(defaultPerDevicePinnedMemoryLimit={"GPU-zzz": "1Gi"})
    assert problems(effective("gpu-0", stranger)) == [
        f"{path}.GPU-zzz: names no MPS device of this claim"
    ]
    # a dynamic MIG device has no UUID before it is made: a UUID key cannot be checked yet
    mig = MigDeviceConfig(
        Sharing(SharingStrategy.MPS, mps=MpsConfig(None, None, (("MIG-x", "1Gi"),)))
    )
    assert problems(effective("mig", mig)) == []


def test_time_slicing_and_no_sharing_need_nothing_together() -> None:
    slicing = GpuConfig(Sharing(SharingStrategy.TIME_SLICING))
    assert problems(effective("gpu-0", slicing), effective("gpu-1", GpuConfig())) == []


def test_limit_commands() -> None:
    config = MpsConfig(30, "10Gi", (("0", "4Gi"), ("GPU-b", "512Mi")))
    assert limit_commands(config, ["GPU-a", "GPU-b", "GPU-c"]) == [
        "set_default_active_thread_percentage 30",
        "set_default_device_pinned_mem_limit 0 4096M",
        "set_default_device_pinned_mem_limit 1 512M",
        "set_default_device_pinned_mem_limit 2 10240M",
    ]
    assert limit_commands(MpsConfig(), ["GPU-a"]) == []


def test_shm_size_is_half_the_memory(tmp_path: Path) -> None:
    assert shm_size(tmp_path) == 64 * 1024 * 1024  # no /proc/meminfo: the fallback
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc/meminfo").write_text("MemTotal:       2048000 kB\nMemFree: 1 kB\n")
    assert shm_size(tmp_path) == 1024000 * 1024


class Recorder:
    def __init__(self, name: str, calls: list[str]) -> None:
        self.name = name
        self.calls = calls

    def handles(self, device: str) -> bool:
        return True

    def conflict(
        self, uid: str, devices: Prepared, held: Mapping[str, Prepared], describe: Any
    ) -> str | None:
        return None

    async def apply(self, uid: str, devices: Prepared, record: RecordIntents) -> Prepared:
        self.calls.append(f"apply {self.name}")
        await record((cp.Intent(self.name, "d", (("step", 1),)),))
        await record((cp.Intent(self.name, "d", (("step", 2),)),))  # replaces the first
        return devices

    async def undo(self, uid: str, intents: tuple[cp.Intent, ...], devices: Prepared) -> None:
        self.calls.append(f"undo {self.name}")

    async def recover(self, checkpoint: cp.Checkpoint) -> StartupRecovery:
        self.calls.append(f"recover {self.name}")
        return StartupRecovery()


@pytest.mark.anyio
async def test_effects_undo_and_recover_in_reverse_and_a_record_replaces_its_own() -> None:
    calls: list[str] = []
    effects = Effects([Recorder("mig", calls), Recorder("sharing", calls)])
    written: list[tuple[cp.Intent, ...]] = []

    async def record(intents: tuple[cp.Intent, ...]) -> None:
        written.append(intents)

    device = cp.PreparedDevice(("gpu",), "node-a", "gpu-0", (), "gpu", "GPU-a", 0, GpuConfig())
    await effects.apply("uid", (device,), record)
    assert [[(i.effector, i.get("step")) for i in w] for w in written][-1] == [
        ("mig", 2),
        ("sharing", 2),
    ]
    await effects.undo("uid", written[-1], ())
    await effects.recover(cp.Checkpoint("boot"))
    assert calls == [
        "apply mig",
        "apply sharing",
        "undo sharing",
        "undo mig",
        "recover sharing",
        "recover mig",
    ]
