"""The integration tests' harness: the real agent process, its API server and kubelet.

:class:`AgentHarness` (the fixtures of ``conftest.py`` make one per module) and what the tests
share with it: the node's names, the request helpers, :class:`AgentProcess` and
:func:`cluster`. ``conftest.py`` has the module docstring of the whole arrangement.
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

from agent.node.cdi import CdiSpecDirectory
from agent.node.checkpoint import ClaimState, from_dict
from agent.node.checkpoint_store import FILE_NAME as CHECKPOINT_FILE
from agent.sim.allocation import (
    ApiAccess,
    claim_from_request,
    create_and_allocate_claim,
    create_claim,
    delete_claim,
    whole_pool,
)
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import AllocatedDevice, OpaqueConfig, PodReference, create_allocated_claim
from agent.sim.control.client import wait_engine_started
from agent.sim.deviceclasses import default_device_classes
from agent.sim.kubelet import ClaimRef, ClaimSource, EventKind, KubeletEmulator, PodClaims

NODE = "node-a"
DRIVER = "gpu.nvidia.com"
PROFILE = "dgx-h100"
NAMESPACE = "default"
START_TIMEOUT = 30.0
STOP_TIMEOUT = 20.0
GPU_CLASS = "gpu.nvidia.com"


def gpu_request(
    name: str = "gpu",
    *,
    count: int = 1,
    selectors: Sequence[str] = (),
    all_devices: bool = False,
    device_class: str = GPU_CLASS,
) -> dict[str, Any]:
    """A claim request as a user writes it: ``count`` devices of the class (or all of them)
    matching every CEL selector."""
    exactly: dict[str, Any] = {"deviceClassName": device_class}
    if all_devices:
        exactly["allocationMode"] = "All"
    elif count != 1:
        exactly["count"] = count
    if selectors:
        exactly["selectors"] = [{"cel": {"expression": e}} for e in selectors]
    return {"name": name, "exactly": exactly}


def allocated_devices(claim: Mapping[str, Any]) -> list[str]:
    """The device names the allocator wrote into the claim's ``status.allocation``."""
    return [r["device"] for r in claim["status"]["allocation"]["devices"]["results"]]


class AgentProcess:
    """One ``gpu-dra-agent run`` subprocess and its log file."""

    def __init__(self, process: Process, log_path: Path) -> None:
        self.process = process
        self.log_path = log_path

    @property
    def returncode(self) -> int | None:
        return self.process.returncode

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    async def wait(self, timeout: float = STOP_TIMEOUT) -> int:  # noqa: ASYNC109
        """Wait for the process to exit (it must, within ``timeout``); returns its status."""
        with anyio.fail_after(timeout):
            return await self.process.wait()

    async def stop(
        self,
        timeout: float = STOP_TIMEOUT,  # noqa: ASYNC109
        signal_number: int = signal.SIGTERM,
    ) -> int:
        """SIGTERM (what pod deletion sends) or ``signal_number``; returns the exit status."""
        if self.process.returncode is None:
            self.process.send_signal(signal_number)
        try:
            return await self.wait(timeout)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
            raise


class AgentHarness:
    """The agent, the API server and the kubelet emulator of one test module."""

    def __init__(self, workdir: Path, server: EmbeddedApiServer, kubelet: KubeletEmulator) -> None:
        self.workdir = workdir
        self.server = server
        self.kubelet = kubelet
        self.kubeconfig = server.write_kubeconfig(workdir / "kubeconfig")
        self.agent: AgentProcess | None = None
        self.api = ApiAccess(server.url, server.token)
        self._starts = 0
        self._claims = 0
        self._created: list[ClaimRef] = []  # by this test; deleted after it

    # -- paths ---------------------------------------------------------------------------

    @property
    def registrar_dir(self) -> Path:
        return self.workdir / "registry"

    @property
    def plugins_dir(self) -> Path:
        return self.workdir / "plugins"

    @property
    def plugin_dir(self) -> Path:
        return self.plugins_dir / DRIVER

    @property
    def cdi_root(self) -> Path:
        return self.workdir / "cdi"

    @property
    def registration_socket(self) -> Path:
        return self.registrar_dir / f"{DRIVER}-reg.sock"

    @property
    def dra_socket(self) -> Path:
        return self.plugin_dir / "dra.sock"

    @property
    def checkpoint_path(self) -> Path:
        return self.plugin_dir / CHECKPOINT_FILE

    # -- the agent process ---------------------------------------------------------------

    def command(self, *extra: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "agent",
            "run",
            "--simulate",
            PROFILE,
            "--node-name",
            NODE,
            "--kubeconfig",
            str(self.kubeconfig),
            "--registrar-dir",
            str(self.registrar_dir),
            "--plugins-dir",
            str(self.plugins_dir),
            "--cdi-root",
            str(self.cdi_root),
            *extra,
        ]

    async def start_agent(
        self,
        env: Mapping[str, str] | None = None,
        *,
        args: Sequence[str] = (),
        wait_registered: bool = True,
    ) -> AgentProcess:
        """Start the agent (``env`` is added to this process's environment, ``args`` to its
        command line); by default wait until the kubelet emulator has registered it."""
        self._starts += 1
        registrations = len(self.kubelet.events(EventKind.REGISTERED, DRIVER))
        environ = {k: v for k, v in os.environ.items() if k not in ("NODE_NAME", "KUBECONFIG")}
        environ.pop("GPU_DRA_AGENT_CRASH_AT", None)
        environ.update(env or {})
        log_path = self.workdir / f"agent-{self._starts}.log"
        with log_path.open("wb") as log_file:
            process = await anyio.open_process(
                self.command(*args), stdout=log_file, stderr=log_file, env=environ
            )
        self.agent = AgentProcess(process, log_path)
        if wait_registered:
            await self._wait_registered(self.agent, registrations + 1)
        return self.agent

    async def _wait_registered(self, agent: AgentProcess, count: int) -> None:
        """Wait for the ``count``-th registration and the engine's start; fail at once (with
        the log) if the agent exits first."""
        exited: list[int] = []

        async def watch_exit(scope: anyio.CancelScope) -> None:
            exited.append(await agent.process.wait())
            scope.cancel()

        async with anyio.create_task_group() as group:
            group.start_soon(watch_exit, group.cancel_scope)
            try:
                await self.kubelet.wait_event(
                    EventKind.REGISTERED, DRIVER, count=count, timeout=START_TIMEOUT
                )
                # the sockets open before the engine: wait until it runs too
                await wait_engine_started(self.plugin_dir, START_TIMEOUT)
            except TimeoutError:
                exited.append(-1)
            group.cancel_scope.cancel()
        if exited:
            raise AssertionError(
                f"the agent did not register (exit status {exited[0]}):\n{agent.log()}"
            )

    async def stop_agent(self) -> int:
        """Stop the running agent with SIGTERM; returns its exit status."""
        assert self.agent is not None
        return await self.agent.stop()

    async def wait_slices(self, timeout: float = 10.0) -> list[dict[str, Any]]:  # noqa: ASYNC109
        """This node's ResourceSlices, once the publisher has written a whole pool (every
        slice of one generation: a pool of several slices is written one slice at a time)."""
        selector = f"spec.nodeName={NODE},spec.driver={DRIVER}"

        def published() -> list[dict[str, Any]]:
            found = self.server.list_objects("resourceslices", field_selector=selector)
            return found if found and whole_pool(found) else []

        with anyio.fail_after(timeout):
            while not (found := published()):  # noqa: ASYNC110
                await anyio.sleep(0.05)
        return found

    # -- claims --------------------------------------------------------------------------

    async def claim(
        self,
        devices: Sequence[str],
        *,
        name: str | None = None,
        request: str = "gpu",
        pool: str = NODE,
        configs: Sequence[OpaqueConfig] = (),
        reserved_for: Sequence[PodReference] | None = None,
    ) -> ClaimRef:
        """Create a claim with a hand-written allocation of ``devices`` (no allocator): only
        for what a scheduler would never write (unknown devices, another node's pool, one
        exclusive device in two claims); everything else uses :meth:`allocate`."""
        self._claims += 1
        name = name or f"claim-{self._claims}"
        allocated = [AllocatedDevice(request=request, device=d, pool=pool) for d in devices]
        created = await create_allocated_claim(
            self.server.url,
            name,
            allocated,
            namespace=NAMESPACE,
            configs=configs,
            reserved_for=reserved_for,
            node_name=NODE,
        )
        return self._track(created)

    async def allocate(
        self,
        request: Mapping[str, Any],
        *,
        name: str | None = None,
        constraints: Sequence[dict[str, Any]] = (),
        config: Sequence[dict[str, Any]] = (),
    ) -> tuple[ClaimRef, dict[str, Any]]:
        """Create a claim with one ``request`` (name plus ``exactly`` or ``firstAvailable``)
        and have the allocator pick its devices, as kube-scheduler would, once the agent has
        published its slices; returns the kubelet's view and the stored claim."""
        await self.wait_slices()
        self._claims += 1
        name = name or f"claim-{self._claims}"
        manifest = claim_from_request(
            name, request, namespace=NAMESPACE, constraints=constraints, config=config
        )
        try:
            created = await create_and_allocate_claim(self.api, manifest, NODE)
        finally:
            self._created.append(ClaimRef(namespace=NAMESPACE, name=name, uid=""))
        return self._track(created), created

    async def pending(self, request: Mapping[str, Any], *, name: str) -> ClaimRef:
        """Create a claim and leave it unallocated (the scheduler has not got to it)."""
        created = await create_claim(self.api, claim_from_request(name, request))
        return self._track(created)

    async def run_pod(self, pod: str, claims: Sequence[ClaimSource]) -> PodClaims:
        """The kubelet emulator starts a pod: claims allocated by the allocator, then prepared."""
        await self.wait_slices()
        names = [c if isinstance(c, str) else c["metadata"]["name"] for c in claims]
        self._created += [ClaimRef(namespace=NAMESPACE, name=n, uid="") for n in names]
        started = await self.kubelet.run_pod(pod, claims, namespace=NAMESPACE)
        for claim in started.claims:
            self._track(claim)
        return started

    def _track(self, created: Mapping[str, Any]) -> ClaimRef:
        meta = created["metadata"]
        ref = ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])
        self._created = [c for c in self._created if c.name != ref.name] + [ref]
        return ref

    async def device_attribute(self, device: str, attribute: str) -> Any:
        """The published value of one attribute of ``device`` (to select it, as a user would
        select a GPU by UUID)."""
        for item in await self.wait_slices():
            for entry in item["spec"].get("devices", []):
                if entry["name"] == device:
                    return next(iter(entry["attributes"][attribute].values()))
        raise AssertionError(f"{device} is not published")

    async def delete_claims(self) -> None:
        """Unprepare (while the agent runs and holds them) and delete the claims this test
        created, as kubelet and garbage collector would once its pods are gone."""
        created, self._created = self._created, []
        held = self.checkpoint_claims()
        prepared = [c for c in created if c.uid in held]
        running = self.agent is not None and self.agent.returncode is None
        if prepared and running and self.kubelet.registrations(DRIVER):
            answers = await self.unprepare(*prepared)
            assert all(not a.error for a in answers.values()), answers
        for ref in created:
            await delete_claim(self.api, ref.namespace, ref.name)

    async def prepare(self, *claims: ClaimRef) -> dict[str, Any]:
        return await self.kubelet.prepare(DRIVER, list(claims))

    async def unprepare(self, *claims: ClaimRef) -> dict[str, Any]:
        return await self.kubelet.unprepare(DRIVER, list(claims))

    # -- the node's files ----------------------------------------------------------------

    def checkpoint_claims(self) -> dict[str, ClaimState]:
        """Claim UID -> state, from the checkpoint file on disk (empty when there is none)."""
        try:
            document = json.loads(self.checkpoint_path.read_text())
        except FileNotFoundError:
            return {}
        return {uid: claim.state for uid, claim in from_dict(document).claims.items()}

    def cdi_claim_uids(self) -> set[str]:
        return CdiSpecDirectory(self.cdi_root, DRIVER).claim_uids()

    def cdi_spec_path(self, uid: str) -> Path:
        return CdiSpecDirectory(self.cdi_root, DRIVER).claim_path(uid)

    def assert_consistent(self) -> None:
        """Every claim in the checkpoint is completed and has its CDI spec; no spec is orphaned."""
        states = self.checkpoint_claims()
        assert all(s == ClaimState.PREPARE_COMPLETED for s in states.values()), states
        assert set(states) == self.cdi_claim_uids()


@contextlib.asynccontextmanager
async def cluster(workdir: Path, **kubelet_options: Any) -> AsyncIterator[AgentHarness]:
    """API server (with this node's Node) and kubelet emulator (``kubelet_options`` added to
    its arguments); no agent running yet, one left running is stopped at the end."""
    async with EmbeddedApiServer() as server:
        server.put_object({"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}})
        for device_class in default_device_classes():
            server.put_object(device_class)
        access = ApiAccess(server.url, server.token)
        async with KubeletEmulator(
            workdir / "registry",
            node_name=NODE,
            poll_interval=0.05,
            api_access=access,
            **kubelet_options,
        ) as kl:
            harness = AgentHarness(workdir, server, kl)
            try:
                yield harness
            finally:
                if harness.agent is not None and harness.agent.returncode is None:
                    await harness.agent.stop()
