"""The controller against the embedded API server: the Lease (one leader, a takeover after it
expires), the template, the finalizer, status.status and the deletion sequence."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from agent.imex.config import decode_channel_config
from agent.imex.controller import FINALIZER, LEASE_NAME, Controller, domain_status
from agent.imex.domains import DomainApi, domain_ref
from agent.sim.apiserver import EmbeddedApiServer
from tests.unit.imex.conftest import compute_domain

pytestmark = pytest.mark.anyio
CLIQUE = "6f1a3c2e-9b4d-4e7a-8c21-3d5f7a9b1c0e.32766"


def controller(api_client: Any, identity: str, lease_seconds: float = 15.0) -> Controller:
    return Controller(
        DomainApi(api_client),
        identity=identity,
        lease_namespace="gpu-dra-agent",
        lease_seconds=lease_seconds,
        resync_seconds=0.05,
    )


async def test_one_leader_and_a_takeover_once_the_lease_expires(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    first, second = controller(api_client, "one", 1.0), controller(api_client, "two", 1.0)
    assert await first._try_lease()
    assert not await second._try_lease()
    assert await first._try_lease()  # renewing
    lease = apiserver.get_object("leases", LEASE_NAME, "gpu-dra-agent")
    assert lease is not None and lease["spec"]["holderIdentity"] == "one"
    await anyio.sleep(1.2)  # "one" stopped renewing
    assert await second._try_lease()
    lease = apiserver.get_object("leases", LEASE_NAME, "gpu-dra-agent")
    assert lease is not None
    assert lease["spec"]["holderIdentity"] == "two" and lease["spec"]["leaseTransitions"] == 1
    assert not await first._try_lease()


def test_status_rule() -> None:
    def domain(num: int, *statuses: str) -> dict[str, Any]:
        nodes = [
            {"name": f"n{i}", "ipAddress": "", "cliqueID": CLIQUE, "index": i, "status": s}
            for i, s in enumerate(statuses)
        ]
        return {"spec": {"numNodes": num}, "status": {"nodes": nodes}}

    assert domain_status(domain(0)) == "NotReady"
    assert domain_status(domain(0, "Ready")) == "Ready"
    assert domain_status(domain(0, "Ready", "NotReady")) == "NotReady"
    assert domain_status(domain(2, "Ready")) == "NotReady"
    assert domain_status(domain(2, "Ready", "Ready")) == "Ready"


async def test_template_finalizer_status_and_deletion(
    apiserver: EmbeddedApiServer, api_client: Any
) -> None:
    leader = controller(api_client, "one")
    stored = apiserver.put_object(compute_domain(namespace="team-a", num_nodes=1, mode="All"))
    ref = domain_ref(stored)
    await leader.reconcile_all()
    domain = apiserver.get_object("computedomains", "cd", "team-a")
    assert domain is not None
    assert domain["metadata"]["finalizers"] == [FINALIZER]
    assert domain["status"]["status"] == "NotReady"
    template = apiserver.get_object("resourceclaimtemplates", "cd-channel", "team-a")
    assert template is not None
    assert template["metadata"]["ownerReferences"][0]["uid"] == ref.uid
    devices = template["spec"]["spec"]["devices"]
    assert devices["requests"] == [
        {
            "name": "channel",
            "exactly": {"deviceClassName": "compute-domain-default-channel.nvidia.com"},
        }
    ]
    config = decode_channel_config(devices["config"][0]["opaque"]["parameters"])
    assert (config.domain_id, str(config.allocation_mode)) == (ref.uid, "All")
    api = DomainApi(api_client)
    await api.join(ref, "tray-a", "10.0.0.1", CLIQUE)
    await api.report(ref, "tray-a", True, "DaemonReady", "READY")
    await leader.reconcile_all()
    domain = apiserver.get_object("computedomains", "cd", "team-a")
    assert domain is not None and domain["status"]["status"] == "Ready"
    reasons = [e["reason"] for e in apiserver.list_objects("events", namespace="team-a")]
    assert sorted(reasons) == ["Ready", "TemplateCreated"]
    # deletion: the template goes at once, the domain only once its node left
    apiserver.delete_object("computedomains", "cd", "team-a")
    await leader.reconcile_all()
    assert apiserver.get_object("resourceclaimtemplates", "cd-channel", "team-a") is None
    assert apiserver.get_object("computedomains", "cd", "team-a") is not None
    await leader.reconcile_all()
    assert apiserver.get_object("computedomains", "cd", "team-a") is not None
    assert await api.leave(ref, "tray-a")
    await leader.reconcile_all()
    assert apiserver.get_object("computedomains", "cd", "team-a") is None
