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
from chronoq.protocol.rocketmq import status


def add_to_server(server, node) -> "ReplicationService":
    service = ReplicationService(node)
    apb_grpc.add_ReplicationServicer_to_server(service, server)
    return service


async def _answer(response_type, what: str, fn, request):
    try:
        return await fn(request)
    except Exception as exc:  # noqa: BLE001 - the boundary
        code, message = status.code_and_message(exc, what)
        return response_type(status=apb.Status(code=code, message=message))


class ReplicationService(apb_grpc.ReplicationServicer):
    def __init__(self, node) -> None:
        self.node = node

    async def Pull(self, request, context):
        return await _answer(apb.PullResponse, "Pull", self.node.pull, request)

    async def ClusterStatus(self, request, context):
        return await _answer(apb.ClusterStatusResponse, "ClusterStatus", self.node.status, request)

    async def Promote(self, request, context):
        return await _answer(apb.PromoteResponse, "Promote", self.node.promote, request)
