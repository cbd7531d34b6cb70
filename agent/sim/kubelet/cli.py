"""``gpu-dra-agent sim kubelet``: the emulator as a standalone process for the demo.

Run next to the agent (and the embedded API server), it logs every registration, connection
change, health report and slice wipe until SIGINT or SIGTERM, which is how a person watches the
agent's kubelet-facing behaviour without a cluster.
"""

from __future__ import annotations

import argparse
import logging
import signal
from pathlib import Path

import anyio
from kubernetes_asyncio import client, config

from agent.sim.kubelet.emulator import KubeletEmulator
from agent.sim.kubelet.events import logger
from agent.sim.kubelet.health import DEFAULT_HEALTH_TIMEOUT, DEFAULT_STREAM_RETRY_DELAY
from agent.sim.kubelet.wipe import DEFAULT_WIPE_DELAY


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
    parser.add_argument(
        "--no-auto-wipe",
        action="store_true",
        help="never wipe slices of disconnected drivers (the kubelet always does)",
    )
    parser.add_argument(
        "--no-wipe-on-start",
        action="store_true",
        help="do not wipe this node's slices at start (the kubelet does)",
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


async def run(args: argparse.Namespace) -> int:
    """Run the emulator until SIGINT/SIGTERM; returns the process exit code."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
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
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with KubeletEmulator(
            args.registrar_dir,
            node_name=args.node_name,
            kube_client_config=configuration,
            health_timeout=args.health_timeout,
            health_retry_delay=args.health_retry_delay,
            auto_wipe=configuration is not None and not args.no_auto_wipe,
            wipe_delay=args.wipe_delay,
            wipe_on_start=configuration is not None and not args.no_wipe_on_start,
        ):
            logger.info(
                "kubelet emulator watching %s for node %s", args.registrar_dir, args.node_name
            )
            async for received in signals:
                logger.info("received %s, stopping", signal.Signals(received).name)
                break
    return 0
