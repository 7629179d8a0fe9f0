"""AckMessage by hand: the request's encoder (chronoq.client.client), the one ``AckMessageResponse``
encoder, and chronoq's ``AckAndReceive`` that acks one batch and receives the next in one call."""

from __future__ import annotations

from itertools import repeat

from chronoq.protocol.rocketmq import fields as f
from chronoq.protocol.rocketmq.fields import varint
from chronoq.protocol.rocketmq.receive import receive_batch


def ack_request(group: bytes, topic: bytes, entries) -> bytes:
    """An ``AckMessageRequest``: ``group``/``topic`` are ``resource()`` bytes; ``entries`` are
    (message id, receipt handle) strings."""
    pieces = [f.field(f.K_ACK_GROUP, group), f.field(f.K_ACK_TOPIC, topic)]
    add = pieces.append
    for message_id, handle in entries:
        entry = (f.string_field(f.K_ACK_ENTRY_MESSAGE_ID, message_id) if message_id else b"") + \
            (f.string_field(f.K_ACK_ENTRY_HANDLE, handle) if handle else b"")
        add(f.K_ACK_ENTRIES)
        add(varint(len(entry)))
        add(entry)
    return b"".join(pieces)


_OK_TOP = f.field(f.K_ACK_RESULT_STATUS, f.OK_STATUS)
_OK_RESULT_STATUS = f.field(f.K_RESULT_STATUS, f.OK_STATUS)


def ack_response(message_ids, handles, failures=None, *, status: tuple[int, str] | None = None) -> bytes:
    """The ``AckMessageResponse`` of every AckMessage answer: one ``AckMessageResultEntry`` per
    (message id, receipt handle), in order, OK (message "OK") unless ``failures[i]`` is a ``(code,
    message)``. The top status is ``status`` when given (the request failed as a whole: give no
    entries), else the first failure's (clients read only that), else OK."""
    assert status is None or not message_ids, "a failed request carries no entries"
    # (all accepted, the usual answer: no call to work the top status out)
    top = _OK_TOP if failures is None and status is None else \
        f.top_status(f.K_ACK_RESULT_STATUS, _OK_TOP, failures, status)
    pieces = [top]
    add = pieces.append
    text, ok = f.string_field, _OK_RESULT_STATUS
    for message_id, handle, failure in zip(message_ids, handles, failures or repeat(None)):
        entry = (text(f.K_RESULT_MESSAGE_ID, message_id) if message_id else b"") + \
            (text(f.K_RESULT_HANDLE, handle) if handle else b"") + \
            (ok if failure is None else f.field(f.K_RESULT_STATUS, f.status(*failure)))
        add(f.K_ACK_RESULTS)
        add(varint(len(entry)))
        add(entry)
    return b"".join(pieces)


# ``chronoq.v1.Consume/AckAndReceive`` acks one batch and receives the next in one call:
#
#     message AckAndReceiveRequest  { apache.rocketmq.v2.AckMessageRequest ack = 1;
#                                     apache.rocketmq.v2.ReceiveMessageRequest receive = 2; }
#     message AckAndReceiveResponse { repeated apache.rocketmq.v2.ReceiveMessageResponse responses = 1;
#                                     apache.rocketmq.v2.AckMessageResponse ack = 2; }
#
# The ack runs first; when it fails the receive does not run (``responses`` is empty). When every
# entry was acked, ``ack`` carries the OK status alone (no per-entry results).
K_ACK_AND_RECEIVE_ACK, K_ACK_AND_RECEIVE_RECEIVE = f.key(1, f.LEN), f.key(2, f.LEN)
K_ACK_AND_RECEIVE_RESPONSE_ACK = f.key(2, f.LEN)


def ack_and_receive_request(ack: bytes, receive: bytes) -> bytes:
    return f.field(K_ACK_AND_RECEIVE_ACK, ack) + f.field(K_ACK_AND_RECEIVE_RECEIVE, receive)


def ack_and_receive_response(ack: bytes, items) -> bytes:
    return receive_batch(items) + f.field(K_ACK_AND_RECEIVE_RESPONSE_ACK, ack)


def split_ack_and_receive_request(blob: bytes) -> tuple[memoryview, memoryview]:
    """(the AckMessageRequest bytes, the ReceiveMessageRequest bytes); ValueError when malformed."""
    parts = dict(f.length_fields(blob))
    if set(parts) != {1, 2}:
        raise ValueError("AckAndReceive needs exactly an ack (1) and a receive (2)")
    return parts[1], parts[2]


def split_ack_and_receive_response(blob: bytes) -> tuple[list[memoryview], memoryview]:
    """(the serialized ReceiveMessageResponses, the AckMessageResponse bytes); ValueError when
    malformed or without an ack."""
    items, ack = [], None
    for number, value in f.length_fields(blob):
        if number == 1:
            items.append(value)
        elif number == 2:
            ack = value
    if ack is None:
        raise ValueError("AckAndReceive answered no ack result")
    return items, ack
