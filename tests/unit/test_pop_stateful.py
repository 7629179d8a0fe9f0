"""A Hypothesis state machine over receive / ack / change-invisible / advance / crash / restart.

The model checks, against ``PopService`` on a real data directory and a FakeClock:

- no message acked is delivered again, unless a crash came within the stated bound
  ``popkit.REDELIVERY_BOUND_MS`` after its ack (or after it was revived);
- no message is handed out twice while a delivery of it is still invisible (within one process);
- ``delivery_attempt`` is the previous attempt + 1 (within one process);
- FIFO: a message is handed out only after every earlier message of its group is acked (or
  earlier in the same batch);
- every message not acked is eventually delivered again (checked in ``teardown``, which drains).

A crash drops the service's unflushed state and the broker's unsaved offsets (``Node.crash``).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from popkit import REDELIVERY_BOUND_MS, Node

from chronoq.core import errors

# tmpfs makes the many fsyncs of a long random run cheap; the semantics do not change.
_FAST_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
G = "sm-group"
T = "sm-topic"
DELAYS_MS = (500, 1_000, 2_000)


@dataclass
class Delivery:
    message_id: str
    until: int
    epoch: int
    settled: bool = False    # ended by the client: acked or replaced by change-invisible


@dataclass
class Msg:
    body: bytes
    group: str | None
    acked_at: int | None = None
    dup_ok: bool = False     # acked within the bound before a crash: it may come back
    until: int | None = None  # latest delivery's invisible time (this process)
    latest: str | None = None
    last_attempt: int = 0
    last_epoch: int = -1
    deliveries: list[Delivery] = field(default_factory=list)


class PopMachine(RuleBasedStateMachine):
    FIFO = False

    def __init__(self):
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="chronoq-pop-sm-", dir=_FAST_TMP)
        self.node = Node(self.dir).open()
        self._configure()
        self.msgs: dict[str, Msg] = {}
        self.order: dict[str, list[str]] = {}
        self.held: dict[str, Delivery] = {}
        self.epoch = 0
        self.counter = 0

    def _configure(self):
        pop = self.node.pop
        self.node.broker.topic(T, create=True)  # (a receive creates no topic)
        pop.set_group(G, fifo=self.FIFO, max_attempts=1000)
        pop.group(G).retry_delays_ms = DELAYS_MS  # short back-off keeps teardown's drain quick

    @property
    def now(self) -> int:
        return self.node.clock.wall_ms()

    # ----------------------------------------------------------------- rules
    @rule(n=st.integers(1, 3), group=st.sampled_from(["a", "b"]))
    def send(self, n, group):
        for _ in range(n):
            self.counter += 1
            body = f"body-{self.counter}".encode()
            mgroup = group if self.FIFO else None
            r = self.node.broker.send(T, body, message_group=mgroup)
            self.msgs[r.message_id] = Msg(body, mgroup)
            self.order.setdefault(mgroup or "", []).append(r.message_id)

    @rule(max_messages=st.integers(1, 5), invisible_ms=st.sampled_from([1_000, 3_000, 10_000]))
    def receive(self, max_messages, invisible_ms):
        got = self.node.pop.receive(G, T, max_messages=max_messages, invisible_ms=invisible_ms)
        assert len(got) <= max_messages
        self._delivered(got, invisible_ms)

    def _delivered(self, got, invisible_ms):
        now = self.now
        batch: set[str] = set()
        for p in got:
            mid = p.message.message_id
            m = self.msgs.get(mid)
            assert m is not None, f"unknown message {mid}"
            assert p.message.body == m.body and p.message.topic == T
            assert p.delivery_attempt >= 1
            assert p.invisible_until_ms == now + invisible_ms
            if m.acked_at is not None:
                assert m.dup_ok, f"{mid} acked at {m.acked_at} was delivered again at {now}"
                m.acked_at = None
            if m.until is not None and not m.dup_ok:
                assert m.until <= now, f"{mid} handed out at {now} while invisible until {m.until}"
            if m.last_epoch == self.epoch and not m.dup_ok:
                assert p.delivery_attempt == m.last_attempt + 1, (mid, p.delivery_attempt, m.last_attempt)
            if self.FIFO:
                assert p.message_group == m.group
                for earlier in self.order[m.group]:
                    if earlier == mid:
                        break
                    e = self.msgs[earlier]
                    assert e.acked_at is not None or e.dup_ok or m.dup_ok or earlier in batch, (
                        f"FIFO: {mid} handed out before the earlier {earlier} was acked")
            batch.add(mid)
            d = Delivery(mid, p.invisible_until_ms, self.epoch)
            m.deliveries.append(d)
            m.until, m.latest = p.invisible_until_ms, p.receipt_handle
            m.last_attempt, m.last_epoch = p.delivery_attempt, self.epoch
            self.held[p.receipt_handle] = d

    def _expect_valid(self, handle: str, d: Delivery) -> bool:
        m = self.msgs[d.message_id]
        return (d.epoch == self.epoch and not d.settled and m.latest == handle
                and (self.FIFO or self.now < d.until))

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def ack(self, data):
        handle = data.draw(st.sampled_from(sorted(self.held)))
        d = self.held.pop(handle)
        expected = self._expect_valid(handle, d)
        try:
            self.node.pop.ack(G, T, handle)
        except errors.InvalidReceiptHandle:
            # Refused, rightly: the delivery already ended (revived, replaced, lost in a crash).
            assert not expected, f"valid handle of {d.message_id} refused"
            return
        d.settled = True
        m = self.msgs[d.message_id]
        m.acked_at = self.now
        m.until = None

    @precondition(lambda self: self.held)
    @rule(data=st.data(), invisible_ms=st.sampled_from([0, 1_000, 5_000]))
    def change_invisible(self, data, invisible_ms):
        handle = data.draw(st.sampled_from(sorted(self.held)))
        d = self.held[handle]
        expected = self._expect_valid(handle, d)
        try:
            new = self.node.pop.change_invisible(G, T, handle, invisible_ms)
        except errors.InvalidReceiptHandle:
            assert not expected, f"valid handle of {d.message_id} refused"
            del self.held[handle]
            return
        d.settled = True
        del self.held[handle]
        try:
            self.node.pop.ack(G, T, handle)
            raise AssertionError("the old handle still works after change-invisible-time")
        except errors.InvalidReceiptHandle:
            pass
        m = self.msgs[d.message_id]
        d2 = Delivery(d.message_id, self.now + invisible_ms, self.epoch)
        m.deliveries.append(d2)
        m.until, m.latest = d2.until, new
        self.held[new] = d2

    @rule(ms=st.sampled_from([100, 500, 1_000, 2_500, 10_000, 30_000]))
    def advance(self, ms):
        self.node.advance(ms)

    @rule()
    def crash(self):
        crash_at = self.now
        for m in self.msgs.values():
            # The stated bound: only an ack this close before the crash may be forgotten.
            # (Revives and DLQ moves are fsynced with their records before tick returns; a lost
            # change-invisible only brings the message back sooner, which is allowed anyway
            # since its in-flight deliveries are forgotten below.)
            if m.acked_at is not None and crash_at - m.acked_at <= REDELIVERY_BOUND_MS:
                m.dup_ok = True  # sticky: one copy may come back at any later time
            m.until = None
        self.epoch += 1
        self.node.restart(clean=False)
        self._configure()

    @rule()
    def clean_restart(self):
        self.node.restart(clean=True)
        self._configure()

    @invariant()
    def books_balance(self):
        self.node.pop.check()

    # ----------------------------------------------------------------- liveness
    def teardown(self):
        try:
            if self.node.pop is not None:
                self._drain()
                self.node.close()
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def _drain(self):
        for _ in range(60):
            if all(m.acked_at is not None for m in self.msgs.values()):
                return
            self.node.advance(12_000)
            while True:
                got = self.node.pop.receive(G, T, max_messages=32, invisible_ms=10_000)
                if not got:
                    break
                self._delivered(got, 10_000)
                for p in got:
                    self.held.pop(p.receipt_handle, None)
                    self.node.pop.ack(G, T, p.receipt_handle)
                    self.msgs[p.message.message_id].acked_at = self.now
                    self.msgs[p.message.message_id].until = None
        missing = [mid for mid, m in self.msgs.items() if m.acked_at is None]
        raise AssertionError(f"never delivered again: {missing}")


class FifoPopMachine(PopMachine):
    FIFO = True


# A longer search: CHRONOQ_POP_SM_EXAMPLES=5000 (and CHRONOQ_POP_SM_STEPS) in the environment.
_settings = settings(max_examples=int(os.environ.get("CHRONOQ_POP_SM_EXAMPLES", "100")),
                     stateful_step_count=int(os.environ.get("CHRONOQ_POP_SM_STEPS", "40")), deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPopMachine = PopMachine.TestCase
TestPopMachine.settings = _settings
TestFifoPopMachine = FifoPopMachine.TestCase
TestFifoPopMachine.settings = _settings
