"""What one receive reads from one queue: fresh messages from the group's pop offset, and, for a
FIFO group, the entries due for redelivery in place merged with them in queue order.

``read_fresh`` skips messages the tag filter rejects, offsets that recovered CKs cover (the
restart skip set) and retry copies of another topic, and stops (without passing it) at a retry
message whose back-off has not ended: the queue is then *blocked* until that time (the caller's
``blocked`` set; ``PopService.tick`` wakes long polls when it ends). Reads through the
``Broker``; writes nothing.
"""

from __future__ import annotations

from chronoq.broker.broker import Broker
from chronoq.pop.inflight import QueueState
from chronoq.pop.names import PROP_NOT_BEFORE_MS, PROP_ORIGIN_TOPIC, PROP_RECONSUME_TIMES

SCAN_MAX = 4_096              # messages one receive may pass over in one queue (filters)
READ_CHUNK = 64               # read size when a filter or skip set may reject messages


def read_fresh(broker: Broker, blocked: set[QueueState], qs: QueueState, topic: str, popped: str, qid: int,
               hi: int, need: int, now: int, tags: frozenset[str] | None, retry: bool) -> tuple[list, int]:
    """Messages from the pop offset: [(message, attempt, None, -1)], and the next pop offset.

    Skips messages the filter rejects, offsets recovered CKs cover, and retry copies of
    another topic; stops (without passing it) at a retry message whose back-off has not ended.
    """
    taken: list = []
    offset = qs.pop_offset
    skip = qs.skip
    scanned = 0
    read = broker.read
    while len(taken) < need and offset < hi and scanned < SCAN_MAX:
        want = need - len(taken) if tags is None and not skip else min(READ_CHUNK, hi - offset)
        res = read(popped, qid, offset, want)
        if not res.messages:
            if res.next_offset <= offset:
                break
            offset = res.next_offset
            continue
        for m in res.messages:
            off = m.queue_offset
            scanned += 1
            if skip and off in skip:
                offset = off + 1
                continue
            attempt = 1
            if retry:
                props = m.properties
                if props.get(PROP_ORIGIN_TOPIC) != topic:
                    offset = off + 1
                    continue
                not_before = _int(props.get(PROP_NOT_BEFORE_MS), 0)
                if not_before > now:
                    qs.blocked_until = not_before
                    blocked.add(qs)
                    return taken, offset
                attempt = _int(props.get(PROP_RECONSUME_TIMES), 0) + 1
            elif tags is not None and m.tag not in tags:
                offset = off + 1
                continue
            taken.append((m, attempt, None, -1))
            offset = off + 1
            if len(taken) >= need:
                return taken, offset
        offset = max(offset, res.next_offset)
    return taken, offset


def merge_pending(qs: QueueState, fresh: list, next_offset: int, need: int) -> tuple[list, int]:
    """FIFO in-place redelivery: pending entries and fresh messages, in queue order."""
    items = []
    pending_offsets = set()
    for ck in qs.pending:
        for i in ck.unsettled():
            off = ck.offsets[i]
            pending_offsets.add(off)
            items.append((off, None, ck.attempts[i] + 1, ck, i))
    items.extend((m.queue_offset, m, attempt, None, -1) for m, attempt, _, _ in fresh
                 if m.queue_offset not in pending_offsets)
    items.sort(key=lambda item: item[0])
    chosen, rest = items[:need], items[need:]
    cut = [item[0] for item in rest if item[3] is None]
    if cut:  # fresh messages that did not fit are read again next time
        next_offset = min(cut)
    return [(m, attempt, ck, i) for _, m, attempt, ck, i in chosen], next_offset


def _int(text: str | None, default: int) -> int:
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        return default
