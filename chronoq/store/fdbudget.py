"""One cap on the file descriptors that the consume queues of a store hold open.

A consume queue keeps its files open once touched (``ConsumeQueue._fd``): one or two per queue
in use. Topics are created by clients (auto-create is on by default), so without a cap a client
that writes to a few thousand topics runs the process out of descriptors (``EMFILE``): measured
with a soft limit of 1,024, the 1,000th topic's send failed, and from then on the broker could
not save its topic table, write a checkpoint or accept a connection. A broker with that many
topics could not even start again (loading a queue opens its first and last files).

``FdBudget`` tracks every open consume-queue file, oldest opened first, and past ``limit``
closes the oldest (its owner's ``_evict``): the next use of that file opens it again (~10 us).
Oldest-opened rather than least-recently-used: no bookkeeping on the hit path (every put and
read), and a reader sweeping old files of many queues only evicts what was opened before it.
Safe to close at any time on the thread that uses the queues: syncs off the loop go by path
(``ConsumeQueue.take_dirty``), and ``ConsumeQueue.sync`` opens an evicted dirty file again. One
thread at a time uses a store's queues (the event loop; a replica's follower worker), so no other
thread can hold a descriptor the budget closes; a second thread reading queue files would need a
lock around the descriptor's use, not only around this bookkeeping.

The default limit leaves most of the process's descriptors to connections and other files:
a quarter of the soft ``RLIMIT_NOFILE``, between ``LIMIT_MIN`` and ``LIMIT_MAX``.
"""

from __future__ import annotations

import resource
from collections import OrderedDict

LIMIT_MIN = 64
LIMIT_MAX = 8192


def default_limit() -> int:
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return LIMIT_MAX
    return max(LIMIT_MIN, min(LIMIT_MAX, soft // 4))


class FdBudget:
    def __init__(self, limit: int | None = None) -> None:
        self.limit = default_limit() if limit is None else limit
        assert self.limit >= 1
        self._open: OrderedDict[tuple[object, int], None] = OrderedDict()  # (owner, key), oldest first
        self.evictions = 0

    def opened(self, owner, key: int) -> None:
        """``owner`` opened its file ``key``: close the oldest open ones past the limit (never
        this one: it is the newest)."""
        self._open[(owner, key)] = None
        while len(self._open) > self.limit:
            (old_owner, old_key), _ = self._open.popitem(last=False)
            old_owner._evict(old_key)
            self.evictions += 1

    def closed(self, owner, key: int) -> None:
        """``owner`` closed its file ``key`` itself (file removed, queue closed)."""
        self._open.pop((owner, key), None)

    def __len__(self) -> int:
        return len(self._open)
