"""Dead letters of a consumer group: list them and send them back to their topics
(``chronoq dlq list|resend GROUP``; the console's DLQ resend can call the same).

A group's dead letters are the messages of ``%DLQ%<group>`` (one queue; ``chronoq.pop.copies``
writes them with their origin topic and id). They are never removed by a resend: a resend moves
a *cursor*, the consume offset of the broker's own group ``RESEND_GROUP`` on that topic (in
``offsets.json``), past what it sent. So ``list`` shows what a resend would send next (from the
cursor) or everything retained (``all``), each marked resent or not.

A resend, one request (``resend`` for an asyncio shell: the Admin service, the console; the
steps one by one for the embedded broker: ``plan_resend``, ``Broker.write``, ``Broker.flush``,
``resent``):

1. ``plan_resend`` reads up to ``limit`` dead letters from the cursor and makes each the message
   its consumer knew (origin topic, body, tag, keys, user properties, FIFO group) with the dead
   letter's own record id as its message id.
2. The caller writes them through the one send path (``Broker.write``: validation, the dedupe
   window, metrics) and waits until they are durable (the committer), whatever the flush policy.
3. ``resent`` moves the cursor past them and writes ``offsets.json`` (fsync) before the answer.

A failure between 2 and 3 leaves the cursor where it was, and the next resend sends the same
dead letters again: at least once, never lost. While the broker runs (the cursor's write failed,
say) the dedupe window answers such a repeat as a duplicate (same id, topic and body) within
``dedupe_window_ms``, so nothing is stored twice; after a crash (the window is memory only) they
are stored, and delivered, twice. A dead letter whose record retention deleted is skipped and
counted.
"""

from __future__ import annotations

from dataclasses import dataclass

from chronoq.broker.broker import OutgoingMessage
from chronoq.core import errors, validate
from chronoq.core.model import Message, MessageType
from chronoq.core.validate import PROP_MESSAGE_GROUP, SYSTEM_PROPERTY_PREFIX
from chronoq.pop import copies, names

# The cursor's group: a reserved prefix, so no consumer group can be named so, and group
# listings leave it out (``catalog.known_groups``).
RESEND_GROUP = "CHRONOQ_DLQ_RESEND"
DLQ_QUEUE = 0
LIMIT_MAX = 1000
LIST_LIMIT_DEFAULT = 20
RESEND_LIMIT_DEFAULT = 100
BODY_DEFAULT = 64
BODY_MAX = 4096


def dlq_topic(broker, group: str) -> str:
    """``%DLQ%<group>``; NotFound when the group never dead-lettered anything."""
    name = names.dlq_topic(validate.group_name(group))
    if name not in broker.topics:
        raise errors.NotFound(f"consumer group {group} has no dead letters (no topic {name})")
    return name


def cursor(broker, dlq: str) -> int:
    """The next dead letter a resend sends (the oldest retained when none was resent)."""
    lo, _hi = broker.queue_bounds(dlq, DLQ_QUEUE)
    at = broker.offsets.get(RESEND_GROUP, {}).get(dlq, {}).get(DLQ_QUEUE)
    return lo if at is None else max(at, lo)


def _limit(limit: int, default: int) -> int:
    if not 0 <= limit <= LIMIT_MAX:
        raise errors.ClientError(f"limit must be between 1 and {LIMIT_MAX}, not {limit}")
    return limit or default


@dataclass(frozen=True, slots=True)
class DeadLetters:
    letters: list[tuple[Message, Message, bool]]  # (record, the consumer's view of it, resent)
    min_offset: int
    max_offset: int
    cursor: int


def list_dead(broker, group: str, limit: int = 0, everything: bool = False) -> DeadLetters:
    """Up to ``limit`` dead letters from the cursor (``everything``: from the oldest retained)."""
    dlq = dlq_topic(broker, group)
    limit = _limit(limit, LIST_LIMIT_DEFAULT)
    lo, hi = broker.queue_bounds(dlq, DLQ_QUEUE)
    at = cursor(broker, dlq)
    start = lo if everything else at
    read = broker.read(dlq, DLQ_QUEUE, start, limit).messages if start < hi else []
    return DeadLetters([(m, copies.view(m), m.queue_offset < at) for m in read], lo, hi, at)


@dataclass(frozen=True, slots=True)
class Resend:
    dlq: str
    messages: list[OutgoingMessage]
    from_offset: int
    to_offset: int      # the cursor once they are durable
    skipped: int        # dead letters in the range whose record is gone


def plan_resend(broker, group: str, limit: int = 0) -> Resend:
    """Step 1: the next ``limit`` dead letters as messages to their topics (nothing written)."""
    dlq = dlq_topic(broker, group)
    limit = _limit(limit, RESEND_LIMIT_DEFAULT)
    start = cursor(broker, dlq)
    _lo, hi = broker.queue_bounds(dlq, DLQ_QUEUE)
    if start >= hi:
        return Resend(dlq, [], start, start, 0)
    res = broker.read(dlq, DLQ_QUEUE, start, limit)
    now = broker.clock.wall_ms()
    out = [_message(broker, m, now) for m in res.messages]
    end = res.messages[-1].queue_offset + 1 if res.messages else res.next_offset
    return Resend(dlq, out, start, end, end - start - len(out))


def _message(broker, m: Message, now_ms: int) -> OutgoingMessage:
    v = copies.view(m)
    props = v.properties
    user = {k: val for k, val in props.items() if not k.startswith(SYSTEM_PROPERTY_PREFIX)}
    # A topic that takes only delay messages gets it as one, due now (it was due long ago).
    cfg = broker.topics.get(v.topic)
    deliver_at = now_ms if cfg is not None and cfg.message_type is MessageType.DELAY else None
    return OutgoingMessage(v.topic, m.body, tag=m.tag, keys=m.keys, properties=user, message_id=m.message_id,
                           message_group=props.get(PROP_MESSAGE_GROUP) or None, deliver_at_ms=deliver_at)


def resent(broker, plan: Resend) -> None:
    """Step 3: the plan's messages are durable; move the cursor past them (fsync)."""
    if plan.to_offset != plan.from_offset:
        broker.set_offsets(RESEND_GROUP, plan.dlq, {DLQ_QUEUE: plan.to_offset})


def remaining(broker, plan: Resend) -> int:
    _lo, hi = broker.queue_bounds(plan.dlq, DLQ_QUEUE)
    return max(0, hi - cursor(broker, plan.dlq))


@dataclass(frozen=True, slots=True)
class Resent:
    resent: int
    duplicates: int     # answered by the dedupe window (sent already, the cursor had not moved)
    skipped: int
    from_offset: int
    to_offset: int
    remaining: int


async def resend(broker, durable, group: str, limit: int = 0) -> Resent:
    """One resend request, steps 1-3, for an asyncio shell (the Admin service, the console):
    ``await durable()`` returns once everything written so far is durable and dispatched."""
    plan = plan_resend(broker, group, limit)
    duplicates = 0
    if plan.messages:
        broker.check_space()
        results = broker.write(plan.messages)  # the one send path
        duplicates = sum(1 for r in results if r.duplicate)
        await durable()  # whatever the flush policy: the cursor moves only past durable copies
    if broker.closed:
        raise errors.ClosedError("the broker is stopping")
    resent(broker, plan)
    return Resent(len(plan.messages), duplicates, plan.skipped, plan.from_offset, plan.to_offset,
                  remaining(broker, plan))

