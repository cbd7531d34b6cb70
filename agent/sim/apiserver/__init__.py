"""An embedded, in-memory Kubernetes API server for the kinds gpu-dra-agent talks to.

No real kube-apiserver runs on a developer laptop or in CI here, yet the agent's Kubernetes code must be
exercised against real HTTP, real ``Status`` errors and real watch streams, so that what works against
this server works against a cluster. The demo ships with it; tests start one per test on port 0.

Implemented:
  * kinds (table-driven, :mod:`.kinds`): ``resource.k8s.io/v1`` resourceslices, resourceclaims (with
    ``status``), deviceclasses; core ``v1`` nodes (with ``status``) and events;
    ``resource.nvidia.com/v1beta1`` computedomains (with ``status``); ``resource.k8s.io/v1``
    resourceclaimtemplates; ``coordination.k8s.io/v1`` leases;
  * verbs: get, list (field and label selectors, ``limit``/``continue``), create (``generateName``),
    update (optimistic concurrency, generation bumps, status subresource split), patch (JSON patch, merge
    patch, strategic merge patch with merge semantics and whole-list replacement), delete (returns the
    object, ``preconditions``), deletecollection, watch (history replay, 410 Expired, bookmarks,
    ``sendInitialEvents``, ``timeoutSeconds``, selector enter/leave as ADDED/DELETED);
  * one global resourceVersion; real ``Status`` bodies; discovery and ``/version``;
  * background cascading deletion of objects whose ``ownerReferences`` name a deleted object (slices
    owned by a Node go with the Node);
  * fault injection (status codes, ``Retry-After``, latency, dropped connections, ending watches) and
    a request log;
  * an opt-in max-in-flight limit answering 429 with ``Retry-After`` (watches hold no seat), request
    counts by verb, resource and status, and a restart that keeps the objects (:mod:`.limits`; over
    HTTP ``GET /debug/embedded/requests``, ``POST /debug/embedded/restart``);
  * for kubectl: OpenAPI v2 and v3 (:mod:`.openapi`, schemas in :mod:`.schema_index`), field
    validation (``fieldValidation``, :mod:`.fieldcheck`), server-side printing (``as=Table``,
    :mod:`.tables`) and server-side apply (:mod:`.apply`).

Not implemented: authentication, authorization and RBAC (the token is ignored); admission; schema
validation of values and defaulting (only names, unknown fields, ResourceSlice required/immutable
fields, the capacities' request policies as kube-apiserver checks them (:mod:`.policies`), kind and
namespace are checked); graceful deletion periods and foreground/orphan propagation (finalizers are honoured: a
delete marks ``deletionTimestamp``, removing the last finalizer completes it); feature gates
(no fields are dropped); strategic-merge list merging by key and ``$patch`` directives;
``resourceVersion``/``resourceVersionMatch`` on LIST (always the latest state); dry run; managed
fields of writes other than server-side apply; label-selector ``>``/``<``; namespaces as objects
(any namespace exists); protobuf; TLS; HTTP/2; the watch cache's server-side timeouts.
"""

from agent.sim.apiserver.cli import configure_parser, run
from agent.sim.apiserver.errors import ApiError
from agent.sim.apiserver.faults import FaultInjector, FaultRule, RequestLog, RequestRecord
from agent.sim.apiserver.kinds import DEFAULT_KINDS, KindRegistry, ResourceKind
from agent.sim.apiserver.server import EmbeddedApiServer

__all__ = [
    "DEFAULT_KINDS",
    "ApiError",
    "EmbeddedApiServer",
    "FaultInjector",
    "FaultRule",
    "KindRegistry",
    "RequestLog",
    "RequestRecord",
    "ResourceKind",
    "configure_parser",
    "run",
]
