"""Sending to and receiving from every broker group that holds a topic (docs/cluster.md, "Clients").

Both ask ``endpoint`` for the topic's route (QueryRoute: with a cluster, every live group's
queues, each naming its group's primary) and talk to each group's primary through a ``Client``
of its own. A route naming one broker only (a single node, or a cluster topic on one group)
means ``endpoint`` itself, as ``Client`` alone does. The route is asked once per topic and again
after a failed call (a group's primary changed).

``RoutedSender`` sends each batch to one group's primary, round robin over the groups that take
sends (READ_WRITE queues); a message with a message group (FIFO) always goes to the same group
(crc32 of the message group over the groups by name, as the official clients hash a message
group over the route's queues), so its order holds. Receipts come back in the order of the batch.

``RoutedReceiver`` receives from every group holding the topic (readable queues, a draining
group's too): each receive asks the groups in turn, starting one further each time, and answers
the first group's messages; when none has any it long-polls them in turn, ``POLL_SLICE_S`` each,
until ``wait_s`` is spent. ``ack`` sends each message's ack to the group it came from.

``group_endpoints`` is the route read once: group name -> its primary's endpoint.
"""

from __future__ import annotations

import asyncio
import zlib
from typing import Iterable, Sequence

from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.client.client import BatchSendError, Client, OutgoingMessage, ReceivedMessage, SendReceipt

_WRITABLE = (pb.WRITE, pb.READ_WRITE)
_READABLE = (pb.READ, pb.READ_WRITE)
POLL_SLICE_S = 0.5  # a routed receive's long poll of one group, while others may have messages


async def group_endpoints(client: Client, topic: str, writable: bool = False) -> dict[str, str]:
    """The groups of ``topic``'s route (``writable``: those taking sends; else those that can be
    read) -> the endpoint of each one's primary; {} when the route names one broker only (then
    ``client.endpoint`` serves the whole topic)."""
    client._routes.pop(topic, None)  # (asked afresh: a group may have come or gone)
    wanted = _WRITABLE if writable else _READABLE
    brokers: dict[str, str] = {}
    for q in await client.route(topic):
        if q.permission in wanted and q.broker.id == 0 and q.broker.endpoints.addresses:
            address = q.broker.endpoints.addresses[0]
            brokers[q.broker.name] = f"{address.host}:{address.port}"
    return {name: brokers[name] for name in sorted(brokers)} if len(brokers) > 1 else {}


class _Routed:
    """The clients of one routed sender or receiver: ``endpoint``'s, and one per group primary."""

    def __init__(self, endpoint: str, **client_kwargs) -> None:
        self.endpoint = endpoint
        self._kwargs = client_kwargs
        self.entry = Client(endpoint, **client_kwargs)
        self._clients: dict[str, Client] = {endpoint: self.entry}
        self._targets: dict[str, list[str]] = {}  # topic -> the endpoints used, by group name
        self._next: dict[str, int] = {}

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    _writable = False

    async def targets(self, topic: str) -> list[str]:
        found = self._targets.get(topic)
        if found is None:
            groups = await group_endpoints(self.entry, topic, self._writable)
            found = self._targets[topic] = list(groups.values()) or [self.endpoint]
        return found

    def _client(self, endpoint: str) -> Client:
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = Client(endpoint, **self._kwargs)
        return client

    def _turn(self, topic: str) -> int:
        at = self._next.get(topic, 0)
        self._next[topic] = at + 1
        return at


class RoutedSender(_Routed):
    _writable = True

    async def send_batch(self, messages: Iterable[OutgoingMessage]) -> list[SendReceipt]:
        messages = list(messages)
        if not messages:
            return []
        topic = messages[0].topic
        assert all(m.topic == topic for m in messages), "one topic per batch"
        targets = await self.targets(topic)
        at = self._turn(topic)
        parts: dict[str, list[int]] = {}
        for i, m in enumerate(messages):
            pick = zlib.crc32(m.message_group.encode()) if m.message_group else at
            parts.setdefault(targets[pick % len(targets)], []).append(i)
        out: list = [None] * len(messages)
        refused: BatchSendError | None = None
        try:
            for endpoint, indexes in parts.items():
                try:
                    receipts = await self._client(endpoint).send_batch([messages[i] for i in indexes])
                except BatchSendError as exc:  # some of this part stored: keep their receipts
                    receipts, refused = exc.results, refused or exc
                for i, r in zip(indexes, receipts):
                    out[i] = r
        except Exception:
            self._targets.pop(topic, None)  # (ask the route again next time: a primary may have moved)
            raise
        if refused is not None:
            raise BatchSendError(refused.code, refused.status_message, out)
        return out


class RoutedReceiver(_Routed):
    def __init__(self, endpoint: str, **client_kwargs) -> None:
        super().__init__(endpoint, **client_kwargs)
        self._source: dict[int, Client] = {}  # id(message) -> the client it came from, until acked

    async def receive(self, group: str, topic: str, *, max_messages: int = 16, invisible_s: float = 30,
                      wait_s: float = 5, tag: str = "*") -> list[ReceivedMessage]:
        """Up to ``max_messages`` of one group; [] once ``wait_s`` passed with none anywhere."""
        targets = await self.targets(topic)
        if len(targets) == 1:
            client = self._client(targets[0])
            got = await client.receive(group, topic, max_messages=max_messages, invisible_s=invisible_s,
                                       wait_s=wait_s, tag=tag)
            return self._remember(got, client)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        wait = 0.0  # the first round asks without waiting: any group's ready messages come first
        try:
            for _round in range(int(wait_s / POLL_SLICE_S) + 2):  # (bounded: each round spends POLL_SLICE_S)
                for _ in targets:
                    client = self._client(targets[self._turn(topic) % len(targets)])
                    got = await client.receive(group, topic, max_messages=max_messages, invisible_s=invisible_s,
                                               wait_s=wait, tag=tag)
                    if got:
                        return self._remember(got, client)
                left = deadline - loop.time()
                if left <= 0:
                    return []
                wait = min(POLL_SLICE_S, left / len(targets))
        except Exception:
            self._targets.pop(topic, None)
            raise
        return []

    def _remember(self, got: list[ReceivedMessage], client: Client) -> list[ReceivedMessage]:
        for m in got:
            self._source[id(m)] = client
        return got

    async def ack(self, group: str, topic: str, messages: Sequence[ReceivedMessage]) -> None:
        """Acknowledge ``messages`` (received through this receiver), each at its own group."""
        parts: dict[int, tuple[Client, list]] = {}
        for m in messages:
            client = self._source.get(id(m), self.entry)
            parts.setdefault(id(client), (client, []))[1].append(m)
        for client, mine in parts.values():
            await client.ack(group, topic, mine)
        for m in messages:
            self._source.pop(id(m), None)


async def topic_primaries(endpoint: str, topic: str, **connection) -> list[str]:
    """The endpoints of the primaries of every live group holding ``topic`` (readable queues), or
    ``[endpoint]`` when its route names one broker (or answers no route: the node's own answer
    then says why). For calls each group answers for its own part (cancel by key)."""
    from chronoq.client.client import ClientError

    async with Client(endpoint, **connection) as client:
        try:
            groups = await group_endpoints(client, topic)
        except ClientError:
            groups = {}
    return list(groups.values()) or [endpoint]


async def _cluster_groups(endpoint: str, **connection):
    """``ClusterGroups`` as ``endpoint`` reads the cluster from etcd; None when it is not in a
    cluster (it answers PRECONDITION_FAILED: this node alone)."""
    from rocketmq.grpc_protocol.definition_pb2 import Code

    from chronoq.client.admin import AdminClient
    from chronoq.client.client import ClientError

    async with AdminClient(endpoint, **connection) as admin:
        try:
            return await admin.call("ClusterGroups")
        except ClientError as exc:
            if exc.code != Code.PRECONDITION_FAILED:
                raise
            return None


async def key_cancel_targets(endpoint: str, topic: str, **connection) -> tuple[list[str], list[str]]:
    """For calls every group holding ``topic`` answers for its own part (cancel by key): (the
    groups holding it that have no primary now, the endpoints of the primaries to ask). Not in a
    cluster: ([], [endpoint]), asked directly, so its answer for a topic that does not exist is
    TOPIC_NOT_FOUND (a route lookup first would have created it, and "0 cancelled" hid the typo).
    A placed topic: its placement's groups (a route leaves dead groups out, so such a call would
    report on part of the topic as if it were all of it). A topic placed nowhere: its route."""
    shown = await _cluster_groups(endpoint, **connection)
    if shown is None:
        return [], [endpoint]
    holding = next((set(p.groups) for p in shown.placements if p.topic == topic), set())
    if not holding:
        return [], await topic_primaries(endpoint, topic, **connection)
    leaders = {g.name: g.leader for g in shown.groups if g.live and g.leader}
    return sorted(holding - set(leaders)), [leaders[g] for g in sorted(holding & set(leaders))]


async def cluster_primaries(endpoint: str, **connection) -> list[str]:
    """The endpoints of every live broker group's primary (``ClusterGroups``); ``[endpoint]``
    when it is not in a cluster. For views summed over every group (consumer groups' lag)."""
    shown = await _cluster_groups(endpoint, **connection)
    if shown is None:
        return [endpoint]
    return [g.leader for g in shown.groups if g.live and g.leader] or [endpoint]
