"""Helpers for the timer tests: open a broker on a fake clock, "kill -9" it, drain due work."""

from __future__ import annotations

import os


from chronoq.broker.broker import Broker
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig

T0 = 1_700_000_000_000  # a bucket-aligned start is not assumed anywhere
TOPIC = "t"


def open_broker(path, clock: FakeClock, **cfg) -> Broker:
    cfg.setdefault("segment_bytes", 64 * 1024)
    return Broker(BrokerConfig(data_dir=str(path), **cfg), clock=clock)


def crash(broker: Broker) -> None:
    """Drop the broker as ``kill -9`` would: no flush, no checkpoint, timer buffers lost.

    Only file descriptors are closed (so tests do not leak them); whatever reached the page
    cache stays, as it does when a process is killed.
    """
    store = broker.store
    for fd in store.log._fds.values():
        os.close(fd)
    store.log._fds.clear()
    for cq in store.queues.values():
        cq.close()
    broker.timer.files.abandon()
    broker.closed = True
    broker.dir_lock.release()  # the kernel drops a killed process's flock


def garble_tail(path: str) -> None:
    """A bucket file as a power cut or a kill -9 mid-write leaves it: the last entry half
    written, then garbage."""
    with open(path, "rb") as fh:
        data = fh.read()
    with open(path, "wb") as fh:
        fh.write(data[:-40] + b"\xff" * 13)


def crash_torn(broker: Broker, path: str, lose_checkpoint: bool = False) -> Broker:
    """``kill -9`` in the middle of appending to the bucket file ``path`` (its tail torn:
    ``garble_tail``), optionally with the timer checkpoint lost too; returns the reopened broker."""
    crash(broker)
    garble_tail(path)
    checkpoint = os.path.join(broker.data_dir, "timer", "checkpoint.json")
    if lose_checkpoint and os.path.exists(checkpoint):
        os.unlink(checkpoint)
    return open_broker(broker.data_dir, broker.clock)


def drain(broker: Broker, max_ticks: int = 500) -> int:
    """Tick while the timer says it has work now (a bounded loop). Returns deliveries."""
    now = broker.clock.wall_ms()
    done = 0
    for _ in range(max_ticks):
        deadline = broker.timer_next_deadline_ms()
        if deadline is None or deadline > now:
            return done
        done += broker.timer_tick()
    raise AssertionError(f"timer still busy after {max_ticks} ticks")


def run_schedules(broker: Broker, book, clock: FakeClock, ms: int) -> None:
    """The server's two tasks (schedule rounds, timer ticks) on a fake clock for ``ms``, 250 ms a
    step; fails if the round task never rests (a schedule planned again at once, forever)."""
    end = clock.wall_ms() + ms
    while True:
        for _ in range(1000):
            r, t = book.next_round_ms(), broker.timer_next_deadline_ms()
            if r is not None and r <= clock.wall_ms():
                book.run_round_here()
            elif t is not None and t <= clock.wall_ms():
                broker.timer_tick()
            else:
                break
        else:
            raise AssertionError("the round task never rests")
        if clock.wall_ms() >= end:
            return
        clock.advance(min(250, end - clock.wall_ms()))


def visible(broker: Broker, topic: str = TOPIC) -> list:
    """Every message readable in ``topic`` (all queues), in queue order."""
    out = []
    cfg = broker.topics.get(topic)
    if cfg is None:
        return out
    for qid in range(cfg.queues):
        offset = 0
        while True:
            got = broker.read(topic, qid, offset, 1000)
            out.extend(got.messages)
            if got.next_offset >= got.max_offset or not got.messages:
                break
            offset = got.next_offset
    return out


def bodies(broker: Broker, topic: str = TOPIC) -> list[bytes]:
    return sorted(m.body for m in visible(broker, topic))


# The timer service tests' levels, their broker (``opened_broker``) and bucket files (tests/unit/test_timer_service.py,
# test_timer_restart.py).
LEVELS = "1s 5s 1m"
DAY = 86_400_000


def opened_broker(tmp_path, clock: FakeClock):
    """A test module's ``broker`` fixture (``yield from opened_broker(tmp_path, clock)``): the
    levels above, topic ``TOPIC`` with 2 queues, closed after the test unless it was."""
    b = open_broker(tmp_path, clock, timer_delay_levels=LEVELS)
    b.create_topic(TOPIC, 2)
    yield b
    if not b.closed:
        b.close()


def sched_files(b) -> list[str]:
    return sorted(os.listdir(b.timer.sched_dir))
