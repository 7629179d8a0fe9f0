"""chronoq's gRPC server on the asyncio event loop: the part of ``grpc.aio.server`` chronoq uses.

Why chronoq has its own, and what HTTP/2 it speaks: ``chronoq.server.h2server`` (the transport).
This module is the API: ``Server`` takes generic and registered method handlers
(``grpc.*_rpc_method_handler``) and ``grpc.aio.ServerInterceptor``s, listens on plaintext ports
(prior knowledge, as gRPC clients speak it) and TLS ports with ALPN ``h2``
(``server_ssl_context``), and stops with a grace as ``grpc.aio`` does. How a call runs (the
handler's ``Context``, the eager first step) is ``chronoq.server.h2calls``. Every client that
speaks gRPC over HTTP/2 works with it (grpcio, grpc-js, grpc-java).
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
import tempfile

import grpc

from chronoq.core import refusals as R
from chronoq.server.callstats import CallStats
from chronoq.server.h2calls import CallDetails, Calls
from chronoq.server.h2limits import Limits, UnreadAnswers
from chronoq.server.h2server import Connection
from chronoq.server.h2streams import status_code


class Server(Calls):
    """The subset of ``grpc.aio.Server`` chronoq uses, served on this event loop."""

    # A unary handler may answer ``chronoq.protocol.h2.Parts``, sent without its serializer.
    TAKES_PARTS = True

    def __init__(self, *, interceptors=(), max_receive_message_length: int = 4 << 20,
                 limits: Limits | None = None, refusals=None) -> None:
        """``limits``: connections, streams, timeouts and attack budgets (``h2limits.Limits``, its
        defaults if None). ``refusals``: a ``chronoq.core.refusals.Refusals`` that counts what the
        limits turn away (the broker's); None counts nothing."""
        self.limits = limits if limits is not None else Limits()
        self.refusals = refusals
        self._interceptors = list(interceptors)
        self._generic: list = []
        self._registered: dict[str, object] = {}  # full method path -> RpcMethodHandler
        self._binds: list[tuple] = []  # (address, port, ssl context or None, listening socket)
        self._servers: list[asyncio.AbstractServer] = []
        self._connections: set[Connection] = set()
        # Answer bytes its connections hold for peers that do not take them, in all (h2limits).
        self.unread_answers = UnreadAnswers(self.limits.max_unread_answer_bytes_total)
        # Unary request bytes its connections hold (their ``buffered``, summed as it changes).
        self.buffered_requests = 0
        # Calls in flight past their first step: tasks, or calls resumed by a future's
        # done-callback (``h2calls._Waiting``), which stand for a task.
        self._calls: set = set()
        self._stopping = False
        self._stopped: asyncio.Event | None = None
        self.max_receive = max_receive_message_length
        self.stats = CallStats()  # calls, latency, bytes (chronoq.server.callstats, for /metrics)

    # ------------------------------------------------------------------ grpc.aio.Server's API
    def add_generic_rpc_handlers(self, handlers) -> None:
        self._generic.extend(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        for name, handler in method_handlers.items():
            self._registered[f"/{service_name}/{name}"] = handler

    def add_insecure_port(self, address: str) -> int:
        return self._bind(address, None)

    def add_secure_port(self, address: str, context: ssl.SSLContext) -> int:
        if not isinstance(context, ssl.SSLContext):
            raise TypeError("add_secure_port takes an ssl.SSLContext (see server_ssl_context)")
        return self._bind(address, context)

    def _bind(self, address: str, context) -> int:
        host, _, port = address.rpartition(":")
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
        port_n = int(port)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host or "0.0.0.0", port_n))
            sock.listen(1024)
        except OSError as exc:
            sock.close()
            raise RuntimeError(f"cannot bind {address}: {exc.strerror or exc}") from None
        sock.setblocking(False)
        bound = sock.getsockname()[1]
        self._binds.append((address, bound, context, sock))
        return bound

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        for _address, _port, context, sock in self._binds:
            server = await loop.create_server(lambda: Connection(self), sock=sock, ssl=context,
                                              backlog=1024)
            self._servers.append(server)

    async def stop(self, grace: float | None) -> None:
        self._stopping = True
        for server in self._servers:
            server.close()
        for conn in list(self._connections):
            conn.goaway()
        if grace and self._calls:
            await asyncio.wait(self._ends(), timeout=grace)
        for call in list(self._calls):
            call.cancel()
        if self._calls:
            await asyncio.wait(self._ends(), timeout=1.0)
        for conn in list(self._connections):
            conn.close()
        for server in self._servers:
            try:
                await asyncio.wait_for(server.wait_closed(), 1.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - shutting down regardless
                pass
        if self._stopped is not None:
            self._stopped.set()

    def _ends(self) -> list:
        """What ``stop`` waits on for each call in flight: its task, or its ``finished`` future."""
        return [call if isinstance(call, asyncio.Future) else call.finished() for call in self._calls]

    async def wait_for_termination(self, timeout: float | None = None) -> bool:
        if self._stopped is None:
            return True
        try:
            await asyncio.wait_for(self._stopped.wait(), timeout)
            return True
        except asyncio.TimeoutError:
            return False

    # ------------------------------------------------------------------ the request bytes cap
    def shed_requests(self) -> None:
        """The unary request bytes held over ``max_buffered_request_bytes_total`` (h2limits): end
        unfinished requests, the one holding the most on the connection holding the most first,
        until the sum is under the cap again. A request already whole waits only for its handler
        and is never ended here. Runs only past the cap: a scan of the connections is fine."""
        cap = self.limits.max_buffered_request_bytes_total
        while self.buffered_requests > cap:
            unfinished = [(conn, s) for conn in self._connections for s in conn.streams.values()
                          if s.queue is None and not s.half_closed and s.counted]
            if not unfinished:
                return  # all held bytes are whole requests about to be taken
            conn, stream = max(unfinished, key=lambda cs: (cs[0].buffered, cs[1].counted))
            held = stream.counted
            conn.refuse(R.REQUEST_BUDGET, f"an unfinished request holding {held} bytes while requests held "
                                          f"{self.buffered_requests} in all")
            conn._fail_call(stream, status_code(grpc.StatusCode.RESOURCE_EXHAUSTED),
                            f"request bytes held for unfinished requests passed the broker's cap ({cap} bytes, "
                            "all connections); this request, holding the most, was ended: send it again")
            conn._flush_out()

    # ------------------------------------------------------------------ handlers (for Calls._run)
    async def _lookup(self, details: CallDetails):
        handler = self._registered.get(details.method)
        if handler is not None:
            return handler
        for generic in self._generic:
            handler = generic.service(details)
            if handler is not None:
                return handler
        return None

    def _handler(self, details: CallDetails):
        """An awaitable of the call's handler (None when there is none), through the interceptors.
        (Not a coroutine itself: the call awaits the interceptor's, or the lookup's, directly.)"""
        interceptors = self._interceptors
        if not interceptors:
            return self._lookup(details)
        if len(interceptors) == 1:  # chronoq's one (the access gate): no chain to build
            return interceptors[0].intercept_service(self._lookup, details)

        async def chain(index: int, d: CallDetails):
            if index == len(self._interceptors):
                return await self._lookup(d)
            return await self._interceptors[index].intercept_service(lambda dd: chain(index + 1, dd), d)

        return chain(0, details)

def server_ssl_context(cert_pem: bytes, key_pem: bytes) -> ssl.SSLContext:
    """A TLS context for gRPC: TLS 1.2+, ALPN ``h2`` (gRPC clients require it)."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    # load_cert_chain reads files only: write the PEMs to a private temporary file for the call.
    fd, path = tempfile.mkstemp(prefix="chronoq-tls-")
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(key_pem + b"\n" + cert_pem)
        context.load_cert_chain(path)
    finally:
        os.unlink(path)
    return context
