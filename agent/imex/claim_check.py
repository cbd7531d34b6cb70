"""What a channel claim must be before the engine acts on it (pure: the claim as read).

Allocated ``channel-0`` of this node's pool, with a ``ComputeDomainChannelConfig`` among its
configs, on a node that has a fabric clique; otherwise a :class:`ChannelRefused` naming the
claim and what is wrong (the kubelet shows it on the pod).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from agent.dra.config import parse_allocation
from agent.imex.config import DRIVER, ChannelConfig, channel_config_for
from agent.imex.fabric import CHANNEL_DEVICE, Clique
from agent.imex.refusals import ChannelRefused
from agent.node.types import ClaimRef


@dataclass(frozen=True, slots=True)
class ChannelRequest:
    config: ChannelConfig  # the claim's ComputeDomainChannelConfig
    request: str  # the allocation result's request (its base request name)
    clique: str  # this node's fabric clique


def channel_request(
    claim: dict[str, Any], ref: ClaimRef, node_name: str, clique: Clique
) -> ChannelRequest:
    """What the claim (as read from the API server) asks of this node, once it is checked."""
    subject = f"ResourceClaim {ref.namespace}/{ref.name} ({ref.uid})"
    if (claim.get("metadata") or {}).get("uid") != ref.uid:
        raise ChannelRefused(f"{subject} got replaced: the API server has another uid")
    allocation = (claim.get("status") or {}).get("allocation")
    if not isinstance(allocation, dict):
        raise ChannelRefused(f"{subject} is not allocated")
    results, configs = parse_allocation(allocation)
    ours = [r for r in results if r.driver == DRIVER and r.pool == node_name]
    if not ours:
        raise ChannelRefused(f"{subject} has no {DRIVER} device in pool {node_name}")
    if any(r.device != CHANNEL_DEVICE for r in ours):
        raise ChannelRefused(
            f"{subject}: devices {', '.join(r.device for r in ours)} do not exist on this "
            f"node (it publishes only {CHANNEL_DEVICE})"
        )
    if clique.clique is None:
        raise ChannelRefused(f"{subject}: this node cannot join a ComputeDomain: {clique.reason}")
    config = channel_config_for(ours[0], configs, f"{ref.namespace}/{ref.name}")
    return ChannelRequest(config, ours[0].base_request, clique.clique)
