"""KEP-5304 device metadata: the file a container reads, its CDI spec, and their names. Pure.

With ``--device-metadata`` every prepared request of a claim gets, as the Kubernetes 1.36
kubelet-plugin library lays it out (``k8s.io/dynamic-resource-allocation``, ``kubeletplugin``
and ``api/metadata``):

- a metadata file on the host, ``<plugin data dir>/dra-device-metadata/<namespace>_<claim>/
  <request>/metadata.json`` (mode 0644): a JSON *stream*, the same ``DeviceMetadata`` object
  once per API version, newest first (``metadata.resource.k8s.io/v1beta1``, then ``v1alpha1``,
  the only one 1.36 consumers know): a reader takes the first object whose ``apiVersion`` it
  understands. The object holds the claim's name, namespace, uid and ``generation`` (1: the
  agent never rewrites it), ``podClaimName`` for a claim made from a ResourceClaimTemplate,
  and the request with its devices (driver, pool, name and the attributes the ResourceSlice
  publishes, in its ``{"string": ...}`` form);
- a CDI spec ``<cdi dir>/<driver>_metadata_<claim uid>_<request>.json`` of kind
  ``<driver>/metadata`` with one device ``<claim uid>_<request>`` that bind-mounts the file
  read-only at ``/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/
  <podClaimName>/<request>/<driver>-metadata.json`` (template claims), else
  ``.../resourceclaims/<claim name>/<request>/<driver>-metadata.json``;
- its CDI id ``<driver>/metadata=<claim uid>_<request>``, added to the ``cdi_device_ids`` of
  every device of the request in the kubelet's answer.

A request with subrequests (``firstAvailable``) is named by its base name in the paths and by
``request/subrequest`` in the file, as in the allocation result.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.dra import cdi

#: Under the driver's plugin data directory.
SUBDIR = "dra-device-metadata"
FILE_NAME = "metadata.json"
#: Where containers see the files.
CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
RESOURCE_CLAIMS_SUBDIR = "resourceclaims"
RESOURCE_CLAIM_TEMPLATES_SUBDIR = "resourceclaimtemplates"
FILE_SUFFIX = "-metadata.json"
CDI_CLASS = "metadata"
KIND = "DeviceMetadata"
#: Encoded in this order: newest first.
API_VERSIONS = ("metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1")
#: Set by the resourceclaim controller on a claim made from a pod's ResourceClaimTemplate.
POD_CLAIM_NAME_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
MOUNT_OPTIONS = ("ro", "bind")
FILE_MODE = 0o644
DIR_MODE = 0o755
# A request name is a DNS label; a namespace and claim name DNS subdomains (no "_", no "/").
_REQUEST = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_OBJECT_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class MetadataError(ValueError):
    """A name that cannot become a path or a CDI name; the message says which."""


@dataclass(frozen=True, slots=True)
class MetadataDevice:
    """One device of a request: where it is and what the ResourceSlice says about it."""

    pool: str
    name: str
    attributes: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RequestMetadata:
    """What one metadata file describes: a claim's request and its devices of this driver."""

    driver: str
    namespace: str
    claim: str
    uid: str
    request: str  # as in the allocation result: "req" or "req/sub"
    pod_claim_name: str | None
    devices: tuple[MetadataDevice, ...]

    @property
    def base_request(self) -> str:
        return base_request(self.request)


def base_request(request: str) -> str:
    """``req`` of ``req/sub``; raises MetadataError unless it is a DNS label."""
    base = request.partition("/")[0]
    if _REQUEST.fullmatch(base) is None:
        raise MetadataError(f"request name {request!r} is not a DNS label")
    return base


def _object_name(what: str, value: str) -> str:
    if _OBJECT_NAME.fullmatch(value) is None:
        raise MetadataError(f"{what} {value!r} is not a DNS subdomain")
    return value


def claim_dir(plugin_dir: Path, namespace: str, claim: str) -> Path:
    """``<plugin dir>/dra-device-metadata/<namespace>_<claim>``."""
    ns, name = _object_name("namespace", namespace), _object_name("claim name", claim)
    return Path(plugin_dir) / SUBDIR / f"{ns}_{name}"


def host_file(plugin_dir: Path, namespace: str, claim: str, request: str) -> Path:
    return claim_dir(plugin_dir, namespace, claim) / base_request(request) / FILE_NAME


def container_file(driver: str, claim: str, request: str, pod_claim_name: str | None) -> str:
    """Where the container sees the file (module docstring)."""
    if pod_claim_name:
        parent = (
            f"{RESOURCE_CLAIM_TEMPLATES_SUBDIR}/{_object_name('pod claim name', pod_claim_name)}"
        )
    else:
        parent = f"{RESOURCE_CLAIMS_SUBDIR}/{_object_name('claim name', claim)}"
    return f"{CONTAINER_DIR}/{parent}/{base_request(request)}/{driver}{FILE_SUFFIX}"


def cdi_device_name(uid: str, request: str) -> str:
    return f"{cdi.validate_claim_uid(uid)}_{base_request(request)}"


def cdi_kind(driver: str) -> str:
    return f"{driver}/{CDI_CLASS}"


def cdi_id(driver: str, uid: str, request: str) -> str:
    """``<driver>/metadata=<uid>_<request>``."""
    return f"{cdi_kind(driver)}={cdi_device_name(uid, request)}"


def spec_file_name(driver: str, uid: str, request: str) -> str:
    return f"{driver}_{CDI_CLASS}_{cdi_device_name(uid, request)}{cdi.SPEC_SUFFIX}"


def spec_file_uid(driver: str, file_name: str) -> str | None:
    """The claim uid of one of our metadata spec file names, or None for any other file."""
    prefix = f"{driver}_{CDI_CLASS}_"
    if not (file_name.startswith(prefix) and file_name.endswith(cdi.SPEC_SUFFIX)):
        return None
    uid, sep, request = file_name[len(prefix) : -len(cdi.SPEC_SUFFIX)].partition("_")
    try:
        cdi.validate_claim_uid(uid)
        base_request(request)
    except (cdi.CdiSpecError, MetadataError):
        return None
    return uid if sep else None


def cdi_spec(metadata: RequestMetadata, host_path: Path) -> dict[str, Any]:
    """The CDI spec that mounts ``host_path`` (the request's file) into the container."""
    mount = {
        "hostPath": str(host_path),
        "containerPath": container_file(
            metadata.driver, metadata.claim, metadata.request, metadata.pod_claim_name
        ),
        "options": list(MOUNT_OPTIONS),
    }
    device = {
        "name": cdi_device_name(metadata.uid, metadata.request),
        "containerEdits": {"mounts": [mount]},
    }
    spec: dict[str, Any] = {
        "cdiVersion": "",
        "kind": cdi_kind(metadata.driver),
        "devices": [device],
    }
    spec["cdiVersion"] = cdi.minimum_version(spec)
    return spec


def document(metadata: RequestMetadata, api_version: str) -> dict[str, Any]:
    """One ``DeviceMetadata`` object of the stream."""
    object_meta = {
        "name": metadata.claim,
        "namespace": metadata.namespace,
        "uid": metadata.uid,
        "generation": 1,
    }
    body: dict[str, Any] = {"kind": KIND, "apiVersion": api_version, "metadata": object_meta}
    if metadata.pod_claim_name:
        body["podClaimName"] = metadata.pod_claim_name
    devices = []
    for device in metadata.devices:
        entry: dict[str, Any] = {"driver": metadata.driver, "pool": device.pool}
        entry["name"] = device.name
        if device.attributes:
            entry["attributes"] = {k: dict(v) for k, v in sorted(device.attributes.items())}
        devices.append(entry)
    body["requests"] = [{"name": metadata.request, "devices": devices}]
    return body


def encode_stream(metadata: RequestMetadata) -> bytes:
    """The file's bytes: one indented object per API version, each ending in a newline."""
    return b"".join(
        (json.dumps(document(metadata, version), indent=2) + "\n").encode()
        for version in API_VERSIONS
    )


def decode_stream(data: bytes) -> list[dict[str, Any]]:
    """The objects of a metadata stream, in order; raises ValueError if it is not one."""
    text, decoder, objects, at = data.decode(), json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            break
        value, at = decoder.raw_decode(text, at)
        if not isinstance(value, dict):
            raise ValueError("a metadata stream holds JSON objects only")
        objects.append(value)
    if not objects:
        raise ValueError("empty metadata stream")
    return objects


def pod_claim_name_of(claim: Mapping[str, Any]) -> str | None:
    """The ``resource.kubernetes.io/pod-claim-name`` annotation of a ResourceClaim, if any."""
    metadata = claim.get("metadata")
    annotations = metadata.get("annotations") if isinstance(metadata, Mapping) else None
    value = annotations.get(POD_CLAIM_NAME_ANNOTATION) if isinstance(annotations, Mapping) else None
    return value if isinstance(value, str) and value else None


def allocated_requests(
    claim: Mapping[str, Any], driver: str, pool: str
) -> dict[str, tuple[str, ...]]:
    """Device name -> the request refs (``req`` or ``req/sub``) it was allocated for, for the
    results of ``driver`` in ``pool``; a claim of another shape gives what it can."""
    status = claim.get("status")
    allocation = status.get("allocation") if isinstance(status, Mapping) else None
    devices = allocation.get("devices") if isinstance(allocation, Mapping) else None
    results = devices.get("results") if isinstance(devices, Mapping) else None
    found: dict[str, tuple[str, ...]] = {}
    for result in results if isinstance(results, list) else ():
        if not isinstance(result, Mapping):
            continue
        if result.get("driver") != driver or result.get("pool") != pool:
            continue
        name, request = result.get("device"), result.get("request")
        if isinstance(name, str) and isinstance(request, str):
            found[name] = (*found.get(name, ()), request)
    return found


def group_requests(
    requests_by_device: Iterable[tuple[str, Sequence[str]]],
) -> dict[str, list[str]]:
    """Request ref -> its devices, in the order given (each device under every request)."""
    grouped: dict[str, list[str]] = {}
    for device, requests in requests_by_device:
        for request in requests:
            grouped.setdefault(request, []).append(device)
    return grouped
