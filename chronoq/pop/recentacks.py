"""Deliveries settled by an ack, remembered until their invisible time would have ended.

Why: a consumer whose ack answer was lost (a timeout, a dropped connection) acks again. RocketMQ's
broker answers that repeated ack OK; chronoq's checkpoint is gone by then (or its entry settled),
so the handle names nothing live and the ack was refused as stale, and the application could
not tell "already acked" from "redelivered to someone else". A handle found here, for the same
group and topic and before the delivery's invisible time ended, is answered as acked (nothing
changes). Past that time, or for a handle this memory let go, a repeated ack is refused as
before; so is any other use of an acked handle (change-invisible-time).

Pure and bounded: at most ``limit`` deliveries (oldest forgotten first), each an int key and a
3-tuple of references (~140 bytes with its dict slot: ~2.3 MB at the default). Memory only: after
a restart a repeated ack is refused.
"""

from __future__ import annotations

RECENT_ACKS_MAX = 16_384  # deliveries remembered (oldest forgotten first)


class RecentAcks:
    __slots__ = ("limit", "_seen")

    def __init__(self, limit: int = RECENT_ACKS_MAX) -> None:
        assert limit >= 0
        self.limit = limit
        self._seen: dict[int, tuple[str, str, int]] = {}  # ck_id << 8 | index -> (group, topic, deadline)

    def add(self, ck_id: int, index: int, group: str, topic: str, deadline_ms: int) -> None:
        """Delivery ``index`` of checkpoint ``ck_id`` was settled by an ack."""
        if not self.limit:
            return
        seen = self._seen
        if len(seen) >= self.limit:
            del seen[next(iter(seen))]  # (a dict keeps insertion order: the oldest goes)
        seen[ck_id << 8 | index] = (group, topic, deadline_ms)

    def repeated(self, ck_id: int, index: int, group: str, topic: str, now_ms: int) -> bool:
        """True when that delivery was acked for ``group``/``topic`` and its invisible time has
        not ended: an ack of it again is answered OK."""
        got = self._seen.get(ck_id << 8 | index)
        return got is not None and got[0] == group and got[1] == topic and now_ms < got[2]

    def __len__(self) -> int:
        return len(self._seen)
