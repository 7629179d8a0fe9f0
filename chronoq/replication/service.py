"""``chronoq.v1.Replication``: the gRPC servicer both roles serve, over a *node*.

The node is the role's object: ``chronoq.replication.shipper.PrimaryNode`` on a primary,
``chronoq.server.replica.ReplicaNode`` on a replica. Each has ``pull(request)``,
``status()`` and ``promote()`` (coroutines or not, see below), raising chronoq errors that
become the answer's status at the one boundary here (``chronoq.protocol.rocketmq.status``), as
the Admin service does. Access control: no rule in ``chronoq.server.auth``, so admins only.
"""

from __future__ import annotations

from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.proto import chronoq_admin_pb2_grpc as apb_grpc
from chronoq.protocol.h2 import Parts
from chronoq.protocol.rocketmq import status


def add_to_server(server, node) -> "ReplicationService":
    # chronoq's own server sends an answer given in ``Parts`` as it is (a primary's pull answer:
    # chronoq.replication.shipper.wire); grpcio's serializes only the response object.
    service = ReplicationService(node, takes_parts=bool(getattr(server, "TAKES_PARTS", False)))
    apb_grpc.add_ReplicationServicer_to_server(service, server)
    return service


async def _answer(response_type, what: str, fn, request):
    try:
        return await fn(request)
    except Exception as exc:  # noqa: BLE001 - the boundary
        code, message = status.code_and_message(exc, what)
        return response_type(status=apb.Status(code=code, message=message))


class ReplicationService(apb_grpc.ReplicationServicer):
    def __init__(self, node, takes_parts: bool = False) -> None:
        self.node = node
        self.takes_parts = takes_parts

    async def Pull(self, request, context):
        answer = await _answer(apb.PullResponse, "Pull", self.node.pull, request)
        if type(answer) is Parts and not self.takes_parts:
            return apb.PullResponse.FromString(bytes(answer))
        return answer

    async def ClusterStatus(self, request, context):
        return await _answer(apb.ClusterStatusResponse, "ClusterStatus", self.node.status, request)

    async def Promote(self, request, context):
        return await _answer(apb.PromoteResponse, "Promote", self.node.promote, request)
