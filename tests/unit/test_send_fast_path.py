"""The SendMessage fast path (convert.plain_batch -> Broker.write_plain -> Store.write_plain ->
send_response) against the message-by-message path it stands in for.

Two brokers on the same fake clock get the same requests, one through each path: the answers,
the commit log (byte for byte), the consume queues, the dedupe window, the metrics and the trace
must come out the same. Batches the fast path does not take must get the old path's answers.
"""

from __future__ import annotations

import asyncio
import gzip
import os

from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv

from chronoq.protocol.rocketmq.send import send_response
from chronoq.broker.broker import Broker
from chronoq.core.clock import FakeClock
from chronoq.broker.committer import GroupCommitter
from chronoq.core.config import BrokerConfig
from chronoq.features.transactions import Transactions
from chronoq.server import convert
from chronoq.server.messaging.calls import SendRequest, serialize_answer
from chronoq.server.messaging.service import MessagingService
from chronoq.store import record

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

    async def fast(self, messages) -> bytes:
        """The fast path only; it must take the batch."""
        plain = convert.plain_batch(messages)
        assert plain is not None
        offsets = await self.committer.send_plain(*plain)
        assert offsets is not None
        return sv.SendMessageResponse.FromString(send_response(plain[1], offsets)).SerializeToString()

    async def via_send_message(self, messages) -> bytes:
        """As the server calls it: the request keeps its bytes (send.plain_columns reads them)."""
        request = SendRequest(sv.SendMessageRequest(messages=messages).SerializeToString())
        return serialize_answer(await self.service.SendMessage(request, None))

    async def via_parsed_request(self, messages) -> bytes:
        """A parsed request without its bytes: convert.plain_batch reads the columns."""
        return serialize_answer(await self.service.SendMessage(sv.SendMessageRequest(messages=messages), None))

    async def old(self, messages) -> bytes:
        return serialize_answer(await self.service._send_batch(messages))

    def state(self) -> dict:
        b = self.broker
        return {"log": log_bytes(self.config.data_dir), "queues": queue_snapshot(b.store),
                "dedupe": list(b._dedupe.items()), "sent": dict(b.sent_by_topic), "trace": b.trace.events.tuples(),
                "next": dict(b.store._next_qoff), "dispatched": b.store.dispatched}

    async def close(self) -> None:
        await self.committer.close()
        self.broker.close()


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


def test_fast_path_stores_and_answers_what_the_old_path_does(tmp_path):
    async def scenario(fast, old, clock):
        for side in (fast, old):
            side.broker.create_topic("orders", 3)
            side.broker.create_topic("events", 1)
        batches = [
            _batch("orders", "a", 7),                                   # no tag
            _batch("orders", "b", 5, tag="red"),                        # one tag
            [_message("orders", f"c-{i}", body_for(f"c-{i}"), tag=("x", "", "yy")[i % 3]) for i in range(9)],
            _batch("orders", "d", 4, born_ms=None),                     # born unset: the store time
            _batch("events", "e", 3, mtype=pb.MESSAGE_TYPE_UNSPECIFIED),  # inferred NORMAL
            _batch("orders", "f", 100),
        ]
        for i, messages in enumerate(batches):
            clock.advance(3)
            answer = await (fast.fast(messages) if i % 2 else fast.via_send_message(messages))
            assert answer == await old.old(messages)
            assert sv.SendMessageResponse.FromString(answer).status.code == pb.OK
        assert fast.state() == old.state()
        assert fast.broker.sent_by_topic == {"orders": 125, "events": 3}
        # Read back through the store: the same messages, in the same queues and offsets.
        assert read_all(fast.broker.store) == read_all(old.broker.store)
        # A resend of a whole batch is a duplicate: the fast path declines, the answers match.
        assert convert.plain_batch(batches[1]) is not None
        assert fast.broker.write_plain(*convert.plain_batch(batches[1])) is None
        assert await fast.via_send_message(batches[1]) == await old.old(batches[1])
        assert fast.state() == old.state()

    _run(tmp_path, scenario)


def test_batches_the_fast_path_declines_get_the_old_answers(tmp_path):
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
            plain = convert.plain_batch(messages)
            # Nothing written when declined (so trying it first is harmless).
            assert plain is None or fast.broker.write_plain(*plain) is None, name
            answer = await fast.via_send_message(messages)
            assert answer == await old.via_parsed_request(messages), name
            assert fast.state() == old.state(), name
        # Declined batches were answered message by message, with failures where due.
        answer = sv.SendMessageResponse.FromString(await old.old(unusual["bad tag"]))
        assert answer.status.code == pb.ILLEGAL_MESSAGE_TAG

    _run(tmp_path, scenario, max_body_bytes=4096)


def test_write_plain_writes_the_records_write_does_across_segment_rolls(tmp_path):
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
            written = a.write([prep("t", q, body, m, tag="")._replace(tag=tag, keys=b"", properties=b"", born_ms=bm)
                               for q, body, m, tag, bm in zip(queue_ids, bodies, mids, tags, borns)])
            commits, qoffs = b.write_plain("t", queue_ids, borns, [m.encode() for m in mids], tags, bodies)
            assert commits == [w.commit_offset for w in written]
            assert qoffs == [w.queue_offset for w in written]
            for store in (a, b):
                store.dispatch(store.sync())
            clock.advance(7)
        assert len(os.listdir(tmp_path / "b" / "commitlog")) > 2
        assert log_bytes(tmp_path / "a") == log_bytes(tmp_path / "b")
        assert queue_snapshot(a) == queue_snapshot(b)
        # Each record is what record.encode makes of the same fields (the first of its append:
        # another follows).
        msg = b.read_at(commits[0], written[0].size)
        assert record.encode(record.FLAG_CONTINUES, msg.queue_id, msg.queue_offset, msg.born_ms, msg.stored_ms, 0, b"t",
                             msg.message_id.encode(), msg.tag.encode(), b"", b"", msg.body) \
            == bytes(log_bytes(tmp_path / "b")[commits[0]:commits[0] + written[0].size])
    finally:
        a.close()
        b.close()
