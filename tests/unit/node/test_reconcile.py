"""Startup reconciliation: lost specs, orphans, a corrupt checkpoint, a reboot."""

from __future__ import annotations

import json

import pytest

from agent.dra import cdi
from agent.node.checkpoint_store import LoadStatus
from agent.node.engine import PrepareEngine
from agent.node.reconcile import StartupReport
from agent.node.types import ClaimRef
from tests.unit.node.engine_support import DRIVER, Node

pytestmark = pytest.mark.anyio
NEW_BOOT = "0b5e7d1c-9a8f-4e3d-b2c1-a0f9e8d7c6b5"


async def prepared(node: Node, *names: str) -> list[ClaimRef]:
    """Claims ``names`` (one GPU each: gpu-0, gpu-1, ...) prepared by an engine now closed."""
    refs = [await node.claim(name, [f"gpu-{i}"]) for i, name in enumerate(names)]
    engine = node.engine()
    await engine.start()
    try:
        results = await engine.prepare(refs)
        assert all(result.error is None for result in results.values())
    finally:
        await engine.close()
    return refs


async def restart(node: Node, boot_id: str | None = None) -> tuple[PrepareEngine, StartupReport]:
    engine = node.engine(boot_id=boot_id)
    return engine, await engine.start()


async def test_lost_and_damaged_specs_are_rebuilt_orphans_removed(node: Node) -> None:
    a, b = await prepared(node, "a", "b")
    originals = {ref.uid: node.spec_path(ref.uid).read_bytes() for ref in (a, b)}
    node.spec_path(a.uid).unlink()  # tmpfs emptied
    node.spec_path(b.uid).write_text('{"kind": "tampered"}')
    orphan = node.spec_path("7d3c2b1a-0000-4000-8000-00000000abcd")
    orphan.write_text("{}")
    foreign = node.cdi_root / "vendor.example.com-claim_7d3c2b1a-0000-4000-8000-00000000abcd.json"
    foreign.write_text("{}")
    engine, report = await restart(node)
    try:
        assert report.load_status is LoadStatus.LOADED
        assert report.recreated_specs == tuple(sorted((a.uid, b.uid)))
        assert report.removed_orphan_specs == ("7d3c2b1a-0000-4000-8000-00000000abcd",)
        assert {uid: node.spec_path(uid).read_bytes() for uid in originals} == originals
        assert not orphan.exists()
        assert foreign.exists()  # another vendor's file is never touched
        node.assert_consistent()
    finally:
        await engine.close()


async def test_corrupt_checkpoint_warns_and_adopts_the_specs(node: Node) -> None:
    a, b = await prepared(node, "a", "b")
    stranger = node.spec_path("7d3c2b1a-0000-4000-8000-00000000abcd")
    stranger.write_text(
        json.dumps(
            cdi.claim_spec(
                DRIVER,
                "7d3c2b1a-0000-4000-8000-00000000abcd",
                [cdi.ClaimDevice("gpu-99", 99)],
            )
        )
    )
    node.checkpoint_path.write_text('{"schemaVersion": 1, "claims": {')
    engine, report = await restart(node)
    try:
        assert report.load_status is LoadStatus.CORRUPT
        assert report.adopted == tuple(sorted((a.uid, b.uid)))
        assert report.events == ("CheckpointCorrupted",)
        ((kind, reason, message),) = node.events.posted
        assert (kind, reason) == ("Warning", "CheckpointCorrupted")
        assert "not valid JSON" in message and "re-adopted 2" in message
        assert list(node.plugin_dir.glob("*.corrupt-*"))  # kept for a post-mortem
        assert not stranger.exists()  # names a device this node does not have
        node.assert_consistent()

        # An adopted device is still held: another claim cannot take it.
        intruder = await node.claim("intruder", ["gpu-0"])
        error = (await engine.prepare([intruder]))[intruder.uid].error or ""
        assert "gpu-0" in error and a.uid in error
        # The kubelet preparing an adopted claim again gets the full answer (request names).
        again = (await engine.prepare([a]))[a.uid]
        assert again.error is None
        assert again.devices[0].request_names == ("gpu",)
        assert node.checkpoint_claims()[a.uid]["namespace"] == "default"
        # Unprepare works from the checkpoint alone.
        assert await engine.unprepare([a, b]) == {a.uid: None, b.uid: None}
        assert node.spec_uids() == set()
    finally:
        await engine.close()


async def test_reboot_drops_previous_boot_claims(node: Node) -> None:
    (a,) = await prepared(node, "a")
    engine, report = await restart(node, boot_id=NEW_BOOT)
    try:
        assert report.load_status is LoadStatus.PREVIOUS_BOOT
        assert report.previous_boot_claims == (a.uid,)
        assert report.removed_orphan_specs == (a.uid,)
        assert [(k, r) for k, r, _ in node.events.posted] == [("Normal", "NodeRebooted")]
        assert node.checkpoint_claims() == {}
        assert json.loads(node.checkpoint_path.read_text())["nodeBootID"] == NEW_BOOT
        node.assert_consistent()
        result = (await engine.prepare([a]))[a.uid]  # the kubelet prepares again after a reboot
        assert result.error is None
        node.assert_consistent()
    finally:
        await engine.close()
