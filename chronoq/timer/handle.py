"""Recall handles: the opaque, printable string a delayed send returns. Pure: no I/O.

Text: a version character followed by unpadded URL-safe base64 of (little-endian)::

    off size field
      0    1 kind       1 TIMER, 2 LEVEL, 3 IMMEDIATE (due at send: already visible)
      1    1 level      delay level for LEVEL, else 0
      2    8 position   TIMER: ident (commit offset of the delayed record, the key of its schedule
                        entry); LEVEL: offset in queue level-1 of the delay topic;
                        IMMEDIATE: commit offset of the record
     10    8 due_ms     i64, when the message is due
     18    1 topic_len  then the topic (UTF-8)
      .    1 id_len     then the message id (ASCII)
      .    1 group_len  version "2" only: then the broker group that minted it (ASCII)
      .    4 crc32c     of every byte before it

Version ``"1"``: no group field. Minted by a broker outside a cluster (no ``etcd_endpoints``), and
by every broker before issue 23 step 3: such handles stay valid where they were minted.
Version ``"2"`` (issue 23 step 3, docs/cluster.md): minted by a broker in a cluster, naming its
broker group (``group_name``), so a recall or reschedule arriving at another group's node can be
passed on to the group that stores the message (``chronoq.server.cluster``). The group is
covered by the CRC like the rest; a reschedule's new handle names the same group as the old one.

The CRC only catches mangled handles (it is not a secret): a well-formed handle that names nothing
gets the definite answer NOT_FOUND. A reschedule issues a new handle; the old one then answers
NOT_FOUND.
"""

from __future__ import annotations

import base64
import binascii
import struct
from dataclasses import dataclass

import google_crc32c

from chronoq.core import errors

VERSION = "1"
VERSION_GROUP = "2"  # the same fields and the minting broker group
TIMER = 1
LEVEL = 2
IMMEDIATE = 3
_HEAD = struct.Struct("<BBqq")
_CRC = struct.Struct("<I")
HANDLE_CHARS_MAX = 1024


@dataclass(frozen=True, slots=True)
class RecallHandle:
    kind: int
    level: int
    position: int
    due_ms: int
    topic: str
    message_id: str
    group: str = ""  # the broker group that minted it ("": version 1, a broker outside a cluster)

    def encode(self) -> str:
        return encode(self.kind, self.level, self.position, self.due_ms, self.topic, self.message_id, self.group)


def _group_field(group: str) -> tuple[str, bytes]:
    """(version, the bytes after the message id) for handles minted by ``group``."""
    if not group:
        return VERSION, b""
    g = group.encode()
    assert 0 < len(g) < 256 and group.isascii(), group
    return VERSION_GROUP, _LEN[len(g)] + g


def encode(kind: int, level: int, position: int, due_ms: int, topic: str, message_id: str, group: str = "") -> str:
    """The handle text (the send path calls this directly: no intermediate object); ``group``:
    the minting broker's group in a cluster ("" outside one: a version 1 handle)."""
    t = topic.encode()
    m = message_id.encode()
    assert len(t) < 256 and len(m) < 256 and kind in (TIMER, LEVEL, IMMEDIATE)
    version, tail = _group_field(group)
    body = b"".join((_HEAD.pack(kind, level, position, due_ms), _LEN[len(t)], t, _LEN[len(m)], m, tail))
    raw = body + _CRC.pack(_crc(body))
    return version + _b64(raw).rstrip(b"=").decode()


_LEN = [bytes([i]) for i in range(256)]
_crc = google_crc32c.value
_b64 = base64.urlsafe_b64encode
# The compiled build mints a batch's handles in C (handle.pxd's ``_encode_many_in_c``: a lone
# handle ~5k instructions with the call, not ~19k); this source's loop is the pure build's.
_COMPILED = not __file__.endswith(".py")
_CRC_IN_CPU = _COMPILED and bool(chronoq_crc32c_in_cpu())  # noqa: F821 - cimported in handle.pxd


def encode_many(kind: int, positions, dues, topics, message_ids, group: str = "") -> list[str]:
    """``encode(kind, 0, positions[i], dues[i], topics[i], message_ids[i], group)`` for a whole batch
    (the delayed send path): each topic's bytes made once, and the texts finished (padding cut,
    version put in front, decoded) in one pass over the batch instead of once per handle.
    ``message_ids`` are ASCII bytes (the record's field) or str."""
    assert kind in (TIMER, IMMEDIATE), "a LEVEL handle carries its level: use encode"
    version_text, tail = _group_field(group)
    if _COMPILED:
        return _encode_many_in_c(kind, positions, dues, topics, message_ids, version_text, tail,  # noqa: F821
                                 _CRC_IN_CPU, _crc)
    prefixes: dict[str, bytes] = {}
    raws: list[bytes] = []
    add, pack, pack_crc, crc, lens, b64 = raws.append, _HEAD.pack, _CRC.pack, _crc, _LEN, binascii.b2a_base64
    for position, due_ms, topic, mid in zip(positions, dues, topics, message_ids):
        prefix = prefixes.get(topic)
        if prefix is None:
            t = topic.encode()
            assert len(t) < 256
            prefix = prefixes[topic] = lens[len(t)] + t
        if type(mid) is not bytes:
            mid = mid.encode()
        assert len(mid) < 256
        body = pack(kind, 0, position, due_ms) + prefix + lens[len(mid)] + mid + tail
        add(b64(body + pack_crc(crc(body)), newline=False))
    if not raws:
        return []
    # Standard base64 made URL-safe, its padding cut (base64 has no "=" but padding, and no
    # newline) and split: one pass each over the whole batch. (Two single-byte replaces, not a
    # translate: they skip from one hit to the next (memchr) where a translate looks up every byte,
    # five times the instructions.)
    version = version_text.encode()
    joined = (version + (b"\n" + version).join(raws)).replace(b"+", b"-").replace(b"/", b"_").replace(b"=", b"")
    return joined.decode().split("\n")


def decode(text: object) -> RecallHandle:
    """Parse a handle; ``ClientError`` (kind bad_request) when it is not one chronoq issued."""
    if not isinstance(text, str) or not text:
        raise errors.ClientError("recall handle is missing")
    if len(text) > HANDLE_CHARS_MAX or not text.isascii():
        raise errors.ClientError("recall handle is not a chronoq recall handle")
    version = text[:1]
    if version not in (VERSION, VERSION_GROUP):
        raise errors.ClientError(f"recall handle version {version!r} is not supported "
                                 f"(expected {VERSION!r} or {VERSION_GROUP!r})")
    payload = text[1:]
    try:
        raw = base64.b64decode(payload + "=" * (-len(payload) % 4), altchars=b"-_", validate=True)
    except (binascii.Error, ValueError):
        raise errors.ClientError("recall handle is not valid base64") from None
    try:
        kind, level, position, due_ms = _HEAD.unpack_from(raw, 0)
        pos = _HEAD.size
        tlen = raw[pos]
        topic = raw[pos + 1:pos + 1 + tlen].decode()
        pos += 1 + tlen
        mlen = raw[pos]
        mid = raw[pos + 1:pos + 1 + mlen].decode()
        pos += 1 + mlen
        group = ""
        if version == VERSION_GROUP:
            glen = raw[pos]
            group = raw[pos + 1:pos + 1 + glen].decode("ascii")
            pos += 1 + glen
        (crc,) = _CRC.unpack_from(raw, pos)
    except (struct.error, IndexError, UnicodeDecodeError):
        raise errors.ClientError("recall handle is truncated or malformed") from None
    if pos + _CRC.size != len(raw) or google_crc32c.value(raw[:pos]) != crc:
        raise errors.ClientError("recall handle failed its checksum (mangled or truncated)")
    if kind not in (TIMER, LEVEL, IMMEDIATE) or not topic or not mid or (kind == LEVEL) != (level > 0):
        raise errors.ClientError("recall handle names an unknown kind of message")
    if version == VERSION_GROUP and not group:
        raise errors.ClientError("recall handle names no broker group")
    return RecallHandle(kind, level, position, due_ms, topic, mid, group)
