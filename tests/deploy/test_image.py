"""The container image, built by ``make image`` and run with podman as the DaemonSet runs it.

Marked ``image`` (``make test-image``; default runs deselect it): it needs root and Debian's
container tools (``make image-tools``), and a first build takes a few minutes. The build is
``scripts/build_image.sh``, which reuses an image built from the same inputs.

The container gets what the simulated overlay's DaemonSet gives the agent's container, read
from ``kubectl kustomize deploy/kubernetes/overlays/simulated``: its arguments, its environment
(downward API fields filled in), privileged mode, and every hostPath volume at its mountPath
with its read-only flag and mount propagation. This test's node differs from a real one in
three ways, all of them settings an operator has too:

- the kubelet's root directory is ``<workdir>/kubelet`` instead of ``/var/lib/kubelet``
  (kubelet ``--root-dir``): hostPath, mountPath and the environment's paths under it move
  there together, so the plugin socket the agent registers has the same path on both sides,
  as the kubelet needs; other hostPaths (the CDI root) are directories of the workdir;
- the API server is the embedded one on this host's loopback, reached with host networking and
  a kubeconfig mounted read-only (in a cluster: the pod's service account);
- the metrics port is a free one (host networking shares this machine's ports).

Driven from outside by the kubelet emulator: registration, one prepare (the CDI spec appears in
the host's CDI directory), one unprepare, metrics over the host network, then SIGTERM: exit
status 0, the registration socket removed, JSON log lines only.

Rootful podman with vfs storage, runc and cgroupfs (crun refuses this machine's hybrid cgroup
layout), and rlimits no higher than the caller's: a sandbox without CAP_SYS_RESOURCE cannot
raise them to podman's defaults.
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.dra import cdi
from agent.node.cdi import CdiSpecDirectory
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import AllocatedDevice, create_allocated_claim
from agent.sim.deviceclasses import default_device_classes
from agent.sim.kubelet import ClaimRef, EventKind, KubeletEmulator
from tests.deploy.conftest import ROOT, build

pytestmark = pytest.mark.image

IMAGE = "localhost/gpu-dra-agent:dev"
IMAGE_DIR = ROOT / ".cache" / "image"
NODE = "node-a"
DRIVER = "gpu.nvidia.com"
KUBELET_DIR = "/var/lib/kubelet"
KUBECONFIG_MOUNT = "/etc/gpu-dra-agent/kubeconfig"
TOOLS = ("mmdebstrap", "buildah", "podman", "runc")
BUILD_TIMEOUT = 1800.0
#: Creating the container copies the image's root filesystem (vfs storage): tens of seconds.
CREATE_TIMEOUT = 300.0
REGISTER_TIMEOUT = 60.0
STOP_TIMEOUT = 30.0
CONTAINER_PREFIX = "gpu-dra-agent-test-"


def _require_tools() -> None:
    """Missing tools (or not root): a failure under CI, a skip naming `make image-tools`
    elsewhere."""
    missing = [tool for tool in TOOLS if shutil.which(tool) is None]
    reason = ""
    if missing:
        reason = f"{', '.join(missing)} not installed: `make image-tools` installs them"
    elif os.geteuid() != 0:
        reason = "the image test runs rootful podman: run `make test-image` as root"
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)


def podman(*args: str) -> list[str]:
    """podman on the storage `make image` builds into (scripts/build_image.sh)."""
    return [
        "podman",
        "--root",
        str(IMAGE_DIR / "storage"),
        "--runroot",
        str(IMAGE_DIR / "run"),
        "--storage-driver",
        "vfs",
        "--runtime",
        "runc",
        "--cgroup-manager",
        "cgroupfs",
        "--events-backend",
        "file",
        *args,
    ]


@dataclass(frozen=True)
class Image:
    name: str
    size: int  # bytes, uncompressed
    build_seconds: float
    build_output: str


@pytest.fixture(scope="module")
def image() -> Image:
    _require_tools()
    started = time.monotonic()
    result = subprocess.run(
        [str(ROOT / "scripts" / "build_image.sh")],
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT,
        env={**os.environ, "IMAGE": IMAGE, "IMAGE_DIR": str(IMAGE_DIR)},
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    elapsed = time.monotonic() - started
    # containers an interrupted run left behind (each a full copy of the image under vfs)
    stale = subprocess.run(
        podman("ps", "--all", "--filter", f"name={CONTAINER_PREFIX}", "--format", "{{.ID}}"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    if stale:
        subprocess.run(podman("rm", "--force", *stale), capture_output=True, timeout=120)
    size = subprocess.run(
        podman("image", "inspect", "--format", "{{.Size}}", IMAGE),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return Image(IMAGE, int(size), elapsed, result.stdout)


@pytest.fixture
def workdir() -> Iterator[Path]:
    # short: the registration and DRA socket paths must fit in 107 bytes
    path = Path(tempfile.mkdtemp(prefix="gi-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def _agent_container(daemonset: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The agent's container and the pod's volumes by name."""
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return container, {v["name"]: v for v in pod.get("volumes", [])}


def _on_test_node(path: str, workdir: Path) -> str:
    """``path`` on this test's node, whose kubelet root directory is ``<workdir>/kubelet``."""
    if path == KUBELET_DIR or path.startswith(KUBELET_DIR + "/"):
        return str(workdir / "kubelet") + path.removeprefix(KUBELET_DIR)
    return path


def run_arguments(
    daemonset: dict[str, Any], workdir: Path, kubeconfig: Path, pod_uid: str, metrics_port: int
) -> tuple[list[str], list[str]]:
    """(podman run options, the container's arguments) for the DaemonSet's agent container."""
    container, volumes = _agent_container(daemonset)
    options = ["--network", "host"]
    if container.get("securityContext", {}).get("privileged"):
        options.append("--privileged")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    options += ["--ulimit", f"nofile={soft}:{hard}", "--ulimit", "nproc=4096:4096"]

    fields = {"spec.nodeName": NODE, "metadata.uid": pod_uid}
    env: dict[str, str] = {}
    for variable in container.get("env", []):
        if "valueFrom" in variable:
            env[variable["name"]] = fields[variable["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            env[variable["name"]] = _on_test_node(variable.get("value", ""), workdir)
    env["KUBECONFIG"] = KUBECONFIG_MOUNT
    for name, value in env.items():
        options += ["--env", f"{name}={value}"]

    propagation = {"Bidirectional": "rshared", "HostToContainer": "rslave"}
    for mount in container.get("volumeMounts", []):
        volume = volumes[mount["name"]]
        assert set(volume) == {"name", "hostPath"}, f"not a hostPath volume: {volume}"
        host_path = volume["hostPath"]["path"]
        if _on_test_node(host_path, workdir) != host_path:
            source, target = (
                _on_test_node(host_path, workdir),
                _on_test_node(mount["mountPath"], workdir),
            )
        else:
            source, target = str(workdir / volume["name"]), mount["mountPath"]
        Path(source).mkdir(parents=True, exist_ok=True)
        flags = ["ro" if mount.get("readOnly") else "rw"]
        if mount.get("mountPropagation") in propagation:
            flags.append(propagation[mount["mountPropagation"]])
        options += ["--volume", f"{source}:{target}:{','.join(flags)}"]
    options += ["--volume", f"{kubeconfig}:{KUBECONFIG_MOUNT}:ro"]

    def expand(argument: str) -> str:  # Kubernetes' $(VAR) references to the environment
        return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env[m[1]], argument)

    arguments = [expand(a) for a in container["args"]]
    arguments = [
        f"--metrics-address=0.0.0.0:{metrics_port}" if a.startswith("--metrics-address=") else a
        for a in arguments
    ]
    return options, arguments


async def _podman(*args: str, timeout: float = 60.0) -> str:  # noqa: ASYNC109
    with anyio.fail_after(timeout):
        result = await anyio.run_process(podman(*args), check=False)
    output = result.stdout.decode(errors="replace")
    assert result.returncode == 0, f"podman {' '.join(args)}: {result.stderr.decode()}"
    return output.strip()


async def _logs(container: str) -> str:
    result = await anyio.run_process(podman("logs", container), check=False)
    return (result.stdout + result.stderr).decode(errors="replace")


def _entries(directory: Path) -> list[str]:
    """The names in ``directory`` (blocking; tiny directories)."""
    return sorted(p.name for p in directory.iterdir())


def _is_socket(path: str) -> bool:
    return Path(path).is_socket()


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text: str = response.read().decode()
        return text


@pytest.mark.anyio
async def test_the_image_runs_as_the_daemonset_and_serves_the_kubelet(
    image: Image, workdir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    daemonset = next(
        o for o in build(ROOT / "deploy/kubernetes/overlays/simulated") if o["kind"] == "DaemonSet"
    )
    pod_uid = str(uuid.uuid4())
    metrics_port = _free_port()
    registry = Path(_on_test_node(f"{KUBELET_DIR}/plugins_registry", workdir))
    cdi_specs = CdiSpecDirectory(workdir / "cdi", DRIVER)
    name = f"{CONTAINER_PREFIX}{pod_uid[:8]}"
    container, _ = _agent_container(daemonset)
    probe = container["startupProbe"]["exec"]["command"]

    async with EmbeddedApiServer() as server:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        for device_class in default_device_classes():
            server.put_object(device_class)
        kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
        options, arguments = run_arguments(daemonset, workdir, kubeconfig, pod_uid, metrics_port)
        assert f"{workdir}/cdi:/var/run/cdi:rw" in options, options
        assert "GPU_DRA_SIMULATE=dgx-h100" in options, options

        async with KubeletEmulator(registry, node_name=NODE, poll_interval=0.05) as kubelet:
            created = time.monotonic()
            await _podman(
                "create", "--name", name, *options, image.name, *arguments, timeout=CREATE_TIMEOUT
            )
            try:
                started = time.monotonic()
                await _podman("start", name)
                start_returned = time.monotonic() - started
                try:
                    registered = await kubelet.wait_event(
                        EventKind.REGISTERED, DRIVER, timeout=REGISTER_TIMEOUT
                    )
                except TimeoutError:
                    pytest.fail(f"the container did not register:\n{await _logs(name)}")
                to_registration = registered.at - started

                [registration] = kubelet.registrations(DRIVER)
                plugin_dir = workdir / "kubelet" / "plugins" / DRIVER
                assert registration.endpoint == str(plugin_dir / f"dra-{pod_uid}.sock")
                assert _is_socket(registration.endpoint)  # made inside, seen outside
                # the startup probe, as the kubelet runs it: exec in the container
                await _podman("exec", name, *probe)

                created_claim = await create_allocated_claim(
                    server.url,
                    "claim-1",
                    [AllocatedDevice(request="gpu", device="gpu-0", pool=NODE)],
                    node_name=NODE,
                )
                ref = ClaimRef(
                    namespace="default", name="claim-1", uid=created_claim["metadata"]["uid"]
                )
                result = (await kubelet.prepare(DRIVER, [ref]))[ref.uid]
                assert result.error == ""
                [device] = result.devices
                assert device.device_name == "gpu-0"
                assert any(ref.uid in cdi_id for cdi_id in device.cdi_device_ids)
                # written inside the container, in the host's CDI directory (the runtime's view)
                assert cdi_specs.claim_uids() == {ref.uid}
                spec = json.loads(cdi_specs.claim_path(ref.uid).read_bytes())
                assert spec["kind"] == cdi.kind(DRIVER)

                assert (await kubelet.unprepare(DRIVER, [ref]))[ref.uid].error == ""
                assert cdi_specs.claim_uids() == set()

                metrics = await anyio.to_thread.run_sync(_scrape, metrics_port)
                assert re.search(r"^gpu_dra_claims_prepared_total\S* 1(\.0)?$", metrics, re.M), (
                    metrics
                )

                stopping = time.monotonic()
                await _podman("kill", "--signal", "TERM", name)
                status = int(await _podman("wait", name, timeout=STOP_TIMEOUT))
                stopped = time.monotonic() - stopping
                logs = await _logs(name)
                assert status == 0, logs
                await kubelet.wait_event(EventKind.DEREGISTERED, DRIVER, timeout=5)
            finally:
                await anyio.run_process(podman("rm", "--force", name), check=False)

    assert _entries(registry) == [], "the registration socket outlived the agent"
    records = [json.loads(line) for line in logs.splitlines() if line.strip()]
    messages = [r["message"] for r in records]
    assert "received SIGTERM; stopping" in messages, messages
    assert records[-1]["message"] == "stopped" and records[-1]["reason"] == "SIGTERM"
    assert not [r for r in records if r["level"] in ("error", "critical")], logs
    with capsys.disabled():
        print(
            f"\nimage {image.name}: {image.size / 1e6:.0f} MB, make image {image.build_seconds:.0f} s "
            f"({image.build_output.strip().splitlines()[-1]}); container create "
            f"{started - created:.1f} s, start to registration {to_registration:.2f} s "
            f"(podman start returned after {start_returned:.2f} s), "
            f"SIGTERM to exit {stopped:.2f} s"
        )
