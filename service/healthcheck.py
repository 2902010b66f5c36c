"""`python -m loadplan.service.healthcheck HOST:PORT [--tls-ca F] [--tls-cert F --tls-key F]`: exit 0 iff SERVING.

The container health check of docker-compose.yml; it speaks the standard
grpc.health.v1 protocol, so any other prober works as well. Health needs no
token; against a TLS registry pass its CA (and, for mutual TLS, a client
certificate and key), or set $LOADPLAN_TLS_CA / _CERT / _KEY.
"""

from __future__ import annotations

import argparse
import sys

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from loadplan.client.auth import AuthConfigError, ClientTls, open_channel, resolve_tls

SERVICE = "loadplan.v1.ModelRegistry"


def check(address: str, timeout: float = 2.0, *, tls: ClientTls | None = None) -> bool:
    with open_channel(address, tls) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=SERVICE), timeout=timeout)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadplan.service.healthcheck")
    parser.add_argument("address", nargs="?", default="127.0.0.1:50051", metavar="HOST:PORT")
    parser.add_argument("--timeout", type=float, default=2.0, metavar="SECONDS")
    parser.add_argument("--tls-ca", metavar="FILE", help="CA of the registry's certificate (default $LOADPLAN_TLS_CA)")
    parser.add_argument("--tls-cert", metavar="FILE", help="client certificate, for mutual TLS")
    parser.add_argument("--tls-key", metavar="FILE", help="its private key")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        tls = resolve_tls(None, args.tls_ca, args.tls_cert, args.tls_key)
        ok = check(args.address, args.timeout, tls=tls)
    except AuthConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print("SERVING" if ok else "NOT_SERVING")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
