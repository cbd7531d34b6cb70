"""A pod's claims on the emulated node: the scheduler's allocation, then the kubelet's prepare.

In a cluster kube-scheduler allocates a pod's ResourceClaims on the node it picks and reserves
them for the pod; the kubelet then reads each claim, checks that it is allocated and reserved
for the pod, groups the claims by the drivers named in ``status.allocation.devices.results``
and calls NodePrepareResources once per driver with all of that driver's claims before any
container starts, and NodeUnprepareResources once the pod is gone. Without a scheduler the
emulator does the scheduler's part with :mod:`agent.sim.allocation` (the allocator, which
writes ``status.allocation`` exactly as the scheduler does): claims given as specs are created
first, claims stored without an allocation are allocated on this node, claims already
allocated must be allocated for this node. Nothing here names a device.

On 1.36+ a claim whose devices have binding conditions (KEP-5007) holds the pod in the
scheduler's PreBind until they are True (:func:`prebind`); when one fails or times out, the
claims are given back (the failed ones deallocated, the others unreserved) and the pod is not
started here, so another node's emulator can take its claims.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from agent.node.types import ClaimRef
from agent.sim.allocation import (
    AllocationFailedError,
    ApiAccess,
    allocate_existing_claim,
    create_claim,
    release_claim,
)
from agent.sim.binding import (
    BindingOutcome,
    needs_binding,
    undo_allocation,
    wait_for_binding,
)
from agent.sim.binding_flag import DEFAULT_BINDING_TIMEOUT_S
from agent.sim.claims import ClaimCreationError, PodReference
from agent.sim.kubelet.errors import KubeletEmulatorError

Obj = dict[str, Any]
#: A claim of a pod: a ResourceClaim manifest to create, or the name of a stored claim in the
#: pod's namespace.
ClaimSource = Mapping[str, Any] | str
#: how long a pod given up in PreBind may take to give its claims back
UNRESERVE_TIMEOUT_S = 10.0


class PodAdmissionError(KubeletEmulatorError):
    """A pod's claims could not be created or allocated on this node (the pod stays pending,
    as it would with kube-scheduler); the message names the claim and the allocator's reasons."""


class PodBindingError(PodAdmissionError):
    """A claim's binding conditions failed or timed out in PreBind: the pod's claims were
    given back and the pod can be scheduled on another node; ``outcome`` is the failed wait."""

    def __init__(self, message: str, outcome: BindingOutcome) -> None:
        super().__init__(message)
        self.outcome = outcome


@dataclass
class PodClaims:
    """One pod's claims on this node: as stored after allocation, and the drivers' answers."""

    pod: PodReference
    namespace: str
    claims: list[Obj]  # as stored: allocated on this node and reserved for the pod
    drivers: dict[str, list[ClaimRef]]  # driver -> its claims, in the pod's order
    #: driver -> claim UID -> v1 ``NodePrepareResourceResponse`` (empty before prepare)
    results: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def refs(self) -> list[ClaimRef]:
        return [claim_ref(c) for c in self.claims]

    def errors(self) -> dict[str, str]:
        """``driver/namespace/name`` -> the per-claim error of each claim a driver refused."""
        found: dict[str, str] = {}
        for driver, refs in self.drivers.items():
            answers = self.results.get(driver, {})
            for ref in refs:
                answer = answers.get(ref.uid)
                if answer is not None and answer.error:
                    found[f"{driver}/{ref.namespace}/{ref.name}"] = answer.error
        return found

    def cdi_device_ids(self) -> dict[str, list[str]]:
        """Claim name -> the CDI device IDs its drivers returned (what the container gets)."""
        ids: dict[str, list[str]] = {}
        for driver, refs in self.drivers.items():
            for ref in refs:
                answer = self.results.get(driver, {}).get(ref.uid)
                devices = [] if answer is None else answer.devices
                ids.setdefault(ref.name, []).extend(i for d in devices for i in d.cdi_device_ids)
        return ids


def claim_ref(claim: Mapping[str, Any]) -> ClaimRef:
    meta = claim["metadata"]
    return ClaimRef(namespace=meta["namespace"], name=meta["name"], uid=meta["uid"])


def group_by_driver(claims: Sequence[Mapping[str, Any]]) -> dict[str, list[ClaimRef]]:
    """The kubelet's batches: each driver with every claim that has a device of it."""
    drivers: dict[str, list[ClaimRef]] = {}
    for claim in claims:
        results = claim["status"]["allocation"]["devices"].get("results") or []
        for driver in dict.fromkeys(r["driver"] for r in results):
            drivers.setdefault(driver, []).append(claim_ref(claim))
    return drivers


async def create_claims(
    access: ApiAccess, manifests: Sequence[Mapping[str, Any]], namespace: str
) -> list[str]:
    """Create ResourceClaims (a user's ``kubectl create``); returns their names. A manifest
    without a namespace gets ``namespace``; one naming another namespace is refused, as a pod
    can only use claims of its own namespace."""
    bodies = []
    for manifest in manifests:  # all checked before any is created
        body = dict(manifest)
        meta = dict(body.get("metadata") or {})
        if meta.setdefault("namespace", namespace) != namespace:
            raise PodAdmissionError(
                f"claim {meta.get('name')!r} is in namespace {meta['namespace']!r}; a pod in "
                f"{namespace!r} can only use claims of its own namespace"
            )
        if body.get("kind", "ResourceClaim") != "ResourceClaim":
            raise PodAdmissionError(f"not a ResourceClaim: kind {body.get('kind')!r}")
        body["metadata"] = meta
        bodies.append(body)
    names = []
    for body in bodies:
        try:
            created = await create_claim(access, body)
        except ClaimCreationError as err:
            name = body["metadata"].get("name")
            raise PodAdmissionError(f"creating claim {name!r}: {err}") from err
        names.append(created["metadata"]["name"])
    return names


async def admit(
    access: ApiAccess,
    node_name: str,
    pod: PodReference,
    namespace: str,
    claims: Sequence[ClaimSource],
) -> PodClaims:
    """The scheduler's part: create the claims given as manifests, allocate on ``node_name``
    (through the allocator) those that are not allocated yet, reserve all for ``pod``.
    Raises :class:`PodAdmissionError` (claims allocated before the failing one stay so)."""
    manifests = [c for c in claims if not isinstance(c, str)]
    created = iter(await create_claims(access, manifests, namespace))
    names = [c if isinstance(c, str) else next(created) for c in claims]
    stored: list[Obj] = []
    for name in names:
        try:
            stored.append(
                await allocate_existing_claim(
                    access, namespace, name, node_name, reserved_for=(pod,)
                )
            )
        except (AllocationFailedError, ClaimCreationError) as err:
            raise PodAdmissionError(f"pod {namespace}/{pod.name}: {err}") from err
    return PodClaims(pod, namespace, stored, group_by_driver(stored))


async def release(access: ApiAccess, pod: PodClaims, *, delete_claims: bool) -> None:
    """After the pod's claims were unprepared: delete them (claims generated from templates)
    or unreserve them, deallocating those no other pod uses."""
    for ref in pod.refs:
        await release_claim(access, ref.namespace, ref.name, pod.pod, delete=delete_claims)


async def prebind(
    access: ApiAccess, pod: PodClaims, *, binding_timeout_s: float = DEFAULT_BINDING_TIMEOUT_S
) -> PodClaims:
    """The scheduler's PreBind for an admitted pod: wait for every claim's binding conditions
    (all claims at once; none for claims without). Returns the pod with its claims as stored
    then. When one fails or times out the others' waits end, the claims whose conditions are
    not all True lose their allocation, the rest are unreserved (as the scheduler's
    Unreserve), and :class:`PodBindingError` says why. A wait cancelled from outside (the
    pod given up) gives the claims back the same way before the cancellation goes on."""
    outcomes: dict[int, BindingOutcome] = {}
    failed: list[BindingOutcome] = []

    async def wait(index: int, claim: Obj, scope: anyio.CancelScope) -> None:
        outcome = await wait_for_binding(access, claim, binding_timeout_s=binding_timeout_s)
        outcomes[index] = outcome
        if not outcome.bound:
            failed.append(outcome)
            scope.cancel()

    try:
        async with anyio.create_task_group() as group:
            for index, claim in enumerate(pod.claims):
                if needs_binding(claim):
                    group.start_soon(wait, index, claim, group.cancel_scope)
    except anyio.get_cancelled_exc_class():
        # the pod was given up while it waited (its start's timeout, a stop): the scheduler's
        # Unreserve gives its claims back all the same, whatever cancelled the wait
        with anyio.CancelScope(shield=True), anyio.move_on_after(UNRESERVE_TIMEOUT_S):
            await _give_back(access, pod, outcomes)
        raise
    if not failed:
        claims = [
            (outcomes[i].claim or c) if i in outcomes else c for i, c in enumerate(pod.claims)
        ]
        return PodClaims(pod.pod, pod.namespace, claims, pod.drivers)
    await _give_back(access, pod, outcomes)
    raise PodBindingError(
        f"pod {pod.namespace}/{pod.pod.name}: binding {failed[0].state}: {failed[0].message}; "
        "its claims were given back, the pod can be scheduled on another node",
        failed[0],
    )


async def _give_back(
    access: ApiAccess, pod: PodClaims, outcomes: dict[int, BindingOutcome]
) -> None:
    """The claims of a pod that will not bind here: those whose binding conditions are not all
    True lose their allocation, the rest are unreserved."""
    for index, claim in enumerate(pod.claims):
        outcome = outcomes.get(index)
        if needs_binding(claim) and (outcome is None or not outcome.bound):
            if outcome is None:  # its wait was ended (a failed outcome undid its own)
                await undo_allocation(access, claim)
        else:
            ref = claim_ref(claim)
            await release_claim(access, ref.namespace, ref.name, pod.pod)
