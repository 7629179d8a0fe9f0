"""Value types shared by every layer (the rules for their fields: ``chronoq.core.validate``)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from chronoq.core import errors
# The rules for names and message fields live in chronoq.core.validate (one module that every entry
# point uses); the constants and the test other layers read are re-exported here.
from chronoq.core.validate import (GROUP_NAME_MAX, MESSAGE_GROUP_BYTES_MAX, MESSAGE_ID_CHARS_MAX,  # noqa: F401
                              PROPERTIES_BYTES_MAX, PROPERTIES_MAX, SYSTEM_GROUP_PREFIXES, SYSTEM_PROPERTY_PREFIX,
                              SYSTEM_TOPIC_PREFIXES, TOPIC_NAME_MAX, is_system_topic)


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
    # Sends with a replace key only (chronoq.timer.keyed): "none", "replaced:<message id>" or
    # "already_delivered:<message id>".
    replaced: str = ""


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
