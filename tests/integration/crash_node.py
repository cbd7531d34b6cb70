"""The crash matrix's GPU node (``run --simulate dgx-h100 --dynamic-mig``): what a crash left
and the whole-node checks listed in ``test_crash_matrix.py``'s docstring; the ComputeDomain
node is ``crash_tray.py``."""

from __future__ import annotations

import json
from typing import Any

import anyio

from agent.crash import ENV_VAR, EXIT_STATUS
from agent.hardware.simulated.tools import read_timeslices
from agent.node.checkpoint import ClaimState, PreparedClaim, from_dict
from agent.node.durable import is_temporary
from agent.sharing.mps import daemons_of
from agent.sim.state_cli import read_state
from tests.integration.conftest import (
    DRIVER,
    NODE,
    AgentHarness,
)
from tests.integration.crash_scenarios import DYNAMIC, SHARES, Scenario
from tests.integration.test_sharing import host_root, mps_dir


class Node:
    """The matrix's agent and everything it touches on the node, checked as a whole."""

    def __init__(self, harness: AgentHarness) -> None:
        self.harness = harness
        self.expected_devices: dict[bool, set[str]] = {}  # dynamic MIG? -> published names
        self.claims = 0  # made by the scenarios so far
        self.current: str | None = None  # the UID of the running scenario's claim
        self.dynamic = True  # how the running agent publishes (a share scenario's: static)

    # -- the agent -------------------------------------------------------------------------

    async def stop(self) -> None:
        agent = self.harness.agent
        if agent is not None and agent.returncode is None:
            assert await agent.stop() == 0, agent.log()

    async def start(
        self, *, dynamic: bool = True, armed: str | None = None, shares: bool = False
    ) -> None:
        env = {ENV_VAR: armed} if armed else None
        self.dynamic = dynamic
        args = (*(DYNAMIC if self.dynamic else ()), *(SHARES if shares else ()))
        await self.harness.start_agent(env, args=args)

    async def crashed(self, scenario: Scenario) -> None:
        """The armed agent died at the scenario's point, nowhere else."""
        agent = self.harness.agent
        assert agent is not None
        assert await agent.wait() == EXIT_STATUS, agent.log()
        assert f"crashing at {scenario.point}" in agent.log(), agent.log()

    def left(self, uid: str) -> str:
        """What a crash left of claim ``uid``: its checkpoint state (or ``absent``), whether
        its CDI spec exists, and whether a temporary lies next to the checkpoint or specs."""
        claim = self.checkpoint().get(uid)
        words = [str(claim.state) if claim is not None else "absent"]
        words.append("spec" if uid in self.harness.cdi_claim_uids() else "no-spec")
        directories = (self.harness.plugin_dir, self.harness.cdi_root)
        if any(is_temporary(p.name) for d in directories for p in d.iterdir()):
            words.append("temporary")
        if claim is not None and claim.intents:
            words.append("intents=" + ",".join(sorted({i.effector for i in claim.intents})))
        return " ".join(words)

    # -- what the node holds ----------------------------------------------------------------

    def checkpoint(self) -> dict[str, PreparedClaim]:
        try:
            document = json.loads(self.harness.checkpoint_path.read_text())
        except FileNotFoundError:
            return {}
        return dict(from_dict(document).claims)

    def wipe(self) -> None:
        """Delete this node's slices, as the kubelet does at its start."""
        for item in self.published():
            self.harness.server.delete_object("resourceslices", item["metadata"]["name"])

    def published(self) -> list[dict[str, Any]]:
        selector = f"spec.nodeName={NODE},spec.driver={DRIVER}"
        return self.harness.server.list_objects("resourceslices", field_selector=selector)

    async def whole_pool(self, dynamic: bool, timeout: float = 15.0) -> set[str]:  # noqa: ASYNC109
        """Wait until the published pool is whole and holds the devices of a clean start
        (before those are known: the first whole pool after a wipe); returns its devices."""
        expected = self.expected_devices.get(dynamic)
        with anyio.fail_after(timeout):
            while (devices := self._pool_devices()) is None or (  # noqa: ASYNC110
                expected is not None and devices != expected
            ):
                await anyio.sleep(0.05)
        return devices

    async def shared_pool(
        self,
        dynamic: bool,
        timeout: float = 15.0,  # noqa: ASYNC109
        *,
        shared: bool = True,
    ) -> None:
        """Wait until the published pool is a clean start's, its devices shared (or, with
        ``shared=False``, none of them): the pool of the agent just started, not the last
        one's, which a claim allocated at once would otherwise be given (a static pool
        after a share scenario's agent has no MIG device for a MIG claim)."""
        with anyio.fail_after(timeout):
            while not (  # noqa: ASYNC110
                self._pool_devices() == self.expected_devices[dynamic]
                and all(
                    bool(d.get("allowMultipleAllocations")) is shared
                    for s in self.published()
                    for d in s["spec"].get("devices", [])
                )
            ):
                await anyio.sleep(0.05)

    def _pool_difference(self, expected: set[str]) -> str:
        found = self.published()
        pools = sorted({json.dumps(s["spec"]["pool"], sort_keys=True) for s in found})
        names = {d["name"] for s in found for d in s["spec"].get("devices", [])}
        return (
            f"the pool is not whole or not what a clean start publishes: {len(found)} slices "
            f"of {pools}; missing {sorted(expected - names)}, extra {sorted(names - expected)}"
        )

    def _pool_devices(self) -> set[str] | None:
        """The devices of the published pool when it is whole (None otherwise); fails on a
        device published twice or a slice of another generation left behind."""
        found = self.published()
        pools = {
            (s["spec"]["pool"]["generation"], s["spec"]["pool"]["resourceSliceCount"])
            for s in found
        }
        if len(pools) != 1 or len(found) != next(iter(pools))[1]:
            return None
        names = [d["name"] for s in found for d in s["spec"].get("devices", [])]
        assert len(names) == len(set(names)), f"a device is published twice: {sorted(names)}"
        assert len({s["metadata"]["name"] for s in found}) == len(found)
        return set(names)

    # -- the checks ------------------------------------------------------------------------

    async def check(
        self, kubelet_view: set[str], in_flight: str | None = None, *, undone: bool = False
    ) -> None:
        """Everything the module docstring lists; ``kubelet_view`` is the claims the kubelet
        was told are prepared, ``in_flight`` the one whose call the crash interrupted, and
        ``undone`` says that call was an unprepare: its claim may still be completed while its
        hardware is already undone (agent/node/unprepare.py), which the retry finishes."""
        harness = self.harness
        claims = self.checkpoint()
        started = {u for u, c in claims.items() if c.state is not ClaimState.PREPARE_COMPLETED}
        assert not started, f"claims left PrepareStarted: {started}"
        completed = set(claims)
        assert completed == harness.cdi_claim_uids(), "checkpoint and CDI specs disagree"
        assert completed ^ kubelet_view <= {in_flight}, (completed, kubelet_view, in_flight)
        for directory in (harness.plugin_dir, harness.cdi_root):
            leftovers = [p.name for p in directory.iterdir() if is_temporary(p.name)]
            assert not leftovers, f"temporaries left in {directory}: {leftovers}"
        held = {u: c for u, c in claims.items() if not (undone and u == in_flight)}

        state = read_state(harness.plugins_dir, DRIVER)  # what `sim state -o json` prints
        devices = [d for c in claims.values() for d in c.devices]
        mig_uuids = {d.uuid for d in devices if d.mig is not None}
        required = {d.uuid for c in held.values() for d in c.devices if d.mig is not None}
        live = {
            ci["uuid"]: gpu["uuid"]
            for gpu in state["gpus"]
            for gi in gpu.get("gpuInstances", [])
            for ci in gi.get("computeInstances", [])
        }
        assert required <= set(live) <= mig_uuids, f"MIG instances {live}, claims {mig_uuids}"
        with_instances = {
            gpu["uuid"] for gpu in state["gpus"] if gpu.get("gpuInstances") or gpu.get("migMode")
        }
        assert with_instances <= set(live.values()), f"MIG left on: {with_instances}"

        used = {d.mig.parent_uuid if d.mig is not None else d.uuid for d in devices}
        timeslices = read_timeslices(host_root(harness))
        changed = {
            gpu["uuid"]
            for gpu in state["gpus"]
            if int(gpu.get("computeMode", 0)) != 0 or timeslices.get(gpu["uuid"], 0) != 0
        }
        assert changed <= used, f"compute mode or time-slice not restored on {changed - used}"

        shared = {u for u, c in claims.items() if any(d.mps is not None for d in c.devices)}
        running = {u for u in shared if u in held}
        mps_root = harness.plugin_dir / "mps"
        dirs = {p.name for p in mps_root.iterdir()} if mps_root.exists() else set()
        assert dirs <= shared, f"MPS directories of claims not prepared: {dirs - shared}"
        for uid in dirs | ({self.current} if self.current else set()):
            daemons = daemons_of(mps_dir(harness, uid) / "pipe")
            assert (uid in running) <= len(daemons) <= (uid in shared), f"{uid}: MPS {daemons}"

        try:  # a restart may republish (a changed inventory); it must converge
            await self.whole_pool(self.dynamic, timeout=10.0)
        except TimeoutError:
            expected = self.expected_devices[self.dynamic]
            raise AssertionError(self._pool_difference(expected)) from None
