"""Reduce per-GPU NVLinks to NVLink domains and peer counts (a pure function, no I/O).

GPUs and NVSwitches are nodes identified by PCI bus id; every active link is an edge. A connected
component holding at least one GPU of this host is an NVLink domain; its id is derived from the
sorted member GPU UUIDs so that it is stable across restarts and identical for every member.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Iterable

from agent.hardware.inventory import Gpu

DOMAIN_PREFIX = "nvl-"


def domain_id(member_uuids: Iterable[str]) -> str:
    """``nvl-`` + 12 hex characters of a hash of the sorted member UUIDs (a DNS label)."""
    digest = hashlib.sha256("\n".join(sorted(member_uuids)).encode()).hexdigest()
    return DOMAIN_PREFIX + digest[:12]


def assign_nvlink_domains(gpus: Iterable[Gpu]) -> tuple[Gpu, ...]:
    """Return the GPUs with ``nvlink_domain`` and ``nvlink_peer_count`` filled in."""
    gpus = tuple(gpus)
    parent: dict[str, str] = {}

    def find(node: str) -> str:
        parent.setdefault(node, node)
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    linked: set[str] = set()
    for gpu in gpus:
        for link in gpu.nvlinks:
            if link.active and link.remote_pci_bus_id is not None:
                linked.add(gpu.pci_bus_id)
                parent[find(gpu.pci_bus_id)] = find(link.remote_pci_bus_id)
    members: dict[str, list[Gpu]] = {}
    for gpu in gpus:
        if gpu.pci_bus_id in linked:
            members.setdefault(find(gpu.pci_bus_id), []).append(gpu)
    result = []
    for gpu in gpus:
        group = members.get(find(gpu.pci_bus_id)) if gpu.pci_bus_id in linked else None
        if group is None:
            result.append(dataclasses.replace(gpu, nvlink_domain=None, nvlink_peer_count=0))
            continue
        result.append(
            dataclasses.replace(
                gpu,
                nvlink_domain=domain_id(member.uuid for member in group),
                nvlink_peer_count=len(group) - 1,
            )
        )
    return tuple(result)
