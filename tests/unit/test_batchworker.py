"""The shared file-making thread (chronoq/core/batchworker.py) on its own, with a real thread:
jobs in submit order and in batches of at most ``batch_max``, the queue's bound, reports only for
batches whose work asks for one, and close. The work function is held by an event where a test
needs the thread held; nothing waits on time but a generous bound."""

from __future__ import annotations

import threading

from chronoq.core.batchworker import BatchWorker

WAIT_S = 10


class _Recorder:
    """The work and report functions: records the batches; ``gate`` holds the thread in work."""

    def __init__(self, report_when=lambda batch: True):
        self.batches: list[list] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()
        self.reports = threading.Semaphore(0)
        self.report_count = 0
        self._report_when = report_when

    def work(self, batch: list) -> bool:
        self.entered.set()
        assert self.gate.wait(WAIT_S), "the test never opened the gate"
        self.batches.append(list(batch))
        return self._report_when(batch)

    def report(self) -> None:
        self.report_count += 1
        self.reports.release()


def test_jobs_go_in_submit_order_in_batches_of_at_most_batch_max_each_reported():
    rec = _Recorder()
    rec.gate.clear()  # the first batch holds the thread while the rest queue up
    worker = BatchWorker("test-batchworker", rec.work, rec.report, batch_max=4)
    assert worker.submit([0]) == 1
    assert rec.entered.wait(WAIT_S)
    assert worker.submit(list(range(1, 11))) == 10
    rec.gate.set()
    for _ in range(4):  # [0], then 1-4, 5-8, 9-10
        assert rec.reports.acquire(timeout=WAIT_S)
    worker.close()
    assert rec.batches == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert rec.report_count == 4
    assert threading.current_thread().name != "test-batchworker"


def test_a_batch_whose_work_says_so_is_not_reported():
    rec = _Recorder(report_when=lambda batch: batch != ["quiet"])
    worker = BatchWorker("test-batchworker", rec.work, rec.report, batch_max=1)
    assert worker.submit(["quiet", "loud"]) == 2
    assert rec.reports.acquire(timeout=WAIT_S)
    worker.close()
    assert rec.batches == [["quiet"], ["loud"]] and rec.report_count == 1


def test_the_queue_bound_takes_the_first_jobs_that_fit_and_refuses_the_rest():
    rec = _Recorder()
    rec.gate.clear()
    worker = BatchWorker("test-batchworker", rec.work, rec.report, batch_max=100, queue_max=3)
    assert worker.submit(["held"]) == 1
    assert rec.entered.wait(WAIT_S)  # the thread holds "held": the queue is empty again
    assert worker.submit(["a", "b"]) == 2
    assert worker.submit(["c", "d", "e"]) == 1  # room for one
    assert worker.submit(["f"]) == 0
    rec.gate.set()
    for _ in range(2):
        assert rec.reports.acquire(timeout=WAIT_S)
    assert worker.submit(["g", "h", "i", "j"]) == 3  # room again once the thread took them
    assert rec.reports.acquire(timeout=WAIT_S)
    worker.close()
    assert rec.batches == [["held"], ["a", "b", "c"], ["g", "h", "i"]]


def test_close_finishes_the_batch_in_hand_drops_the_queued_and_takes_nothing_after():
    rec = _Recorder()
    rec.gate.clear()
    worker = BatchWorker("test-batchworker", rec.work, rec.report, batch_max=1)
    assert worker.submit(["in hand", "queued"]) == 2
    assert rec.entered.wait(WAIT_S)
    closer = threading.Thread(target=worker.close)
    closer.start()
    for _ in range(WAIT_S * 100):  # until close has stopped the queue (then it waits for the thread)
        with worker._cond:
            if worker._stop:
                break
        threading.Event().wait(0.01)
    assert worker._stop, "close never began"
    rec.gate.set()
    closer.join(WAIT_S)
    assert not closer.is_alive(), "close did not return"
    assert rec.batches == [["in hand"]] and rec.report_count == 1
    assert worker.submit(["late"]) == 0
    assert rec.batches == [["in hand"]]


def test_a_failing_report_does_not_stop_the_thread():
    rec = _Recorder()
    calls = []

    def report():
        calls.append(1)
        rec.reports.release()
        raise RuntimeError("the loop is closed")

    worker = BatchWorker("test-batchworker", rec.work, report, batch_max=1)
    assert worker.submit(["one"]) == 1
    assert rec.reports.acquire(timeout=WAIT_S)
    assert worker.submit(["two"]) == 1
    assert rec.reports.acquire(timeout=WAIT_S)
    worker.close()
    assert rec.batches == [["one"], ["two"]] and len(calls) == 2
