"""Sending over every broker group that holds a topic (docs/cluster.md, "Clients").

``RoutedSender(endpoint)`` asks ``endpoint`` for the topic's route (QueryRoute: with a cluster,
every live group's queues, each naming its group's primary) and sends each batch to one group's
primary, round robin over the groups that take sends (READ_WRITE queues); a message with a
message group (FIFO) always goes to the same group (crc32 of the message group over the groups
by name, as the official clients hash a message group over the route's queues), so its order
holds. A route naming one broker only (a single node, or a cluster topic on one group) sends
through ``endpoint`` itself, as ``Client`` does. Receipts come back in the order of the batch.
The route is asked once per topic and again after a failed call (a group's primary changed).
"""

from __future__ import annotations

import zlib
from typing import Iterable

from rocketmq.grpc_protocol import definition_pb2 as pb

from chronoq.client.client import Client, OutgoingMessage, SendReceipt

_WRITABLE = (pb.WRITE, pb.READ_WRITE)


class RoutedSender:
    def __init__(self, endpoint: str, **client_kwargs) -> None:
        self.endpoint = endpoint
        self._kwargs = client_kwargs
        self.entry = Client(endpoint, **client_kwargs)
        self._clients: dict[str, Client] = {endpoint: self.entry}
        self._targets: dict[str, list[str]] = {}  # topic -> the endpoints taking sends, by group name
        self._next: dict[str, int] = {}

    async def __aenter__(self) -> "RoutedSender":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        for client in self._clients.values():
            await client.close()

    async def targets(self, topic: str) -> list[str]:
        found = self._targets.get(topic)
        if found is None:
            self.entry._routes.pop(topic, None)
            brokers = {}
            for q in await self.entry.route(topic):
                if q.permission in _WRITABLE and q.broker.id == 0 and q.broker.endpoints.addresses:
                    address = q.broker.endpoints.addresses[0]
                    brokers[q.broker.name] = f"{address.host}:{address.port}"
            found = [brokers[name] for name in sorted(brokers)] if len(brokers) > 1 else [self.endpoint]
            self._targets[topic] = found
        return found

    def _client(self, endpoint: str) -> Client:
        client = self._clients.get(endpoint)
        if client is None:
            client = self._clients[endpoint] = Client(endpoint, **self._kwargs)
        return client

    async def send_batch(self, messages: Iterable[OutgoingMessage]) -> list[SendReceipt]:
        messages = list(messages)
        if not messages:
            return []
        topic = messages[0].topic
        assert all(m.topic == topic for m in messages), "one topic per batch"
        targets = await self.targets(topic)
        at = self._next.get(topic, 0)
        self._next[topic] = at + 1
        parts: dict[str, list[int]] = {}
        for i, m in enumerate(messages):
            pick = zlib.crc32(m.message_group.encode()) if m.message_group else at
            parts.setdefault(targets[pick % len(targets)], []).append(i)
        out: list = [None] * len(messages)
        try:
            for endpoint, indexes in parts.items():
                receipts = await self._client(endpoint).send_batch([messages[i] for i in indexes])
                for i, r in zip(indexes, receipts):
                    out[i] = r
        except Exception:
            self._targets.pop(topic, None)  # (ask the route again next time: a primary may have moved)
            raise
        return out
