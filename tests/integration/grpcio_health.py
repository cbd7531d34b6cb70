"""A kubelet's health-stream client on grpcio (gRPC C core), run as a script by
``test_grpcio_client``: opens ``NodeWatchResources`` of one DRAResourceHealth version on the
DRA socket, reads the first message and prints it as JSON (field by field, as the kubelet's
generated Go code reads them). Its own process, like ``grpcio_kubelet.py``.

Usage: ``python grpcio_health.py GENERATED_DIR DRA_SOCKET VERSION`` (``v1alpha1`` or ``v1``).
"""

from __future__ import annotations

import importlib
import json
import sys


def main() -> None:
    generated, dra_socket, version = sys.argv[1:4]
    sys.path.insert(0, generated)
    import grpc  # type: ignore[import-untyped]

    pb = importlib.import_module(f"dra_health.{version}.api_pb2")
    pb_grpc = importlib.import_module(f"dra_health.{version}.api_pb2_grpc")
    with grpc.insecure_channel(f"unix:{dra_socket}") as channel:
        stub = pb_grpc.DRAResourceHealthStub(channel)
        stream = stub.NodeWatchResources(pb.NodeWatchResourcesRequest(), timeout=10)
        first = next(iter(stream))
        stream.cancel()
    devices = [
        {
            "pool_name": d.device.pool_name,
            "device_name": d.device.device_name,
            "health": pb.HealthStatus.Name(d.health),
            "last_updated_time": d.last_updated_time,
            "health_check_timeout_seconds": d.health_check_timeout_seconds,
            "message": d.message,
        }
        for d in first.devices
    ]
    print(
        json.dumps(
            {
                "service": pb.DESCRIPTOR.services_by_name["DRAResourceHealth"].full_name,
                "devices": devices,
            }
        )
    )


if __name__ == "__main__":
    main()
