"""The plain data ``status`` gathers from each source and the findings it reports.

Each source fills its own record and says what it could not read (``error``); the drift
rules (``agent.status.drift``) and the renderers see only these records.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from agent.hardware.inventory import Inventory
from agent.node.checkpoint import Checkpoint


class CannotRead(Exception):
    """A source that status cannot do without is unreadable (exit 2); the message says
    which and why."""


@dataclass(frozen=True)
class Finding:
    """One disagreement between two sources, and what to do about it."""

    subject: str  # what it is about: a claim, a device, a file, a slice
    problem: str
    hint: str


@dataclass(frozen=True)
class CheckpointView:
    """The GPU driver's checkpoint as read without the node lock."""

    path: str
    status: str  # loaded | missing | corrupt | previous-boot
    checkpoint: Checkpoint | None = None
    reason: str = ""
    age_s: float | None = None


@dataclass(frozen=True)
class SpecFile:
    """A claim's CDI spec file compared with what its checkpoint entry says."""

    uid: str
    path: str
    state: str  # matches | missing | differs | orphan | unbuildable
    since: float | None = None  # the file's mtime (the claim's prepare time)
    detail: str = ""  # why an unbuildable spec cannot be built from the checkpoint


@dataclass(frozen=True)
class CdiView:
    root: str
    common_path: str
    common_present: bool
    specs: tuple[SpecFile, ...] = ()


@dataclass(frozen=True)
class MpsDaemonView:
    claim_uid: str
    pipe_dir: str
    pid: int | None
    alive: bool


@dataclass(frozen=True)
class ChannelClaimView:
    """One entry of the compute-domain.nvidia.com checkpoint."""

    uid: str
    namespace: str
    name: str
    domain: str  # namespace/name
    domain_uid: str
    state: str
    spec_state: str  # matches | missing


@dataclass(frozen=True)
class ImexView:
    """The ComputeDomain side of the node: channel claims and the IMEX daemon."""

    checkpoint_path: str
    claims: tuple[ChannelClaimView, ...] = ()
    daemons: dict[str, int | None] = field(default_factory=dict)  # domain uid -> live pid
    error: str = ""


@dataclass(frozen=True)
class HardwareView:
    inventory: Inventory
    compute_modes: dict[str, int] = field(default_factory=dict)  # GPU UUID -> NVML mode
    source: str = "nvml"  # nvml | simulated <profile>


@dataclass(frozen=True)
class ApiView:
    """What the API server holds for this node (with --kubeconfig or in-cluster)."""

    slices: tuple[dict[str, Any], ...] = ()
    channel_slices: tuple[dict[str, Any], ...] = ()
    claims: dict[str, dict[str, Any]] = field(default_factory=dict)  # uid -> ResourceClaim
    domains: tuple[dict[str, Any], ...] = ()
    cliques: tuple[dict[str, Any], ...] = ()  # ComputeDomainCliques (membership per clique)
    #: claims allocated this node's channel with KEP-5007 binding conditions
    binding_claims: tuple[dict[str, Any], ...] = ()


@dataclass(frozen=True)
class AgentView:
    running: bool
    how: str  # what told us (the socket that answered, or why not)
    version: str
    socket: str = ""  # the DRA socket that accepted a connection


@dataclass(frozen=True)
class Snapshot:
    node: str
    driver: str
    agent: AgentView
    checkpoint: CheckpointView
    cdi: CdiView
    hardware: HardwareView
    mps: tuple[MpsDaemonView, ...] = ()
    imex: ImexView | None = None
    api: ApiView | None = None
    #: the running agent's health view by device name (its health stream); None: not read
    health: dict[str, str] | None = None
