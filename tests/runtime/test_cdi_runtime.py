"""Every kind of claim, prepared by the real agent, run by a real container runtime.

``make test-runtime`` (marked ``runtime``; the default run deselects it): it needs root, for
rootful podman and for the simulated host's device nodes (made with mknod). The agent runs on
simulated hosts (``dgx-h100`` with dynamic MIG, consumable shares and device metadata;
``dgx-a100`` with static MIG instances; a ``gb200-nvl72-tray`` in a ComputeDomain) and
prepares claims through the kubelet emulator, as in the integration tests
(``tests/runtime/conftest.py``). Then podman, through the CDI library it is built with,
resolves exactly the CDI ids the kubelet got for a claim, and a probe inside the container
prints what it sees (:mod:`tests.runtime.container`). What it must see comes from the agent's
checkpoint and the simulated host, not from the spec (:mod:`tests.runtime.checks`);
``test_broken_specs.py`` shows each check failing on a spec broken for it.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest

from agent.dra import cdi
from tests.runtime.checks import Expected, problems
from tests.runtime.claims import (
    GPU_KINDS,
    SHARE,
    Prepared,
    broken_copy,
    drop,
    edit_specs,
    isolated,
    run_probe,
)
from tests.runtime.container import Podman, View

pytestmark = [pytest.mark.runtime, pytest.mark.anyio]

# -- each kind of claim, seen from inside its container ----------------------------------------


@pytest.mark.parametrize("kind", [*GPU_KINDS, SHARE])
async def test_a_gpu_claim_is_what_its_container_sees(
    podman: Podman, gpu_claims: dict[str, Prepared], kind: str
) -> None:
    prepared = gpu_claims[kind]
    view = await run_probe(podman, prepared)
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
    view = await run_probe(podman, prepared, None, "--read-only")
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
    view = await run_probe(podman, static_mig)
    assert len(static_mig.expected.caps) == 2
    assert problems(view, static_mig.expected) == [], view.output


async def test_an_imex_channel_is_a_character_device_in_its_container(
    podman: Podman, channel: Prepared
) -> None:
    view = await run_probe(podman, channel)
    assert problems(view, channel.expected) == [], view.output


async def test_a_container_sees_none_of_another_claims_devices(
    podman: Podman, gpu_claims: dict[str, Prepared]
) -> None:
    first, second = gpu_claims["whole GPU"], gpu_claims["dynamic MIG"]
    assert first.expected.gpu_minors.isdisjoint(second.expected.gpu_minors)
    for one, other in ((first, second), (second, first)):
        expected = isolated(one.expected, other.expected)
        view = await run_probe(podman, one)
        assert problems(view, expected) == [], view.output


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
    no_hook = broken_copy(prepared, workdir, "no-hook")
    edit_specs(no_hook, "-common", drop("hooks"))
    runs = {"without": (bare, None), "with": (prepared, None), "no hook": (prepared, no_hook)}
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(STARTS):
        for name, (which, cdi_dir) in runs.items():
            view = await run_probe(podman, which, cdi_dir)
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
