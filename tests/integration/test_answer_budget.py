"""The answer budget against a live in-process broker (issue 20 §2; docs/security.md, "Answer budget").

A raw HTTP/2 client (frames built with hyperframe and hpack) announces SETTINGS_INITIAL_WINDOW_SIZE
= 0, so no answer can reach it, and opens many receives for batches of big messages. Both
``grpc_server`` modes: the bound is in the handlers, above the transport.

- The bytes the broker holds for it stay within its per-connection budget (``service.answers``);
  the receives beyond it are refused with TOO_MANY_REQUESTS (read once the client opens its
  window) and counted as ``answer_budget`` refusals; a normal client on another connection sends
  and receives meanwhile, and gets every message the attacker's answers do not hold.
- The send timeout (an injected clock moved past it): the stuck answers' calls end and their
  messages go back to the queue at once, for ReceiveMessage and for the unary ReceiveBatch.
"""

from __future__ import annotations

import asyncio
import struct
import time
import types

import grpc
import pytest
from hpack import Decoder, Encoder
from hyperframe.frame import (DataFrame, Frame, GoAwayFrame, HeadersFrame, PingFrame, RstStreamFrame,
                              SettingsFrame, WindowUpdateFrame)
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.core import refusals
from chronoq.protocol.rocketmq.receive import split_receive_batch
from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.clock import SystemClock
from chronoq.broker.committer import GroupCommitter
from chronoq.core.config import BrokerConfig
from chronoq.server.consumers import ConsumerLoops, close_consumers, open_consumers
from chronoq.server.grpc_server import GrpcFrontEnd

from .conftest import free_port

Code = pb.Code
BODY = 64 * 1024                 # each message: 64 KiB, as in the report
MESSAGES = 96                    # 6 MiB in all
PER_CONNECTION = 1 << 20         # 1 MiB: 15 messages' answers
TOTAL = 4 << 20
ATTACK_CALLS = 40                # 40 receives x 16 messages would hold 40 MiB without the budget
ATTACK_BATCH = 16
TIMEOUT_MS = 10_000
RECEIVE = "/apache.rocketmq.v2.MessagingService/ReceiveMessage"
RECEIVE_BATCH = "/chronoq.v1.Consume/ReceiveBatch"


class ShiftedClock(SystemClock):
    """The real clock whose monotonic reading the test moves forward (the send timeout)."""

    def __init__(self) -> None:
        super().__init__()
        self.shift_ns = 0

    def monotonic_ns(self) -> int:
        return super().monotonic_ns() + self.shift_ns


class RawClient:
    """An HTTP/2 client that takes no answer until told: its streams' initial window is 0."""

    def __init__(self, reader, writer) -> None:
        self.reader, self.writer = reader, writer
        self.encoder, self.decoder = Encoder(), Decoder()
        self.next_id = 1
        self.data: dict[int, bytearray] = {}   # stream -> DATA bytes received
        self.ended: set[int] = set()           # END_STREAM seen
        self.reset: dict[int, int] = {}        # stream -> RST_STREAM code
        self.trailers: dict[int, dict] = {}
        self.goaway = False
        self._buf = b""

    @classmethod
    async def connect(cls, port: int) -> "RawClient":
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
                     + SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: 0}).serialize())
        return cls(reader, writer)

    def call(self, path: str, request: bytes) -> int:
        sid, self.next_id = self.next_id, self.next_id + 2
        headers = HeadersFrame(sid, self.encoder.encode([
            (":method", "POST"), (":scheme", "http"), (":path", path), (":authority", "localhost"),
            ("content-type", "application/grpc"), ("te", "trailers"), ("grpc-timeout", "60S"),
            ("x-mq-client-id", "attacker@1@1@x")]), flags=["END_HEADERS"])
        data = DataFrame(sid, struct.pack(">BI", 0, len(request)) + request, flags=["END_STREAM"])
        self.writer.write(headers.serialize() + data.serialize())
        return sid

    def open_window(self) -> None:
        self.writer.write(SettingsFrame(0, settings={SettingsFrame.INITIAL_WINDOW_SIZE: (1 << 31) - 1}).serialize()
                          + WindowUpdateFrame(0, window_increment=(1 << 31) - 1 - 65_535).serialize())

    async def read_until(self, done, limit_s: float = 20) -> None:
        """Read frames (answering SETTINGS and PING as a client must) until ``done()``."""
        deadline = time.monotonic() + limit_s
        while not done():
            left = deadline - time.monotonic()
            assert left > 0, "the broker did not answer in time"
            try:
                chunk = await asyncio.wait_for(self.reader.read(1 << 20), min(left, 0.2))
            except asyncio.TimeoutError:
                continue
            assert chunk, "the broker closed the connection"
            self._buf += chunk
            self._frames()
            await self.writer.drain()

    def _frames(self) -> None:
        buf = self._buf
        while len(buf) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(buf[:9]))
            if len(buf) < 9 + length:
                break
            frame.parse_body(memoryview(buf[9:9 + length]))
            buf = buf[9 + length:]
            sid = frame.stream_id
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                self.writer.write(SettingsFrame(0, flags=["ACK"]).serialize())
            elif isinstance(frame, PingFrame) and "ACK" not in frame.flags:
                self.writer.write(PingFrame(0, frame.opaque_data, flags=["ACK"]).serialize())
            elif isinstance(frame, DataFrame):
                self.data.setdefault(sid, bytearray()).extend(frame.data)
                if frame.data:  # give back what we read: only the initial window is 0
                    self.writer.write(WindowUpdateFrame(0, window_increment=len(frame.data)).serialize())
            elif isinstance(frame, HeadersFrame):
                fields = dict(self.decoder.decode(frame.data))
                if "grpc-status" in fields:
                    self.trailers[sid] = fields
            elif isinstance(frame, RstStreamFrame):
                self.reset[sid] = frame.error_code
            elif isinstance(frame, GoAwayFrame):
                self.goaway = True
            if "END_STREAM" in frame.flags and sid:
                self.ended.add(sid)
        self._buf = buf

    def finished(self, sid: int) -> bool:
        return sid in self.ended or sid in self.reset

    def messages(self, sid: int) -> list[bytes]:
        """The gRPC messages stream ``sid`` answered."""
        out, buf = [], bytes(self.data.get(sid, b""))
        while buf:
            _flag, length = struct.unpack(">BI", buf[:5])
            out.append(buf[5:5 + length])
            buf = buf[5 + length:]
        return out

    def close(self) -> None:
        self.writer.close()


def receive_request(group: str, topic: str, batch: int, poll_ms: int = 0) -> sv.ReceiveMessageRequest:
    req = sv.ReceiveMessageRequest(group=pb.Resource(name=group),
                                   message_queue=pb.MessageQueue(topic=pb.Resource(name=topic)),
                                   filter_expression=pb.FilterExpression(type=pb.TAG, expression="*"),
                                   batch_size=batch, auto_renew=False)
    req.invisible_duration.seconds = 300  # far beyond the test: only a release brings messages back
    req.long_polling_timeout.FromMilliseconds(poll_ms)
    return req


def answer_responses(path: str, messages: list[bytes]) -> list[sv.ReceiveMessageResponse]:
    if path == RECEIVE_BATCH:
        assert len(messages) <= 1
        messages = [bytes(m) for m in split_receive_batch(messages[0])] if messages else []
    return [sv.ReceiveMessageResponse.FromString(m) for m in messages]


async def start(tmp_path, mode: str):
    clock = ShiftedClock()
    config = BrokerConfig(data_dir=str(tmp_path / "data"), port=free_port(), grpc_server=mode,
                          answer_budget_per_connection=PER_CONNECTION, answer_budget_total=TOTAL,
                          answer_send_timeout_ms=TIMEOUT_MS).validate()
    broker = Broker(config, clock=clock)
    committer = GroupCommitter(broker)
    committer.start()
    pop, txns = open_consumers(broker, config)
    loops = ConsumerLoops(pop, txns, committer, broker.clock)  # the runtime's POP ticker and checks
    loops.start()
    front = GrpcFrontEnd(types.SimpleNamespace(config=config, broker=broker, committer=committer, pop=pop,
                                               txns=txns, loops=loops))
    await front.start()
    return front, clock


async def stop(front) -> None:
    await front.stop()
    front.runtime.loops.close()
    close_consumers(front.runtime.pop, front.runtime.txns)
    await front.runtime.committer.close()
    front.runtime.broker.close()


async def normal_receive(stub, group: str, topic: str, want: int) -> list:
    """Receive (with a normal client) until ``want`` messages came or a long poll finds none."""
    got = []
    while len(got) < want:
        call = stub.ReceiveMessage(receive_request(group, topic, 32, poll_ms=3000), timeout=10)
        responses = [r async for r in call]
        assert responses[0].status.code in (Code.OK, Code.MESSAGE_NOT_FOUND), responses[0].status
        batch = [r.message for r in responses if r.WhichOneof("content") == "message"]
        if not batch:
            break
        got += batch
    return got


async def attack(tmp_path, mode: str, path: str, expire: bool):
    front, clock = await start(tmp_path, mode)
    service, broker = front.service, front.runtime.broker
    topic, group = "budget-topic", "budget-group"
    for i in range(MESSAGES):
        broker.send_batch([OutgoingMessage(topic, bytes([i]) * BODY)])
    attacker = await RawClient.connect(front.config.port)
    try:
        # Long polls: a receive that finds the queue empty for a moment (messages another refused
        # receive released are on their way back) waits instead of answering "no message", so
        # each call ends held or refused.
        request = receive_request(group, topic, ATTACK_BATCH, poll_ms=30_000).SerializeToString()
        sids = [attacker.call(path, request) for _ in range(ATTACK_CALLS)]
        await attacker.writer.drain()
        # Every call has been answered in the broker's eyes: held (its bytes wait on the window)
        # or refused (its status waits too). Nothing more is taken out of the queue.
        await attacker.read_until(lambda: service.answers.refused + len(service.answers) >= ATTACK_CALLS)
        held_bytes = service.answers.held
        assert 0 < held_bytes <= PER_CONNECTION
        assert service.answers.by_peer and max(service.answers.by_peer.values()) <= PER_CONNECTION
        assert broker.refusals.counts[refusals.ANSWER_BUDGET] >= ATTACK_CALLS - len(service.answers)
        held_messages = sum(len(h.popped) for h in service.answers._open.values())
        assert held_messages < MESSAGES // 2

        async with grpc.aio.insecure_channel(front.config.endpoint) as channel:
            stub = service_pb2_grpc.MessagingServiceStub(channel)
            # A normal client is served during the attack: it sends, and it receives every
            # message the attacker's answers do not hold, at once (not after their invisible time).
            sent = pb.Message(topic=pb.Resource(name="other-topic"), body=b"hello",
                              system_properties=pb.SystemProperties(message_id="01" + "A" * 32,
                                                                    message_type=pb.NORMAL))
            answer = await stub.SendMessage(sv.SendMessageRequest(messages=[sent]), timeout=10)
            assert answer.status.code == Code.OK
            others = await normal_receive(stub, group, topic, MESSAGES - held_messages)
            assert len(others) == MESSAGES - held_messages
            assert not await normal_receive(stub, group, topic, 0 + 1)  # nothing else is visible

            if expire:
                # The attacker never opens its window: past the send timeout its answers' calls
                # end and their messages come back at once (their invisible time is 300 s).
                clock.shift_ns += TIMEOUT_MS * 1_000_000
                waiting = len(service.answers)
                assert service.expire_answers() == waiting > 0 and len(service.answers) == 0
                if mode == "chronoq":  # its streams are reset: the bytes are dropped
                    assert service.answers.held == 0 and not service.answers.by_peer
                else:  # grpcio's core keeps them until the peer reads or goes: still counted
                    assert service.answers.held == held_bytes
                back = await normal_receive(stub, group, topic, held_messages)
                assert len(back) == held_messages
                assert {m.system_properties.message_id for m in back}.isdisjoint(
                    m.system_properties.message_id for m in others)
                if mode == "chronoq":  # their streams were reset (the refused calls' few status
                    # bytes still wait on the window; the stream limits bound those)
                    await attacker.read_until(lambda: sum(map(attacker.finished, sids)) >= waiting)
                    assert set(attacker.reset.values()) == {0x8}  # CANCEL
                return
        # The attacker opens its window: it gets the answers held for it, and the refusals.
        attacker.open_window()
        await attacker.read_until(lambda: all(attacker.finished(s) for s in sids))
        codes = []
        for sid in sids:
            responses = answer_responses(path, attacker.messages(sid))
            assert responses, f"stream {sid} answered nothing ({attacker.trailers.get(sid)}, {attacker.reset.get(sid)})"
            codes.append(responses[0].status.code)
        refused = [c for c in codes if c == Code.TOO_MANY_REQUESTS]
        assert len(refused) == service.answers.refused and refused
        assert codes.count(Code.OK) == ATTACK_CALLS - len(refused)
        assert service.answers.held == 0 and not service.answers.by_peer  # all taken: all returned
    finally:
        attacker.close()
        await stop(front)


@pytest.mark.parametrize("mode", ["chronoq", "grpcio"])
@pytest.mark.parametrize("path", [RECEIVE, RECEIVE_BATCH])
def test_a_client_that_reads_nothing_holds_no_more_than_its_budget(tmp_path, mode, path):
    asyncio.run(attack(tmp_path, mode, path, expire=False))


@pytest.mark.parametrize("mode", ["chronoq", "grpcio"])
@pytest.mark.parametrize("path", [RECEIVE, RECEIVE_BATCH])
def test_answers_not_taken_in_time_end_and_their_messages_come_back_at_once(tmp_path, mode, path):
    asyncio.run(attack(tmp_path, mode, path, expire=True))
