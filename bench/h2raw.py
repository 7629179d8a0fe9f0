"""A raw HTTP/2 client for hostile tests: frames built one by one, nothing checked on our side.

``bench/hostile.py`` drives attacks with it, and tests may import it (``from bench.h2raw import
Conn``) to send frames no well-behaved client would. Frames are built with ``hyperframe`` and header
blocks with ``hpack``; what the server sends back is scanned by a small loop of our own (a flood's
acks run to millions of frames: only their types are counted, and the few frames that tell how the
server reacted are kept: its SETTINGS, GOAWAY, RST_STREAM codes and the ``grpc-status`` of trailers).

    conn = Conn("127.0.0.1", port)
    conn.start()                                   # preface + SETTINGS, waits for the server's SETTINGS
    sid = conn.call("QueryRoute", request_bytes)   # HEADERS + one DATA with END_STREAM
    conn.read_until_closed(2.0)                    # frames until GOAWAY, EOF or the time limit
    conn.goaway_code, conn.rst_codes, conn.grpc_statuses, conn.closed

Every socket operation is bounded by a timeout; ``send`` reports a server that closed (or reset)
the connection instead of raising.
"""

from __future__ import annotations

import collections
import socket
import struct
import time

import hpack
from hyperframe.frame import (ContinuationFrame, DataFrame, ExtensionFrame, HeadersFrame, PingFrame,
                              RstStreamFrame, SettingsFrame, WindowUpdateFrame)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
SERVICE = "/apache.rocketmq.v2.MessagingService/"

# Frame types and the settings and error codes used here (RFC 9113 §6, §6.5.2, §7)
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0, 1, 3, 4, 6, 7, 8, 9
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_MAX_CONCURRENT_STREAMS, SETTINGS_INITIAL_WINDOW_SIZE = 1, 3, 4
ERROR_NAMES = {0: "NO_ERROR", 1: "PROTOCOL_ERROR", 2: "INTERNAL_ERROR", 3: "FLOW_CONTROL_ERROR",
               4: "SETTINGS_TIMEOUT", 5: "STREAM_CLOSED", 6: "FRAME_SIZE_ERROR", 7: "REFUSED_STREAM",
               8: "CANCEL", 9: "COMPRESSION_ERROR", 10: "CONNECT_ERROR", 11: "ENHANCE_YOUR_CALM",
               12: "INADEQUATE_SECURITY", 13: "HTTP_1_1_REQUIRED"}

_HEAD = struct.Struct(">HBBBI")  # length (24 bits as 16 + 8), type, flags, stream id


def error_name(code: int | None) -> str | None:
    return None if code is None else ERROR_NAMES.get(code, str(code))


# ----------------------------------------------------------------------------- frames
def settings(values: dict[int, int] | None = None, ack: bool = False) -> bytes:
    return SettingsFrame(0, settings=values or {}, flags=["ACK"] if ack else []).serialize()


def headers(stream_id: int, block: bytes, end_stream: bool = False, end_headers: bool = True) -> bytes:
    flags = (["END_STREAM"] if end_stream else []) + (["END_HEADERS"] if end_headers else [])
    return HeadersFrame(stream_id, data=block, flags=flags).serialize()


def continuation(stream_id: int, block: bytes = b"", end_headers: bool = False) -> bytes:
    return ContinuationFrame(stream_id, data=block, flags=["END_HEADERS"] if end_headers else []).serialize()


def header_frames(stream_id: int, block: bytes, end_stream: bool = False, max_frame: int = 16_384) -> bytes:
    """A header block of any size: HEADERS, then CONTINUATION frames of ``max_frame`` bytes."""
    parts = [block[i:i + max_frame] for i in range(0, len(block), max_frame)] or [b""]
    out = [headers(stream_id, parts[0], end_stream, end_headers=len(parts) == 1)]
    out += [continuation(stream_id, p, end_headers=i == len(parts) - 1) for i, p in enumerate(parts[1:], 1)]
    return b"".join(out)


def data(stream_id: int, payload: bytes = b"", end_stream: bool = False) -> bytes:
    return DataFrame(stream_id, data=payload, flags=["END_STREAM"] if end_stream else []).serialize()


def rst_stream(stream_id: int, code: int = 8) -> bytes:  # CANCEL
    return RstStreamFrame(stream_id, error_code=code).serialize()


def window_update(stream_id: int, increment: int) -> bytes:
    """Any increment, 0 included (a protocol error the server must answer)."""
    return WindowUpdateFrame(stream_id, window_increment=increment).serialize()


def ping(payload: bytes = b"\0" * 8, ack: bool = False) -> bytes:
    return PingFrame(0, opaque_data=payload, flags=["ACK"] if ack else []).serialize()


def unknown(kind: int = 0x20, stream_id: int = 0, body: bytes = b"") -> bytes:
    """A frame of a type RFC 9113 does not define (receivers must ignore it)."""
    return ExtensionFrame(kind, stream_id, flag_byte=0, body=body).serialize()


def literal(name: bytes, value: bytes, index: bool = False) -> bytes:
    """One HPACK field as a literal with a new name (RFC 7541 §6.2.1, §6.2.2), plain (not Huffman):
    without indexing, or added to the dynamic table (``index``). Blocks built of these alone leave
    the table as it was, whatever the connection's encoder did before."""
    return bytes([0x40 if index else 0x00]) + _hpack_string(name) + _hpack_string(value)


def _hpack_string(raw: bytes) -> bytes:
    n = len(raw)  # length as a 7-bit prefix integer (RFC 7541 §5.1), Huffman bit clear
    if n < 127:
        return bytes([n]) + raw
    out, n = bytearray([127]), n - 127
    while n >= 128:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out) + raw


def grpc_message(body: bytes, announced: int | None = None) -> bytes:
    """gRPC's length-prefixed message (uncompressed); ``announced`` overrides the length field."""
    return struct.pack(">BI", 0, len(body) if announced is None else announced) + body


def grpc_headers(method: str, authority: str = "localhost", extra=()) -> list[tuple[str, str]]:
    """A gRPC request's header list for ``MessagingService/<method>`` (or a full ``/path``)."""
    path = method if method.startswith("/") else SERVICE + method
    return [(":method", "POST"), (":scheme", "http"), (":path", path), (":authority", authority),
            ("content-type", "application/grpc"), ("te", "trailers"),
            ("x-mq-client-id", "hostile@1@1@raw"), *extra]


# ----------------------------------------------------------------------------- connection
class Conn:
    """One raw HTTP/2 connection (plaintext, prior knowledge) and what the server answered on it."""

    def __init__(self, host: str, port: int, *, timeout: float = 5.0, rcvbuf: int | None = None) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if rcvbuf:  # a small receive buffer: the server's answers back up sooner when we never read
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        self.timeout = timeout
        self.sock.settimeout(timeout)
        self.sock.connect((host, port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.authority = f"{host}:{port}"
        self.encoder = hpack.Encoder()
        self._decoder = hpack.Decoder()
        self.next_stream = 1
        self.buf = bytearray()
        self.closed = False              # EOF or reset seen (reading or sending)
        self.send_blocked = False        # a send timed out: the server stopped reading us
        self.server_settings: dict[int, int] = {}
        self.goaway_code: int | None = None
        self.goaway_debug = b""
        self.rst_codes: collections.Counter = collections.Counter()
        self.grpc_statuses: collections.Counter = collections.Counter()
        self.ended: set[int] = set()     # streams the server reset or finished (trailers)
        self.frames_in: collections.Counter = collections.Counter()
        self.bytes_in = 0
        # Flow control for DATA sent with ``send_data``: what the server granted, what we used.
        self.conn_window = 65_535
        self.stream_granted: collections.Counter = collections.Counter()
        self.stream_sent: collections.Counter = collections.Counter()

    # ------------------------------------------------------------------ sending
    def send(self, payload: bytes) -> bool:
        """Send all of ``payload``; False when the server closed or reset the connection or stopped
        reading for longer than the socket timeout (``send_blocked``)."""
        if self.closed:
            return False
        try:
            self.sock.sendall(payload)
            return True
        except socket.timeout:
            self.send_blocked = True
            return False
        except OSError:  # EPIPE, ECONNRESET
            self.closed = True
            return False

    def start(self, values: dict[int, int] | None = None, wait_s: float = 2.0) -> bool:
        """Preface and our SETTINGS (``values``), then read until the server's SETTINGS arrive (and
        acknowledge them). False if the server closed first."""
        self.send(PREFACE + settings(values))
        deadline = time.monotonic() + wait_s
        while not self.server_settings and not self.closed and time.monotonic() < deadline:
            self.poll(deadline - time.monotonic())
        return self.send(settings(ack=True)) and bool(self.server_settings)

    def window(self, stream_id: int) -> int:
        """The bytes of DATA the server's windows allow on ``stream_id`` now (``poll`` reads its
        WINDOW_UPDATEs)."""
        initial = self.server_settings.get(SETTINGS_INITIAL_WINDOW_SIZE, 65_535)
        return min(self.conn_window, initial + self.stream_granted[stream_id] - self.stream_sent[stream_id])

    def send_data(self, stream_id: int, payload: bytes, end_stream: bool = False) -> bool:
        """One DATA frame, counted against the windows (not checked: see ``window``)."""
        self.conn_window -= len(payload)
        self.stream_sent[stream_id] += len(payload)
        return self.send(data(stream_id, payload, end_stream))

    def stream_id(self) -> int:
        sid, self.next_stream = self.next_stream, self.next_stream + 2
        return sid

    def block(self, fields) -> bytes:
        """HPACK-encode ``fields`` with this connection's encoder (blocks must go out in order)."""
        return self.encoder.encode(fields)

    def call(self, method: str, request: bytes | None = None, *, end_stream: bool = True, extra=()) -> int:
        """Open a gRPC call: HEADERS, then (if ``request`` is not None) one length-prefixed message.
        ``end_stream=False`` leaves the request open. Returns the stream id."""
        sid = self.stream_id()
        frames = headers(sid, self.block(grpc_headers(method, self.authority, extra)),
                         end_stream=end_stream and request is None)
        if request is not None:
            frames += data(sid, grpc_message(request), end_stream=end_stream)
        self.send(frames)
        return sid

    # ------------------------------------------------------------------ reading
    def poll(self, timeout: float = 0.0, max_bytes: int = 1 << 20) -> int:
        """Read what arrives within ``timeout`` (at most ``max_bytes``) and scan its frames.
        Returns the bytes read; sets ``closed`` on EOF or reset."""
        if self.closed:
            return 0
        got = 0
        self.sock.settimeout(timeout if timeout > 0 else 0.0)
        try:
            while got < max_bytes:
                chunk = self.sock.recv(min(1 << 18, max_bytes - got))
                if not chunk:
                    self.closed = True
                    break
                got += len(chunk)
                self._scan(chunk)
                self.sock.settimeout(0.0)  # after the first read: only what is already there
        except (BlockingIOError, socket.timeout):
            pass
        except OSError:
            self.closed = True
        finally:
            if not self.closed:
                self.sock.settimeout(self.timeout)
        self.bytes_in += got
        return got

    def read_until_closed(self, seconds: float, max_bytes: int = 512 << 20) -> bool:
        """Read (and scan) until GOAWAY, EOF or ``seconds``; True if the server closed the
        connection or sent GOAWAY."""
        deadline = time.monotonic() + seconds
        total = 0
        while not self.closed and self.goaway_code is None and total < max_bytes:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            total += self.poll(min(left, 0.2))
        return self.closed or self.goaway_code is not None

    def peer_closed(self) -> bool:
        """The server closed or reset the connection, by TCP's state (CLOSE_WAIT once its FIN is in,
        even with unread frames before it): a flood's unread acks need not be read to know."""
        if self.closed:
            return True
        try:
            state = self.sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        except OSError:
            return True
        return state in (7, 8)  # TCP_CLOSE, TCP_CLOSE_WAIT (linux/tcp_states.h)

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass

    def _scan(self, chunk: bytes) -> None:
        buf = self.buf
        buf += chunk
        pos, n = 0, len(buf)
        while n - pos >= 9:
            hi, lo, kind, flags, sid = _HEAD.unpack_from(buf, pos)
            length = hi << 8 | lo
            if n - pos - 9 < length:
                break
            self.frames_in[kind] += 1
            if kind in (SETTINGS, GOAWAY, RST_STREAM, HEADERS, WINDOW_UPDATE):
                self._frame(kind, flags, sid & 0x7FFFFFFF, bytes(buf[pos + 9:pos + 9 + length]))
            pos += 9 + length
        del buf[:pos]

    def _frame(self, kind: int, flags: int, sid: int, payload: bytes) -> None:
        if kind == SETTINGS and not flags & 1:
            for i in range(0, len(payload) - 5, 6):
                key, value = struct.unpack_from(">HI", payload, i)
                self.server_settings[key] = value
        elif kind == GOAWAY and len(payload) >= 8:
            if self.goaway_code is None or self.goaway_code == 0:  # the first error code counts
                self.goaway_code = struct.unpack_from(">I", payload, 4)[0]
            self.goaway_debug = payload[8:]
        elif kind == WINDOW_UPDATE and len(payload) == 4:
            increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if sid:
                self.stream_granted[sid] += increment
            else:
                self.conn_window += increment
        elif kind == RST_STREAM and len(payload) == 4:
            self.ended.add(sid)
            self.rst_codes[error_name(struct.unpack(">I", payload)[0])] += 1
        elif kind == HEADERS and flags & 0x4:  # our server sends whole blocks, no padding or priority
            if flags & 0x1:
                self.ended.add(sid)
            try:
                fields = self._decoder.decode(payload)
            except Exception:  # noqa: BLE001 - a block we cannot read tells nothing more
                return
            for name, value in fields:
                if name == "grpc-status":
                    self.grpc_statuses[value] += 1
