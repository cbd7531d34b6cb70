"""The demo's ComputeDomain step (``gpu-dra-agent demo``): two simulated GB200 trays form a
domain that goes Ready.

Two more ``gpu-dra-agent run`` processes (``tray-a``, ``tray-b``, profile
``gb200-nvl72-tray``, one shared simulated fabric directory) and the controller run against
the demo's API server, each tray with a kubelet emulator of its own. A ComputeDomain is
created; the controller makes its ResourceClaimTemplate; a claim per tray is made from it and
allocated as the scheduler would; both trays prepare theirs (each joins the domain and starts
its IMEX daemon); the domain goes Ready; both unprepare and the domain is deleted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AsyncExitStack
from pathlib import Path
from typing import Any

import anyio

from agent.errors import AgentError
from agent.imex.config import DRIVER
from agent.imex.domains import node_entries

TRAYS = {"tray-a": "10.0.7.1", "tray-b": "10.0.7.2"}
PROFILE = "gb200-nvl72-tray"
DOMAIN = {
    "apiVersion": "resource.nvidia.com/v1beta1",
    "kind": "ComputeDomain",
    "metadata": {"name": "training", "namespace": "default"},
    "spec": {
        "numNodes": 2,
        "channel": {
            "resourceClaimTemplate": {"name": "training-channel"},
            "allocationMode": "Single",
        },
    },
}


class StepFailed(AgentError):
    """The ComputeDomain step did not do what it should."""


async def compute_domain_step(
    server: Any, workdir: Path, environ: dict[str, str], say: Callable[[str], None]
) -> None:
    from agent.sim.allocation import ApiAccess, create_and_allocate_claim, published_pool
    from agent.sim.kubelet import ClaimRef, EventKind, KubeletEmulator

    say(f"11. ComputeDomain over IMEX: agents on two simulated {PROFILE} trays and the controller")
    kubeconfig = workdir / "kubeconfig"
    access = ApiAccess(server.url, server.token)
    processes = []
    async with AsyncExitStack() as stack:
        kubelets = {}
        try:
            for tray, address in TRAYS.items():
                server.put_object(
                    {
                        "apiVersion": "v1",
                        "kind": "Node",
                        "metadata": {"name": tray},
                        "status": {"addresses": [{"type": "InternalIP", "address": address}]},
                    }
                )
                root = workdir / tray
                kubelets[tray] = await stack.enter_async_context(
                    KubeletEmulator(root / "registry", node_name=tray, poll_interval=0.05)
                )
                command = [
                    sys.executable, "-m", "agent", "run", "--simulate", PROFILE,
                    "--node-name", tray, "--kubeconfig", str(kubeconfig),
                    "--registrar-dir", str(root / "registry"),
                    "--plugins-dir", str(root / "plugins"), "--cdi-root", str(root / "cdi"),
                    "--sim-fabric-dir", str(workdir / "fabric"),
                ]  # fmt: skip
                log = (workdir / f"{tray}.log").open("wb")
                processes.append(
                    await anyio.open_process(command, stdout=log, stderr=log, env=environ)
                )
                log.close()
            log = (workdir / "controller.log").open("wb")
            processes.append(
                await anyio.open_process(
                    [
                        sys.executable,
                        "-m",
                        "agent",
                        "controller",
                        "--kubeconfig",
                        str(kubeconfig),
                        "--identity",
                        "demo",
                        "--resync-seconds",
                        "0.2",
                    ],
                    stdout=log,
                    stderr=log,
                    env=environ,
                )
            )
            log.close()
            for tray, kubelet in kubelets.items():
                try:
                    await kubelet.wait_event(EventKind.REGISTERED, DRIVER, timeout=60)
                except TimeoutError:
                    raise StepFailed(f"{tray} did not register {DRIVER}") from None
                try:  # it registers first, then writes its slice
                    await published_pool(access, tray, DRIVER, timeout_s=60)
                except TimeoutError:
                    raise StepFailed(f"{tray} published no slice of {DRIVER}") from None
            say(f"    both trays registered {DRIVER} and publish channel-0 of their clique")
            domain = server.put_object(DOMAIN)
            uid = domain["metadata"]["uid"]
            await _until(
                lambda: (
                    server.get_object("resourceclaimtemplates", "training-channel", "default")
                    is not None
                )
            )
            template = server.get_object("resourceclaimtemplates", "training-channel", "default")
            if template is None:
                raise StepFailed("the controller made no ResourceClaimTemplate training-channel")
            say(f"    ComputeDomain default/training ({uid}): template training-channel made")
            refs = {}
            for tray in TRAYS:
                manifest = {
                    "apiVersion": "resource.k8s.io/v1",
                    "kind": "ResourceClaim",
                    "metadata": {"name": f"{tray}-channel", "namespace": "default"},
                    "spec": template["spec"]["spec"],
                }
                claim = await create_and_allocate_claim(access, manifest, tray)
                refs[tray] = ClaimRef(
                    namespace="default", name=f"{tray}-channel", uid=claim["metadata"]["uid"]
                )
            async with anyio.create_task_group() as group:
                for tray, ref in refs.items():
                    group.start_soon(_prepare, kubelets[tray], tray, ref, say)
            await _until(
                lambda: (
                    (server.get_object("computedomains", "training", "default") or {})
                    .get("status", {})
                    .get("status")
                    == "Ready"
                )
            )
            stored = server.get_object("computedomains", "training", "default") or {}
            if stored.get("status", {}).get("status") != "Ready":
                raise StepFailed(f"the domain did not go Ready: {stored.get('status')}")
            nodes = ", ".join(f"{e.name} #{e.index} {e.status}" for e in node_entries(stored))
            say(f"    the domain is Ready: {nodes}")
            for tray, ref in refs.items():
                result = (await kubelets[tray].unprepare(DRIVER, [ref]))[ref.uid]
                if result.error:
                    raise StepFailed(f"unprepare on {tray} failed: {result.error}")
            server.delete_object("computedomains", "training", "default")
            await _until(lambda: server.get_object("computedomains", "training", "default") is None)
            say("    both trays left (daemons stopped); the domain and its template are deleted")
        finally:
            for process in processes:
                if process.returncode is None:
                    process.terminate()
                with anyio.move_on_after(20):
                    await process.wait()
                if process.returncode is None:
                    process.kill()
                    await process.wait()


async def _until(check: Callable[[], bool], timeout: float = 20.0) -> None:  # noqa: ASYNC109
    """Poll ``check`` (objects other processes write) until it holds or ``timeout`` passes."""
    with anyio.move_on_after(timeout):
        while not check():  # noqa: ASYNC110
            await anyio.sleep(0.1)


async def _prepare(kubelet: Any, tray: str, ref: Any, say: Callable[[str], None]) -> None:
    result = (await kubelet.prepare(DRIVER, [ref]))[ref.uid]
    if result.error:
        raise StepFailed(f"preparing the channel claim on {tray} failed: {result.error}")
    (device,) = result.devices
    say(f"    {tray}: joined, IMEX daemon READY, CDI {device.cdi_device_ids[0]}")
