"""The DeviceClasses the agent's deployment installs, for clusters that have none.

``deploy/kubernetes/base/deviceclasses.yaml`` is what a cluster gets (and
``overlays/extended-resources`` on 1.36+); ``explain --simulate``, the demo and the
integration tests need the same classes without kustomize, so they live here too (a test
checks the two stay equal).
"""

from __future__ import annotations

from typing import Any


def _device_class(name: str, kind: str) -> dict[str, Any]:
    expression = (
        f"device.driver == 'gpu.nvidia.com' && device.attributes['gpu.nvidia.com'].type == '{kind}'"
    )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": name},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def _channel_class() -> dict[str, Any]:
    """A ComputeDomain's IMEX channel (``agent.imex``): channel-0 of compute-domain.nvidia.com."""
    domain = "compute-domain.nvidia.com"
    expression = (
        f"device.driver == '{domain}' && device.attributes['{domain}'].type == 'channel' && "
        f"device.attributes['{domain}'].id == 0"
    )
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "DeviceClass",
        "metadata": {"name": "compute-domain-default-channel.nvidia.com"},
        "spec": {"selectors": [{"cel": {"expression": expression}}]},
    }


def default_device_classes(*, extended_resources: bool = False) -> list[dict[str, Any]]:
    """The base's classes; with ``extended_resources`` those of the ``extended-resources``
    overlay (Kubernetes 1.36+): ``gpu.nvidia.com`` serves ``nvidia.com/gpu``."""
    gpu = _device_class("gpu.nvidia.com", "gpu")
    if extended_resources:
        gpu["spec"]["extendedResourceName"] = EXTENDED_RESOURCE_NAME
    return [gpu, _device_class("mig.nvidia.com", "mig"), _channel_class()]


#: What pods written for NVIDIA's device plugin ask for.
EXTENDED_RESOURCE_NAME = "nvidia.com/gpu"
