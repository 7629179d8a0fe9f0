"""A canonical, comparable view of the POP in-flight books.

The in-flight books are rebuilt on open from the POP log (``poplog.py``, one of the source logs
named in docs/storage.md) and the consume offsets. What a restart must keep
is every unsettled delivery: which message (popped topic, queue, offset), for which group and
asked-for topic, under which CK id (its receipt handles stay valid), its attempt and when it
becomes visible again. The rest is how the books are held and is left out: the merge buffer
(``logged``/``durable``), a FIFO CK's ``expired`` flag (its deadline has passed: the next tick
decides it again), the pop offsets and skip sets (a restart reads from the consume offset and
skips what CKs covered, a live broker from its pop offset: the same messages either way), and
auto-renew extensions (in memory only by design, ``inflight.extend``).

Read-only.
"""

from __future__ import annotations

from typing import NamedTuple


class InflightEntry(NamedTuple):
    group: str
    topic: str          # the topic the consumer asked for
    popped: str         # where the message was read (the topic, or the group's retry topic)
    queue_id: int
    queue_offset: int
    ck_id: int
    attempt: int
    deadline_ms: int
    pop_ms: int
    delivered_ms: int
    fifo: bool
    named: bool


def inflight_books(pop) -> list[InflightEntry]:
    """Every unsettled delivery of a ``PopService``, sorted."""
    out = []
    for ck in pop._inflight.cks.values():
        qs = ck.queue
        for i in ck.unsettled():
            out.append(InflightEntry(ck.group, ck.topic, qs.topic, qs.queue_id, ck.offsets[i], ck.ck_id,
                                     ck.attempts[i], ck.deadline_ms, ck.pop_ms, ck.delivered_ms, ck.fifo,
                                     ck.named))
    out.sort()
    return out

