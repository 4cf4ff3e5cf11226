#!/usr/bin/env python3
"""Exit 0 when the gRPC server at HOST:PORT reports SERVING, 1 otherwise.

The containers' healthcheck (`grpc-health-check 127.0.0.1:50051`): it asks the
standard health service (grpc.health.v1.Health/Check) that `kv-manager serve`
and `gpu-worker` register, with the empty service name (the whole server)
unless SERVICE is given. A server that is still loading, draining after
SIGTERM, or not listening is unhealthy.
"""

from __future__ import annotations

import argparse
import sys
from typing import Sequence

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="grpc-health-check", description=__doc__.splitlines()[0])
    parser.add_argument("address", metavar="HOST:PORT")
    parser.add_argument("service", nargs="?", default="", help="a service name (default: the whole server)")
    parser.add_argument("--timeout-s", type=float, default=3.0, help="deadline of the call (default %(default)s)")
    args = parser.parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        try:
            response = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout_s
            )
        except grpc.RpcError as error:
            print(f"{args.address}: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        print(f"{args.address}: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
