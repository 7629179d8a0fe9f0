"""``ListPending``'s answer (chronoq_admin.proto ``PendingMessage``) from a page of
``chronoq.timer.pending``: user properties only, the message group apart, as ``ReadMessages``
answers them (``chronoq.server.pipeline``)."""

from __future__ import annotations

from chronoq.core import model, validate
from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.store import record
from chronoq.timer.pending import LIMIT_DEFAULT, PendingMessage, PendingQuery

_SYSTEM_PREFIX = model.SYSTEM_PROPERTY_PREFIX


def query_from(request) -> PendingQuery:
    """The query a ``ListPendingRequest`` asks (its checks are ``chronoq.timer.pending``'s)."""
    return PendingQuery(topic=request.topic, key=request.key,
                        from_ms=request.from_ms if request.HasField("from_ms") else None,
                        to_ms=request.to_ms if request.HasField("to_ms") else None,
                        limit=request.limit or LIMIT_DEFAULT, cursor=request.cursor)


def pending_pb(m: PendingMessage, with_body: bool, broker_group: str = "") -> apb.PendingMessage:
    parts = m.parts
    props = record.decode_properties(parts.properties)
    group = props.get(validate.PROP_MESSAGE_GROUP, "")
    return apb.PendingMessage(
        due_ms=m.due_ms, ident=m.ident, level=m.level, topic=m.topic, queue=m.queue_id,
        message_id=parts.message_id.decode(), keys=record.decode_keys(parts.keys), tag=parts.tag.decode(),
        properties={k: v for k, v in props.items() if not k.startswith(_SYSTEM_PREFIX)},
        message_group=group, born_ms=parts.born_ms, stored_ms=parts.stored_ms, deliver_at_ms=parts.deliver_at_ms,
        body_bytes=len(parts.body), body=parts.body if with_body else b"", recall_handle=m.recall_handle(broker_group))
