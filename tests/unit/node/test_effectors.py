"""The engine's device-effector hook, with an effector written for the test: intents are
durable before the hardware changes, live ids reach the completion record and the CDI spec,
failures keep what could not be undone, unprepare and startup undo, the static path pays
nothing."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace

import pytest

from agent.node import checkpoint as cp
from agent.node.cdi import CdiFileError, CdiSpecDirectory
from agent.node.checkpoint import Checkpoint
from agent.node.checkpoint_store import CheckpointStore
from agent.node.effectors import (
    Describe,
    EffectFailed,
    Prepared,
    RecordIntents,
    StartupRecovery,
)
from agent.node.engine import PrepareEngine
from agent.node.errors import CheckpointFormatError
from tests.unit.node.engine_support import Node

pytestmark = pytest.mark.anyio
SLOT = "gpu-2-mig-3g40gb-9-4"
OTHER_SLOT = "gpu-2-mig-3g40gb-9-0"


class FakeEffector:
    """Makes MIG slots of GPU 2 out of thin air; records what it saw."""

    name = "fake"

    def __init__(self, node: Node) -> None:
        self.node = node
        self.made: dict[str, str] = {}  # device -> claim
        self.on_disk_at_apply: list[dict[str, object]] = []
        self.fail_apply: str | None = None
        self.fail_undo = False
        self.undone: list[tuple[str, tuple[str, ...]]] = []

    def handles(self, device: str) -> bool:
        return device.startswith("gpu-2-mig-")

    def conflict(
        self, uid: str, devices: Prepared, held: Mapping[str, Prepared], describe: Describe
    ) -> str | None:
        for other, theirs in held.items():
            if other != uid and any(d.device.startswith("gpu-2") for d in theirs):
                return f"claim {uid}: GPU 2 is used by claim {describe(other)}"
        return None

    async def apply(self, uid: str, devices: Prepared, record: RecordIntents) -> Prepared:
        mine = [d for d in devices if self.handles(d.device)]
        await record(tuple(cp.Intent(self.name, d.device, (("slot", d.device),)) for d in mine))
        self.on_disk_at_apply.append(self.node.checkpoint_claims()[uid])
        for device in mine:
            self.made[device.device] = uid
        if self.fail_apply is not None:
            if not self.fail_undo:
                for device in mine:
                    del self.made[device.device]
            left = (
                ()
                if not self.fail_undo
                else tuple(cp.Intent(self.name, d.device, (("slot", d.device),)) for d in mine)
            )
            raise EffectFailed(self.fail_apply, left)
        live = cp.MigInstance("GPU-parent", 1, 0, 510, 12, 13)
        return tuple(
            replace(d, uuid="MIG-made", mig=live) if self.handles(d.device) else d for d in devices
        )

    async def undo(self, uid: str, intents: tuple[cp.Intent, ...], devices: Prepared) -> None:
        if self.fail_undo:
            raise EffectFailed(f"claim {uid}: still busy", intents)
        self.undone.append((uid, tuple(i.device for i in intents)))
        for intent in intents:
            self.made.pop(intent.device, None)

    async def recover(self, checkpoint: Checkpoint) -> StartupRecovery:
        started = [
            c for c in checkpoint.claims.values() if c.intents and c.state.value == "PrepareStarted"
        ]
        for claim in started:
            await self.undo(claim.uid, claim.intents, claim.devices)
        return StartupRecovery(rolled_back=tuple(c.uid for c in started))


async def _engine(node: Node, effector: FakeEffector) -> PrepareEngine:
    engine = node.engine(dynamic_mig=True, effectors=[effector])
    await engine.start()
    return engine


async def test_intent_is_durable_before_apply_and_live_ids_are_recorded(node: Node) -> None:
    effector = FakeEffector(node)
    engine = await _engine(node, effector)
    try:
        ref = await node.claim("mig", [SLOT])
        result = (await engine.prepare([ref]))[ref.uid]
        assert result.error is None, result.error
        (seen,) = effector.on_disk_at_apply
        assert seen["state"] == "PrepareStarted"
        assert seen["intents"] == [
            {"effector": "fake", "device": SLOT, "parameters": {"slot": SLOT}}
        ]
        on_disk = node.checkpoint_claims()[ref.uid]
        assert on_disk["state"] == "PrepareCompleted"
        assert on_disk["intents"] == seen["intents"]  # kept: unprepare undoes by them
        assert on_disk["devices"][0]["uuid"] == "MIG-made"
        nodes = node.spec(ref.uid)["devices"][0]["containerEdits"]["deviceNodes"]
        assert [n["path"] for n in nodes] == [
            "/dev/nvidia2",
            "/dev/nvidia-caps/nvidia-cap12",
            "/dev/nvidia-caps/nvidia-cap13",
        ]
        # another claim on the same GPU: refused by the effector's rule, naming the holder
        other = await node.claim("other", [OTHER_SLOT])
        refused = (await engine.prepare([other]))[other.uid]
        assert refused.error is not None and f"default/mig ({ref.uid})" in refused.error
        assert (await engine.unprepare([ref]))[ref.uid] is None
        assert effector.undone == [(ref.uid, (SLOT,))]
        assert effector.made == {} and node.checkpoint_claims() == {}
        node.assert_consistent()
    finally:
        await engine.close()


async def test_failure_keeps_what_could_not_be_undone_until_the_retry(node: Node) -> None:
    effector = FakeEffector(node)
    engine = await _engine(node, effector)
    try:
        ref = await node.claim("mig", [SLOT])
        effector.fail_apply, effector.fail_undo = "no room at placement 4", True
        result = (await engine.prepare([ref]))[ref.uid]
        assert result.error == "no room at placement 4"
        entry = node.checkpoint_claims()[ref.uid]
        assert entry["state"] == "PrepareStarted" and entry["intents"][0]["device"] == SLOT
        assert not node.spec_path(ref.uid).exists()
        # the kubelet's retry: the leftover is undone first, then made again
        effector.fail_apply, effector.fail_undo = None, False
        result = (await engine.prepare([ref]))[ref.uid]
        assert result.error is None
        assert effector.undone == [(ref.uid, (SLOT,))]
        assert effector.made == {SLOT: ref.uid}
        assert (await engine.unprepare([ref]))[ref.uid] is None
        node.assert_consistent()
    finally:
        await engine.close()


@pytest.mark.parametrize("undo_fails", [False, True], ids=["undone", "undo-fails"])
async def test_a_failed_cdi_write_undoes_what_the_effectors_made(
    node: Node, monkeypatch: pytest.MonkeyPatch, undo_fails: bool
) -> None:
    """The device was made, then its CDI spec could not be written (disk full): the claim
    fails and the device is undone at once, or kept recorded (started) until it can be."""
    effector = FakeEffector(node)
    engine = await _engine(node, effector)
    try:
        ref = await node.claim("mig", [SLOT])

        def disk_full(self: CdiSpecDirectory, claim_uid: str, spec: object) -> None:
            raise CdiFileError(f"cannot write the CDI spec of claim {claim_uid}: disk full")

        with monkeypatch.context() as patch:
            patch.setattr(CdiSpecDirectory, "write_claim", disk_full)
            effector.fail_undo = undo_fails
            result = (await engine.prepare([ref]))[ref.uid]
        assert result.error is not None and "disk full" in result.error
        assert not node.spec_path(ref.uid).exists()
        if not undo_fails:
            assert effector.undone == [(ref.uid, (SLOT,))] and effector.made == {}
            assert ref.uid not in node.checkpoint_claims()
        else:
            assert effector.made == {SLOT: ref.uid}
            entry = node.checkpoint_claims()[ref.uid]
            assert entry["state"] == "PrepareStarted" and entry["intents"][0]["device"] == SLOT
        # the kubelet's retry succeeds and leaves exactly one device made
        effector.fail_undo = False
        assert (await engine.prepare([ref]))[ref.uid].error is None
        assert effector.made == {SLOT: ref.uid}
        assert (await engine.unprepare([ref]))[ref.uid] is None
        assert effector.made == {}
        node.assert_consistent()
    finally:
        await engine.close()


async def test_failed_undo_on_unprepare_keeps_the_claim_and_its_spec(node: Node) -> None:
    effector = FakeEffector(node)
    engine = await _engine(node, effector)
    try:
        ref = await node.claim("mig", [SLOT])
        assert (await engine.prepare([ref]))[ref.uid].error is None
        effector.fail_undo = True
        assert (await engine.unprepare([ref]))[ref.uid] == f"claim {ref.uid}: still busy"
        assert node.checkpoint_claims()[ref.uid]["state"] == "PrepareCompleted"
        assert node.spec_path(ref.uid).exists()
        effector.fail_undo = False
        assert (await engine.unprepare([ref]))[ref.uid] is None
        node.assert_consistent()
    finally:
        await engine.close()


async def test_startup_rolls_back_started_intents(node: Node) -> None:
    effector = FakeEffector(node)
    engine = await _engine(node, effector)
    ref = await node.claim("mig", [SLOT])
    effector.fail_apply, effector.fail_undo = "crashed", True  # leaves the intent on disk
    await engine.prepare([ref])
    await engine.close()
    effector.fail_apply, effector.fail_undo = None, False
    engine = await _engine(node, effector)
    try:
        assert effector.undone == [(ref.uid, (SLOT,))]
        assert engine.checkpoint.claims == {}
        node.assert_consistent()
    finally:
        await engine.close()


async def test_static_claims_cost_two_writes_with_an_effector_configured(
    node: Node, monkeypatch: pytest.MonkeyPatch
) -> None:
    effector = FakeEffector(node)
    engine = await _engine(node, effector)
    saves: list[int] = []
    original = CheckpointStore.save

    def counting_save(self: CheckpointStore, checkpoint: Checkpoint) -> None:
        saves.append(len(checkpoint.claims))
        original(self, checkpoint)

    monkeypatch.setattr(CheckpointStore, "save", counting_save)
    try:
        ref = await node.claim("whole", ["gpu-5"])
        assert (await engine.prepare([ref]))[ref.uid].error is None
        assert saves == [1, 1] and effector.on_disk_at_apply == []
        assert "intents" not in json.loads(node.checkpoint_path.read_text())["claims"][ref.uid]
        mig = await node.claim("mig", [SLOT])
        saves.clear()
        assert (await engine.prepare([mig]))[mig.uid].error is None
        assert len(saves) == 3  # started, intent, completed
    finally:
        await engine.close()


def test_intents_round_trip_and_are_checked() -> None:
    uid = "0b0d6a4e-93c1-4c8d-9c53-0d4b7f3a1e11"
    checkpoint = cp.mark_started(Checkpoint("boot-1"), uid, "ns", "c")
    intent = cp.Intent("mig", SLOT, (("start", 4), ("parentUUID", "GPU-1")))
    checkpoint = cp.record_intents(checkpoint, uid, [intent])
    again = cp.from_dict(json.loads(cp.encode(checkpoint)))
    assert again.claims[uid].intents == (intent,)
    assert intent.integer("start") == 4 and intent.string("parentUUID") == "GPU-1"
    document = cp.to_dict(checkpoint)
    document["claims"][uid]["intents"][0]["parameters"]["start"] = -1
    document["checksum"] = cp.checksum(document)
    with pytest.raises(CheckpointFormatError, match="non-negative"):
        cp.from_dict(document)
