"""``status.allocation`` exactly as kube-scheduler writes it.

Results in allocation order (request by request; ``request`` is ``<req>/<sub>`` for a
``firstAvailable`` subrequest), ``adminAccess`` copied from the request when it sets it,
``tolerations`` copied when it has some, ``shareID`` and ``consumedCapacity`` for a device
allowing multiple allocations (KEP-5075), ``bindingConditions`` and ``bindingFailureConditions``
copied from the device (KEP-5007, when the gate is on); then the class configs of each request
(source FromClass, ``requests`` naming the request or chosen subrequest), then the claim's
configs (source FromClaim, their ``requests`` as written); and a node selector naming the node
by ``metadata.name`` when a device is local to it (or, with binding conditions on, when a device
says ``bindsToNode``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from agent.dra.quantity import format_quantity

if TYPE_CHECKING:
    from agent.dra.allocator.claim import ParsedClaim
    from agent.dra.allocator.search import Allocated

Obj = dict[str, Any]


def node_selector(node_name: str) -> Obj:
    return {
        "nodeSelectorTerms": [
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": [node_name]}]}
        ]
    }


def device_result(
    request: str,
    driver: str,
    pool: str,
    device: str,
    admin_access: bool | None = None,
    tolerations: Sequence[Obj] = (),
) -> Obj:
    """One ``devices.results[]`` entry."""
    result: Obj = {"request": request, "driver": driver, "pool": pool, "device": device}
    if admin_access is not None:
        result["adminAccess"] = admin_access
    if tolerations:
        result["tolerations"] = [dict(t) for t in tolerations]
    return result


def config_entry(source: str, requests: Sequence[str], configuration: Obj) -> Obj:
    """One ``devices.config[]`` entry; ``configuration`` holds ``opaque``."""
    entry: Obj = {"source": source}
    if requests:
        entry["requests"] = list(requests)
    entry.update({k: v for k, v in configuration.items() if k != "requests"})
    return entry


def allocation_result(
    claim: ParsedClaim,
    chosen: Sequence[Allocated],
    node_name: str,
    share_id: Callable[[], str] = lambda: "",
    *,
    binding_conditions: bool = False,
) -> Obj:
    results = []
    for a in chosen:
        result = device_result(
            a.request.name,
            a.device.id.driver,
            a.device.id.pool,
            a.device.id.device,
            a.request.admin_access,
            a.request.tolerations,
        )
        if a.shared and not a.request.admin_access:  # KEP-5075: a share of the device
            result["shareID"] = share_id()
            result["consumedCapacity"] = {
                name: format_quantity(int(amount)) if amount.denominator == 1 else str(amount)
                for name, amount in a.consumed
            }
        if binding_conditions:  # KEP-5007: copies, so the device may change meanwhile
            for key in ("bindingConditions", "bindingFailureConditions"):
                if a.device.spec.get(key):
                    result[key] = list(a.device.spec[key])
        results.append(result)
    used = {a.request.parent: a.request for a in chosen}
    configs = [
        config_entry("FromClass", [request.name], config)
        for claim_request in claim.requests
        if (request := used.get(claim_request.name)) is not None
        for config in request.class_config
    ]
    configs += [
        config_entry("FromClaim", config.get("requests") or [], config) for config in claim.config
    ]
    devices: Obj = {"results": results}
    if configs:
        devices["config"] = configs
    allocation: Obj = {"devices": devices}
    if any(
        a.device.node_local or (binding_conditions and a.device.spec.get("bindsToNode") is True)
        for a in chosen
    ):
        allocation["nodeSelector"] = node_selector(node_name)
    return allocation
