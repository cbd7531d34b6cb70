"""Device metadata (KEP-5304) below the engine: names and paths, the stream's format, the
noting reader, and the effector's apply, undo and startup recovery on real files, with the
checkpoint's own serialization in the loop (its intents must load again)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from agent.dra.config import GpuConfig
from agent.dra.model import DeviceAttribute, DraDevice
from agent.metadata import build_metadata
from agent.metadata import document as doc
from agent.metadata.document import MetadataDevice, MetadataError, RequestMetadata
from agent.metadata.effector import MetadataEffector
from agent.metadata.notes import NotingClaimReader
from agent.node import checkpoint as cp
from agent.node.effectors import EffectFailed

pytestmark = pytest.mark.anyio
DRIVER = "gpu.nvidia.com"
NODE = "node-a"
UID = "3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8"
STRANGER = "7e6d5c4b-3a29-4180-9f7e-6d5c4b3a2918"
BOOT = "0b4d9a8e-1c2f-4e3a-9b7c-5d6e7f8a9b0c"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def prepared(name: str, *requests: str) -> cp.PreparedDevice:
    return cp.PreparedDevice(
        requests=requests,
        pool=NODE,
        device=name,
        cdi_device_ids=(f"k8s.{DRIVER}/claim={UID}-{name}",),
        kind="gpu",
        uuid=f"GPU-{name}",
        gpu_minor=int(name.rsplit("-", 1)[1]),
        config=GpuConfig(),
    )


def claim(annotations: dict[str, str] | None = None) -> dict[str, Any]:
    results = [
        {"request": "train", "driver": DRIVER, "pool": NODE, "device": "gpu-0"},
        {"request": "infer/small", "driver": DRIVER, "pool": NODE, "device": "gpu-1"},
        {"request": "other", "driver": "nic.example.com", "pool": NODE, "device": "nic-0"},
    ]
    meta: dict[str, Any] = {"name": "job", "namespace": "ml", "uid": UID}
    if annotations:
        meta["annotations"] = annotations
    return {"metadata": meta, "status": {"allocation": {"devices": {"results": results}}}}


class Reader:
    def __init__(self, value: dict[str, Any]) -> None:
        self.value = value

    async def read(self, namespace: str, name: str) -> dict[str, Any]:
        return self.value


class Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[cp.Intent, ...]] = []

    async def __call__(self, intents: tuple[cp.Intent, ...]) -> None:
        self.calls.append(intents)


def published() -> list[DraDevice]:
    return [
        DraDevice(
            f"gpu-{i}",
            attributes={
                "uuid": DeviceAttribute.of_string(f"GPU-{i}"),
                "index": DeviceAttribute.of_int(i),
            },
        )
        for i in range(2)
    ]


def effector(tmp_path: Path, value: dict[str, Any]) -> tuple[NotingClaimReader, MetadataEffector]:
    notes, metadata = build_metadata(
        Reader(value),
        enabled=True,
        driver=DRIVER,
        pool=NODE,
        plugin_dir=tmp_path / "plugin",
        cdi_root=tmp_path / "cdi",
        devices=published(),
    )
    assert isinstance(notes, NotingClaimReader)
    return notes, metadata


def request_file(tmp_path: Path, request: str, claim_dir: str = "ml_job") -> Path:
    return tmp_path / "plugin" / "dra-device-metadata" / claim_dir / request / "metadata.json"


def spec_file(tmp_path: Path, request: str, uid: str = UID) -> Path:
    return tmp_path / "cdi" / f"{DRIVER}_metadata_{uid}_{request}.json"


def roundtrip(checkpoint: cp.Checkpoint) -> cp.Checkpoint:
    """Through the checkpoint's JSON and strict parser, as a restart would read it."""
    return cp.from_dict(json.loads(json.dumps(cp.to_dict(checkpoint))))


# -- document -------------------------------------------------------------------------------


def test_names_and_paths() -> None:
    assert doc.cdi_id(DRIVER, UID, "gpu/big") == f"{DRIVER}/metadata={UID}_gpu"
    assert doc.spec_file_name(DRIVER, UID, "gpu") == f"{DRIVER}_metadata_{UID}_gpu.json"
    assert doc.spec_file_uid(DRIVER, f"{DRIVER}_metadata_{UID}_gpu.json") == UID
    for other in (f"{DRIVER}_metadata_{UID}.json", f"x_metadata_{UID}_gpu.json", "a.json"):
        assert doc.spec_file_uid(DRIVER, other) is None
    assert doc.container_file(DRIVER, "job", "gpu/big", None) == (
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/job/gpu/{DRIVER}-metadata.json"
    )
    assert doc.container_file(DRIVER, "job-x1", "gpu", "accel").startswith(
        "/var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/accel/gpu/"
    )
    for bad in ("../etc", "GPU", "a_b", ""):
        with pytest.raises(MetadataError):
            doc.host_file(Path("/p"), "ml", "job", bad)
    with pytest.raises(MetadataError, match="namespace"):
        doc.claim_dir(Path("/p"), "../..", "job")


def test_the_stream_holds_each_version_newest_first() -> None:
    metadata = RequestMetadata(
        DRIVER,
        "ml",
        "job",
        UID,
        "gpu",
        "accel",
        (MetadataDevice(NODE, "gpu-0", {"index": {"int": 0}}),),
    )
    data = doc.encode_stream(metadata)
    objects = doc.decode_stream(data)
    assert [o["apiVersion"] for o in objects] == list(doc.API_VERSIONS)
    assert objects[1] == {
        "kind": "DeviceMetadata",
        "apiVersion": "metadata.resource.k8s.io/v1alpha1",
        "metadata": {"name": "job", "namespace": "ml", "uid": UID, "generation": 1},
        "podClaimName": "accel",
        "requests": [
            {
                "name": "gpu",
                "devices": [
                    {
                        "driver": DRIVER,
                        "pool": NODE,
                        "name": "gpu-0",
                        "attributes": {"index": {"int": 0}},
                    }
                ],
            }
        ],
    }
    with pytest.raises(ValueError, match="empty"):
        doc.decode_stream(b"\n")
    with pytest.raises(ValueError):
        doc.decode_stream(b'{"a": 1}\n[1]')


async def test_the_reader_notes_what_the_effector_needs() -> None:
    notes = NotingClaimReader(
        Reader(claim({doc.POD_CLAIM_NAME_ANNOTATION: "accel"})), driver=DRIVER, pool=NODE, limit=1
    )
    await notes.read("ml", "job")
    note = notes.take(UID)
    assert note is not None and (note.namespace, note.name, note.pod_claim_name) == (
        "ml",
        "job",
        "accel",
    )
    assert dict(note.requests) == {"gpu-0": ("train",), "gpu-1": ("infer/small",)}
    assert notes.take(UID) is None  # taken once
    other = claim()
    other["metadata"]["uid"] = STRANGER
    await notes.read("ml", "job")
    notes._inner = Reader(other)  # type: ignore[assignment]
    await notes.read("ml", "job")
    assert len(notes) == 1 and notes.take(UID) is None  # the oldest note went


# -- the effector on real files ---------------------------------------------------------------


async def test_apply_writes_each_request_and_undo_removes_it(tmp_path: Path) -> None:
    notes, metadata = effector(tmp_path, claim({doc.POD_CLAIM_NAME_ANNOTATION: "accel"}))
    await notes.read("ml", "job")
    record = Recorder()
    devices = (prepared("gpu-0", "train"), prepared("gpu-1", "infer"))
    made = await metadata.apply(UID, devices, record)
    [intents] = record.calls
    assert [i.get("request") for i in intents] == ["train", "infer/small"]
    assert made[0].cdi_device_ids[-1] == f"{DRIVER}/metadata={UID}_train"
    assert made[1].cdi_device_ids[-1] == f"{DRIVER}/metadata={UID}_infer"
    infer = doc.decode_stream(request_file(tmp_path, "infer").read_bytes())[0]
    assert infer["requests"][0]["name"] == "infer/small"
    assert infer["requests"][0]["devices"][0]["attributes"] == {
        "index": {"int": 1},
        "uuid": {"string": "GPU-1"},
    }
    spec = json.loads(spec_file(tmp_path, "train").read_text())
    [mount] = spec["devices"][0]["containerEdits"]["mounts"]
    assert mount["hostPath"] == str(request_file(tmp_path, "train"))
    assert "/resourceclaimtemplates/accel/train/" in mount["containerPath"]

    await metadata.undo(UID, intents, made)
    assert not (tmp_path / "plugin" / "dra-device-metadata" / "ml_job").exists()
    assert not list((tmp_path / "cdi").iterdir())
    await metadata.undo(UID, intents, made)  # idempotent


async def test_apply_without_the_claims_read_fails_before_any_write(tmp_path: Path) -> None:
    _, metadata = effector(tmp_path, claim())
    record = Recorder()
    with pytest.raises(EffectFailed, match="did not read"):
        await metadata.apply(UID, (prepared("gpu-0", "train"),), record)
    assert record.calls == [] and not (tmp_path / "cdi").exists()


async def test_recover_rebuilds_completed_claims_and_removes_the_rest(tmp_path: Path) -> None:
    notes, metadata = effector(tmp_path, claim())
    await notes.read("ml", "job")
    record = Recorder()
    devices = await metadata.apply(
        UID, (prepared("gpu-0", "train"), prepared("gpu-1", "infer")), record
    )
    checkpoint = cp.mark_started(cp.Checkpoint(boot_id=BOOT), UID, "ml", "job")
    checkpoint = cp.record_intents(checkpoint, UID, record.calls[-1])
    completed = roundtrip(cp.mark_completed(checkpoint, UID, devices, "spec.json"))

    before = spec_file(tmp_path, "train").read_bytes()
    spec_file(tmp_path, "train").unlink()  # the tmpfs was emptied
    request_file(tmp_path, "infer").unlink()  # and someone removed a file
    orphan = spec_file(tmp_path, "gpu", uid=STRANGER)
    orphan.write_text("{}")
    report = await metadata.recover(completed)
    assert report.problems == () and report.rolled_back == ()
    assert spec_file(tmp_path, "train").read_bytes() == before
    rebuilt = doc.decode_stream(request_file(tmp_path, "infer").read_bytes())[1]
    assert rebuilt["requests"][0]["name"] == "infer/small"
    assert [d["name"] for d in rebuilt["requests"][0]["devices"]] == ["gpu-1"]
    assert not orphan.exists()

    started = roundtrip(checkpoint)  # the same claim, never completed: rolled back
    report = await metadata.recover(started)
    assert report.rolled_back == (UID,)
    assert not (tmp_path / "plugin" / "dra-device-metadata" / "ml_job").exists()
    assert not list((tmp_path / "cdi").iterdir())


async def test_recover_keeps_files_of_a_claim_with_a_cdi_spec_and_no_entry(tmp_path: Path) -> None:
    """After a corrupt checkpoint the engine adopts claims from their own CDI specs: their
    metadata stays (the kubelet holds its CDI id), though no intent names it."""
    notes, metadata = effector(tmp_path, claim())
    await notes.read("ml", "job")
    await metadata.apply(UID, (prepared("gpu-0", "train"),), Recorder())
    (tmp_path / "cdi" / f"k8s.{DRIVER}-claim_{UID}.json").write_text("{}")
    await metadata.recover(cp.Checkpoint(boot_id=BOOT))
    assert spec_file(tmp_path, "train").exists() and request_file(tmp_path, "train").exists()
