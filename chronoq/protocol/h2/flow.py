"""HTTP/2 flow control (RFC 9113 §6.9) for one connection, one end's view. Sans-IO: numbers in,
numbers and WINDOW_UPDATE frames out.

Two directions, two kinds of counter:

- what the peer lets us send: the connection's ``peer_window`` and each stream's ``send_window``
  (a stream starts at the peer's ``peer_initial_window``, which SETTINGS may move for every open
  stream at once); a DATA frame spends both, WINDOW_UPDATE grows one;
- what the peer sent us since we last granted more: ``recv_unacked``, on the connection and on
  each stream; once half of our window is used we grant it back (``grant_*``: a WINDOW_UPDATE),
  unless the caller decides to hold the peer back (a handler that does not read, too many bytes
  held), which is the caller's policy, not this module's.

The one owner of these counters for chronoq's HTTP/2 server (``chronoq.server.h2server`` and
``h2streams``) and its client transport (``chronoq.client.h2channel``): their connection classes
inherit ``ConnectionWindows``, their stream classes ``StreamWindows``, so the counters are plain
attributes of the objects the hot paths already hold.
"""

from __future__ import annotations

from chronoq.protocol.h2.frames import (FLOW_CONTROL_ERROR, PROTOCOL_ERROR, FrameError, data_frames,
                                        window_update_frame)
from chronoq.protocol.h2.settings import DEFAULT_WINDOW, MAX_WINDOW


class StreamWindows:
    """A stream's counters: ``send_window`` (bytes we may still send on it) and ``recv_unacked``
    (bytes it sent us since our last WINDOW_UPDATE for it)."""

    __slots__ = ("send_window", "recv_unacked")

    def __init__(self, send_window: int) -> None:
        self.send_window = send_window
        self.recv_unacked = 0


class ConnectionWindows:
    """A connection's counters and the rules that move them; ``our_conn_window`` and
    ``our_stream_window`` are the receive windows this end announces (the stream one in its
    SETTINGS, the connection one with ``opening_update``)."""

    def __init__(self, our_conn_window: int, our_stream_window: int) -> None:
        assert DEFAULT_WINDOW <= our_conn_window <= MAX_WINDOW and 0 < our_stream_window <= MAX_WINDOW
        self.peer_window = DEFAULT_WINDOW         # what we may still send on the connection
        self.peer_initial_window = DEFAULT_WINDOW  # a new stream's send window
        self.recv_unacked = 0                     # what the peer sent since our last connection grant
        self._our_conn_window = our_conn_window
        self._conn_half = our_conn_window // 2
        self._stream_half = our_stream_window // 2

    def opening_update(self) -> bytes:
        """The WINDOW_UPDATE that takes the connection's receive window from the protocol's
        default to ours (sent once, with our first SETTINGS)."""
        return window_update_frame(0, self._our_conn_window - DEFAULT_WINDOW)

    # ------------------------------------------------------------------ what we send
    def room(self, stream: StreamWindows) -> int:
        """Bytes of DATA ``stream`` may send now (may be <= 0)."""
        return min(stream.send_window, self.peer_window)

    def spend(self, stream: StreamWindows, n: int) -> None:
        """``n`` bytes of DATA left on ``stream`` (within ``room``)."""
        stream.send_window -= n
        self.peer_window -= n

    def data_out(self, stream_id: int, stream: StreamWindows, data: bytes, max_frame: int,
                 end_flags: int = 0) -> tuple[list[bytes], int]:
        """DATA frames for as much of ``data`` as the windows allow (``frames.data_frames``), the
        bytes taken spent: (frames, bytes taken)."""
        frames, taken = data_frames(stream_id, data, min(stream.send_window, self.peer_window), max_frame, end_flags)
        stream.send_window -= taken
        self.peer_window -= taken
        return frames, taken

    def peer_settings_window(self, value: int, streams) -> int:
        """The peer's SETTINGS_INITIAL_WINDOW_SIZE (already checked against 2^31-1): every open
        stream's send window moves by the change (§6.9.2). Returns the change (> 0: windows grew)."""
        delta = value - self.peer_initial_window
        self.peer_initial_window = value
        if delta:
            for stream in streams:
                stream.send_window += delta
        return delta

    def connection_update(self, increment: int) -> None:
        """A WINDOW_UPDATE on stream 0. ``FrameError`` (a connection error) on an increment of 0 or
        a window past 2^31-1."""
        if not increment:
            raise FrameError(PROTOCOL_ERROR, "WINDOW_UPDATE of 0")
        self.peer_window += increment
        if self.peer_window > MAX_WINDOW:
            raise FrameError(FLOW_CONTROL_ERROR, "connection window over 2^31-1")

    @staticmethod
    def stream_update(stream: StreamWindows, increment: int) -> int:
        """A WINDOW_UPDATE on ``stream``: 0, or the error code to reset the stream with (an
        increment of 0, a window past 2^31-1)."""
        if not increment:
            return PROTOCOL_ERROR
        stream.send_window += increment
        return FLOW_CONTROL_ERROR if stream.send_window > MAX_WINDOW else 0

    # ------------------------------------------------------------------ what we receive
    def received(self, n: int) -> bool:
        """``n`` bytes of a DATA frame (padding included) came in on the connection; True when a
        connection grant is due (``grant_connection``)."""
        self.recv_unacked += n
        return self.recv_unacked >= self._conn_half

    def stream_received(self, stream: StreamWindows, n: int) -> bool:
        """``n`` bytes of a DATA frame came in on ``stream``; True when its grant is due."""
        stream.recv_unacked += n
        return stream.recv_unacked >= self._stream_half

    def data_in(self, stream_id: int, stream: StreamWindows | None, n: int) -> bytes:
        """``n`` bytes of a DATA frame came in on ``stream`` (None: one no longer open): the
        WINDOW_UPDATEs now due, connection and stream (usually nothing). For an end that grants
        whenever half a window is used, as a client does."""
        self.recv_unacked += n
        out = b""
        if self.recv_unacked >= self._conn_half:
            out = window_update_frame(0, self.recv_unacked)
            self.recv_unacked = 0
        if stream is not None:
            stream.recv_unacked += n
            if stream.recv_unacked >= self._stream_half:
                out += window_update_frame(stream_id, stream.recv_unacked)
                stream.recv_unacked = 0
        return out

    def grant_connection(self) -> bytes:
        """The connection's WINDOW_UPDATE once half of our window is used (else nothing)."""
        n = self.recv_unacked
        if n < self._conn_half:
            return b""
        self.recv_unacked = 0
        return window_update_frame(0, n)

    def grant_stream(self, stream_id: int, stream: StreamWindows) -> bytes:
        """The stream's WINDOW_UPDATE once half of our window is used (else nothing)."""
        n = stream.recv_unacked
        if n < self._stream_half:
            return b""
        stream.recv_unacked = 0
        return window_update_frame(stream_id, n)
