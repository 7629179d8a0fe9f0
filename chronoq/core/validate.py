"""The rules for every string and byte field that enters a commit-log record: one module.

Every way a message reaches the log checks its fields here: the embedded ``Broker`` API
(``Broker.prepare`` and ``Broker.write_batch``, the one send path), gRPC SendMessage (whose protocol rules,
message type against fields, stay in ``chronoq.server.convert``), Stage/Publish
(``chronoq.features.staging``), transactions, and the retry and dead-letter copies (written through
``Broker.write``). Timer copies copy an already checked record and add only properties the
broker computes (``chronoq.timer.copies.add_prop`` asserts they hold no separator). So no entry
point can store what another refuses, and a rule changes in one place. Pure: no I/O, no state.

Why these rules: the record (``chronoq.store.record``) stores topic, message id, tag, keys and
properties as UTF-8; keys are joined by 0x01; properties are ``name 0x01 value`` pairs joined by
0x02; the message group and the message type travel as properties (``__GROUP``, ``__TYPE``). A
separator byte inside a field would read back as a different message (``message_group =
"g\\x02evil\\x01yes"`` became group ``g`` plus a user property ``evil=yes``), and a string that is
not valid Unicode (a lone surrogate) cannot be encoded at all. docs/security.md ("Validation")
lists the rules per field for users.

Each failure is a ``chronoq.core.errors.ClientError`` subclass naming the field and what is wrong;
``naming`` prefixes which message (or row) it concerns. Per message the work is a few C-level
passes (``str.isprintable``, one precompiled regex search) per field, never a Python loop over
characters: this runs on every send.
"""

from __future__ import annotations

import re

from chronoq.core import errors

TOPIC_NAME_MAX = 127          # record: topic_len is a u8 (the name is ASCII)
GROUP_NAME_MAX = 120          # leaves room in %RETRY%{group}_{topic} style names
MESSAGE_ID_CHARS_MAX = 128    # record: msgid_len is a u8 (the id is ASCII)
TAG_BYTES_MAX = 1024          # record: tag_len is a u16
KEYS_BYTES_MAX = 16 * 1024    # record: keys_len is a u16 (each key counts one separator byte)
PROPERTIES_MAX = 128
PROPERTIES_BYTES_MAX = 16 * 1024
MESSAGE_GROUP_BYTES_MAX = 64  # a group is shorter than this, in UTF-8 bytes

# Names the broker uses for its own topics and groups. Users may not create or send to them.
SYSTEM_TOPIC_PREFIXES = ("%RETRY%", "%DLQ%", "%SYS%", "CHRONOQ_", "SCHEDULE_TOPIC", "rmq_sys_")
SYSTEM_GROUP_PREFIXES = ("CHRONOQ_", "%SYS%")
# Of those, the broker's internal topics (transactions' half messages and ops, delay levels, the
# timer's control records, the trace, staged sends, the epoch): no RocketMQ client call may name
# them, as RocketMQ's proxy refuses its own system topics. Retry and dead-letter topics are not
# internal: consumers read a dead-letter topic, and what a retry topic holds is a group's own.
INTERNAL_TOPIC_PREFIXES = tuple(p for p in SYSTEM_TOPIC_PREFIXES if p not in ("%RETRY%", "%DLQ%"))
# Property names starting with this are written by the broker (message group, delivery attempt,
# origin topic of a retry, ...). Users may not set them.
SYSTEM_PROPERTY_PREFIX = "__"
# The broker's properties every reader interprets: a message's FIFO group (when its record has
# none of its own) and the message type it was sent as (chronoq.broker.broker writes them).
PROP_MESSAGE_GROUP = "__GROUP"
PROP_MESSAGE_TYPE = "__TYPE"
# The record's separators inside the keys and properties fields (chronoq.store.record).
SEPARATORS = ("\x01", "\x02")

_NAME_RE = re.compile(r"[%|a-zA-Z0-9_-]+")
# C0 controls (the separators 0x01 and 0x02 among them), DEL, and lone surrogates (no UTF-8 form).
_CONTROL = re.compile("[\x00-\x1f\x7f\ud800-\udfff]").search
# What a property value may not hold: the separators and lone surrogates (other control
# characters round-trip unchanged, and RocketMQ clients allow them in values).
_VALUE_FORBIDDEN = re.compile("[\x01\x02\ud800-\udfff]").search
assert all(_CONTROL(s) and _VALUE_FORBIDDEN(s) for s in SEPARATORS)


def has_control(text: str) -> bool:
    """True when ``text`` holds a C0 control character, DEL or a lone surrogate.

    ``isprintable()`` is one C pass and False for each of those, so a True answer settles it;
    the regex decides the rest exactly (non-ASCII text may be "unprintable", e.g. U+00A0,
    without holding any of them)."""
    return not text.isprintable() and _CONTROL(text) is not None


def naming(exc: errors.ClientError, where: str) -> errors.ClientError:
    """``exc`` again (same type), its message prefixed with ``where``: which message or row."""
    return type(exc)(f"{where}: {exc.message}")


def _short(text: str) -> str:
    return repr(text[:40]) + ("..." if len(text) > 40 else "")


# ----------------------------------------------------------------------------- names
def _check_name(name: object, what: str, max_len: int, exc: type[errors.ClientError]) -> str:
    if not isinstance(name, str):
        raise exc(f"{what} name must be a string, not {type(name).__name__}")
    if not name:
        raise exc(f"{what} name is missing")
    if len(name) > max_len:
        raise exc(f"{what} name {_short(name)} is {len(name)} characters; at most {max_len} allowed")
    # fullmatch: with match(), "$" also matches before a trailing newline ("orders\n" passed).
    if not _NAME_RE.fullmatch(name):
        raise exc(f"{what} name {_short(name)} may only contain letters, digits, '%', '|', '_' and '-'")
    return name


def topic_name(name: object) -> str:
    """A topic name: 1..127 of ``[A-Za-z0-9%|_-]`` (system topics included)."""
    return _check_name(name, "topic", TOPIC_NAME_MAX, errors.InvalidTopic)


def is_system_topic(name: str) -> bool:
    return name.startswith(SYSTEM_TOPIC_PREFIXES)


def client_topic(name: object) -> str:
    """A topic a RocketMQ client call may name (route, send, receive, ack): valid and not one of
    the broker's internal topics (without this, any consumer could read uncommitted transactions'
    half messages or delayed messages before they are due)."""
    topic = topic_name(name)
    if topic.startswith(INTERNAL_TOPIC_PREFIXES):
        raise errors.ReservedName(f"topic {topic!r} is internal to the broker; clients cannot use it")
    return topic


def user_topic(name: object) -> str:
    """A topic a user may create or send to: valid and not a system topic."""
    topic = topic_name(name)
    if is_system_topic(topic):
        raise errors.ReservedName(f"topic {topic!r} uses a reserved system prefix; pick another name")
    return topic


def group_name(name: object) -> str:
    """A consumer group name: 1..120 of ``[A-Za-z0-9%|_-]``, no reserved prefix."""
    group = _check_name(name, "consumer group", GROUP_NAME_MAX, errors.InvalidGroup)
    if group.startswith(SYSTEM_GROUP_PREFIXES):
        raise errors.InvalidGroup(f"consumer group {group!r} uses a reserved system prefix")
    return group


# ----------------------------------------------------------------------------- message fields
def message_id(mid: object) -> str:
    """A client-chosen message id: 1..128 printable ASCII characters, not blank."""
    if not isinstance(mid, str):
        raise errors.InvalidMessageId(f"message id must be a string, not {type(mid).__name__}")
    if not mid.strip():
        raise errors.InvalidMessageId("message id is blank")
    if len(mid) > MESSAGE_ID_CHARS_MAX or not mid.isascii() or has_control(mid):
        raise errors.InvalidMessageId(
            f"message id {_short(mid)} must be printable ASCII of at most {MESSAGE_ID_CHARS_MAX} characters")
    return mid


def plain_message_ids(ids: list) -> bool:
    """True when every id surely passes ``message_id``, checked in bulk (a few C passes over
    them all): strings of printable ASCII without a space, 1..128 long. False decides nothing:
    the caller then checks them one by one (``message_id`` words the error)."""
    # (C level throughout: a lone id, the official clients' send, paid 9k instructions for
    # passes over a set of types and a list of lengths; now 3k)
    try:
        joined = "".join(ids)  # (TypeError: an id that is not a string)
    except TypeError:
        return False
    return (joined.isascii() and joined.isprintable() and " " not in joined and all(ids)
            and (len(joined) <= MESSAGE_ID_CHARS_MAX or max(map(len, ids)) <= MESSAGE_ID_CHARS_MAX))


def tag(value: object) -> str:
    """A tag: "" (none) or a non-blank string without '|' (the filter syntax's "or") or control
    characters, at most 1024 UTF-8 bytes."""
    if value is None or value == "":
        return ""
    if not isinstance(value, str):
        raise errors.InvalidTag(f"tag must be a string, not {type(value).__name__}")
    if not value.strip():
        raise errors.InvalidTag("tag is blank")
    if len(value) > TAG_BYTES_MAX:  # (before any pass over a huge string)
        raise errors.InvalidTag(f"tag is {len(value)} characters; at most {TAG_BYTES_MAX} bytes allowed")
    if "|" in value or has_control(value):
        raise errors.InvalidTag(f"tag {_short(value)} may not contain '|', control characters or lone surrogates")
    if len(value.encode()) > TAG_BYTES_MAX:
        raise errors.InvalidTag(f"tag is longer than {TAG_BYTES_MAX} bytes in UTF-8")
    return value


def keys(value: object) -> tuple[str, ...]:
    """Message keys: a string or a list of strings, each non-blank, without control characters
    (0x01 joins them in the record) or lone surrogates; 16 KiB in all. Spaces are allowed, as the
    RocketMQ proxy allows them (a key is kept whole: RocketMQ joins keys with spaces, so there a
    key "order 42" comes back as two, "order" and "42")."""
    if not value:
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, (list, tuple, set, frozenset)):
        raise errors.InvalidKey(f"message keys must be a string or a list of strings, not {type(value).__name__}")
    out = []
    size = 0
    for key in value:  # type: ignore[union-attr]
        if not isinstance(key, str) or not key.strip():
            raise errors.InvalidKey(f"message key {_short(key) if isinstance(key, str) else key!r} must be a non-blank string")
        if len(key) > KEYS_BYTES_MAX:
            raise errors.InvalidKey(f"a message key is {len(key)} characters; all keys together may take "
                                    f"{KEYS_BYTES_MAX} bytes")
        if has_control(key):
            raise errors.InvalidKey(f"message key {_short(key)} may not contain control characters or lone surrogates")
        size += len(key.encode()) + 1
        out.append(key)
    if size > KEYS_BYTES_MAX:
        raise errors.InvalidKey(f"message keys take {size} bytes; at most {KEYS_BYTES_MAX} allowed")
    return tuple(out)


def properties(props: object, *, allow_system: bool = False) -> dict[str, str]:
    """User properties (a new dict): names non-empty without control characters or lone
    surrogates, not starting with "__" (the broker's) unless ``allow_system``; values any
    string without 0x01, 0x02 or lone surrogates; at most 128 and 16 KiB (names and values in
    UTF-8). Broker writes (``allow_system``) may add "__" properties on top of a message already
    at the user limits (a retry or dead-letter copy): the limits count only the user's own."""
    if not props:
        return {}
    if not isinstance(props, dict):
        raise errors.InvalidProperty("properties must be a mapping of strings to strings")
    if len(props) > PROPERTIES_MAX and not allow_system:
        raise errors.PropertiesTooLarge(f"{len(props)} properties; at most {PROPERTIES_MAX} allowed")
    size = 0
    count = 0
    for key, value in props.items():
        if not isinstance(key, str) or not key:
            raise errors.InvalidProperty(f"property name {key!r} must be a non-empty string")
        if not isinstance(value, str):
            raise errors.InvalidProperty(f"property {_short(key)} must have a string value, not "
                                         f"{type(value).__name__}")
        if len(key) + len(value) > PROPERTIES_BYTES_MAX and not key.startswith(SYSTEM_PROPERTY_PREFIX):
            raise errors.PropertiesTooLarge(f"property {_short(key)} alone is over {PROPERTIES_BYTES_MAX} "
                                            "characters")
        if has_control(key):
            raise errors.InvalidProperty(
                f"property name {_short(key)} may not contain control characters or lone surrogates")
        if _VALUE_FORBIDDEN(value) is not None:
            raise errors.InvalidProperty(
                f"property {_short(key)}: the value may not contain 0x01, 0x02 (the record's separators) "
                "or lone surrogates")
        if key.startswith(SYSTEM_PROPERTY_PREFIX):
            if not allow_system:
                raise errors.InvalidProperty(f"property name {_short(key)} is reserved for the broker ('__' prefix)")
            continue
        count += 1
        size += len(key.encode()) + len(value.encode())
    if count > PROPERTIES_MAX:
        raise errors.PropertiesTooLarge(f"{count} properties; at most {PROPERTIES_MAX} allowed")
    if size > PROPERTIES_BYTES_MAX:
        raise errors.PropertiesTooLarge(f"properties take {size} bytes; at most {PROPERTIES_BYTES_MAX} allowed")
    return dict(props)


def message_group(group: object) -> str:
    """A FIFO message group: a non-blank string without control characters (it is stored as a
    property value, so 0x01 and 0x02 would split it) or lone surrogates, under 64 UTF-8 bytes."""
    if not isinstance(group, str):
        raise errors.InvalidMessageGroup(f"message group must be a string, not {type(group).__name__}")
    if not group.strip():
        raise errors.InvalidMessageGroup("message group is blank")
    if len(group) < MESSAGE_GROUP_BYTES_MAX and has_control(group):  # (a long one is refused below)
        raise errors.InvalidMessageGroup(
            f"message group {_short(group)} may not contain control characters (0x01 and 0x02 separate "
            "the record's properties) or lone surrogates")
    if len(group) >= MESSAGE_GROUP_BYTES_MAX or (not group.isascii() and
                                                 len(group.encode()) >= MESSAGE_GROUP_BYTES_MAX):
        raise errors.InvalidMessageGroup(
            f"message group {_short(group)} must be under {MESSAGE_GROUP_BYTES_MAX} bytes in UTF-8")
    return group


def body(value: object, max_bytes: int) -> bytes:
    """A message body as bytes: bytes-like, or a str (stored as UTF-8); not empty, at most
    ``max_bytes``."""
    if type(value) is not bytes:
        if isinstance(value, str):
            try:
                value = value.encode()
            except UnicodeEncodeError:
                raise errors.ClientError("message body is a str with a lone surrogate (no UTF-8 form); "
                                         "pass bytes") from None
        elif isinstance(value, (bytes, bytearray, memoryview)):
            value = bytes(value)
        else:
            raise errors.ClientError(f"message body must be bytes, not {type(value).__name__}")
    if not value:
        raise errors.BodyEmpty("message body is empty")
    if len(value) > max_bytes:
        raise errors.BodyTooLarge(f"message body is {len(value)} bytes; the limit is {max_bytes}")
    return value  # type: ignore[return-value]

