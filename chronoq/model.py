"""Value types shared by every layer, and the validation rules for names and messages."""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass, field

from chronoq import errors

TOPIC_NAME_MAX = 127
GROUP_NAME_MAX = 120
_NAME_RE = re.compile(r"^[%|a-zA-Z0-9_-]+$")

# Names the broker uses for its own topics and groups. Users may not create or send to them.
SYSTEM_TOPIC_PREFIXES = ("%RETRY%", "%DLQ%", "%SYS%", "CHRONOQ_", "SCHEDULE_TOPIC", "rmq_sys_")
SYSTEM_GROUP_PREFIXES = ("CHRONOQ_", "%SYS%")

# Property keys starting with this prefix are written by the broker (message group, delivery
# attempt, origin topic of a retry, ...). Users may not set them.
SYSTEM_PROPERTY_PREFIX = "__"
# The record codec joins properties with these separators, so they may not appear inside one.
PROPERTY_FORBIDDEN = ("\x01", "\x02")
PROPERTIES_MAX = 128
PROPERTIES_BYTES_MAX = 16 * 1024
MESSAGE_GROUP_BYTES_MAX = 64
MESSAGE_ID_CHARS_MAX = 128


class MessageType(enum.IntEnum):
    """Numbers match ``apache.rocketmq.v2.MessageType``; MIXED is a topic accepting all."""

    MIXED = 0
    NORMAL = 1
    FIFO = 2
    DELAY = 3
    TRANSACTION = 4

    @classmethod
    def parse(cls, text: str) -> "MessageType":
        try:
            return cls[text.strip().upper()]
        except KeyError:
            names = ", ".join(m.name.lower() for m in cls)
            raise errors.ClientError(f"unknown message type {text!r}; expected one of {names}") from None


def _check_name(name: object, what: str, max_len: int, exc: type[errors.ClientError]) -> str:
    if not isinstance(name, str) or not name:
        raise exc(f"{what} name is missing")
    if len(name) > max_len:
        raise exc(f"{what} name {name[:40]!r}... is {len(name)} characters; at most {max_len} allowed")
    # fullmatch: with match(), "$" also matches before a trailing newline ("orders\n" passed).
    if not _NAME_RE.fullmatch(name):
        raise exc(f"{what} name {name!r} may only contain letters, digits, '%', '|', '_' and '-'")
    return name


def validate_topic_name(name: object) -> str:
    return _check_name(name, "topic", TOPIC_NAME_MAX, errors.InvalidTopic)


def validate_user_topic(name: object) -> str:
    """A topic a user may create or send to: valid and not a system topic."""
    topic = validate_topic_name(name)
    if is_system_topic(topic):
        raise errors.ReservedName(f"topic {topic!r} uses a reserved system prefix; pick another name")
    return topic


def is_system_topic(name: str) -> bool:
    return name.startswith(SYSTEM_TOPIC_PREFIXES)


def validate_group_name(name: object) -> str:
    group = _check_name(name, "consumer group", GROUP_NAME_MAX, errors.InvalidGroup)
    if group.startswith(SYSTEM_GROUP_PREFIXES):
        raise errors.InvalidGroup(f"consumer group {group!r} uses a reserved system prefix")
    return group


_CONTROL_RE = re.compile("[\x00-\x1f\x7f]")


def _has_control(text: str) -> bool:
    # On every send (message ids, tags, keys): isprintable() is one C pass and False for every
    # control character, so a True answer settles it; the regex decides the rest exactly
    # (non-ASCII text may be "unprintable" without holding a control character).
    return not text.isprintable() and _CONTROL_RE.search(text) is not None


def validate_tag(tag: object) -> str:
    if tag is None or tag == "":
        return ""
    if not isinstance(tag, str) or not tag.strip():
        raise errors.InvalidTag("tag must be a non-blank string")
    if "|" in tag or _has_control(tag):
        raise errors.InvalidTag(f"tag {tag!r} may not contain '|' or control characters")
    if len(tag.encode()) > 1024:
        raise errors.InvalidTag("tag is longer than 1024 bytes")
    return tag


def validate_keys(keys: object) -> tuple[str, ...]:
    if not keys:
        return ()
    if isinstance(keys, str):
        keys = (keys,)
    if not isinstance(keys, (list, tuple, set, frozenset)):
        raise errors.InvalidKey(f"message keys must be a string or a list of strings, not {type(keys).__name__}")
    out = []
    for key in keys:  # type: ignore[union-attr]
        if not isinstance(key, str) or not key.strip() or _has_control(key) or " " in key:
            raise errors.InvalidKey(f"message key {key!r} must be non-blank without spaces or control characters")
        out.append(key)
    if sum(len(k.encode()) + 1 for k in out) > 16 * 1024:
        raise errors.InvalidKey("message keys exceed 16 KiB in total")
    return tuple(out)


def validate_properties(props: object, *, allow_system: bool = False) -> dict[str, str]:
    if not props:
        return {}
    if not isinstance(props, dict):
        raise errors.InvalidProperty("properties must be a mapping of strings to strings")
    # Broker writes (allow_system) may add "__" keys on top of a message already at the user
    # limits (a retry or dead-letter copy): the limits count only the user's own properties.
    if len(props) > PROPERTIES_MAX and not allow_system:
        raise errors.PropertiesTooLarge(f"{len(props)} properties; at most {PROPERTIES_MAX} allowed")
    size = 0
    count = 0
    for key, value in props.items():
        if not isinstance(key, str) or not isinstance(value, str) or not key:
            raise errors.InvalidProperty(f"property {key!r} must map a non-empty string to a string")
        if any(sep in key or sep in value for sep in PROPERTY_FORBIDDEN):
            raise errors.InvalidProperty(f"property {key!r} contains a reserved control character")
        if _has_control(key):
            raise errors.InvalidProperty(f"property key {key!r} may not contain control characters")
        if key.startswith(SYSTEM_PROPERTY_PREFIX):
            if not allow_system:
                raise errors.InvalidProperty(f"property key {key!r} is reserved for the broker ('__' prefix)")
            continue
        count += 1
        size += len(key.encode()) + len(value.encode())
    if count > PROPERTIES_MAX:
        raise errors.PropertiesTooLarge(f"{count} properties; at most {PROPERTIES_MAX} allowed")
    if size > PROPERTIES_BYTES_MAX:
        raise errors.PropertiesTooLarge(f"properties take {size} bytes; at most {PROPERTIES_BYTES_MAX} allowed")
    return dict(props)


def validate_message_id(message_id: object) -> str:
    if not isinstance(message_id, str) or not message_id.strip():
        raise errors.InvalidMessageId("message id is blank")
    if len(message_id) > MESSAGE_ID_CHARS_MAX or _has_control(message_id) or not message_id.isascii():
        raise errors.InvalidMessageId(
            f"message id {message_id[:40]!r} must be printable ASCII of at most {MESSAGE_ID_CHARS_MAX} characters"
        )
    return message_id


@dataclass(slots=True)
class TopicConfig:
    name: str
    queues: int = 4
    message_type: MessageType = MessageType.MIXED

    def to_json(self) -> dict:
        return {"name": self.name, "queues": self.queues, "message_type": self.message_type.name.lower()}

    @classmethod
    def from_json(cls, data: dict) -> "TopicConfig":
        return cls(data["name"], int(data["queues"]), MessageType.parse(data["message_type"]))


@dataclass(slots=True)
class SendResult:
    message_id: str
    topic: str
    queue_id: int
    queue_offset: int
    commit_offset: int
    duplicate: bool = False
    # Delayed sends only: pass to Broker.recall / Broker.reschedule (chronoq.timer.handle).
    recall_handle: str = ""


@dataclass(slots=True)
class Message:
    """A stored message as read back from the log."""

    topic: str
    queue_id: int
    queue_offset: int
    commit_offset: int
    message_id: str
    body: bytes
    tag: str = ""
    keys: tuple[str, ...] = ()
    properties: dict[str, str] = field(default_factory=dict)
    born_ms: int = 0
    stored_ms: int = 0
    deliver_at_ms: int = 0
    flags: int = 0
