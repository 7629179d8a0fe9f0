"""One comparable view of everything a broker derives from its sources (docs/storage.md).

``derived_digest(broker, pop)`` gathers the per-structure digests (``chronoq.store.digest``,
``chronoq.timer.digest``, ``chronoq.pop.digest``) with the consumer-group offsets and topic
configs they are read against. Two brokers whose digests are equal hand every reader and every
consumer group the same messages, at the same offsets, at the same times: a broker rebuilt from
its logs alone must equal the live one (tests/integration/test_rebuild_from_log.py), and a
follower can use it to check it applies the leader's log byte for byte.

Read-only; call it between requests (on the broker's thread).
"""

from __future__ import annotations

from chronoq.pop.digest import inflight_books
from chronoq.store.digest import queue_digest
from chronoq.timer.digest import pending_timers


def group_offsets(broker) -> dict[tuple[str, str, int], int]:
    """``{(group, topic, queue id): next offset to consume}`` as the broker holds them."""
    return {(group, topic, qid): offset
            for group, topics in broker.offsets.items()
            for topic, queues in topics.items()
            for qid, offset in queues.items()}


def derived_digest(broker, pop=None) -> dict:
    """``{"log", "queues", "timers", "offsets", "topics"[, "inflight", "groups"]}`` (see the modules)."""
    out = {
        # The log's extent: opening a directory must not have written anything to it.
        "log": (broker.store.log.min_offset, broker.store.log.written),
        "queues": queue_digest(broker.store),
        "timers": pending_timers(broker.timer),
        "offsets": group_offsets(broker),
        "topics": {name: cfg.to_json() for name, cfg in sorted(broker.topics.items())},
    }
    if pop is not None:
        out["inflight"] = inflight_books(pop)
        out["groups"] = {g.name: g.to_json() for g in pop.list_groups()}
    return out
