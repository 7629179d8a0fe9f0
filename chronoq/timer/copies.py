"""Records the timer writes, built from stored record bytes. Pure: no I/O.

* a **level record**: a message sent with a delay level, parked in ``DELAY_TOPIC`` queue level-1
  with its real topic and queue in reserved properties;
* a **delivered copy**: a due message made visible in its real topic and queue. It keeps the
  original message id, body, tag, keys, user properties, born time and ``deliver_at_ms``, and
  gains one reserved property naming the schedule entry it came from (``PROP_TIMER_REF`` =
  ``"<bucket start>.<ident>"`` or ``PROP_DELAY_REF`` = ``"<level>.<queue offset>"``). Those
  references are how a restart finds what was already delivered after the timer's checkpoint;
* a **rescheduled record**: a new delayed record (``FLAG_DELAYED``) for the new time, carrying
  ``PROP_TIMER_MOVED_FROM``/``PROP_DELAY_MOVED_FROM``; absorbing it both retires the old entry and
  schedules the new one, so a move is one atomic record;
* a **control record** (recall): ``FLAG_DELAYED | FLAG_SYSTEM`` in ``CONTROL_TOPIC`` with
  ``PROP_TIMER_CANCEL`` or ``PROP_DELAY_CANCEL``; it never reaches a consume queue.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from chronoq.store import record
from chronoq.store.store import Prepared
from chronoq.core.delay_levels import DELAY_TOPIC

CONTROL_TOPIC = "CHRONOQ_TIMER_CTL"
PROP_TIMER_REF = "__TIMER_REF"
PROP_TIMER_MOVED_FROM = "__TIMER_MOVED_FROM"
PROP_TIMER_CANCEL = "__TIMER_CANCEL"
PROP_TIMER_REPLACED = "__TIMER_REPLACED"  # what a replacing send replaced (chronoq.timer.keyed)
PROP_DELAY_REF = "__DELAY_REF"
PROP_DELAY_TOPIC = "__DELAY_TOPIC"
PROP_DELAY_QID = "__DELAY_QID"
PROP_DELAY_LEVEL = "__DELAY_LEVEL"
PROP_DELAY_MOVED_FROM = "__DELAY_MOVED_FROM"
PROP_DELAY_CANCEL = "__DELAY_CANCEL"
# Reserved properties that only make sense while a message waits; a delivered copy drops them.
_WAITING_PROPS = (PROP_TIMER_MOVED_FROM, PROP_DELAY_MOVED_FROM, PROP_DELAY_TOPIC, PROP_DELAY_QID,
                  PROP_DELAY_LEVEL, PROP_TIMER_REPLACED)
REF_MARKERS = (PROP_TIMER_REF.encode(), PROP_DELAY_REF.encode())

_HEADER = record.HEADER
_SIZE = record.HEADER_SIZE
_PAIR = record.PROP_PAIR_SEP
_SEP = record.PROP_SEP


class Parts(NamedTuple):
    flags: int
    queue_id: int
    born_ms: int
    stored_ms: int
    deliver_at_ms: int
    topic: bytes
    message_id: bytes
    tag: bytes
    keys: bytes
    properties: bytes
    body: bytes


def split(raw) -> Parts:
    """The fields of a record (already validated), without decoding any of them."""
    (total, _m, _v, _c, flags, qid, _qoff, born, stored, deliver,
     tlen, mlen, taglen, klen, plen, blen) = _HEADER.unpack_from(raw, 0)
    p = _SIZE
    topic = bytes(raw[p:p + tlen]); p += tlen
    mid = bytes(raw[p:p + mlen]); p += mlen
    tag = bytes(raw[p:p + taglen]); p += taglen
    keys = bytes(raw[p:p + klen]); p += klen
    props = bytes(raw[p:p + plen]); p += plen
    body = bytes(raw[p:p + blen])
    assert p + blen == total, "record lengths disagree"
    return Parts(flags, qid, born, stored, deliver, topic, mid, tag, keys, props, body)


def header_fields(raw) -> tuple[int, int, int, bytes, bytes]:
    """(flags, queue_id, deliver_at_ms, topic, message id) without slicing the rest."""
    (_t, _m, _v, _c, flags, qid, _qoff, _born, _stored, deliver,
     tlen, mlen, _tg, _k, _p, _b) = _HEADER.unpack_from(raw, 0)
    return flags, qid, deliver, bytes(raw[_SIZE:_SIZE + tlen]), bytes(raw[_SIZE + tlen:_SIZE + tlen + mlen])


def stored_ms(raw) -> int:
    return _HEADER.unpack_from(raw, 0)[8]


def add_prop(props: bytes, key: str, value: str) -> bytes:
    pair = key.encode() + _PAIR + value.encode()
    # The broker computes these (a reference, a topic name, a number): none may hold a separator,
    # or the copy would read back with properties nobody sent (chronoq.core.validate's rule).
    assert pair.count(_PAIR) == 1 and _SEP not in pair, pair
    return props + _SEP + pair if props else pair


def without_waiting_props(props: bytes) -> bytes:
    if b"__TIMER_MOVED_FROM" not in props and b"__DELAY_" not in props and b"__TIMER_REPLACED" not in props:
        return props
    kept = {k: v for k, v in record.decode_properties(props).items() if k not in _WAITING_PROPS}
    return record.encode_properties(kept)


def get_prop(props: bytes, key: str) -> str | None:
    if key.encode() not in props:
        return None
    return record.decode_properties(props).get(key)


def level_record(p: Prepared, level: int, due_ms: int) -> Prepared:
    """Park a prepared message in the delay topic's queue for ``level``."""
    props = add_prop(p.properties, PROP_DELAY_TOPIC, p.topic)
    props = add_prop(props, PROP_DELAY_QID, str(p.queue_id))
    props = add_prop(props, PROP_DELAY_LEVEL, str(level))
    return p._replace(topic=DELAY_TOPIC, queue_id=level - 1, flags=p.flags | record.FLAG_SYSTEM,
                      deliver_at_ms=due_ms, properties=props)


def real_destination(parts: Parts) -> tuple[str, int]:
    """(topic, queue) a record is finally delivered to: a level record names them in properties."""
    if parts.topic == DELAY_TOPIC.encode():
        props = record.decode_properties(parts.properties)
        return props[PROP_DELAY_TOPIC], int(props[PROP_DELAY_QID])
    return parts.topic.decode(), parts.queue_id


_DELAY_TOPIC_BYTES = DELAY_TOPIC.encode()
_topic_names: dict[bytes, str] = {}


def delivered_copy(raw: bytes, ref_key: str, ref_value: str, flags: int = 0) -> Prepared:
    """The visible copy of a due message (timer entry or level record). ``flags``:
    ``record.FLAG_HELD`` for a copy written ahead of its due time (``timer_prewrite_ms``).

    On the delivery hot path (a burst is 200k of these): one header unpack and plain slices.
    """
    (total, _m, _v, _c, _flags, qid, _qoff, born, _stored, deliver,
     tlen, mlen, taglen, klen, plen, blen) = _HEADER.unpack_from(raw, 0)
    p = _SIZE
    topic_raw = raw[p:p + tlen]
    p += tlen
    mid = raw[p:p + mlen]
    p += mlen
    tag = raw[p:p + taglen]
    p += taglen
    keys = raw[p:p + klen]
    p += klen
    props = raw[p:p + plen]
    p += plen
    body = raw[p:p + blen]
    assert p + blen == total, "record lengths disagree"
    if topic_raw == _DELAY_TOPIC_BYTES:
        decoded = record.decode_properties(props)
        topic, qid = decoded[PROP_DELAY_TOPIC], int(decoded[PROP_DELAY_QID])
    else:
        topic = _topic_names.get(topic_raw)
        if topic is None:
            if len(_topic_names) > 4096:
                _topic_names.clear()
            topic = _topic_names[topic_raw] = topic_raw.decode()
    props = add_prop(without_waiting_props(props), ref_key, ref_value)
    return Prepared(topic, qid, flags, born, deliver, mid, tag, keys, props, body)


def rescheduled(raw, new_due_ms: int, moved_key: str, moved_value: str) -> Prepared:
    """A new delayed record for ``new_due_ms`` that also retires the entry it moves from."""
    parts = split(raw)
    topic, qid = real_destination(parts)
    props = add_prop(without_waiting_props(parts.properties), moved_key, moved_value)
    return Prepared(topic, qid, record.FLAG_DELAYED, parts.born_ms, new_due_ms, parts.message_id, parts.tag,
                    parts.keys, props, parts.body)


def control(key: str, value: str, message_id: bytes, due_ms: int, now_ms: int) -> Prepared:
    """A recall record: durable in the commit log, absorbed by the timer, never consumed."""
    return Prepared(CONTROL_TOPIC, 0, record.FLAG_DELAYED | record.FLAG_SYSTEM, now_ms, due_ms, message_id,
                    b"", b"", record.encode_properties({key: value}), b"")


def parse_ref(value: str, parts: int = 2) -> tuple[int, ...]:
    """``"a.b"`` -> (a, b); raises ValueError on anything else."""
    fields = value.split(".")
    if len(fields) != parts:
        raise ValueError(f"reference {value!r} should have {parts} fields")
    return tuple(int(f) for f in fields)


_LEN = struct.Struct("<I")


def record_length(raw, pos: int = 0) -> int:
    return _LEN.unpack_from(raw, pos)[0]
