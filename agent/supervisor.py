"""The supervisor: wires the agent's parts together under one anyio task group.

Start-up runs in a fixed order. The kubelet's two sockets open first (the DRA socket, then the
registration socket): the kubelet's first call, GetInfo, needs only the driver's name and
versions, and the DRA service answers with a stand-in for the prepare engine
(:mod:`agent.kubelet.deferred`: a prepare waits for the engine, within a bound) and a health
stream that sends nothing until the monitor has looked (:mod:`agent.health.front`). Then the
GPUs are discovered (simulated or real), the prepare engine starts (it reloads and reconciles
the checkpoint) and is handed to the waiting service, and the health monitor starts (NVML
events are watched from here on); where this node serves ComputeDomains, the second driver's
sockets open (:mod:`agent.imex.sockets`). With ``--metrics-address`` the Prometheus endpoint's
address is bound first thing, and the endpoint answers from here on: every enabled feature's
series exists now (at 0 where nothing was recorded), so a scrape either fails to connect or
sees all of them, whatever the API server does. Only then is the API side made
(:mod:`agent.api_side`: the HTTP stack is loaded, the client made, the Node's uid and the
server's version read); until the client exists, a prepare's claim read waits for it (within
the read's timeout), an Event waits in a queue and the health monitor's taints wait for the
slice publisher (:mod:`agent.kube.deferred`). The slice publisher and the second driver's
engine follow. They, the health monitor and the kubelet plugins then run as children of the
task group until SIGTERM or SIGINT, with, in simulate mode, the fault-injection control socket.

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
from agent.telemetry.meter_provider import (
    configure_metrics,
    open_metrics,
    serve_metrics,
    shutdown_metrics,
)
from agent.telemetry.metrics import slice_writes_at_zero
from agent.telemetry.tracing import configure_tracing, shutdown_tracing

log = logging.getLogger("agent.supervisor")


async def _settle_heap_when(
    published: Callable[[], Awaitable[None]], registered: Callable[[], bool]
) -> None:
    """Freeze the objects start-up made (agent/memory.py) once the first publish converged and
    the kubelet registered the plugin: later full collections, which a prepare may trigger,
    no longer walk them. Not sooner, so that the collection it starts with (tens of
    milliseconds) never delays the registration."""
    from agent.memory import settle_heap

    await published()
    while not registered():  # noqa: ASYNC110  (the registrar has a flag, not an event)
        await anyio.sleep(0.1)
    log.info("heap settled after start-up", extra={"frozen_objects": settle_heap()})


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
        from agent.kubelet.deferred import DeferredPreparer
        from agent.kubelet.plugin import KubeletPlugin

        config = self.config
        if config.metrics_address is not None:
            # bound now (an address in use stops the start here), answering once the series
            # of every enabled feature exist (_open_metrics): never a scrape with part of them
            try:
                serve_metrics(*config.metrics_address, listen=False)
            except OSError as err:
                raise self._metrics_error(err) from err

        # The kubelet's sockets first: GetInfo needs nothing but the driver's name and versions
        # (agent.kubelet.deferred). A prepare waits for the engine made below, the health
        # stream for the monitor's first look at the GPUs (agent.health.front).
        preparer = DeferredPreparer(f"the {config.driver_name} prepare engine")
        front = None
        if config.health_monitoring:
            from agent.health.front import build_health_front

            front = build_health_front(
                policy=config.health, node_name=config.node_name, driver_name=config.driver_name
            )
        plugin = KubeletPlugin(
            driver_name=config.driver_name,
            dra_socket=config.dra_socket,
            registration_socket=config.registration_socket,
            engine=preparer,
            **({} if front is None else front.plugin_arguments()),
        )
        # returns once both sockets exist; a failure to open them is a start-up error
        await self._start_child(group, "kubelet plugin", plugin.run)
        channels = None
        if config.compute_domains == "on":  # the second driver's too: no GPU needed to decide
            from agent.imex.sockets import open_sockets

            channels = await open_sockets(
                config, None, lambda name, run: self._start_child(group, name, run)
            )
        try:
            await self._start_node(stack, group, plugin, preparer, front, channels)
        except BaseException as err:
            why = (
                "the agent stopped before its engine started"
                if isinstance(err, anyio.get_cancelled_exc_class())
                else f"the agent failed to start: {err!r}"
            )
            for waiting in (preparer, channels):
                if waiting is not None:
                    waiting.fail(why)  # calls waiting for an engine get this at once
            raise

    async def _start_node(
        self,
        stack: AsyncExitStack,
        group: TaskGroup,
        plugin: Any,
        preparer: Any,
        front: Any,
        channels: Any,
    ) -> None:
        """Everything after the kubelet's sockets: the GPUs, the engine (handed to the waiting
        DRA service), the health monitor, the second driver, then the API side."""
        # Heavy imports live here so that `gpu-dra-agent --help` and the kubelet's first
        # answer stay fast: loaded in a worker thread, so that the event loop answers the
        # kubelet's registration meanwhile (the API side's, aiohttp and kubernetes-asyncio,
        # are loaded by connect_api the same way; agent/threadload.py).
        from agent.node_side import load_node_modules, start_engine
        from agent.threadload import load_in_thread

        await load_in_thread(load_node_modules, self.config)
        from agent.api_side import connect_api
        from agent.kube.deferred import DeferredPublisher

        config = self.config
        node = await start_engine(config, stack, preparer)
        session, inventory, devices = node.session, node.inventory, node.devices
        counter_sets, held_back, events = node.counter_sets, node.held_back, node.events

        # The NVML event monitor runs from here on, before the API side: an XID in the first
        # second is not lost, whatever the API server does, and its first look is the health
        # stream's first list. Its slice writes go to the publisher once the API client
        # exists, its Events wait in the queue, and the unmonitored taint's effect follows the
        # server's version when it is known.
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
                dynamic_mig=node.dynamic_mig,
                shares=node.shares,
                front=front,
            )
            self._child(group, "health monitor", health.monitor.run)
        if session.simulated is not None:
            from agent.sim.control import control_socket_path
            from agent.sim.control.server import SimulationControl

            control = SimulationControl(
                control_socket_path(config.plugin_dir), session.simulated.library
            )
            await self._start_child(group, "simulation control", control.run)

        if channels is None:
            # the second driver's sockets (compute-domain.nvidia.com, agent/imex), where
            # --compute-domains=auto finds the GPUs in a fabric clique (or off: logged): its
            # engine comes once the API client exists
            from agent.imex.sockets import open_sockets

            channels = await open_sockets(
                config, inventory, lambda name, run: self._start_child(group, name, run)
            )

        self._open_metrics()  # every series exists now, at 0 where nothing was recorded
        # the kubelet registers the plugin meanwhile; a prepare waits for the claim reader
        api = await connect_api(config, stack, node.pending_reader)
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
            device_order=config.device_order,  # type: ignore[arg-type]  # checked by config
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
                inventory,
                api.client,
                api.claim_reader,
                api.node_uid,
                channels,
                lambda name, run: self._child(group, name, run),
                lambda name, run: self._start_child(group, name, run),
                server_version=api.version,
            )
        self._child(
            group,
            "heap settling",
            lambda: _settle_heap_when(
                publisher.wait_converged, lambda: plugin.registrar.registered is True
            ),
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

    def _open_metrics(self) -> None:
        """The Prometheus endpoint answers from here on (with --metrics-address): the node
        side's series exist (the engine's, the effectors', the health monitor's first look,
        the second driver's), and the API side's were exported at 0 ahead of it."""
        try:
            endpoint = open_metrics()
        except OSError as err:
            raise self._metrics_error(err) from err
        if endpoint is not None:
            log.info("serving Prometheus metrics", extra={"url": endpoint.url})

    def _metrics_error(self, err: OSError) -> AgentError:
        host, port = self.config.metrics_address or ("", 0)
        return AgentError(f"cannot serve metrics on {host}:{port} (--metrics-address): {err}")


class _Started:
    """A TaskStatus that tells the supervisor when its child became ready."""

    def __init__(self, on_started: Callable[[None], None]) -> None:
        self._on_started = on_started

    def started(self, value: None = None) -> None:
        self._on_started(value)
