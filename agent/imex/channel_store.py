"""The channel engine's durable state on a node: its checkpoint and its claims' CDI specs.

``ChannelStore`` owns ``<plugin dir>/checkpoint.json`` (:mod:`agent.imex.channel_checkpoint`)
and the ``compute-domain.nvidia.com`` claim specs in the CDI directory; the engine
(:mod:`agent.imex.engine`) decides, the store makes it durable. Every file call runs in a worker
thread; a record is on disk before :attr:`ChannelStore.claims` shows it.
"""

from __future__ import annotations

from pathlib import Path

import anyio

from agent.hardware.hostfiles import HostFiles
from agent.imex import channel_checkpoint
from agent.imex.cdi import CHANNELS_MAJOR_NAME, channel_spec, channels_for
from agent.imex.channel_checkpoint import CHECKPOINT_FILE, COMPLETED, ChannelClaim
from agent.imex.config import DRIVER, AllocationMode
from agent.imex.daemon_files import sweep_domains
from agent.imex.fabric import CHANNEL_DEVICE
from agent.imex.refusals import ChannelRefused
from agent.node.cdi import CdiSpecDirectory
from agent.node.durable import clean_temporaries


class ChannelStore:
    """The checkpoint's claims (in memory as on disk) and the claims' CDI specs."""

    def __init__(self, plugin_dir: Path, cdi_root: Path, host_root: Path) -> None:
        self.plugin_dir = Path(plugin_dir)
        self.path = self.plugin_dir / CHECKPOINT_FILE
        self.specs = CdiSpecDirectory(Path(cdi_root), DRIVER)
        self._host = HostFiles(Path(host_root))
        self.claims: dict[str, ChannelClaim] = {}

    async def recover(self, domains_dir: Path) -> None:
        """At start (under the node lock): load the checkpoint; rewrite the CDI specs of
        completed claims (tmpfs), remove the others (of no entry, or of a ``PrepareStarted``
        one: its retry writes it again) and the temporaries a crash left; remove the
        directories (and stop the daemons) of domains no entry serves."""
        await anyio.to_thread.run_sync(clean_temporaries, self.plugin_dir)
        self.claims = await anyio.to_thread.run_sync(channel_checkpoint.load, self.path)
        for claim in self.claims.values():
            if claim.state == COMPLETED:
                await self.write_spec(claim)
        owned = {uid for uid, c in self.claims.items() if c.state == COMPLETED}
        for uid in self.specs.claim_uids() - owned:
            self.specs.remove_claim(uid)
        served = {c.domain_uid for c in self.claims.values()}
        await anyio.to_thread.run_sync(sweep_domains, domains_dir, served)

    async def record(self, entry: ChannelClaim) -> None:
        """``entry`` durable (shielded: a cancelled call must not leave memory and disk apart)."""
        claims = {**self.claims, entry.uid: entry}
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(channel_checkpoint.save, self.path, claims)
        self.claims = claims

    async def forget(self, uid: str) -> None:
        """The claim's entry gone from the checkpoint."""
        claims = {u: c for u, c in self.claims.items() if u != uid}
        await anyio.to_thread.run_sync(channel_checkpoint.save, self.path, claims)
        self.claims = claims

    async def write_spec(self, entry: ChannelClaim) -> None:
        await anyio.to_thread.run_sync(self._write_spec, entry)

    async def remove_spec(self, uid: str) -> None:
        await anyio.to_thread.run_sync(self.specs.remove_claim, uid)

    def _write_spec(self, entry: ChannelClaim) -> None:
        major = self._host.device_majors().get(CHANNELS_MAJOR_NAME)
        if major is None:
            raise ChannelRefused(
                f"no {CHANNELS_MAJOR_NAME} line in {self._host.root}/proc/devices: the NVIDIA "
                "driver offers no IMEX channels (is NVreg_ImexChannelCount 0?)"
            )
        spec = channel_spec(
            DRIVER, entry.uid, CHANNEL_DEVICE, channels_for(AllocationMode(entry.mode)), major
        )
        self.specs.ensure(self.specs.claim_path(entry.uid), spec)
