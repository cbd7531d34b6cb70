"""CDI documents: schema-valid for gpu and MIG devices, minimal cdiVersion, safe claim UIDs."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.dra import cdi
from tests.support import cdi_schema
from tests.support.cdi_schema import assert_valid_cdi_spec, cdi_problems

DRIVER = "gpu.nvidia.com"
UID_LETTER = "aa11bb22-cc33-4d44-8e55-ff6677889900"  # starts with a letter
UID_DIGIT = "3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8"  # starts with a digit
MIG = cdi.ClaimDevice("gpu-1-mig-1g10gb-19-3", 1, cdi.MigCapabilities(508, 39, 40))


def test_common_spec() -> None:
    spec = cdi.common_spec(
        DRIVER,
        ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"],
        [("/run/nvidia/driver/usr/bin/nvidia-smi", "/usr/bin/nvidia-smi")],
    )
    assert_valid_cdi_spec(spec)
    assert spec == {
        "cdiVersion": "0.3.0",
        "kind": "k8s.gpu.nvidia.com/claim",
        "devices": [
            {
                "name": "common",
                "containerEdits": {
                    "deviceNodes": [
                        {"path": "/dev/nvidiactl"},
                        {"path": "/dev/nvidia-uvm"},
                        {"path": "/dev/nvidia-uvm-tools"},
                    ],
                    "mounts": [
                        {
                            "hostPath": "/run/nvidia/driver/usr/bin/nvidia-smi",
                            "containerPath": "/usr/bin/nvidia-smi",
                            "options": ["ro", "nosuid", "nodev", "bind"],
                        }
                    ],
                },
            }
        ],
    }
    assert cdi.common_device_id(DRIVER) == "k8s.gpu.nvidia.com/claim=common"
    assert cdi.common_spec_file_name(DRIVER) == "k8s.gpu.nvidia.com-common.json"


def test_empty_common_spec_is_refused() -> None:
    with pytest.raises(cdi.CdiSpecError, match="is the NVIDIA driver loaded"):
        cdi.common_spec(DRIVER, [], [])


def test_gpu_and_mig_claim_spec() -> None:
    spec = cdi.claim_spec(DRIVER, UID_LETTER, [cdi.ClaimDevice("gpu-0", 0), MIG])
    assert_valid_cdi_spec(spec)
    assert spec["kind"] == "k8s.gpu.nvidia.com/claim"
    assert spec["cdiVersion"] == "0.3.0"
    gpu_entry, mig_entry = spec["devices"]
    assert gpu_entry == {
        "name": f"{UID_LETTER}-gpu-0",
        "containerEdits": {
            "deviceNodes": [{"path": "/dev/nvidia0", "type": "c", "major": 195, "minor": 0}]
        },
    }
    assert mig_entry["name"] == f"{UID_LETTER}-gpu-1-mig-1g10gb-19-3"
    assert mig_entry["containerEdits"]["deviceNodes"] == [
        {"path": "/dev/nvidia1", "type": "c", "major": 195, "minor": 1},
        {"path": "/dev/nvidia-caps/nvidia-cap39", "type": "c", "major": 508, "minor": 39},
        {"path": "/dev/nvidia-caps/nvidia-cap40", "type": "c", "major": 508, "minor": 40},
    ]
    assert cdi.claim_device_id(DRIVER, UID_LETTER, "gpu-0") == (
        f"k8s.gpu.nvidia.com/claim={UID_LETTER}-gpu-0"
    )


def test_claim_device_starting_with_a_digit_needs_cdi_0_5() -> None:
    spec = cdi.claim_spec(DRIVER, UID_DIGIT, [MIG])
    assert spec["cdiVersion"] == "0.5.0"
    assert_valid_cdi_spec(spec)


def test_schema_check_catches_mistakes() -> None:
    """The validator is not a rubber stamp: broken documents fail it."""
    spec = cdi.claim_spec(DRIVER, UID_LETTER, [MIG])
    broken: dict[str, Any] = json.loads(json.dumps(spec))
    broken["devices"][0]["containerEdits"]["deviceNodes"][1]["major"] = "508"
    del broken["devices"][0]["containerEdits"]["deviceNodes"][0]["path"]
    broken["cdiVersion"] = "0.8.0"
    found = cdi_problems(broken)
    assert len(found) == 3, found
    assert cdi_problems({**spec, "devices": [{"name": "x", "containerEdits": {}}]})


def _spec(**edits: Any) -> dict[str, Any]:
    return {
        "kind": "k8s.gpu.nvidia.com/claim",
        "devices": [{"name": "dev", "containerEdits": edits}],
    }


@pytest.mark.parametrize(
    ("spec", "version"),
    [
        (_spec(deviceNodes=[{"path": "/dev/x", "type": "c", "major": 1, "minor": 2}]), "0.3.0"),
        (_spec(env=["A=B"]), "0.3.0"),
        (_spec(mounts=[{"hostPath": "/a", "containerPath": "/b", "type": "bind"}]), "0.4.0"),
        (_spec(deviceNodes=[{"path": "/dev/x", "hostPath": "/dev/y"}]), "0.5.0"),
        ({**_spec(), "devices": [{"name": "0dev", "containerEdits": {}}]}, "0.5.0"),
        ({**_spec(), "annotations": {"a": "b"}}, "0.6.0"),
        ({**_spec(), "devices": [{"name": "d", "annotations": {"a": "b"}}]}, "0.6.0"),
        ({**_spec(), "kind": "vendor.com/class.sub"}, "0.6.0"),
        (_spec(additionalGIDs=[5]), "0.7.0"),
        ({**_spec(), "containerEdits": {"intelRdt": {"closID": "x"}}}, "0.7.0"),
    ],
)
def test_minimum_version_table(spec: dict[str, Any], version: str) -> None:
    assert cdi.minimum_version(spec) == version


@pytest.mark.parametrize(
    "uid",
    [
        "../../etc",
        "",
        "3F2A1B4C-5D6E-4F70-8192-A3B4C5D6E7F8",  # not canonical: upper case
        "3f2a1b4c5d6e4f708192a3b4c5d6e7f8",
        "3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8/../x",
        "3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8\n",
    ],
)
def test_claim_uid_must_be_a_canonical_uuid(uid: str) -> None:
    with pytest.raises(cdi.InvalidClaimUidError, match="not a canonical lowercase UUID"):
        cdi.claim_spec_file_name(DRIVER, uid)
    with pytest.raises(cdi.InvalidClaimUidError):
        cdi.claim_spec(DRIVER, uid, [cdi.ClaimDevice("gpu-0", 0)])
    with pytest.raises(cdi.InvalidClaimUidError):
        cdi.claim_device_id(DRIVER, uid, "gpu-0")


def test_file_names() -> None:
    name = cdi.claim_spec_file_name(DRIVER, UID_DIGIT)
    assert name == f"k8s.gpu.nvidia.com-claim_{UID_DIGIT}.json"
    assert cdi.claim_uid_of_spec_file(DRIVER, name) == UID_DIGIT
    assert cdi.claim_uid_of_spec_file(DRIVER, "k8s.gpu.nvidia.com-claim_../x.json") is None
    assert cdi.claim_uid_of_spec_file(DRIVER, "k8s.gpu.nvidia.com-common.json") is None
    assert cdi.claim_uid_of_spec_file(DRIVER, f"k8s.other.com-claim_{UID_DIGIT}.json") is None
    assert cdi.claim_uid_of_spec_file(DRIVER, f"k8s.gpu.nvidia.com-claim_{UID_DIGIT}.yaml") is None
    with pytest.raises(cdi.CdiSpecError, match="driver name"):
        cdi.kind("GPU/../x")


def test_claim_spec_refuses_bad_input() -> None:
    with pytest.raises(cdi.CdiSpecError, match="no devices"):
        cdi.claim_spec(DRIVER, UID_DIGIT, [])
    with pytest.raises(cdi.CdiSpecError, match="twice"):
        cdi.claim_spec(DRIVER, UID_DIGIT, [cdi.ClaimDevice("gpu-0", 0)] * 2)
    with pytest.raises(cdi.CdiSpecError, match="cannot be part of a CDI device name"):
        cdi.claim_spec(DRIVER, UID_DIGIT, [cdi.ClaimDevice("gpu 0/..", 0)])


def test_encoding_is_stable() -> None:
    spec = cdi.claim_spec(DRIVER, UID_DIGIT, [MIG])
    assert cdi.encode_spec(spec) == cdi.encode_spec(json.loads(cdi.encode_spec(spec)))
    assert cdi.encode_spec(spec).endswith(b"}\n")


def test_missing_schema_fails_with_install_hint(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(cdi_schema, "SCHEMA_DIR", tmp_path / "absent")
    cdi_schema._validator.cache_clear()
    try:
        with pytest.raises(cdi_schema.CdiSchemaMissing, match=cdi_schema.DEBIAN_PACKAGE):
            assert_valid_cdi_spec(cdi.claim_spec(DRIVER, UID_DIGIT, [MIG]))
    finally:
        cdi_schema._validator.cache_clear()
    assert issubclass(cdi_schema.CdiSchemaMissing, AssertionError)  # a failure, never a skip


def test_common_spec_with_numbered_control_nodes_and_the_ldcache_hook() -> None:
    hook = cdi.ldcache_hook("/sbin/ldconfig", ["/usr/lib/x86_64-linux-gnu"])
    spec = cdi.common_spec(
        DRIVER,
        [cdi.DeviceNode("/dev/nvidiactl", type="c", major=195, minor=255)],
        [("/d/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1")],
        [hook],
    )
    assert_valid_cdi_spec(spec)
    assert spec["cdiVersion"] == "0.3.0"  # hooks are in every version
    edits = spec["devices"][0]["containerEdits"]
    assert edits["deviceNodes"] == [
        {"path": "/dev/nvidiactl", "type": "c", "major": 195, "minor": 255}
    ]
    assert edits["hooks"] == [hook]
    assert hook["hookName"] == "createContainer" and hook["path"] == "/bin/sh"
    assert hook["args"][-2:] == ["/sbin/ldconfig", "/usr/lib/x86_64-linux-gnu"]
    # no mounts: nothing for ldconfig to find, so no hook either
    alone = cdi.common_spec(DRIVER, ["/dev/nvidiactl"], [], [hook])
    assert "hooks" not in alone["devices"][0]["containerEdits"]
    with pytest.raises(cdi.CdiSpecError, match="not absolute"):
        cdi.ldcache_hook("ldconfig", [])
