"""The committed betterproto2 code must match what proto/ generates today."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_generated_code_is_up_to_date() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_proto.py"), "--check"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_routes_match_the_kubelet_contract() -> None:
    from agent.kubelet import api

    expected = {
        api.pluginregistration.RegistrationBase: {
            "/pluginregistration.Registration/GetInfo",
            "/pluginregistration.Registration/NotifyRegistrationStatus",
        },
        api.dra_v1.DraPluginBase: {
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin/NodeUnprepareResources",
        },
        api.dra_v1beta1.DraPluginBase: {
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodePrepareResources",
            "/k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin/NodeUnprepareResources",
        },
        api.health_v1alpha1.DraResourceHealthBase: {
            "/v1alpha1.DRAResourceHealth/NodeWatchResources"
        },
        api.health_v1.DraResourceHealthBase: {"/v1.DRAResourceHealth/NodeWatchResources"},
    }
    for base, routes in expected.items():
        assert set(base().__mapping__()) == routes


def test_field_numbers_match_the_kubelet_contract() -> None:
    """Spot checks of field numbers against kubelet-dra-protocol.md, encoded by hand."""
    from agent.kubelet import api

    device = api.dra_v1.Device(
        request_names=["r"], pool_name="p", device_name="d", cdi_device_ids=["c"], share_id="s"
    )
    # field 1..5, wire type 2 (length-delimited): tags 0x0a 0x12 0x1a 0x22 0x2a
    assert bytes(device) == bytes.fromhex("0a01721201701a01642201632a0173")
    health = api.health_v1alpha1.DeviceHealth(
        health=api.health_v1alpha1.HealthStatus.UNHEALTHY,
        last_updated_time=7,
        health_check_timeout_seconds=30,
        message="m",
    )
    # field 2 enum (0x10), 3 int64 (0x18), 4 int64 (0x20), 5 string (0x2a)
    assert bytes(health) == bytes.fromhex("10021807201e2a016d")
    info = api.pluginregistration.PluginInfo(
        type="t", name="n", endpoint="e", supported_versions=["v"]
    )
    assert bytes(info) == bytes.fromhex("0a017412016e1a0165220176")
