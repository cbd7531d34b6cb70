"""``gpu-dra-agent explain``: the real command line on a fitting and a non-fitting claim,
table and machine formats, and the exit codes (0 fits, 1 does not, 2 the claim at fault)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
FOUR_H100 = ROOT / "examples" / "gpu-4x-h100-one-numa-nvlink.yaml"


async def explain(*args: str) -> tuple[int, str, str]:
    result = await anyio.run_process([sys.executable, "-m", "agent", "explain", *args], check=False)
    return result.returncode, result.stdout.decode(), result.stderr.decode()


@pytest.mark.anyio
async def test_a_fitting_claim_shows_the_allocation() -> None:
    code, out, _ = await explain(str(FOUR_H100), "--simulate", "dgx-h100", "--node", "n1")
    assert code == 0
    assert out.startswith("claim default/four-h100-one-numa-node on node n1: FITS")
    assert "0: gpu-0, gpu-1, gpu-2, gpu-3; 1: gpu-4, gpu-5, gpu-6, gpu-7" in out
    code, text, _ = await explain(
        str(FOUR_H100), "--simulate", "dgx-h100", "--node", "n1", "-o", "json"
    )
    report = json.loads(text)
    assert code == 0 and report["fits"] is True
    assert report["allocation"]["devices"]["results"] == [
        {"request": "gpus", "driver": "gpu.nvidia.com", "pool": "n1", "device": f"gpu-{i}"}
        for i in range(4)
    ]
    assert report["allocation"]["nodeSelector"]["nodeSelectorTerms"][0]["matchFields"][0][
        "values"
    ] == ["n1"]
    verdicts = [d["verdict"] for d in report["requests"][0]["devices"]]
    assert verdicts == ["allocated"] * 4 + ["candidate"] * 4


@pytest.mark.anyio
async def test_a_fitting_claim_says_which_device_first_fit_takes_and_where_it_is() -> None:
    """The scheduler does not score devices: the table and json say each allocated device's
    place in the published order (dgx-h100 without dynamic MIG: 8 whole GPUs in one slice,
    gpu-0 first) and what first fit went past before it."""
    args = (str(FOUR_H100), "--simulate", "dgx-h100", "--node", "n1")
    code, out, _ = await explain(*args)
    assert code == 0
    lines = out.splitlines()
    assert lines.index("first fit:") < lines.index(
        "allocation (-o yaml or --all: status.allocation as the scheduler writes it):"
    )
    assert lines.index("first fit:") > max(
        i for i, line in enumerate(lines) if line.startswith("constraint ")
    )
    slice_name = "00000-gpu.nvidia.com-n1-0"  # discover --simulate names it generateName + index
    assert (
        f"  gpus: gpu-0  device 1 of 8, slice {slice_name} position 1; "
        "before it: nothing the selectors choose"
    ) in lines
    assert (
        f"  gpus: gpu-1  device 2 of 8, slice {slice_name} position 2; "
        "before it: 1 taken by this request"
    ) in lines
    code, text, _ = await explain(*args, "-o", "json")
    first = json.loads(text)["firstFit"]
    assert [e["device"] for e in first] == [f"gpu-{i}" for i in range(4)]
    assert first[0] == {
        "request": "gpus",
        "device": "gpu-0",
        "pool": "n1",
        "driver": "gpu.nvidia.com",
        "order": 1,
        "of": 8,
        "slice": slice_name,
        "inSlice": 1,
        "before": {},
        "why": f"gpu-0 is device 1 of 8 in the order the node publishes (slice {slice_name}, "
        "position 1): first fit took it, the first device the request's selectors choose",
    }
    code, text, _ = await explain(*args, "-o", "yaml")
    assert yaml.safe_load(text)["firstFit"] == first
    code, out, _ = await explain(str(FOUR_H100), "--simulate", "h200-nvl-bridged")
    assert code == 1 and "first fit:" not in out
    code, text, _ = await explain(str(FOUR_H100), "--simulate", "h200-nvl-bridged", "-o", "json")
    assert json.loads(text)["firstFit"] == []


@pytest.mark.anyio
async def test_a_claim_that_does_not_fit_says_why_per_device(tmp_path: Path) -> None:
    code, out, _ = await explain(str(FOUR_H100), "--simulate", "h200-nvl-bridged")
    assert code == 1 and "DOES NOT FIT" in out
    assert "request:no (productName=NVIDIA H200 NVL)" in out
    assert "needs 4 device(s), 0 available (4 not selected)" in out
    code, text, _ = await explain(str(FOUR_H100), "--simulate", "h200-nvl-bridged", "-o", "yaml")
    report = yaml.safe_load(text)
    assert code == 1 and report["fits"] is False and report["allocation"] is None
    device = report["requests"][0]["devices"][0]
    assert device["verdict"] == "not selected"
    assert device["selectors"][1]["saw"] == {
        "attributes[gpu.nvidia.com].productName": "NVIDIA H200 NVL"
    }
    # 80Gi of memory on the L40S host: the capacity seen is in the report
    code, text, _ = await explain(
        str(ROOT / "examples" / "gpu-80gi-memory.yaml"), "--simulate", "l40s-pcie", "-o", "json"
    )
    saw = json.loads(text)["requests"][0]["devices"][0]["selectors"][1]["saw"]
    assert code == 1 and saw == {"capacity[gpu.nvidia.com].memory": "48Gi"}


@pytest.mark.anyio
async def test_a_bad_claim_exits_2_and_a_failing_selector_is_shown(tmp_path: Path) -> None:
    claim = yaml.safe_load_all(FOUR_H100.read_text()).__next__()
    claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"][
        "expression"
    ] = "device.driver =="
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(claim))
    code, _, err = await explain(str(bad), "--simulate", "dgx-h100")
    assert code == 2 and "syntax error at 1:17" in err
    selector = claim["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"][0]["cel"]
    selector["expression"] = (
        "device.attributes['gpu.nvidia.com'].nvlinkPeerCount.compareTo(quantity('4')) > 0"
    )
    bad.write_text(yaml.safe_dump(claim))
    # fails at run time on every device the class admits: the claim's fault (exit 2), and the
    # explanation is printed as for a claim that does not fit
    code, out, err = await explain(str(bad), "--simulate", "dgx-h100")
    assert code == 2 and "type error at 1:53: no such overload: int.compareTo(quantity)" in out
    assert "the claim is at fault: request gpus: its selector fails on every device" in err
    # on a host where only some devices reach the failing branch, it is not the claim's fault
    selector["expression"] = (
        "device.attributes['gpu.nvidia.com'].productName.startsWith('NVIDIA H100') || "
        "device.attributes['gpu.nvidia.com'].nvlinkPeerCount.compareTo(quantity('4')) > 0"
    )
    bad.write_text(yaml.safe_dump(claim))
    code, out, err = await explain(str(bad), "--simulate", "dgx-h100")
    assert code == 0 and "at fault" not in err, (out, err)
    code, _, err = await explain(str(tmp_path / "missing.yaml"), "--simulate", "dgx-h100")
    assert code == 2 and "bad claim" in err


@pytest.mark.anyio
async def test_both_machine_formats_for_a_fitting_and_a_non_fitting_claim() -> None:
    # fitting: yaml (json is above); not fitting: json (yaml is above); the same report
    fits = [str(FOUR_H100), "--simulate", "dgx-h100"]
    code, text, _ = await explain(*fits, "-o", "yaml")
    as_yaml = yaml.safe_load(text)
    assert code == 0 and as_yaml["fits"] is True
    assert [r["device"] for r in as_yaml["allocation"]["devices"]["results"]] == [
        f"gpu-{i}" for i in range(4)
    ]
    assert as_yaml == json.loads((await explain(*fits, "-o", "json"))[1])
    misfit = [str(FOUR_H100), "--simulate", "gb200-nvl72-tray"]
    code, text, _ = await explain(*misfit, "-o", "json")
    as_json = json.loads(text)
    assert code == 1 and as_json["fits"] is False and as_json["allocation"] is None
    assert as_json["reasons"] and {d["verdict"] for d in as_json["requests"][0]["devices"]} == {
        "not selected"
    }
    assert as_json == yaml.safe_load((await explain(*misfit, "-o", "yaml"))[1])


@pytest.mark.anyio
async def test_dynamic_mig_only_with_a_simulated_host(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text("")
    code, _, err = await explain(
        str(FOUR_H100), "--kubeconfig", str(kubeconfig), "--node", "n", "--dynamic-mig"
    )
    assert code == 2 and "--dynamic-mig goes with --simulate" in err


@pytest.mark.anyio
async def test_dynamic_mig_says_what_it_needs_when_the_build_cannot_partition(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import argparse

    import agent.dra
    from agent import explain as command

    def build_slices(devices: Any, *, node_name: str, driver_name: str) -> Any:
        raise AssertionError("not called")

    monkeypatch.setattr(agent.dra, "build_slices", build_slices)  # no counter_sets
    parser = argparse.ArgumentParser()
    command.configure_parser(parser)
    args = parser.parse_args([str(FOUR_H100), "--simulate", "dgx-h100", "--dynamic-mig"])
    assert await command.run(args) == 2
    assert "--dynamic-mig needs agent.dra.devices to build partitionable devices" in (
        capsys.readouterr().err
    )


def _can_partition() -> bool:
    from agent.explain import DynamicMigUnavailableError, dynamic_mig_builders

    try:
        dynamic_mig_builders()
    except DynamicMigUnavailableError:
        return False
    return True


@pytest.mark.anyio
@pytest.mark.skipif(not _can_partition(), reason="agent.dra cannot publish partitionable devices")
async def test_dynamic_mig_explains_mig_placements_and_their_counters(tmp_path: Path) -> None:
    mig = ROOT / "examples" / "mig-1g10gb.yaml"
    code, text, _ = await explain(str(mig), "--simulate", "dgx-h100", "-o", "json")
    assert code == 1  # MIG is off on dgx-h100: no MIG device without --dynamic-mig
    code, text, _ = await explain(str(mig), "--simulate", "dgx-h100", "--dynamic-mig", "-o", "json")
    report = json.loads(text)
    assert code == 0, text
    [result] = report["allocation"]["devices"]["results"]
    assert result["device"].startswith("gpu-0-mig-1g10gb-")
    # a whole GPU and a MIG device of that same GPU cannot both be had: 8 GPUs + 1 MIG
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "all-and-one-more", "namespace": "default"},
        "spec": {
            "devices": {
                "requests": [
                    {"name": "gpus", "exactly": {"deviceClassName": "gpu.nvidia.com", "count": 8}},
                    {"name": "mig", "exactly": {"deviceClassName": "mig.nvidia.com"}},
                ]
            }
        },
    }
    path = tmp_path / "claim.yaml"
    path.write_text(yaml.safe_dump(claim))
    code, text, _ = await explain(
        str(path), "--simulate", "dgx-h100", "--dynamic-mig", "-o", "json"
    )
    report = json.loads(text)
    assert code == 1 and report["fits"] is False
    assert any("exceed the shared counters" in r for r in report["reasons"]), report["reasons"]
    code, table, _ = await explain(str(path), "--simulate", "dgx-h100", "--dynamic-mig")
    assert code == 1 and "together exceed the shared counters" in table


def test_counters_another_claim_exhausted_and_blocking_taints_are_reported() -> None:
    from agent.dra.allocator import allocate, build_node_state, parse_claim
    from agent.dra.allocator import explain as report_of
    from agent.explain import render_table
    from tests.unit.dra.test_allocator import (
        CLASSES,
        NODE,
        allocated_claim,
        claim,
        exactly,
        partitions,
    )

    slices = partitions()  # gpu-0 (80Gi, both slices) and two 40Gi halves, one counter set
    taint = {"key": "gpu.nvidia.com/xid", "value": "79", "effect": "NoExecute"}
    slices[1]["spec"]["devices"][2]["taints"] = [taint]
    state = build_node_state(NODE, slices, [allocated_claim("gpu-0-half-0")])
    parsed = parse_claim(claim(exactly("r")), CLASSES)
    report = report_of(parsed, state, allocate(parsed, state))
    assert report["fits"] is False
    by_name = {d["device"]: d for d in report["requests"][0]["devices"]}
    assert by_name["gpu-0-half-0"]["allocatedTo"] == "default/other"
    exhausted = [c for c in by_name["gpu-0"]["counters"] if c["exhausted"]]
    assert {(c["counter"], c["needs"], c["available"]) for c in exhausted} >= {
        ("slice-0", 1, 0),
        ("memory", 85899345920, 42949672960),
    }
    assert by_name["gpu-0-half-1"]["taints"] == [{**taint, "blocks": True}]
    assert json.loads(json.dumps(report)) == report  # JSON-ready as it is
    table = render_table(report, all_devices=True)  # --all: every counter of every device
    assert "allocated to default/other" in table
    assert "counter gpu-0-counters/slice-0: needs 1, 0 left" in table
    assert "taint gpu.nvidia.com/xid=79:NoExecute (blocks)" in table
    assert "why it does not fit:" in table
    table = render_table(report)  # by default: one reason per device, counters per set
    assert "allocated to default/other" in table
    assert "counter set gpu-0-counters exhausted: " in table and " and 1 more" in table
    assert "counter gpu-0-counters/slice-0" not in table
    assert "taint gpu.nvidia.com/xid=79:NoExecute" in table
    assert "why it does not fit:" in table


@pytest.mark.anyio
@pytest.mark.skipif(not _can_partition(), reason="agent.dra cannot publish partitionable devices")
async def test_the_demos_third_4_gpu_claim_on_a_dynamic_mig_host_reads_in_40_lines(
    tmp_path: Path,
) -> None:
    """The demo's claims (one GPU, then 4 H100s on one NUMA node) allocated on a dynamic-MIG
    dgx-h100 in an API server, then a third 4-GPU claim explained against it: the table fits a
    screen (40 lines of at most 160 characters) and still says why each GPU is out; ``--all``
    lists all 208 devices."""
    from agent.demo.claims import CLAIM_SPECS
    from agent.discover import name_for_preview
    from agent.dra import build_device_set, build_slices
    from agent.dra.partitionable import DynamicMig
    from agent.hardware.discovery import discover_host
    from agent.sim.allocation import ApiAccess, claim_from_request, create_and_allocate_claim
    from agent.sim.apiserver import EmbeddedApiServer
    from agent.sim.deviceclasses import default_device_classes

    node = "gpu-node"
    inventory = await discover_host("dgx-h100", tmp_path / "host")
    device_set = build_device_set(inventory, dynamic_mig=DynamicMig())
    slices = build_slices(
        device_set.devices,
        node_name=node,
        driver_name="gpu.nvidia.com",
        counter_sets=device_set.counter_sets,
    )
    async with EmbeddedApiServer() as server:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        for obj in [*default_device_classes(), *name_for_preview(slices)]:
            server.put_object(obj)
        access = ApiAccess(server.url, server.token)
        request, constraints = CLAIM_SPECS["four-gpus"]
        for name, (spec, rules) in CLAIM_SPECS.items():
            manifest = claim_from_request(name, spec, namespace="default", constraints=rules)
            await create_and_allocate_claim(access, manifest, node)
        third = claim_from_request(
            "four-more", request, namespace="default", constraints=constraints
        )
        path = tmp_path / "four-more.yaml"
        path.write_text(yaml.safe_dump(third))
        kubeconfig = server.write_kubeconfig(tmp_path / "kubeconfig")
        args = [str(path), "--kubeconfig", str(kubeconfig), "--node", node]
        code, out, err = await explain(*args)
        assert code == 1, err
        lines = out.splitlines()
        assert len(lines) <= 40 and max(len(line) for line in lines) <= 160, out
        gpus = {line.split()[0]: line for line in lines if line.startswith("  gpu-")}
        assert sorted(gpus) == [f"gpu-{i}" for i in range(8)], out
        in_use = [g for g, line in gpus.items() if "in use" in line]
        assert len(in_use) == 5, out  # one-gpu's GPU and four-gpus' four
        assert all("allocated to default/" in gpus[g] for g in in_use), out
        assert "not shown: 200 device(s) of other classes than gpu.nvidia.com" in out
        assert "why it does not fit:" in out
        code, every, _ = await explain(*args, "--all")
        assert code == 1
        names = {line.split()[0] for line in every.splitlines() if line.startswith("  gpu-")}
        assert len(names) == 208


def share_claim(tmp_path: Path, memory: str) -> str:
    request = {
        "name": "gpu",
        "exactly": {
            "deviceClassName": "gpu.nvidia.com",
            "capacity": {"requests": {"memory": memory}},
        },
    }
    claim = {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": "share", "namespace": "default"},
        "spec": {"devices": {"requests": [request]}},
    }
    path = tmp_path / f"share-{memory}.yaml"
    path.write_text(yaml.safe_dump(claim))
    return str(path)


@pytest.mark.anyio
async def test_consumable_shares_on_a_simulated_host(tmp_path: Path) -> None:
    small = share_claim(tmp_path, "20Gi")
    args = ("--simulate", "dgx-h100", "--consumable-shares", "memory")
    code, out, _ = await explain(small, *args)
    assert code == 0 and "capacity memory: 80Gi left, needs 20Gi" in out
    code, text, _ = await explain(small, *args, "-o", "json")
    [result] = json.loads(text)["allocation"]["devices"]["results"]
    assert result["consumedCapacity"] == {"memory": "20Gi"} and len(result["shareID"]) == 36
    # not shared: no shareID, and more memory than a GPU has fits no device
    code, text, _ = await explain(small, "--simulate", "dgx-h100", "-o", "json")
    assert code == 0 and "shareID" not in json.loads(text)["allocation"]["devices"]["results"][0]
    code, text, _ = await explain(share_claim(tmp_path, "81Gi"), *args, "-o", "json")
    assert code == 1
    assert {d["verdict"] for d in json.loads(text)["requests"][0]["devices"]} == {"capacity policy"}
    code, _, err = await explain(small, "--simulate", "dgx-h100", "--consumable-shares", "all")
    assert code == 2 and "is not a consumable-shares mode" in err
