"""``chronoq.v1.Replication`` from the calling side: the replica's pulls, ``chronoq cluster
status`` and ``chronoq promote``. The channel (TLS, request signing) is the official path's
(``chronoq.client.client``), so a pull is authenticated like any other call.

Pulls go over chronoq's own HTTP/2 transport (``chronoq.client.h2channel``, on the event loop
thread), the rest over grpc.aio: a pull is the replica's one call per round, and grpc.aio adds its
own threads' wake-ups to each, and grants a large answer its window in steps (64 KiB at first,
each step a WINDOW_UPDATE the primary waits for); the h2 transport grants 8 MiB per call, more
than a pull's 4 MiB chunk, so an answer leaves the primary in one go."""

from __future__ import annotations

from chronoq.client.admin import SignedChannel
from chronoq.client.client import ClientError
from chronoq.protocol.rocketmq import status as codes


PULL_PATH = "/chronoq.v1.Replication/Pull"


class ReplicationClient(SignedChannel):
    def __init__(self, endpoint: str, **connection):
        from chronoq.proto import chronoq_admin_pb2, chronoq_admin_pb2_grpc

        # A pull answers up to a 4 MiB chunk plus snapshot files: no receive limit.
        super().__init__(endpoint, options=[("grpc.max_receive_message_length", -1)], **connection)
        self.apb = chronoq_admin_pb2
        self._stub = chronoq_admin_pb2_grpc.ReplicationStub(self._channel)
        self._h2 = self.h2_channel()
        self._pull = self._h2.unary_unary(PULL_PATH, chronoq_admin_pb2.PullRequest.SerializeToString,
                                          chronoq_admin_pb2.PullResponse.FromString)

    async def pull(self, request, wait_s: float):
        """One pull; the answer whatever its status (the follower decides what a refusal means).
        Fails with ``grpc.aio.AioRpcError`` as a grpc.aio call does."""
        return await self._pull(request, metadata=self.signature(), timeout=self.timeout + wait_s)

    async def close(self) -> None:
        await self._h2.close()
        await super().close()

    async def status(self):
        resp = await self._stub.ClusterStatus(self.apb.ClusterStatusRequest(), timeout=self.timeout)
        _check(resp.status)
        return resp

    async def forward(self, path: str, request, response_type, timeout_s: float, metadata=()):
        """One unary call of another service on the primary, answered as it comes (a replica
        passes the official clients' route calls on: ``chronoq.server.replica``), with the
        caller's own ``metadata`` (its signature among them), never this node's credentials: a
        caller the primary would refuse is refused there."""
        call = self._h2.unary_unary(path, type(request).SerializeToString, response_type.FromString)
        return await call(request, metadata=tuple(metadata), timeout=timeout_s)

    async def promote(self):
        resp = await self._stub.Promote(self.apb.PromoteRequest(), timeout=self.timeout)
        _check(resp.status)
        return resp


def _check(status) -> None:
    if status.code != codes.OK:
        raise ClientError(status.code, status.message)
