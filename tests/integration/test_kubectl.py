"""kubectl (the one tests/deploy requires, 1.32 on Debian) against ``gpu-dra-agent sim
apiserver`` with an agent running: the session the README shows, every command as a user
types it, validation on (``--validate=strict``, kubectl's default).

The API server and the agent are the real commands, each its own process; kubectl gets a
fresh ``HOME`` so that no discovery or OpenAPI cache from another run answers for the server.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import anyio
import pytest
from anyio.abc import Process

from tests.integration.harness import DRIVER, NODE, PROFILE

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "gpu-80gi-memory.yaml"
DEVICE_CLASSES = ROOT / "deploy" / "kubernetes" / "base" / "deviceclasses.yaml"
CLAIM = """apiVersion: resource.k8s.io/v1
kind: ResourceClaim
metadata:
  name: {name}
  labels: {{team: {team}}}
spec:
  devices:
    requests:
    - name: gpu
      exactly:
        {field}: gpu.nvidia.com
"""
NODE_YAML = f"""apiVersion: v1
kind: Node
metadata:
  name: {NODE}
  labels: {{example.com/rack: {{rack}}}}
"""


def claim(name: str, team: str = "a", field: str = "deviceClassName") -> str:
    return CLAIM.format(name=name, team=team, field=field)


def node(rack: str) -> str:
    return NODE_YAML.replace("{rack}", rack)


@dataclass
class Result:
    rc: int
    out: str
    err: str


@dataclass
class Session:
    workdir: Path
    kubeconfig: Path
    kubectl_path: str

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig), "HOME": str(self.workdir)}

    async def kubectl(self, *args: str, stdin: str | None = None) -> Result:
        result = await anyio.run_process(
            [self.kubectl_path, *args],
            input=stdin.encode() if stdin is not None else None,
            check=False,
            env=self.env(),
        )
        return Result(result.returncode, result.stdout.decode(), result.stderr.decode())

    async def ok(self, *args: str, stdin: str | None = None) -> str:
        result = await self.kubectl(*args, stdin=stdin)
        assert result.rc == 0, f"kubectl {' '.join(args)} failed:\n{result.err}"
        return result.out


async def _stop(process: Process) -> None:
    if process.returncode is None:
        process.send_signal(signal.SIGTERM)
        with anyio.move_on_after(10):
            await process.wait()
        if process.returncode is None:
            process.kill()
            await process.wait()


@pytest.fixture(scope="module")
async def session(workdir: Path) -> AsyncIterator[Session]:
    kubectl_path = shutil.which("kubectl")
    if kubectl_path is None:
        pytest.fail("kubectl is not installed; make tools says how to install it")
    kubeconfig = workdir / "kubeconfig"
    log = (workdir / "apiserver.log").open("wb")
    server = await anyio.open_process(
        [sys.executable, "-m", "agent", "sim", "apiserver", "--listen", "127.0.0.1:0",
         "--kubeconfig-out", str(kubeconfig)],
        stdout=log, stderr=log,
    )  # fmt: skip
    agent_log = (workdir / "agent.log").open("wb")
    agent: Process | None = None
    try:
        with anyio.fail_after(20):
            while not kubeconfig.exists():  # noqa: ASYNC110
                await anyio.sleep(0.05)
        agent = await anyio.open_process(
            [sys.executable, "-m", "agent", "run", "--simulate", PROFILE, "--node-name", NODE,
             "--kubeconfig", str(kubeconfig), "--registrar-dir", str(workdir / "registry"),
             "--plugins-dir", str(workdir / "plugins"), "--cdi-root", str(workdir / "cdi")],
            stdout=agent_log, stderr=agent_log,
        )  # fmt: skip
        yield Session(workdir, kubeconfig, kubectl_path)
    finally:
        if agent is not None:
            await _stop(agent)
        await _stop(server)
        log.close()
        agent_log.close()


async def test_apply_validates_creates_and_changes(session: Session) -> None:
    assert "node/node-a created" in await session.ok("apply", "-f", "-", stdin=node("r1"))
    # the agent publishes its slices once its Node exists
    with anyio.fail_after(30):
        while NODE not in (await session.ok("get", "resourceslices")):  # noqa: ASYNC110
            await anyio.sleep(0.2)
    out = await session.ok("apply", "-f", "-", stdin=claim("one-gpu"))
    assert "resourceclaim.resource.k8s.io/one-gpu created" in out
    out = await session.ok("apply", "-f", str(DEVICE_CLASSES))
    assert "deviceclass.resource.k8s.io/gpu.nvidia.com created" in out
    out = await session.ok("apply", "-f", str(EXAMPLE))  # a template and a Pod
    assert "resourceclaimtemplate.resource.k8s.io/gpu-80gi created" in out
    assert "pod/big-model created" in out

    assert "node/node-a configured" in await session.ok("apply", "-f", "-", stdin=node("r2"))
    out = await session.ok("apply", "-f", "-", stdin=claim("one-gpu", team="b"))
    assert "resourceclaim.resource.k8s.io/one-gpu configured" in out
    labels = await session.ok("get", "node", NODE, "-o", "jsonpath={.metadata.labels}")
    assert json.loads(labels) == {"example.com/rack": "r2"}
    team = await session.ok(
        "get", "resourceclaim", "one-gpu", "-o", "jsonpath={.metadata.labels.team}"
    )
    assert team == "b"
    assert "unchanged" in await session.ok("apply", "-f", "-", stdin=claim("one-gpu", team="b"))


async def test_a_typo_in_a_field_name_is_refused(session: Session) -> None:
    result = await session.kubectl("apply", "-f", "-", stdin=claim("typo", field="deviceClassNam"))
    assert result.rc == 1
    assert (
        'ResourceClaim in version "v1" cannot be handled as a ResourceClaim: strict decoding '
        'error: unknown field "spec.devices.requests[0].exactly.deviceClassNam"'
    ) in result.err
    missing = await session.kubectl("get", "resourceclaim", "typo")
    assert missing.rc == 1 and "NotFound" in missing.err
    # the same typo in a change of an existing object (a strategic merge patch)
    bad_node = node("r2").replace("labels:", "labelz:")
    result = await session.kubectl("apply", "-f", "-", stdin=bad_node)
    assert result.rc == 1 and 'unknown field "metadata.labelz"' in result.err
    # without validation kubectl sends Ignore: the field is dropped, as kube-apiserver does
    result = await session.kubectl(
        "apply", "--validate=false", "-f", "-", stdin=claim("typo", field="deviceClassNam")
    )
    assert result.rc == 0, result.err
    await session.ok("delete", "resourceclaim", "typo")


async def test_server_side_apply(session: Session) -> None:
    out = await session.ok("apply", "--server-side", "-f", "-", stdin=claim("ssa"))
    assert "resourceclaim.resource.k8s.io/ssa serverside-applied" in out
    obj = json.loads(await session.ok("get", "resourceclaim", "ssa", "-o", "json",
                                      "--show-managed-fields"))  # fmt: skip
    entries = obj["metadata"]["managedFields"]
    assert [(e["manager"], e["operation"]) for e in entries] == [("kubectl", "Apply")]
    assert entries[0]["fieldsV1"]["f:metadata"] == {"f:labels": {"f:team": {}}}

    change = claim("ssa", team="b")
    result = await session.kubectl("apply", "--server-side", "--field-manager=ops", "-f", "-",
                                   stdin=change)  # fmt: skip
    assert result.rc == 1
    assert 'Apply failed with 1 conflict: conflict with "kubectl": .metadata.labels.team' in (
        result.err
    )
    out = await session.ok("apply", "--server-side", "--field-manager=ops", "--force-conflicts",
                           "-f", "-", stdin=change)  # fmt: skip
    assert "serverside-applied" in out
    obj = json.loads(await session.ok("get", "resourceclaim", "ssa", "-o", "json",
                                      "--show-managed-fields"))  # fmt: skip
    assert obj["metadata"]["labels"] == {"team": "b"}
    owners = {e["manager"]: e["fieldsV1"] for e in obj["metadata"]["managedFields"]}
    assert owners["ops"]["f:metadata"] == {"f:labels": {"f:team": {}}}
    assert "f:metadata" not in owners["kubectl"]  # the label changed hands
    typo = await session.kubectl("apply", "--server-side", "-f", "-",
                                 stdin=claim("ssa", field="deviceClassNam"))  # fmt: skip
    assert typo.rc == 1
    assert ".spec.devices.requests[0].exactly.deviceClassNam: field not declared in schema" in (
        typo.err
    )


def _header(out: str) -> list[str]:
    return re.split(r"\s{2,}", out.splitlines()[0].strip())


async def test_get_prints_the_columns_kube_apiserver_prints(session: Session) -> None:
    out = await session.ok("get", "resourceslices")
    assert _header(out) == ["NAME", "NODE", "DRIVER", "POOL", "AGE"]
    assert re.search(rf"\s{NODE}\s+{re.escape(DRIVER)}\s+{NODE}\s+\d+[smh]", out), out
    out = await session.ok("get", "resourceclaims")
    assert _header(out) == ["NAME", "STATE", "AGE"]
    assert re.search(r"^one-gpu\s+pending\s", out, re.M), out
    out = await session.ok("get", "deviceclasses")
    assert _header(out) == ["NAME", "AGE"] and re.search(r"^gpu.nvidia.com\s+\d+s", out, re.M)
    assert _header(await session.ok("get", "resourceclaimtemplates")) == ["NAME", "AGE"]
    out = await session.ok("get", "nodes", "-o", "wide")
    assert _header(out)[:5] == ["NAME", "STATUS", "ROLES", "AGE", "VERSION"]
    assert "INTERNAL-IP" in out and re.search(rf"^{NODE}\s+Unknown\s+<none>\s", out, re.M), out
    out = await session.ok("get", "pods")
    assert _header(out) == ["NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    assert re.search(r"^big-model\s+0/1\s+\s*0\s", out, re.M), out
    domain = ("apiVersion: resource.nvidia.com/v1beta1\nkind: ComputeDomain\nmetadata: {name: dom}\n"
              "spec: {numNodes: 2, channel: {resourceClaimTemplate: {name: dom-channel}}}\n")  # fmt: skip
    await session.ok("apply", "-f", "-", stdin=domain)
    out = await session.ok("get", "computedomains")
    assert _header(out) == ["NAME", "STATUS", "NODES", "AGE"]  # the CRD's printer columns
    assert re.search(r"^dom\s+2\s+\d+s", out, re.M), out
    await session.ok("delete", "computedomain", "dom")


async def test_describe_and_explain(session: Session) -> None:
    out = await session.ok("describe", "resourceclaim", "one-gpu")
    assert re.search(r"^Name:\s+one-gpu$", out, re.M), out
    assert re.search(r"Device Class Name:\s+gpu.nvidia.com", out), out
    out = await session.ok("describe", "node", NODE)
    assert re.search(rf"^Name:\s+{NODE}$", out, re.M) and "example.com/rack=r2" in out
    out = await session.ok("describe", "resourceslices")
    assert f"Driver:  {DRIVER}" in out or re.search(rf"Driver:\s+{re.escape(DRIVER)}", out), out
    out = await session.ok("explain", "resourceclaim.spec.devices.requests")
    assert "FIELD: requests <[]DeviceRequest>" in out
    assert re.search(r"^\s+exactly\s+<ExactDeviceRequest>", out, re.M), out
    assert "firstAvailable" in out


async def test_get_watch_sees_changes_and_delete(session: Session) -> None:
    process = await anyio.open_process(
        [session.kubectl_path, "get", "resourceclaims", "--watch", "--output-watch-events"],
        env=session.env(),
    )
    seen = ""

    async def read_until(text: str) -> None:
        nonlocal seen
        assert process.stdout is not None
        with anyio.fail_after(15):
            while text not in seen:
                seen += (await process.stdout.receive()).decode()

    try:
        await read_until("one-gpu")  # the list before the watch
        await session.ok("apply", "-f", "-", stdin=claim("watched"))
        await read_until("watched")
        assert re.search(r"ADDED\s+watched\s+pending", seen), seen
        out = await session.ok("delete", "resourceclaim", "watched")
        assert 'resourceclaim.resource.k8s.io "watched" deleted' in out
        await read_until("DELETED")
        assert re.search(r"DELETED\s+watched\s", seen), seen
    finally:
        process.kill()
        await process.wait()
    missing = await session.kubectl("get", "resourceclaim", "watched")
    assert missing.rc == 1 and "NotFound" in missing.err
