"""The network front ends a running broker serves. Each has async ``start``/``stop`` and ``describe``."""

from __future__ import annotations


def build_early(runtime) -> list:
    """Front ends that listen before recovery: HTTP, so ``/healthz`` answers "not ready" meanwhile
    (``chronoq.server.http``; its other routes wait for the broker)."""
    if runtime.config.http_port < 0:
        return []
    from chronoq.server.http import HttpFrontEnd

    return [HttpFrontEnd(runtime)]


def build(runtime) -> list:
    """Front ends that need the open broker: the gRPC service (``chronoq.server.grpc_server``)."""
    # Imported here, not at the top: the gRPC stack is heavy and embedded users never load it. An
    # ImportError (say, chronoq's generated stubs missing from a tree that was never installed)
    # must stop the start: a broker that says "ready" without its gRPC port serves nobody.
    from chronoq.server.grpc_server import GrpcFrontEnd

    return [GrpcFrontEnd(runtime)]
