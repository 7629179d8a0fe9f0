"""The network front ends a running broker serves. Each has async ``start``/``stop`` and ``describe``."""

from __future__ import annotations


def build(runtime) -> list:
    """Front ends for this runtime: the gRPC service (``chronoq.server.grpc_server``), then HTTP."""
    front_ends = []
    try:
        from chronoq.server.grpc_server import GrpcFrontEnd
    except ImportError:
        return front_ends
    front_ends.append(GrpcFrontEnd(runtime))
    if runtime.config.http_port >= 0:  # after gRPC: the HTTP routes read its PopService
        from chronoq.server.http import HttpFrontEnd

        front_ends.append(HttpFrontEnd(runtime))
    return front_ends
