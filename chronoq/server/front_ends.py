"""The network front ends a running broker serves. Each has async ``start``/``stop`` and ``describe``."""

from __future__ import annotations


def build(runtime) -> list:
    """Front ends for this runtime: the gRPC service (``chronoq.server.grpc_server``), then HTTP."""
    # Imported here, not at the top: the gRPC stack is heavy and embedded users never load it. An
    # ImportError (say, chronoq's generated stubs missing from a tree that was never installed)
    # must stop the start: a broker that says "ready" without its gRPC port serves nobody.
    from chronoq.server.grpc_server import GrpcFrontEnd

    front_ends = [GrpcFrontEnd(runtime)]
    if runtime.config.http_port >= 0:  # after gRPC: the HTTP routes read its PopService
        from chronoq.server.http import HttpFrontEnd

        front_ends.append(HttpFrontEnd(runtime))
    return front_ends
