"""The checkpoint: records, update functions, strict parsing and the store's recovery paths."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from agent.dra.config import GpuConfig, MigDeviceConfig, Sharing, SharingStrategy
from agent.node import checkpoint as cp
from agent.node.checkpoint_store import FILE_NAME, CheckpointStore, LoadStatus
from agent.node.errors import CheckpointFormatError, NodeError

BOOT = "0b4d9a8e-1c2f-4e3a-9b7c-5d6e7f8a9b0c"
OTHER_BOOT = "aaaaaaaa-1111-2222-3333-444444444444"
UID = "3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8"
UID2 = "7e6d5c4b-3a29-4180-9f7e-6d5c4b3a2918"
NOW = datetime(2026, 3, 4, 5, 6, 7, tzinfo=UTC)

GPU = cp.PreparedDevice(
    requests=("gpu",),
    pool="node-a",
    device="gpu-0",
    cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={UID}-gpu-0",),
    kind="gpu",
    uuid="GPU-11111111-2222-3333-4444-555555555555",
    gpu_minor=0,
    config=GpuConfig(Sharing(SharingStrategy.TIME_SLICING)),
)
MIG = cp.PreparedDevice(
    requests=("mig", "other"),
    pool="node-a",
    device="gpu-1-mig-1g10gb-19-3",
    cdi_device_ids=(f"k8s.gpu.nvidia.com/claim={UID}-gpu-1-mig-1g10gb-19-3",),
    kind="mig",
    uuid="MIG-99999999-8888-7777-6666-555555555555",
    gpu_minor=1,
    config=MigDeviceConfig(),
    mig=cp.MigInstance("GPU-abcdabcd-2222-3333-4444-555555555555", 3, 0, 508, 39, 40),
)


def prepared() -> cp.Checkpoint:
    state = cp.mark_started(cp.Checkpoint(BOOT), UID, "team-a", "training")
    state = cp.mark_completed(state, UID, [GPU, MIG], f"k8s.gpu.nvidia.com-claim_{UID}.json")
    return cp.mark_started(state, UID2, "team-b", "inference")


def store(tmp_path: Path, boot: str = BOOT) -> CheckpointStore:
    return CheckpointStore(tmp_path, boot, clock=lambda: NOW)


def test_update_functions() -> None:
    state = prepared()
    assert state.claims[UID].state is cp.ClaimState.PREPARE_COMPLETED
    assert state.claims[UID].devices == (GPU, MIG)
    assert state.claims[UID2].state is cp.ClaimState.PREPARE_STARTED
    assert state.completed() == (state.claims[UID],)
    removed = cp.remove_claim(state, UID)
    assert set(removed.claims) == {UID2}
    assert set(state.claims) == {UID, UID2}  # the original is untouched
    assert cp.remove_claim(removed, UID) is removed
    with pytest.raises(TypeError):
        state.claims[UID] = state.claims[UID2]  # type: ignore[index]


def test_update_functions_refuse_out_of_order_steps() -> None:
    with pytest.raises(NodeError, match="never marked PrepareStarted"):
        cp.mark_completed(cp.Checkpoint(BOOT), UID, [GPU], "f.json")
    with pytest.raises(NodeError, match="already prepared"):
        cp.mark_started(prepared(), UID, "team-a", "training")
    with pytest.raises(Exception, match="not a canonical lowercase UUID"):
        cp.mark_started(cp.Checkpoint(BOOT), "../../etc", "ns", "n")


def test_round_trip_and_checksum() -> None:
    document = cp.to_dict(prepared())
    assert document["schemaVersion"] == 1
    assert document["nodeBootID"] == BOOT
    assert document["checksum"].startswith("sha256:")
    device = document["claims"][UID]["devices"][1]
    assert device["mig"] == {
        "parentUUID": "GPU-abcdabcd-2222-3333-4444-555555555555",
        "giID": 3,
        "ciID": 0,
        "capsMajor": 508,
        "giCapMinor": 39,
        "ciCapMinor": 40,
    }
    assert json.loads(json.dumps(document)) == document
    assert cp.from_dict(json.loads(json.dumps(document))) == prepared()


def test_device_rebuilds_its_cdi_entry() -> None:
    entry = MIG.cdi_device()
    assert (entry.device_name, entry.gpu_minor) == ("gpu-1-mig-1g10gb-19-3", 1)
    assert entry.mig is not None and (entry.mig.gi_minor, entry.mig.ci_minor) == (39, 40)
    assert GPU.cdi_device().mig is None


def _resigned(document: dict[str, Any]) -> dict[str, Any]:
    document = {key: value for key, value in document.items() if key != "checksum"}
    document["checksum"] = cp.checksum(document)
    return document


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["claims"][UID].update(state="Prepared"), "state"),
        (lambda d: d["claims"][UID].update(extra=1), "unknown field"),
        (lambda d: d["claims"][UID]["devices"][0].update(kind="vfio"), "kind"),
        (lambda d: d["claims"][UID]["devices"][0].update(uuid="MIG-x"), "uuid"),
        (lambda d: d["claims"][UID]["devices"][0].update(gpuMinor=-1), "gpuMinor"),
        (lambda d: d["claims"][UID]["devices"][0].update(requests=["a/b"]), "base request"),
        (lambda d: d["claims"][UID]["devices"][1].update(mig=None), "mig"),
        (lambda d: d["claims"][UID]["devices"][1]["mig"].update(giID="3"), "giID"),
        (
            lambda d: d["claims"][UID]["devices"][0]["config"].update(kind="MigDeviceConfig"),
            "config",
        ),
        (
            lambda d: d["claims"][UID]["devices"][0]["config"].update(bogus=1),
            "bogus: unknown field",
        ),
        (lambda d: d["claims"][UID].update(cdiSpecFile="../../etc/passwd"), "cdiSpecFile"),
        (lambda d: d["claims"].update({"../../etc": d["claims"][UID]}), "canonical lowercase UUID"),
        (lambda d: d.update(nodeBootID="../x"), "nodeBootID"),
        (lambda d: d.update(claims=[]), "claims"),
    ],
)
def test_invalid_content_is_rejected_with_its_path(mutate: Any, message: str) -> None:
    document = cp.to_dict(prepared())
    mutate(document)
    with pytest.raises(CheckpointFormatError, match=message):
        cp.from_dict(_resigned(document))


def test_missing_file_gives_empty_checkpoint(tmp_path: Path) -> None:
    result = store(tmp_path).load()
    assert result.status is LoadStatus.MISSING
    assert result.checkpoint == cp.Checkpoint(BOOT)


def test_save_then_load(tmp_path: Path) -> None:
    store(tmp_path / "gpu.nvidia.com").save(prepared())
    path = tmp_path / "gpu.nvidia.com" / FILE_NAME
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    result = store(tmp_path / "gpu.nvidia.com").load()
    assert result.status is LoadStatus.LOADED
    assert result.checkpoint == prepared()
    assert os.listdir(path.parent) == [FILE_NAME]


def test_save_refuses_a_checkpoint_of_another_boot(tmp_path: Path) -> None:
    with pytest.raises(NodeError, match="boot"):
        store(tmp_path).save(cp.Checkpoint(OTHER_BOOT))


def _future_schema(data: bytes) -> bytes:
    document = json.loads(data)
    document["schemaVersion"] = 2
    return json.dumps(_resigned(document)).encode()


def _tampered(data: bytes) -> bytes:
    return data.replace(b'"team-a"', b'"team-x"')


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda data: b"\x00\xff garbage", "not valid JSON"),
        (lambda data: data[: len(data) // 2], "not valid JSON"),
        (lambda data: b"", "not valid JSON"),
        (lambda data: b"[1, 2]", "not a JSON object"),
        (_tampered, "checksum mismatch"),
        (lambda data: data.replace(b'"team-a"', b'"\\ud800"'), "checksum mismatch"),
        (lambda data: b"[" * 100_000 + b"]" * 100_000, "not valid JSON"),
        (_future_schema, "schemaVersion 2 is not supported"),
    ],
)
def test_corrupt_file_is_quarantined(tmp_path: Path, damage: Any, reason: str) -> None:
    store(tmp_path).save(prepared())
    path = tmp_path / FILE_NAME
    damaged = damage(path.read_bytes())
    path.write_bytes(damaged)
    result = store(tmp_path).load()
    assert result.status is LoadStatus.CORRUPT
    assert reason in result.reason
    assert result.checkpoint == cp.Checkpoint(BOOT)
    quarantined = tmp_path / f"{FILE_NAME}.corrupt-20260304T050607Z"
    assert result.moved_to == quarantined
    assert quarantined.read_bytes() == damaged
    assert not path.exists()
    # a second corruption in the same second gets its own name
    path.write_bytes(b"{")
    again = store(tmp_path).load()
    assert again.moved_to == tmp_path / f"{FILE_NAME}.corrupt-20260304T050607Z-1"


def test_unreadable_file_is_quarantined(tmp_path: Path) -> None:
    (tmp_path / FILE_NAME).mkdir()  # reading a directory fails with an OSError
    result = store(tmp_path).load()
    assert result.status is LoadStatus.CORRUPT
    assert "unreadable" in result.reason
    assert result.moved_to is not None and result.moved_to.is_dir()


def test_previous_boot_is_archived_and_its_claims_reported(tmp_path: Path) -> None:
    old = prepared()
    CheckpointStore(tmp_path, BOOT).save(old)
    result = store(tmp_path, OTHER_BOOT).load()
    assert result.status is LoadStatus.PREVIOUS_BOOT
    assert result.checkpoint == cp.Checkpoint(OTHER_BOOT)
    assert dict(result.untrusted_claims) == dict(old.claims)
    assert result.moved_to == tmp_path / f"{FILE_NAME}.boot-{BOOT}"
    assert result.moved_to.exists() and not (tmp_path / FILE_NAME).exists()
    assert "rebooted" in result.reason and "2 claim(s)" in result.reason
    assert store(tmp_path, OTHER_BOOT).load().status is LoadStatus.MISSING


def test_load_cleans_leftover_temporaries(tmp_path: Path) -> None:
    store(tmp_path).save(prepared())
    leftover = tmp_path / f".{FILE_NAME}.tmp-0123456789abcdef"
    leftover.write_bytes(b"{half")
    assert store(tmp_path).load().status is LoadStatus.LOADED
    assert not leftover.exists()


def test_admin_access_is_recorded_only_when_true() -> None:
    admin = dataclasses.replace(GPU, admin_access=True)
    state = cp.mark_started(cp.Checkpoint(BOOT), UID, "ns", "monitor")
    state = cp.mark_completed(state, UID, [admin, MIG], "f.json")
    document = cp.to_dict(state)
    devices = document["claims"][UID]["devices"]
    assert devices[0]["adminAccess"] is True
    assert "adminAccess" not in devices[1]  # a file an agent without the field still reads
    assert cp.from_dict(json.loads(json.dumps(document))) == state
    old = cp.from_dict(cp.to_dict(prepared()))  # written before the field existed
    assert [d.admin_access for d in old.claims[UID].devices] == [False, False]
    devices[0]["adminAccess"] = "yes"
    with pytest.raises(CheckpointFormatError, match=r"devices\[0\].adminAccess"):
        cp.from_dict(_resigned(document))


def test_store_notices_every_write_by_another_store(tmp_path: Path) -> None:
    ours, theirs = store(tmp_path), store(tmp_path)
    assert ours.changed()  # nothing read yet
    assert ours.load().status is LoadStatus.MISSING
    assert not ours.changed()
    theirs.save(prepared())
    assert ours.changed()
    assert ours.load().checkpoint == prepared()
    assert not ours.changed()
    ours.save(cp.remove_claim(prepared(), UID2))
    assert not ours.changed()  # our own write
    for _ in range(50):  # same size, within one mtime tick: the pinned inode still differs
        theirs.save(prepared())
        theirs.save(prepared())
        assert ours.changed()
        ours.load()
        assert not ours.changed()
    (tmp_path / FILE_NAME).unlink()
    assert ours.changed()
    ours.close()
    theirs.close()
