"""A ResourceClaim's device requests, resolved against the DeviceClasses, ready to allocate.

Parsing checks what the API server would refuse (a request without a name or class, an
unknown allocation mode, a selector that does not compile) and raises
:class:`ClaimSpecError`: such a claim is bad, not merely unsatisfiable. A DeviceClass that
does not exist is not an error here: the scheduler keeps such a claim pending, so it is one
more reason the claim does not fit (:attr:`Request.class_problem`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from agent.dra.cel import CelError, Selector, compile_selector
from agent.dra.errors import DraModelError, InvalidValueError
from agent.dra.quantity import parse_quantity

Obj = dict[str, Any]
MODES = ("ExactCount", "All")


class ClaimSpecError(DraModelError):
    """The claim is malformed: the API server or the scheduler would reject it as written."""


@dataclass(frozen=True)
class SelectorSource:
    """One selector with where it comes from (``class <name>`` or ``request``)."""

    source: str
    selector: Selector | None  # None: the class's selector does not compile
    error: CelError | None = None


@dataclass(frozen=True)
class Request:
    """An ``exactly`` request, or one ``firstAvailable`` subrequest (``name`` is ``req/sub``)."""

    name: str
    parent: str
    class_name: str
    selectors: tuple[SelectorSource, ...]
    mode: str
    count: int
    admin_access: bool | None
    tolerations: tuple[Obj, ...]
    class_config: tuple[Obj, ...]
    class_problem: str = ""
    #: KEP-5075 ``capacity.requests``: capacity name (as written) -> amount
    capacity: tuple[tuple[str, Fraction], ...] = ()


@dataclass(frozen=True)
class ClaimRequest:
    name: str
    alternatives: tuple[Request, ...]  # one, or the firstAvailable subrequests in order
    first_available: bool


@dataclass(frozen=True)
class Constraint:
    """``matchAttribute`` (equal values) or, with ``distinct``, ``distinctAttribute``
    (pairwise different values, KEP-5075); ``match_attribute`` names the attribute."""

    requests: tuple[str, ...]  # empty: all requests
    match_attribute: str
    distinct: bool = False

    @property
    def kind(self) -> str:
        return "distinctAttribute" if self.distinct else "matchAttribute"

    def applies_to(self, request: Request) -> bool:
        return not self.requests or request.parent in self.requests or request.name in self.requests


@dataclass(frozen=True)
class ParsedClaim:
    namespace: str
    name: str
    uid: str
    requests: tuple[ClaimRequest, ...]
    constraints: tuple[Constraint, ...]
    config: tuple[Obj, ...]  # spec.devices.config entries


def claim_spec(document: Mapping[str, Any]) -> tuple[Obj, Obj]:
    """``(metadata, spec)`` of a ResourceClaim, or of the claim a ResourceClaimTemplate makes."""
    kind = document.get("kind")
    if kind == "ResourceClaimTemplate":
        template = document.get("spec") or {}
        return dict(document.get("metadata") or {}), dict(template.get("spec") or {})
    if kind not in ("ResourceClaim", None):
        raise ClaimSpecError(f"expected a ResourceClaim or ResourceClaimTemplate, got {kind}")
    return dict(document.get("metadata") or {}), dict(document.get("spec") or {})


def parse_claim(document: Mapping[str, Any], classes: Mapping[str, Obj]) -> ParsedClaim:
    """Parse a ResourceClaim (or template) against ``classes`` (DeviceClass name -> object)."""
    metadata, spec = claim_spec(document)
    devices = spec.get("devices") or {}
    raw_requests = devices.get("requests") or []
    if not isinstance(raw_requests, list) or not raw_requests:
        raise ClaimSpecError("spec.devices.requests: at least one request is required")
    requests = []
    seen: set[str] = set()
    for index, raw in enumerate(raw_requests):
        path = f"spec.devices.requests[{index}]"
        name = _name(raw.get("name"), path)
        if name in seen:
            raise ClaimSpecError(f"{path}.name: duplicate request name {name!r}")
        seen.add(name)
        if ("exactly" in raw) == ("firstAvailable" in raw):
            raise ClaimSpecError(f"{path}: exactly one of exactly and firstAvailable is required")
        if "exactly" in raw:
            alternatives: tuple[Request, ...] = (
                _request(raw["exactly"] or {}, name, name, f"{path}.exactly", classes),
            )
        else:
            subs = raw["firstAvailable"] or []
            if not subs:
                raise ClaimSpecError(f"{path}.firstAvailable: at least one subrequest is required")
            names = [
                _name(s.get("name"), f"{path}.firstAvailable[{i}]") for i, s in enumerate(subs)
            ]
            if len(set(names)) != len(names):
                raise ClaimSpecError(f"{path}.firstAvailable: duplicate subrequest names")
            alternatives = tuple(
                _request(sub, f"{name}/{sub_name}", name, f"{path}.firstAvailable[{i}]", classes)
                for i, (sub, sub_name) in enumerate(zip(subs, names, strict=True))
            )
        requests.append(ClaimRequest(name, alternatives, "firstAvailable" in raw))
    constraints = []
    for index, raw in enumerate(devices.get("constraints") or []):
        kinds = [k for k in ("matchAttribute", "distinctAttribute") if raw.get(k) is not None]
        if len(kinds) != 1:
            raise ClaimSpecError(
                f"spec.devices.constraints[{index}]: exactly one of matchAttribute and "
                "distinctAttribute is required"
            )
        attribute = raw.get(kinds[0])
        if not attribute or "/" not in str(attribute):
            raise ClaimSpecError(
                f"spec.devices.constraints[{index}].{kinds[0]}: a fully qualified "
                f"attribute name (domain/name) is required, got {attribute!r}"
            )
        targets = tuple(str(r) for r in raw.get("requests") or [])
        for request_name in targets:
            if request_name.split("/", 1)[0] not in seen:
                raise ClaimSpecError(
                    f"spec.devices.constraints[{index}].requests: no request {request_name!r}"
                )
        constraints.append(Constraint(targets, str(attribute), kinds[0] == "distinctAttribute"))
    return ParsedClaim(
        namespace=str(metadata.get("namespace") or "default"),
        name=str(metadata.get("name") or metadata.get("generateName") or "claim"),
        uid=str(metadata.get("uid") or ""),
        requests=tuple(requests),
        constraints=tuple(constraints),
        config=tuple(devices.get("config") or []),
    )


def _name(value: Any, path: str) -> str:
    if not isinstance(value, str) or not value:
        raise ClaimSpecError(f"{path}.name: a name is required")
    return value


def _request(
    raw: Mapping[str, Any], name: str, parent: str, path: str, classes: Mapping[str, Obj]
) -> Request:
    class_name = raw.get("deviceClassName")
    if not isinstance(class_name, str) or not class_name:
        raise ClaimSpecError(f"{path}.deviceClassName: a DeviceClass name is required")
    mode = raw.get("allocationMode") or "ExactCount"
    if mode not in MODES:
        raise ClaimSpecError(f"{path}.allocationMode: {mode!r} is not one of {', '.join(MODES)}")
    count = raw.get("count", 1 if mode == "ExactCount" else 0)
    if mode == "ExactCount" and (not isinstance(count, int) or count < 1):
        raise ClaimSpecError(f"{path}.count: must be a positive integer, got {count!r}")
    if mode == "All" and "count" in raw:
        raise ClaimSpecError(f"{path}.count: must not be set with allocationMode All")
    selectors: list[SelectorSource] = []
    device_class = classes.get(class_name)
    class_config: tuple[Obj, ...] = ()
    problem = ""
    if device_class is None:
        problem = f"DeviceClass {class_name} does not exist"
    else:
        class_spec = device_class.get("spec") or {}
        class_config = tuple(class_spec.get("config") or [])
        for selector in class_spec.get("selectors") or []:
            expression = str((selector.get("cel") or {}).get("expression", ""))
            try:
                selectors.append(
                    SelectorSource(f"class {class_name}", compile_selector(expression))
                )
            except CelError as err:
                selectors.append(SelectorSource(f"class {class_name}", None, err))
    for index, selector in enumerate(raw.get("selectors") or []):
        text = (selector.get("cel") or {}).get("expression")
        if not isinstance(text, str):
            raise ClaimSpecError(f"{path}.selectors[{index}].cel.expression is required")
        try:
            selectors.append(SelectorSource("request", compile_selector(text)))
        except CelError as err:
            raise ClaimSpecError(f"{path}.selectors[{index}]: {err}") from err
    admin = raw.get("adminAccess")
    amounts = []
    asked = (raw.get("capacity") or {}).get("requests") or {}
    for capacity_name, amount in asked.items():
        try:
            amounts.append((str(capacity_name), parse_quantity(str(amount))))
        except InvalidValueError as err:
            raise ClaimSpecError(f"{path}.capacity.requests.{capacity_name}: {err}") from err
    return Request(
        name=name,
        parent=parent,
        class_name=class_name,
        selectors=tuple(selectors),
        mode=mode,
        count=int(count),
        admin_access=admin if isinstance(admin, bool) else None,
        tolerations=tuple(raw.get("tolerations") or []),
        class_config=class_config,
        class_problem=problem,
        capacity=tuple(amounts),
    )


def request_names(claim: ParsedClaim) -> Sequence[str]:
    return [r.name for r in claim.requests]
