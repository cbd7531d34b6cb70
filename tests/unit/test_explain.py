"""``gpu-dra-agent explain``: the real command line on a fitting and a non-fitting claim,
table and machine formats, and the exit codes (0 fits, 1 does not, 2 bad claim)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

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
    code, out, _ = await explain(str(bad), "--simulate", "dgx-h100")
    assert code == 1 and "type error at 1:53: no such overload: int.compareTo(quantity)" in out
    code, _, err = await explain(str(tmp_path / "missing.yaml"), "--simulate", "dgx-h100")
    assert code == 2 and "bad claim" in err
