"""Each check of the runtime test fails on a spec broken on purpose for it.

A copy of the agent's CDI directory is edited (:mod:`tests.runtime.claims`) and podman runs the
claim's container from it: the probe's view must show the problem the edit makes, so a check
that passed on a wrong spec would fail here. The claims are those of ``conftest.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from agent.imex.cdi import channel_path
from agent.imex.config import DRIVER as CD_DRIVER
from tests.runtime.checks import problems
from tests.runtime.claims import (
    Prepared,
    broken_copy,
    drop,
    drop_nodes,
    edit_specs,
    isolated,
    moved_mounts,
    mps_pipe_unmounted,
    other_gpu,
    run_probe,
)
from tests.runtime.container import ContainerFailed, Podman

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]


#: (kind, spec file part, the change, a problem it must cause)
BROKEN = [
    ("whole GPU", "-claim_", other_gpu, "another GPU's node /dev/nvidia"),
    ("whole GPU", "-claim_", other_gpu, "no GPU node /dev/nvidia"),
    ("whole GPU", "-common", drop_nodes("/dev/nvidiactl"), "no control node /dev/nvidiactl"),
    ("whole GPU", "-common", drop("hooks"), "ldconfig -p lists no libcuda.so.1"),
    ("whole GPU", "-common", drop("mounts"), "ldconfig -p lists no libnvidia-ml.so.1"),
    ("dynamic MIG", "-claim_", drop_nodes("/dev/nvidia-caps/"), "no MIG capability node"),
    ("MPS", "-claim_", drop("env"), "environment CUDA_MPS_PIPE_DIRECTORY=None"),
    ("MPS", "-claim_", mps_pipe_unmounted, "no directory /tmp/nvidia-mps"),
    ("whole GPU", "_metadata_", moved_mounts, "dra-device-attributes"),
]


@pytest.mark.parametrize(
    ("kind", "file_part", "change", "problem"),
    BROKEN,
    ids=[f"{kind}: {problem}" for kind, _, _, problem in BROKEN],
)
async def test_each_check_fails_on_a_spec_broken_for_it(
    podman: Podman,
    gpu_claims: dict[str, Prepared],
    workdir: Path,
    kind: str,
    file_part: str,
    change: Callable[[dict[str, Any]], None],
    problem: str,
) -> None:
    prepared = gpu_claims[kind]
    broken = broken_copy(prepared, workdir, f"{kind}-{problem}")
    edit_specs(broken, file_part, change)
    view = await run_probe(podman, prepared, broken)
    found = problems(view, prepared.expected)
    assert any(problem in p for p in found), found


async def test_the_channel_check_fails_without_the_channel_node(
    podman: Podman, channel: Prepared, workdir: Path
) -> None:
    broken = broken_copy(channel, workdir, "channel")

    def another_channel(edits: dict[str, Any]) -> None:
        for node in edits["deviceNodes"]:
            node.update(path=channel_path(1), minor=1)

    edit_specs(broken, f"{CD_DRIVER}-claim_", another_channel)
    view = await run_probe(podman, channel, broken)
    assert f"no IMEX channel {channel_path(0)}" in problems(view, channel.expected)


async def test_the_isolation_check_fails_when_a_spec_adds_another_claims_gpu(
    podman: Podman, gpu_claims: dict[str, Prepared], workdir: Path
) -> None:
    first, second = gpu_claims["whole GPU"], gpu_claims["dynamic MIG"]
    [minor] = second.expected.gpu_minors
    broken = broken_copy(first, workdir, "isolation")

    def add_gpu(edits: dict[str, Any]) -> None:
        node = {"path": f"/dev/nvidia{minor}", "type": "c", "major": 195, "minor": minor}
        edits.setdefault("deviceNodes", []).append(node)

    edit_specs(broken, f"-claim_{first.ref.uid}", add_gpu)
    view = await run_probe(podman, first, broken)
    found = problems(view, isolated(first.expected, second.expected))
    assert f"another claim's device /dev/nvidia{minor}" in found, found


async def test_without_the_driver_nodes_on_the_host_the_runtime_refuses(
    podman: Podman, gpu_claims: dict[str, Prepared], workdir: Path
) -> None:
    """A control node named by its path alone is read from the host: missing there, the
    runtime refuses the container (what the common spec would do on a host whose nodes
    the driver has not made), so the spec's numbers are what makes them."""
    prepared = gpu_claims["whole GPU"]
    broken = broken_copy(prepared, workdir, "missing-host-node")

    def path_only(edits: dict[str, Any]) -> None:
        for node in edits.get("deviceNodes", []):
            if node["path"] == "/dev/nvidiactl":
                for key in ("type", "major", "minor"):
                    node.pop(key, None)
                node["hostPath"] = str(workdir / "no-such-node")

    edit_specs(broken, "-common", path_only)
    with pytest.raises(ContainerFailed, match="no-such-node"):
        await run_probe(podman, prepared, broken)
