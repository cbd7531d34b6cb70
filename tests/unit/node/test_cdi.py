"""CDI spec files: atomic writes with mode 0644, listing, orphans, damage detection."""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

import pytest

from agent.dra import cdi
from agent.node.cdi import CdiSpecDirectory, SpecStatus
from agent.node.errors import CdiFileError

DRIVER = "gpu.nvidia.com"
UID = "3f2a1b4c-5d6e-4f70-8192-a3b4c5d6e7f8"
UID2 = "aa11bb22-cc33-4d44-8e55-ff6677889900"


def claim_spec(uid: str = UID) -> dict[str, object]:
    return cdi.claim_spec(DRIVER, uid, [cdi.ClaimDevice("gpu-0", 0)])


def test_write_claim_and_common(tmp_path: Path) -> None:
    specs = CdiSpecDirectory(tmp_path / "cdi", DRIVER)
    path = Path(specs.write_claim(UID, claim_spec()))
    assert path == tmp_path / "cdi" / f"k8s.gpu.nvidia.com-claim_{UID}.json"
    assert json.loads(path.read_text()) == claim_spec()
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    common = specs.write_common(cdi.common_spec(DRIVER, ["/dev/nvidiactl"], []))
    assert common.name == "k8s.gpu.nvidia.com-common.json"
    assert stat.S_IMODE(common.stat().st_mode) == 0o644
    assert specs.claim_uids() == {UID}


def test_listing_ignores_other_files(tmp_path: Path) -> None:
    specs = CdiSpecDirectory(tmp_path, DRIVER)
    assert specs.claim_uids() == set()
    specs.write_claim(UID, claim_spec())
    specs.write_claim(UID2, claim_spec(UID2))
    for name in (
        "k8s.gpu.nvidia.com-common.json",
        "nvidia.yaml",
        f"k8s.compute-domain.nvidia.com-claim_{UID}.json",
        "k8s.gpu.nvidia.com-claim_not-a-uuid.json",
        f".k8s.gpu.nvidia.com-claim_{UID}.json.tmp-0123456789abcdef",
    ):
        (tmp_path / name).write_text("{}")
    assert specs.claim_uids() == {UID, UID2}
    assert specs.clean_temporaries() == [
        tmp_path / f".k8s.gpu.nvidia.com-claim_{UID}.json.tmp-0123456789abcdef"
    ]
    assert specs.remove_claim(UID) is True
    assert specs.remove_claim(UID) is False
    assert specs.claim_uids() == {UID2}
    assert (tmp_path / "nvidia.yaml").exists()


def test_paths_are_never_built_from_a_bad_uid(tmp_path: Path) -> None:
    specs = CdiSpecDirectory(tmp_path / "cdi", DRIVER)
    (tmp_path / "etc").mkdir()
    victim = tmp_path / "etc" / "passwd"
    victim.write_text("root")
    for call in (
        lambda: specs.remove_claim("../etc/passwd"),
        lambda: specs.write_claim("../../etc", claim_spec()),
        lambda: specs.claim_path("../../etc"),
    ):
        with pytest.raises(cdi.InvalidClaimUidError):
            call()
    assert victim.read_text() == "root"


def test_write_claim_checks_the_kind(tmp_path: Path) -> None:
    specs = CdiSpecDirectory(tmp_path, DRIVER)
    with pytest.raises(CdiFileError, match=re.escape("expected 'k8s.gpu.nvidia.com/claim'")):
        specs.write_claim(UID, {**claim_spec(), "kind": "other.com/x"})


def test_status_and_ensure(tmp_path: Path) -> None:
    specs = CdiSpecDirectory(tmp_path, DRIVER)
    path, expected = specs.claim_path(UID), claim_spec()
    assert specs.status(path, expected) is SpecStatus.MISSING
    assert specs.ensure(path, expected) is True
    assert specs.status(path, expected) is SpecStatus.MATCHES
    assert specs.ensure(path, expected) is False
    path.write_text(path.read_text()[:20])  # truncated
    assert specs.status(path, expected) is SpecStatus.DIFFERS
    assert specs.ensure(path, expected) is True
    os.chmod(path, 0o600)
    assert specs.status(path, expected) is SpecStatus.DIFFERS
    specs.ensure(path, expected)
    assert specs.status(path, claim_spec(UID2)) is SpecStatus.DIFFERS
    assert json.loads(path.read_text()) == expected
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


def test_write_failure_names_the_directory(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    specs = CdiSpecDirectory(blocker, DRIVER)
    with pytest.raises(CdiFileError, match="mounted read-write"):
        specs.write_claim(UID, claim_spec())
