"""The supervisor: wires the agent's parts together under one anyio task group.

Start-up runs in a fixed order, because each step needs the one before and the kubelet must
never see a socket whose engine cannot answer: discover the GPUs (simulated or real), start the
prepare engine (it reloads and reconciles the checkpoint), start the health monitor (NVML events
are watched from here on), and open the DRA socket and, after it, the registration socket;
then, where this node serves ComputeDomains, the second driver's sockets
(:mod:`agent.imex.sockets`: its engine needs the API client, so a call waits for the engine
within a bound). Only then is the API side made (:mod:`agent.api_side`: the HTTP stack is loaded, the client made, the
Node's uid and the server's version read) while the kubelet registers the plugin; until the
client exists, a prepare's claim read waits for it (within the read's timeout), an Event waits
in a queue and the health monitor's taints wait for the slice publisher
(:mod:`agent.kube.deferred`). The slice publisher and the second driver's engine follow. They, the
health monitor and the kubelet plugin then run as children of the task group until SIGTERM or
SIGINT, with, in simulate mode, the fault-injection control socket.

A child that fails is logged and brings the whole process down cleanly (sockets removed,
engine closed, exit status 1): systemd or the DaemonSet restarts it, and the checkpoint makes
the restart harmless. Nothing is fire-and-forget.
"""

from __future__ import annotations

import logging
import signal
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from agent.config import AgentConfig
from agent.errors import AgentError
from agent.notify import SystemdNotifier, announce_ready
from agent.telemetry.meter_provider import configure_metrics, serve_metrics, shutdown_metrics
from agent.telemetry.metrics import slice_writes_at_zero
from agent.telemetry.tracing import configure_tracing, shutdown_tracing

log = logging.getLogger("agent.supervisor")


class Supervisor:
    """Runs the agent for one driver until a signal or a failure; see :meth:`run`."""

    def __init__(self, config: AgentConfig) -> None:
        self.config = config
        self.failure: BaseException | None = None
        self.stopped_by: str | None = None
        #: READY/WATCHDOG/STOPPING/STATUS for systemd (a no-op without $NOTIFY_SOCKET).
        self.notifier = SystemdNotifier.from_environ()

    async def run(self) -> int:
        """Serve until SIGTERM/SIGINT (exit status 0) or a failure: an AgentError (a problem
        an operator can fix) is raised for the CLI to print; anything else was logged with
        its traceback and gives exit status 1."""
        # metrics first: instruments made from here on (the span processor's) record at once
        configure_metrics(node_name=self.config.node_name)
        configure_tracing(node_name=self.config.node_name)
        try:
            async with AsyncExitStack() as stack:
                async with anyio.create_task_group() as group:
                    group.start_soon(self._watch_signals, group)
                    group.start_soon(self.notifier.keep_alive, lambda: self.failure is None)
                    self.notifier.status("starting: discovering GPUs")
                    try:
                        await self._start(stack, group)
                    except AgentError as err:  # reported by the CLI, one line
                        self.failure = err
                        group.cancel_scope.cancel()
                    except Exception as err:
                        self._failed(group, "start-up", err)
        finally:
            self.notifier.stopping(f"stopped: {self.stopped_by or 'failure'}")
            shutdown_tracing()
            shutdown_metrics()
        if isinstance(self.failure, AgentError):
            raise self.failure
        if self.failure is not None:
            return 1  # already logged with its traceback
        log.info("stopped", extra={"reason": self.stopped_by or "cancelled"})
        return 0

    async def _watch_signals(self, group: TaskGroup) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
            async for received in signals:
                self.stopped_by = signal.Signals(received).name
                log.info("received %s; stopping", self.stopped_by)
                self.notifier.stopping(f"stopping on {self.stopped_by}")
                group.cancel_scope.cancel()
                return

    def _failed(self, group: TaskGroup, name: str, err: Exception) -> None:
        log.error("%s failed; stopping the agent", name, exc_info=err)
        self.failure = err
        group.cancel_scope.cancel()

    def _child(self, group: TaskGroup, name: str, run: Callable[[], Awaitable[Any]]) -> None:
        async def supervised() -> None:
            try:
                await run()
            except Exception as err:
                self._failed(group, name, err)

        group.start_soon(supervised, name=name)

    async def _start_child(self, group: TaskGroup, name: str, run: Callable[..., Any]) -> None:
        """Like :meth:`_child` for a task that signals readiness; returns once it is ready.

        A failure before readiness is raised here (a start-up error); after it, it stops the
        agent like any child's.
        """

        async def supervised(*, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
            ready = False

            def started(value: None = None) -> None:
                nonlocal ready
                ready = True
                task_status.started()

            try:
                await run(task_status=_Started(started))
            except Exception as err:
                if not ready:
                    raise
                self._failed(group, name, err)

        await group.start(supervised, name=name)

    async def _start(self, stack: AsyncExitStack, group: TaskGroup) -> None:
        # Heavy imports live here so that `gpu-dra-agent --help` stays fast; the API side's
        # (aiohttp, kubernetes-asyncio) are loaded by connect_api, after the sockets are open.
        from agent.api_side import connect_api
        from agent.dra import build_devices
        from agent.dra.shares import parse_mode
        from agent.hardware.discovery import discover, nvml_session
        from agent.kube.deferred import (
            DeferredClaimReader,
            DeferredEventPoster,
            DeferredPublisher,
            Pending,
        )
        from agent.kube.interfaces import ClaimReader
        from agent.kubelet.plugin import KubeletPlugin
        from agent.node.engine import PrepareEngine

        config = self.config
        if config.metrics_address is not None:
            host, port = config.metrics_address
            try:
                endpoint = serve_metrics(host, port)
            except OSError as err:
                raise AgentError(
                    f"cannot serve metrics on {host}:{port} (--metrics-address): {err}"
                ) from err
            log.info("serving Prometheus metrics", extra={"url": endpoint.url})
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
        )
        report = await engine.start()
        stack.push_async_callback(engine.close)
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

        # The NVML event monitor runs from here on, before the kubelet sees a socket: an XID
        # in the first second is not lost, whatever the API server does. Its slice writes go
        # to the publisher once the API client exists, its Events wait in the queue, and the
        # unmonitored taint's effect follows the server's version when it is known.
        slices = DeferredPublisher()
        slice_writes_at_zero(config.driver_name)  # the publisher comes after the API client
        health = None
        if config.health_monitoring:
            from agent.health.wiring import build_health

            health = build_health(
                nvml=session.nvml,
                inventory=inventory,
                policy=config.health,
                node_name=config.node_name,
                publisher=slices,
                events=events,
                driver_name=config.driver_name,
                dynamic_mig=dynamic_mig,
                shares=shares,
            )
            self._child(group, "health monitor", health.monitor.run)
        if session.simulated is not None:
            from agent.sim.control import control_socket_path
            from agent.sim.control.server import SimulationControl

            control = SimulationControl(
                control_socket_path(config.plugin_dir), session.simulated.library
            )
            await self._start_child(group, "simulation control", control.run)

        plugin = KubeletPlugin(
            driver_name=config.driver_name,
            dra_socket=config.dra_socket,
            registration_socket=config.registration_socket,
            engine=engine,
            **({} if health is None else health.plugin_arguments()),
        )
        # returns once both sockets exist; a failure to open them is a start-up error
        await self._start_child(group, "kubelet plugin", plugin.run)
        # the second driver's sockets too (compute-domain.nvidia.com, agent/imex;
        # --compute-domains): its engine comes once the API client exists
        from agent.imex.sockets import open_sockets

        channels = await open_sockets(
            config, inventory, lambda name, run: self._start_child(group, name, run)
        )

        # the kubelet registers the plugin meanwhile; a prepare waits for the claim reader
        api = await connect_api(config, stack, pending_reader)
        self._child(group, "queued events", lambda: events.attach(api.events))
        if config.dynamic_mig:
            log.info(
                "dynamic MIG: %d partitionable GPU(s), %d device(s), slice layout %s",
                len(counter_sets),
                len(devices),
                api.slice_layout,
                extra={"held_back": held_back},
            )
        from agent.kube.publisher import SlicePublisher

        publisher = SlicePublisher(
            api.client,
            node_name=config.node_name,
            driver_name=config.driver_name,
            node_uid=api.node_uid,
            slice_layout=api.slice_layout,
            request_timeout=config.api_timeout_s,
        )
        publisher.set_devices(devices, counter_sets)
        if health is not None:
            health.monitor.set_unmonitored_effect(api.health_policy.unmonitored_effect)
        slices.attach(publisher)  # the health monitor's latest devices, if it set any
        self._child(group, "slice publisher", publisher.run)
        if channels is not None:
            from agent.imex.wiring import serve_compute_domains

            await serve_compute_domains(
                config,
                api.client,
                api.claim_reader,
                api.node_uid,
                channels,
                lambda name, run: self._child(group, name, run),
                lambda name, run: self._start_child(group, name, run),
            )
        self._child(
            group,
            "readiness notice",
            lambda: announce_ready(
                self.notifier,
                registered=lambda: plugin.registrar.registered is True,
                published=publisher.wait_converged,
                summary=f"ready: {len(devices)} device(s) of {config.driver_name} published, "
                "registered with the kubelet",
            ),
        )
        log.info(
            "ready",
            extra={
                "driver": config.driver_name,
                "dra_socket": str(config.dra_socket),
                "registration_socket": str(config.registration_socket),
            },
        )


class _Started:
    """A TaskStatus that tells the supervisor when its child became ready."""

    def __init__(self, on_started: Callable[[None], None]) -> None:
        self._on_started = on_started

    def started(self, value: None = None) -> None:
        self._on_started(value)


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
