"""The operator-side clients of a chronoq node: ``SignedChannel`` (a grpc channel with the
node's TLS and every call signed, also used by ``chronoq.replication.client``) and
``AdminClient``, which speaks chronoq's own ``chronoq.v1.Admin`` (topics, consumer groups, timer
stats, recall and reschedule; ``chronoq/proto/chronoq_admin.proto``).

Apart from ``chronoq.client.client`` because none of it is on a producer's or consumer's path:
admin calls are few and go through grpc.aio, so this module stays plain Python (not in
``chronoq.COMPILED_MODULES``). Statuses are checked as the messaging calls check theirs
(``Client._check``: ``ClientError`` with an ``apache.rocketmq.v2.Code``).

    async with AdminClient("127.0.0.1:8081") as admin:
        await admin.create_topic("orders", queues=8)
"""

from __future__ import annotations

import grpc

from chronoq.client import h2channel as h2client
from chronoq.client.client import Client, _open_channel, _signature_metadata, _tls_context


class _Signer(grpc.aio.UnaryUnaryClientInterceptor, grpc.aio.UnaryStreamClientInterceptor):
    """Signs every call of a channel (the AdminClient's: its methods pass no metadata)."""

    def __init__(self, access_key: str, secret_key: str) -> None:
        self._ak, self._sk = access_key, secret_key

    def _details(self, details):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *_signature_metadata(self._ak, self._sk))
        return details._replace(metadata=metadata)

    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)

    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(self._details(client_call_details), request)


# The largest answer an operator-side client takes: the broker's biggest answers are a listing of
# every schedule (up to 1,000 with 64 KiB bodies) and a 64 MiB ReadMessages page.
ADMIN_RECEIVE_MAX = 256 << 20


class SignedChannel:
    """A channel to a chronoq node for the operator-side clients (``AdminClient``,
    ``chronoq.replication.client``): TLS as configured, every call signed when keys are given.
    ``async with`` closes it."""

    def __init__(self, endpoint: str, *, request_timeout_s: float = 10.0, access_key: str = "",
                 secret_key: str = "", tls: bool = False, tls_ca_file: str = "", options=None):
        self.endpoint = endpoint
        self.timeout = request_timeout_s
        self._access = (access_key, secret_key)
        self._tls = (tls, tls_ca_file)
        signer = [_Signer(access_key, secret_key)] if access_key else None
        if options is None:  # (grpc's default is 4 MiB: 1,000 schedules of 64 KiB bodies list at 61 MB)
            options = [("grpc.max_receive_message_length", ADMIN_RECEIVE_MAX)]
        self._channel = _open_channel(endpoint, tls, tls_ca_file, options=options, interceptors=signer)

    def h2_channel(self) -> h2client.Channel:
        """A ``chronoq.client.h2channel`` channel to the same endpoint with the same TLS (the
        caller closes it; its calls are signed with ``signature()``)."""
        tls, ca_file = self._tls
        return h2client.Channel(self.endpoint, ssl=_tls_context(tls, ca_file))

    def signature(self) -> list[tuple[str, str]] | None:
        """The signing headers for one call now (None without an access key)."""
        access_key, secret_key = self._access
        return _signature_metadata(access_key, secret_key) if access_key else None

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()


class AdminClient(SignedChannel):
    """``chronoq.v1.Admin``: topics and consumer groups (lag per topic); timer stats, recall and
    reschedule of delayed messages.

    Answers are the protobuf messages of ``chronoq_admin.proto``; a non-OK status raises
    ``ClientError`` with the same ``apache.rocketmq.v2.Code`` values as the messaging calls.
    """

    def __init__(self, endpoint: str, **connection):
        from chronoq.proto import chronoq_admin_pb2, chronoq_admin_pb2_grpc

        super().__init__(endpoint, **connection)
        self._apb = chronoq_admin_pb2
        self._stub = chronoq_admin_pb2_grpc.AdminStub(self._channel)

    async def call(self, rpc: str, **fields):
        """Any Admin RPC by name with its request's fields (``chronoq_admin.proto``): the response,
        its status checked."""
        request = getattr(self._apb, rpc + "Request")(**fields)
        resp = await getattr(self._stub, rpc)(request, timeout=self.timeout)
        Client._check(resp.status)
        return resp

    async def create_topic(self, name: str, queues: int = 0, message_type: str = "", force: bool = False):
        """Create (or grow, or retype) a topic. 0 / "": the default for a new topic, keep for an old one.
        Retyping a topic that holds messages needs ``force``."""
        a = self._apb
        resp = await self._stub.CreateTopic(a.CreateTopicRequest(
            topic=a.Topic(name=name, queues=queues, message_type=message_type), force=force), timeout=self.timeout)
        Client._check(resp.status)
        return resp.topic

    async def list_topics(self, include_system: bool = False) -> list:
        resp = await self._stub.ListTopics(self._apb.ListTopicsRequest(include_system=include_system),
                                           timeout=self.timeout)
        Client._check(resp.status)
        return list(resp.topics)

    async def create_group(self, name: str, *, fifo: bool | None = None, max_attempts: int | None = None):
        """Create a consumer group or change its settings; ``None`` keeps a setting as it is."""
        a = self._apb
        req = a.CreateGroupRequest(group=a.Group(name=name, fifo=bool(fifo), max_attempts=max_attempts or 0),
                                   set_fifo=fifo is not None, set_max_attempts=max_attempts is not None)
        resp = await self._stub.CreateGroup(req, timeout=self.timeout)
        Client._check(resp.status)
        return resp.group

    async def list_groups(self, group: str = "", topic: str = "") -> list:
        """One ``GroupLag`` per (group, topic): lag (not yet received) and in-flight counts."""
        resp = await self._stub.ListGroups(self._apb.ListGroupsRequest(group=group, topic=topic),
                                           timeout=self.timeout)
        Client._check(resp.status)
        return list(resp.groups)

    async def timer_stats(self, minutes: int = 0):
        """``TimerStatsResponse``: lateness histogram, pending per due bucket for the next
        ``minutes`` (0: 10), backlog per delay level, lane states."""
        resp = await self._stub.TimerStats(self._apb.TimerStatsRequest(minutes=minutes), timeout=self.timeout)
        Client._check(resp.status)
        return resp

    async def stats(self):
        """``StatsResponse``: the broker overview (the figures of its /metrics endpoint)."""
        resp = await self._stub.Stats(self._apb.StatsRequest(), timeout=self.timeout)
        Client._check(resp.status)
        return resp

    async def lookup_message(self, query: str, scan_mib: int = 0, trace_mib: int = 0):
        """``LookupMessageResponse``: the records and life of the message(s) with id or key ``query``
        (0 MiB: the broker's [console] windows). Nothing found raises ``ClientError`` NOT_FOUND."""
        resp = await self._stub.LookupMessage(self._apb.LookupMessageRequest(
            query=query, scan_mib=scan_mib, trace_mib=trace_mib), timeout=self.timeout)
        Client._check(resp.status)
        return resp

    async def recall(self, recall_handle: str):
        """``RecallResponse``; ``.outcome`` is "cancelled", "already_delivered" or "not_found"."""
        resp = await self._stub.Recall(self._apb.RecallRequest(recall_handle=recall_handle), timeout=self.timeout)
        Client._check(resp.status)
        return resp

    async def cancel_by_key(self, topic: str, key: str):
        """``CancelByKeyResponse``: the pending timer messages of ``topic`` with message key ``key``
        that were cancelled (``.cancelled``) and those already due or being delivered (``.delivered``)."""
        resp = await self._stub.CancelByKey(self._apb.CancelByKeyRequest(topic=topic, key=key), timeout=self.timeout)
        Client._check(resp.status)
        return resp

    async def create_schedule(self, schedule):
        """Create a recurring schedule (a ``chronoq_admin_pb2.Schedule``); answers it as stored."""
        resp = await self._stub.CreateSchedule(self._apb.CreateScheduleRequest(schedule=schedule), timeout=self.timeout)
        Client._check(resp.status)
        return resp.schedule

    async def list_schedules(self, next_firings: int = 0) -> list:
        resp = await self._stub.ListSchedules(self._apb.ListSchedulesRequest(next=next_firings), timeout=self.timeout)
        Client._check(resp.status)
        return list(resp.schedules)

    async def schedule(self, op: str, name: str):
        """``op`` one of show, pause, resume, delete: the schedule afterwards (as it was, for delete)."""
        rpc = {"show": "ShowSchedule", "pause": "PauseSchedule", "resume": "ResumeSchedule",
               "delete": "DeleteSchedule"}[op]
        resp = await getattr(self._stub, rpc)(self._apb.ScheduleRequest(name=name), timeout=self.timeout)
        Client._check(resp.status)
        return resp.schedule

    async def list_pending(self, topic: str = "", key: str = "", from_ms: int | None = None,
                           to_ms: int | None = None, limit: int = 0, cursor: str = "", bodies: bool = False,
                           span: bool = False):
        """``ListPendingResponse``: a page of pending delayed messages in due order (``limit`` 0:
        100) and ``next_cursor`` ("" at the end) to get the next page with the same filters."""
        resp = await self._stub.ListPending(self._apb.ListPendingRequest(
            topic=topic, key=key, from_ms=from_ms, to_ms=to_ms, limit=limit, cursor=cursor, bodies=bodies,
            span=span), timeout=self.timeout)
        Client._check(resp.status)
        return resp

    async def reschedule(self, recall_handle: str, deliver_at_ms: int):
        """``RescheduleResponse``; ``.outcome`` "rescheduled" comes with the new ``.recall_handle``."""
        resp = await self._stub.Reschedule(self._apb.RescheduleRequest(
            recall_handle=recall_handle, deliver_at_ms=int(deliver_at_ms)), timeout=self.timeout)
        Client._check(resp.status)
        return resp
