"""The read-only hardware check (``python -m agent.hwcheck``) against simulated hosts, and
without any NVML library."""

from __future__ import annotations

import pytest

from agent import hwcheck as smoke


def test_smoke_on_simulated_host(capsys: pytest.CaptureFixture[str]) -> None:
    assert smoke.main(["--simulate", "dgx-h100"]) == 0
    out = capsys.readouterr().out
    assert "8 GPU(s)" in out and "NVIDIA H100 80GB HBM3" in out
    assert out.count("registered events 0xb") == 8
    assert "event set freed" in out
    assert "ResourceSlices: 1 slice(s), 8 device(s), within the API limits" in out


def test_smoke_builds_split_slices_for_a_large_host(capsys: pytest.CaptureFixture[str]) -> None:
    assert smoke.main(["--simulate", "big-mig-host"]) == 0
    assert "ResourceSlices: 2 slice(s), 168 device(s)" in capsys.readouterr().out


def test_smoke_without_driver(capsys: pytest.CaptureFixture[str]) -> None:
    assert smoke.main([]) == 2
    assert "libnvidia-ml.so.1" in capsys.readouterr().err


def test_smoke_with_unknown_profile(capsys: pytest.CaptureFixture[str]) -> None:
    assert smoke.main(["--simulate", "no-such-host"]) == 2
    assert "unknown simulated host profile" in capsys.readouterr().err
