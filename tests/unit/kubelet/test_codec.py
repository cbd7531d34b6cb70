"""The hand-written prepare answer encoding gives betterproto2's bytes exactly."""

from __future__ import annotations

import random
from types import ModuleType
from typing import Any

import pytest

from agent.kubelet import api
from agent.kubelet.codec import DraCodec, encode_prepare_response

VERSIONS = [api.dra_v1, api.dra_v1beta1]
TEXTS = ["", "gpu", "gpu-0", "é" * 70, "x" * 200, "k8s.gpu.nvidia.com/claim=common", "\x00"]


def _device(pb: ModuleType, rng: random.Random) -> Any:
    fields: dict[str, Any] = {
        "request_names": rng.choices(TEXTS, k=rng.randrange(3)),
        "pool_name": rng.choice(TEXTS),
        "device_name": rng.choice(TEXTS),
        "cdi_device_ids": rng.choices(TEXTS, k=rng.randrange(4)),
    }
    if pb is api.dra_v1 and rng.random() < 0.3:
        fields["share_id"] = rng.choice(TEXTS)
    return pb.Device(**fields)


def _response(pb: ModuleType, rng: random.Random) -> Any:
    claims = {}
    for _ in range(rng.randrange(5)):
        devices = [_device(pb, rng) for _ in range(rng.randrange(4))]
        error = rng.choice(TEXTS) if rng.random() < 0.3 else ""
        claims[rng.choice(TEXTS) + str(rng.random())] = pb.NodePrepareResourceResponse(
            devices=devices, error=error
        )
    return pb.NodePrepareResourcesResponse(claims=claims)


@pytest.mark.parametrize("pb", VERSIONS, ids=lambda pb: pb.__name__.rsplit(".", 1)[-1])
def test_the_bytes_are_betterproto2s(pb: ModuleType) -> None:
    rng = random.Random(7)
    for _ in range(500):
        response = _response(pb, rng)
        assert encode_prepare_response(response) == bytes(response)
    edge = pb.NodePrepareResourcesResponse(
        claims={"": pb.NodePrepareResourceResponse(), "u": pb.NodePrepareResourceResponse()}
    )
    assert encode_prepare_response(edge) == bytes(edge)


def test_the_codec_encodes_other_messages_with_betterproto2() -> None:
    codec = DraCodec()
    pb = api.dra_v1
    request = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace="n", uid="u", name="c")])
    assert codec.encode(request, pb.NodePrepareResourcesRequest) == bytes(request)
    answer = pb.NodePrepareResourcesResponse(claims={"u": pb.NodePrepareResourceResponse()})
    assert codec.encode(answer, pb.NodePrepareResourcesResponse) == bytes(answer)
    with pytest.raises(TypeError):  # grpclib's own check of the message type stays
        codec.encode(request, pb.NodePrepareResourcesResponse)
