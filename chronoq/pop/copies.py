"""The copies POP writes: a retry copy (``%RETRY%{group}_{topic}``, with its back-off) and a
dead-letter copy (``%DLQ%{group}``), the system topics that hold them, and the consumer's view
of a copy (origin topic and id, POP properties removed). Reads one message back from the store
for them. No state: every function takes the ``Broker``.
"""

from __future__ import annotations

from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core import errors, model
from chronoq.core.clock import Clock
from chronoq.core.model import Message
from chronoq.pop import names
from chronoq.pop.groups import GroupConfig
from chronoq.pop.inflight import Checkpoint
from chronoq.timer.keyed import REPLACE_PROP
from chronoq.pop.names import (PROP_DLQ_ORIGIN_MESSAGE_ID, PROP_DLQ_ORIGIN_TOPIC, PROP_NOT_BEFORE_MS,
                               PROP_ORIGIN_MESSAGE_ID, PROP_ORIGIN_TOPIC, PROP_RECONSUME_TIMES)


def read_one(broker: Broker, topic: str, qid: int, offset: int) -> Message | None:
    """The message at ``topic``/``qid``@``offset``; None when the store no longer has it."""
    try:
        res = broker.read(topic, qid, offset, 1)
    except errors.NotFound:
        return None
    if res.messages and res.messages[0].queue_offset == offset:
        return res.messages[0]
    return None


def system_topic(broker: Broker, name: str, queues: int) -> model.TopicConfig:
    """The system topic ``name``, created with ``queues`` queues (capped by ``max_queues``),
    or grown to that many if it has fewer."""
    cfg = broker.topics.get(name)
    want = min(queues, broker.config.max_queues)
    if cfg is None or cfg.queues < want:
        # A retry topic made for a shorter back-off table (e.g. 19 queues, then a restart with
        # 24 levels) grows rather than clamping levels into its last queue: a queue holding
        # several levels' delays makes a short-delay copy wait behind a long-delay head (late,
        # for up to the difference of the delays, for as long as the table stays). Growing
        # only adds empty queues: copies already waiting keep their queue and their absolute
        # __NOT_BEFORE_MS, and receives read every queue the topic has, so nothing is lost
        # or handed out early either way. A shorter table never shrinks the topic (counts
        # only grow); its upper queues just drain.
        kind = cfg.message_type if cfg is not None else model.MessageType.MIXED
        cfg = broker.create_topic(name, want, kind, system=True)
    return cfg


def retry_message(broker: Broker, ck: Checkpoint, m: Message, attempt: int, gcfg: GroupConfig,
                  now: int) -> OutgoingMessage:
    props = dict(m.properties)
    # A replace key is its pending timer message's: delivered, the key's work is done, and a copy
    # holding it is refused (it names no delivery time) and was dropped: the message lost.
    props.pop(REPLACE_PROP, None)
    origin_id = props.get(PROP_ORIGIN_MESSAGE_ID) or props.get(PROP_DLQ_ORIGIN_MESSAGE_ID) or m.message_id
    props[PROP_ORIGIN_TOPIC] = ck.topic
    props[PROP_ORIGIN_MESSAGE_ID] = origin_id
    props[PROP_RECONSUME_TIMES] = str(attempt)
    # A nack (ChangeInvisibleDuration above 0) named its wait: due at once, as in RocketMQ.
    # Otherwise the invisible time ran out, or a nack of 0 named none: the retry back-off
    # applies (docs/rocketmq.md).
    not_before = now if ck.named else names.not_before_ms(attempt, ck.delivered_ms, now, gcfg.retry_delays_ms)
    if not_before > now:
        props[PROP_NOT_BEFORE_MS] = str(not_before)
    else:
        props.pop(PROP_NOT_BEFORE_MS, None)
    delays = gcfg.retry_delays_ms
    cfg = system_topic(broker, names.retry_topic(ck.group, ck.topic), names.retry_queues(delays))
    return OutgoingMessage(cfg.name, m.body, tag=m.tag, keys=m.keys, properties=props,
                           queue_id=names.retry_queue(attempt, not_before, now, cfg.queues, delays),
                           born_ms=m.born_ms)


def dlq_message(broker: Broker, clock: Clock, ck: Checkpoint, m: Message) -> OutgoingMessage:
    v = view(m)
    props = v.properties if v is not m else dict(m.properties)
    props.pop(REPLACE_PROP, None)  # (as in retry_message)
    props[PROP_DLQ_ORIGIN_TOPIC] = v.topic
    props[PROP_DLQ_ORIGIN_MESSAGE_ID] = v.message_id
    cfg = system_topic(broker, names.dlq_topic(ck.group), names.DLQ_QUEUES)
    if broker.trace is not None:  # chronoq.broker.trace (a retried write may record it twice)
        broker.trace.dead_lettered(ck.group, v.topic, v.message_id, clock.wall_ms())
    return OutgoingMessage(cfg.name, m.body, tag=m.tag, keys=m.keys, properties=props, queue_id=0,
                           born_ms=m.born_ms)


def view(m: Message) -> Message:
    """The message as its consumer knows it: origin topic and id, POP properties removed."""
    props = dict(m.properties)
    topic, message_id = m.topic, m.message_id
    origin = props.pop(PROP_ORIGIN_TOPIC, None)
    if origin is not None:
        topic = origin
        message_id = props.pop(PROP_ORIGIN_MESSAGE_ID, None) or message_id
        props.pop(PROP_RECONSUME_TIMES, None)
        props.pop(PROP_NOT_BEFORE_MS, None)
    origin = props.pop(PROP_DLQ_ORIGIN_TOPIC, None)
    if origin is not None:
        topic = origin
        message_id = props.pop(PROP_DLQ_ORIGIN_MESSAGE_ID, None) or message_id
    return Message(topic=topic, queue_id=m.queue_id, queue_offset=m.queue_offset, commit_offset=m.commit_offset,
                   message_id=message_id, body=m.body, tag=m.tag, keys=m.keys, properties=props,
                   born_ms=m.born_ms, stored_ms=m.stored_ms, deliver_at_ms=m.deliver_at_ms, flags=m.flags)
