"""Wiring the second driver, ``compute-domain.nvidia.com``, into the agent's process.

Before the API side, :func:`agent.imex.sockets.open_sockets` decides whether to serve at all
(``--compute-domains``: ``auto`` only where the GPUs share a usable fabric clique, ``on``
always, ``off`` never; the reason is logged either way) and opens the driver's kubelet
sockets. Once the API client exists the supervisor calls :func:`serve_compute_domains`: it
finds the node's IMEX address, installs the simulated IMEX tools in simulate mode, starts the
driver's own parts as children of the supervisor's task group (the channel engine with its
IMEX daemon, the slice publisher: ``channel-0`` or, without a clique, no device) and hands the
engine to the sockets' stand-in.
"""

from __future__ import annotations

import hashlib
import logging
import shutil
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio

from agent.config import AgentConfig
from agent.errors import describe
from agent.hardware.inventory import Inventory
from agent.imex import metrics
from agent.imex.binding import ChannelBinder, binding_enabled
from agent.imex.clique_watch import CliqueWatch
from agent.imex.cliques import CliqueApi
from agent.imex.config import DRIVER
from agent.imex.daemon import ImexDaemon
from agent.imex.domains import DomainApi
from agent.imex.engine import ChannelEngine
from agent.imex.fabric import Clique, channel_devices, node_clique
from agent.imex.membership import CliqueMembership, Membership, StatusMembership
from agent.imex.sockets import DeferredChannelPreparer
from agent.kube.backoff import Backoff, is_transient, retry_after
from agent.kube.rawcall import send

log = logging.getLogger(__name__)

#: The ``nvidia-caps-imex-channels`` major of a simulated host's ``/proc/devices``.
SIM_CHANNELS_MAJOR = 236
Child = Callable[[str, Callable[[], Awaitable[Any]]], None]
StartChild = Callable[[str, Callable[..., Any]], Awaitable[None]]


async def serve_compute_domains(
    config: AgentConfig,
    inventory: Inventory,
    api_client: Any,
    claim_reader: Any,
    node_uid: str | None,
    preparer: DeferredChannelPreparer,
    child: Child,
    start_child: StartChild,
    *,
    server_version: tuple[int, int] | None = None,
) -> ChannelEngine:
    """Start the driver whose sockets :func:`agent.imex.sockets.open_sockets` opened; returns
    its engine, which ``preparer`` now answers the kubelet with."""
    from agent.kube.publisher import SlicePublisher

    clique = preparer.clique if preparer.clique is not None else node_clique(inventory)
    preparer.clique = clique
    plugin_dir = config.plugins_dir / DRIVER
    node_ip = config.node_ip or await _node_address(
        api_client, config.node_name, config.api_timeout_s
    )
    if node_ip is None and config.simulate is not None:
        node_ip = simulated_address(config.node_name)
    if node_ip is None and clique.clique is not None:
        clique = Clique(
            None,
            f"no address for this node's IMEX daemon: Node {config.node_name} has no "
            "InternalIP and --node-ip is not set",
        )
    if clique.clique is None:
        log.warning("%s publishes no IMEX channel: %s", DRIVER, clique.reason)
    else:
        log.info("serving %s: fabric clique %s, IMEX address %s", DRIVER, clique.clique, node_ip)
    daemon_cmd, ctl_cmd = _imex_commands(config, plugin_dir)
    daemon = ImexDaemon(
        plugin_dir / "domains", [daemon_cmd], [ctl_cmd], on_change=metrics.daemon_changed
    )
    domains = DomainApi(api_client, request_timeout=config.api_timeout_s)
    membership: Membership = (
        CliqueMembership(
            domains,
            CliqueApi(api_client, domains.call, config.namespace),
            CliqueWatch(
                api_client, domains.call, config.namespace, request_timeout=config.api_timeout_s
            ),
        )
        if config.membership == "cliques"
        else StatusMembership(domains)
    )
    engine = ChannelEngine(
        node_name=config.node_name,
        plugin_dir=plugin_dir,
        cdi_root=config.cdi_root,
        host_root=config.host_root,
        clique=clique,
        node_ip=node_ip or "",
        claim_reader=claim_reader,
        domains=domains,
        daemon=daemon,
        membership=membership,
        ready_timeout_s=config.imex_ready_timeout_s,
    )
    try:
        await engine.start()
    except Exception as error:
        preparer.fail(f"the {DRIVER} engine did not start: {error}")
        raise  # a start-up error: the supervisor stops the process
    await start_child("channel engine", engine.run)
    binding, why = binding_enabled(config.binding_conditions, server_version)
    log.info("binding conditions on channel-0: %s (%s)", "on" if binding else "off", why)
    if binding and clique.clique is not None:
        from agent.kube.library import ResourceV1Api

        binder = ChannelBinder(
            node_name=config.node_name,
            engine=engine,
            resource_api=ResourceV1Api(api_client),
            call=domains.call,
            request_timeout=config.api_timeout_s,
        )
        child("channel binder", binder.run)
    publisher = SlicePublisher(
        api_client,
        node_name=config.node_name,
        driver_name=DRIVER,
        node_uid=node_uid,
        request_timeout=config.api_timeout_s,
    )
    publisher.set_devices(channel_devices(clique.clique, binding_conditions=binding))
    child("channel slice publisher", publisher.run)
    preparer.attach(engine)
    dra_socket, _ = config.sockets_of(DRIVER)
    log.info(
        "ready",
        extra={"driver": DRIVER, "dra_socket": str(dra_socket), "clique": clique.clique or ""},
    )
    return engine


def simulated_address(node_name: str) -> str:
    """A stable loopback address for a simulated node without one (127.x.y.z by name)."""
    digest = hashlib.sha256(node_name.encode()).digest()
    return f"127.{digest[0]}.{digest[1]}.{max(digest[2], 1)}"


def _imex_commands(config: AgentConfig, plugin_dir: Path) -> tuple[str, str]:
    """The daemon and ``nvidia-imex-ctl`` commands: a path as given; a bare name from the
    driver root's ``usr/bin`` (in simulate mode, the simulated tools), else from PATH."""
    search = [config.driver_files / "usr/bin"]
    if config.simulate is not None:
        from agent.imex.simulated import add_channel_major, install_tools

        sim_bin = config.host_root / "driver-root"
        fabric = config.sim_fabric_dir or plugin_dir / "sim-fabric"
        install_tools(sim_bin, fabric, config.node_name)
        add_channel_major(config.host_root, SIM_CHANNELS_MAJOR)
        search.insert(0, sim_bin / "usr/bin")
        log.info("simulated IMEX daemon and nvidia-imex-ctl, fabric directory %s", fabric)
    daemon = config.imex_daemon_cmd
    if "/" in daemon:
        return daemon, str(Path(daemon).with_name("nvidia-imex-ctl"))

    def find(name: str) -> str:
        for directory in search:
            if (directory / name).is_file():
                return str(directory / name)
        return shutil.which(name) or name  # a missing tool fails the prepare, naming it

    return find(daemon), find("nvidia-imex-ctl")


async def _node_address(api_client: Any, node_name: str, request_timeout: float) -> str | None:
    """The Node's InternalIP; None when the Node has none or cannot be read for good (403, a
    Node that is not a JSON object). A transient failure (429, 5xx, a dropped connection, a
    Node not registered yet) is retried, never sooner than the server's ``Retry-After``: a
    node that gave up here would publish no channel until restarted."""
    from agent.kube.library import CoreV1Api

    read_node = CoreV1Api(api_client).read_node
    backoff = Backoff(initial=0.2, maximum=5.0)
    while True:
        try:
            node = await send(read_node, node_name, request_timeout=request_timeout)
            break
        except Exception as error:
            if not is_transient(error) or isinstance(error, ValueError):
                log.warning("could not read Node %s for its address: %s", node_name, error)
                return None
            delay = backoff.next_delay(retry_after(error))
            log.warning(
                "could not read Node %s for its address yet: %s; again in %.1f s",
                node_name,
                describe(error),
                delay,
            )
        await anyio.sleep(delay)
    for address in (node.get("status") or {}).get("addresses") or []:
        if isinstance(address, dict) and address.get("type") == "InternalIP":
            if address.get("address"):
                return str(address["address"])
    return None
