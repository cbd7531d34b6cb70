"""The agent's settings: one frozen record, read from flags, the environment and a YAML file.

An operator sets the agent up through a DaemonSet (environment variables from the downward API,
flags in ``args``) or, on a bare host, through a config file; all three must agree on names and
meaning, and a wrong value must be reported before anything touches the host, naming where the
value came from (``--node-name``, ``NODE_NAME`` or the config file's key). Precedence is
flags > environment > config file > defaults. Nothing here performs I/O beyond reading the
config file and checking that named files exist.
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.config_values import ConfigError as ConfigError  # raised by load_config
from agent.config_values import (
    Value,
    boolean,
    choice,
    command,
    health_policy,
    host_port,
    ip_address,
    ldconfig_path,
    seconds_up_to,
    shares_mode,
)
from agent.config_values import parse_api_timeout as parse_api_timeout  # run and controller
from agent.dra.names import is_dns_subdomain
from agent.health.policy import HealthPolicy

DEFAULT_DRIVER_NAME = "gpu.nvidia.com"
DEFAULT_REGISTRAR_DIR = Path("/var/lib/kubelet/plugins_registry")
DEFAULT_PLUGINS_DIR = Path("/var/lib/kubelet/plugins")
DEFAULT_CDI_ROOT = Path("/var/run/cdi")
#: ``sun_path`` holds 108 bytes including the terminating NUL.
MAX_SOCKET_PATH_BYTES = 107
#: Directory under the plugin data directory where ``--simulate`` lays out its fake host.
SIMULATED_HOST_DIR = "simulated-host"
SIMULATED_DRIVER_ROOT = "driver-root"  # in the simulated host's directory
_MAX_DRIVER_NAME_LENGTH = 63
#: How partitionable devices are laid out in slices (docs/OPERATIONS.md, "Dynamic MIG"):
#: ``auto`` reads the API server's version (1.34: ``combined``, one slice per GPU with its
#: counters and devices; 1.35+: ``split``, a counters-only slice plus device slices).
SLICE_LAYOUTS = ("auto", "combined", "split")
DEVICE_ORDERS = ("packing", "names")  # agent.dra.order's (kept here: config imports no layer)
#: ``--compute-domains``: serve compute-domain.nvidia.com where the GPUs share a fabric clique
#: (``auto``), always (``on``: a node without a clique publishes no channel) or never.
COMPUTE_DOMAIN_MODES = ("auto", "on", "off")
#: The kubelet gives a prepare 45 s; waiting for the IMEX daemon must end well before.
MAX_IMEX_READY_TIMEOUT_S = 40.0
#: ``--api-timeout-seconds``: how long one API call waits for its answer. A claim read is part
#: of a prepare, which the kubelet gives 45 s, so it cannot usefully wait longer than this.
DEFAULT_API_TIMEOUT_S = 10.0
API_TIMEOUT_ENV = "GPU_DRA_API_TIMEOUT_SECONDS"
_INSTANCE_ID = re.compile(r"[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?")


@dataclass(frozen=True, slots=True)
class Setting:
    """One setting: its key (flag and config-file name), environment variable and default."""

    key: str
    env: str | None
    default: str | None
    is_path: bool = False

    @property
    def attribute(self) -> str:
        return self.key.replace("-", "_")

    @property
    def flag(self) -> str:
        return f"--{self.key}"


SETTINGS: tuple[Setting, ...] = (
    Setting("node-name", "NODE_NAME", None),
    Setting("kubeconfig", "KUBECONFIG", None, is_path=True),
    Setting("driver-name", None, DEFAULT_DRIVER_NAME),
    Setting("registrar-dir", "KUBELET_REGISTRAR_DIRECTORY_PATH", str(DEFAULT_REGISTRAR_DIR), True),
    Setting("plugins-dir", "KUBELET_PLUGINS_DIRECTORY_PATH", str(DEFAULT_PLUGINS_DIR), True),
    Setting("cdi-root", "CDI_ROOT", str(DEFAULT_CDI_ROOT), is_path=True),
    # driver-root and host-root default to "/" except in simulate mode (see load_config)
    Setting("driver-root", "NVIDIA_DRIVER_ROOT", None, is_path=True),
    # where the agent itself sees the driver root (a container mounts the host's elsewhere)
    Setting("driver-root-mount", "NVIDIA_DRIVER_ROOT_MOUNT", None, is_path=True),
    Setting("host-root", None, None, is_path=True),
    # the host's ldconfig, run by the common CDI spec's hook in each container ("none": no hook)
    Setting("ldconfig-path", "GPU_DRA_LDCONFIG_PATH", "/sbin/ldconfig"),
    Setting("simulate", "GPU_DRA_SIMULATE", None),
    Setting("instance-id", "POD_UID", None),
    # health monitoring (docs/ARCHITECTURE.md, "Data flow: a health event")
    Setting("health-monitoring", "GPU_DRA_HEALTH_MONITORING", "true"),
    Setting("health-xids", None, None),  # "79=NoExecute, 62=Ignore": laid over the defaults
    Setting("health-quarantine-seconds", None, None),
    # the Prometheus endpoint, HOST:PORT (docs/OBSERVABILITY.md); off unless given
    Setting("metrics-address", "GPU_DRA_METRICS_ADDRESS", None),
    # dynamic MIG (docs/OPERATIONS.md, "Dynamic MIG")
    Setting("dynamic-mig", "GPU_DRA_DYNAMIC_MIG", "false"),
    Setting("slice-layout", "GPU_DRA_SLICE_LAYOUT", "auto"),
    # the order devices are published in; first fit follows it (docs/OPERATIONS.md, "Packing")
    Setting("device-order", "GPU_DRA_DEVICE_ORDER", "names"),
    Setting("adopt-mig-instances", "GPU_DRA_ADOPT_MIG_INSTANCES", "false"),
    Setting("mig-mode-off-when-idle", "GPU_DRA_MIG_MODE_OFF_WHEN_IDLE", "true"),
    # KEP-5075 shares: disabled|memory|unlimited|<N> (docs/OPERATIONS.md, "Consumable shares")
    Setting("consumable-shares", "GPU_DRA_CONSUMABLE_SHARES", "disabled"),
    # KEP-5304 device metadata files (docs/OPERATIONS.md, "Device metadata")
    Setting("device-metadata", "GPU_DRA_DEVICE_METADATA", "false"),
    # ComputeDomains: the compute-domain.nvidia.com driver (docs/OPERATIONS.md, "ComputeDomains")
    Setting("compute-domains", "GPU_DRA_COMPUTE_DOMAINS", "auto"),
    Setting("imex-daemon-cmd", "GPU_DRA_IMEX_DAEMON_CMD", "nvidia-imex"),
    Setting("imex-ready-timeout-seconds", "GPU_DRA_IMEX_READY_TIMEOUT_SECONDS", "20"),
    Setting("node-ip", "NODE_IP", None),
    Setting("compute-domain-membership", "GPU_DRA_COMPUTE_DOMAIN_MEMBERSHIP", "cliques"),
    # KEP-5007 conditions on channel-0 (agent.imex.binding): auto = on from Kubernetes 1.36
    Setting("binding-conditions", "GPU_DRA_BINDING_CONDITIONS", "auto"),
    Setting("namespace", "POD_NAMESPACE", "gpu-dra-agent"),
    Setting("sim-fabric-dir", "GPU_DRA_SIM_FABRIC_DIR", None, is_path=True),
    # every API client's request timeout (watches: their connect and first answer)
    Setting("api-timeout-seconds", API_TIMEOUT_ENV, f"{DEFAULT_API_TIMEOUT_S:g}"),
)
_BY_KEY = {s.key: s for s in SETTINGS}


@dataclass(frozen=True, slots=True)
class AgentConfig:
    """Everything ``gpu-dra-agent run`` needs to know, validated; paths are absolute."""

    node_name: str
    kubeconfig: Path | None
    driver_name: str
    registrar_dir: Path
    plugins_dir: Path
    cdi_root: Path
    driver_root: Path  # on the host: what CDI specs name
    host_root: Path
    simulate: str | None
    instance_id: str | None
    health_monitoring: bool = True
    health: HealthPolicy = field(default_factory=HealthPolicy)
    driver_root_mount: Path | None = None  # where the agent reads it; None: at driver_root
    metrics_address: tuple[str, int] | None = None  # (host, port) of the Prometheus endpoint
    # dynamic MIG: publish partitionable devices, create instances on prepare
    dynamic_mig: bool = False
    slice_layout: str = "auto"  # one of SLICE_LAYOUTS
    device_order: str = "names"  # one of agent.dra.order.DEVICE_ORDERS
    adopt_mig_instances: bool = False  # may destroy MIG instances the agent did not create
    mig_mode_off_when_idle: bool = True  # Hopper+: MIG mode off when a GPU's last instance goes
    consumable_shares: str = "disabled"  # agent.dra.share_mode.parse_mode accepts it
    device_metadata: bool = False  # KEP-5304 metadata file and CDI mount per prepared request
    # ComputeDomains (agent/imex): the second driver, compute-domain.nvidia.com
    compute_domains: str = "auto"  # one of COMPUTE_DOMAIN_MODES
    imex_daemon_cmd: str = "nvidia-imex"
    imex_ready_timeout_s: float = 20.0
    node_ip: str | None = None  # where this node's IMEX daemon listens; else the Node's address
    membership: str = "cliques"  # ComputeDomainCliques, or the domain's status.nodes ("status")
    binding_conditions: str = "auto"  # auto|on|off (agent.imex.binding.binding_enabled)
    namespace: str = "gpu-dra-agent"  # the driver's namespace (ComputeDomainCliques live there)
    sim_fabric_dir: Path | None = None  # simulated IMEX peers find each other here
    api_timeout_s: float = DEFAULT_API_TIMEOUT_S  # each API call's bound (--api-timeout-seconds)
    ldconfig_path: str | None = "/sbin/ldconfig"  # the CDI ldcache hook's; None: no hook

    @property
    def driver_files(self) -> Path:
        """Where the agent finds the driver's files (the mount, or the driver root itself)."""
        return self.driver_root_mount or self.driver_root

    @property
    def plugin_dir(self) -> Path:
        """The driver's data directory: DRA socket, checkpoint, lock (same inside and outside
        the container, as the kubelet dials the socket by this path)."""
        return self.plugins_dir / self.driver_name

    @property
    def dra_socket(self) -> Path:
        name = f"dra-{self.instance_id}.sock" if self.instance_id else "dra.sock"
        return self.plugin_dir / name

    @property
    def registration_socket(self) -> Path:
        suffix = f"-{self.instance_id}" if self.instance_id else ""
        return self.registrar_dir / f"{self.driver_name}{suffix}-reg.sock"

    def sockets_of(self, driver: str) -> tuple[Path, Path]:
        """(DRA socket, registration socket) of another driver this process serves
        (compute-domain.nvidia.com), named like this driver's."""
        other = dataclasses.replace(self, driver_name=driver)
        return other.dra_socket, other.registration_socket


def read_config_file(path: Path) -> dict[str, str]:
    """The settings in a YAML config file, keyed like the flags (``node-name``)."""
    from agent import yamlload  # only with a config file

    try:
        document = yamlload.safe_load(path.read_text())
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror or err}") from err
    except yamlload.YAMLError as err:
        raise ConfigError(f"config file {path} is not valid YAML: {err}") from err
    if document is None:
        return {}
    if not isinstance(document, dict):
        raise ConfigError(
            f"config file {path} must be a mapping of settings (e.g. 'node-name: node-a'), "
            f"not a {type(document).__name__}"
        )
    settings: dict[str, str] = {}
    for raw_key, value in document.items():
        key = str(raw_key).replace("_", "-")
        if key not in _BY_KEY:
            known = ", ".join(s.key for s in SETTINGS)
            raise ConfigError(f"config file {path}: unknown key {raw_key!r}; known keys: {known}")
        if key in settings:
            raise ConfigError(f"config file {path}: key {raw_key!r} is given twice")
        if value is None or isinstance(value, dict | list):
            raise ConfigError(
                f"config file {path}: key {raw_key!r} needs a single value, got {value!r}"
            )
        settings[key] = str(value).lower() if isinstance(value, bool) else str(value)
    return settings


def _merge(
    flags: Mapping[str, Any],
    environ: Mapping[str, str],
    file_values: Mapping[str, str],
    path: Path | None,
) -> dict[str, Value]:
    merged: dict[str, Value] = {}
    for setting in SETTINGS:
        flag_value = flags.get(setting.attribute)
        if flag_value is not None:
            merged[setting.key] = Value(str(flag_value), setting.flag)
        elif setting.env is not None and environ.get(setting.env):
            merged[setting.key] = Value(environ[setting.env], setting.env)
        elif setting.key in file_values:
            merged[setting.key] = Value(file_values[setting.key], f"{path}: {setting.key}")
        elif setting.default is not None:
            merged[setting.key] = Value(setting.default, f"default of {setting.flag}")
    return merged


def _absolute(value: Value) -> Path:
    if not value.value.strip():
        raise ConfigError(f"{value.source} is empty; give a directory or file path")
    return Path(value.value).absolute()


def _check_socket_length(path: Path, sources: str) -> None:
    length = len(os.fsencode(path))
    if length > MAX_SOCKET_PATH_BYTES:
        raise ConfigError(
            f"socket path {path} is {length} bytes, more than the {MAX_SOCKET_PATH_BYTES} a unix "
            f"socket path may have; shorten {sources}"
        )


def load_config(
    flags: Mapping[str, Any],
    environ: Mapping[str, str] | None = None,
    config_file: Path | None = None,
) -> AgentConfig:
    """Merge the sources and validate; raise ConfigError naming the offending source.

    ``flags`` maps attribute names (``node_name``) to values, ``None`` meaning "not given".
    """
    environ = os.environ if environ is None else environ
    file_values = read_config_file(config_file) if config_file is not None else {}
    values = _merge(flags, environ, file_values, config_file)

    node = values.get("node-name")
    if node is None:
        raise ConfigError(
            "the node name is required: pass --node-name or set NODE_NAME (in a DaemonSet, from "
            "the downward API field spec.nodeName)"
        )
    if not is_dns_subdomain(node.value):
        raise ConfigError(
            f"{node.source} {node.value!r} is not a valid node name: it must be a lower-case DNS "
            "subdomain (letters, digits, '-' and '.', at most 253 characters); use the name "
            "`kubectl get nodes` shows"
        )
    driver = values["driver-name"]
    if not is_dns_subdomain(driver.value, _MAX_DRIVER_NAME_LENGTH):
        raise ConfigError(
            f"{driver.source} {driver.value!r} is not a valid DRA driver name: it must be a "
            f"lower-case DNS subdomain of at most {_MAX_DRIVER_NAME_LENGTH} characters, "
            "e.g. gpu.nvidia.com"
        )
    instance = values.get("instance-id")
    instance_id = instance.value.lower() if instance is not None else None
    if instance is not None and (instance_id is None or not _INSTANCE_ID.fullmatch(instance_id)):
        raise ConfigError(
            f"{instance.source} {instance.value!r} is not a valid instance id: use the pod UID "
            "(letters, digits and '-', at most 63 characters); it becomes part of socket names"
        )

    kubeconfig = None
    if "kubeconfig" in values:
        raw = values["kubeconfig"]
        if os.pathsep in raw.value:
            raise ConfigError(
                f"{raw.source} names several files ({raw.value}); the agent reads one kubeconfig"
            )
        kubeconfig = _absolute(raw)
        if not kubeconfig.is_file():
            raise ConfigError(f"{raw.source}: kubeconfig {kubeconfig} does not exist")

    simulate = values.get("simulate")
    if simulate is not None and not simulate.value.strip():
        raise ConfigError(f"{simulate.source} is empty; name a profile such as dgx-h100")

    plugins_dir = _absolute(values["plugins-dir"])
    plugin_dir = plugins_dir / driver.value
    simulated_root = plugin_dir / SIMULATED_HOST_DIR
    roots: dict[str, Path] = {}
    for key, simulated in (
        ("driver-root", simulated_root / SIMULATED_DRIVER_ROOT),
        ("host-root", simulated_root),
    ):
        if key in values:
            roots[key] = _absolute(values[key])
        else:
            roots[key] = simulated if simulate is not None else Path("/")

    config = AgentConfig(
        node_name=node.value,
        kubeconfig=kubeconfig,
        driver_name=driver.value,
        registrar_dir=_absolute(values["registrar-dir"]),
        plugins_dir=plugins_dir,
        cdi_root=_absolute(values["cdi-root"]),
        driver_root=roots["driver-root"],
        driver_root_mount=(
            _absolute(values["driver-root-mount"]) if "driver-root-mount" in values else None
        ),
        host_root=roots["host-root"],
        simulate=simulate.value if simulate is not None else None,
        instance_id=instance_id,
        health_monitoring=boolean(values["health-monitoring"]),
        health=health_policy(values),
        metrics_address=(
            host_port(values["metrics-address"]) if "metrics-address" in values else None
        ),
        dynamic_mig=boolean(values["dynamic-mig"]),
        slice_layout=choice(values["slice-layout"], SLICE_LAYOUTS),
        device_order=choice(values["device-order"], DEVICE_ORDERS),
        adopt_mig_instances=boolean(values["adopt-mig-instances"]),
        mig_mode_off_when_idle=boolean(values["mig-mode-off-when-idle"]),
        consumable_shares=shares_mode(values["consumable-shares"]),
        device_metadata=boolean(values["device-metadata"]),
        compute_domains=choice(values["compute-domains"], COMPUTE_DOMAIN_MODES),
        imex_daemon_cmd=command(values["imex-daemon-cmd"]),
        imex_ready_timeout_s=seconds_up_to(
            values["imex-ready-timeout-seconds"], MAX_IMEX_READY_TIMEOUT_S
        ),
        node_ip=ip_address(values["node-ip"]) if "node-ip" in values else None,
        membership=choice(values["compute-domain-membership"], ("cliques", "status")),
        binding_conditions=choice(values["binding-conditions"], ("auto", "on", "off")),
        namespace=values["namespace"].value,
        sim_fabric_dir=_absolute(values["sim-fabric-dir"]) if "sim-fabric-dir" in values else None,
        api_timeout_s=parse_api_timeout(
            values["api-timeout-seconds"].value, values["api-timeout-seconds"].source
        ),
        ldconfig_path=ldconfig_path(values["ldconfig-path"]),
    )
    _check_socket_length(
        config.dra_socket, f"{values['plugins-dir'].source}, the driver name or the instance id"
    )
    _check_socket_length(
        config.registration_socket,
        f"{values['registrar-dir'].source}, the driver name or the instance id",
    )
    return config
