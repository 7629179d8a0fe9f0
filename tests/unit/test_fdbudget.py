"""The consume queues' one cap on open files (``chronoq/store/fdbudget.py``): queues under a tiny
budget read, write, sync, truncate and reopen exactly as queues without one, while the files
they hold open never pass the cap; and a store with thousands of queues stays under it."""

from __future__ import annotations

import os
import random

from chronoq.store.consumequeue import ConsumeQueue
from chronoq.store.fdbudget import LIMIT_MAX, LIMIT_MIN, FdBudget, default_limit
from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.config import BrokerConfig

from test_consumequeue import entries

PER_FILE = 4


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_queues_under_a_tiny_budget_behave_as_queues_without_one(tmp_path):
    rng = random.Random(7)
    budget = FdBudget(3)
    capped = [ConsumeQueue(str(tmp_path / "a" / str(q)), "t", q, PER_FILE, budget) for q in range(6)]
    free = [ConsumeQueue(str(tmp_path / "b" / str(q)), "t", q, PER_FILE) for q in range(6)]
    for step in range(400):
        q, op, n, pick = rng.randrange(6), rng.random(), rng.randint(1, 9), rng.random()
        for cq in (capped[q], free[q]):
            if op < 0.5:
                cq.put(cq.next_offset, entries(cq.next_offset, n))
            elif op < 0.8 and cq.next_offset > cq.min_offset:
                offset = cq.min_offset + int(pick * (cq.next_offset - cq.min_offset))
                assert cq.get(offset, 5) == entries(offset, len(cq.get(offset, 5)) // 24)
            elif op < 0.9:
                cq.sync()  # a dirty file the budget closed is synced by path
            elif cq.next_offset > cq.min_offset + 2:
                cq.truncate(cq.next_offset - 2)
        assert capped[q].get(capped[q].min_offset, 10**6) == free[q].get(free[q].min_offset, 10**6)
        assert len(budget) <= 3
        assert sum(len(cq._fds) for cq in capped) == len(budget)  # every open file is counted once
    assert budget.evictions > 0
    for cq in capped:
        cq.sync()
        cq.close()
    assert len(budget) == 0
    again = [ConsumeQueue(str(tmp_path / "a" / str(q)), "t", q, PER_FILE, FdBudget(2)) for q in range(6)]
    for cq, ref in zip(again, free):
        assert (cq.min_offset, cq.next_offset) == (ref.min_offset, ref.next_offset)
        assert cq.get(cq.min_offset, 10**6) == ref.get(ref.min_offset, 10**6)


def test_deleted_files_leave_the_budget(tmp_path):
    budget = FdBudget(100)
    cq = ConsumeQueue(str(tmp_path / "q"), "t", 0, PER_FILE, budget)
    cq.put(0, entries(0, 12))  # three files, all open
    assert len(budget) == 3
    assert cq.delete_below(1000 + 100 * 8) == 2  # the first two files point below it
    assert len(budget) == 1 and list(cq._fds) == [2]


def test_the_default_is_a_quarter_of_the_soft_limit_within_bounds():
    assert LIMIT_MIN <= default_limit() <= LIMIT_MAX


def _bodies(broker, topic):
    return sorted(m.body for q in range(4) for m in broker.read(topic, q, 0, 10).messages)


def test_a_broker_with_thousands_of_queues_holds_at_most_its_budget_open(tmp_path):
    before = _open_fds()
    config = BrokerConfig(data_dir=str(tmp_path), segment_bytes=1 << 20, cq_entries_per_file=64, cq_open_files=32)
    broker = Broker(config)
    topics = [f"t{i}" for i in range(600)]
    try:
        for round_ in range(2):  # 2,400 queues, each written twice
            for q in range(4):
                broker.send_batch([OutgoingMessage(topic, b"m-%d-%d" % (round_, q)) for topic in topics])
            broker.flush()
            assert len(broker.store.cq_files) <= 32
            assert _open_fds() - before < 32 + 24  # the queues' files and the broker's own
        expected = sorted(b"m-%d-%d" % (r, q) for r in range(2) for q in range(4))
        for topic in topics[::97]:
            assert _bodies(broker, topic) == expected
    finally:
        broker.close()
    reopened = Broker(config)
    try:
        assert _bodies(reopened, "t599") == expected and len(reopened.store.cq_files) <= 32
    finally:
        reopened.close()
