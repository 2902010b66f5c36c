"""`python -m loadplan.service.healthcheck HOST:PORT`: exit 0 iff the registry is SERVING.

The container health check of docker-compose.yml; it speaks the standard
grpc.health.v1 protocol, so any other prober works as well.
"""

from __future__ import annotations

import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVICE = "loadplan.v1.ModelRegistry"


def check(address: str, timeout: float = 2.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    address = argv[0] if argv else "127.0.0.1:50051"
    ok = check(address)
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
