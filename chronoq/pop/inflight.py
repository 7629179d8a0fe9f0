"""In-flight POP state: checkpoints (CKs), ack bitmaps, deadlines, FIFO blocking, attempt ids.

Pure core: no I/O and no clock; every time-dependent call takes ``now_ms``. The shell
(``service.py``) reads and writes messages and files; this module keeps the books and decides
what is due. Durable records go to an injected ``Sink`` (the POP log's in-memory buffer).

Terms
-----
QueueState  one per (group, popped topic, queue id): RocketMQ's ``topic@group@queue`` lock key.
            The broker is single-threaded (see ``broker.py``), so each call is the lock.
            ``pop_offset``: the next offset a receive reads. ``committed``: the consume offset
            last given to ``Broker.commit_offset``.
CK          one per (receive, queue): the offsets handed out, each one's delivery attempt, pop
            time, invisible deadline and a bitmap of *settled* entries.
settled     acked, moved to a successor CK (change-invisible-time, FIFO redelivery),
            dead-lettered, or gone from the store. A revived CK is finished as a whole.
logged      the CK's record is in the POP log (maybe not yet fsynced); later settlements of a
            logged CK are logged too. A CK starts unlogged (the in-memory merge buffer) and is
            logged once it has lived ``buffer_ms`` (counted from its *lineage*: a successor
            inherits its source's start), or at once when it succeeds a logged CK.
durable     its record is fsynced.
unsafe      offsets the consume offset must not pass: entries of CKs that are not durable and
            not settled. An acked message, or one whose CK is durable, needs no queue position.

Invariants (``check`` verifies them; the tests call it)
--------------------------------------------------------
I1  An entry holds exactly one unsafe reference iff its CK is live, not durable, not settled.
I2  consume offset = min(pop_offset, lowest unsafe offset); what is committed never decreases.
I3  A successor CK is logged before any record saying its source's entry is settled: before the
    ACK record when the source is logged, before the source's own CK record (whose bitmap says
    it) when the source is logged later (aged, or sealed by a revive). The restart's skip set
    holds every offset of every CK in the log, so the log must never lose sight of a message (a
    torn tail keeps a prefix: at worst both, never neither).
I4  CK ids are ``generation << 32 | sequence`` and the generation grows at every open and
    compaction, so an id (and so a receipt handle) is never reused.
I5  FIFO: while a FIFO CK of a queue is in flight (live, not expired), ``fifo_inflight > 0`` and
    the queue hands out nothing. Expired FIFO CKs wait in ``pending`` to be redelivered in place.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Iterable, Protocol

from chronoq.core import errors

ENTRIES_MAX = 32  # entries per CK: the bitmap is a u32 on disk
ATTEMPT_CACHE_MAX = 4096
# The deadline heap is lazy (acked CKs leave their entry behind until it surfaces); rebuild it
# when stale entries outnumber live CKs this much, so memory follows what is in flight.
HEAP_SLACK = 4096
_heappush = heapq.heappush
_heappop = heapq.heappop


class Sink(Protocol):
    """Where durable records go (``poplog.PopLog``). Calls only buffer; no I/O happens here."""

    def add_ck(self, ck: "Checkpoint") -> None: ...

    def add_ack(self, ck_id: int, index: int) -> None: ...

    def add_done(self, ck_id: int) -> None: ...


class QueueState:
    __slots__ = ("group", "topic", "queue_id", "pop_offset", "committed", "unsafe", "_heap", "skip",
                 "fifo_inflight", "pending", "blocked_until")

    def __init__(self, group: str, topic: str, queue_id: int, pop_offset: int, committed: int):
        assert pop_offset >= 0
        self.group = group
        self.topic = topic
        self.queue_id = queue_id
        self.pop_offset = pop_offset
        self.committed = committed          # -1: nothing committed yet
        self.unsafe: dict[int, int] = {}    # offset -> references
        self._heap: list[int] = []          # unsafe offsets (lazy: may hold released ones)
        self.skip: set[int] = set()         # offsets covered by CKs recovered from the log
        self.fifo_inflight = 0              # live FIFO CKs not yet expired
        self.pending: list[Checkpoint] = []  # expired FIFO CKs awaiting in-place redelivery
        self.blocked_until = 0              # retry queue: head not due before this (0: none)

    def hold(self, offset: int) -> None:
        n = self.unsafe.get(offset, 0)
        if not n:
            _heappush(self._heap, offset)
        self.unsafe[offset] = n + 1

    def release(self, offset: int) -> None:
        n = self.unsafe[offset] - 1
        assert n >= 0
        if n:
            self.unsafe[offset] = n
        else:
            del self.unsafe[offset]

    def consume_offset(self) -> int:
        """Everything below is acked, filtered out, revived, or covered by a durable CK."""
        heap, unsafe = self._heap, self.unsafe
        while heap and heap[0] not in unsafe:
            _heappop(heap)
        if heap and heap[0] < self.pop_offset:
            return heap[0]
        return self.pop_offset

    def __repr__(self) -> str:
        return f"QueueState({self.topic}@{self.group}@{self.queue_id} pop={self.pop_offset})"


class Checkpoint:
    __slots__ = ("ck_id", "group", "topic", "queue", "offsets", "attempts", "pop_ms", "delivered_ms",
                 "aging_ms", "deadline_ms", "bits", "full", "fifo", "logged", "durable", "expired", "live",
                 "renew_until_ms", "client_id", "moved", "named")

    def __init__(self, ck_id: int, group: str, topic: str, queue: QueueState, offsets: list[int],
                 attempts: list[int], pop_ms: int, delivered_ms: int, aging_ms: int, deadline_ms: int,
                 fifo: bool):
        n = len(offsets)
        assert 1 <= n <= ENTRIES_MAX and len(attempts) == n, (n, len(attempts))
        assert all(a >= 1 for a in attempts)
        self.ck_id = ck_id
        self.group = group
        self.topic = topic             # the topic the consumer asked for (acks must name it)
        self.queue = queue             # where the entries were read (origin or retry topic)
        self.offsets = offsets
        self.attempts = attempts       # delivery attempt of each entry (1 = first delivery)
        self.pop_ms = pop_ms
        self.delivered_ms = delivered_ms  # when these deliveries began (back-off is measured from it)
        self.aging_ms = aging_ms       # start of the lineage, for the merge buffer
        self.deadline_ms = deadline_ms  # end of the invisible time
        self.bits = 0                  # settled entries
        self.full = (1 << n) - 1
        self.fifo = fifo
        self.logged = False
        self.durable = False
        self.expired = False
        self.live = True
        self.renew_until_ms = 0        # auto-renew (renew.py): extended, not revived, until then
        # The invisible time is one the client named (ChangeInvisibleDuration above 0: a nack with
        # its own wait): when it ends the message is due at once, no retry back-off.
        self.named = False
        self.client_id = ""            # the receiving client, for auto-renew
        # Unlogged: the successors its settled entries moved to while neither was logged; they
        # are logged before it (I3). None once logged.
        self.moved: list[Checkpoint] | None = None

    def unsettled(self) -> list[int]:
        bits = self.bits
        return [i for i in range(len(self.offsets)) if not bits >> i & 1]

    def __repr__(self) -> str:
        return (f"CK({self.ck_id:#x} {self.topic}@{self.group}@{self.queue.queue_id} {self.offsets} "
                f"bits={self.bits:b} deadline={self.deadline_ms})")


class Inflight:
    def __init__(self, sink: Sink | None, *, generation: int, buffer_ms: int):
        assert buffer_ms >= 0
        self.sink = sink
        self.buffer_ms = buffer_ms
        self.cks: dict[int, Checkpoint] = {}
        self.queues: dict[tuple[str, str, int], QueueState] = {}
        self.pairs: dict[tuple[str, str], int] = {}  # (group, topic) -> its queues in ``queues``
        self.dirty: set[QueueState] = set()   # consume offset may have moved
        self._deadlines: list[tuple[int, int]] = []  # (deadline_ms, ck_id), lazy
        self._aging: list[tuple[int, int]] = []      # (log-by ms, ck_id) of unlogged CKs, lazy
        self._attempts: OrderedDict[tuple, tuple[list, list]] = OrderedDict()
        # CKs being revived or forwarded: their copies are written and wait for their fsync. Their
        # handles are already stale (an ack now could not stop the copy), and nothing else touches
        # them until ``revive.Reviver`` completes or postpones them.
        self.reviving: set[int] = set()
        self._id_base = 0
        self._seq = 0
        self.set_generation(generation)

    # ----------------------------------------------------------------- ids and queues
    def set_generation(self, generation: int) -> None:
        assert 0 < generation < 1 << 32
        self._id_base = generation << 32
        self._seq = 0

    @property
    def generation(self) -> int:
        """The generation new CK ids carry."""
        return self._id_base >> 32

    def _new_id(self) -> int:
        self._seq += 1
        assert self._seq < 1 << 32, "CK sequence exhausted; compaction starts a new generation"
        return self._id_base | self._seq

    def add_queue(self, qs: QueueState) -> QueueState:
        key = (qs.group, qs.topic, qs.queue_id)
        assert key not in self.queues
        self.queues[key] = qs
        pair = (qs.group, qs.topic)
        self.pairs[pair] = self.pairs.get(pair, 0) + 1
        return qs

    def remove_queue(self, qs: QueueState) -> None:
        """Forget a queue's state (an operator's ``forget``; nothing of it may be in flight)."""
        del self.queues[(qs.group, qs.topic, qs.queue_id)]
        pair = (qs.group, qs.topic)
        left = self.pairs[pair] - 1
        if left:
            self.pairs[pair] = left
        else:
            del self.pairs[pair]
        self.dirty.discard(qs)

    # ----------------------------------------------------------------- creating CKs
    def open(self, qs: QueueState, topic: str, offsets: list[int], attempts: list[int], now_ms: int,
             invisible_ms: int, *, fifo: bool, delivered_ms: int | None = None,
             aging_ms: int | None = None, log_now: bool = False, named: bool = False) -> Checkpoint:
        """A new CK for entries just handed out (or handed on by a settled source).

        Ensures: every entry holds an unsafe reference (I1); the CK is due at
        ``now_ms + invisible_ms``; it is logged now when ``log_now`` or its lineage is older
        than the merge buffer, else queued for ``age``.
        """
        ck = Checkpoint(self._new_id(), qs.group, topic, qs, offsets, attempts, now_ms,
                        now_ms if delivered_ms is None else delivered_ms,
                        now_ms if aging_ms is None else aging_ms, now_ms + invisible_ms, fifo)
        ck.named = named
        if len(self._deadlines) > 2 * len(self.cks) + HEAP_SLACK:
            self._deadlines = [(c.deadline_ms, c.ck_id) for c in self.cks.values() if not c.expired]
            heapq.heapify(self._deadlines)
        self.cks[ck.ck_id] = ck
        for offset in offsets:
            qs.hold(offset)
        _heappush(self._deadlines, (ck.deadline_ms, ck.ck_id))
        if fifo:
            qs.fifo_inflight += 1
        log_by = ck.aging_ms + self.buffer_ms
        if log_now or log_by <= now_ms:
            self._log(ck)
        else:
            _heappush(self._aging, (log_by, ck.ck_id))
        return ck

    def restore(self, qs: QueueState, ck_id: int, topic: str, offsets: list[int], attempts: list[int],
                pop_ms: int, delivered_ms: int, deadline_ms: int, bits: int, fifo: bool,
                named: bool = False) -> Checkpoint:
        """A CK read back from the POP log: logged and durable, so it holds no unsafe reference."""
        assert ck_id not in self.cks
        ck = Checkpoint(ck_id, qs.group, topic, qs, offsets, attempts, pop_ms, delivered_ms, pop_ms,
                        deadline_ms, fifo)
        assert bits & ck.full == bits and bits != ck.full
        ck.bits = bits
        ck.named = named
        ck.logged = ck.durable = True
        self.cks[ck_id] = ck
        _heappush(self._deadlines, (deadline_ms, ck_id))
        if fifo:
            qs.fifo_inflight += 1
        return ck

    def seal(self, ck: Checkpoint) -> None:
        """Log ``ck`` now if it is not (before it is finished or settled for good), so the
        log, not only the consume offset, says its offsets are done."""
        if not ck.logged:
            self._log(ck)

    def _log(self, ck: Checkpoint) -> int:
        """Log ``ck``, after the unlogged successors its bitmap says entries moved to (I3),
        found down the chain, also through successors settled in memory meanwhile. Returns how
        many CKs were logged."""
        assert not ck.logged and self.sink is not None
        first: dict[int, Checkpoint] = {}  # by id: FIFO successors can hold several entries
        todo = [ck]
        while todo:  # a loop, not recursion: a client may change one message many times
            c = todo.pop()
            if c.moved:
                todo.extend(s for s in c.moved if not s.logged)
                c.moved = None
            if c is not ck and c.live:
                first[c.ck_id] = c
        # A successor is opened after its source, so its id is higher: newest first puts every
        # successor before its source.
        for _, c in sorted(first.items(), reverse=True):
            assert not c.logged
            c.logged = True
            self.sink.add_ck(c)
        ck.logged = True
        self.sink.add_ck(ck)
        return len(first) + 1

    # ----------------------------------------------------------------- handles
    def find(self, ck_id: int, index: int, queue_id: int, queue_offset: int, group: str,
             topic: str) -> Checkpoint:
        """The live CK a receipt handle names, or InvalidReceiptHandle (unknown or stale)."""
        ck = self.cks.get(ck_id)
        if ck is None or ck_id in self.reviving:
            raise errors.InvalidReceiptHandle(
                "receipt handle is stale or unknown (acked, revived after its invisible time, "
                "replaced by change-invisible-time, or from another broker)")
        if ck.group != group or ck.topic != topic:
            raise errors.InvalidReceiptHandle(
                # (not naming the handle's own group and topic: with access control on, a caller
                # of another group must not learn them)
                f"receipt handle belongs to another consumer group or topic than {group!r}/{topic!r}")
        if (index >= len(ck.offsets) or ck.offsets[index] != queue_offset
                or ck.queue.queue_id != queue_id):
            raise errors.InvalidReceiptHandle("receipt handle does not match its checkpoint")
        if ck.bits >> index & 1:
            raise errors.InvalidReceiptHandle(
                "receipt handle is stale (already acked, or replaced by change-invisible-time)")
        return ck

    # ----------------------------------------------------------------- settling
    def settle(self, ck: Checkpoint, index: int, successor: Checkpoint | None = None) -> None:
        """Mark entry ``index`` settled; ``successor``: the CK it moved to (change-invisible-time,
        FIFO redelivery), opened already. Ensures: I1 and I3 still hold; a fully settled CK is
        removed."""
        bit = 1 << index
        assert ck.live and not ck.bits & bit, (ck, index)
        ck.bits |= bit
        if successor is not None and not ck.logged and not successor.logged:
            if ck.moved is None:
                ck.moved = [successor]
            elif successor not in ck.moved:
                ck.moved.append(successor)
        if not ck.durable:
            ck.queue.release(ck.offsets[index])
            self.dirty.add(ck.queue)
        if ck.logged:
            self.sink.add_ack(ck.ck_id, index)  # type: ignore[union-attr]
        if ck.bits == ck.full:
            self._remove(ck)

    def change(self, ck: Checkpoint, index: int, now_ms: int, invisible_ms: int) -> Checkpoint:
        """Change-invisible-time: a successor CK for one entry; the old entry is settled. A time
        above 0 is the client's own wait (``named``: due again at its end, no back-off); 0 is a
        nack with no wait of its own (the Node push consumer's, which has no retry policy): the
        retry back-off spaces those."""
        new = self.open(ck.queue, ck.topic, [ck.offsets[index]], [ck.attempts[index]], now_ms,
                        invisible_ms, fifo=ck.fifo, delivered_ms=ck.delivered_ms,
                        aging_ms=ck.aging_ms, log_now=ck.logged, named=invisible_ms > 0)
        self.settle(ck, index, new)  # after open: the successor is logged first (I3)
        return new

    def finish(self, ck: Checkpoint) -> None:
        """The CK's unsettled entries were revived (or dead-lettered): drop it as a whole."""
        assert ck.live
        if not ck.durable:
            for i in ck.unsettled():
                ck.queue.release(ck.offsets[i])
            self.dirty.add(ck.queue)
        if ck.logged and ck.bits != ck.full:
            self.sink.add_done(ck.ck_id)  # type: ignore[union-attr]
        self._remove(ck)

    def expire(self, ck: Checkpoint) -> None:
        """FIFO: the invisible time ended; the unsettled entries wait for in-place redelivery."""
        assert ck.live and ck.fifo and not ck.expired and ck.bits != ck.full
        ck.expired = True
        qs = ck.queue
        qs.fifo_inflight -= 1
        assert qs.fifo_inflight >= 0
        qs.pending.append(ck)

    def _remove(self, ck: Checkpoint) -> None:
        ck.live = False
        del self.cks[ck.ck_id]
        if ck.fifo:
            qs = ck.queue
            if ck.expired:
                qs.pending.remove(ck)
            else:
                qs.fifo_inflight -= 1
                assert qs.fifo_inflight >= 0

    # ----------------------------------------------------------------- time
    def due(self, now_ms: int, limit: int, entries_max: int | None = None) -> list[Checkpoint]:
        """Up to ``limit`` in-flight CKs whose invisible time has ended, earliest first; with
        ``entries_max``, no more CKs once their unsettled entries reach it (the first is always
        taken, so a tick makes progress whatever the CK's size)."""
        out: list[Checkpoint] = []
        seen: set[int] = set()  # a rebuilt heap may hold an id twice
        heap, cks, reviving = self._deadlines, self.cks, self.reviving
        waiting = []  # being forwarded to the DLQ: due again if that fails
        entries, entries_max = 0, limit * ENTRIES_MAX if entries_max is None else entries_max
        while heap and heap[0][0] <= now_ms and len(out) < limit and entries < entries_max:
            deadline, ck_id = _heappop(heap)
            ck = cks.get(ck_id)
            if ck is not None and ck.deadline_ms == deadline and not ck.expired and ck_id not in seen:
                seen.add(ck_id)
                if ck_id in reviving:
                    waiting.append((deadline, ck_id))
                else:
                    out.append(ck)
                    entries += len(ck.offsets) - ck.bits.bit_count()
        for item in waiting:
            _heappush(heap, item)
        return out

    def postpone(self, ck: Checkpoint, deadline_ms: int) -> None:
        """Revive could not finish (storage error): try again at ``deadline_ms``."""
        assert ck.live and not ck.expired
        ck.deadline_ms = deadline_ms
        _heappush(self._deadlines, (deadline_ms, ck.ck_id))

    def renew_for(self, ck: Checkpoint, client_id: str, renew_until_ms: int) -> None:
        """Mark a CK just opened by an auto-renew receive (``renew.py``)."""
        assert ck.live and renew_until_ms >= ck.deadline_ms and client_id
        ck.renew_until_ms = renew_until_ms
        ck.client_id = client_id

    def extend(self, ck: Checkpoint, deadline_ms: int) -> None:
        """Auto-renew: the CK stays invisible until ``deadline_ms`` (same id, so its receipt
        handles stay valid). In memory only: the POP log keeps the deadline it was logged with."""
        assert ck.live and not ck.expired and deadline_ms > ck.deadline_ms, (ck, deadline_ms)
        ck.deadline_ms = deadline_ms
        _heappush(self._deadlines, (deadline_ms, ck.ck_id))

    def age(self, now_ms: int, *, everything: bool = False) -> int:
        """Log the unlogged CKs whose lineage outlived the merge buffer (all of them when
        ``everything``, at a clean stop). Returns how many were logged."""
        heap, cks = self._aging, self.cks
        count = 0
        while heap and (everything or heap[0][0] <= now_ms):
            _, ck_id = _heappop(heap)
            ck = cks.get(ck_id)
            if ck is not None and not ck.logged:
                count += self._log(ck)
        return count

    def mark_durable(self, cks: Iterable[Checkpoint]) -> None:
        """The POP log fsynced these CKs' records: their entries no longer pin the queue (I1)."""
        for ck in cks:
            if ck.live and not ck.durable:
                assert ck.logged
                ck.durable = True
                for i in ck.unsettled():
                    ck.queue.release(ck.offsets[i])
                self.dirty.add(ck.queue)

    def next_deadline(self) -> int | None:
        """The earliest invisible-time end or merge-buffer deadline (None: nothing waits)."""
        heap, cks = self._deadlines, self.cks
        while heap:
            deadline, ck_id = heap[0]
            ck = cks.get(ck_id)
            if ck is not None and ck.deadline_ms == deadline and not ck.expired:
                break
            _heappop(heap)
        aging = self._aging
        while aging:
            ck = cks.get(aging[0][1])
            if ck is not None and not ck.logged:
                break
            _heappop(aging)
        best = heap[0][0] if heap else None
        if aging and (best is None or aging[0][0] < best):
            best = aging[0][0]
        return best

    # ----------------------------------------------------------------- attempt ids
    def remember_attempt(self, key: tuple, popped: list, refs: list[tuple[Checkpoint, int]]) -> None:
        """A receive's answer, so a retry with the same attempt id gets the same batch."""
        assert len(popped) == len(refs)
        cache = self._attempts
        cache[key] = (popped, refs)
        cache.move_to_end(key)
        while len(cache) > ATTEMPT_CACHE_MAX:
            cache.popitem(last=False)

    def recall_attempt(self, key: tuple, now_ms: int) -> list | None:
        """The cached answer's entries still in flight (None if there are none)."""
        entry = self._attempts.get(key)
        if entry is None:
            return None
        popped, refs = entry
        keep = [p for p, (ck, i) in zip(popped, refs)
                if ck.live and not ck.expired and not ck.bits >> i & 1 and ck.deadline_ms > now_ms]
        if not keep:
            del self._attempts[key]
            return None
        return keep

    # ----------------------------------------------------------------- checking
    def check(self) -> None:
        """Verify I1, I5 and the table's consistency (O(state); for tests)."""
        refs: dict[QueueState, dict[int, int]] = {}
        fifo: dict[QueueState, int] = {}
        for ck_id, ck in self.cks.items():
            assert ck.live and ck.ck_id == ck_id and ck.bits != ck.full
            assert not ck.durable or ck.logged
            assert ck.moved is None or not ck.logged
            if ck.fifo and not ck.expired:
                fifo[ck.queue] = fifo.get(ck.queue, 0) + 1
            if ck.expired:
                assert ck in ck.queue.pending
            if not ck.durable:
                per = refs.setdefault(ck.queue, {})
                for i in ck.unsettled():
                    per[ck.offsets[i]] = per.get(ck.offsets[i], 0) + 1
        for qs in self.queues.values():
            assert qs.unsafe == refs.get(qs, {}), (qs, qs.unsafe, refs.get(qs))
            assert qs.fifo_inflight == fifo.get(qs, 0), (qs, qs.fifo_inflight)
            assert all(ck.live and ck.expired for ck in qs.pending)
            assert qs.consume_offset() <= qs.pop_offset
