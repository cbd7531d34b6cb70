"""Host profile and GPU model loading: shipped data is valid, mistakes get precise messages."""

from __future__ import annotations

from importlib import resources
from pathlib import Path
from typing import Any

import pytest
import yaml

from agent.hardware.errors import ProfileError
from agent.hardware.simulated import load_profile, shipped_profiles
from agent.hardware.simulated.models import load_models

VALID: dict[str, Any] = {
    "description": "two L40S",
    "model": "l40s",
    "driver_version": "570.158.01",
    "cuda_driver_version": 12080,
    "gpus": [
        {"index": 0, "minor": 0, "uuid": "GPU-00000000-0000-0000-0000-000000000001",
         "pci_bus_id": "0000:01:00.0", "pcie_root": "pci0000:00", "numa_node": 0},
        {"index": 1, "minor": 1, "uuid": "GPU-00000000-0000-0000-0000-000000000002",
         "pci_bus_id": "0000:81:00.0", "pcie_root": "pci0000:80", "numa_node": 1},
    ],
}  # fmt: skip


def write(tmp_path: Path, document: dict[str, Any]) -> Path:
    path = tmp_path / "mine.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def with_changes(**changes: Any) -> dict[str, Any]:
    document: dict[str, Any] = yaml.safe_load(yaml.safe_dump(VALID))
    document.update(changes)
    return document


def test_every_shipped_profile_loads() -> None:
    for name in shipped_profiles():
        profile = load_profile(name)
        assert profile.name == name and profile.gpus
        assert int(profile.driver_version.split(".")[0]) >= 565


def test_model_table_matches_mig_profiles_md() -> None:
    models = load_models()
    a100 = models["a100-sxm4-80gb"]
    assert [(p.name, p.id, p.enum) for p in a100.gi_profiles] == [
        ("1g.10gb", 19, 0), ("1g.10gb+me", 20, 7), ("1g.20gb", 15, 9), ("2g.20gb", 14, 1),
        ("3g.40gb", 9, 2), ("4g.40gb", 5, 3), ("7g.80gb", 0, 4),
    ]  # fmt: skip
    seven = a100.gi_by_name("7g.80gb")
    assert seven is not None
    cis = {(c.enum, c.slices): (c.instances, c.sm) for c in a100.ci_profiles(seven)}
    assert cis == {
        (0, 1): (7, 14), (7, 1): (7, 14), (1, 2): (3, 28), (2, 3): (2, 42), (3, 4): (1, 56),
        (4, 7): (1, 98),
    }  # fmt: skip
    assert models["l40s"].mig_capable is False


def test_user_file_by_path(tmp_path: Path) -> None:
    profile = load_profile(write(tmp_path, VALID))
    assert profile.name == "mine" and len(profile.gpus) == 2
    assert profile.model.name == "NVIDIA L40S"


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"model": "h900"}, "model: expected a GPU model of gpu-models.yaml"),
        ({"driver_version": "535.104.05"}, "driver_version: expected driver version 565"),
        ({"cuda_driver_version": "12.8"}, "cuda_driver_version: expected an integer"),
        ({"mig": "enabled"}, "model l40s does not support MIG"),
        ({"nvlink": {"switches": ["0000:05:00.0"]}}, "model l40s has no NVLink"),
        ({"colour": "green"}, "unknown field(s) colour"),
        ({"description": None}, "missing required field 'description'"),
    ],
)
def test_mistakes_are_reported_precisely(
    tmp_path: Path, changes: dict[str, Any], message: str
) -> None:
    with pytest.raises(ProfileError) as caught:
        load_profile(write(tmp_path, with_changes(**changes)))
    assert message in str(caught.value)
    assert "mine.yaml" in str(caught.value)


def test_gpu_field_paths_are_named(tmp_path: Path) -> None:
    document = with_changes()
    document["gpus"][1]["pci_bus_id"] = "81:00.0"
    with pytest.raises(ProfileError, match=r"gpus\[1\]\.pci_bus_id: expected a lower-case PCI"):
        load_profile(write(tmp_path, document))
    document["gpus"][1]["pci_bus_id"] = "0000:01:00.0"
    with pytest.raises(ProfileError, match="distinct pci_bus_id"):
        load_profile(write(tmp_path, document))


def test_bad_mig_layout(tmp_path: Path) -> None:
    shipped = resources.files("agent.hardware.simulated").joinpath("profiles", "dgx-a100.yaml")
    document = yaml.safe_load(shipped.read_text())
    document["mig_layouts"]["mixed"][0] = ["3g.40gb", 2]
    with pytest.raises(ProfileError, match=r"mig_layouts\.mixed\[0\]\[1\]: expected a placement"):
        load_profile(write(tmp_path, document))


def test_unknown_name_and_missing_file() -> None:
    with pytest.raises(ProfileError, match=r"shipped profiles: .*dgx-h100"):
        load_profile("dgx-h1000")
    with pytest.raises(ProfileError, match="does not exist"):
        load_profile(Path("/nonexistent/profile.yaml"))


def test_invalid_yaml(tmp_path: Path) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text("gpus: [\n")
    with pytest.raises(ProfileError, match=r"broken\.yaml: not valid YAML"):
        load_profile(path)
