"""Read-only reports over POP's in-flight books, for admin reports (``chronoq group list``, the
console, ``/metrics``): lag per (group, topic), deliveries in flight, the topics each group
consumes. Computed on demand from the ``Inflight`` books and the ``Broker``; nothing is kept.
"""

from __future__ import annotations

from chronoq.broker.broker import Broker
from chronoq.core import errors, model, validate
from chronoq.pop import names
from chronoq.pop.inflight import Inflight


def lag(broker: Broker, inflight: Inflight, group: str, topic: str) -> int:
    """Messages of ``topic`` (and the group's retry copies) this group has not popped yet."""
    validate.group_name(group)
    if topic not in broker.topics:
        raise errors.TopicNotFound(f"topic {topic!r} does not exist")
    total = 0
    for name in (topic, names.retry_topic(group, topic)):
        cfg = broker.topics.get(name)
        if cfg is None:
            continue
        for qid in range(cfg.queues):
            lo, hi = broker.queue_bounds(name, qid)
            qs = inflight.queues.get((group, name, qid))
            if qs is not None:
                start = qs.pop_offset
            else:
                committed = broker.get_offset(group, name, qid)
                start = lo if committed is None else committed
            total += max(0, hi - max(start, lo))
    return total


def inflight_count(inflight: Inflight) -> int:
    """Deliveries handed out and not yet settled (for metrics and tests)."""
    return sum(len(ck.unsettled()) for ck in inflight.cks.values() if not ck.expired)


def inflight_by_topic(inflight: Inflight) -> dict[tuple[str, str], int]:
    """Deliveries handed out and not yet settled per (group, topic the consumer asked for).

    Every (group, user topic) with POP state in memory is a key, 0 when nothing is in flight;
    retried deliveries count under their origin topic. For admin reports (``group list``).
    """
    out: dict[tuple[str, str], int] = {}
    for (group, topic, _qid) in inflight.queues:
        if not model.is_system_topic(topic):
            out.setdefault((group, topic), 0)
    for ck in inflight.cks.values():
        if not ck.expired:
            key = (ck.group, ck.topic)
            out[key] = out.get(key, 0) + len(ck.unsettled())
    return out


def consumed_topics(broker: Broker, inflight: dict[tuple[str, str], int]) -> dict[str, set[str]]:
    """group -> the existing user topics it consumes: POP state in memory (``inflight_by_topic``)
    or a committed offset. ``group list`` and the lag gauge."""
    topics = broker.topics
    consumed: dict[str, set[str]] = {}
    for (group, topic) in inflight:
        if topic in topics:
            consumed.setdefault(group, set()).add(topic)
    for group, offsets in broker.offsets.items():
        mine = {t for t in offsets if t in topics and not model.is_system_topic(t)}
        if mine:
            consumed.setdefault(group, set()).update(mine)
    return consumed
