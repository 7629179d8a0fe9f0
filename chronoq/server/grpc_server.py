"""The gRPC front end: serves ``MessagingService`` (``chronoq.server.messaging``), chronoq's
``Consume`` calls and ``chronoq.v1.Admin`` on the broker's port, behind the access gate.

The port is served by ``h2grpc.Server`` (chronoq's own HTTP/2 gRPC server on this event loop)
unless ``grpc_server = "grpcio"``; both take the same handlers and the access gate. The POP service
and the transactions' book are the runtime's, and so are their loops (``chronoq.server.consumers``):
the front end attaches to those loops and leaves all of it running when it stops.
"""

from __future__ import annotations

import logging

import grpc
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.core import errors
from chronoq.server import admin, auth, h2grpc, process
from chronoq.server.messaging.calls import AckAndReceiveRequest, SendRequest, serialize_answer
from chronoq.server.messaging.service import MessagingService

log = logging.getLogger("chronoq.grpc")

STOP_GRACE_S = 1.0                  # in-flight RPCs get this long when the server stops
# chronoq's own consume calls beside the RocketMQ service (chronoq.client.client uses them when offered).
MESSAGING_SERVICE = "apache.rocketmq.v2.MessagingService"
CONSUME_SERVICE = "chronoq.v1.Consume"


class GrpcFrontEnd:
    """Serves ``MessagingService`` on ``config.host:config.port`` for the runtime's broker."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.server: grpc.aio.Server | None = None
        self.service: MessagingService | None = None
        self.bound = ""

    async def start(self) -> None:
        cfg = self.config
        broker = self.runtime.broker
        pop, txns = self.runtime.pop, self.runtime.txns  # the broker's consumer state (server/consumers.py)
        assert broker is not None and self.runtime.committer is not None and pop is not None, "open the broker first"
        gate, tls = auth.build_gate(cfg, broker.refusals), auth.server_credentials(cfg)  # access control, limits, TLS
        self.service = MessagingService(cfg, broker, self.runtime.committer, pop, txns, self.runtime.loops)
        # Big enough that an oversized body reaches us and gets MESSAGE_BODY_TOO_LARGE instead
        # of a transport error.
        receive_limit = 2 * cfg.max_body_bytes + (4 << 20)
        # HTTP/2 caps and defences (docs/security.md), connections within the open-files limit
        limits = process.connection_limits(cfg)
        if cfg.grpc_server == "chronoq":
            server = h2grpc.Server(interceptors=[gate], max_receive_message_length=receive_limit,
                                   limits=limits, refusals=broker.refusals)
        else:
            server = grpc.aio.server(interceptors=[gate], options=[
                ("grpc.max_receive_message_length", receive_limit),
                ("grpc.max_send_message_length", -1),
                ("grpc.so_reuseport", 0),  # a second broker on this port must fail, not share it
                *limits.grpcio_options(),
            ])
        # SendMessage, AckMessage and ReceiveMessage first (generic handlers are asked in order):
        # their requests may keep their bytes and their answers may be bytes encoded by hand
        # (chronoq.protocol.rocketmq).
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(MESSAGING_SERVICE, {
            "SendMessage": grpc.unary_unary_rpc_method_handler(
                self.service.SendMessage, request_deserializer=SendRequest.parse,
                response_serializer=serialize_answer),
            "AckMessage": grpc.unary_unary_rpc_method_handler(
                self.service.AckMessage, request_deserializer=sv.AckMessageRequest.FromString,
                response_serializer=serialize_answer),
            "ReceiveMessage": grpc.unary_stream_rpc_method_handler(
                self.service.ReceiveMessage, request_deserializer=sv.ReceiveMessageRequest.FromString,
                response_serializer=serialize_answer),
        }),))
        service_pb2_grpc.add_MessagingServiceServicer_to_server(self.service, server)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(CONSUME_SERVICE, {
            # Both answer bytes (chronoq.protocol.rocketmq); no .proto declares them. Unary on the wire, served
            # as one-message streams so the answer budget sees when the answer left (ReceiveBatch).
            "ReceiveBatch": grpc.unary_stream_rpc_method_handler(
                self.service.ReceiveBatch, request_deserializer=sv.ReceiveMessageRequest.FromString),
            "AckAndReceive": grpc.unary_stream_rpc_method_handler(
                self.service.AckAndReceive, request_deserializer=AckAndReceiveRequest.parse),
        }),))
        admin_service = admin.add_to_server(server, broker, pop, self.runtime.committer,
                                            getattr(self.runtime, "schedules", None))
        # A cluster of broker groups (etcd; chronoq.server.cluster): placement calls and the route.
        admin_service.cluster = self.service.cluster = getattr(self.runtime, "cluster", None)
        if getattr(self.runtime, "replication", None) is not None:  # chronoq.v1.Replication (docs/replication.md)
            from chronoq.replication import service as replication

            replication.add_to_server(server, self.runtime.replication)
        host = f"[{cfg.host}]" if ":" in cfg.host and not cfg.host.startswith("[") else cfg.host
        self.bound = f"{host}:{cfg.port}"
        try:
            port = server.add_secure_port(self.bound, tls) if tls else server.add_insecure_port(self.bound)
        except RuntimeError as exc:
            port = 0
            log.debug("bind failed: %s", exc)
        if not port:
            raise errors.ClientError(f"cannot listen on {self.bound}: the address is in use or not local (set "
                                     "--port/CHRONOQ_PORT, --host/CHRONOQ_HOST, or port/host in the config file)")
        await server.start()
        self.server = server
        self.service.start()
        if cfg.host in ("0.0.0.0", "::") and not cfg.advertised_address:
            log.warning("listening on %s but advertising %s to clients; set advertised_address to an address "
                        "clients can reach", cfg.host, cfg.endpoint)

    async def stop(self) -> None:
        if self.service is not None:
            self.service.begin_stop()
        if self.server is not None:
            await self.server.stop(STOP_GRACE_S)
            self.server = None
        if self.service is not None:
            await self.service.close()

    def transport_figures(self) -> tuple:
        """For /metrics (chronoq.server.service_metrics): (``CallStats`` or None, open connections,
        open streams, parked long polls); None for what this server cannot tell (grpcio's)."""
        server, service = self.server, self.service
        parked = service._waker.parked if service is not None else None
        if not isinstance(server, h2grpc.Server):
            return None, None, None, parked
        conns = server._connections
        return server.stats, len(conns), sum(len(c.streams) for c in conns), parked

    def describe(self) -> str:
        return f"RocketMQ gRPC on {self.bound} (clients are told {self.config.endpoint})"

