"""Run the kubelet plugin: publish this host's GPUs and prepare them for the kubelet's pods.

This is the agent's main job on a GPU host (``gpu-dra-agent run``). This module only declares
the flags and hands over: settings are merged and validated in :mod:`agent.config` (flags >
environment > config file > defaults), and the process is wired in :mod:`agent.supervisor`.
Flags default to ``None`` here so that the loader can tell "not given" from "given as the
default" and let the environment and the config file fill in.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from agent.switches import add_switch

EPILOG = """\
environment variables (used when the flag is absent): NODE_NAME, KUBECONFIG,
KUBELET_REGISTRAR_DIRECTORY_PATH, KUBELET_PLUGINS_DIRECTORY_PATH, CDI_ROOT,
NVIDIA_DRIVER_ROOT, GPU_DRA_SIMULATE, POD_UID, GPU_DRA_METRICS_ADDRESS, GPU_DRA_DYNAMIC_MIG,
GPU_DRA_SLICE_LAYOUT, GPU_DRA_ADOPT_MIG_INSTANCES, GPU_DRA_MIG_MODE_OFF_WHEN_IDLE,
GPU_DRA_COMPUTE_DOMAINS, GPU_DRA_IMEX_DAEMON_CMD, GPU_DRA_IMEX_READY_TIMEOUT_SECONDS, NODE_IP,
GPU_DRA_SIM_FABRIC_DIR, GPU_DRA_API_TIMEOUT_SECONDS; tracing and metrics
push: the standard OTEL_* variables (docs/OBSERVABILITY.md).

example (no GPU, no cluster):
  gpu-dra-agent run --simulate dgx-h100 --node-name node-a --kubeconfig k.yaml \\
      --registrar-dir /tmp/r --plugins-dir /tmp/p --cdi-root /tmp/cdi
"""


def configure_parser(parser: argparse.ArgumentParser) -> None:
    """Add the ``run`` options to ``parser`` (cheap: no agent modules imported)."""
    parser.epilog = EPILOG
    add = parser.add_argument
    add("--config", type=Path, metavar="FILE", help="YAML file with the settings below")
    add("--node-name", help="Kubernetes node name; also the pool name [NODE_NAME] (required)")
    add("--kubeconfig", help="kubeconfig file [KUBECONFIG] (default: in-cluster config)")
    add("--driver-name", help="DRA driver name (default: gpu.nvidia.com)")
    add(
        "--registrar-dir",
        help="kubelet plugin registry directory [KUBELET_REGISTRAR_DIRECTORY_PATH] "
        "(default: /var/lib/kubelet/plugins_registry)",
    )
    add(
        "--plugins-dir",
        help="kubelet plugins directory; the DRA socket goes in <dir>/<driver>/ "
        "[KUBELET_PLUGINS_DIRECTORY_PATH] (default: /var/lib/kubelet/plugins)",
    )
    add("--cdi-root", help="directory for CDI spec files [CDI_ROOT] (default: /var/run/cdi)")
    add(
        "--driver-root",
        help="where the NVIDIA driver files are [NVIDIA_DRIVER_ROOT] (default: /, or the "
        "simulated host's driver-root directory with --simulate)",
    )
    add(
        "--driver-root-mount",
        help="where this process sees the driver root, when it is mounted elsewhere than on "
        "the host (a container) [NVIDIA_DRIVER_ROOT_MOUNT] (default: the --driver-root path)",
    )
    add(
        "--host-root",
        help="where the host's /proc and /sys are (default: /, or <plugins-dir>/<driver>/"
        "simulated-host with --simulate)",
    )
    add(
        "--ldconfig-path",
        metavar="PATH",
        help="the host's ldconfig, which the common CDI spec's createContainer hook runs on "
        "each GPU container's root file system (ldconfig -r) so that its loader cache lists "
        "the driver libraries; needs /bin/sh on the host; none: no hook "
        "[GPU_DRA_LDCONFIG_PATH] (default: /sbin/ldconfig)",
    )
    add(
        "--simulate",
        metavar="PROFILE",
        help="run on a simulated host: a shipped profile name (dgx-h100, ...) or a profile "
        "file [GPU_DRA_SIMULATE]",
    )
    add(
        "--instance-id",
        help="unique id for the socket names, for overlapping instances in a rolling update "
        "[POD_UID]",
    )
    add_switch(
        parser,
        "health-monitoring",
        default=None,
        help="watch the GPUs (XID, ECC, lost GPU) and taint unhealthy devices "
        "[GPU_DRA_HEALTH_MONITORING] (default: true)",
    )
    add(
        "--health-xids",
        metavar="LIST",
        help='XID actions laid over the defaults, e.g. "79=NoExecute, 62=Ignore"',
    )
    add(
        "--health-quarantine-seconds",
        metavar="N",
        help="how long a NoSchedule XID taint stays after the last occurrence (default: 300)",
    )
    add(
        "--metrics-address",
        metavar="HOST:PORT",
        help="serve Prometheus metrics on this address, e.g. 0.0.0.0:9464 "
        "[GPU_DRA_METRICS_ADDRESS] (default: off)",
    )
    add_switch(
        parser,
        "dynamic-mig",
        default=None,
        help="publish every MIG placement of MIG-capable GPUs as partitionable devices and "
        "create the MIG instance when a claim for one is prepared [GPU_DRA_DYNAMIC_MIG] "
        "(default: false)",
    )
    add(
        "--slice-layout",
        metavar="auto|combined|split",
        help="with --dynamic-mig: one slice per GPU with its counters (combined, Kubernetes "
        "1.34) or counters in a slice of their own (split, 1.35+); auto asks the API server "
        "[GPU_DRA_SLICE_LAYOUT] (default: auto)",
    )
    add(
        "--device-order",
        metavar="packing|names",
        help="the order devices are published in, which kube-scheduler's first fit follows: "
        "names sorts device names (smallest placement start first), as the incumbent driver "
        "does; packing lists MIG placements GPU by GPU, small profiles from the high placement "
        "starts, then whole GPUs (2.7-3.4 points more of a cluster allocated on openb traces; "
        "docs/OPERATIONS.md, Packing) [GPU_DRA_DEVICE_ORDER] (default: names)",
    )
    add_switch(
        parser,
        "adopt-mig-instances",
        default=None,
        help="with --dynamic-mig: treat MIG instances the agent did not create as its own "
        "(they may be destroyed when unused) [GPU_DRA_ADOPT_MIG_INSTANCES] (default: false)",
    )
    add_switch(
        parser,
        "mig-mode-off-when-idle",
        default=None,
        help="with --dynamic-mig: turn MIG mode off on a Hopper or newer GPU when its last "
        "instance is gone [GPU_DRA_MIG_MODE_OFF_WHEN_IDLE] (default: true)",
    )
    add_switch(
        parser,
        "device-metadata",
        default=None,
        help="KEP-5304: per prepared request, a metadata file of its devices mounted into the "
        "containers at /var/run/kubernetes.io/dra-device-attributes/... by CDI "
        "[GPU_DRA_DEVICE_METADATA] (default: false)",
    )
    add(
        "--consumable-shares",
        metavar="disabled|memory|unlimited|N",
        help="publish full GPUs and static MIG devices for several claims at once (KEP-5075): "
        "shares ask for memory (memory: default the whole GPU; unlimited: default none) or "
        "one of N shares [GPU_DRA_CONSUMABLE_SHARES] (default: disabled)",
    )
    add(
        "--compute-domains",
        metavar="auto|on|off",
        help="serve the compute-domain.nvidia.com driver (ComputeDomains over IMEX): auto where "
        "the GPUs share a fabric clique, on always (a node without a clique publishes no "
        "channel), off never [GPU_DRA_COMPUTE_DOMAINS] (default: auto)",
    )
    add(
        "--imex-daemon-cmd",
        metavar="CMD",
        help="the IMEX daemon to run for a ComputeDomain (a name is looked for in the driver "
        "root's usr/bin, then on PATH; nvidia-imex-ctl is taken from the same place) "
        "[GPU_DRA_IMEX_DAEMON_CMD] (default: nvidia-imex)",
    )
    add(
        "--imex-ready-timeout-seconds",
        metavar="N",
        help="how long a channel prepare waits for the IMEX daemon to be READY before it "
        "fails (retryably) [GPU_DRA_IMEX_READY_TIMEOUT_SECONDS] (default: 20, at most 40)",
    )
    add(
        "--binding-conditions",
        metavar="auto|on|off",
        help="publish channel-0 with KEP-5007 binding conditions (IMEXDaemonReady, "
        "IMEXDaemonFailed) and prepare a channel claim as soon as it is allocated here, so "
        "the scheduler binds its pod only once this node's IMEX daemon is READY and moves it "
        "elsewhere if it cannot be; auto: on when the API server is 1.36 or newer "
        "[GPU_DRA_BINDING_CONDITIONS] (default: auto)",
    )
    add(
        "--node-ip",
        metavar="IP",
        help="the address this node's IMEX daemon listens on [NODE_IP] (default: the Node's "
        "InternalIP)",
    )
    add(
        "--compute-domain-membership",
        metavar="cliques|status",
        help="where a node's membership in a ComputeDomain is written: its clique's "
        "ComputeDomainClique (one object per rack, the controller aggregates) or the domain's "
        "status.nodes (every node writes one object) [GPU_DRA_COMPUTE_DOMAIN_MEMBERSHIP] "
        "(default: cliques)",
    )
    add(
        "--namespace",
        metavar="NS",
        help="the driver's namespace, where ComputeDomainCliques live [POD_NAMESPACE] "
        "(default: gpu-dra-agent)",
    )
    add(
        "--sim-fabric-dir",
        metavar="DIR",
        help="with --simulate: the directory simulated IMEX daemons of several agents share to "
        "find each other [GPU_DRA_SIM_FABRIC_DIR] (default: <plugins-dir>/"
        "compute-domain.nvidia.com/sim-fabric)",
    )
    add(
        "--api-timeout-seconds",
        metavar="N",
        help="how long each call to the API server waits for its answer (a watch: for its "
        "first answer; Events and the start-up reads wait at most 5 s) "
        "[GPU_DRA_API_TIMEOUT_SECONDS] (default: 10, at most 40)",
    )


async def run(args: argparse.Namespace) -> int:
    """Load the settings, then serve until SIGTERM/SIGINT; returns the exit status."""
    from agent.config import load_config
    from agent.memory import pin_mmap_threshold
    from agent.supervisor import Supervisor

    config = load_config(vars(args), os.environ, args.config)
    logging.getLogger("agent.memory").info(pin_mmap_threshold(os.environ))
    return await Supervisor(config).run()
