"""``chronoq.v1.Replication`` from the calling side: the replica's pulls, ``chronoq cluster
status`` and ``chronoq promote``. The channel (TLS, request signing) is the official path's
(``chronoq.client.client``), so a pull is authenticated like any other call."""

from __future__ import annotations

from chronoq.client.client import ClientError, SignedChannel
from chronoq.protocol.rocketmq import status as codes


class ReplicationClient(SignedChannel):
    def __init__(self, endpoint: str, **connection):
        from chronoq.proto import chronoq_admin_pb2, chronoq_admin_pb2_grpc

        # A pull answers up to a 4 MiB chunk plus snapshot files: no receive limit.
        super().__init__(endpoint, options=[("grpc.max_receive_message_length", -1)], **connection)
        self.apb = chronoq_admin_pb2
        self._stub = chronoq_admin_pb2_grpc.ReplicationStub(self._channel)

    async def pull(self, request, wait_s: float):
        """One pull; the answer whatever its status (the follower decides what a refusal means)."""
        return await self._stub.Pull(request, timeout=self.timeout + wait_s)

    async def status(self):
        resp = await self._stub.ClusterStatus(self.apb.ClusterStatusRequest(), timeout=self.timeout)
        _check(resp.status)
        return resp

    async def forward(self, path: str, request, response_type, timeout_s: float):
        """One unary call of another service on the primary, answered as it comes (a replica
        passes the official clients' route calls on: ``chronoq.server.replica``)."""
        call = self._channel.unary_unary(path, request_serializer=type(request).SerializeToString,
                                         response_deserializer=response_type.FromString)
        return await call(request, timeout=timeout_s)

    async def promote(self):
        resp = await self._stub.Promote(self.apb.PromoteRequest(), timeout=self.timeout)
        _check(resp.status)
        return resp


def _check(status) -> None:
    if status.code != codes.OK:
        raise ClientError(status.code, status.message)
