"""The crash matrix's ComputeDomain node: a ``gb200-nvl72-tray --compute-domains on`` agent
serving ``compute-domain.nvidia.com`` and what its channel checks look at (the checks are
listed in ``test_crash_matrix.py``'s docstring)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio

from agent.crash import ENV_VAR, EXIT_STATUS
from agent.imex.cdi import channel_spec, channels_for
from agent.imex.cliques import DOMAIN_LABEL, daemon_entries
from agent.imex.config import DRIVER as CD_DRIVER
from agent.imex.config import AllocationMode
from agent.imex.daemon_files import CONFIG_FILE, PID_FILE
from agent.imex.domains import CONDITION_PREFIX, NodeEntry
from agent.imex.fabric import CHANNEL_DEVICE
from agent.imex.wiring import SIM_CHANNELS_MAJOR
from agent.node.cdi import SpecStatus
from agent.node.durable import is_temporary
from agent.sim.kubelet import ClaimRef
from tests.integration.compute_domains import DRIVER_NAMESPACE, Cluster
from tests.integration.compute_domains import Node as ClusterNode
from tests.integration.crash_scenarios import Scenario

TRAY_NODE = "tray-m"
CHANNEL_SETTLE_S = 20.0  # the restarted agent replaces the daemon in the background


class Tray:
    """The channel scenarios' node (module docstring): a ``gb200-nvl72-tray`` agent serving
    ``compute-domain.nvidia.com``, its kubelet emulator, and one stored ComputeDomain."""

    def __init__(self, cluster: Cluster, node: ClusterNode, domain: dict[str, Any]) -> None:
        self.cluster = cluster
        self.node = node
        self.domain = domain
        self.domain_uid: str = domain["metadata"]["uid"]
        self.claims = 0

    # -- the agent -------------------------------------------------------------------------

    async def start(self, armed: str | None = None) -> None:
        await self.cluster.start(self.node, env={ENV_VAR: armed} if armed else None)

    async def stop(self) -> None:
        process = self.node.process
        if process is not None and process.returncode is None:
            assert await self.cluster.stop(self.node) == 0, self.node.log()

    async def crashed(self, scenario: Scenario) -> None:
        process = self.node.process
        assert process is not None
        with anyio.fail_after(20):
            assert await process.wait() == EXIT_STATUS, self.node.log()
        assert f"crashing at {scenario.point}" in self.node.log(), self.node.log()

    async def clean(self) -> None:
        """Unprepare what a failed scenario left prepared, so that it fails alone."""
        left = self.node.checkpoint()
        if not left:
            return
        await self.start()
        refs = [ClaimRef(namespace=c["namespace"], uid=u, name=c["name"]) for u, c in left.items()]
        await self.node.kubelet.unprepare(CD_DRIVER, refs)
        await self.stop()

    async def claim(self) -> ClaimRef:
        self.claims += 1
        return await self.cluster.hand_claim(self.node, f"m-channel-{self.claims}", self.domain)

    # -- what the node holds ----------------------------------------------------------------

    @property
    def domains_dir(self) -> Path:
        return self.node.plugin_dir / "domains"

    def daemons(self) -> dict[int, Path]:
        """Live simulated IMEX daemons (pid -> config) started for this node's domain
        directories, found in ``/proc`` by their command line (``nvidia-imex ... -c CONFIG``;
        the ``/bin/sh`` wrapper before its ``exec`` counts too), whoever started them."""
        root = f"{self.domains_dir}/"
        found: dict[int, Path] = {}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdecimal():
                continue
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
                state = (entry / "stat").read_text().split(") ", 1)[1][0]
            except (OSError, IndexError):
                continue
            if state == "Z" or not any(Path(a).name == "nvidia-imex" for a in argv):
                continue
            config = argv[argv.index("-c") + 1] if "-c" in argv[:-1] else ""
            if config.startswith(root):
                found[int(entry.name)] = Path(config)
        return found

    def entries(self) -> list[NodeEntry]:
        """This node's entries in the domain's ComputeDomainCliques (at most one is right)."""
        cliques = self.cluster.server.list_objects(
            "computedomaincliques",
            DRIVER_NAMESPACE,
            label_selector=f"{DOMAIN_LABEL}={self.domain_uid}",
        )
        return [e for c in cliques for e in daemon_entries(c) if e.name == TRAY_NODE]

    def conditions(self) -> list[dict[str, Any]]:
        stored = self.cluster.domain(self.domain["metadata"]["name"])
        conditions = (stored.get("status") or {}).get("conditions") or []
        return [c for c in conditions if c.get("type") == CONDITION_PREFIX + TRAY_NODE]

    def temporaries(self) -> list[Path]:
        roots = [self.node.plugin_dir, self.node.root / "cdi"]
        if self.domains_dir.is_dir():
            roots += [p for p in self.domains_dir.iterdir() if p.is_dir()]
        return [p for d in roots if d.is_dir() for p in d.iterdir() if is_temporary(p.name)]

    def left(self, uid: str) -> str:
        """What a crash left (:attr:`Scenario.left` of a channel scenario)."""
        claim = self.node.checkpoint().get(uid)
        words = [claim["state"] if claim is not None else "absent"]
        words.append("spec" if uid in self.node.cdi.claim_uids() else "no-spec")
        entries = self.entries()
        assert len(entries) <= 1, f"{TRAY_NODE} is in its clique {len(entries)} times"
        words.append("member=" + (entries[0].status if entries else "absent"))
        directory = self.node.domain_dir(self.domain_uid)
        words.append("config" if (directory / CONFIG_FILE).is_file() else "no-config")
        words.append("pid" if (directory / PID_FILE).is_file() else "no-pid")
        words.append(f"daemons={len(self.daemons())}")
        if self.temporaries():
            words.append("temporary")
        return " ".join(words)

    # -- the checks ------------------------------------------------------------------------

    async def check(
        self,
        kubelet_view: set[str],
        in_flight: str | None = None,
        killed: frozenset[int] = frozenset(),
        adopted: frozenset[int] = frozenset(),
    ) -> None:
        """The module docstring's channel checks; ``in_flight`` is the claim whose call the
        crash interrupted (its entry, spec and membership may differ until the retry),
        ``killed`` the daemons that ran when the agent died (none may survive the restart)
        and ``adopted`` those that must still run (a completed claim holds their domain)."""
        claims = self.node.checkpoint()
        completed = {u for u, c in claims.items() if c["state"] == "PrepareCompleted"}
        started = set(claims) - completed
        assert started <= {in_flight}, f"claims left PrepareStarted: {started}"
        assert completed ^ kubelet_view <= {in_flight}, (completed, kubelet_view, in_flight)
        specs = self.node.cdi
        assert specs.claim_uids() == completed, "CDI specs and completed entries disagree"
        for uid in completed:
            mode = AllocationMode(claims[uid]["mode"])
            spec = channel_spec(
                CD_DRIVER, uid, CHANNEL_DEVICE, channels_for(mode), SIM_CHANNELS_MAJOR
            )
            status = specs.status(specs.claim_path(uid), spec)
            assert status is SpecStatus.MATCHES, f"{uid}: its CDI spec {status.value}"

        served = {c["domain_uid"] for c in claims.values()}
        wanted = {self.node.domain_dir(d) / CONFIG_FILE for d in served}
        with anyio.move_on_after(CHANNEL_SETTLE_S):
            while True:
                found = self.daemons()
                pid_files = {
                    int(t)
                    if (t := read_or_empty(config.parent / PID_FILE).strip()).isdecimal()
                    else 0
                    for config in wanted
                }
                if (
                    sorted(found.values()) == sorted(wanted)
                    and not set(found) & killed
                    and adopted <= set(found)
                    and pid_files == set(found)
                ):
                    break
                await anyio.sleep(0.1)
        assert sorted(found.values()) == sorted(wanted), (
            f"IMEX daemons {found}: wanted one for each of {sorted(wanted)}\n{self.node.log()}"
        )
        assert not set(found) & killed, f"daemons of the killed agent survive: {found}"
        assert adopted <= set(found), f"daemons {sorted(adopted)} not adopted: {found}"
        assert pid_files == set(found), f"pid files {pid_files}, daemons {found}"
        # after the daemons settled: a restarted agent writes the record and the pid file of
        # the daemon it starts in the background (each through a temporary)
        assert not self.temporaries(), f"temporaries left: {self.temporaries()}"
        directories = (
            {p.name for p in self.domains_dir.iterdir()} if self.domains_dir.is_dir() else set()
        )
        assert directories <= served, f"directories of domains not served: {directories - served}"

        entries = self.entries()
        assert len(entries) <= 1, f"{TRAY_NODE} is in its clique {len(entries)} times"
        if in_flight is None:  # after the retry: a member exactly while a claim is prepared
            assert len(entries) == (1 if completed else 0), (entries, completed)
            assert all(e.status == "Ready" for e in entries), entries
            # with cliques a node writes the domain only when its daemon is not ready
            assert self.conditions() == [], self.conditions()


def read_or_empty(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
