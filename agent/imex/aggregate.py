"""The controller's copy of a domain's ComputeDomainCliques into its status (pure).

``status.nodes`` becomes the daemons of every clique of the domain (by clique, then index),
in the domain's own shape (``name`` for ``nodeName``); the domain is ``Ready`` when it has at
least ``numNodes`` nodes (with ``numNodes: 0``, at least one) and every clique is Ready (each of
its daemons is). The ``IMEXDaemonReady.<node>`` condition an agent writes when its daemon is not
ready is dropped once the node is Ready again or no longer a member.
"""

from __future__ import annotations

import copy

from agent.imex.cliques import DOMAIN_LABEL, clique_ready, daemon_entries
from agent.imex.documents import CONDITION_PREFIX, NodeEntry, Obj


def cliques_of(domain: Obj, cliques: list[Obj]) -> list[Obj]:
    uid = domain["metadata"]["uid"]
    return [c for c in cliques if (c["metadata"].get("labels") or {}).get(DOMAIN_LABEL) == uid]


def aggregated_nodes(cliques: list[Obj]) -> list[NodeEntry]:
    entries = [e for c in cliques for e in daemon_entries(c)]
    return sorted(entries, key=lambda e: (e.clique, e.index, e.name))


def aggregated_status(domain: Obj, cliques: list[Obj]) -> Obj:
    """The domain's status as the controller wants it, from its cliques."""
    status = copy.deepcopy(domain.get("status") or {})
    entries = aggregated_nodes(cliques)
    status["nodes"] = [e.to_dict() for e in entries]
    wanted = int((domain.get("spec") or {}).get("numNodes") or 0)
    ready = (
        bool(cliques)
        and bool(entries)
        and len(entries) >= wanted
        and all(clique_ready(c) or not daemon_entries(c) for c in cliques)
    )
    status["status"] = "Ready" if ready else "NotReady"
    failing = {e.name for e in entries if e.status != "Ready"}
    conditions = [
        c
        for c in status.get("conditions") or []
        if not str(c.get("type", "")).startswith(CONDITION_PREFIX)
        or str(c["type"])[len(CONDITION_PREFIX) :] in failing
    ]
    if conditions:
        status["conditions"] = conditions
    else:
        status.pop("conditions", None)
    return status
