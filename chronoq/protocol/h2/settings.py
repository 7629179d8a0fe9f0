"""HTTP/2 SETTINGS (RFC 9113 §6.5) and the flow-control windows they set (§6.9). Sans-IO.

A SETTINGS payload is a run of 6-byte entries: identifier (16 bits) and value (32 bits),
big-endian (``SETTING``). ``parse_settings`` checks the values RFC 9113 §6.5.2 bounds and
returns the entries in order; what each end does with them (and with the ones it does not
use) is its own.
"""

from __future__ import annotations

import struct

from chronoq.protocol.h2.frames import (ACK, FLOW_CONTROL_ERROR, FRAME_SIZE_ERROR, MAX_FRAME_LENGTH, PROTOCOL_ERROR,
                                        SETTINGS, FrameError, frame)

S_HEADER_TABLE_SIZE, S_ENABLE_PUSH, S_MAX_CONCURRENT_STREAMS = 1, 2, 3
S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST_SIZE = 4, 5, 6

SETTING = struct.Struct(">HI")
assert SETTING.size == 6

DEFAULT_WINDOW = 65_535                 # every window until SETTINGS or WINDOW_UPDATE say otherwise
MAX_WINDOW = (1 << 31) - 1              # no window may grow past this (FLOW_CONTROL_ERROR)
DEFAULT_MAX_FRAME = 16_384              # SETTINGS_MAX_FRAME_SIZE's initial value, and its least

SETTINGS_ACK = frame(SETTINGS, ACK, 0)


def settings_frame(entries) -> bytes:
    """A SETTINGS frame of ``(identifier, value)`` entries."""
    return frame(SETTINGS, 0, 0, b"".join(SETTING.pack(k, v) for k, v in entries))


def parse_settings(payload: bytes) -> list[tuple[int, int]]:
    """A SETTINGS frame's ``(identifier, value)`` entries, in order. ``FrameError`` on a length that
    is not whole entries or on a value out of its range (initial window, frame size, push)."""
    if len(payload) % 6:
        raise FrameError(FRAME_SIZE_ERROR, "SETTINGS length")
    entries = []
    for pos in range(0, len(payload), 6):
        key, value = SETTING.unpack_from(payload, pos)
        if key == S_INITIAL_WINDOW_SIZE:
            if value > MAX_WINDOW:
                raise FrameError(FLOW_CONTROL_ERROR, "initial window over 2^31-1")
        elif key == S_MAX_FRAME_SIZE:
            if not DEFAULT_MAX_FRAME <= value <= MAX_FRAME_LENGTH:
                raise FrameError(PROTOCOL_ERROR, "MAX_FRAME_SIZE out of range")
        elif key == S_ENABLE_PUSH and value > 1:
            raise FrameError(PROTOCOL_ERROR, "ENABLE_PUSH out of range")
        entries.append((key, value))
    return entries
