"""Delivery lanes: bounded pending queues with retry, back-off and blocking. Pure: no I/O.

One lane per delay level and one for timer messages (RocketMQ 4.9.3's asynchronous delivery, per
level). A lane holds the deliveries it has claimed, in due order:

    CLAIMED --write ok--> WRITTEN --durable (store.dispatched >= end)--> done (popped from the head)
       ^                     |
       +--write failed-------+ (sync failed: stays WRITTEN; only the fsync is retried, a written
                                copy is never written twice)

* **Flow control**: ``room()`` is what the lane may still claim (``pending_max`` minus what it
  holds). The caller stops scanning for due messages when it is 0, so nothing new piles up while
  writes lag.
* **Retry with back-off**: a failure (disk full, I/O error) sets ``retry_at_ms`` to
  ``backoff_ms * 2**(failures-1)`` ahead (capped); nothing is written before then.
* **Blocking**: after ``block_after`` consecutive failures the lane is *blocked*: it claims nothing
  new (room 0) and only retries what it holds, in order, until a retry succeeds. It never skips
  a failed delivery or reorders behind it.
* Completion is strictly in order from the head, so a level's offset only advances over a prefix.

A claim with ``prepared=None`` is a skip (a cancelled level message): it completes in order
without writing anything.
"""

from __future__ import annotations

from collections import deque

CLAIMED = 0
WRITTEN = 1
SKIP = 2


class Delivery:
    __slots__ = ("ref", "due_ms", "prepared", "state", "end", "commit_offset", "queue_offset")

    def __init__(self, ref, due_ms: int, prepared):
        self.ref = ref
        self.due_ms = due_ms
        self.prepared = prepared
        self.state = SKIP if prepared is None else CLAIMED
        self.end = 0  # commit-log offset just past the written copy
        self.commit_offset = -1
        self.queue_offset = -1  # the copy's offset in its real queue


class Lane:
    def __init__(self, name: str, pending_max: int, backoff_ms: int, backoff_max_ms: int, block_after: int):
        assert pending_max >= 1 and backoff_ms >= 1 and backoff_max_ms >= backoff_ms and block_after >= 1
        self.name = name
        self.pending_max = pending_max
        self.backoff_ms = backoff_ms
        self.backoff_max_ms = backoff_max_ms
        self.block_after = block_after
        self.pending: deque[Delivery] = deque()
        self.failures = 0
        self.retry_at_ms = 0
        self.blocked = False
        self.last_error = ""
        self.delivered = 0
        self.skipped = 0
        self.failed_total = 0
        self.times_blocked = 0
        # Times the pending queue filled up, so scanning for due messages paused (flow control).
        self.times_full = 0

    def room(self, now_ms: int) -> int:
        """How many more deliveries may be claimed now (0 while backing off or blocked)."""
        if self.blocked or now_ms < self.retry_at_ms:
            return 0
        return self.pending_max - len(self.pending)

    def claim(self, ref, due_ms: int, prepared) -> Delivery:
        assert len(self.pending) < self.pending_max, "claim beyond room()"
        d = Delivery(ref, due_ms, prepared)
        self.pending.append(d)
        if len(self.pending) == self.pending_max:
            self.times_full += 1
        return d

    def to_write(self, now_ms: int) -> list[Delivery]:
        """Claimed deliveries to write now (none while a back-off runs), in order."""
        if now_ms < self.retry_at_ms:
            return []
        return [d for d in self.pending if d.state == CLAIMED]

    def needs_durability(self, durable_upto: int, now_ms: int) -> bool:
        return now_ms >= self.retry_at_ms and any(d.state == WRITTEN and d.end > durable_upto for d in self.pending)

    @staticmethod
    def written(d: Delivery, commit_offset: int, end: int, queue_offset: int = -1) -> None:
        assert d.state == CLAIMED and end > commit_offset >= 0
        d.state = WRITTEN
        d.commit_offset = commit_offset
        d.end = end
        d.queue_offset = queue_offset

    def failed(self, now_ms: int, error: str) -> int:
        """Record a failed write/sync; return the back-off chosen (ms)."""
        self.failures += 1
        self.failed_total += 1
        self.last_error = error
        delay = min(self.backoff_max_ms, self.backoff_ms << min(self.failures - 1, 30))
        self.retry_at_ms = now_ms + delay
        if self.failures >= self.block_after and not self.blocked:
            self.blocked = True
            self.times_blocked += 1
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.retry_at_ms = 0
        self.blocked = False

    def complete(self, durable_upto: int) -> list[Delivery]:
        """Pop the finished prefix: skips, and written copies that are durable and visible."""
        done = []
        pending = self.pending
        while pending:
            d = pending[0]
            if d.state == SKIP or (d.state == WRITTEN and d.end <= durable_upto):
                done.append(pending.popleft())
            else:
                break
        for d in done:
            if d.state == SKIP:
                self.skipped += 1
            else:
                self.delivered += 1
        return done

    def next_deadline(self) -> int | None:
        """When this lane next needs a tick by itself: the end of its back-off, if it holds work."""
        if self.pending and self.retry_at_ms:
            return self.retry_at_ms
        return None

    def stats(self) -> dict:
        return {"pending": len(self.pending), "pending_max": self.pending_max, "failures": self.failures,
                "blocked": self.blocked, "retry_at_ms": self.retry_at_ms or None, "last_error": self.last_error,
                "delivered": self.delivered, "skipped": self.skipped, "failed_total": self.failed_total,
                "times_blocked": self.times_blocked, "times_full": self.times_full}
