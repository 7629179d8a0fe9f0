"""chronoq's HTTP/2 gRPC server (chronoq.server.h2server) in process, on a recording transport:
calls answered within the read that completes them, resumed by their future without a task,
cancelled at every point of that path, frames cut anywhere across reads, and the answer bytes
held for peers that do not read (the rest: test_h2server.py).
"""

import asyncio
import struct

import pytest
from h2echokit import SERVICE, Echo, Tagging, _frame, _frames

from chronoq.protocol import h2
from chronoq.server import h2calls, h2grpc, h2server


# ---------------------------------------------------------------------------------- eager calls
class _Transport:
    """What a connection writes, kept (the calls below feed it bytes by hand, in one loop pass)."""

    def __init__(self) -> None:
        self.out = bytearray()
        self.writes = 0
        self.buffered = 0  # what a paused transport holds (set by hand)

    def write(self, data: bytes) -> None:
        self.out += data
        self.writes += 1

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_extra_info(self, key, default=None):
        return ("127.0.0.1", 1) if key == "peername" else default

    def close(self) -> None:
        pass

    def can_write_eof(self) -> bool:  # (as TLS: a failed connection is closed at once)
        return False

    def is_closing(self) -> bool:
        return False


_UNARY_BLOCK = h2.literal_block([(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/Unary"),
                                       (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])


def _request(sid: int, body: bytes, *, split: bool = False):
    """A unary call's frames: one piece, or (HEADERS, DATA) when ``split``."""
    head = _frame(h2.HEADERS, 0x4, sid, _UNARY_BLOCK)
    data = _frame(h2.DATA, 0x1, sid, struct.pack(">BI", 0, len(body)) + body)
    return (head, data) if split else head + data


def _answers(out: bytes) -> dict:
    """stream id -> (answer messages' bytes, ended with trailers)"""
    got: dict = {}
    for kind, flags, sid, payload in _frames(bytes(out)):
        if kind == h2.DATA:
            got.setdefault(sid, [b"", False])[0] += payload[5:]
        elif kind == h2.HEADERS and flags & 0x1:
            got.setdefault(sid, [b"", False])[1] = True
    return {sid: tuple(v) for sid, v in got.items()}


def _in_process(test):
    async def main():
        echo, gate = Echo(), Tagging()
        server = h2grpc.Server(interceptors=[gate])
        server.add_generic_rpc_handlers((echo.handlers(),))
        conn = h2server.Connection(server)
        transport = _Transport()
        conn.connection_made(transport)
        conn.data_received(h2.PREFACE + _frame(h2.SETTINGS, 0, 0))
        transport.out.clear()  # our SETTINGS and their acknowledgement
        transport.writes = 0
        await test(server, conn, transport, echo)

    asyncio.run(main())


def test_a_call_that_never_waits_is_answered_within_the_read_that_completes_it():
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"one") + _request(3, b"two"))
        assert not server._calls  # no task: both ran to their end inside data_received
        # ...and their answers left with it, in one write, without waiting for a loop pass
        assert _answers(transport.out) == {1: (b"one", True), 3: (b"two", True)}
        assert transport.writes == 1

    _in_process(test)


def test_a_call_whose_request_comes_in_a_later_read_goes_on_in_a_task():
    async def test(server, conn, transport, echo):
        head, data = _request(1, b"later", split=True)
        conn.data_received(head)
        assert len(server._calls) == 1  # waiting for its DATA
        conn.data_received(data)
        for _ in range(5):
            await asyncio.sleep(0)
        conn._flush_out()
        assert _answers(transport.out) == {1: (b"later", True)}
        assert not server._calls

    _in_process(test)


def test_a_call_reset_before_its_task_first_runs_still_sees_its_cancellation():
    # The handler ran up to its first wait inside data_received; the client's RST_STREAM comes in
    # the next read, before the task that goes on with it has taken a step. The handler must get
    # the CancelledError there (its clean-up runs), and no answer goes out.
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"sleep"))
        (task,) = server._calls
        conn.data_received(_frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert task.cancelled() and echo.cancelled.is_set()
        conn._flush_out()
        assert 1 not in _answers(transport.out)
        conn.data_received(_request(3, b"next"))  # the connection goes on
        conn._flush_out()
        assert _answers(transport.out)[3] == (b"next", True)

    _in_process(test)


def test_a_call_that_waits_once_is_resumed_by_its_future_without_a_task():
    # A sync send waits once (its group commit): its future's done-callback goes on with it.
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"nap") + _request(3, b"nap-fail"))
        calls = list(server._calls)
        assert len(calls) == 2 and not any(isinstance(c, asyncio.Task) for c in calls)
        assert conn.streams[1].task in calls and not calls[0].done()
        for _ in range(50):
            if not server._calls:
                break
            await asyncio.sleep(0.002)
        assert not server._calls and all(c.done() and not c.cancelled() for c in calls)
        conn._flush_out()
        # (3 failed after its wait: trailers only, its status UNKNOWN)
        assert _answers(transport.out) == {1: (b"nap", True), 3: (b"", True)}

    _in_process(test)


def test_a_call_that_waits_twice_goes_on_in_a_task_that_can_be_cancelled():
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"twice"))
        (first,) = server._calls
        assert not isinstance(first, asyncio.Task)
        while first in server._calls:  # its first wait ends; the second goes on in a task
            await asyncio.sleep(0.002)
        (task,) = server._calls
        assert isinstance(task, asyncio.Task) and conn.streams[1].task is task and first.done()
        conn.data_received(_frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert task.cancelled() and echo.cancelled.is_set() and not server._calls
        assert conn.lingering == 0  # the reset's done-callback ran
        conn._flush_out()
        assert 1 not in _answers(transport.out)

    _in_process(test)


def test_a_call_reset_after_its_future_is_done_but_before_it_resumed_is_cancelled():
    # The future it waits on is done (its wake-up scheduled) when the RST_STREAM comes: as with a
    # task, the call must see the cancellation where it waits, not answer.
    async def test(server, conn, transport, echo):
        echo.gate = asyncio.get_running_loop().create_future()
        conn.data_received(_request(1, b"gate"))
        (call,) = server._calls
        echo.gate.set_result(None)
        conn.data_received(_frame(h2.RST_STREAM, 0, 1, struct.pack(">I", h2.CANCEL)))
        for _ in range(5):
            await asyncio.sleep(0)
        assert call.cancelled() and echo.cancelled.is_set() and not server._calls
        assert conn.lingering == 0
        conn._flush_out()
        assert 1 not in _answers(transport.out)

    _in_process(test)


def test_stop_waits_for_a_call_resumed_by_its_future():
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"nap"))
        (call,) = server._calls
        await server.stop(5.0)
        assert call.done() and not call.cancelled()

    _in_process(test)


def test_a_reset_from_outside_a_read_over_the_reset_budget_ends_the_connection_cleanly():
    # Context.reset (the answer budget's timeout, from the POP ticker) spends the connection's
    # reset budget; over it, the connection must end with GOAWAY, not raise into the caller.
    async def test(server, conn, transport, echo):
        conn.data_received(_request(1, b"sleep"))
        stream = conn.streams[1]
        while conn.resets.take():  # the budget spent by earlier resets
            pass
        h2calls.Context(stream, (), None, conn.loop).reset()  # must not raise
        assert conn.closed and stream.cancelled
        goaways = [(payload[4:8], payload[8:]) for kind, _f, _s, payload in _frames(bytes(transport.out))
                   if kind == h2.GOAWAY]
        assert goaways and goaways[0][0] == struct.pack(">I", h2.ENHANCE_YOUR_CALM), goaways
        assert b"reset by the server over the budget" in goaways[0][1]

    _in_process(test)


@pytest.mark.parametrize("cut", [1, 7, 9, 10, 33, 1000])
def test_frames_cut_anywhere_across_reads_and_continued_header_blocks_are_read_whole(cut):
    """A read's frames are read from its bytes; only a frame it cuts in two is held for the next
    read. A header block may go on in CONTINUATION frames."""
    async def test(server, conn, transport, echo):
        continued = (_frame(h2.HEADERS, 0, 5, _UNARY_BLOCK[:4]) + _frame(h2.CONTINUATION, 0, 5, _UNARY_BLOCK[4:9])
                     + _frame(h2.CONTINUATION, 0x4, 5, _UNARY_BLOCK[9:])
                     + _frame(h2.DATA, 0x1, 5, struct.pack(">BI", 0, 4) + b"cont"))
        wire = _request(1, b"one") + _request(3, b"x" * 300) + continued + _request(7, b"last")
        for start in range(0, len(wire), cut):
            conn.data_received(wire[start:start + cut])
        for _ in range(5):
            await asyncio.sleep(0)
        conn._flush_out()
        assert _answers(transport.out) == {1: (b"one", True), 3: (b"x" * 300, True), 5: (b"cont", True),
                                           7: (b"last", True)}
        assert not conn.closed and not conn.buf

    _in_process(test)


# ---------------------------------------------------------------------------------- answers held for the peer
_BIDI_BLOCK = h2.literal_block([(":method", "POST"), (":scheme", "http"), (":path", f"/{SERVICE}/Bidi"),
                                (":authority", "x"), ("content-type", "application/grpc"), ("te", "trailers")])
_WINDOWS_OF_0 = _frame(h2.SETTINGS, 0, 0, struct.pack(">HI", 0x4, 0))  # SETTINGS_INITIAL_WINDOW_SIZE = 0


def _blocked(conn) -> int:
    """The answer bytes waiting on ``conn``'s peer, summed the slow way (what ``held_answers`` keeps)."""
    return sum(len(item) for stream in conn.waiting.values() for item in stream.blocked)


def test_answer_bytes_held_for_peers_go_back_to_0_when_their_connections_drop():
    """Connections whose peers announce windows of 0 hold their answers; the server's total
    (``h2limits.UnreadAnswers``) follows each byte as it starts waiting, leaves or is dropped,
    and connections lost abruptly while holding take all of theirs off it: answers waiting, a
    failed call's answer left waiting behind it, and a paused transport's buffer."""
    async def main():
        server = h2grpc.Server()
        server.add_generic_rpc_handlers((Echo().handlers(),))
        total = server.unread_answers
        conns = []
        for _ in range(2):
            conn = h2server.Connection(server)
            conn.connection_made(_Transport())
            conn.data_received(h2.PREFACE + _WINDOWS_OF_0)
            conns.append(conn)
        a, b = conns

        def settle() -> None:  # the kept counts against the slow sums, at every step
            for conn in conns:
                assert conn.held_answers == _blocked(conn)
            assert total.held == sum(conn.held_answers + conn.held_out for conn in conns)

        async def steps() -> None:
            for _ in range(5):
                await asyncio.sleep(0)

        a.data_received(_request(1, b"x" * 1000) + _request(3, b"y" * 2000))
        await steps()
        assert a.held_answers == 1005 + 2005
        settle()
        a.data_received(_frame(h2.WINDOW_UPDATE, 0, 1, struct.pack(">I", 400)))  # 400 bytes of one leave
        assert a.held_answers == 605 + 2005
        settle()
        a.transport.buffered = 90_000  # the transport passes its high-water mark, then drains
        a.pause_writing()
        assert a.held_out == 90_000 and total.held == 605 + 2005 + 90_000
        a.resume_writing()
        assert a.held_out == 0
        settle()

        # b: a streaming call whose answer waits, then fails on a request cut inside a message: its
        # trailers queue behind the answer, and it leaves ``streams`` while still ``waiting``.
        b.data_received(_frame(h2.HEADERS, 0x4, 1, _BIDI_BLOCK)
                        + _frame(h2.DATA, 0, 1, struct.pack(">BI", 0, 5) + b"hello"))
        await steps()
        assert b.held_answers == 10
        b.data_received(_frame(h2.DATA, 0x1, 1, struct.pack(">BI", 0, 10) + b"cut"))
        await steps()
        assert 1 in b.waiting and 1 not in b.streams and b.held_answers > 10
        b.transport.buffered = 70_000
        b.pause_writing()
        assert b.held_out == 70_000
        settle()
        assert total.held == 605 + 2005 + b.held_answers + 70_000

        a.connection_lost(ConnectionResetError())
        b.connection_lost(ConnectionResetError())
        await steps()
        assert total.held == 0
        assert [(c.held_answers, c.held_out, c.waiting) for c in conns] == [(0, 0, {}), (0, 0, {})]
        assert not server._calls  # the waiting handlers were cancelled with their connections

    asyncio.run(main())
