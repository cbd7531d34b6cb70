"""A throwaway agent process for the crash-point tests: build an engine, run one request, print.

Usage: ``python -m tests.unit.node.engine_crash_child '<json>'`` where the JSON object has
``profile``, ``host_root``, ``base`` (the node directory of ``engine_support.Node``),
``kubeconfig``, ``action`` (``prepare`` or ``unprepare``) and ``claims`` (a list of
``[namespace, uid, name]``). With ``GPU_DRA_AGENT_CRASH_AT`` set, the process dies at that
point (SIGKILL, ``agent.crash.EXIT_STATUS``) instead of printing.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import anyio

from agent.hardware.discovery import discover_host
from agent.hardware.hostfiles import HostFiles
from agent.kube.claims import ApiClaimReader
from agent.kube.client import create_api_client
from agent.kube.events import LoggingEventPoster
from agent.node.engine import PrepareEngine
from agent.node.types import ClaimRef

DRIVER = "gpu.nvidia.com"
NODE = "node-1"


async def main(args: dict[str, Any]) -> None:
    host_root = Path(args["host_root"])
    base = Path(args["base"])
    inventory = await discover_host(args["profile"], host_root)
    client = await create_api_client(Path(args["kubeconfig"]))
    boot_id = HostFiles(host_root).boot_id()
    assert boot_id is not None
    reader = ApiClaimReader(client)
    engine = PrepareEngine(
        driver=DRIVER,
        node_name=NODE,
        inventory=inventory,
        plugin_dir=base / "plugins" / DRIVER,
        cdi_root=base / "cdi",
        host_root=host_root,
        driver_root=host_root / "driver-root",
        claim_reader=reader,
        boot_id=boot_id,
        events=LoggingEventPoster(),
    )
    claims = [ClaimRef(*claim) for claim in args["claims"]]
    try:
        await engine.start()
        if args["action"] == "prepare":
            prepared = await engine.prepare(claims)
            output: Any = {uid: asdict(result) for uid, result in prepared.items()}
        else:
            output = await engine.unprepare(claims)
        print(json.dumps(output))
    finally:
        await engine.close()
        await reader.close()
        await client.close()


if __name__ == "__main__":
    anyio.run(main, json.loads(sys.argv[1]))
