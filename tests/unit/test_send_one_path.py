"""SendMessage's one path (send.send_columns -> convert.outgoing_batch -> Broker.write_batch ->
Store.write_columns -> send_response) for every shape of message: a batch stores and answers what
its messages sent one request each store and answer, and a request read from its bytes what the
same request read through the generated classes does.

Two brokers on the same fake clock get the same messages, one way each: the answers, the commit
log (byte for byte), the consume queues, the dedupe window, the metrics and the trace must come
out the same.
"""

from __future__ import annotations

import asyncio
import gzip
import os

import pytest

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

from chronoq.protocol.rocketmq.send import send_response
from chronoq.broker.broker import Broker
from chronoq.core import errors
from chronoq.core.clock import FakeClock
from chronoq.broker.committer import GroupCommitter
from chronoq.core.config import BrokerConfig
from chronoq.features.transactions import Transactions
from chronoq.server import convert
from chronoq.server.messaging.calls import SendRequest, serialize_answer
from chronoq.server.messaging.service import MessagingService
from chronoq.store import record
from chronoq.store.store import Columns

from storekit import SMALL_SEGMENT, body_for, log_bytes, open_store, prep, queue_snapshot, read_all

NOW = 1_700_000_000_000


def _message(topic: str, mid: str, body: bytes, *, tag: str | None = None, born_ms: int | None = NOW - 5,
             mtype=pb.NORMAL, **sp_fields) -> pb.Message:
    sp_fields.setdefault("body_encoding", pb.IDENTITY)
    sp = pb.SystemProperties(message_id=mid, message_type=mtype, **sp_fields)
    if tag is not None:
        sp.tag = tag
    if born_ms is not None:
        sp.born_timestamp.FromMilliseconds(born_ms)
    return pb.Message(topic=pb.Resource(name=topic), body=body, system_properties=sp)


def _with_properties(mid: str, body: bytes, properties: dict) -> pb.Message:
    return pb.Message(topic=pb.Resource(name="orders"), body=body, user_properties=properties,
                      system_properties=pb.SystemProperties(message_id=mid))


def _batch(topic: str, prefix: str, n: int, **kw) -> list[pb.Message]:
    return [_message(topic, f"{prefix}-{i:04d}", body_for(f"{prefix}-{i}"), **kw) for i in range(n)]


class _Side:
    """A broker, its committer and a MessagingService on one fake clock."""

    def __init__(self, path, clock: FakeClock, **config) -> None:
        self.config = BrokerConfig(data_dir=str(path), flush_policy="sync", trace_enabled=True,
                                    segment_bytes=1 << 20, **config).validate()
        self.broker = Broker(self.config, clock=clock)
        self.committer = GroupCommitter(self.broker)
        self.committer.start()
        self.service = MessagingService(self.config, self.broker, self.committer, None, Transactions(self.broker))

    async def via_send_message(self, messages) -> bytes:
        """As the server calls it: the request keeps its bytes (send.send_columns reads them)."""
        request = SendRequest(sv.SendMessageRequest(messages=messages).SerializeToString())
        return serialize_answer(await self.service.SendMessage(request, None))

    async def via_parsed_request(self, messages) -> bytes:
        """A parsed request without its bytes: convert.send_columns reads the columns."""
        return serialize_answer(await self.service.SendMessage(sv.SendMessageRequest(messages=messages), None))

    async def one_by_one(self, messages) -> bytes:
        """Each message in a request of its own; the answers' entries joined in one answer."""
        entries = []
        for m in messages:
            answer = sv.SendMessageResponse.FromString(await self.via_send_message([m]))
            entries.extend(answer.entries)
        return sv.SendMessageResponse(status=sv.SendMessageResponse.FromString(
            send_response((), ())).status, entries=entries).SerializeToString()

    def state(self) -> dict:
        b = self.broker
        return {"log": _without_append_marks(log_bytes(self.config.data_dir)), "queues": queue_snapshot(b.store),
                "dedupe": list(b._dedupe.items()), "sent": dict(b.sent_by_topic), "trace": b.trace.events.tuples(),
                "next": dict(b.store._next_qoff), "dispatched": b.store.dispatched}

    async def close(self) -> None:
        await self.committer.close()
        self.broker.close()


def _without_append_marks(log: bytes) -> bytes:
    """The log with each record's FLAG_CONTINUES cleared and its CRC blanked: a batch is one append
    (every record but the last marked), the same messages one per request are appends of one;
    every other byte must be equal."""
    out, pos = bytearray(log), 0
    while pos + record.HEADER_SIZE <= len(out):
        total = int.from_bytes(out[pos:pos + 4], "little")
        if total == 0:
            break
        out[pos + 6:pos + 10] = bytes(4)
        flags = int.from_bytes(out[pos + 10:pos + 12], "little") & ~record.FLAG_CONTINUES
        out[pos + 10:pos + 12] = flags.to_bytes(2, "little")
        pos += total
    return bytes(out)


def _run(tmp_path, scenario, **config):
    async def go():
        clock = FakeClock(NOW)
        fast, old = _Side(tmp_path / "fast", clock, **config), _Side(tmp_path / "old", clock, **config)
        try:
            await scenario(fast, old, clock)
        finally:
            await fast.close()
            await old.close()
    asyncio.run(go())


def _delayed(topic: str, prefix: str, n: int, **kw) -> list[pb.Message]:
    return [_message(topic, f"{prefix}-{i:04d}", body_for(f"{prefix}-{i}"), mtype=pb.DELAY,
                     delivery_timestamp={"seconds": NOW // 1000 + 60 + i, "nanos": (i % 1000) * 1_000_000}, **kw)
            for i in range(n)]


def test_a_batch_stores_and_answers_what_its_messages_one_by_one_do(tmp_path):
    """Every shape of batch (plain, tags, delayed, FIFO groups, keys, properties, delay levels):
    the same records, queues, answers (recall handles too) as its messages sent one per request."""
    async def scenario(batched, single, clock):
        for side in (batched, single):
            side.broker.create_topic("orders", 3)
            side.broker.create_topic("events", 1)
        batches = [
            _batch("orders", "a", 7),                                   # no tag
            _batch("orders", "b", 5, tag="red"),                        # one tag
            [_message("orders", f"c-{i}", body_for(f"c-{i}"), tag=("x", "", "yy")[i % 3]) for i in range(9)],
            _batch("orders", "d", 4, born_ms=None),                     # born unset: the store time
            _batch("events", "e", 3, mtype=pb.MESSAGE_TYPE_UNSPECIFIED),  # inferred NORMAL
            _batch("orders", "f", 100),
            _delayed("orders", "g", 50),                                # the delayed batch
            _delayed("orders", "g2", 3, tag="late", keys=["k1", "k2"]),
            [_message("orders", f"h-{i}", body_for(f"h-{i}"), mtype=pb.FIFO, message_group=f"grp-{i % 3}",
                      keys=[f"key-{i}"]) for i in range(9)],
            [_with_properties(f"i-{i}", body_for(f"i-{i}"), {"a": str(i), "b": "x\u00e9"}) for i in range(4)],
            [_with_properties(f"j-{i}", body_for(f"j-{i}"), {convert.DELAY_LEVEL_PROPERTY: str(i % 3), "z": "1"})
             for i in range(4)],
            _batch("orders", "k", 2) + _batch("events", "k2", 2) + _delayed("events", "k3", 2),  # mixed
        ]
        for messages in batches:
            clock.advance(3)
            answer = await batched.via_send_message(messages)
            assert sv.SendMessageResponse.FromString(answer).status.code == pb.OK
            assert answer == await single.one_by_one(messages)
            assert batched.state() == single.state()
        assert read_all(batched.broker.store) == read_all(single.broker.store)
        # A resend of a whole batch is a duplicate, answered as the first send was.
        for messages in (batches[1], batches[6]):
            assert await batched.via_send_message(messages) == await single.one_by_one(messages)
            assert batched.state() == single.state()

    _run(tmp_path, scenario)


def test_groups_keys_and_properties_round_trip_alike_on_every_path(tmp_path):
    """A message group, keys and properties stored through the wire (a batch, a lone message) and
    through the embedded API read back alike; a forged group (control characters) is refused on
    every path (issue 21: a group forged on one path but not another)."""
    from chronoq.broker.broker import PROP_MESSAGE_GROUP, OutgoingMessage

    async def scenario(wire, embedded, clock):
        for side in (wire, embedded):
            side.broker.create_topic("orders", 4)
        props = {"a": "1", "ü": "v\u00e9"}
        msgs = [pb.Message(topic=pb.Resource(name="orders"), body=b"body-%d" % i, user_properties=props,
                           system_properties=pb.SystemProperties(
                               message_id=f"m-{i}", message_type=pb.FIFO, message_group="grp-%d" % (i % 2),
                               keys=["k1", f"k-{i}"], tag="t", body_encoding=pb.IDENTITY)) for i in range(3)]
        await wire.via_send_message(msgs[:2])
        await wire.via_send_message(msgs[2:])
        embedded.broker.send_batch([OutgoingMessage("orders", b"body-%d" % i, tag="t", keys=("k1", f"k-{i}"),
                                                    properties=dict(props), message_id=f"m-{i}",
                                                    message_group="grp-%d" % (i % 2), born_ms=NOW)
                                    for i in range(3)])

        def stored(side):
            return sorted(((m.message_id, m.queue_id, m.tag, tuple(m.keys), m.properties, m.body)
                           for q in range(4) for m in side.broker.read("orders", q, 0, 100).messages),
                          key=lambda row: row[0])
        assert stored(wire) == stored(embedded)
        assert len(stored(wire)) == 3 and {row[4].get(PROP_MESSAGE_GROUP) for row in stored(wire)} == {"grp-0", "grp-1"}
        forged = pb.Message(topic=pb.Resource(name="orders"), body=b"x", system_properties=pb.SystemProperties(
            message_id="forged", message_type=pb.FIFO, message_group="g\x02evil\x01yes"))
        for messages in ([forged], [msgs[0], forged]):
            answer = sv.SendMessageResponse.FromString(await wire.via_send_message(messages))
            assert answer.status.code == pb.ILLEGAL_MESSAGE_GROUP if hasattr(pb, "ILLEGAL_MESSAGE_GROUP") \
                else answer.status.code != pb.OK
        with pytest.raises(errors.ClientError):
            embedded.broker.send_batch([OutgoingMessage("orders", b"x", message_group="g\x02evil\x01yes")])
        assert all("evil" not in m[4] for m in stored(wire))

    _run(tmp_path, scenario)


def test_requests_read_from_bytes_answer_what_parsed_requests_do(tmp_path):
    body = b"x" * 100
    unusual = {
        "fifo": _batch("orders", "g", 2) + [_message("orders", "g-fifo", body, mtype=pb.FIFO, message_group="grp")],
        "two topics": _batch("orders", "h", 2) + _batch("events", "h2", 2),
        "empty body": _batch("orders", "i", 2) + [_message("orders", "i-empty", b"")],
        "bad tag": _batch("orders", "j", 2) + [_message("orders", "j-bad", body, tag="a|b")],
        "blank tag": _batch("orders", "j2", 2) + [_message("orders", "j2-blank", body, tag="  ")],
        "id twice": _batch("orders", "k", 2) + [_message("orders", "k-0000", body_for("k-0"))],
        "id twice, other body": _batch("orders", "l", 2) + [_message("orders", "l-0000", body)],
        "no id": _batch("orders", "m", 2) + [_message("orders", "", body)],
        "id with a space": _batch("orders", "n", 2) + [_message("orders", "n 1", body)],
        "control in id": _batch("orders", "o", 2) + [_message("orders", "o\x01", body)],
        "long id": _batch("orders", "p", 2) + [_message("orders", "p" * 200, body)],
        "keys": _batch("orders", "q", 2) + [_message("orders", "q-k", body, keys=["k1"])],
        "properties": _batch("orders", "q2", 2) + [_with_properties("q2-p", body, {"a": "b"})],
        "delay level": _batch("orders", "q3", 2)
        + [_with_properties("q3-p", body, {convert.DELAY_LEVEL_PROPERTY: "1"})],
        "priority": _batch("orders", "q4", 2) + [_message("orders", "q4-p", body, priority=3)],
        "gzip": _batch("orders", "r", 2) + [_message("orders", "r-z", gzip.compress(body), body_encoding=pb.GZIP)],
        "new topic": _batch("brand-new", "s", 3),
        "bad topic": _batch("%RETRY%g_orders", "t", 2),
        "too large": _batch("orders", "u", 2) + [_message("orders", "u-big", b"y" * 5000)],
        "delay": _batch("orders", "v", 2) + [_message("orders", "v-d", body, mtype=pb.DELAY,
                                                       delivery_timestamp={"seconds": NOW // 1000 + 60})],
        "transaction": _batch("orders", "w", 2) + [_message("orders", "w-t", body, mtype=pb.TRANSACTION)],
    }

    async def scenario(fast, old, clock):
        for side in (fast, old):
            side.broker.create_topic("orders", 2)
            side.broker.create_topic("events", 2)
        for name, messages in unusual.items():
            clock.advance(1)
            answer = await fast.via_send_message(messages)
            assert answer == await old.via_parsed_request(messages), name
            assert fast.state() == old.state(), name
        # Refused batches were answered message by message, with failures where due.
        answer = sv.SendMessageResponse.FromString(await old.via_send_message(unusual["bad tag"]))
        assert answer.status.code == pb.ILLEGAL_MESSAGE_TAG

    _run(tmp_path, scenario, max_body_bytes=4096)


def test_write_columns_writes_the_records_write_does_across_segment_rolls(tmp_path):
    """Store.write_columns (the send path) and Store.write (Prepared records) lay down the same
    records, queue offsets and segments; each record is record.encode of its fields."""
    clock = FakeClock(NOW)
    a, b = open_store(tmp_path / "a", clock, segment_bytes=SMALL_SEGMENT), \
        open_store(tmp_path / "b", clock, segment_bytes=SMALL_SEGMENT)
    try:
        for round_ in range(6):  # ~330 KiB: several rolls (between batches: a batch is one append)
            n = 40
            mids = [f"m-{round_}-{i}" for i in range(n)]
            bodies = [body_for(m, 1000 + i * 37) for i, m in enumerate(mids)]
            queue_ids = [(round_ + i) % 3 for i in range(n)]
            tags = [b"", b"t1", b"t22"][round_ % 3:] * n
            tags = tags[:n]
            borns = [NOW - i for i in range(n)]
            flags = [record.FLAG_DELAYED if i % 5 == 4 else 0 for i in range(n)]
            dues = [NOW + 60_000 + i if f else 0 for i, f in enumerate(flags)]
            written = a.write([prep("t", q, body, m, tag="")._replace(tag=tag, keys=b"", properties=b"", born_ms=bm,
                                                                     flags=f, deliver_at_ms=d)
                               for q, body, m, tag, bm, f, d in zip(queue_ids, bodies, mids, tags, borns, flags, dues)])
            commits, qoffs, sizes = b.write_columns(Columns(["t"] * n, queue_ids, flags, borns, dues,
                                                            [m.encode() for m in mids], tags, [b""] * n, [b""] * n,
                                                            bodies))
            assert commits == [w.commit_offset for w in written]
            assert qoffs == [w.queue_offset for w in written]
            assert sizes == [w.size for w in written]
            for store in (a, b):
                store.dispatch(store.sync())
            clock.advance(7)
        assert len(os.listdir(tmp_path / "b" / "commitlog")) > 2
        assert log_bytes(tmp_path / "a") == log_bytes(tmp_path / "b")
        assert queue_snapshot(a) == queue_snapshot(b)
        assert list(a.delayed_dispatched) == list(b.delayed_dispatched)
        # Each record is what record.encode makes of the same fields (the first of its append:
        # another follows).
        msg = b.read_at(commits[0], written[0].size)
        assert record.encode(record.FLAG_CONTINUES, msg.queue_id, msg.queue_offset, msg.born_ms, msg.stored_ms, 0, b"t",
                             msg.message_id.encode(), msg.tag.encode(), b"", b"", msg.body) \
            == bytes(log_bytes(tmp_path / "b")[commits[0]:commits[0] + written[0].size])
    finally:
        a.close()
        b.close()
