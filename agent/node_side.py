"""The supervisor's node-side start: the GPUs, the device effectors and the prepare engine.

The supervisor calls :func:`start_engine` once the kubelet's sockets are open (the DRA service
waits for the engine meanwhile, :mod:`agent.kubelet.deferred`). Its modules are loaded in a
worker thread first (:func:`load_node_modules`), so that the event loop answers the kubelet's
registration while they load. It discovers the GPUs (simulated or real), builds the devices,
the effectors (dynamic MIG, sharing, device metadata) and the engine, starts the engine (it
reloads and reconciles the checkpoint) and hands it to the waiting DRA service; the API
client is not there yet, so the engine reads claims through a
:class:`agent.kube.deferred.DeferredClaimReader` and posts Events through a queue.
"""

from __future__ import annotations

import importlib
import logging
from contextlib import AsyncExitStack
from dataclasses import dataclass
from typing import Any

from agent.config import AgentConfig
from agent.kubelet.deferred import DeferredPreparer

log = logging.getLogger("agent.supervisor")

#: What the node's side of the start runs on (:func:`start_engine`).
NODE_MODULES = (
    "agent.dra.devices",
    "agent.dra.slices",
    "agent.hardware.discovery",
    "agent.kube.deferred",
    "agent.node.engine",
    "agent.sharing",
    "agent.metadata",
    "agent.api_side",
)


def load_node_modules(config: AgentConfig) -> None:
    """Import what :func:`start_engine` and the rest of the start use (in a worker thread)."""
    names = list(NODE_MODULES)
    if config.dynamic_mig:
        names += ["agent.hardware.mig_ops", "agent.mig"]
    if config.health_monitoring:
        names.append("agent.health.wiring")
    if config.simulate is not None:
        names += ["agent.hardware.simulated.host", "agent.sim.control.server"]
    if config.compute_domains != "off":
        names += ["agent.imex.sockets", "agent.imex.fabric", "agent.imex.metrics"]
    for name in names:
        importlib.import_module(name)


@dataclass(frozen=True, slots=True)
class NodeSide:
    """What :func:`start_engine` made, for the rest of the start."""

    session: Any  # agent.hardware.discovery.NvmlSession
    inventory: Any  # agent.hardware.inventory.Inventory, as the devices were built from
    engine: Any  # agent.node.engine.PrepareEngine, started
    devices: list[Any]  # the DraDevices to publish
    counter_sets: tuple[Any, ...]  # with --dynamic-mig
    held_back: list[Any]  # --dynamic-mig placements not published (logged)
    shares: Any  # agent.dra.share_mode.SharesMode
    dynamic_mig: Any  # agent.dra.partitionable.DynamicMig, or None
    pending_reader: Any  # Pending[ClaimReader]: connect_api sets it
    events: Any  # DeferredEventPoster: the API side attaches the poster


async def start_engine(
    config: AgentConfig, stack: AsyncExitStack, preparer: DeferredPreparer
) -> NodeSide:
    """Discover, build and start the engine (closed by ``stack``); ``preparer`` gets it."""
    from agent.dra import build_devices
    from agent.dra.share_mode import parse_mode
    from agent.hardware.discovery import discover, nvml_session
    from agent.kube.deferred import DeferredClaimReader, DeferredEventPoster
    from agent.kube.interfaces import ClaimReader
    from agent.node.engine import PrepareEngine
    from agent.pending import Pending

    session = await stack.enter_async_context(nvml_session(config.simulate, config.host_root))
    inventory = await discover(session.nvml, config.host_root)
    shares = parse_mode(config.consumable_shares)  # --consumable-shares (agent.dra.shares)
    devices = build_devices(inventory, shares=shares)
    log.info(
        "discovered %d GPU(s), %d allocatable device(s)",
        len(inventory.gpus),
        len(devices),
        extra={"simulated": config.simulate or "no", "host_root": str(config.host_root)},
    )

    # The API client is made once the kubelet's sockets are open (connect_api, below): a
    # claim read waits for it within the read's timeout, an Event waits in a queue.
    pending_reader: Pending[ClaimReader] = Pending("API client")
    claim_reader = DeferredClaimReader(pending_reader, timeout_s=config.api_timeout_s)
    events = DeferredEventPoster()
    effectors: list[Any] = []  # agent.node.effectors.DeviceEffector, in order
    if config.dynamic_mig:  # MIG instances made on prepare (agent/mig)
        from agent.hardware.mig_ops import MigOps
        from agent.mig import MigEffector, metrics_at_zero

        metrics_at_zero()

        effectors.append(
            MigEffector(
                MigOps(session.nvml),
                inventory,
                config.host_root,
                mode_off_when_idle=config.mig_mode_off_when_idle,
                adopt_instances=config.adopt_mig_instances,
            )
        )
    from agent.sharing import build_sharing

    effectors.append(  # after MIG: it sees the MIG devices just made (agent/sharing)
        build_sharing(
            session.nvml,
            inventory,
            plugin_dir=config.plugin_dir,
            host_root=config.host_root,
            driver_root=(
                session.simulated.root / "driver-root"
                if session.simulated is not None
                else config.driver_files
            ),
            dynamic_mig=config.dynamic_mig,
            simulated=session.simulated is not None,
        )
    )
    from agent.metadata import build_metadata

    # last effector: KEP-5304 files per request (agent/metadata; --device-metadata); the
    # engine's reader notes what they need of each claim
    engine_reader, metadata = build_metadata(
        claim_reader,
        enabled=config.device_metadata,
        driver=config.driver_name,
        pool=config.node_name,
        plugin_dir=config.plugin_dir,
        cdi_root=config.cdi_root,
        devices=devices,
    )
    effectors.append(metadata)
    engine = PrepareEngine(
        driver=config.driver_name,
        node_name=config.node_name,
        inventory=inventory,
        plugin_dir=config.plugin_dir,
        cdi_root=config.cdi_root,
        host_root=config.host_root,
        driver_root=config.driver_root,
        driver_root_mount=config.driver_files,
        claim_reader=engine_reader,
        boot_id=session.files.boot_id() or "unknown",
        events=events,
        dynamic_mig=config.dynamic_mig,
        adopt_mig_instances=config.adopt_mig_instances,
        effectors=effectors,
        sharing=True,
        ldconfig_path=config.ldconfig_path,
    )
    report = await engine.start()
    stack.push_async_callback(engine.close)
    preparer.attach(engine)  # the kubelet's calls that waited for it go on now
    log.info(
        "prepare engine started: checkpoint %s, %d prepared claim(s)",
        report.load_status,
        len(report.prepared),
        extra={
            "rolled_back": len(report.rolled_back),
            "recreated_specs": len(report.recreated_specs),
            "removed_orphan_specs": len(report.removed_orphan_specs),
        },
    )

    dynamic_mig: Any = None
    counter_sets: tuple[Any, ...] = ()
    held_back: list[Any] = []
    if config.dynamic_mig:  # after start: the checkpoint says which instances are ours
        from agent.dra import build_device_set

        dynamic_mig = _dynamic_mig_settings(engine.checkpoint, config.adopt_mig_instances)
        if report.rolled_back:  # recovery destroyed what a crash made: read the GPUs again
            inventory = await discover(session.nvml, config.host_root)
        device_set = build_device_set(inventory, dynamic_mig=dynamic_mig, shares=shares)
        devices, counter_sets = list(device_set.devices), device_set.counter_sets
        held_back = list(device_set.held_back)
    metadata.set_devices(devices)  # the devices as published (dynamic MIG: placements)
    return NodeSide(
        session,
        inventory,
        engine,
        devices,
        counter_sets,
        held_back,
        shares,
        dynamic_mig,
        pending_reader,
        events,
    )


def _dynamic_mig_settings(checkpoint: Any, adopt: bool) -> Any:
    """``--dynamic-mig`` publishing settings: the MIG devices whose instance this agent made
    are placements like any other; every other instance found is static (``agent.dra``).
    Made by this agent means a MIG intent of the checkpoint names it: the effector records
    the intent before the instance exists and removes it only once it is gone (a static
    instance prepared for a claim has live ids in the checkpoint too, but no intent). The
    engine and the MIG effector read the same rule from the checkpoint at startup."""
    from agent.dra.partitionable import owned_by_intents

    return owned_by_intents(
        ((i.effector, i.device) for c in checkpoint.claims.values() for i in c.intents), adopt
    )
