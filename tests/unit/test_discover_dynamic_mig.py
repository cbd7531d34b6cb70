"""``gpu-dra-agent discover --dynamic-mig``: partitionable devices and their counter sets."""

from __future__ import annotations

import pytest
import yaml

from agent.cli import main
from tests.support.k8s_schema import manifest_errors, pool_rule_errors


def discover(capsys: pytest.CaptureFixture[str], *args: str) -> str:
    code = main(["discover", "--node-name", "node-a", *args])
    out = capsys.readouterr().out
    assert code == 0, out
    return out


def test_table_shows_placements_and_counter_sets(capsys: pytest.CaptureFixture[str]) -> None:
    text = discover(capsys, "--simulate", "dgx-h100", "--dynamic-mig")
    rows = {line.split()[0]: line for line in text.splitlines() if line.startswith("gpu-")}
    assert len(rows) == 8 * 26
    assert rows["gpu-0"].endswith("capable, disabled, partitionable")
    assert rows["gpu-3-mig-3g40gb-9-4"].endswith("3g.40gb @4, slices 4-7, made on prepare")
    assert rows["gpu-3-mig-1g10gb-me-20-6"].endswith("1g.10gb+me @6, slice 6, made on prepare")
    assert (
        "counter set gpu-5-counter-set: multiprocessors 132, copy-engines 8, decoders 7, "
        "encoders 0, jpeg-engines 7, ofa-engines 1, memory 79Gi, 8 of 8 memory slices free"
    ) in text
    assert text.count("0 device(s), 8 counter set(s)") == 1  # split: counters-only slice


def test_table_of_static_instances_says_what_is_held_back(
    capsys: pytest.CaptureFixture[str],
) -> None:
    text = discover(capsys, "--simulate", "dgx-a100", "--dynamic-mig")
    assert "note: gpu-4: " in text and "--adopt-mig-instances" in text
    assert "counter set" not in text  # the static layouts leave nothing to carve
    adopted = discover(capsys, "--simulate", "dgx-a100", "--dynamic-mig", "--adopt-mig-instances")
    rows = [line.split()[0] for line in adopted.splitlines() if line.startswith("gpu-")]
    assert len(rows) == 8 * 25 and "gpu-0" not in rows  # Ampere, MIG on: placements only
    assert adopted.count("counter set gpu-") == 8


@pytest.mark.parametrize(("layout", "version"), [("combined", "1.34"), ("split", "1.35")])
def test_yaml_is_valid_for_its_layout(
    capsys: pytest.CaptureFixture[str], layout: str, version: str
) -> None:
    text = discover(
        capsys, "--simulate", "dgx-h100", "--dynamic-mig", "--slice-layout", layout, "-o", "yaml"
    )
    assert manifest_errors(text, version) == []
    docs = [d for d in yaml.safe_load_all(text) if d]
    assert pool_rule_errors(docs, version) == []
    assert sum(len(d["spec"].get("sharedCounters") or []) for d in docs) == 8
    assert len(docs) == (8 if layout == "combined" else 9)


def test_environment_turns_it_on(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPU_DRA_DYNAMIC_MIG", "true")
    text = discover(capsys, "--simulate", "h200-nvl-bridged")
    assert "gpu-0-mig-3g71gb-9-4" in text and "counter set gpu-0-counter-set" in text
