"""Simulated host profiles: which GPUs a host has and how they are wired, loaded from YAML.

A profile is named after a file shipped in ``profiles/`` (``dgx-h100``) or is a path to the user's
own file. It references a GPU model of ``gpu-models.yaml`` for everything model-specific.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from agent import yamlload
from agent.hardware.errors import ProfileError
from agent.hardware.simulated.models import GpuModel, load_models
from agent.hardware.simulated.schema import PCI_BUS_ID, Node

GPU_UUID = re.compile(r"^GPU-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
PCIE_ROOT = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")
DRIVER_VERSION = re.compile(r"^\d{3}\.\d+(\.\d+)?$")
FABRIC_STATES = {"not-started": 1, "in-progress": 2, "completed": 3}
MIN_DRIVER_MAJOR = 565


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One GPU of a simulated host."""

    index: int
    minor: int
    uuid: str
    pci_bus_id: str
    pcie_root: str
    numa_node: int
    mig_layout: tuple[tuple[str, int], ...]  # (GI profile name, placement start)


@dataclass(frozen=True, slots=True)
class FabricSpec:
    """The NVLink fabric membership every GPU of the host reports."""

    cluster_uuid: uuid.UUID
    clique_id: int
    state: int  # NVML_GPU_FABRIC_STATE_*


@dataclass(frozen=True, slots=True)
class HostProfile:
    """A whole simulated host."""

    name: str
    description: str
    model: GpuModel
    driver_version: str
    cuda_driver_version: int  # as NVML reports it, e.g. 12080
    boot_id: str
    mig_enabled: bool
    gpus: tuple[GpuSpec, ...]
    nvswitches: tuple[str, ...]  # PCI bus ids of the NVSwitches every NVLink goes to
    bridges: tuple[tuple[int, int], ...]  # GPU index pairs joined by NVLink bridges
    fabric: FabricSpec | None


def shipped_profiles() -> list[str]:
    """Names of the host profiles shipped with the package."""
    folder = resources.files(__package__).joinpath("profiles")
    names = (entry.name for entry in folder.iterdir())
    return sorted(
        n[: -len(".yaml")] for n in names if n.endswith(".yaml") and n != "gpu-models.yaml"
    )


def load_profile(profile: str | Path) -> HostProfile:
    """Load a host profile by shipped name or by path, validating every field."""
    if isinstance(profile, Path) or "/" in profile or profile.endswith((".yaml", ".yml")):
        path = Path(profile)
        if not path.is_file():
            raise ProfileError(f"simulated host profile file {str(path)!r} does not exist")
        text, source = path.read_text(), str(path)
    else:
        if profile not in shipped_profiles():
            raise ProfileError(
                f"unknown simulated host profile {profile!r}; shipped profiles: "
                f"{', '.join(shipped_profiles())} (or give the path of a YAML file)"
            )
        text = resources.files(__package__).joinpath("profiles", f"{profile}.yaml").read_text()
        source = f"{profile}.yaml"
    try:
        document = yamlload.safe_load(text)
    except yamlload.YAMLError as exc:
        raise ProfileError(f"{source}: not valid YAML: {exc}") from exc
    return parse_profile(document, source, Path(source).stem)


def parse_profile(document: Any, source: str, name: str) -> HostProfile:
    """Validate a parsed host-profile document."""
    root = Node(source, "", document)
    root.only(
        "description", "model", "driver_version", "cuda_driver_version", "boot_id", "mig",
        "mig_layouts", "nvlink", "fabric", "gpus",
    )  # fmt: skip
    models = load_models()
    model_node = root.req("model")
    model = models.get(model_node.string())
    if model is None:
        raise model_node.fail("a GPU model of gpu-models.yaml: " + ", ".join(sorted(models)))
    driver_node = root.req("driver_version")
    driver = driver_node.string(DRIVER_VERSION, "a driver version like 570.158.01")
    if int(driver.split(".")[0]) < MIN_DRIVER_MAJOR:
        raise driver_node.fail(f"driver version {MIN_DRIVER_MAJOR} or newer")
    cuda = root.req("cuda_driver_version").integer(11000, 99990)
    mig_node = root.get("mig", required=False)
    mig_enabled = False
    if mig_node is not None:
        mig_enabled = mig_node.choice({"enabled": 1, "disabled": 0}) == 1
        if not model.mig_capable:
            raise mig_node.fail(f"no 'mig' field: model {model.key} does not support MIG")
    layouts = _layouts(root.get("mig_layouts", required=False), model)
    gpus = tuple(_gpu(node, layouts, mig_enabled) for node in root.req("gpus").items())
    _check_unique(root, gpus)
    nvswitches, bridges = _nvlink(root.get("nvlink", required=False), model, len(gpus))
    boot = root.get("boot_id", required=False)
    return HostProfile(
        name=name,
        description=root.req("description").string(),
        model=model,
        driver_version=driver,
        cuda_driver_version=cuda,
        boot_id=str(uuid.UUID(boot.string()))
        if boot
        else str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
        mig_enabled=mig_enabled,
        gpus=gpus,
        nvswitches=nvswitches,
        bridges=bridges,
        fabric=_fabric(root.get("fabric", required=False)),
    )


def _layouts(node: Node | None, model: GpuModel) -> dict[str, tuple[tuple[str, int], ...]]:
    if node is None:
        return {}
    layouts = {}
    for key, entries in node.entries():
        layout = []
        for entry in entries.items():
            pair = entry.items()
            if len(pair) != 2:
                raise entry.fail("a [profile name, placement start] pair")
            gi = model.gi_by_name(pair[0].string())
            if gi is None:
                names = ", ".join(p.name for p in model.gi_profiles)
                raise pair[0].fail(f"a MIG profile of {model.key}: {names}")
            start = pair[1].integer(0, 7)
            if start not in (s for s, _ in gi.placements):
                raise pair[1].fail(f"a placement start of {gi.name}: {gi.placements}")
            layout.append((gi.name, start))
        layouts[key] = tuple(layout)
    return layouts


def _gpu(node: Node, layouts: dict[str, tuple[tuple[str, int], ...]], mig: bool) -> GpuSpec:
    node.only("index", "minor", "uuid", "pci_bus_id", "pcie_root", "numa_node", "mig_layout")
    layout_node = node.get("mig_layout", required=False)
    layout: tuple[tuple[str, int], ...] = ()
    if layout_node is not None:
        if not mig:
            raise layout_node.fail("no mig_layout: MIG is not enabled in this profile")
        name = layout_node.string()
        if name not in layouts:
            raise layout_node.fail("a layout name of mig_layouts: " + ", ".join(sorted(layouts)))
        layout = layouts[name]
    return GpuSpec(
        index=node.req("index").integer(0, 63),
        minor=node.req("minor").integer(0, 254),
        uuid=node.req("uuid").string(
            GPU_UUID, "a GPU UUID like GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx"
        ),
        pci_bus_id=node.req("pci_bus_id").string(
            PCI_BUS_ID, "a lower-case PCI bus id like 0000:18:00.0"
        ),
        pcie_root=node.req("pcie_root").string(PCIE_ROOT, "a PCIe root like pci0000:16"),
        numa_node=node.req("numa_node").integer(0, 63),
        mig_layout=layout,
    )


def _check_unique(root: Node, gpus: tuple[GpuSpec, ...]) -> None:
    if [g.index for g in gpus] != list(range(len(gpus))):
        raise root.req("gpus").fail("GPUs listed in index order 0, 1, 2, ...")
    for field in ("minor", "uuid", "pci_bus_id"):
        values = [getattr(g, field) for g in gpus]
        if len(set(values)) != len(values):
            raise ProfileError(f"{root.source}: gpus: every GPU needs a distinct {field}")


def _nvlink(
    node: Node | None, model: GpuModel, gpu_count: int
) -> tuple[tuple[str, ...], tuple[tuple[int, int], ...]]:
    if node is None:
        return (), ()
    if model.nvlinks == 0:
        raise node.fail(f"no 'nvlink' field: model {model.key} has no NVLink")
    node.only("switches", "bridges")
    switches_node = node.get("switches", required=False)
    bridges_node = node.get("bridges", required=False)
    if (switches_node is None) == (bridges_node is None):
        raise node.fail("exactly one of 'switches' or 'bridges'")
    if switches_node is not None:
        return tuple(
            s.string(PCI_BUS_ID, "an NVSwitch PCI bus id") for s in switches_node.items()
        ), ()
    assert bridges_node is not None
    pairs = []
    for pair_node in bridges_node.items():
        pair = [p.integer(0, gpu_count - 1) for p in pair_node.items()]
        if len(pair) != 2 or pair[0] == pair[1]:
            raise pair_node.fail("a pair of two different GPU indexes")
        pairs.append((pair[0], pair[1]))
    return (), tuple(pairs)


def _fabric(node: Node | None) -> FabricSpec | None:
    if node is None:
        return None
    node.only("cluster_uuid", "clique_id", "state")
    cluster = node.req("cluster_uuid")
    try:
        cluster_uuid = uuid.UUID(cluster.string())
    except ValueError as exc:
        raise cluster.fail("a UUID") from exc
    return FabricSpec(
        cluster_uuid=cluster_uuid,
        clique_id=node.req("clique_id").integer(0, 2**32 - 1),
        state=node.req("state").choice(FABRIC_STATES),
    )
