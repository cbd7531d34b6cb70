"""Shared setup of the engine tests: a simulated host, an embedded API server, real files.

The engine is exercised exactly as the agent runs it: claims are created over HTTP the way the
scheduler leaves them (``agent.sim.claims``), read back through kubernetes-asyncio, and the
CDI specs and checkpoint are real files in a temporary directory.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.dra import cdi
from agent.hardware.discovery import discover_host
from agent.hardware.hostfiles import HostFiles
from agent.hardware.inventory import Inventory
from agent.kube.claims import ApiClaimReader
from agent.kube.events import LoggingEventPoster
from agent.node.checkpoint_store import FILE_NAME
from agent.node.effectors import DeviceEffector
from agent.node.engine import PrepareEngine
from agent.node.types import ClaimRef
from agent.sim.apiserver import EmbeddedApiServer
from agent.sim.claims import AllocatedDevice, OpaqueConfig, create_allocated_claim

DRIVER = "gpu.nvidia.com"
NODE = "node-1"


@dataclass(frozen=True)
class Host:
    """A simulated host laid out under ``root`` and what discovery found there."""

    profile: str
    root: Path
    inventory: Inventory

    @property
    def boot_id(self) -> str:
        boot_id = HostFiles(self.root).boot_id()
        assert boot_id is not None
        return boot_id


def discover(profile: str, root: Path) -> Host:
    inventory = anyio.run(discover_host, profile, root)
    return Host(profile, root, inventory)


@dataclass
class Node:
    """Directories of one node and a factory of engines over them."""

    host: Host
    api: EmbeddedApiServer
    api_client: Any
    base: Path
    events: LoggingEventPoster = field(default_factory=LoggingEventPoster)
    readers: list[ApiClaimReader] = field(default_factory=list)

    @property
    def plugin_dir(self) -> Path:
        return self.base / "plugins" / DRIVER

    @property
    def cdi_root(self) -> Path:
        return self.base / "cdi"

    @property
    def checkpoint_path(self) -> Path:
        return self.plugin_dir / FILE_NAME

    def engine(
        self,
        *,
        boot_id: str | None = None,
        lock_timeout_s: float = 5.0,
        dynamic_mig: bool = False,
        adopt_mig_instances: bool = False,
        effectors: Sequence[DeviceEffector] = (),
    ) -> PrepareEngine:
        return PrepareEngine(
            driver=DRIVER,
            node_name=NODE,
            inventory=self.host.inventory,
            plugin_dir=self.plugin_dir,
            cdi_root=self.cdi_root,
            host_root=self.host.root,
            driver_root=self.host.root / "driver-root",
            claim_reader=self.reader(),
            boot_id=boot_id or self.host.boot_id,
            events=self.events,
            lock_timeout_s=lock_timeout_s,
            dynamic_mig=dynamic_mig,
            adopt_mig_instances=adopt_mig_instances,
            effectors=effectors,
        )

    def reader(self) -> ApiClaimReader:
        reader = ApiClaimReader(self.api_client, timeout_s=5.0)
        self.readers.append(reader)
        return reader

    async def close(self) -> None:
        for reader in self.readers:
            await reader.close()

    async def claim(
        self,
        name: str,
        devices: Sequence[str | AllocatedDevice],
        *,
        configs: Sequence[OpaqueConfig] = (),
        namespace: str = "default",
    ) -> ClaimRef:
        """Create an allocated claim; plain device names become request ``gpu`` results."""
        results = [
            d if isinstance(d, AllocatedDevice) else AllocatedDevice("gpu", d, NODE)
            for d in devices
        ]
        created = await create_allocated_claim(
            self.api.url, name, results, namespace=namespace, configs=configs, node_name=NODE
        )
        return ClaimRef(namespace, created["metadata"]["uid"], name)

    def spec_path(self, uid: str) -> Path:
        return self.cdi_root / cdi.claim_spec_file_name(DRIVER, uid)

    def spec(self, uid: str) -> dict[str, Any]:
        document: dict[str, Any] = json.loads(self.spec_path(uid).read_text())
        return document

    def checkpoint_claims(self) -> dict[str, Any]:
        """The claims of the checkpoint file on disk (not the engine's memory)."""
        claims: dict[str, Any] = json.loads(self.checkpoint_path.read_text())["claims"]
        return claims

    def spec_uids(self) -> set[str]:
        prefix = f"k8s.{DRIVER}-claim_"
        return {
            path.name[len(prefix) : -len(".json")] for path in self.cdi_root.glob(f"{prefix}*.json")
        }

    def assert_consistent(self) -> None:
        """Checkpoint and CDI directory agree: every completed claim has its spec, nothing else."""
        claims = self.checkpoint_claims() if self.checkpoint_path.exists() else {}
        completed = {uid for uid, c in claims.items() if c["state"] == "PrepareCompleted"}
        assert completed == set(claims), f"started claims left over: {claims}"
        assert self.spec_uids() == completed
        leftovers = [p.name for p in self.base.rglob(".*.tmp-*")]
        assert leftovers == []


@pytest.fixture(scope="session")
def h100_host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return discover("dgx-h100", tmp_path_factory.mktemp("dgx-h100"))


@pytest.fixture(scope="session")
def a100_host(tmp_path_factory: pytest.TempPathFactory) -> Host:
    return discover("dgx-a100", tmp_path_factory.mktemp("dgx-a100"))


@pytest.fixture
def node(h100_host: Host, apiserver: EmbeddedApiServer, api_client: Any, tmp_path: Path) -> Node:
    return Node(h100_host, apiserver, api_client, tmp_path / "node")


@pytest.fixture
def a100_node(
    a100_host: Host, apiserver: EmbeddedApiServer, api_client: Any, tmp_path: Path
) -> Node:
    return Node(a100_host, apiserver, api_client, tmp_path / "node")


@pytest.fixture
async def engine(node: Node) -> AsyncIterator[PrepareEngine]:
    engine = node.engine()
    await engine.start()
    try:
        yield engine
    finally:
        await engine.close()


def files_under(root: Path) -> Iterator[Path]:
    return (path for path in root.rglob("*") if path.is_file())
