"""What producers hand the broker and what it answers, as columns: ``OutgoingBatch`` in,
``Sent`` out (chronoq.broker.sending).

Columns, not an object per message: a SendMessage of 100 messages is read from the wire into
lists (chronoq.protocol.rocketmq.send), checked and encoded column by column, and answered from
lists; a Python object per message and field was a third of the broker's time per delayed
message. ``OutgoingMessage`` stays the embedded API's unit (tests, the CLI, features):
``OutgoingBatch.of`` is the one adapter from it, ``Sent.results`` the one back to ``SendResult``.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from chronoq.core.model import MessageType, SendResult


@dataclass(slots=True)
class OutgoingMessage:
    """What a producer hands the broker. Only ``topic`` and ``body`` are required."""

    topic: str
    body: bytes
    tag: str = ""
    keys: Sequence[str] = ()
    properties: dict[str, str] = field(default_factory=dict)
    message_id: str | None = None
    queue_id: int | None = None
    message_group: str | None = None
    born_ms: int | None = None
    message_type: MessageType | None = None
    # Delayed delivery (chronoq.timer): at most one of these. deliver_at_ms is epoch ms (at or
    # before now: delivered at once); delay_level is 1..len(timer_delay_levels), 0/None: no delay.
    deliver_at_ms: int | None = None
    delay_level: int | None = None


# OutgoingBatch's optional columns: (name, the OutgoingMessage field, the value meaning "not set").
# A column is None when no message of the batch sets it, so the common batch skips its rule.
_OPTIONAL = (("tags", "tag", ""), ("keys", "keys", ()), ("properties", "properties", {}),
             ("message_ids", "message_id", None), ("queue_ids", "queue_id", None),
             ("message_groups", "message_group", None), ("born_ms", "born_ms", None),
             ("message_types", "message_type", None), ("deliver_at_ms", "deliver_at_ms", None),
             ("delay_levels", "delay_level", None))


@dataclass(slots=True)
class OutgoingBatch:
    """A batch of messages as columns, one entry per message in each list, in order. Only
    ``topics`` and ``bodies`` are required; an optional column is None when no message sets it
    (meaning for each message what ``OutgoingMessage``'s default means)."""

    topics: list
    bodies: list
    tags: list | None = None
    keys: list | None = None
    properties: list | None = None
    message_ids: list | None = None
    queue_ids: list | None = None
    message_groups: list | None = None
    born_ms: list | None = None
    message_types: list | None = None
    deliver_at_ms: list | None = None
    delay_levels: list | None = None

    def __len__(self) -> int:
        return len(self.bodies)

    @classmethod
    def of(cls, messages: Iterable[OutgoingMessage]) -> "OutgoingBatch":
        """The columns of ``OutgoingMessage`` objects (the embedded callers' adapter)."""
        msgs = messages if type(messages) is list else list(messages)
        n = len(msgs)
        batch = cls(list(map(_topic, msgs)), list(map(_body, msgs)))
        for name, get, unset in _OPTIONAL_GETTERS:  # (C-level passes only: a lone message pays no frame)
            column = list(map(get, msgs))
            if column.count(None) != n if unset is None else any(column):
                setattr(batch, name, column)
        return batch

    def take(self, indices: Sequence[int]) -> "OutgoingBatch":
        """The messages at ``indices``, as a batch of their own."""
        pick = [i for i in indices]
        out = OutgoingBatch([self.topics[i] for i in pick], [self.bodies[i] for i in pick])
        for name, _attr, _unset in _OPTIONAL:
            column = getattr(self, name)
            if column is not None:
                setattr(out, name, [column[i] for i in pick])
        return out

    def message(self, i: int) -> OutgoingMessage:
        """Message ``i`` as an object (the transaction half's path, which keeps one)."""
        out = OutgoingMessage(self.topics[i], self.bodies[i])
        for name, attr, _unset in _OPTIONAL:
            column = getattr(self, name)
            if column is not None:
                value = column[i]
                setattr(out, attr, {} if attr == "properties" and value is None else value)
        return out


_topic, _body = operator.attrgetter("topic"), operator.attrgetter("body")
_OPTIONAL_GETTERS = tuple((name, operator.attrgetter(attr), unset) for name, attr, unset in _OPTIONAL)


@dataclass(slots=True)
class Sent:
    """The answer to a written batch, per message in order: its id, topic and queue (a delay-level
    message: its real ones), queue offset (-1: not in a queue until due), commit offset, recall
    handle (None: no message has one), whether it answers an earlier send (None: none does) and
    what a send with a replace key replaced (None: no message has one; chronoq.timer.keyed)."""

    message_ids: list
    topics: list
    queue_ids: list
    queue_offsets: list
    commit_offsets: list
    recall_handles: list | None = None
    duplicates: list | None = None
    replaced: list | None = None

    def results(self) -> list[SendResult]:
        """As ``SendResult`` objects (the embedded API)."""
        n = len(self.message_ids)
        recalls = self.recall_handles or [""] * n
        dups = self.duplicates or [False] * n
        replaced = self.replaced or [""] * n
        return [SendResult(mid, topic, qid, qoff, commit, dup, recall, rep)
                for mid, topic, qid, qoff, commit, dup, recall, rep
                in zip(self.message_ids, self.topics, self.queue_ids, self.queue_offsets, self.commit_offsets, dups,
                       recalls, replaced)]

    @classmethod
    def of(cls, results: list[SendResult]) -> "Sent":
        """The columns of ``SendResult`` objects (a batch answered message by message)."""
        return cls([r.message_id for r in results], [r.topic for r in results], [r.queue_id for r in results],
                   [r.queue_offset for r in results], [r.commit_offset for r in results],
                   [r.recall_handle for r in results] if any(r.recall_handle for r in results) else None,
                   [r.duplicate for r in results] if any(r.duplicate for r in results) else None,
                   [r.replaced for r in results] if any(r.replaced for r in results) else None)
