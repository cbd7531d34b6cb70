"""The demo's extended-resources step (Kubernetes 1.36, KEP-5004): a pod written for NVIDIA's
device plugin (``nvidia.com/gpu: 2`` in its limits, no ResourceClaim) is served by DRA. The
DeviceClass ``gpu.nvidia.com`` of the ``extended-resources`` overlay names the resource, with
a time-slicing config of its own; the scheduler's part (``agent.sim.extended``) makes the
pod's special claim, the kubelet emulator finds it in the pod's status and prepares it, and
the agent applies the class's config to both GPUs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from agent.demo.common import DRIVER, DemoFailed, say

#: The class's config: what every GPU given to an ``nvidia.com/gpu`` request gets.
TIME_SLICING = {
    "opaque": {
        "driver": DRIVER,
        "parameters": {
            "apiVersion": "resource.nvidia.com/v1beta1",
            "kind": "GpuConfig",
            "sharing": {"strategy": "TimeSlicing", "timeSlicingConfig": {"interval": "Long"}},
        },
    }
}
LONG = 3  # nvidia-smi compute-policy --set-timeslice value of Long


def _uuids(server: Any, devices: list[str]) -> list[str]:
    found = {
        entry["name"]: entry["attributes"]["uuid"]["string"]
        for item in server.list_objects("resourceslices")
        for entry in item["spec"].get("devices", [])
        if "uuid" in entry.get("attributes", {})  # a MIG placement has none until made
    }
    return [found[d] for d in devices]


async def extended_resources_step(server: Any, kubelet: Any, node: str, plugins_dir: Path) -> None:
    from agent.config import SIMULATED_HOST_DIR
    from agent.hardware.simulated.tools import read_timeslices
    from agent.sim.allocation import ApiAccess
    from agent.sim.deviceclasses import default_device_classes
    from agent.sim.extended import (
        EXTENDED_RESOURCE_CLAIM_ANNOTATION,
        end_pod,
        pod_manifest,
        start_pod,
    )

    classes = {c["metadata"]["name"]: c for c in default_device_classes(extended_resources=True)}
    gpu_class = classes[DRIVER]
    gpu_class["spec"]["config"] = [TIME_SLICING]
    server.put_object(gpu_class)
    say("8. extended resources (Kubernetes 1.36): DeviceClass gpu.nvidia.com with")
    say("   extendedResourceName: nvidia.com/gpu (overlays/extended-resources) and a")
    say("   time-slicing config (interval Long); a pod written for the device plugin:")
    manifest = pod_manifest("legacy-cuda", {"cuda": {"nvidia.com/gpu": "2"}})
    say("     containers: [{name: cuda, resources: {limits: {nvidia.com/gpu: 2}}}]")
    access = ApiAccess(server.url, server.token)
    pod, started = await start_pod(access, kubelet, manifest, node)
    [claim] = started.claims
    meta = claim["metadata"]
    if meta.get("annotations") != {EXTENDED_RESOURCE_CLAIM_ANNOTATION: "true"}:
        raise DemoFailed(f"the special claim lacks its annotation: {meta.get('annotations')}")
    [request] = claim["spec"]["devices"]["requests"]
    status = pod["status"]["extendedResourceClaimStatus"]
    say(f"   the scheduler's special claim {meta['name']} (owner: the pod; annotation")
    say(f"   {EXTENDED_RESOURCE_CLAIM_ANNOTATION}=true), request {request['name']}")
    say(f"   for {request['exactly']['count']} of {request['exactly']['deviceClassName']};")
    say(f"   pod.status.extendedResourceClaimStatus names it: {status['resourceClaimName']}")
    if started.errors():
        raise DemoFailed(f"preparing the special claim failed: {started.errors()}")
    answer = started.results[DRIVER][meta["uid"]]
    devices = [d.device_name for d in answer.devices]
    host = plugins_dir / DRIVER / SIMULATED_HOST_DIR
    slices = read_timeslices(host)
    uuids = _uuids(server, devices)
    if len(devices) != 2 or any(slices.get(u) != LONG for u in uuids):
        raise DemoFailed(f"the class's time-slicing did not reach {devices}: {slices}")
    say(f"   the kubelet prepared it: {', '.join(devices)}, each time-sliced (Long) by the")
    say("   class's config, since the scheduler's claim has none of its own")
    await end_pod(access, kubelet, started)
    gone = server.get_object("resourceclaims", meta["name"], meta["namespace"]) is None
    if not gone or any(read_timeslices(host).get(u) for u in uuids):
        raise DemoFailed("the pod's end left its claim or a time-slice behind")
    say("   the pod is deleted: unprepared, time-slices back to Default, the claim gone with it")
    server.put_object(default_device_classes()[0])  # the class as the other steps use it
