"""Receipt handles: the opaque string a consumer echoes to ack or change a message's invisibility.

Pure codec, no I/O. A handle names one *delivery*: the checkpoint (CK) that handed the message out
and the message's index in it. It is 48 lower-case hex characters encoding 24 bytes
(little-endian)::

    off  size  field
      0     1  version       1
      1     8  ck_id         u64, (generation << 32) | sequence; never reused (see inflight.py)
      9     1  index         u8, position of the message in the CK (0..31)
     10     2  queue_id      u16, queue the message was read from
     12     8  queue_offset  u64, its offset there
     20     4  crc32         zlib CRC-32 of bytes [0, 20)

A handle is well formed iff it is a 48-character hex string, the version is known and the CRC
matches. Well formed is not valid: ``Inflight.find`` also requires a live CK with that id whose
entry ``index`` is still unsettled and sits at ``queue_id``/``queue_offset`` for the same group
and topic. Fencing follows from ids never being reused: once a CK is revived, replaced
(change-invisible-time) or fully acked, its handles match nothing. The CRC only catches typos and
truncation; handles are not secret.
"""

from __future__ import annotations

import struct
import zlib

from chronoq.core import errors

VERSION = 1
_BODY = struct.Struct("<BQBHQ")
_CRC = struct.Struct("<I")
BODY_SIZE = 20
HANDLE_BYTES = 24
HANDLE_CHARS = 2 * HANDLE_BYTES
assert _BODY.size == BODY_SIZE and BODY_SIZE + _CRC.size == HANDLE_BYTES

_pack = _BODY.pack
_unpack = _BODY.unpack_from
_pack_crc = _CRC.pack
_unpack_crc = _CRC.unpack_from
_crc32 = zlib.crc32


def encode(ck_id: int, index: int, queue_id: int, queue_offset: int) -> str:
    body = _pack(VERSION, ck_id, index, queue_id, queue_offset)
    return (body + _pack_crc(_crc32(body))).hex()


def decode(text: object) -> tuple[int, int, int, int]:
    """Return (ck_id, index, queue_id, queue_offset); InvalidReceiptHandle if malformed."""
    if type(text) is not str or len(text) != HANDLE_CHARS:
        raise errors.InvalidReceiptHandle("receipt handle is malformed (wrong type or length)")
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raise errors.InvalidReceiptHandle("receipt handle is malformed (not hex)") from None
    if _crc32(raw[:BODY_SIZE]) != _unpack_crc(raw, BODY_SIZE)[0]:
        raise errors.InvalidReceiptHandle("receipt handle is malformed (checksum mismatch)")
    version, ck_id, index, queue_id, queue_offset = _unpack(raw)
    if version != VERSION:
        raise errors.InvalidReceiptHandle(f"receipt handle version {version} is unknown")
    return ck_id, index, queue_id, queue_offset
