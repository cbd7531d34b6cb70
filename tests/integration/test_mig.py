"""Dynamic MIG with the real agent process (``run --simulate dgx-h100 --dynamic-mig``), the
kubelet emulator and ``gpu-dra-agent sim state`` reading the simulated host's MIG state.

- Two 3g.40gb devices at placements 0 and 4 of one GPU prepared concurrently; an overlapping
  third claim and a full-GPU claim on that GPU get errors naming the claim in the way;
  unprepare leaves no instance and MIG mode off.
- ``kill -9`` (``GPU_DRA_AGENT_CRASH_AT``) after the intent, after the GPU instance, after the
  compute instance and after the completed record: after the restart ``sim state`` shows no
  instance that no completed claim owns, and the kubelet's retry converges to the answer of
  an uninterrupted prepare.

The claims ask for a MIG profile and the allocator places them on the partitionable devices
the agent publishes, shared counters included, as kube-scheduler would (two 3g.40gb claims
on one GPU land on placements 0 and 4). Only the overlapping and full-GPU claims name their
devices (``harness.claim``): the counters make the scheduler refuse them, and the agent must
refuse them too when a broken scheduler or a stale copy writes them.
"""

from __future__ import annotations

import json
import sys
from typing import Any

import anyio
import pytest

from agent.crash import ENV_VAR, EXIT_STATUS, MIG_CRASH_POINTS
from agent.sim.kubelet import DraCallError
from tests.integration.conftest import AgentHarness, allocated_devices, gpu_request

pytestmark = pytest.mark.anyio
DYNAMIC = ("--dynamic-mig", "true")
LEFT = "gpu-0-mig-3g40gb-9-0"
RIGHT = "gpu-0-mig-3g40gb-9-4"
OVERLAP = "gpu-0-mig-2g20gb-14-2"


def mig_request(profile: str, *, gpu_uuid: str | None = None) -> dict[str, Any]:
    """One MIG device of ``profile`` (on the GPU with ``gpu_uuid``), as a user asks for it."""
    selectors = [f"device.attributes['gpu.nvidia.com'].profile == '{profile}'"]
    if gpu_uuid is not None:
        selectors.append(f"device.attributes['gpu.nvidia.com'].parentUUID == '{gpu_uuid}'")
    return gpu_request("mig", selectors=selectors, device_class="mig.nvidia.com")


def placement(device: str) -> tuple[int, int]:
    """(GPU minor, placement start) of a ``gpu-<minor>-mig-<profile>-<gi>-<start>`` device."""
    return int(device.split("-")[1]), int(device.rsplit("-", 1)[1])


async def sim_state(harness: AgentHarness) -> dict[str, Any]:
    """``gpu-dra-agent sim state -o json``, as an operator would run it."""
    command = [sys.executable, "-m", "agent", "sim", "state"]
    command += ["--plugins-dir", str(harness.plugins_dir), "-o", "json"]
    result = await anyio.run_process(command, check=False)
    assert result.returncode == 0, result.stderr.decode()
    document: dict[str, Any] = json.loads(result.stdout)
    return document


def instances(state: dict[str, Any], minor: int) -> list[tuple[str, int, int, list[str]]]:
    """(profile, start, size, MIG UUIDs) of every GPU instance of GPU ``minor``."""
    (gpu,) = [g for g in state["gpus"] if g["minor"] == minor]
    return [
        (gi["profile"], gi["start"], gi["size"], [ci["uuid"] for ci in gi["computeInstances"]])
        for gi in gpu["gpuInstances"]
    ]


def mig_mode(state: dict[str, Any], minor: int) -> int:
    (gpu,) = [g for g in state["gpus"] if g["minor"] == minor]
    return int(gpu["migMode"])


async def test_two_placements_concurrently_and_clear_errors(fresh_harness: AgentHarness) -> None:
    harness = fresh_harness
    await harness.start_agent(args=DYNAMIC)
    gpu0 = await harness.device_attribute("gpu-0", "uuid")
    left, first = await harness.allocate(mig_request("3g.40gb", gpu_uuid=gpu0), name="left")
    right, second = await harness.allocate(mig_request("3g.40gb", gpu_uuid=gpu0), name="right")
    # the counters leave exactly the two halves of GPU 0 for two 3g.40gb claims
    assert (allocated_devices(first), allocated_devices(second)) == ([LEFT], [RIGHT])
    answers: dict[str, Any] = {}

    async def prepare(ref: Any) -> None:
        answers.update(await harness.prepare(ref))

    async with anyio.create_task_group() as group:  # two kubelet calls at once
        group.start_soon(prepare, left)
        group.start_soon(prepare, right)
    assert answers[left.uid].error == "" and answers[right.uid].error == ""
    assert [d.device_name for d in answers[left.uid].devices] == [LEFT]
    state = await sim_state(harness)
    assert mig_mode(state, 0) == 1
    made = instances(state, 0)  # in the order made: either prepare may come first
    assert sorted((p, start, size) for p, start, size, _ in made) == [
        ("3g.40gb", 0, 4),
        ("3g.40gb", 4, 4),
    ]
    spec = json.loads(harness.cdi_spec_path(left.uid).read_text())
    paths = [n["path"] for n in spec["devices"][0]["containerEdits"]["deviceNodes"]]
    assert paths[0] == "/dev/nvidia0" and len(paths) == 3
    assert all(p.startswith("/dev/nvidia-caps/nvidia-cap") for p in paths[1:])

    # named on purpose: both overlap the prepared placements, so no scheduler would write them
    overlap = await harness.claim([OVERLAP], name="overlap")
    error = (await harness.prepare(overlap))[overlap.uid].error
    assert f"default/left ({left.uid})" in error and "placement overlaps" in error
    whole = await harness.claim(["gpu-0"], name="whole")
    error = (await harness.prepare(whole))[whole.uid].error
    assert "has MIG device" in error and "default/" in error
    assert len(instances(await sim_state(harness), 0)) == 2  # nothing touched

    answers = await harness.unprepare(left, right)
    assert answers[left.uid].error == "" and answers[right.uid].error == ""
    state = await sim_state(harness)
    assert instances(state, 0) == [] and mig_mode(state, 0) == 0
    harness.assert_consistent()
    assert harness.checkpoint_claims() == {}
    assert await harness.stop_agent() == 0


async def _crash_then_restart(harness: AgentHarness, point: str) -> tuple[Any, str]:
    """Start the agent set to die at ``point``, allocate a 3g.40gb claim, let the prepare
    kill it, restart it; returns the claim and its allocated device."""
    agent = await harness.start_agent({ENV_VAR: point}, args=DYNAMIC)
    ref, claim = await harness.allocate(mig_request("3g.40gb"), name=f"crash-{point}")
    with pytest.raises(DraCallError):
        await harness.prepare(ref)
    assert await agent.wait() == EXIT_STATUS, agent.log()
    await harness.start_agent(args=DYNAMIC)
    [device] = allocated_devices(claim)
    return ref, device


@pytest.mark.parametrize("point", [*MIG_CRASH_POINTS, "after-prepare-completed"])
async def test_kill_during_a_mig_prepare(fresh_harness: AgentHarness, point: str) -> None:
    harness = fresh_harness
    ref, device = await _crash_then_restart(harness, point)
    minor, start = placement(device)
    state = await sim_state(harness)
    completed = point == "after-prepare-completed"
    if completed:  # the claim is prepared: its instance is owned, nothing else exists
        assert [(p, s) for p, s, _, _ in instances(state, minor)] == [("3g.40gb", start)]
    else:  # rolled back at startup: no leaked instance, MIG mode off again
        assert instances(state, minor) == [] and mig_mode(state, minor) == 0
    harness.assert_consistent()

    result = (await harness.prepare(ref))[ref.uid]  # the kubelet's retry
    assert result.error == ""
    assert [d.device_name for d in result.devices] == [device]
    (made,) = instances(await sim_state(harness), minor)
    assert made[:3] == ("3g.40gb", start, 4) and len(made[3]) == 1
    document = json.loads(harness.cdi_spec_path(ref.uid).read_text())
    assert document["devices"][0]["name"] == f"{ref.uid}-{device}"
    harness.assert_consistent()

    assert (await harness.unprepare(ref))[ref.uid].error == ""
    state = await sim_state(harness)
    assert instances(state, minor) == [] and mig_mode(state, minor) == 0
    assert harness.checkpoint_claims() == {}
    assert await harness.stop_agent() == 0


async def test_sim_state_table_while_the_agent_is_down(fresh_harness: AgentHarness) -> None:
    harness = fresh_harness
    await harness.start_agent(args=DYNAMIC)
    gpu5 = await harness.device_attribute("gpu-5", "uuid")
    ref, claim = await harness.allocate(mig_request("1g.10gb", gpu_uuid=gpu5), name="table")
    [device] = allocated_devices(claim)
    minor, start = placement(device)
    assert minor == 5
    assert (await harness.prepare(ref))[ref.uid].error == ""
    assert await harness.stop_agent() == 0  # instances outlive the agent, as on hardware
    command = [sys.executable, "-m", "agent", "sim", "state"]
    result = await anyio.run_process([*command, "--plugins-dir", str(harness.plugins_dir)])
    table = result.stdout.decode()
    assert "1g.10gb" in table and f"placement {start}+1" in table and "MIG-" in table
    await harness.start_agent(args=DYNAMIC)
    assert (await harness.unprepare(ref))[ref.uid].error == ""
    assert instances(await sim_state(harness), 5) == []
    assert await harness.stop_agent() == 0
