"""Every kind of claim, prepared by the real agent, run by a real container runtime.

``make test-runtime`` (marked ``runtime``; the default run deselects it): it needs root, for
rootful podman and for the simulated host's device nodes (made with mknod). The agent runs on
simulated hosts (``dgx-h100`` with dynamic MIG, consumable shares and device metadata;
``dgx-a100`` with static MIG instances; a ``gb200-nvl72-tray`` in a ComputeDomain) and
prepares claims through the kubelet emulator, as in the integration tests. Then podman,
through the CDI library it is built with, resolves exactly the CDI ids the kubelet got for a
claim (``--device k8s.gpu.nvidia.com/claim=...``), and a probe inside the container prints
what it sees (:mod:`tests.runtime.container`). What it must see comes from the agent's
checkpoint and the simulated host, not from the spec (:mod:`tests.runtime.checks`); each
check is shown to fail on a spec broken on purpose for it.
"""

from __future__ import annotations

import json
import shutil
import statistics
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.dra import cdi
from agent.imex.cdi import channel_path
from agent.imex.config import DRIVER as CD_DRIVER
from agent.imex.wiring import SIM_CHANNELS_MAJOR
from agent.metadata.document import container_file
from agent.node.checkpoint import PreparedDevice, from_dict
from agent.sim.kubelet import ClaimRef
from tests.integration.compute_domains import TRAY, running_cluster
from tests.integration.harness import DRIVER, AgentHarness, cluster, gpu_request
from tests.integration.test_mig import mig_request
from tests.integration.test_shares import share_request
from tests.integration.test_sharing import MPS, TIME_SLICING_LONG
from tests.integration.test_sharing import running as running_agent
from tests.runtime.checks import Expected, problems
from tests.runtime.container import ContainerFailed, Podman, View

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]

GPU_ARGS = ("--dynamic-mig", "true", "--consumable-shares", "memory", "--device-metadata", "true")
COMMON_ID = cdi.common_device_id(DRIVER)
#: What each claim of the dgx-h100 agent asks for: (request, its config).
GPU_KINDS: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {
    "whole GPU": (gpu_request(), []),
    "dynamic MIG": (mig_request("1g.10gb"), []),
    "MPS": (gpu_request(), MPS),
    "time-slicing": (gpu_request(), TIME_SLICING_LONG),
}
SHARE = "consumable share"
STATIC_MIG = "static MIG"
CHANNEL = "IMEX channel"
MPS_ENV = {
    "CUDA_MPS_PIPE_DIRECTORY": cdi.MPS_PIPE_PATH,
    "CUDA_MPS_LOG_DIRECTORY": cdi.MPS_LOG_PATH,
}


@dataclass
class Prepared:
    """One prepared claim: the CDI ids the kubelet got, where their specs are, and what its
    container must see."""

    ref: ClaimRef
    device_ids: list[str]
    cdi_dir: Path
    expected: Expected


def _expected(devices: list[PreparedDevice], files: dict[str, list[str]]) -> Expected:
    """From the agent's checkpoint record of a claim: its GPUs' minors, MIG capability
    numbers and MPS environment."""
    expected = Expected(gpu_minors={d.gpu_minor for d in devices}, files=dict(files))
    for device in devices:
        if device.mig is not None:
            for minor in (device.mig.gi_cap_minor, device.mig.ci_cap_minor):
                path = f"/dev/nvidia-caps/nvidia-cap{minor}"
                expected.caps[path] = (device.mig.caps_major, minor)
        if device.mps is not None:
            expected.env.update(MPS_ENV)
            expected.directories.add(cdi.MPS_PIPE_PATH)
    return expected


def _checkpoint(harness: AgentHarness) -> dict[str, list[PreparedDevice]]:
    document = json.loads(harness.checkpoint_path.read_text())
    return {uid: list(claim.devices) for uid, claim in from_dict(document).claims.items()}


async def _prepare(harness: AgentHarness, kinds: dict[str, Any]) -> dict[str, Prepared]:
    """Allocate and prepare one claim per kind (name -> (request, config)); the kubelet's
    answers and the checkpoint make each one's :class:`Prepared`."""
    refs = {}
    for number, (kind, (request, config)) in enumerate(kinds.items()):
        refs[kind], _ = await harness.allocate(request, name=f"claim-{number}", config=config)
    answers = await harness.prepare(*refs.values())
    records = _checkpoint(harness)
    prepared = {}
    for kind, ref in refs.items():
        answer = answers[ref.uid]
        assert answer.error == "", (
            f"{kind}: {answer.error}\n{harness.agent and harness.agent.log()}"
        )
        ids = [i for device in answer.devices for i in device.cdi_device_ids]
        assert COMMON_ID in ids, ids
        files = {}
        for request in {r for device in answer.devices for r in device.request_names}:
            if any("/metadata=" in i for i in ids):  # --device-metadata: the KEP-5304 file
                path = container_file(DRIVER, ref.name, request, None)
                files[path] = [ref.uid, *(d.device_name for d in answer.devices)]
        expected = _expected(records[ref.uid], files)
        prepared[kind] = Prepared(ref, ids, harness.cdi_root, expected)
    return prepared


@pytest.fixture(scope="module")
async def gpu_claims(workdir: Path, podman: Podman) -> AsyncIterator[dict[str, Prepared]]:
    """A dgx-h100 agent's claims, prepared: one of each kind of GPU_KINDS and a consumable
    share (pinned to the last GPU, so the allocator's first fit leaves it free)."""
    async with cluster(workdir / "gpu") as harness:
        await running_agent(harness, args=GPU_ARGS)
        uuid = await harness.device_attribute("gpu-7", "uuid")
        kinds = {**GPU_KINDS, SHARE: (share_request("20Gi", uuid), TIME_SLICING_LONG)}
        prepared = await _prepare(harness, kinds)
        try:
            yield prepared
        finally:
            await harness.delete_claims()


@pytest.fixture(scope="module")
async def static_mig(workdir: Path, podman: Podman) -> AsyncIterator[Prepared]:
    """A claim for a MIG device that exists before the agent starts (dgx-a100's layouts)."""
    async with cluster(workdir / "a100") as harness:
        await harness.start_agent(args=("--simulate", "dgx-a100"))  # the last one counts
        prepared = await _prepare(harness, {STATIC_MIG: (mig_request("1g.10gb"), [])})
        try:
            yield prepared[STATIC_MIG]
        finally:
            await harness.delete_claims()


@pytest.fixture(scope="module")
async def channel(workdir: Path, podman: Podman) -> AsyncIterator[Prepared]:
    """An IMEX channel claim of a one-tray ComputeDomain, prepared (its daemon READY)."""
    nodes = {"tray-0": (TRAY, "10.0.9.1")}
    async with running_cluster(workdir / "cd", nodes) as domains:
        tray = domains.nodes["tray-0"]
        domain = await domains.create_domain("cd-rt", num_nodes=1)
        ref = await domains.channel_claim(tray, "channel-claim", domain)
        answer = await domains.prepare(tray, ref)
        assert not answer["error"], f"{answer}\n{tray.log()}"
        ids = [i for device in answer["devices"] for i in device["cdi_device_ids"]]
        expected = Expected(gpu_minors=set(), channels={channel_path(0): (SIM_CHANNELS_MAJOR, 0)})
        try:
            # the tray's GPU driver writes its common spec in the same CDI directory
            yield Prepared(ref, [*ids, COMMON_ID], tray.root / "cdi", expected)
        finally:
            await domains.unprepare(tray, ref)
            await domains.delete_claims()


async def _run(
    podman: Podman, prepared: Prepared, cdi_dir: Path | None = None, *options: str
) -> View:
    return await anyio.to_thread.run_sync(
        podman.run,
        cdi_dir or prepared.cdi_dir,
        prepared.device_ids,
        list(prepared.expected.files),
        options,
    )


# -- each kind of claim, seen from inside its container ----------------------------------------


@pytest.mark.parametrize("kind", [*GPU_KINDS, SHARE])
async def test_a_gpu_claim_is_what_its_container_sees(
    podman: Podman, gpu_claims: dict[str, Prepared], kind: str
) -> None:
    prepared = gpu_claims[kind]
    view = await _run(podman, prepared)
    assert problems(view, prepared.expected) == [], view.output
    if kind == "dynamic MIG":
        assert len(prepared.expected.caps) == 2  # the GPU and compute instance
    if kind == "MPS":  # the daemon's pipe directory, as the agent made it on the host
        assert cdi.MPS_PIPE_PATH in view.directories
    assert prepared.expected.files, "--device-metadata: every claim has its metadata file"


async def test_a_read_only_root_file_system_gets_its_loader_cache_too(
    podman: Podman, gpu_claims: dict[str, Prepared]
) -> None:
    """The ldcache hook writes the container's cache before the runtime makes its root
    read-only (readOnlyRootFilesystem: true)."""
    prepared = gpu_claims["whole GPU"]
    view = await _run(podman, prepared, None, "--read-only")
    assert "ro" in _root_mount_options(view), view.output
    assert problems(view, prepared.expected) == [], view.output


def _root_mount_options(view: View) -> list[str]:
    for line in view.output.split("== mounts", 1)[1].splitlines():
        fields = line.split()
        if len(fields) > 5 and fields[4] == "/":
            return fields[5].split(",")
    raise AssertionError(f"no root mount in:\n{view.output}")


async def test_a_static_mig_claim_is_what_its_container_sees(
    podman: Podman, static_mig: Prepared
) -> None:
    view = await _run(podman, static_mig)
    assert len(static_mig.expected.caps) == 2
    assert problems(view, static_mig.expected) == [], view.output


async def test_an_imex_channel_is_a_character_device_in_its_container(
    podman: Podman, channel: Prepared
) -> None:
    view = await _run(podman, channel)
    assert problems(view, channel.expected) == [], view.output


async def test_a_container_sees_none_of_another_claims_devices(
    podman: Podman, gpu_claims: dict[str, Prepared]
) -> None:
    first, second = gpu_claims["whole GPU"], gpu_claims["dynamic MIG"]
    assert first.expected.gpu_minors.isdisjoint(second.expected.gpu_minors)
    for one, other in ((first, second), (second, first)):
        expected = _isolated(one.expected, other.expected)
        view = await _run(podman, one)
        assert problems(view, expected) == [], view.output


def _isolated(expected: Expected, other: Expected) -> Expected:
    forbidden = {f"/dev/nvidia{m}" for m in other.gpu_minors} | set(other.caps)
    return Expected(**{**expected.__dict__, "forbidden": forbidden})


# -- every check fails on a spec broken for it ---------------------------------------------------


def _broken_copy(prepared: Prepared, workdir: Path, name: str) -> Path:
    target = workdir / "broken" / name.replace(" ", "-")
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(prepared.cdi_dir, target)
    return target


def _edit(cdi_dir: Path, file_part: str, change: Callable[[dict[str, Any]], None]) -> None:
    """Apply ``change`` to every containerEdits of the specs whose file name holds
    ``file_part``."""
    files = [p for p in cdi_dir.iterdir() if file_part in p.name]
    assert files, f"no spec named *{file_part}* in {cdi_dir}"
    for path in files:
        spec = json.loads(path.read_text())
        for device in spec["devices"]:
            change(device["containerEdits"])
        path.write_text(json.dumps(spec))


def _drop_nodes(prefix: str) -> Callable[[dict[str, Any]], None]:
    def change(edits: dict[str, Any]) -> None:
        edits["deviceNodes"] = [
            n for n in edits.get("deviceNodes", []) if not n["path"].startswith(prefix)
        ]
        if not edits["deviceNodes"]:
            del edits["deviceNodes"]

    return change


def _other_gpu(edits: dict[str, Any]) -> None:
    for node in edits.get("deviceNodes", []):
        if node["path"].startswith("/dev/nvidia") and node["path"][11:].isdigit():
            minor = int(node["path"][11:]) + 1
            node.update(path=f"/dev/nvidia{minor}", minor=minor)


def _drop(key: str) -> Callable[[dict[str, Any]], None]:
    def change(edits: dict[str, Any]) -> None:
        edits.pop(key, None)

    return change


def _mps_pipe_unmounted(edits: dict[str, Any]) -> None:
    edits["mounts"] = [
        m for m in edits.get("mounts", []) if m["containerPath"] != "/tmp/nvidia-mps"
    ]


def _moved_mounts(edits: dict[str, Any]) -> None:
    """Every mount somewhere else (dropping them would leave a device without edits, which
    the CDI library refuses along with every other spec of the directory)."""
    for mount in edits.get("mounts", []):
        mount["containerPath"] = "/elsewhere" + mount["containerPath"]


#: (kind, spec file part, the change, a problem it must cause)
BROKEN = [
    ("whole GPU", "-claim_", _other_gpu, "another GPU's node /dev/nvidia"),
    ("whole GPU", "-claim_", _other_gpu, "no GPU node /dev/nvidia"),
    ("whole GPU", "-common", _drop_nodes("/dev/nvidiactl"), "no control node /dev/nvidiactl"),
    ("whole GPU", "-common", _drop("hooks"), "ldconfig -p lists no libcuda.so.1"),
    ("whole GPU", "-common", _drop("mounts"), "ldconfig -p lists no libnvidia-ml.so.1"),
    ("dynamic MIG", "-claim_", _drop_nodes("/dev/nvidia-caps/"), "no MIG capability node"),
    ("MPS", "-claim_", _drop("env"), "environment CUDA_MPS_PIPE_DIRECTORY=None"),
    ("MPS", "-claim_", _mps_pipe_unmounted, "no directory /tmp/nvidia-mps"),
    ("whole GPU", "_metadata_", _moved_mounts, "dra-device-attributes"),
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
    broken = _broken_copy(prepared, workdir, f"{kind}-{problem}")
    _edit(broken, file_part, change)
    view = await _run(podman, prepared, broken)
    found = problems(view, prepared.expected)
    assert any(problem in p for p in found), found


async def test_the_channel_check_fails_without_the_channel_node(
    podman: Podman, channel: Prepared, workdir: Path
) -> None:
    broken = _broken_copy(channel, workdir, "channel")

    def another_channel(edits: dict[str, Any]) -> None:
        for node in edits["deviceNodes"]:
            node.update(path=channel_path(1), minor=1)

    _edit(broken, f"{CD_DRIVER}-claim_", another_channel)
    view = await _run(podman, channel, broken)
    assert f"no IMEX channel {channel_path(0)}" in problems(view, channel.expected)


async def test_the_isolation_check_fails_when_a_spec_adds_another_claims_gpu(
    podman: Podman, gpu_claims: dict[str, Prepared], workdir: Path
) -> None:
    first, second = gpu_claims["whole GPU"], gpu_claims["dynamic MIG"]
    [minor] = second.expected.gpu_minors
    broken = _broken_copy(first, workdir, "isolation")

    def add_gpu(edits: dict[str, Any]) -> None:
        node = {"path": f"/dev/nvidia{minor}", "type": "c", "major": 195, "minor": minor}
        edits.setdefault("deviceNodes", []).append(node)

    _edit(broken, f"-claim_{first.ref.uid}", add_gpu)
    view = await _run(podman, first, broken)
    found = problems(view, _isolated(first.expected, second.expected))
    assert f"another claim's device /dev/nvidia{minor}" in found, found


async def test_without_the_driver_nodes_on_the_host_the_runtime_refuses(
    podman: Podman, gpu_claims: dict[str, Prepared], workdir: Path
) -> None:
    """A control node named by its path alone is read from the host: missing there, the
    runtime refuses the container (what the common spec would do on a host whose nodes
    the driver has not made), so the spec's numbers are what makes them."""
    prepared = gpu_claims["whole GPU"]
    broken = _broken_copy(prepared, workdir, "missing-host-node")

    def path_only(edits: dict[str, Any]) -> None:
        for node in edits.get("deviceNodes", []):
            if node["path"] == "/dev/nvidiactl":
                for key in ("type", "major", "minor"):
                    node.pop(key, None)
                node["hostPath"] = str(workdir / "no-such-node")

    _edit(broken, "-common", path_only)
    with pytest.raises(ContainerFailed, match="no-such-node"):
        await _run(podman, prepared, broken)


# -- time ---------------------------------------------------------------------------------------

STARTS = 10


async def test_container_start_with_and_without_the_claims_devices(
    podman: Podman,
    gpu_claims: dict[str, Prepared],
    workdir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """podman run's wall time, median of STARTS, interleaved: without CDI devices, with a
    claim's (the MIG claim: three device nodes, the driver's mounts, the ldcache hook), and
    with the same but no hook (what the hook costs)."""
    prepared = gpu_claims["dynamic MIG"]
    bare = Prepared(prepared.ref, [], prepared.cdi_dir, Expected(gpu_minors=set()))
    no_hook = _broken_copy(prepared, workdir, "no-hook")
    _edit(no_hook, "-common", _drop("hooks"))
    runs = {"without": (bare, None), "with": (prepared, None), "no hook": (prepared, no_hook)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(STARTS):
        for name, (which, cdi_dir) in runs.items():
            view = await _run(podman, which, cdi_dir)
            times[name].append(view.seconds)
            assert bool(view.libraries.get("libcuda.so.1")) == (name == "with")
            assert ("/dev/nvidiactl" in view.devices) == (which is prepared)
    ms = {name: statistics.median(values) * 1000 for name, values in times.items()}
    with capsys.disabled():
        print(
            f"\ncontainer start (podman run --rm, median of {STARTS}): without CDI devices "
            f"{ms['without']:.0f} ms; with a MIG claim's {ms['with']:.0f} ms "
            f"(+{ms['with'] - ms['without']:.0f} ms), of which the ldcache hook "
            f"{ms['with'] - ms['no hook']:.0f} ms"
        )


def test_the_probe_parses_what_it_prints() -> None:
    """The parser itself (no container): devices in hex, ldconfig's lines, files."""
    from tests.runtime.container import parse

    output = "\n".join(
        [
            "== dev",
            "/dev/nvidia3 character special file c3 3",
            "== dirs",
            "/tmp/nvidia-mps",
            "== env",
            "A=b=c",
            "== mounts",
            "1 2 0:3 / /proc rw - proc proc rw",
            "== ldconfig",
            "2 libs found in cache `/etc/ld.so.cache'",
            "\tlibcuda.so.1 (libc6,x86-64) => /usr/lib/x86_64-linux-gnu/libcuda.so.1",
            "== file /x",
            "hello",
            "== end",
        ]
    )
    view = parse(output)
    assert view.devices == {"/dev/nvidia3": ("character special file", 0xC3, 3)}
    assert view.env == {"A": "b=c"} and view.mounts == ["/proc"]
    assert view.libraries == {"libcuda.so.1": "/usr/lib/x86_64-linux-gnu/libcuda.so.1"}
    assert view.files == {"/x": "hello"} and view.directories == {"/tmp/nvidia-mps"}
    with pytest.raises(AssertionError, match="did not finish"):
        parse("== dev\n")
