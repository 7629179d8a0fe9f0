"""chronoq.protocol.rocketmq's hand encoders and the client's hand-encoded requests equal what the
generated classes build, byte for byte."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

from chronoq.protocol.rocketmq import ack, fields, outgoing, receive, send
from chronoq.client.client import DELAY_LEVEL_PROPERTY, Client, OutgoingMessage

text = st.text(st.characters(blacklist_categories=("Cs",)), max_size=12)
names = st.text("abcXYZ09_-%|é", min_size=1, max_size=10)


def _client(namespace: str, host: str = "host-1") -> Client:
    client = Client.__new__(Client)  # no channel: only the encoders are used
    client.namespace = namespace
    client._encoder = outgoing.SendRequestEncoder(namespace, host)
    return client


def _encode(client: Client, messages, born_ms: int) -> bytes:
    """The one encoder, ids from the messages (hypothesis gives each one)."""
    return client._encoder.encode(messages, born_ms, iter(()))


def _reference(m: OutgoingMessage, born_ms: int, namespace: str, host: str) -> pb.Message:
    """What the client built with the generated classes before it encoded by hand."""
    sp = pb.SystemProperties(message_id=m.message_id, body_encoding=pb.IDENTITY, born_host=host,
                             tag=m.tag or None, keys=list(m.keys))
    sp.born_timestamp.FromMilliseconds(born_ms)
    if m.message_group:
        sp.message_group = m.message_group
        sp.message_type = pb.FIFO
    elif m.deliver_at_ms is not None:
        sp.message_type = pb.DELAY
        sp.delivery_timestamp.FromMilliseconds(int(m.deliver_at_ms))
    else:
        sp.message_type = pb.NORMAL
    props = m.properties
    if m.delay_level:
        props = dict(props, **{DELAY_LEVEL_PROPERTY: str(int(m.delay_level))})
        sp.message_type = pb.DELAY
    return pb.Message(topic=pb.Resource(name=m.topic, resource_namespace=namespace), body=m.body,
                      user_properties=props, system_properties=sp)


messages_st = st.builds(
    OutgoingMessage, topic=names, body=st.binary(min_size=0, max_size=300), tag=text,
    keys=st.lists(text, max_size=3), properties=st.dictionaries(text, text, max_size=3),
    message_group=st.none() | text, deliver_at_ms=st.none() | st.integers(0, 2**42),
    message_id=names, delay_level=st.none() | st.integers(0, 18))


@settings(max_examples=300, deadline=None)
@given(st.lists(messages_st, min_size=1, max_size=5), st.sampled_from(["", "ns-1"]),
       st.integers(-2**40, 2**42))
def test_send_request_equals_the_generated_encoding(messages, namespace, born_ms):
    client = _client(namespace)
    raw = _encode(client, messages, born_ms)
    want = sv.SendMessageRequest(messages=[_reference(m, born_ms, namespace, "host-1") for m in messages])
    assert sv.SendMessageRequest.FromString(raw) == want
    # Maps aside, the bytes are exactly the generated serialization (same field order).
    if not any(m.properties or m.delay_level for m in messages):
        assert raw == want.SerializeToString()
    assert _encode(client, messages, born_ms) == raw  # the second call, from the encoder's caches


shaped = st.builds(
    OutgoingMessage, topic=st.sampled_from(["t", "u"]), body=st.binary(min_size=0, max_size=200) | st.just(b"x" * 300),
    tag=st.sampled_from(["", "TagA"]), message_group=st.none() | st.sampled_from(["g1", "g" * 70]),
    deliver_at_ms=st.none() | st.integers(0, 2**42), message_id=st.none() | names | st.just("i" * 200),
    keys=st.sampled_from([(), ("k",)]))


@settings(max_examples=300, deadline=None)
@given(st.lists(shaped, min_size=1, max_size=12), st.sampled_from(["", "ns-1"]))
def test_a_batch_of_repeated_shapes_equals_the_generated_encoding(messages, namespace):
    # Messages of one shape share the bytes before their id (cached per call by shape and lengths);
    # any mix of shapes, fresh and given ids, lengths either side of 128 must still be exact.
    client = _client(namespace)
    born_ms = 1_700_000_000_123
    fresh = [b"01%032X" % i for i in range(len(messages))]
    raw = client._encoder.encode(messages, born_ms, iter(fresh))
    given_ids = iter(fresh)
    want = sv.SendMessageRequest(messages=[
        _reference(OutgoingMessage(m.topic, m.body, tag=m.tag, keys=m.keys, message_group=m.message_group,
                                   deliver_at_ms=m.deliver_at_ms,
                                   message_id=m.message_id or next(given_ids).decode()), born_ms, namespace, "host-1")
        for m in messages])
    assert raw == want.SerializeToString()


def test_messages_without_an_id_get_fresh_ones():
    client = _client("")
    got = sv.SendMessageRequest.FromString(client._send_request_bytes([OutgoingMessage("t", b"a"),
                                                                        OutgoingMessage("t", b"b")]))
    ids = [m.system_properties.message_id for m in got.messages]
    assert len(set(ids)) == 2 and all(len(i) == 34 for i in ids)
    assert [m.body for m in got.messages] == [b"a", b"b"]
    lone = sv.SendMessageRequest.FromString(client._send_request_bytes([OutgoingMessage("t", b"c")]))
    assert len(lone.messages) == 1 and lone.messages[0].system_properties.message_id not in ids


@given(st.integers(-2**63, 2**63 - 1).filter(bool))
def test_varint_matches_protobuf(n):
    # offset is an int64: negative values are ten bytes of two's complement.
    assert fields.key(4, fields.VARINT) + fields.varint(n) == sv.SendResultEntry(offset=n).SerializeToString()


@settings(max_examples=200, deadline=None)
@given(names, names, st.sampled_from(["", "ns"]), st.lists(st.tuples(text, text), max_size=5))
def test_ack_request_equals_the_generated_encoding(group, topic, namespace, entries):
    raw = ack.ack_request(fields.resource(group, namespace), fields.resource(topic, namespace), entries)
    want = sv.AckMessageRequest(group=pb.Resource(name=group, resource_namespace=namespace),
                                topic=pb.Resource(name=topic, resource_namespace=namespace),
                                entries=[sv.AckMessageEntry(message_id=m, receipt_handle=h) for m, h in entries])
    assert sv.AckMessageRequest.FromString(raw) == want
    assert raw == want.SerializeToString()


statuses = st.none() | st.tuples(st.sampled_from([pb.BAD_REQUEST, pb.ILLEGAL_TOPIC, pb.INTERNAL_ERROR, pb.OK]),
                                 text)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(text, st.integers(-2**63, 2**63 - 1), text, text, statuses), max_size=5),
       st.sampled_from(["all", "ids and offsets", "failures"]))
def test_send_response_equals_the_generated_encoding(results, columns):
    ok = pb.Status(code=pb.OK, message="OK")
    if columns == "ids and offsets":  # the plain batch's answer
        results = [(m, o, "", "", None) for m, o, *_ in results]
    elif columns == "failures":  # a failed message: its id, nothing else
        results = [(m, 0, "", "", st) if st else (m, o, r, t, None) for m, o, r, t, st in results]
    entries = [sv.SendResultEntry(status=pb.Status(code=st[0], message=st[1]) if st else ok, message_id=m,
                                  offset=o, recall_handle=r, transaction_id=t) for m, o, r, t, st in results]
    top = next((e.status for e, r in zip(entries, results) if r[4]), ok)
    want = sv.SendMessageResponse(status=top, entries=entries)
    ids, offsets = [r[0] for r in results], [r[1] for r in results]
    if columns == "ids and offsets":
        raw = send.send_response(ids, offsets)
    else:
        raw = send.send_response(*zip(*results)) if results else send.send_response((), ())
    assert raw == want.SerializeToString()
    assert sv.SendMessageResponse.FromString(raw) == want
    assert outgoing.send_results(raw) == _results(want)  # and the client reads it back


def _results(resp: sv.SendMessageResponse) -> tuple:
    """What outgoing.send_results should read from ``resp``'s bytes: its fields as the generated class has them."""
    return resp.status.code, resp.status.message, [
        (e.status.code, e.status.message, e.message_id, e.offset, e.recall_handle, e.transaction_id)
        for e in resp.entries]


codes = (st.sampled_from([pb.OK, pb.MULTIPLE_RESULTS, pb.BAD_REQUEST, pb.INTERNAL_ERROR, 0])
         | st.integers(-2**31, 2**31 - 1))
unknown = st.one_of(  # fields of numbers the reader does not know, of each wire type: (key, value) bytes
    st.tuples(st.integers(6, 2**29 - 1), st.integers(0, 2**64 - 1)).map(
        lambda t: fields.varint(t[0] << 3) + fields.varint(t[1])),
    st.tuples(st.integers(6, 2**29 - 1), st.binary(max_size=20)).map(
        lambda t: fields.field(fields.varint(t[0] << 3 | 2), t[1])),
    st.tuples(st.integers(6, 99), st.binary(min_size=8, max_size=8)).map(lambda t: fields.varint(t[0] << 3 | 1) + t[1]),
    st.tuples(st.integers(6, 99), st.binary(min_size=4, max_size=4)).map(lambda t: fields.varint(t[0] << 3 | 5) + t[1]))


@settings(max_examples=300, deadline=None)
@given(codes, text, st.lists(st.tuples(codes, text, text, st.integers(-2**63, 2**63 - 1), text, text), max_size=4),
       st.lists(unknown, max_size=3), st.booleans())
def test_the_clients_reading_of_a_send_response_equals_the_generated_one(code, message, entries, extra, with_status):
    want = sv.SendMessageResponse(status=pb.Status(code=code, message=message) if with_status else None, entries=[
        sv.SendResultEntry(status=pb.Status(code=c, message=m), message_id=i, offset=o, recall_handle=r,
                           transaction_id=t) for c, m, i, o, r, t in entries])
    raw = want.SerializeToString()
    assert outgoing.send_results(raw) == _results(want)
    raw += b"".join(extra)  # fields it does not know, as from a newer server: skipped, as the generated parser does
    assert _results(sv.SendMessageResponse.FromString(raw)) == _results(want)
    assert outgoing.send_results(raw) == _results(want)


@given(st.binary(max_size=200))
def test_the_clients_reading_of_a_send_response_accepts_or_raises_value_error(blob):
    try:
        code, message, entries = outgoing.send_results(blob)
    except ValueError:
        return
    assert isinstance(code, int) and isinstance(message, str) and isinstance(entries, list)


@given(st.sampled_from([pb.BAD_REQUEST, pb.INTERNAL_ERROR, pb.TOO_MANY_REQUESTS]), text)
def test_a_refused_request_answers_the_status_alone(code, message):
    want = pb.Status(code=code, message=message)
    assert send.send_response((), (), status=(code, message)) == \
        sv.SendMessageResponse(status=want).SerializeToString()
    assert ack.ack_response((), (), status=(code, message)) == sv.AckMessageResponse(status=want).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(text, text, statuses), max_size=5), st.booleans())
def test_ack_response_equals_the_generated_encoding(entries, with_failures):
    ok = pb.Status(code=pb.OK, message="OK")
    if not with_failures:
        entries = [(m, h, None) for m, h, _ in entries]
    results = [sv.AckMessageResultEntry(message_id=m, receipt_handle=h,
                                        status=pb.Status(code=st[0], message=st[1]) if st else ok)
               for m, h, st in entries]
    top = next((r.status for r, e in zip(results, entries) if e[2]), ok)
    want = sv.AckMessageResponse(status=top, entries=results)
    ids, handles, failures = [e[0] for e in entries], [e[1] for e in entries], [e[2] for e in entries]
    raw = ack.ack_response(ids, handles, failures if with_failures else None)
    assert raw == want.SerializeToString()
    assert sv.AckMessageResponse.FromString(raw) == want


@given(st.sampled_from([pb.OK, pb.MESSAGE_NOT_FOUND, pb.BAD_REQUEST]), text, st.integers(0, 2**42))
def test_receive_status_and_delivery_equal_the_generated_encoding(code, message, now_ms):
    assert receive.receive_status(code, message) == \
        sv.ReceiveMessageResponse(status=pb.Status(code=code, message=message)).SerializeToString()
    want = sv.ReceiveMessageResponse()
    want.delivery_timestamp.FromMilliseconds(now_ms)
    assert receive.receive_delivery(now_ms) == want.SerializeToString()


def test_the_field_table_names_real_fields_of_the_generated_classes():
    # (fields.py checks every number at import; this says what an edit of the table must keep)
    assert len({(cls, name) for cls, name, _, _ in fields.FIELDS}) == len(fields.FIELDS)
    for cls, name, number, wire_type in fields.FIELDS:
        descriptor = cls.DESCRIPTOR.fields_by_name[name]
        assert descriptor.number == number
        assert wire_type == (fields.LEN if descriptor.type in (descriptor.TYPE_STRING, descriptor.TYPE_BYTES,
                                                               descriptor.TYPE_MESSAGE) else fields.VARINT)


# ------------------------------------------------------------------------------ batched receive
@given(st.lists(st.binary(max_size=300), max_size=20))
def test_receive_batch_splits_back_into_its_items(items):
    blob = receive.receive_batch(items)
    assert [bytes(v) for v in receive.split_receive_batch(blob)] == items


def test_receive_batch_is_repeated_field_one():
    """The bytes of `repeated M responses = 1`: a generated class of that shape
    (SendMessageRequest's `repeated Message messages = 1`) reads the same items."""
    items = [pb.Message(body=b"x" * n).SerializeToString() for n in (0, 5, 300)]
    parsed = sv.SendMessageRequest.FromString(receive.receive_batch(items))
    assert [m.SerializeToString() for m in parsed.messages] == items


@given(st.binary(max_size=64), st.binary(max_size=64))
def test_ack_and_receive_request_and_response_split_into_their_parts(ack_bytes, receive_bytes):
    request = ack.ack_and_receive_request(ack_bytes, receive_bytes)
    assert [(n, bytes(v)) for n, v in fields.length_fields(request)] == [(1, ack_bytes), (2, receive_bytes)]
    assert tuple(map(bytes, ack.split_ack_and_receive_request(request))) == (ack_bytes, receive_bytes)
    response = ack.ack_and_receive_response(ack_bytes, [receive_bytes, receive_bytes])
    assert [(n, bytes(v)) for n, v in fields.length_fields(response)] == [
        (1, receive_bytes), (1, receive_bytes), (2, ack_bytes)]
    items, acked = ack.split_ack_and_receive_response(response)
    assert ([bytes(i) for i in items], bytes(acked)) == ([receive_bytes, receive_bytes], ack_bytes)


@given(st.binary(max_size=200))
def test_length_fields_accepts_or_raises_value_error(blob):
    try:
        got = fields.length_fields(blob)
    except ValueError:
        return
    assert sum(len(v) for _, v in got) <= len(blob)
