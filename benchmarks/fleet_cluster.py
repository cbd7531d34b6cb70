"""The fleet of ``make fleet``: processes and what the benchmark reads from them.

* the embedded API server, a process of its own (``gpu-dra-agent sim apiserver
  --max-in-flight``), so its CPU seconds are its own; the benchmark reads its request counts
  and the objects through its ``/debug/embedded/`` endpoints, which are not counted;
* the controller (``gpu-dra-agent controller``);
* N ``gpu-dra-agent run`` processes, each a simulated GB200 tray of its rack (its own Node
  object, plugins/CDI/registry directories, address ``127.0.<rack+1>.<tray+1>``), all sharing
  one simulated NVLink fabric directory;
* the kubelet side: one :class:`KubeletEmulator` per node, all in this process (one process
  drives every node).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import anyio
import yaml
from anyio.abc import Process

from agent.imex.config import DRIVER as CD_DRIVER
from agent.sim.allocation import ApiAccess, create_and_allocate_claim, published_pool
from agent.sim.deviceclasses import default_device_classes
from agent.sim.kubelet import ClaimRef, EventKind, KubeletEmulator
from agent.sim.racks import rack_profile, tray_address
from benchmarks.agent_process import agent_command, start_agent

NAMESPACE, DRIVER_NAMESPACE = "default", "gpu-dra-agent"
TRAYS_PER_RACK = 18
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass
class FleetNode:
    name: str
    rack: int
    address: str
    root: Path
    profile: Path
    kubelet: KubeletEmulator | None = None
    process: Process | None = None
    starts: int = 0

    @property
    def domains_dir(self) -> Path:
        return self.root / "plugins" / CD_DRIVER / "domains"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def cpu_with_children(pid: int) -> float:
    """CPU seconds of a process and of its children it has reaped (an agent's IMEX daemons
    and nvidia-imex-ctl runs)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return sum(int(f) for f in fields[11:15]) / CLK_TCK


def rss_mb(pid: int) -> float:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def imex_daemons(root: Path) -> dict[int, str]:
    """Live simulated IMEX daemons whose config is under ``root``: pid -> config."""
    found: dict[int, str] = {}
    prefix = str(root)
    for entry in Path("/proc").iterdir():
        if not entry.name.isdecimal():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            state = (entry / "stat").read_text().rsplit(") ", 1)[1][0]
        except (OSError, IndexError):
            continue
        if state == "Z" or "nvidia-imex" not in argv or "-c" not in argv[:-1]:
            continue
        config = argv[argv.index("-c") + 1]
        if config.startswith(prefix):
            found[int(entry.name)] = config
    return found


@dataclass
class Fleet:
    workdir: Path
    nodes_count: int
    cliques: int
    max_in_flight: int
    nodes: list[FleetNode] = field(default_factory=list)
    server: Process | None = None
    controller: Process | None = None
    url: str = ""
    kubeconfig: Path = Path()
    http: aiohttp.ClientSession | None = None
    #: the release the API server answers as (1.36: binding conditions on, agent.imex.binding)
    kubernetes_version: str = "1.35.0"
    #: more flags for every agent (a test's shorter --imex-ready-timeout-seconds)
    agent_args: tuple[str, ...] = ()

    # -- the API server's view (uncounted) ---------------------------------------------------

    async def debug(self, what: str, **params: str) -> Any:
        assert self.http is not None
        async with self.http.get(f"{self.url}/debug/embedded/{what}", params=params) as answer:
            answer.raise_for_status()
            return await answer.json()

    async def objects(self, kind: str, namespace: str = "", selector: str = "") -> list[Any]:
        found = await self.debug("objects", kind=kind, namespace=namespace, labelSelector=selector)
        return list(found["items"])

    async def counts(self) -> dict[tuple[str, str, int], int]:
        rows = (await self.debug("requests"))["counts"]
        return {(r["verb"], r["resource"], r["code"]): r["count"] for r in rows}

    def cpu(self) -> dict[str, float]:
        """CPU seconds so far: the agents (with their reaped daemons and tools), the API
        server, the controller, this process (the kubelet emulators); a difference of two
        readings says where a scenario's CPU went."""
        agents = sum(cpu_with_children(n.process.pid) for n in self.nodes if n.process)
        times = os.times()
        return {
            "agents": agents,
            "apiserver": cpu_seconds(self.server.pid) if self.server else 0.0,
            "controller": cpu_seconds(self.controller.pid) if self.controller else 0.0,
            "kubelets": times.user + times.system,
        }

    async def open_watches(self) -> int:
        return int((await self.debug("requests"))["openWatches"])

    async def shed(self, seconds: float, retry_after: int = 1) -> None:
        """Every request answered 429 with ``Retry-After`` for ``seconds`` from now."""
        assert self.http is not None
        params = {"seconds": str(seconds), "retryAfter": str(retry_after)}
        async with self.http.post(f"{self.url}/debug/embedded/shed", params=params) as answer:
            answer.raise_for_status()

    async def early_retries(self) -> list[dict[str, Any]]:
        """Requests a client sent again sooner than the ``Retry-After`` it was given."""
        return list((await self.debug("requests", earlyRetries="1"))["earlyRetries"])

    async def restart_server(self, down_seconds: float) -> None:
        assert self.http is not None
        url = f"{self.url}/debug/embedded/restart"
        async with self.http.post(url, params={"downSeconds": str(down_seconds)}) as answer:
            answer.raise_for_status()

    async def post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        assert self.http is not None
        async with self.http.post(self.url + path, json=body) as answer:
            result: dict[str, Any] = await answer.json()
            if answer.status >= 300:
                raise RuntimeError(f"POST {path}: {answer.status} {result.get('message')}")
            return result

    async def delete(self, path: str) -> None:
        assert self.http is not None
        async with self.http.delete(self.url + path) as answer:
            await answer.read()

    # -- processes ---------------------------------------------------------------------------

    async def start(self, stack: AsyncExitStack, *, shed_seconds: float = 0.0) -> None:
        """The API server, the Node objects and the kubelet emulators, then the controller;
        with ``shed_seconds`` the server answers every request 429 from before the
        controller's start on, for that long (the agents are started by the caller)."""
        self.http = await stack.enter_async_context(aiohttp.ClientSession())
        self.kubeconfig = self.workdir / "kubeconfig"
        log = (self.workdir / "apiserver.log").open("wb")
        self.server = await anyio.open_process(
            [sys.executable, "-m", "agent", "sim", "apiserver", "--listen", "127.0.0.1:0",
             "--kubeconfig-out", str(self.kubeconfig),
             "--max-in-flight", str(self.max_in_flight),
             "--kubernetes-version", self.kubernetes_version],
            stdout=log, stderr=log,
        )  # fmt: skip
        stack.push_async_callback(self._stop, self.server)
        config: Any = None
        with anyio.fail_after(30):
            while not isinstance(config, dict):  # another process writes it
                await anyio.sleep(0.1)
                if self.kubeconfig.exists():
                    config = yaml.safe_load(self.kubeconfig.read_text())
        self.url = config["clusters"][0]["cluster"]["server"]
        for device_class in default_device_classes():
            await self.post("/apis/resource.k8s.io/v1/deviceclasses", device_class)
        for index in range(self.nodes_count):
            rack, tray = divmod(index, self.per_rack)
            name = f"tray-r{rack}-t{tray:02}"
            node = FleetNode(
                name, rack, tray_address(rack, tray), self.workdir / name,
                rack_profile(self.workdir / "profiles", rack),
            )  # fmt: skip
            node.root.mkdir(parents=True, exist_ok=True)
            await self.post(
                "/api/v1/nodes",
                {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name},
                 "status": {"addresses": [{"type": "InternalIP", "address": node.address}]}},
            )  # fmt: skip
            node.kubelet = await stack.enter_async_context(
                KubeletEmulator(node.root / "registry", node_name=name, poll_interval=0.25)
            )
            self.nodes.append(node)
        stack.push_async_callback(self._stop_agents)
        if shed_seconds > 0:  # from the controller's first request on
            await self.shed(shed_seconds)
        log = (self.workdir / "controller.log").open("wb")
        self.controller = await anyio.open_process(
            [sys.executable, "-m", "agent", "controller", "--kubeconfig", str(self.kubeconfig),
             "--lease-namespace", DRIVER_NAMESPACE, "--identity", "controller-0",
             "--resync-seconds", "0.5"],
            stdout=log, stderr=log,
        )  # fmt: skip
        stack.push_async_callback(self._stop, self.controller)

    @property
    def per_rack(self) -> int:
        return -(-self.nodes_count // self.cliques)

    async def start_agent(self, node: FleetNode, *, wait: bool = True) -> None:
        assert node.kubelet is not None
        node.starts += 1
        registered = len(node.kubelet.events(EventKind.REGISTERED, CD_DRIVER))
        command = agent_command(
            node.root, self.kubeconfig, node.name, str(node.profile),
            "--node-ip", node.address, "--compute-domains", "on",
            "--health-monitoring", "false", "--sim-fabric-dir", str(self.workdir / "fabric"),
            *self.agent_args,
        )  # fmt: skip
        node.process = await start_agent(command, node.root / f"agent-{node.starts}.log")
        if wait:
            await self.wait_started(node, registered)

    async def wait_started(self, node: FleetNode, registered: int = 0) -> None:
        """Until ``node``'s agent registered the ComputeDomain driver (``registered`` times
        before) and published its channel slice; RuntimeError if it exits meanwhile."""
        process, kubelet = node.process, node.kubelet
        assert process is not None and kubelet is not None
        async with anyio.create_task_group() as group:

            async def exited() -> None:
                await process.wait()
                log = (node.root / f"agent-{node.starts}.log").read_text(errors="replace")
                raise RuntimeError(f"the agent of {node.name} exited at start:\n{log[-2000:]}")

            group.start_soon(exited)
            await kubelet.wait_event(
                EventKind.REGISTERED, CD_DRIVER, count=registered + 1, timeout=300
            )
            # it registers before its channel slice is written; allocation needs the slice
            await published_pool(
                ApiAccess(self.url, "embedded-apiserver-token"), node.name, CD_DRIVER, timeout_s=300
            )
            group.cancel_scope.cancel()

    async def kill_agent(self, node: FleetNode) -> None:
        assert node.process is not None
        node.process.send_signal(signal.SIGKILL)
        await node.process.wait()

    async def _stop_agents(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.returncode is None:
                node.process.terminate()
        for node in self.nodes:
            if node.process is not None:
                with anyio.move_on_after(20):
                    await node.process.wait()
        for pid in imex_daemons(self.workdir):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    @staticmethod
    async def _stop(process: Process) -> None:
        if process.returncode is None:
            process.terminate()
            with anyio.move_on_after(10):
                await process.wait()

    # -- the domain and its claims -----------------------------------------------------------

    async def create_domain(self, name: str, nodes: int | None = None) -> dict[str, Any]:
        path = f"/apis/resource.nvidia.com/v1beta1/namespaces/{NAMESPACE}/computedomains"
        domain = await self.post(
            path,
            {"apiVersion": "resource.nvidia.com/v1beta1", "kind": "ComputeDomain",
             "metadata": {"name": name, "namespace": NAMESPACE},
             "spec": {"numNodes": self.nodes_count if nodes is None else nodes,
                      "channel": {"resourceClaimTemplate": {"name": f"{name}-channel"}}}},
        )  # fmt: skip
        with anyio.fail_after(30):
            while not await self._template(f"{name}-channel"):  # noqa: ASYNC110 - another process
                await anyio.sleep(0.1)
        return domain

    async def _template(self, name: str) -> list[Any]:
        found = await self.objects("resourceclaimtemplates", NAMESPACE)
        return [t for t in found if t["metadata"]["name"] == name]

    async def template_spec(self, domain: dict[str, Any]) -> dict[str, Any]:
        """The claim spec of the domain's ResourceClaimTemplate (the controller's)."""
        (template,) = await self._template(f"{domain['metadata']['name']}-channel")
        spec: dict[str, Any] = template["spec"]["spec"]
        return spec

    async def claims(self, domain: dict[str, Any]) -> dict[str, ClaimRef]:
        """One channel claim per node from the domain's template, allocated by the allocator
        (as kube-scheduler would), a few at a time."""
        (template,) = await self._template(f"{domain['metadata']['name']}-channel")
        access = ApiAccess(self.url, "embedded-apiserver-token")
        found: dict[str, ClaimRef] = {}
        limiter = anyio.CapacityLimiter(8)

        async def one(node: FleetNode) -> None:
            manifest = {
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                "metadata": {"name": f"{node.name}-{domain['metadata']['name']}",
                             "namespace": NAMESPACE},
                "spec": template["spec"]["spec"],
            }  # fmt: skip
            async with limiter:
                created = await create_and_allocate_claim(access, manifest, node.name)
            meta = created["metadata"]
            found[node.name] = ClaimRef(
                namespace=meta["namespace"], name=meta["name"], uid=meta["uid"]
            )

        async with anyio.create_task_group() as group:
            for node in self.nodes:
                group.start_soon(one, node)
        return found

    async def domain_status(self, name: str) -> dict[str, Any]:
        for domain in await self.objects("computedomains", NAMESPACE):
            if domain["metadata"]["name"] == name:
                return dict(domain.get("status") or {})
        return {}


def counts_delta(
    after: dict[tuple[str, str, int], int], before: dict[tuple[str, str, int], int]
) -> dict[tuple[str, str, int], int]:
    keys = set(after) | set(before)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    return {k: v for k, v in delta.items() if v}


def describe_counts(delta: dict[tuple[str, str, int], int]) -> str:
    """``verb resource code: n`` lines, most first."""
    rows = sorted(delta.items(), key=lambda kv: (-kv[1], kv[0]))
    return "\n".join(f"  {verb:8} {resource:32} {code}: {n}" for (verb, resource, code), n in rows)


def dump(path: Path, document: Any) -> None:
    path.write_text(json.dumps(document, indent=1, sort_keys=True, default=str))
