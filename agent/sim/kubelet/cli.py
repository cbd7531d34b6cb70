"""``gpu-dra-agent sim kubelet``: the emulator as a standalone process for the demo.

Run next to the agent (and the embedded API server), it logs every registration, connection
change, health report and slice wipe until SIGINT or SIGTERM, which is how a person watches the
agent's kubelet-facing behaviour without a cluster. With ``--pod NAME --claim CLAIM...`` it
also starts one pod: its claims are allocated on the node by the allocator (as kube-scheduler
would, on 1.36+ waiting in PreBind for binding conditions up to ``--binding-timeout``; retried
while they do not fit, their binding fails or the driver is not registered yet, up to
``--pod-timeout``) and prepared; the CDI devices each claim got are logged, and on SIGINT or
SIGTERM the pod's claims are unprepared and released. Exit status 1 when the pod could not
start in time, 2 on bad options.
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path
from typing import Any

import anyio
import yaml
from kubernetes_asyncio import client, config

from agent.sim.binding_flag import add_binding_timeout
from agent.sim.claims import PodReference
from agent.sim.kubelet.emulator import KubeletEmulator
from agent.sim.kubelet.errors import DraCallError, DriverNotRegisteredError
from agent.sim.kubelet.events import logger
from agent.sim.kubelet.health import DEFAULT_HEALTH_TIMEOUT, DEFAULT_STREAM_RETRY_DELAY
from agent.sim.kubelet.pods import PodAdmissionError, PodClaims, create_claims
from agent.sim.kubelet.wipe import DEFAULT_WIPE_DELAY
from agent.switches import add_switch


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``sim kubelet`` options to ``parser``."""
    parser.add_argument(
        "--registrar-dir",
        type=Path,
        required=True,
        help="plugin registry directory to watch (the kubelet's plugins_registry)",
    )
    parser.add_argument(
        "--node-name", required=True, help="node whose ResourceSlices the emulator wipes"
    )
    parser.add_argument(
        "--kubeconfig",
        type=Path,
        default=None,
        help="kubeconfig of the API server; without it slices are never wiped",
    )
    parser.add_argument(
        "--wipe-delay",
        type=float,
        default=DEFAULT_WIPE_DELAY,
        help="seconds without a connected plugin instance before a driver's slices are wiped",
    )
    add_switch(
        parser,
        "auto-wipe",
        default=True,
        help="wipe the slices of drivers that disconnected, as the kubelet always does "
        "(default: on; --no-auto-wipe never wipes them)",
    )
    add_switch(
        parser,
        "wipe-on-start",
        default=True,
        help="wipe this node's slices at start, as the kubelet does (default: on)",
    )
    parser.add_argument(
        "--health-timeout",
        type=float,
        default=DEFAULT_HEALTH_TIMEOUT,
        help="seconds after which an unreported device reads as Unknown",
    )
    parser.add_argument(
        "--health-retry-delay",
        type=float,
        default=DEFAULT_STREAM_RETRY_DELAY,
        help="seconds before a health stream that ended is reopened",
    )
    parser.add_argument(
        "--pod",
        metavar="NAME",
        help="start this pod on the node: allocate its claims (--claim) and prepare them",
    )
    parser.add_argument(
        "--claim",
        dest="claims",
        action="append",
        default=[],
        metavar="CLAIM",
        help="a claim of --pod: a YAML file of ResourceClaims to create, or the name of a "
        "stored claim (repeatable)",
    )
    parser.add_argument("--namespace", default="default", help="namespace of --pod and its claims")
    parser.add_argument(
        "--pod-timeout",
        type=float,
        default=60.0,
        help="seconds to keep retrying while the pod's claims do not fit, their binding "
        "conditions fail or time out (--binding-timeout), or its driver is not registered",
    )
    add_binding_timeout(parser)
    add_switch(
        parser,
        "delete-claims",
        default=False,
        help="when stopping, delete the pod's claims (as for claims from a template) instead "
        "of releasing them",
    )


async def run(args: argparse.Namespace) -> int:
    """Run the emulator until SIGINT/SIGTERM; returns the process exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    pod_name: str | None = getattr(args, "pod", None)
    if pod_name is not None and (args.kubeconfig is None or not args.claims):
        logger.error("--pod needs --kubeconfig (claims are allocated there) and --claim")
        return 2
    if pod_name is None and getattr(args, "claims", None):
        logger.error("--claim needs --pod")
        return 2
    configuration = None
    if args.kubeconfig is not None:
        configuration = client.Configuration()
        try:
            await config.load_kube_config(
                config_file=str(args.kubeconfig), client_configuration=configuration
            )
        except (OSError, config.ConfigException) as exc:
            logger.error("cannot load kubeconfig %s: %s", args.kubeconfig, exc)
            return 2
    sources: list[Any] = []
    if pod_name is not None:
        try:
            sources = await _claim_sources(args.claims)
        except (OSError, yaml.YAMLError) as exc:
            logger.error("cannot read the pod's claims: %s", exc)
            return 2
    status = 0
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with KubeletEmulator(
            args.registrar_dir,
            node_name=args.node_name,
            kube_client_config=configuration,
            health_timeout=args.health_timeout,
            health_retry_delay=args.health_retry_delay,
            auto_wipe=configuration is not None and args.auto_wipe,
            wipe_delay=args.wipe_delay,
            wipe_on_start=configuration is not None and args.wipe_on_start,
        ) as kubelet:
            logger.info(
                "kubelet emulator watching %s for node %s", args.registrar_dir, args.node_name
            )
            running: list[PodClaims] = []
            async with anyio.create_task_group() as group:
                if pod_name is not None:

                    async def start_pod() -> None:
                        nonlocal status
                        pod = await _start_pod(kubelet, args, PodReference(pod_name), sources)
                        if pod is None:
                            status = 1
                            group.cancel_scope.cancel()
                        else:
                            running.append(pod)

                    group.start_soon(start_pod)
                async for received in signals:
                    logger.info("received %s, stopping", signal.Signals(received).name)
                    break
                group.cancel_scope.cancel()
            for pod in running:
                await _end_pod(kubelet, pod, args.delete_claims)
    return status


async def _claim_sources(claims: list[str]) -> list[Any]:
    """``--claim`` values: the ResourceClaims of each YAML file, else the name itself."""
    sources: list[Any] = []
    for claim in claims:
        path = anyio.Path(claim)
        if await path.is_file():
            documents = yaml.safe_load_all(await path.read_text())
            sources += [
                d for d in documents if isinstance(d, dict) and d.get("kind") == "ResourceClaim"
            ]
        else:
            sources.append(claim)
    return sources


async def _start_pod(
    kubelet: KubeletEmulator, args: argparse.Namespace, pod: PodReference, sources: list[Any]
) -> PodClaims | None:
    """Create the pod's new claims once, then allocate and prepare until it works or
    ``--pod-timeout`` passes (the scheduler and the kubelet both retry)."""
    access = kubelet.api_access
    assert access is not None
    manifests = [s for s in sources if not isinstance(s, str)]
    try:
        created = iter(await create_claims(access, manifests, args.namespace))
    except PodAdmissionError as exc:
        logger.error("pod %s/%s cannot start: %s", args.namespace, pod.name, exc)
        return None
    names = [s if isinstance(s, str) else next(created) for s in sources]
    last = ""
    with anyio.move_on_after(args.pod_timeout):
        while True:
            try:
                started = await kubelet.run_pod(
                    pod, names, namespace=args.namespace, binding_timeout_s=args.binding_timeout
                )
            except (PodAdmissionError, DriverNotRegisteredError, DraCallError) as exc:
                reason = str(exc)
            else:
                errors = started.errors()
                if not errors:
                    for claim, ids in started.cdi_device_ids().items():
                        logger.info(
                            "pod %s/%s: claim %s prepared, CDI devices %s",
                            args.namespace,
                            pod.name,
                            claim,
                            ", ".join(ids),
                        )
                    return started
                reason = "; ".join(f"{k}: {v}" for k, v in errors.items())
            if reason != last:
                logger.warning("pod %s/%s not started yet: %s", args.namespace, pod.name, reason)
                last = reason
            await anyio.sleep(1.0)
    logger.error(
        "pod %s/%s did not start within %gs: %s", args.namespace, pod.name, args.pod_timeout, last
    )
    return None


async def _end_pod(kubelet: KubeletEmulator, pod: PodClaims, delete: bool) -> None:
    with anyio.CancelScope(shield=True), anyio.move_on_after(30):
        try:
            answers = await kubelet.end_pod(pod, delete_claims=delete)
        except (DriverNotRegisteredError, DraCallError) as exc:
            logger.error("pod %s/%s: unprepare failed: %s", pod.namespace, pod.pod.name, exc)
            return
        errors = {uid: a.error for d in answers.values() for uid, a in d.items() if a.error}
        logger.info(
            "pod %s/%s stopped: claims unprepared and %s%s",
            pod.namespace,
            pod.pod.name,
            "deleted" if delete else "released",
            f" (errors: {errors})" if errors else "",
        )
