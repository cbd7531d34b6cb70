"""A driver's sockets open before its engine exists (``agent.kubelet.deferred``; the
compute-domain driver's stand-in, ``agent.imex.sockets``): a call in between waits for the engine, within a bound, and is the
engine's once it is attached; a bound passed or an engine that never comes fails the call with
a retryable error, not a hang."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent.imex.fabric import Clique
from agent.imex.sockets import DeferredChannelPreparer
from agent.kubelet.deferred import EngineNotReady
from agent.node.types import ClaimPrepareResult, ClaimRef

pytestmark = pytest.mark.anyio
CLAIM = ClaimRef("default", "6a4c2b1e-0d9f-4e8a-b7c3-1f2e3d4c5b6a", "channel")


class Engine:
    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple[str, ...]]] = []

    async def prepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, ClaimPrepareResult]:
        self.calls.append(("prepare", tuple(c.uid for c in claims)))
        return {c.uid: ClaimPrepareResult() for c in claims}

    async def unprepare(self, claims: Sequence[ClaimRef]) -> Mapping[str, str | None]:
        self.calls.append(("unprepare", tuple(c.uid for c in claims)))
        return dict.fromkeys((c.uid for c in claims), None)


async def test_a_call_before_the_engine_waits_for_it() -> None:
    preparer = DeferredChannelPreparer(Clique("fabric.1"), timeout_s=5)
    engine = Engine()
    answers: list[Mapping[str, ClaimPrepareResult]] = []

    async def prepare() -> None:
        answers.append(await preparer.prepare([CLAIM]))

    async with anyio.create_task_group() as group:
        group.start_soon(prepare)
        await anyio.sleep(0.05)
        assert answers == [] and engine.calls == []  # still waiting
        preparer.attach(engine)
    assert answers == [{CLAIM.uid: ClaimPrepareResult()}]
    assert await preparer.unprepare([CLAIM]) == {CLAIM.uid: None}
    assert engine.calls == [("prepare", (CLAIM.uid,)), ("unprepare", (CLAIM.uid,))]


async def test_no_engine_within_the_bound_is_a_retryable_error() -> None:
    preparer = DeferredChannelPreparer(Clique("fabric.1"), timeout_s=0.05)
    with pytest.raises(EngineNotReady, match=r"still starting .*retry"):
        await preparer.prepare([CLAIM])


async def test_an_engine_that_never_comes_fails_every_call() -> None:
    preparer = DeferredChannelPreparer(Clique(None, "no clique"), timeout_s=5)
    preparer.fail("the API server refused the agent")
    with pytest.raises(EngineNotReady, match="the API server refused the agent"):
        await preparer.unprepare([CLAIM])


async def test_sockets_before_the_engine_over_grpc() -> None:
    """A plugin served with the stand-in (the supervisor's start): GetInfo's side needs no
    engine; an empty NodePrepareResources (the probe's) is UNAVAILABLE, naming why, until the
    engine is attached, so a startup probe passes only with the engine; a claim's prepare sent
    before it waits and is answered by it."""
    import tempfile

    from grpclib import GRPCError
    from grpclib.client import Channel
    from grpclib.const import Status

    from agent.kubelet import api
    from agent.kubelet.deferred import DeferredPreparer
    from tests.unit.kubelet.conftest import make_plugin

    short = Path(tempfile.mkdtemp(prefix="dp-", dir="/tmp"))  # unix socket paths stay short
    preparer = DeferredPreparer("the gpu.nvidia.com prepare engine", timeout_s=10)
    plugin = make_plugin(short, preparer)  # type: ignore[arg-type]
    engine = Engine()
    async with anyio.create_task_group() as group:
        await group.start(plugin.run)
        channel = Channel(path=str(plugin.dra_server.path))
        stub = api.dra_v1.DraPluginStub(channel)
        with pytest.raises(GRPCError) as refused:
            await stub.node_prepare_resources(api.dra_v1.NodePrepareResourcesRequest(), timeout=5)
        assert refused.value.status is Status.UNAVAILABLE
        assert "prepare engine is still starting" in str(refused.value.message)
        claim = api.dra_v1.Claim(namespace=CLAIM.namespace, uid=CLAIM.uid, name=CLAIM.name)
        answers: list[Any] = []

        async def prepare() -> None:
            request = api.dra_v1.NodePrepareResourcesRequest(claims=[claim])
            answers.append(await stub.node_prepare_resources(request, timeout=10))

        group.start_soon(prepare)
        await anyio.sleep(0.2)
        assert answers == [] and engine.calls == []
        preparer.attach(engine)
        with anyio.fail_after(5):
            while not answers:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        assert not answers[0].claims[CLAIM.uid].error
        assert engine.calls == [("prepare", (CLAIM.uid,))]
        empty = await stub.node_prepare_resources(api.dra_v1.NodePrepareResourcesRequest())
        assert dict(empty.claims) == {}
        channel.close()
        group.cancel_scope.cancel()
