"""Helpers for the POP tests: open a broker + POP service on a data dir, crash them, drive time."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field


from chronoq.broker.broker import Broker
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.pop.service import PopService

CHECKPOINT_INTERVAL_MS = 1_000
BUFFER_MS = 2_000
FLUSH_INTERVAL_MS = 100
# Small segments keep crash recovery (which scans the preallocated tail) cheap in tests.
SEGMENT_BYTES = 1 << 20
# The stated redelivery bound for acked messages after a crash (service.py docstring).
REDELIVERY_BOUND_MS = BUFFER_MS + FLUSH_INTERVAL_MS + CHECKPOINT_INTERVAL_MS


@dataclass
class Node:
    data_dir: str
    clock: FakeClock = field(default_factory=FakeClock)
    queues: int = 2
    flush_policy: str = "async"
    config: dict = field(default_factory=dict)  # more BrokerConfig settings (kept across restarts)
    broker: Broker | None = None
    pop: PopService | None = None

    def open(self) -> "Node":
        cfg = BrokerConfig(data_dir=self.data_dir, flush_policy=self.flush_policy, default_queues=self.queues,
                           checkpoint_interval_ms=CHECKPOINT_INTERVAL_MS,
                           segment_bytes=SEGMENT_BYTES, **self.config)
        self.broker = Broker(cfg, clock=self.clock)
        self.pop = PopService(self.broker, self.clock, buffer_ms=BUFFER_MS, flush_interval_ms=FLUSH_INTERVAL_MS)
        return self

    def close(self) -> None:
        """A clean stop: the POP service first, then the broker."""
        self.pop.close()
        self.broker.close()

    def crash(self) -> None:
        """What kill -9 leaves: written bytes stay (page cache), nothing more is flushed or saved."""
        self.pop.abandon()
        store = self.broker.store
        for fd in list(getattr(store.log, "_fds", {}).values()):
            _close_quiet(fd)
        for cq in store.queues.values():
            for fd in list(getattr(cq, "_fds", {}).values()):
                _close_quiet(fd)
        self.broker.dir_lock.release()  # the kernel drops a killed process's flock
        self.broker = self.pop = None

    def restart(self, clean: bool = False) -> "Node":
        self.close() if clean else self.crash()
        return self.open()

    def advance(self, ms: int) -> int:
        """Move the clock by ``ms``, stopping at every POP deadline and broker checkpoint on the
        way (as the shell's timers would). Returns how much ``tick`` reported."""
        target = self.clock.wall_ms() + ms
        handled = 0
        for _ in range(100_000):
            now = self.clock.wall_ms()
            nxt = target
            deadline = self.pop.next_deadline_ms()
            if deadline is not None:
                nxt = min(nxt, max(deadline, now))
            nxt = min(nxt, self.broker._last_checkpoint_ms + CHECKPOINT_INTERVAL_MS)
            self.clock.set(max(now, nxt))
            handled += self.pop.tick_durably()
            self.broker.maintenance()
            if self.clock.wall_ms() >= target:
                deadline = self.pop.next_deadline_ms()
                if deadline is None or deadline > target:
                    return handled
        raise AssertionError("advance did not converge: a deadline that tick never clears")


def _close_quiet(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# The POP service tests' group and topic, their node (``opened_node``) and their send and drain helpers
# (tests/unit/test_pop_service.py, test_pop_restart.py).
G = "grp"
T = "orders"


def opened_node(tmp_path):
    """A test module's ``node`` fixture: ``yield from opened_node(tmp_path)``."""
    n = Node(str(tmp_path)).open()
    yield n
    if n.pop is not None and not n.pop.closed:
        n.close()


def send(node, count, *, topic=T, tag="", group=None, prefix="m"):
    ids = []
    for i in range(count):
        r = node.broker.send(topic, f"{prefix}{i}".encode(), tag=tag, message_group=group)
        ids.append(r.message_id)
    return ids


def drain(node, group=G, topic=T, *, invisible_ms=30_000, ack=True, **kw):
    out = []
    while True:
        got = node.pop.receive(group, topic, max_messages=32, invisible_ms=invisible_ms, **kw)
        if not got:
            return out
        out.extend(got)
        if ack:
            for p in got:
                node.pop.ack(group, topic, p.receipt_handle)


async def loop_turns_during(awaitable):
    """(what ``awaitable`` returns, how many times another task ran while it was awaited): 0 when
    it held the event loop from start to end."""
    turns = 0
    done = False

    async def other_work():
        nonlocal turns
        while not done:
            turns += 1
            await asyncio.sleep(0)

    worker = asyncio.ensure_future(other_work())
    await asyncio.sleep(0)
    turns = 0
    try:
        result = await awaitable
    finally:
        done = True
        await worker
    return result, turns
