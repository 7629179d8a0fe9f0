"""HTTP/2 frames (RFC 9113 §4 and §6): their constants, and frames to bytes and back.

Sans-IO: functions of bytes and numbers, no sockets, no event loop, no clock. Both ends of
chronoq's HTTP/2 use them: the server (``chronoq.server.h2server``) and the client's transport
(``chronoq.client.h2channel``).

A frame on the wire is a 9-byte header and a payload::

    offset 0  length     24 bits, big-endian (read as 16 + 8: ``FRAME_HEAD``)
    offset 3  type        8 bits (DATA .. CONTINUATION below; unknown types are ignored)
    offset 4  flags       8 bits
    offset 5  stream id  31 bits (the top bit is reserved: ignored on reading, 0 on writing)

What a peer got wrong is a ``FrameError`` carrying the RFC's error code for its GOAWAY; each end
decides what to do with it (the server counts it and closes with GOAWAY, the client gives up the
connection).
"""

from __future__ import annotations

import struct

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

# Frame types (RFC 9113 §6)
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
# Flags (END_STREAM and ACK share a bit: they belong to different frame types)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
# Error codes (RFC 9113 §7)
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR, STREAM_CLOSED = 0, 1, 2, 3, 5
FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 6, 7, 8, 9
ENHANCE_YOUR_CALM = 11

_COMPILED = not __file__.endswith(".py")
FRAME_HEAD = struct.Struct(">HBBBI")   # length hi 16, length lo 8, type, flags, stream id
FRAME_HEAD_SIZE = 9
U32 = struct.Struct(">I")
assert FRAME_HEAD.size == FRAME_HEAD_SIZE and U32.size == 4
STREAM_ID_MASK = 0x7FFFFFFF
MAX_FRAME_LENGTH = (1 << 24) - 1       # what the 24-bit length can say
PRIORITY_FIELDS = 5                     # HEADERS with PRIORITY_FLAG: dependency (4) and weight (1)
HEADERS_EXTRAS = PADDED | PRIORITY_FLAG  # a HEADERS frame whose payload is more than its fragment
GOAWAY_DEBUG_MAX = 256                  # bytes of debug data we send in a GOAWAY


class FrameError(ValueError):
    """The peer broke the protocol: a connection error whose GOAWAY carries ``code``."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------- to bytes
def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame: header and payload (``payload`` at most the peer's SETTINGS_MAX_FRAME_SIZE)."""
    n = len(payload)
    return FRAME_HEAD.pack(n >> 8, n & 0xFF, kind, flags, stream_id) + payload


def frame_head(kind: int, flags: int, stream_id: int, length: int) -> bytes:
    """A frame's 9-byte header alone, for a payload sent in pieces after it."""
    return FRAME_HEAD.pack(length >> 8, length & 0xFF, kind, flags, stream_id)


def headers_frame(stream_id: int, block: bytes, end_stream: bool) -> bytes:
    """A whole header block in one HEADERS frame (the caller's blocks fit one frame)."""
    return frame(HEADERS, END_HEADERS | (END_STREAM if end_stream else 0), stream_id, block)


def rst_stream_frame(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, U32.pack(code))


def window_update_frame(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, U32.pack(increment))


def goaway_frame(last_stream: int, code: int, debug: str = "") -> bytes:
    """GOAWAY; its debug data (at most ``GOAWAY_DEBUG_MAX`` bytes) says why."""
    return frame(GOAWAY, 0, 0, U32.pack(last_stream) + U32.pack(code)
                 + debug.encode("utf-8", "replace")[:GOAWAY_DEBUG_MAX])


def data_frames(stream_id: int, data: bytes, room: int, max_frame: int, end_flags: int = 0) -> tuple[list[bytes], int]:
    """DATA frames for as much of ``data`` as ``room`` (the smaller of the stream's and the
    connection's send windows) allows, none longer than ``max_frame``: (frames, bytes taken).
    ``end_flags`` (END_STREAM) goes on the frame that takes the last byte of ``data``."""
    n = len(data)
    if n <= room and n <= max_frame:  # all of it in one frame: a gRPC call's request or answer, as a rule
        return [frame(DATA, end_flags, stream_id, data)] if n else [], n
    frames = []
    taken = 0
    while taken < n and room > 0:
        size = min(room, max_frame, n - taken)
        end = taken + size
        frames.append(frame(DATA, end_flags if end == n else 0, stream_id, data[taken:end]))
        taken, room = end, room - size
    return frames, taken


# ---------------------------------------------------------------------- from bytes
def read_frames(buf, max_length: int, handle) -> tuple[int, int]:
    """Hand the complete frames at the start of ``buf``, in order, to ``handle(type, flags, stream
    id, payload)`` until it returns True (the connection ended: the rest is not read). Returns
    ``(end, too_long)``: ``end`` is the offset just past the last frame handled; ``too_long`` is the
    length the next frame's header announces when it is over ``max_length`` (0 otherwise), for the
    caller to fail the connection (FRAME_SIZE_ERROR) without waiting for its bytes. (A callback,
    not a list of frames: this runs for every frame a connection reads.)"""
    unpack = FRAME_HEAD.unpack_from
    pos, n = 0, len(buf)
    while n - pos >= 9:
        hi, lo, kind, flags, stream_id = unpack(buf, pos)
        length = hi << 8 | lo
        if length > max_length:
            return pos, length
        if n - pos - 9 < length:
            break
        # (compiled, a bytearray's payload is copied once, straight into bytes: frames.pxd's
        # ``_payload``; a slice of it is a bytearray that bytes() copies again)
        payload = _payload(buf, pos + 9, length) if _COMPILED else bytes(buf[pos + 9:pos + 9 + length])  # noqa: F821
        pos += 9 + length
        if handle(kind, flags, stream_id & STREAM_ID_MASK, payload):
            break
    return pos, 0


def unpad(payload: bytes) -> bytes:
    """A PADDED DATA frame's data: the pad length byte and the padding off."""
    length = len(payload)
    if not payload or payload[0] >= length:
        raise FrameError(PROTOCOL_ERROR, "bad DATA padding")
    return payload[1:length - payload[0]]


def header_fragment(flags: int, payload: bytes) -> bytes:
    """A HEADERS frame's header block fragment: padding and priority fields off. (Callers skip the
    call when ``flags & HEADERS_EXTRAS`` is 0, as for every HEADERS a gRPC client sends.)"""
    pos, end = 0, len(payload)
    if flags & PADDED:
        if not payload:
            raise FrameError(PROTOCOL_ERROR, "padding length missing")
        end -= payload[0]
        pos = 1
    if flags & PRIORITY_FLAG:
        pos += PRIORITY_FIELDS
    if pos > end:
        raise FrameError(PROTOCOL_ERROR, "padding longer than the frame")
    return payload[pos:end]


def window_increment(payload: bytes) -> int:
    """A WINDOW_UPDATE's increment (the reserved bit off); 0 is the caller's to judge."""
    if len(payload) != 4:
        raise FrameError(FRAME_SIZE_ERROR, "WINDOW_UPDATE length")
    return U32.unpack(payload)[0] & STREAM_ID_MASK


def parse_goaway(payload: bytes) -> tuple[int, int, bytes]:
    """A GOAWAY's (last stream id, error code, debug data); a short one reads as (0, PROTOCOL_ERROR, b"")."""
    if len(payload) < 8:
        return 0, PROTOCOL_ERROR, b""
    return U32.unpack_from(payload, 0)[0] & STREAM_ID_MASK, U32.unpack_from(payload, 4)[0], payload[8:]
