"""How each compared model places a pod on one node, and what it gives the pod.

* ``device-plugin``: whole GPUs only, a fractional request takes a whole GPU; the lowest
  free indices, topology-blind, as a device plugin without the topology manager chooses.
* ``device-plugin-static-mig``: the operator partitions every GPU with one fixed layout; a
  fractional request takes the smallest free instance that covers it (lowest GPU first), a
  whole-GPU request finds no whole GPU.
* ``dra-name-order`` / ``dra``: a ResourceClaim allocated by the embedded allocator
  (:mod:`agent.dra.allocator`, first fit by the 1.36 rules) on the node's ResourceSlices as
  ``run`` publishes them with ``--dynamic-mig``, in the incumbent's order (device names
  sorted) or in this agent's packing order (:mod:`agent.dra.order`).

Compute is counted in GPUs: a whole GPU is 1, a MIG instance its compute slices over the
GPU's (a 3g is 3/7). Each model answers :meth:`Model.try_node` without changing anything,
and the replay commits the placement it chooses.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from fractions import Fraction
from typing import Any, Protocol

from agent.dra.allocator import NodeDevice, ParsedClaim, allocate, build_node_state, parse_claim
from agent.dra.allocator.checks import check_device
from agent.dra.allocator.claim import Request
from agent.dra.allocator.node import (
    DeviceId,
    NodeState,
    forget_allocations,
    note_allocations,
)
from agent.dra.devices import NUMA_NODE
from agent.dra.names import parse_mig_device_name
from agent.dra.order import DeviceOrder, gpu_minor
from agent.sim.deviceclasses import default_device_classes
from agent.sim.packing.cluster import DRIVER, NodeTemplate
from agent.sim.packing.workload import PodRequest

Obj = dict[str, Any]
#: The GPU operator's ``all-balanced`` layout for an H100 80GB.
ALL_BALANCED_H100 = ("1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb")
MODEL_NAMES = ("device-plugin", "device-plugin-static-mig", "dra-name-order", "dra")


@dataclass(frozen=True)
class Placement:
    """What one pod got on one node."""

    node: int
    gpus: tuple[int, ...]  # the minors of the GPUs it uses
    allocated: Fraction  # compute given, in GPUs
    token: Any = field(compare=False, default=None)  # the model's own record


class Model(Protocol):
    name: str

    def try_node(self, node: int, pod: PodRequest) -> Placement | None: ...
    def commit(self, placement: Placement) -> None: ...
    def release(self, placement: Placement) -> None: ...


class DevicePlugin:
    """Whole GPUs, lowest free index first, topology-blind."""

    name = "device-plugin"

    def __init__(self, template: NodeTemplate, nodes: int) -> None:
        self._minors = [gpu.minor for gpu in template.gpus]
        self._free = [[True] * len(self._minors) for _ in range(nodes)]

    def try_node(self, node: int, pod: PodRequest) -> Placement | None:
        want = max(pod.gpus, 1)
        free = [i for i, ok in enumerate(self._free[node]) if ok][:want]
        if len(free) < want:
            return None
        return Placement(node, tuple(self._minors[i] for i in free), Fraction(want), free)

    def commit(self, placement: Placement) -> None:
        for index in placement.token:
            self._free[placement.node][index] = False

    def release(self, placement: Placement) -> None:
        for index in placement.token:
            self._free[placement.node][index] = True


class StaticMig:
    """Every GPU cut into the same MIG instances; a request takes the smallest that covers it."""

    name = "device-plugin-static-mig"

    def __init__(self, template: NodeTemplate, nodes: int, layout: Sequence[str]) -> None:
        sizes = {size.profile: size for size in template.sizes}
        unknown = [profile for profile in layout if profile not in sizes]
        if unknown or not layout:
            raise ValueError(
                f"static MIG layout {list(layout)}: {template.profile} has no MIG profile "
                f"{', '.join(unknown) or '(empty layout)'}; it has {', '.join(sizes) or 'none'}"
            )
        total = sum(sizes[profile].compute_slices for profile in layout)
        if total > template.compute_slices:
            raise ValueError(
                f"static MIG layout {list(layout)} takes {total} compute slices; a GPU has "
                f"{template.compute_slices}"
            )
        ordered = sorted(
            (sizes[p] for p in layout), key=lambda s: (s.compute_slices, s.memory_slices)
        )
        #: (GPU position, instance) in the order a request tries them: smallest size first,
        #: then the lowest GPU
        self._instances = [(gpu, size) for size in ordered for gpu in range(len(template.gpus))]
        self._minors = [gpu.minor for gpu in template.gpus]
        self._free = [[True] * len(self._instances) for _ in range(nodes)]

    def try_node(self, node: int, pod: PodRequest) -> Placement | None:
        if pod.gpus:  # every GPU is partitioned: no whole GPU to give
            return None
        for index, (gpu, size) in enumerate(self._instances):
            covers = size.compute_slices * 1000 >= pod.gpu_milli * size.total_compute
            if covers and self._free[node][index]:
                share = Fraction(size.compute_slices, size.total_compute)
                return Placement(node, (self._minors[gpu],), share, index)
        return None

    def commit(self, placement: Placement) -> None:
        self._free[placement.node][placement.token] = False

    def release(self, placement: Placement) -> None:
        self._free[placement.node][placement.token] = True


class Dra:
    """ResourceClaims allocated by the embedded allocator on the published slices."""

    def __init__(
        self, template: NodeTemplate, node_names: Sequence[str], order: DeviceOrder
    ) -> None:
        self.name = "dra" if order == "packing" else "dra-name-order"
        self._template = template
        first = build_node_state(node_names[0], template.slices(node_names[0], order))
        self._states: list[NodeState] = [first] + [same_hardware(first, n) for n in node_names[1:]]
        self._claims: list[dict[str, Obj]] = [{} for _ in node_names]
        self._classes = {c["metadata"]["name"]: c for c in default_device_classes()}
        self._parsed: dict[tuple[Any, ...], ParsedClaim] = {}
        self._order = order
        self._compute = {size.profile: size for size in template.sizes}
        self._uids = itertools.count()

    def try_node(self, node: int, pod: PodRequest) -> Placement | None:
        shape = _shape(pod)
        parsed = self._parsed.get(shape)
        if parsed is None:
            parsed = self._parsed[shape] = parse_claim(claim_document(pod), self._classes)
        state = self._states[node]
        outcome = allocate(
            parsed, state, lambda: f"share-{next(self._uids)}", selected=self._chooser(shape, state)
        )
        if not outcome.fits or outcome.allocation is None:
            return None
        gpus: list[int] = []
        given = Fraction(0)
        for chosen in outcome.devices:
            minor, share = self._device_compute(chosen.device)
            gpus.append(minor)
            given += share
        claim = {
            "metadata": {"namespace": "sim", "name": pod.name, "uid": f"uid-{next(self._uids)}"},
            "status": {"allocation": outcome.allocation},
        }
        return Placement(node, tuple(gpus), given, claim)

    def commit(self, placement: Placement) -> None:
        claim = placement.token
        self._claims[placement.node][claim["metadata"]["uid"]] = claim
        note_allocations(self._states[placement.node], [claim])

    def release(self, placement: Placement) -> None:
        claims = self._claims[placement.node]
        claims.pop(placement.token["metadata"]["uid"], None)
        state = self._states[placement.node]
        forget_allocations(state)
        note_allocations(state, claims.values())

    def _chooser(
        self, shape: tuple[Any, ...], state: NodeState
    ) -> Callable[[Request], Sequence[NodeDevice]]:
        """The devices each request's selectors select (same on every node of the template:
        evaluated once per pod shape, on the first node asked)."""

        def selected(request: Request) -> Sequence[NodeDevice]:
            key = (self._order, shape, request.name)
            selections = self._template.selections
            indices = selections.get(key)
            if indices is None:
                indices = selections[key] = [
                    i
                    for i, device in enumerate(state.devices)
                    if check_device(request, device, state).selected
                ]
            return [state.devices[i] for i in indices]

        return selected

    def _device_compute(self, device: NodeDevice) -> tuple[int, Fraction]:
        name = device.id.device
        parsed = parse_mig_device_name(name)
        if parsed is not None:
            profile = device.attribute(f"{DRIVER}/profile")
            size = self._compute.get(str(profile))
            share = Fraction(size.compute_slices, size.total_compute) if size else Fraction(1)
            return parsed[0], share
        minor = gpu_minor(name)
        return (minor if minor is not None else -1), Fraction(1)


def same_hardware(state: NodeState, node: str) -> NodeState:
    """``state``'s devices and counters on node ``node`` (its pool): what
    :func:`build_node_state` makes of that node's slices when the hardware is the same, without
    building every device's CEL variable again (they do not name the pool)."""
    devices = [replace(d, id=DeviceId(d.id.driver, node, d.id.device)) for d in state.devices]
    counters = {(drv, node, name, c): v for (drv, _, name, c), v in state.counters.items()}
    return NodeState(node, devices=devices, counters=counters)


def _shape(pod: PodRequest) -> tuple[Any, ...]:
    return (pod.gpus, pod.mig_profile, pod.constraint)


def claim_document(pod: PodRequest) -> Obj:
    """The ResourceClaim a user would write for ``pod``: whole GPUs of class gpu.nvidia.com
    (with a ``matchAttribute`` on the NUMA node or the NVLink domain), or one MIG device of
    the mapped profile (a fraction on a GPU model without MIG: a whole GPU)."""
    if pod.gpus or pod.mig_profile is None:
        request: Obj = {
            "name": "gpus",
            "exactly": {"deviceClassName": "gpu.nvidia.com", "count": max(pod.gpus, 1)},
        }
        constraints = []
        if pod.constraint == "numa" and pod.gpus > 1:
            constraints.append({"requests": ["gpus"], "matchAttribute": NUMA_NODE})
        elif pod.constraint == "nvlink" and pod.gpus > 1:
            constraints.append({"requests": ["gpus"], "matchAttribute": f"{DRIVER}/nvlinkDomain"})
        devices: Obj = {"requests": [request]}
        if constraints:
            devices["constraints"] = constraints
    else:
        selector = f"device.attributes['{DRIVER}'].profile == '{pod.mig_profile}'"
        devices = {
            "requests": [
                {
                    "name": "mig",
                    "exactly": {
                        "deviceClassName": "mig.nvidia.com",
                        "selectors": [{"cel": {"expression": selector}}],
                    },
                }
            ]
        }
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": pod.name, "namespace": "sim"},
        "spec": {"devices": devices},
    }


def build_models(
    names: Sequence[str],
    template: NodeTemplate,
    node_names: Sequence[str],
    static_layout: Sequence[str],
) -> list[Model]:
    out: list[Model] = []
    for name in names:
        if name == "device-plugin":
            out.append(DevicePlugin(template, len(node_names)))
        elif name == "device-plugin-static-mig":
            out.append(StaticMig(template, len(node_names), static_layout))
        elif name == "dra-name-order":
            out.append(Dra(template, node_names, "names"))
        elif name == "dra":
            out.append(Dra(template, node_names, "packing"))
        else:
            raise ValueError(f"unknown model {name!r}; one of {', '.join(MODEL_NAMES)}")
    return out
