"""CDI spec documents for prepared devices, built without I/O.

The container runtime learns which device nodes and driver files a GPU container needs from
CDI specs (Container Device Interface). The agent writes two kinds, both of kind
``k8s.<driver>/claim`` so that every id the kubelet receives has the same vendor and class:

- one *common* spec per driver, file ``k8s.<driver>-common.json``, with a single device
  ``common`` holding what every GPU container needs: the control device nodes
  (``/dev/nvidiactl``, ``/dev/nvidia-uvm``, ...) and read-only mounts of the driver's
  libraries and binaries. The engine lists ``k8s.<driver>/claim=common`` first among the
  CDI ids of every prepared device. A container given it several times is fine: the CDI
  library replaces device nodes and mounts by path when it applies them. It is a device
  (not spec-level edits) because the 0.5 schema defines edits on devices only, and a claim
  name can never collide with it since claim device names start with a UUID;
- one *transient* spec per claim, ``k8s.<driver>-claim_<claimUID>.json``, with one device
  ``<claimUID>-<deviceName>`` per prepared device: ``/dev/nvidia<minor>`` and, for a MIG
  device, the GPU-instance and compute-instance capability nodes
  ``/dev/nvidia-caps/nvidia-cap<N>`` as char devices with explicit major and minor, so
  the runtime creates them in the container even where the host lacks the node files (the
  GPU's own node too: its major is the driver's fixed 195, its minor the GPU's); for a
  device shared through MPS (``agent.sharing``) also ``CUDA_MPS_PIPE_DIRECTORY`` and
  ``CUDA_MPS_LOG_DIRECTORY`` and read-write mounts of the daemon's pipe, log and shm
  directories (``mps_edits``).

The common device also carries a ``createContainer`` hook (:func:`ldcache_hook`) that runs the
host's ``ldconfig`` on the container's root file system, so that the dynamic loader's cache of
the container lists the driver libraries the spec mounts (``ldconfig -p`` shows libcuda.so.1).

Claim UIDs are checked to be canonical UUIDs before any name or path is built from them: a
UID such as ``../../etc`` must never reach the file system.

``cdiVersion`` is the lowest version that supports what a spec uses, so that older runtimes
accept it. Minimum versions, from the CDI reference implementation (``specs-go/version.go``
of cncf-tags/container-device-interface; the Debian package's Go code accepts 0.1.0-0.5.0):

=======  ===================================================================
0.3.0    earliest version the reference library emits; deviceNodes with path,
         type, major, minor, permissions, fileMode, uid, gid; mounts; hooks; env
0.4.0    ``mounts[].type``
0.5.0    ``deviceNodes[].hostPath``; device names starting with a non-letter
         (a claim device ``<claimUID>-...`` whose UUID begins with a digit)
0.6.0    annotations (spec or device); a '.' in the kind's class
0.7.0    ``intelRdt``, ``additionalGIDs``
0.8.0    no spec change (Go API only)
=======  ===================================================================

We use none of the 0.6.0+ features, so every spec we write is accepted by runtimes that
know 0.5.0.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from agent.errors import AgentError

CLASS = "claim"
COMMON_DEVICE = "common"
SPEC_SUFFIX = ".json"
_UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
_DEVICE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9_.:-]*[A-Za-z0-9])?")
_DRIVER = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
LIBRARY_MOUNT_OPTIONS = ("ro", "nosuid", "nodev", "bind")


class CdiSpecError(AgentError):
    """A CDI spec cannot be built from the given input."""


class InvalidClaimUidError(CdiSpecError):
    """A claim UID is not a canonical UUID, so no file name may be built from it."""


@dataclass(frozen=True)
class DeviceNode:
    """A device node the runtime creates in the container (``deviceNodes[]``).

    Without ``major``/``minor`` the runtime takes them from the host node at ``path``.
    """

    path: str
    host_path: str | None = None
    type: str | None = None  # "c" for character devices
    major: int | None = None
    minor: int | None = None

    def to_dict(self) -> dict[str, Any]:
        fields = {
            "path": self.path,
            "hostPath": self.host_path,
            "type": self.type,
            "major": self.major,
            "minor": self.minor,
        }
        return {key: value for key, value in fields.items() if value is not None}


@dataclass(frozen=True)
class Mount:
    """A read-only bind mount of a host file into the container (``mounts[]``)."""

    host_path: str
    container_path: str
    options: tuple[str, ...] = LIBRARY_MOUNT_OPTIONS

    def to_dict(self) -> dict[str, Any]:
        return {
            "hostPath": self.host_path,
            "containerPath": self.container_path,
            "options": list(self.options),
        }


@dataclass(frozen=True)
class MigCapabilities:
    """The capability device numbers of one MIG device, read by the caller from the host.

    ``caps_major`` is the ``nvidia-caps`` entry of /proc/devices; the minors come from
    /proc/driver/nvidia/capabilities/gpu<m>/mig/gi<g>/access and .../ci<c>/access.
    """

    caps_major: int
    gi_minor: int
    ci_minor: int


@dataclass(frozen=True)
class MpsDirectories:
    """The host directories of the MPS control daemon a device is shared through.

    The container gets ``CUDA_MPS_PIPE_DIRECTORY`` and ``CUDA_MPS_LOG_DIRECTORY`` pointing at
    the pipe and log directories, mounted read-write at :data:`MPS_PIPE_PATH` and
    :data:`MPS_LOG_PATH`, and the daemon's shm directory as its ``/dev/shm``.
    """

    pipe_dir: str
    log_dir: str
    shm_dir: str


#: The major of every ``/dev/nvidia<minor>`` node (and nvidiactl, 255): the NVIDIA kernel
#: module registers it statically (NV_MAJOR_DEVICE_NUMBER), ``nvidia-frontend`` in /proc/devices.
NVIDIA_MAJOR = 195

MPS_PIPE_PATH = "/tmp/nvidia-mps"
MPS_LOG_PATH = "/var/log/nvidia-mps"
MPS_MOUNT_OPTIONS = ("rw", "nosuid", "nodev", "bind")


@dataclass(frozen=True)
class ClaimDevice:
    """One prepared device as its CDI entry needs it: the GPU minor (the parent's for MIG)."""

    device_name: str
    gpu_minor: int
    mig: MigCapabilities | None = None
    mps: MpsDirectories | None = None


def validate_claim_uid(uid: str) -> str:
    """Return ``uid`` if it is a canonical lowercase UUID; raise ``InvalidClaimUidError``."""
    if not isinstance(uid, str) or _UUID.fullmatch(uid) is None:
        raise InvalidClaimUidError(
            f"claim UID {uid!r} is not a canonical lowercase UUID (8-4-4-4-12 hex digits); "
            "refusing to build a CDI spec or file name from it"
        )
    return uid


#: Driver names already checked (one or two per process; every spec and file name asks).
_VALID_DRIVERS: set[str] = set()


def _validate_driver(driver: str) -> str:
    if isinstance(driver, str) and driver in _VALID_DRIVERS:
        return driver
    if not isinstance(driver, str) or len(driver) > 63 or _DRIVER.fullmatch(driver) is None:
        raise CdiSpecError(f"driver name {driver!r} is not a DNS subdomain usable as CDI vendor")
    _VALID_DRIVERS.add(driver)
    return driver


def kind(driver: str) -> str:
    """The CDI kind of every spec the agent writes for ``driver``."""
    return f"k8s.{_validate_driver(driver)}/{CLASS}"


def common_spec_file_name(driver: str) -> str:
    return f"k8s.{_validate_driver(driver)}-common{SPEC_SUFFIX}"


def claim_spec_file_name(driver: str, claim_uid: str) -> str:
    """``k8s.<driver>-claim_<claimUID>.json``, after checking the UID."""
    return f"k8s.{_validate_driver(driver)}-{CLASS}_{validate_claim_uid(claim_uid)}{SPEC_SUFFIX}"


def claim_uid_of_spec_file(driver: str, file_name: str) -> str | None:
    """The claim UID of one of our claim spec file names, or None for any other file."""
    prefix = f"k8s.{_validate_driver(driver)}-{CLASS}_"
    if not (file_name.startswith(prefix) and file_name.endswith(SPEC_SUFFIX)):
        return None
    uid = file_name[len(prefix) : -len(SPEC_SUFFIX)]
    return uid if _UUID.fullmatch(uid) else None


def claim_device_name(claim_uid: str, device_name: str) -> str:
    """The CDI device name of a prepared device: ``<claimUID>-<deviceName>``."""
    name = f"{validate_claim_uid(claim_uid)}-{device_name}"
    if _DEVICE_NAME.fullmatch(name) is None:
        raise CdiSpecError(f"device name {device_name!r} cannot be part of a CDI device name")
    return name


def qualified_id(driver: str, cdi_device_name: str) -> str:
    """A fully qualified CDI device id, ``k8s.<driver>/claim=<name>``."""
    return f"{kind(driver)}={cdi_device_name}"


def common_device_id(driver: str) -> str:
    return qualified_id(driver, COMMON_DEVICE)


def claim_device_id(driver: str, claim_uid: str, device_name: str) -> str:
    return qualified_id(driver, claim_device_name(claim_uid, device_name))


def common_spec(
    driver: str,
    control_nodes: Sequence[str | DeviceNode],
    mounts: Iterable[tuple[str, str]],
    hooks: Sequence[Mapping[str, Any]] = (),
) -> dict[str, Any]:
    """The common spec: existing control device nodes (a path alone: the runtime reads the
    host's node), (host, container) driver mounts and the hooks that go with them."""
    edits: dict[str, Any] = {}
    if control_nodes:
        edits["deviceNodes"] = [
            (DeviceNode(node) if isinstance(node, str) else node).to_dict()
            for node in control_nodes
        ]
    mount_list = [Mount(host, container).to_dict() for host, container in mounts]
    if mount_list:
        edits["mounts"] = mount_list
        if hooks:
            edits["hooks"] = [dict(hook) for hook in hooks]
    if not edits:
        raise CdiSpecError(
            f"the common CDI spec of {driver} would be empty: no control device node "
            "(/dev/nvidiactl) and no driver file was found; is the NVIDIA driver loaded and "
            "the driver root mounted?"
        )
    return _spec(driver, [{"name": COMMON_DEVICE, "containerEdits": edits}])


def claim_device_nodes(device: ClaimDevice) -> list[DeviceNode]:
    """The device nodes of one prepared device, in a fixed order."""
    nodes = [
        DeviceNode(
            f"/dev/nvidia{device.gpu_minor}", type="c", major=NVIDIA_MAJOR, minor=device.gpu_minor
        )
    ]
    if device.mig is not None:
        for minor in (device.mig.gi_minor, device.mig.ci_minor):
            nodes.append(
                DeviceNode(
                    f"/dev/nvidia-caps/nvidia-cap{minor}",
                    type="c",
                    major=device.mig.caps_major,
                    minor=minor,
                )
            )
    return nodes


def claim_spec(driver: str, claim_uid: str, devices: Sequence[ClaimDevice]) -> dict[str, Any]:
    """The transient spec of one claim, one CDI device per prepared device."""
    if not devices:
        raise CdiSpecError(f"claim {claim_uid} has no devices to put in a CDI spec")
    entries = []
    for device in devices:
        nodes = [node.to_dict() for node in claim_device_nodes(device)]
        edits: dict[str, Any] = {"deviceNodes": nodes}
        if device.mps is not None:
            edits.update(mps_edits(device.mps))
        entries.append(
            {"name": claim_device_name(claim_uid, device.device_name), "containerEdits": edits}
        )
    names = [str(entry["name"]) for entry in entries]
    if len(set(names)) != len(names):
        raise CdiSpecError(f"claim {claim_uid} lists a device twice: {sorted(names)}")
    return _spec(driver, entries)


#: The ldcache hook's script, run by the host's ``/bin/sh`` as an OCI ``createContainer``
#: hook: in the container's mount namespace, before ``pivot_root``, with the container's root
#: file system (its CDI mounts in place) as the working directory (where runc runs
#: createContainer hooks; seen with runc 1.1.5, make test-runtime). ``ldconfig -r`` chroots into it first, so the container's
#: ``/etc/ld.so.conf`` and files are read and its ``/etc/ld.so.cache`` written, nothing of
#: the host's. It never fails the container: without ldconfig, or outside a container root,
#: it says so on stderr and exits 0 (the libraries are mounted either way).
LDCACHE_SCRIPT = (
    'ldconfig=$1; shift; root=$(pwd -P) || exit 0; if [ "$root" = / ]; then '
    'echo "update-ldcache: not run in a container root file system; skipped" >&2; exit 0; fi; '
    'if [ ! -x "$ldconfig" ]; then echo "update-ldcache: $ldconfig is not on this host; '
    'skipped" >&2; exit 0; fi; "$ldconfig" -r "$root" "$@" || echo "update-ldcache: '
    '$ldconfig -r $root failed; the driver libraries are mounted but not in the cache" >&2; '
    "exit 0"
)
LDCACHE_HOOK_NAME = "gpu-dra-agent-update-ldcache"


def ldcache_hook(ldconfig: str, directories: Sequence[str]) -> dict[str, Any]:
    """The hook that adds ``directories`` (container paths of the mounted driver libraries)
    to the container's loader cache with the host's ``ldconfig`` (an absolute path)."""
    if not ldconfig.startswith("/"):
        raise CdiSpecError(f"ldconfig path {ldconfig!r} is not absolute")
    return {
        "hookName": "createContainer",
        "path": "/bin/sh",
        "args": ["sh", "-c", LDCACHE_SCRIPT, LDCACHE_HOOK_NAME, ldconfig, *directories],
    }


def mps_edits(mps: MpsDirectories) -> dict[str, Any]:
    """The container edits of a device shared through MPS: environment and mounts."""
    mounts = (
        (mps.pipe_dir, MPS_PIPE_PATH),
        (mps.log_dir, MPS_LOG_PATH),
        (mps.shm_dir, "/dev/shm"),
    )
    return {
        "env": [
            f"CUDA_MPS_PIPE_DIRECTORY={MPS_PIPE_PATH}",
            f"CUDA_MPS_LOG_DIRECTORY={MPS_LOG_PATH}",
        ],
        "mounts": [Mount(host, path, MPS_MOUNT_OPTIONS).to_dict() for host, path in mounts],
    }


def _spec(driver: str, devices: list[dict[str, Any]]) -> dict[str, Any]:
    document: dict[str, Any] = {"cdiVersion": "", "kind": kind(driver), "devices": devices}
    document["cdiVersion"] = minimum_version(document)
    return document


def minimum_version(spec: Mapping[str, Any]) -> str:
    """The lowest CDI version supporting every feature ``spec`` uses (module docstring table)."""
    devices = spec.get("devices") or []
    edits = [spec.get("containerEdits") or {}] + [d.get("containerEdits") or {} for d in devices]
    nodes = [node for edit in edits for node in edit.get("deviceNodes") or []]
    mounts = [mount for edit in edits for mount in edit.get("mounts") or []]
    if any(edit.get("intelRdt") or edit.get("additionalGIDs") for edit in edits):
        return "0.7.0"
    class_name = str(spec.get("kind", "")).partition("/")[2]
    if spec.get("annotations") or any(d.get("annotations") for d in devices) or "." in class_name:
        return "0.6.0"
    if any(node.get("hostPath") for node in nodes) or any(
        not str(d.get("name", "a"))[:1].isalpha() for d in devices
    ):
        return "0.5.0"
    if any(mount.get("type") for mount in mounts):
        return "0.4.0"
    return "0.3.0"


#: The encoder of the CDI spec files (C-accelerated: no indent).
SPEC_ENCODER = json.JSONEncoder(sort_keys=True, separators=(",", ":"))


def encode_spec(spec: Mapping[str, Any]) -> bytes:
    """The bytes written to disk: stable key order, so equal specs give equal files.

    Compact, one line: ``json.dumps`` with ``indent`` runs Python's pure-Python encoder, some
    60 us per claim spec (a tenth of a 32-claim batch's prepare), the compact form its C
    encoder. ``jq . FILE`` shows one indented."""
    return SPEC_ENCODER.encode(spec).encode() + b"\n"
