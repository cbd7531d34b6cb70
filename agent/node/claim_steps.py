"""The engine's steps for one claim of a request, apart from the engine's state: which claims
a request names, which recorded answers can be given again, a claim's span, the re-answer of
a claim prepared before, and the read and plan of a new one.

They take what they need as arguments (the spec directory, the claim reader, the host facts)
and own nothing; ``engine.PrepareEngine`` holds the locks and the checkpoint around them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from opentelemetry import trace

from agent.crash import crash_point
from agent.dra import cdi
from agent.kube.interfaces import ClaimReader
from agent.node import checkpoint as cp
from agent.node.batch import answer, ensure_spec
from agent.node.cdi import CdiSpecDirectory
from agent.node.errors import NodeError
from agent.node.facts import HostFacts
from agent.node.holders import Prepared
from agent.node.plan import PrepareRefused, plan_claim
from agent.node.reconcile import is_adopted
from agent.node.types import ClaimPrepareResult, ClaimRef
from agent.telemetry.tracing import in_span, tracer


def unique_claims(claims: Sequence[ClaimRef]) -> list[ClaimRef]:
    """``claims`` without repeated UIDs, the first reference of each kept, in order."""
    seen: dict[str, ClaimRef] = {}
    for ref in claims:
        seen.setdefault(ref.uid, ref)
    return list(seen.values())


def reusable(entry: cp.PreparedClaim) -> bool:
    """A completed claim whose recorded answer is complete (not adopted after corruption)."""
    return entry.state is cp.ClaimState.PREPARE_COMPLETED and not is_adopted(entry)


def claim_span(name: str, ref: ClaimRef) -> trace.Span:
    """The span of one claim of a request (``claim.prepare``, ``claim.unprepare``)."""
    attributes: dict[str, Any] = {
        "k8s.resourceclaim.uid": ref.uid,
        "k8s.resourceclaim.name": ref.name,
        "k8s.namespace.name": ref.namespace,
    }
    return tracer().start_span(name, attributes=attributes)


async def reensure(
    specs: CdiSpecDirectory,
    entry: cp.PreparedClaim,
    span: trace.Span,
    results: dict[str, ClaimPrepareResult],
) -> None:
    """A claim prepared before: make sure its CDI spec is on disk, answer as recorded."""
    with in_span(span):
        span.set_attribute("gpu.device.names", [d.device for d in entry.devices])
        try:
            await ensure_spec(specs, entry.uid, entry.devices)
        except (NodeError, cdi.CdiSpecError) as error:
            results[entry.uid] = ClaimPrepareResult(error=str(error))
            return
        results[entry.uid] = answer(entry.devices)


async def read_and_plan(
    reader: ClaimReader,
    facts: HostFacts,
    ref: ClaimRef,
    span: trace.Span,
    *,
    driver: str,
    pool: str,
    sharing: bool,
) -> Prepared:
    """Read and plan one claim, its devices' names set on ``span`` (the claim's); raises
    ``PrepareRefused`` naming the claim's problem."""
    try:
        claim = await reader.read(ref.namespace, ref.name)
        crash_point("after-claim-read")
        plan = plan_claim(
            ref, claim, driver=driver, pool=pool, devices=facts.devices, sharing=sharing
        )
        span.set_attribute("gpu.device.names", list(plan.device_names))
        return tuple(facts.prepared_device(ref.uid, p) for p in plan.devices)
    except PrepareRefused:
        raise
    except (cdi.CdiSpecError, NodeError) as error:
        raise PrepareRefused(str(error)) from error
    except Exception as error:  # a reader error, or a bug: this claim only
        raise PrepareRefused(str(error) or repr(error)) from error
