"""The registry of resource kinds the embedded API server serves.

The store, the HTTP routes and discovery are all driven by this table, so serving one more kind is one
:class:`ResourceKind` line in :data:`DEFAULT_KINDS` (plus a validator when the kind needs one).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.policies import request_policy_errors

Obj = dict[str, Any]
Validator = Callable[["ResourceKind", Obj, Obj | None], None]

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
GENERIC_FIELDS = ("metadata.name", "metadata.namespace")


@dataclass(frozen=True)
class ResourceKind:
    """One served resource: where it lives in the URL space and how the server treats it."""

    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool
    singular: str = ""
    status_subresource: bool = False
    # The scheduler-facing kinds drop status on create (the strategy's PrepareForCreate);
    # the kubelet creates Nodes with their status filled in, so Nodes keep it.
    keep_status_on_create: bool = False
    # CRDs serve typed list items (with kind/apiVersion); built-in kinds strip them in lists.
    custom: bool = False
    field_selectors: tuple[str, ...] = ()
    validators: tuple[Validator, ...] = field(default=())

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version

    @property
    def list_kind(self) -> str:
        return f"{self.kind}List"

    @property
    def prefix(self) -> str:
        """URL prefix without the leading slash: ``api/v1`` or ``apis/<group>/<version>``."""
        return f"apis/{self.group}/{self.version}" if self.group else f"api/{self.version}"

    @property
    def key(self) -> str:
        """Unique name of the kind, e.g. ``resourceslices.resource.k8s.io`` or ``nodes``."""
        return f"{self.plural}.{self.group}" if self.group else self.plural

    def supported_fields(self) -> tuple[str, ...]:
        return GENERIC_FIELDS + self.field_selectors

    def invalid(self, name: str | None, message: str) -> ApiError:
        return ApiError(
            422,
            f'{self.kind} "{name or ""}" is invalid: {message}',
            name=name,
            group=self.group,
            kind=self.kind,
        )


def validate_metadata(kind: ResourceKind, obj: Obj, old: Obj | None) -> None:
    """Names must be DNS subdomains: the real server rejects anything else, so must we."""
    name = obj.get("metadata", {}).get("name", "")
    if not isinstance(name, str) or len(name) > 253 or not _DNS_SUBDOMAIN.match(name):
        raise kind.invalid(
            str(name), "metadata.name: Invalid value: a lowercase RFC 1123 subdomain is required"
        )


def _get(obj: Obj, path: str) -> Any:
    current: Any = obj
    for part in path.split("."):
        if not isinstance(current, dict):
            return None
        current = current.get(part)
    return current


def validate_resource_slice(kind: ResourceKind, obj: Obj, old: Obj | None) -> None:
    """The required and immutable fields of ``resource.k8s.io/v1`` ResourceSliceSpec."""
    name = obj["metadata"].get("name")
    for required in ("spec.driver", "spec.pool", "spec.pool.name"):
        if not _get(obj, required):
            raise kind.invalid(name, f"{required}: Required value")
    selectors = [
        key
        for key in ("nodeName", "nodeSelector", "allNodes", "perDeviceNodeSelection")
        if _get(obj, f"spec.{key}") not in (None, False, "")
    ]
    if len(selectors) != 1:
        raise kind.invalid(
            name,
            "spec: Invalid value: exactly one of `nodeName`, `nodeSelector`, `allNodes`, "
            "`perDeviceNodeSelection` is required",
        )
    if old is not None:
        for immutable in ("spec.nodeName", "spec.driver", "spec.pool.name"):
            if _get(obj, immutable) != _get(old, immutable):
                raise kind.invalid(name, f"{immutable}: Invalid value: field is immutable")


def validate_request_policies(kind: ResourceKind, obj: Obj, old: Obj | None) -> None:
    """The devices' capacity request policies (KEP-5075), as kube-apiserver checks them
    (``policies``); several errors are listed as kube-apiserver lists them, in brackets."""
    spec = obj.get("spec")
    errors = request_policy_errors(spec) if isinstance(spec, dict) else []
    if errors:
        message = errors[0] if len(errors) == 1 else f"[{', '.join(errors)}]"
        raise kind.invalid(obj["metadata"].get("name"), message)


def validate_resource_claim(kind: ResourceKind, obj: Obj, old: Obj | None) -> None:
    """A ResourceClaim's spec is immutable once created (the scheduler relies on it)."""
    if old is not None and obj.get("spec") != old.get("spec"):
        raise kind.invalid(obj["metadata"].get("name"), "spec: Invalid value: field is immutable")


DEFAULT_KINDS: tuple[ResourceKind, ...] = (
    ResourceKind(
        "resource.k8s.io", "v1", "resourceslices", "ResourceSlice", False,
        field_selectors=("spec.nodeName", "spec.driver"),
        validators=(validate_metadata, validate_resource_slice, validate_request_policies),
    ),
    ResourceKind(
        "resource.k8s.io", "v1", "resourceclaims", "ResourceClaim", True,
        status_subresource=True, validators=(validate_metadata, validate_resource_claim),
    ),
    ResourceKind(
        "resource.k8s.io", "v1", "deviceclasses", "DeviceClass", False,
        validators=(validate_metadata,),
    ),
    ResourceKind(
        "", "v1", "nodes", "Node", False,
        status_subresource=True, keep_status_on_create=True, validators=(validate_metadata,),
    ),
    ResourceKind(
        "", "v1", "pods", "Pod", True,
        status_subresource=True,
        field_selectors=("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
                         "spec.serviceAccountName", "status.phase", "status.podIP",
                         "status.nominatedNodeName"),
        validators=(validate_metadata,),
    ),
    ResourceKind(
        "", "v1", "events", "Event", True,
        field_selectors=("involvedObject.name", "involvedObject.kind", "involvedObject.uid",
                         "involvedObject.namespace", "involvedObject.apiVersion",
                         "involvedObject.resourceVersion", "involvedObject.fieldPath",
                         "reason", "reportingComponent", "type"),
        validators=(validate_metadata,),
    ),
    ResourceKind(
        "resource.nvidia.com", "v1beta1", "computedomains", "ComputeDomain", True,
        status_subresource=True, custom=True, validators=(validate_metadata,),
    ),
    ResourceKind(
        "resource.nvidia.com", "v1beta1", "computedomaincliques", "ComputeDomainClique", True,
        custom=True, validators=(validate_metadata,),
    ),
    ResourceKind(
        "resource.k8s.io", "v1", "resourceclaimtemplates", "ResourceClaimTemplate", True,
        validators=(validate_metadata,),
    ),
    ResourceKind(
        "coordination.k8s.io", "v1", "leases", "Lease", True, validators=(validate_metadata,),
    ),
)  # fmt: skip


class KindRegistry:
    """Look kinds up by URL coordinates, by ``apiVersion``/``kind`` or by key."""

    def __init__(self, kinds: Iterable[ResourceKind] = DEFAULT_KINDS) -> None:
        self._kinds = list(kinds)
        self._by_url = {(k.prefix, k.plural): k for k in self._kinds}
        self._by_type = {(k.api_version, k.kind): k for k in self._kinds}

    def __iter__(self) -> Iterator[ResourceKind]:
        return iter(self._kinds)

    def by_url(self, prefix: str, plural: str) -> ResourceKind | None:
        return self._by_url.get((prefix, plural))

    def by_type(self, api_version: str, kind: str) -> ResourceKind | None:
        return self._by_type.get((api_version, kind))

    def resolve(self, name: str) -> ResourceKind:
        """Find a kind by key (``resourceslices.resource.k8s.io``), plural or Kind name."""
        for k in self._kinds:
            if name in (k.key, k.plural, k.kind):
                return k
        raise KeyError(f"unknown resource kind {name!r}; served: {[k.key for k in self._kinds]}")

    def groups(self) -> dict[str, list[str]]:
        """Versions per non-core group, in registration order."""
        out: dict[str, list[str]] = {}
        for k in self._kinds:
            if k.group and k.version not in out.setdefault(k.group, []):
                out[k.group].append(k.version)
        return out
