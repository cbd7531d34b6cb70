"""The agent's files on disk, damaged or replaced: the checkpoint, the node lock (CDI specs:
``test_spec_files.py``).

What can be found in place of a file the agent wrote: the file truncated at any offset
(power cut on a file system without data journaling), bits flipped (bad disk), values of the
wrong JSON type with a valid checksum (a hand edit or another program), another owner, and
things planted by whoever else can write the directories: a symlink to a file outside, a
dangling symlink, a FIFO, a device, a directory, symlinks named like our temporaries. The
rules: reading never raises over content (the checkpoint is moved aside and the engine
rebuilds, a spec is rewritten), a FIFO or ``/dev/zero`` never hangs or exhausts the reader,
and the agent never writes through a symlink: every target outside stays byte-identical.
The last test does it to the real agent process between restarts: it starts, reports what
it found, and keeps serving.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given
from hypothesis import strategies as st

from agent.dra.config import GpuConfig, MigDeviceConfig, Sharing, SharingStrategy
from agent.node import durable
from agent.node.cdi import CdiSpecDirectory
from agent.node.checkpoint import (
    Checkpoint,
    ClaimState,
    MigInstance,
    PreparedClaim,
    PreparedDevice,
    checksum,
    encode,
    from_dict,
)
from agent.node.checkpoint_store import FILE_NAME, CheckpointStore, LoadStatus
from agent.node.durable import NodeLock
from agent.node.errors import CheckpointFormatError, NodeError
from tests.fuzz import fuzz_settings
from tests.fuzz.planted import PLANTED, UIDS, in_thread, outside, plant
from tests.fuzz.test_configs import json_values
from tests.integration.conftest import (
    DRIVER,
    AgentHarness,
    _claims_deleted_after_each_test,
    allocated_devices,
    anyio_backend,
    fresh_harness,
    gpu_request,
    workdir,
)

BOOT = "8c2f3a94-1b7e-4c55-9d0a-3e6f1a2b4c5d"


def sample_checkpoint() -> Checkpoint:
    gpu = PreparedDevice(
        requests=("gpu",),
        pool="node-a",
        device="gpu-0",
        cdi_device_ids=(f"k8s.{DRIVER}/claim={UIDS[0]}-gpu-0",),
        kind="gpu",
        uuid="GPU-0f1e2d3c",
        gpu_minor=0,
        config=GpuConfig(Sharing(SharingStrategy.TIME_SLICING)),
    )
    mig = PreparedDevice(
        requests=("mig",),
        pool="node-a",
        device="gpu-1-mig-1g10gb-0",
        cdi_device_ids=(f"k8s.{DRIVER}/claim={UIDS[1]}-mig",),
        kind="mig",
        uuid="MIG-4a5b6c7d",
        gpu_minor=1,
        config=MigDeviceConfig(),
        mig=MigInstance("GPU-1a2b", 7, 0, 510, 66, 67),
    )
    claims = [
        PreparedClaim(UIDS[0], "default", "a", ClaimState.PREPARE_COMPLETED, (gpu,)),
        PreparedClaim(UIDS[1], "team-b", "b", ClaimState.PREPARE_STARTED, (mig,)),
    ]
    return Checkpoint(BOOT, {c.uid: c for c in claims})


# -- the checkpoint ---------------------------------------------------------------------------


def _load_fresh(directory: Path, data: bytes | None = None) -> tuple[Any, CheckpointStore]:
    store = CheckpointStore(directory, BOOT)
    if data is not None:
        (directory / FILE_NAME).write_bytes(data)
    return store.load(), store


def _check_quarantined(directory: Path, data: bytes, loaded: Any) -> None:
    """A CORRUPT load moved the file aside whole and left the path free."""
    assert loaded.status is LoadStatus.CORRUPT, loaded
    assert loaded.checkpoint.claims == {}
    assert loaded.reason and str(directory / FILE_NAME) in loaded.reason
    assert loaded.moved_to is not None and loaded.moved_to.read_bytes() == data
    assert not (directory / FILE_NAME).exists()
    loaded.moved_to.unlink()


def test_truncated_at_every_offset(tmp_path: Path) -> None:
    """Every prefix of a valid file: CORRUPT (moved aside whole), except the whole document
    without its final newline, which is the same checkpoint."""
    original = sample_checkpoint()
    data = encode(original)
    for offset in range(len(data)):
        loaded, store = _load_fresh(tmp_path, data[:offset])
        store.close()
        if data[:offset].strip() == data.strip():
            assert loaded.status is LoadStatus.LOADED and loaded.checkpoint == original
            (tmp_path / FILE_NAME).unlink()
        else:
            _check_quarantined(tmp_path, data[:offset], loaded)


@fuzz_settings(ci_examples=200)
@given(st.data())
def test_bit_flips(tmp_path: Path, data: st.DataObject) -> None:
    """One to three flipped bits: CORRUPT, or (a flip the checksum cannot see, e.g. in
    insignificant whitespace) exactly the original checkpoint."""
    original = sample_checkpoint()
    content = bytearray(encode(original))
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        at = data.draw(st.integers(min_value=0, max_value=len(content) - 1))
        content[at] ^= 1 << data.draw(st.integers(min_value=0, max_value=7))
    directory = tmp_path / hashlib.sha256(content).hexdigest()[:12]
    directory.mkdir(exist_ok=True)
    loaded, store = _load_fresh(directory, bytes(content))
    store.close()
    if loaded.status is LoadStatus.LOADED:
        assert loaded.checkpoint == original
    else:
        _check_quarantined(directory, bytes(content), loaded)


def _mutate(document: Any, data: st.DataObject) -> Any:
    """Replace, drop or retype values at random places of a JSON document."""
    for _ in range(data.draw(st.integers(min_value=1, max_value=3))):
        parent, key = None, None
        node = document
        while isinstance(node, dict | list) and node and data.draw(st.booleans()):
            keys = list(node) if isinstance(node, dict) else list(range(len(node)))
            parent, key = node, data.draw(st.sampled_from(keys))
            node = node[key]
        if parent is None:
            return data.draw(json_values)
        action = data.draw(st.sampled_from(["replace", "drop", "wrap"]))
        if action == "drop" and isinstance(parent, dict):
            del parent[key]
        elif action == "wrap":
            parent[key] = [parent[key]]  # type: ignore[index]
        else:
            parent[key] = data.draw(json_values)  # type: ignore[index]
    return document


@fuzz_settings(ci_examples=300)
@given(st.data())
def test_wrong_types_with_a_valid_checksum(tmp_path: Path, data: st.DataObject) -> None:
    """Values of any JSON type anywhere, checksum recomputed so that the field checks are
    what decides: a checkpoint or CheckpointFormatError, never another exception; the
    store then loads it, moves it aside or archives it, never raising."""
    document = json.loads(encode(sample_checkpoint()))
    body = _mutate({k: v for k, v in document.items() if k != "checksum"}, data)
    if isinstance(body, dict):
        body["checksum"] = checksum(body)
    try:
        parsed = from_dict(body)
    except CheckpointFormatError as error:
        assert str(error)
    else:
        assert isinstance(parsed, Checkpoint)
    directory = tmp_path / hashlib.sha256(repr(body).encode()).hexdigest()[:12]
    directory.mkdir(exist_ok=True)
    loaded, store = _load_fresh(directory, json.dumps(body).encode())
    store.close()
    assert loaded.status in (LoadStatus.LOADED, LoadStatus.CORRUPT, LoadStatus.PREVIOUS_BOOT)


def test_wrong_owner_and_mode(tmp_path: Path) -> None:
    """A checkpoint owned by someone else, world-writable: its content is trusted only as
    far as its checksum goes, and the next write replaces it with our own file, 0600."""
    if os.geteuid() != 0:
        pytest.skip("changing a file's owner needs root")
    original = sample_checkpoint()
    path = tmp_path / FILE_NAME
    path.write_bytes(encode(original))
    os.chown(path, 65534, 65534)
    path.chmod(0o666)
    store = CheckpointStore(tmp_path, BOOT)
    loaded = store.load()
    assert loaded.status is LoadStatus.LOADED and loaded.checkpoint == original
    store.save(original)
    st_ = path.stat()
    assert (st_.st_uid, stat.S_IMODE(st_.st_mode)) == (os.geteuid(), 0o600)
    store.close()


@pytest.mark.parametrize("kind", PLANTED)
def test_something_planted_in_place_of_the_checkpoint(
    tmp_path: Path, outside: Callable[[str, bytes], Path], kind: str
) -> None:
    """Not a regular file where the checkpoint belongs: the load neither blocks (a FIFO)
    nor reads forever (``/dev/zero``) nor trusts a file outside; the thing is moved aside,
    the next save writes our own regular file, and nothing outside changes."""
    plugin_dir = tmp_path / "plugin"
    plugin_dir.mkdir()
    path = plugin_dir / FILE_NAME
    plant(kind, path, outside, encode(sample_checkpoint()))
    store = CheckpointStore(plugin_dir, BOOT)
    loaded = in_thread(store.load)
    assert loaded.status is LoadStatus.CORRUPT, loaded
    assert loaded.checkpoint.claims == {} and "unreadable" in loaded.reason
    assert loaded.moved_to is not None and not path.exists() and not path.is_symlink()
    store.save(sample_checkpoint())
    assert stat.S_ISREG(path.lstat().st_mode)
    assert from_dict(json.loads(path.read_bytes())) == sample_checkpoint()
    store.close()


def test_symlinks_named_like_temporaries(
    tmp_path: Path, outside: Callable[[str, bytes], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A symlink at the very temporary name a write is about to use (the random part made
    predictable here): the write fails with a NodeError naming the checkpoint instead of
    following it; startup's cleanup removes only real temporaries, never a symlink's target."""
    target = outside("victim", b"precious\n")
    monkeypatch.setattr(durable.secrets, "token_hex", lambda _n: "0123456789abcdef")
    temporary = tmp_path / f".{FILE_NAME}.tmp-0123456789abcdef"
    temporary.symlink_to(target)
    store = CheckpointStore(tmp_path, BOOT)
    with pytest.raises(NodeError, match="could not write the checkpoint"):
        store.save(sample_checkpoint())
    monkeypatch.undo()
    store.save(sample_checkpoint())
    other = tmp_path / f".{FILE_NAME}.tmp-fedcba9876543210"
    other.symlink_to(target)
    assert durable.clean_temporaries(tmp_path) == []
    assert store.load().status is LoadStatus.LOADED
    store.close()


def test_symlink_in_place_of_the_node_lock(
    tmp_path: Path, outside: Callable[[str, bytes], Path]
) -> None:
    """The lock file is opened and written (the holder's pid) by a root process: a symlink
    there is moved aside and a lock file of our own created; its target is never written."""
    import anyio

    target = outside("shadow", b"root:*:19000:0:99999:7:::\n")
    lock_path = tmp_path / "gpu-dra-agent.lock"
    lock_path.symlink_to(target)

    async def take() -> None:
        async with NodeLock(lock_path, timeout=1):
            assert lock_path.read_bytes() == f"{os.getpid()}\n".encode()

    anyio.run(take)
    assert stat.S_ISREG(lock_path.lstat().st_mode)
    [aside] = tmp_path.glob("gpu-dra-agent.lock.symlink-*")
    assert aside.is_symlink() and aside.readlink() == target


# -- the real agent ---------------------------------------------------------------------------


@pytest.mark.anyio
async def test_the_agent_restarts_over_planted_files(
    fresh_harness: AgentHarness, tmp_path: Path
) -> None:
    """Between restarts of the real process: symlinks to files outside in place of the node
    lock, a prepared claim's spec (with exactly the right content), an orphan spec and our
    temporaries; then the checkpoint truncated. Each time the agent starts, says what it
    found (a Warning Event for the checkpoint), answers the old claim as before, prepares a
    new one, replaced every symlink with a file of its own, and wrote nothing outside."""
    harness = fresh_harness
    outside_dir = tmp_path / "outside"
    outside_dir.mkdir()
    await harness.start_agent()
    first, claim = await harness.allocate(gpu_request(), name="planted-first")
    [device] = allocated_devices(claim)
    answer = (await harness.prepare(first))[first.uid]
    assert answer.error == ""
    assert await harness.stop_agent() == 0

    spec_path = harness.cdi_spec_path(first.uid)
    planted: dict[Path, Path] = {
        harness.plugin_dir / "gpu-dra-agent.lock": outside_dir / "lock-target",
        spec_path: outside_dir / "spec-target",
        CdiSpecDirectory(harness.cdi_root, DRIVER).common_path(): outside_dir / "common-target",
        harness.cdi_spec_path("0badc0de-0000-4000-8000-000000000001"): outside_dir / "orphan",
        harness.plugin_dir / f".{FILE_NAME}.tmp-00000000000000aa": outside_dir / "tmp-target",
        harness.cdi_root / f".{spec_path.name}.tmp-00000000000000bb": outside_dir / "tmp2",
    }
    for link, target in planted.items():
        target.write_bytes(spec_path.read_bytes() if link == spec_path else b"keep me\n")
        target.chmod(0o644)
        link.unlink(missing_ok=True)
        link.symlink_to(target)
    snapshot = {t: (t.read_bytes(), t.stat().st_mtime_ns) for t in planted.values()}

    await harness.start_agent()
    again = (await harness.prepare(first))[first.uid]
    assert again.error == "" and [d.device_name for d in again.devices] == [device]
    assert stat.S_ISREG(spec_path.lstat().st_mode), "the spec symlink was kept"
    common = CdiSpecDirectory(harness.cdi_root, DRIVER).common_path()
    assert stat.S_ISREG(common.lstat().st_mode), "the common spec symlink was kept"
    assert stat.S_ISREG((harness.plugin_dir / "gpu-dra-agent.lock").lstat().st_mode)
    assert not planted_orphan_exists(harness)
    second, _ = await harness.allocate(gpu_request(), name="planted-second")
    assert (await harness.prepare(second))[second.uid].error == ""
    harness.assert_consistent()
    assert await harness.stop_agent() == 0

    data = harness.checkpoint_path.read_bytes()
    harness.checkpoint_path.write_bytes(data[: len(data) // 2])
    agent = await harness.start_agent()
    # the Event is posted once the API client exists, after the kubelet's sockets opened
    with anyio.move_on_after(10):
        while True:
            events = harness.server.list_objects("events")
            if any(e.get("reason") == "CheckpointCorrupted" for e in events):
                break
            await anyio.sleep(0.05)
    assert any(e.get("reason") == "CheckpointCorrupted" for e in events), events
    third, _ = await harness.allocate(gpu_request(), name="planted-third")
    assert (await harness.prepare(third))[third.uid].error == ""
    assert agent.returncode is None
    assert "Traceback" not in agent.log()
    for target, (content, mtime) in snapshot.items():
        assert (target.read_bytes(), target.stat().st_mtime_ns) == (content, mtime), target


def planted_orphan_exists(harness: AgentHarness) -> bool:
    return harness.cdi_spec_path("0badc0de-0000-4000-8000-000000000001").is_symlink()


__all__ = [
    "_claims_deleted_after_each_test",
    "anyio_backend",
    "fresh_harness",
    "outside",
    "workdir",
]


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("state",), []),  # found by test_wrong_types_with_a_valid_checksum: a TypeError
        (("state",), {"PrepareCompleted": 1}),
        (("devices",), {}),
        (("intents",), "none"),
        (("devices", 0, "kind"), ["gpu"]),
        (("devices", 0, "config"), 7),
    ],
)
def test_hostile_values_with_a_valid_checksum(
    tmp_path: Path, path: tuple[Any, ...], value: Any
) -> None:
    """Values a checksum cannot catch (it is recomputed): CheckpointFormatError naming the
    claim, and the store moves the file aside (it used to let a TypeError out of the
    start: the incumbent's crash loop, user-pain.md item 3)."""
    document = json.loads(encode(sample_checkpoint()))
    del document["checksum"]
    node = document["claims"][UIDS[0]]
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    document["checksum"] = checksum(document)
    with pytest.raises(CheckpointFormatError, match=f"claims.{UIDS[0]}"):
        from_dict(document)
    loaded, store = _load_fresh(tmp_path, json.dumps(document).encode())
    store.close()
    _check_quarantined(tmp_path, json.dumps(document).encode(), loaded)
