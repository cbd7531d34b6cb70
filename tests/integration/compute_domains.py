"""The simulated ComputeDomain cluster of the integration tests: agents on simulated nodes
(each with its own kubelet emulator and directories, one shared simulated NVLink fabric
directory), the controller, ComputeDomains and channel claims, all against one embedded API
server. Used by ``test_compute_domain.py`` and ``test_prometheus.py`` (a tray's IMEX metrics).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import Process

from agent.imex.config import DRIVER as CD_DRIVER
from agent.imex.daemon_files import CONFIG_FILE
from agent.node.cdi import CdiSpecDirectory
from agent.sim.allocation import (
    ApiAccess,
    create_and_allocate_claim,
    delete_claim,
    published_pool,
)
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import AllocatedDevice, OpaqueConfig, create_allocated_claim
from agent.sim.deviceclasses import default_device_classes
from agent.sim.kubelet import ClaimRef, EventKind, KubeletEmulator

TRAY = "gb200-nvl72-tray"
NAMESPACE = "default"
#: where the agents keep their ComputeDomainCliques (their --namespace default)
DRIVER_NAMESPACE = "gpu-dra-agent"
START_TIMEOUT = 40.0
READY_TIMEOUT_S = 4


class Node:
    """One simulated node: its agent process, its kubelet emulator and its directories."""

    def __init__(self, name: str, root: Path, kubelet: KubeletEmulator, profile: str) -> None:
        self.name = name
        self.root = root
        self.kubelet = kubelet
        self.profile = profile
        self.process: Process | None = None
        self.starts = 0

    @property
    def plugin_dir(self) -> Path:
        return self.root / "plugins" / CD_DRIVER

    @property
    def cdi(self) -> CdiSpecDirectory:
        return CdiSpecDirectory(self.root / "cdi", CD_DRIVER)

    def log(self) -> str:
        return "".join(
            (self.root / f"agent-{n}.log").read_text(errors="replace")
            for n in range(1, self.starts + 1)
        )

    def domain_dir(self, uid: str) -> Path:
        return self.plugin_dir / "domains" / uid

    def checkpoint(self) -> dict[str, Any]:
        try:
            claims: dict[str, Any] = json.loads((self.plugin_dir / "checkpoint.json").read_text())[
                "claims"
            ]
        except FileNotFoundError:
            return {}
        return claims


class Cluster:
    def __init__(self, workdir: Path, server: EmbeddedApiServer) -> None:
        self.workdir = workdir
        self.server = server
        self.kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
        self.api = ApiAccess(server.url, server.token)
        self.fabric = workdir / "fabric"
        self.nodes: dict[str, Node] = {}
        self.controller: Process | None = None
        self._claims: list[tuple[str, str]] = []

    @contextlib.asynccontextmanager
    async def node(
        self, name: str, profile: str = TRAY, address: str | None = None
    ) -> AsyncIterator[Node]:
        """A simulated node of ``profile``: its Node object in the API server (``address``
        as its InternalIP), its kubelet emulator and its directories under the work
        directory; the agent is not started."""
        manifest: dict[str, Any] = {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name}}
        if address:
            manifest["status"] = {"addresses": [{"type": "InternalIP", "address": address}]}
        self.server.put_object(manifest)
        root = self.workdir / name
        root.mkdir(parents=True, exist_ok=True)
        async with KubeletEmulator(
            root / "registry", node_name=name, poll_interval=0.05, api_access=self.api
        ) as kubelet:
            node = self.nodes[name] = Node(name, root, kubelet, profile)
            yield node

    async def start(
        self,
        node: Node,
        *,
        env: Mapping[str, str] | None = None,
        wait: bool = True,
        args: Sequence[str] = (),
    ) -> None:
        """Start ``node``'s agent (``args`` added to its command line); by default wait until
        its kubelet emulator has registered the ComputeDomain driver, the driver's engine has
        started (its "ready" log line) and its channel slice is in the API server."""
        node.starts += 1
        registered = len(node.kubelet.events(EventKind.REGISTERED, CD_DRIVER))
        command = [
            sys.executable, "-m", "agent", "run", "--simulate", node.profile,
            "--node-name", node.name, "--kubeconfig", str(self.kubeconfig),
            "--registrar-dir", str(node.root / "registry"),
            "--plugins-dir", str(node.root / "plugins"), "--cdi-root", str(node.root / "cdi"),
            "--sim-fabric-dir", str(self.fabric), "--health-monitoring", "false",
            "--imex-ready-timeout-seconds", str(READY_TIMEOUT_S),
            "--compute-domains", "on", *args,
        ]  # fmt: skip
        environ = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")}
        environ.update(env or {})
        with (node.root / f"agent-{node.starts}.log").open("wb") as log_file:
            node.process = await anyio.open_process(
                command, stdout=log_file, stderr=log_file, env=environ
            )
        if wait:
            try:
                await node.kubelet.wait_event(
                    EventKind.REGISTERED, CD_DRIVER, count=registered + 1, timeout=START_TIMEOUT
                )
            except TimeoutError:
                raise AssertionError(f"{node.name} did not register:\n{node.log()}") from None
            # registered before its engine starts and its slice is written: both too
            log = node.root / f"agent-{node.starts}.log"
            try:
                with anyio.fail_after(START_TIMEOUT):
                    while True:
                        if _said_ready(log.read_text(errors="replace"), CD_DRIVER):
                            break
                        await anyio.sleep(0.02)
                await published_pool(self.api, node.name, CD_DRIVER, timeout_s=START_TIMEOUT)
            except TimeoutError:
                raise AssertionError(
                    f"{node.name} did not start its engine:\n{node.log()}"
                ) from None

    async def stop(self, node: Node, signal_number: signal.Signals = signal.SIGTERM) -> int:
        process = node.process
        assert process is not None
        if process.returncode is None:
            process.send_signal(signal_number)
        with anyio.fail_after(20):
            return await process.wait()

    async def channel_claim(
        self, node: Node, name: str, domain: Mapping[str, Any], *, namespace: str = NAMESPACE
    ) -> ClaimRef:
        """A claim as the domain's ResourceClaimTemplate makes it, allocated on ``node``."""
        template = self.server.get_object(
            "resourceclaimtemplates",
            domain["spec"]["channel"]["resourceClaimTemplate"]["name"],
            domain["metadata"]["namespace"],
        )
        assert template is not None, "the controller made no ResourceClaimTemplate"
        manifest = {
            "apiVersion": "resource.k8s.io/v1",
            "kind": "ResourceClaim",
            "metadata": {"name": name, "namespace": namespace},
            "spec": template["spec"]["spec"],
        }
        self._claims.append((namespace, name))
        created = await create_and_allocate_claim(self.api, manifest, node.name)
        meta = created["metadata"]
        return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])

    async def hand_claim(self, node: Node, name: str, domain: Mapping[str, Any]) -> ClaimRef:
        """A channel claim with a hand-written allocation of ``node``'s channel-0 (no
        template, no allocator): what the scheduler writes only when the claim holding it was
        deallocated before the kubelet unprepared it (the node still serves that claim's
        domain); also a domain's claim where no controller runs."""
        config = OpaqueConfig(
            {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomainChannelConfig",
                "domainID": domain["metadata"]["uid"],
                "allocationMode": "Single",
            },
            driver=CD_DRIVER,
            requests=("channel",),
        )
        device = AllocatedDevice("channel", "channel-0", node.name, driver=CD_DRIVER)
        created = await create_allocated_claim(
            self.server.url,
            name,
            [device],
            namespace=domain["metadata"]["namespace"],
            configs=[config],
            node_name=node.name,
            device_class_name="compute-domain-default-channel.nvidia.com",
        )
        self._claims.append((domain["metadata"]["namespace"], name))
        meta = created["metadata"]
        return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])

    async def prepare(self, node: Node, claim: ClaimRef) -> dict[str, Any]:
        """The kubelet's NodePrepareResources for one claim, as a dict."""
        answer = (await node.kubelet.prepare(CD_DRIVER, [claim]))[claim.uid]
        devices = [
            {
                "device_name": d.device_name,
                "pool_name": d.pool_name,
                "cdi_device_ids": list(d.cdi_device_ids),
            }
            for d in answer.devices
        ]
        return {"error": answer.error, "devices": devices}

    async def unprepare(self, node: Node, claim: ClaimRef) -> dict[str, Any]:
        answer = (await node.kubelet.unprepare(CD_DRIVER, [claim]))[claim.uid]
        return {"error": answer.error}

    async def unprepare_leftovers(self) -> None:
        """Unprepare every claim a node's checkpoint still holds (running agents only)."""
        for node in self.nodes.values():
            if node.process is None or node.process.returncode is not None:
                continue
            for uid, entry in node.checkpoint().items():
                ref = ClaimRef(entry.get("namespace", NAMESPACE), uid, entry.get("name", ""))
                await self.unprepare(node, ref)

    def track_claim(self, namespace: str, name: str) -> None:
        """A claim the test made otherwise, deleted with the others after it."""
        self._claims.append((namespace, name))

    async def delete_claims(self) -> None:
        claims, self._claims = self._claims, []
        for namespace, name in claims:
            await delete_claim(self.api, namespace, name)

    def domain(self, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        found = self.server.get_object("computedomains", name, namespace)
        assert found is not None, f"ComputeDomain {namespace}/{name} is gone"
        return found

    async def create_domain(
        self, name: str, *, namespace: str = NAMESPACE, num_nodes: int = 0, mode: str = "Single"
    ) -> dict[str, Any]:
        """A ComputeDomain, once the controller has made its ResourceClaimTemplate."""
        self.put_domain(name, namespace=namespace, num_nodes=num_nodes, mode=mode)
        template = f"{name}-channel"
        await eventually(
            lambda: (
                self.server.get_object("resourceclaimtemplates", template, namespace) is not None
            ),
            what=f"the controller's ResourceClaimTemplate {template}",
        )
        return self.domain(name, namespace)

    def put_domain(
        self, name: str, *, namespace: str = NAMESPACE, num_nodes: int = 0, mode: str = "Single"
    ) -> dict[str, Any]:
        """A ComputeDomain as stored (without waiting for the controller: its channel claims
        are then made by :meth:`hand_claim`)."""
        return self.server.put_object(
            {
                "apiVersion": "resource.nvidia.com/v1beta1",
                "kind": "ComputeDomain",
                "metadata": {"name": name, "namespace": namespace},
                "spec": {
                    "numNodes": num_nodes,
                    "channel": {
                        "resourceClaimTemplate": {"name": f"{name}-channel"},
                        "allocationMode": mode,
                    },
                },
            }
        )


def _said_ready(log: str, driver: str) -> bool:
    """Whether an agent's JSON log says ``driver`` is ready (its engine started)."""
    for line in log.splitlines():
        if '"ready"' in line and driver in line:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if record.get("message") == "ready" and record.get("driver") == driver:
                return True
    return False


async def settled_members(
    cluster: Cluster, name: str, names: Sequence[str], namespace: str = NAMESPACE
) -> None:
    """Wait until the domain's ``status.nodes`` (the controller's copy of its cliques) names
    exactly ``names``."""

    def check() -> bool:
        nodes = (cluster.domain(name, namespace).get("status") or {}).get("nodes") or []
        return sorted(n["name"] for n in nodes) == sorted(names)

    await eventually(check, what=f"the members of {namespace}/{name} to be {list(names)}")


async def eventually(check: Any, *, what: str, timeout: float = 20.0) -> None:  # noqa: ASYNC109
    with anyio.move_on_after(timeout):
        while not check():  # noqa: ASYNC110 - files and API objects of other processes
            await anyio.sleep(0.1)
        return
    raise AssertionError(f"timed out waiting for {what}")


def imex_daemons(config: Path) -> list[int]:
    """Pids of running (simulated) IMEX daemons whose command line names ``config``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            state = (entry / "stat").read_text().split(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if state != "Z" and b"nvidia-imex" in cmdline and str(config).encode() in cmdline:
            found.append(int(entry.name))
    return found


async def stop_all(cluster: Cluster) -> None:
    """Stop every agent and the controller; kill the IMEX daemons a stopped agent leaves for
    the next one (those of a claim a failed test left prepared)."""
    for node in cluster.nodes.values():
        if node.process is not None and node.process.returncode is None:
            await cluster.stop(node)
        for config in (node.plugin_dir / "domains").glob(f"*/{CONFIG_FILE}"):
            for pid in imex_daemons(config):
                os.kill(pid, signal.SIGKILL)
    if cluster.controller is not None and cluster.controller.returncode is None:
        cluster.controller.terminate()
        await cluster.controller.wait()


async def start_controller(cluster: Cluster) -> None:
    log = (cluster.workdir / "controller.log").open("wb")
    cluster.controller = await anyio.open_process(
        [
            sys.executable, "-m", "agent", "controller", "--kubeconfig", str(cluster.kubeconfig),
            "--lease-namespace", "gpu-dra-agent", "--identity", "controller-0",
            "--resync-seconds", "0.2",
        ],
        stdout=log,
        stderr=log,
    )  # fmt: skip
    log.close()


@contextlib.asynccontextmanager
async def running_cluster(
    workdir: Path,
    nodes: Mapping[str, tuple[str, str]],
    *,
    max_in_flight: int | None = None,
    kubernetes_version: str | None = None,
) -> AsyncIterator[Cluster]:
    """The API server with the device classes, the controller and a started agent on each of
    ``nodes`` (name -> (profile, InternalIP)); at the end the agents, the IMEX daemons a
    stopped agent left (a failed test's) and the controller are stopped. ``max_in_flight``:
    the API server's limit (429 beyond it), else none; ``kubernetes_version``: the release it
    answers as (the server's default otherwise)."""
    options: dict[str, Any] = {} if max_in_flight is None else {"max_in_flight": max_in_flight}
    if kubernetes_version is not None:
        options["kubernetes_version"] = kubernetes_version
    async with EmbeddedApiServer(**options) as server, contextlib.AsyncExitStack() as stack:
        for device_class in default_device_classes():
            server.put_object(device_class)
        cluster = Cluster(workdir, server)
        try:
            for name, (profile, address) in nodes.items():
                await stack.enter_async_context(cluster.node(name, profile, address))
            await start_controller(cluster)
            async with anyio.create_task_group() as group:
                for node in cluster.nodes.values():
                    group.start_soon(cluster.start, node)
            yield cluster
        finally:
            await stop_all(cluster)
