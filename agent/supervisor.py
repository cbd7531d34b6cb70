"""The supervisor: wires the agent's parts together under one anyio task group.

Start-up runs in a fixed order, because each step needs the one before and the kubelet must
never see a socket whose engine cannot answer: discover the GPUs (simulated or real), connect
to the API server, start the prepare engine (it reloads and reconciles the checkpoint), and
only then open the DRA socket and, after it, the registration socket. The slice publisher and
the kubelet plugin then run as children of the task group until SIGTERM or SIGINT, with the
health monitor (on by default) and, in simulate mode, the fault-injection control socket.

A child that fails is logged and brings the whole process down cleanly (sockets removed,
engine closed, exit status 1): systemd or the DaemonSet restarts it, and the checkpoint makes
the restart harmless. Nothing is fire-and-forget.
"""

from __future__ import annotations

import dataclasses
import logging
import signal
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import anyio
from anyio.abc import TaskGroup, TaskStatus

from agent.config import AgentConfig
from agent.errors import AgentError
from agent.health.policy import HealthPolicy
from agent.notify import SystemdNotifier, announce_ready
from agent.telemetry.meter_provider import configure_metrics, serve_metrics, shutdown_metrics
from agent.telemetry.tracing import configure_tracing, shutdown_tracing

log = logging.getLogger("agent.supervisor")

#: Bound on the best-effort start-up reads (the Node's uid names the slices' owner and Event
#: target; the server's version picks a taint effect and the slice layout), even when
#: ``--api-timeout-seconds`` is longer.
NODE_LOOKUP_TIMEOUT = 5.0


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
        # Heavy imports live here so that `gpu-dra-agent --help` stays fast.
        from agent.dra import build_devices
        from agent.dra.shares import parse_mode
        from agent.hardware.discovery import discover, nvml_session
        from agent.kube.claims import ApiClaimReader
        from agent.kube.client import create_api_client
        from agent.kube.events import DEFAULT_TIMEOUT_S as EVENT_TIMEOUT_S
        from agent.kube.events import ApiEventPoster
        from agent.kube.publisher import SlicePublisher
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

        api_client = await create_api_client(config.kubeconfig)
        stack.push_async_callback(api_client.close)
        timeout = config.api_timeout_s  # --api-timeout-seconds: every API client below
        node_uid = await _node_uid(api_client, config.node_name, timeout)
        health_policy = await _health_policy_for_server(api_client, config.health, timeout)
        events = ApiEventPoster(
            api_client,
            config.node_name,
            node_uid=node_uid,
            timeout_s=min(timeout, EVENT_TIMEOUT_S),  # best effort: never held longer
        )

        claim_reader = ApiClaimReader(api_client, timeout_s=timeout)
        stack.push_async_callback(claim_reader.close)  # before the client it borrows from
        effectors: list[Any] = []  # agent.node.effectors.DeviceEffector, in order
        if config.dynamic_mig:  # MIG instances made on prepare (agent/mig)
            from agent.hardware.mig_ops import MigOps
            from agent.mig import MigEffector

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
        engine = PrepareEngine(
            driver=config.driver_name,
            node_name=config.node_name,
            inventory=inventory,
            plugin_dir=config.plugin_dir,
            cdi_root=config.cdi_root,
            host_root=config.host_root,
            driver_root=config.driver_root,
            driver_root_mount=config.driver_files,
            claim_reader=claim_reader,
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
        slice_layout: Any = "split"
        if config.dynamic_mig:  # after start: the checkpoint says which instances are ours
            from agent.dra import build_device_set

            dynamic_mig = _dynamic_mig_settings(engine.checkpoint, config.adopt_mig_instances)
            if report.rolled_back:  # recovery destroyed what a crash made: read the GPUs again
                inventory = await discover(session.nvml, config.host_root)
            device_set = build_device_set(inventory, dynamic_mig=dynamic_mig, shares=shares)
            devices, counter_sets = list(device_set.devices), device_set.counter_sets
            slice_layout = await _slice_layout_for_server(api_client, config.slice_layout, timeout)
            log.info(
                "dynamic MIG: %d partitionable GPU(s), %d device(s), slice layout %s",
                len(counter_sets),
                len(devices),
                slice_layout,
                extra={"held_back": list(device_set.held_back)},
            )
        publisher = SlicePublisher(
            api_client,
            node_name=config.node_name,
            driver_name=config.driver_name,
            node_uid=node_uid,
            slice_layout=slice_layout,
            request_timeout=timeout,
        )
        publisher.set_devices(devices, counter_sets)
        self._child(group, "slice publisher", publisher.run)

        health = None
        if config.health_monitoring:
            from agent.health.wiring import build_health

            health = build_health(
                nvml=session.nvml,
                inventory=inventory,
                policy=health_policy,
                node_name=config.node_name,
                publisher=publisher,
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
        # the second driver, compute-domain.nvidia.com (agent/imex; --compute-domains)
        from agent.imex.wiring import serve_compute_domains

        await serve_compute_domains(
            config,
            inventory,
            api_client,
            claim_reader,
            node_uid,
            stack,
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


async def _health_policy_for_server(
    api_client: Any, policy: HealthPolicy, api_timeout_s: float = NODE_LOOKUP_TIMEOUT
) -> HealthPolicy:
    """``policy`` with the ``unmonitored`` taint effect the API server accepts (``None`` from
    1.35 on, else ``NoSchedule``; an unreadable version gets ``NoSchedule``, valid everywhere)."""
    from agent.health.policy import unmonitored_effect_for
    from agent.kube.rawapi import RawSliceApi

    version: tuple[int, int] | None = None
    try:
        with anyio.fail_after(NODE_LOOKUP_TIMEOUT):
            version = await RawSliceApi(
                api_client, request_timeout=api_timeout_s
            ).read_server_version()
    except Exception as err:  # best effort: the safe effect is valid on every version
        log.warning("could not read the API server's version: %s", err)
    effect = unmonitored_effect_for(version)
    log.info(
        "API server %s: the unmonitored taint's effect is %s",
        "version unknown" if version is None else f"v{version[0]}.{version[1]}",
        effect,
    )
    return dataclasses.replace(policy, unmonitored_effect=effect)


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


async def _slice_layout_for_server(
    api_client: Any, configured: str, api_timeout_s: float = NODE_LOOKUP_TIMEOUT
) -> str:
    """``--slice-layout``: as configured, or for ``auto`` the layout the API server's version
    accepts (``combined`` on 1.34, ``split`` from 1.35; ``split`` when unreadable)."""
    from agent.dra.slices import layout_for_version
    from agent.kube.rawapi import RawSliceApi

    if configured != "auto":
        return configured
    version: tuple[int, int] | None = None
    try:
        with anyio.fail_after(NODE_LOOKUP_TIMEOUT):
            version = await RawSliceApi(
                api_client, request_timeout=api_timeout_s
            ).read_server_version()
    except Exception as err:
        log.warning("could not read the API server's version for the slice layout: %s", err)
    return layout_for_version(version)


async def _node_uid(
    api_client: Any, node_name: str, api_timeout_s: float = NODE_LOOKUP_TIMEOUT
) -> str | None:
    """The Node's uid, or None when it cannot be read now (the publisher retries on its own)."""
    from agent.kube.rawapi import RawSliceApi

    try:
        with anyio.fail_after(NODE_LOOKUP_TIMEOUT):
            return await RawSliceApi(api_client, request_timeout=api_timeout_s).read_node_uid(
                node_name
            )
    except Exception as err:  # best effort: events then name the node without its uid
        log.warning("could not read Node %s: %s", node_name, err)
        return None
