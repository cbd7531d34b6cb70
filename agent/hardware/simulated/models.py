"""GPU model data (MIG tables, engines, memory) loaded from ``profiles/gpu-models.yaml``.

The numbers live in one data file, next to the notes on where each came from; this module only
turns them into typed records and derives the compute-instance profiles by NVIDIA's rule.
"""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any

from agent import yamlload
from agent.hardware.errors import ProfileError
from agent.hardware.simulated.schema import Node

MODELS_FILE = "gpu-models.yaml"

BRANDS = {"tesla": 2, "nvidia": 14, "nvidia-rtx": 13, "quadro": 1, "geforce": 5}
ARCHITECTURES = {"ampere": 7, "ada": 8, "hopper": 9, "blackwell": 10}
# NVML_COMPUTE_INSTANCE_PROFILE_* enum value by slice count, plus 1_SLICE_REV1.
CI_ENUM_BY_SLICES = {1: 0, 2: 1, 3: 2, 4: 3, 7: 4}
CI_PROFILE_1_SLICE_REV1 = 7


@dataclass(frozen=True, slots=True)
class GiProfileSpec:
    """One GPU-instance profile of a model: a row of ``nvidia-smi mig -lgip``."""

    name: str
    enum: int
    id: int
    slices: int
    instances: int
    memory_mib: int
    sm: int
    ce: int
    dec: int
    enc: int
    jpeg: int
    ofa: int
    placements: tuple[tuple[int, int], ...]


@dataclass(frozen=True, slots=True)
class CiProfileSpec:
    """One compute-instance profile offered inside a GPU instance (id = enum value)."""

    enum: int
    slices: int
    instances: int
    sm: int


@dataclass(frozen=True, slots=True)
class GpuModel:
    """Everything the simulated library reports that is the same for every GPU of a model."""

    key: str
    name: str
    brand: int
    architecture: int
    cuda_compute_capability: tuple[int, int]
    memory_mib: int
    pci_device_id: int
    nvlinks: int
    ci_rev1: bool
    gi_profiles: tuple[GiProfileSpec, ...]

    @property
    def mig_capable(self) -> bool:
        return bool(self.gi_profiles)

    def gi_by_enum(self, enum: int) -> GiProfileSpec | None:
        return next((p for p in self.gi_profiles if p.enum == enum), None)

    def gi_by_id(self, profile_id: int) -> GiProfileSpec | None:
        return next((p for p in self.gi_profiles if p.id == profile_id), None)

    def gi_by_name(self, name: str) -> GiProfileSpec | None:
        return next((p for p in self.gi_profiles if p.name == name), None)

    def ci_profiles(self, gi: GiProfileSpec) -> tuple[CiProfileSpec, ...]:
        """The CI profiles a GI of this profile offers (mig-profiles.md section 5)."""
        n = gi.slices
        sizes = [k for k in (1, 2, 3, 4, 7) if k <= n and (k in (1, 2) or k == n or n == 7)]
        result = []
        for k in sizes:
            count = n // k
            if n == 7 and k == 2:
                count = 3
            elif n == 7 and k == 3:
                count = 2
            result.append(CiProfileSpec(CI_ENUM_BY_SLICES[k], k, count, self._ci_sm(gi, k)))
            if k == 1 and self.ci_rev1:
                result.append(CiProfileSpec(CI_PROFILE_1_SLICE_REV1, 1, count, self._ci_sm(gi, 1)))
        return tuple(result)

    def full_ci_profile(self, gi: GiProfileSpec) -> CiProfileSpec:
        """The CI profile that spans a whole GI (what a static MIG device uses)."""
        return next(ci for ci in self.ci_profiles(gi) if ci.slices == gi.slices)

    def _ci_sm(self, gi: GiProfileSpec, slices: int) -> int:
        if slices == gi.slices:
            return gi.sm
        same_size = next((p for p in self.gi_profiles if p.slices == slices), None)
        return same_size.sm if same_size is not None else gi.sm * slices // gi.slices


def _gi_profile(node: Node, standard: dict[int, tuple[tuple[int, int], ...]]) -> GiProfileSpec:
    fields = ("name", "enum", "id", "slices", "instances", "memory_mib")
    engines = ("sm", "ce", "dec", "enc", "jpeg", "ofa")
    node.only(*fields, *engines, "placements")
    enum = node.req("enum").integer(0, 0x11)
    placements_node = node.get("placements", required=False)
    if placements_node is not None:
        placements = tuple(_placement(p) for p in placements_node.items())
    elif enum in standard:
        placements = standard[enum]
    else:
        raise node.fail(f"placements (no standard placements for profile enum {enum})")
    values = {key: node.req(key).integer(0) for key in (*fields[2:], *engines)}
    return GiProfileSpec(
        name=node.req("name").string(),
        enum=enum,
        placements=placements,
        **values,
    )


def _placement(node: Node) -> tuple[int, int]:
    pair = node.items()
    if len(pair) != 2:
        raise node.fail("a [start, size] pair")
    return pair[0].integer(0, 7), pair[1].integer(1, 8)


def _model(key: str, node: Node, standard: dict[int, tuple[tuple[int, int], ...]]) -> GpuModel:
    node.only(
        "name", "brand", "architecture", "cuda_compute_capability", "memory_mib",
        "pci_device_id", "nvlinks", "ci_rev1", "mig_profiles",
    )  # fmt: skip
    cc = node.req("cuda_compute_capability").items()
    if len(cc) != 2:
        raise node.req("cuda_compute_capability").fail("[major, minor]")
    profiles_node = node.get("mig_profiles", required=False)
    profiles = (
        tuple(_gi_profile(p, standard) for p in profiles_node.items()) if profiles_node else ()
    )
    ci_rev1 = node.get("ci_rev1", required=False)
    return GpuModel(
        key=key,
        name=node.req("name").string(),
        brand=node.req("brand").choice(BRANDS),
        architecture=node.req("architecture").choice(ARCHITECTURES),
        cuda_compute_capability=(cc[0].integer(1), cc[1].integer(0)),
        memory_mib=node.req("memory_mib").integer(1),
        pci_device_id=node.req("pci_device_id").integer(0),
        nvlinks=node.req("nvlinks").integer(0, 36),
        ci_rev1=ci_rev1.boolean() if ci_rev1 is not None else False,
        gi_profiles=profiles,
    )


def parse_models(document: Any, source: str) -> dict[str, GpuModel]:
    """Validate a parsed gpu-models document and return its models by key."""
    root = Node(source, "", document)
    root.only("standard_placements", "models")
    standard: dict[int, tuple[tuple[int, int], ...]] = {}
    for key, placements in root.req("standard_placements").entries():
        if not key.isdigit():
            raise placements.fail("a profile enum number as key")
        standard[int(key)] = tuple(_placement(p) for p in placements.items())
    return {key: _model(key, node, standard) for key, node in root.req("models").entries()}


def load_models() -> dict[str, GpuModel]:
    """Load the GPU models shipped with the package."""
    text = resources.files(__package__).joinpath("profiles", MODELS_FILE).read_text()
    try:
        document = yamlload.safe_load(text)
    except yamlload.YAMLError as exc:
        raise ProfileError(f"{MODELS_FILE}: not valid YAML: {exc}") from exc
    return parse_models(document, MODELS_FILE)
