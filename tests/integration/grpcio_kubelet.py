"""A kubelet stand-in on grpcio (gRPC C core), run as a script by ``test_grpcio_client``.

The agent's server is grpclib and its messages betterproto2; a client built from the same
libraries could share their mistakes. This client is generated from our ``.proto`` files by
``grpc_tools.protoc`` at test time and talks to the agent the way grpc-go in the kubelet does:
``unix:`` targets, plain HTTP/2. It runs in its own process so that the generated protobuf
modules never meet the test process's descriptor pool.

Usage: ``python grpcio_kubelet.py GENERATED_DIR REGISTRATION_SOCKET VERSION CLAIMS_JSON`` where
CLAIMS_JSON is a list of ``[namespace, name, uid]``; prints one JSON object.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any


def main() -> None:
    generated, registration_socket, version, claims_json = sys.argv[1:5]
    sys.path.insert(0, generated)
    import grpc  # type: ignore[import-untyped]

    reg_pb = importlib.import_module("pluginregistration.api_pb2")
    reg_grpc = importlib.import_module("pluginregistration.api_pb2_grpc")
    dra_pb = importlib.import_module(f"dra.{version}.api_pb2")
    dra_grpc = importlib.import_module(f"dra.{version}.api_pb2_grpc")

    out: dict[str, Any] = {}
    with grpc.insecure_channel(f"unix:{registration_socket}") as channel:
        registration = reg_grpc.RegistrationStub(channel)
        info = registration.GetInfo(reg_pb.InfoRequest(), timeout=1)
        out["info"] = {
            "type": info.type,
            "name": info.name,
            "endpoint": info.endpoint,
            "supported_versions": list(info.supported_versions),
        }
        status = reg_pb.RegistrationStatus(plugin_registered=True)
        registration.NotifyRegistrationStatus(status, timeout=5)

    claims = [
        dra_pb.Claim(namespace=ns, name=name, uid=uid) for ns, name, uid in json.loads(claims_json)
    ]
    with grpc.insecure_channel(f"unix:{info.endpoint}") as channel:
        dra = dra_grpc.DRAPluginStub(channel)
        prepared = dra.NodePrepareResources(
            dra_pb.NodePrepareResourcesRequest(claims=claims), timeout=45
        )
        out["prepare"] = {
            uid: {
                "error": result.error,
                "devices": [
                    {
                        "request_names": list(d.request_names),
                        "pool_name": d.pool_name,
                        "device_name": d.device_name,
                        "cdi_device_ids": list(d.cdi_device_ids),
                    }
                    for d in result.devices
                ],
            }
            for uid, result in prepared.claims.items()
        }
        empty = dra.NodePrepareResources(dra_pb.NodePrepareResourcesRequest(), timeout=45)
        out["empty_prepare"] = len(empty.claims)
        unprepared = dra.NodeUnprepareResources(
            dra_pb.NodeUnprepareResourcesRequest(claims=claims), timeout=45
        )
        out["unprepare"] = {uid: result.error for uid, result in unprepared.claims.items()}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
