"""The network front ends a running broker serves. Each has async ``start``/``stop`` and ``describe``."""

from __future__ import annotations


def build(runtime) -> list:
    """Front ends for this runtime. The gRPC service is added by ``chronoq.server.grpc_server``."""
    front_ends = []
    try:
        from chronoq.server.grpc_server import GrpcFrontEnd
    except ImportError:
        return front_ends
    front_ends.append(GrpcFrontEnd(runtime))
    return front_ends
