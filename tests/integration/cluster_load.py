"""The load of the cluster failover test (``test_cluster.py``): the unmodified official RocketMQ 5
Python and Node.js clients sending plain, delayed and FIFO messages to a topic spread over two
broker groups, two consumer groups receiving them, and the ledger that judges what arrived.

Every body is unique and says what it is (``P-<i>`` plain, ``D-<i>`` delayed, ``F<g>-<i>`` the
i-th message of message group ``mg-<g>``; the Node client's the same with an ``N`` in front, see
``tests/node/cluster_load.mjs``), so a delivery names its send. A send that fails (after the
client's own attempts) is sent again, as a new send, until it is acknowledged or the load's
deadline passes; a message group's sends go one after another, so its acknowledged order is its
send order.

What ``judge`` asserts, per consumer group (docs/cluster.md, "What the cluster test shows"):

* nothing delivered that was not sent; every acknowledged send delivered (0 lost);
* no delayed message delivered before its due time (the receive's return, or the push
  listener's call: both after the broker made it visible, on the same clock);
* each message group's first deliveries in its send order;
* duplicates only where the kill explains them, everything else exactly once. A *copy* is one
  stored message (its message id, in one broker group). A body stored more than once is a send
  that failed during the outage (from the kill until the killed group takes sends again) and was
  sent again: by the application (a new message id) or by the client's next attempt (the same id,
  in the other group). A send that fails may still be stored: its answer was lost at the kill,
  or the promoted replica, alone in its group, stored it and refused it for want of a replica
  (``SLAVE_PERSISTENCE_TIMEOUT``, docs/replication.md). A copy delivered
  more than once was first delivered by the killed primary no earlier than ``DUPLICATE_WINDOW_S``
  before the kill, and again by its replica once promoted: what the replica had not copied of
  that delivery (its checkpoint and ack reach the POP log once ``buffer_ms``, 2 s, old; the copy
  follows within a pull) is made again (docs/replication.md, "The bound on duplicates").
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import os
import subprocess
import threading
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from rocketmq import FilterExpression, Message, Producer, SimpleConsumer

from .conftest import ROOT
from .test_official_python_client import config

DUPLICATE_WINDOW_S = 4.0  # as tests/crash/test_failover_crash.py: buffer_ms (2 s) + a pull (1 s) + margin
RESEND_PAUSE_S = 0.2      # between a failed send and the next try
INVISIBLE_S = 5           # a simple consumer's receive: acked at once, back after this if not
NODE_SCRIPT = os.path.join(ROOT, "tests", "node", "cluster_load.mjs")


@dataclass
class Sent:
    body: bytes
    kind: str                 # plain | delayed | fifo
    group: str = ""           # fifo: the message group; seq its place in it
    seq: int = 0
    due: float = 0.0          # delayed: the due time sent (s since the epoch)
    acked: bool = False
    failures: int = 0         # sends that failed before the one acknowledged
    started: float = 0.0      # the first send's start and the acknowledgement's arrival
    ended: float = 0.0


@dataclass
class Delivery:
    consumer: str             # the consumer group's label
    body: bytes
    message_id: str
    port: int                 # the broker that handed it out
    at: float                 # the receive's return (s since the epoch)
    attempt: int


@dataclass
class Ledger:
    sends: dict[bytes, Sent] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def acked(self) -> int:
        with self.lock:
            return sum(s.acked for s in self.sends.values())

    def deliver(self, consumer: str, message) -> None:
        port = int(message.endpoints.facade.rsplit(":", 1)[1])
        with self.lock:  # appended in the order received: the FIFO check reads this order
            self.deliveries.append(Delivery(consumer, message.body, message.message_id, port, time.time(),
                                            message.delivery_attempt))

    def seen(self, consumer: str) -> set[bytes]:
        with self.lock:
            return {d.body for d in self.deliveries if d.consumer == consumer}

    def missing(self, consumer: str) -> set[bytes]:
        seen = self.seen(consumer)
        with self.lock:
            return {b for b, s in self.sends.items() if s.acked and b not in seen}


# ------------------------------------------------------------------------------------------ sending
class PythonSender:
    """One official Python producer sending through ``send_async``: up to ``window`` plain and
    delayed sends in flight (a send under ``replication = "sync"`` waits for a replica's pull: the
    rate is the window over that round trip), each message group's next send issued when the
    previous one is acknowledged; a failed send is sent again after ``RESEND_PAUSE_S``."""

    def __init__(self, endpoint: str, topic: str, ledger: Ledger, *, plain: int, delayed: int, fifo_groups: int,
                 fifo_each: int, window: int, deadline: float) -> None:
        self.topic, self.ledger, self.deadline = topic, ledger, deadline
        self.producer = Producer(config(endpoint), (topic,))
        loose = [Sent(b"D-%d" % i, "delayed", seq=i) for i in range(delayed)] + \
                [Sent(b"P-%d" % i, "plain", seq=i) for i in range(plain)]
        loose.sort(key=lambda s: s.seq)  # delayed ones spread over the run
        self.chains = {f"mg-{g}": [Sent(b"F%d-%d" % (g, i), "fifo", f"mg-{g}", i) for i in range(fifo_each)]
                       for g in range(fifo_groups)}
        with ledger.lock:
            for s in loose + [s for chain in self.chains.values() for s in chain]:
                ledger.sends[s.body] = s
        self.total = len(ledger.sends)
        self.lock = threading.Lock()
        self.loose, self.resend = list(reversed(loose)), []  # (resend: (time, Sent), kept sorted)
        self.slots = threading.Semaphore(window)
        self.done = 0
        self.pump = threading.Thread(target=self._pump, daemon=True)

    def start(self) -> None:
        self.producer.startup()
        for chain in self.chains.values():
            self._issue(chain[0])
        self.pump.start()

    def join(self) -> None:
        self.pump.join(max(1.0, self.deadline - time.monotonic() + 10))
        assert not self.pump.is_alive(), "the Python sender outlived its deadline"
        self.producer.shutdown()

    def _pump(self) -> None:
        while time.monotonic() < self.deadline:
            with self.lock:
                if self.done == self.total:
                    return
                due = self.resend and self.resend[0][0] <= time.monotonic()
                s = self.resend.pop(0)[1] if due else None
            if s is None or s.kind != "fifo":
                if not self.slots.acquire(timeout=0.05):
                    if s is not None:
                        with self.lock:
                            self.resend.insert(0, (0.0, s))
                    continue
                if s is None:
                    with self.lock:
                        s = self.loose.pop() if self.loose else None
                    if s is None:
                        self.slots.release()
                        time.sleep(0.02)
                        continue
            self._issue(s)

    def _issue(self, s: Sent) -> None:
        if not s.started:
            s.started = time.time()
        m = Message()
        m.topic, m.body = self.topic, s.body
        if s.kind == "fifo":
            m.message_group = s.group
        elif s.kind == "delayed":
            s.due = m.delivery_timestamp = int(time.time()) + 1 + s.seq % 4  # (whole seconds: the client's unit)
        try:
            future = self.producer.send_async(m)
        except Exception:  # noqa: BLE001 - no queue to send to now: like a failed send
            self._failed(s)
            return
        future.add_done_callback(lambda f: self._answered(s, f))

    def _answered(self, s: Sent, future) -> None:
        if future.exception() is not None:  # the client's attempts all failed: not acknowledged
            self._failed(s)
            return
        with self.ledger.lock:
            s.acked, s.ended = True, time.time()
        with self.lock:
            self.done += 1
        if s.kind == "fifo":
            chain = self.chains[s.group]
            if s.seq + 1 < len(chain):
                self._issue(chain[s.seq + 1])
        else:
            self.slots.release()

    def _failed(self, s: Sent) -> None:
        s.failures += 1
        if s.kind != "fifo":
            self.slots.release()
        with self.lock:
            self.resend.append((time.monotonic() + RESEND_PAUSE_S, s))
            self.resend.sort(key=lambda r: r[0])


class NodeLoad:
    """``tests/node/cluster_load.mjs`` in a subprocess: the Node producer and a Node simple consumer
    (consumer group ``label``). Its deliveries enter the ledger as they come; its sends once it has
    sent them all (``sent`` is set then); ``stop`` ends its consumer."""

    def __init__(self, node: str, endpoint: str, topic: str, count: int, fifo_groups: int, deadline_s: float,
                 group: str, ledger: Ledger, label: str) -> None:
        self.ledger, self.label = ledger, label
        self.started = time.time()
        self.sent, self.done = threading.Event(), {}
        self.proc = subprocess.Popen([node, NODE_SCRIPT, endpoint, topic, str(count), str(fifo_groups),
                                      str(int(deadline_s * 1000)), group], cwd=ROOT, stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     env=dict(os.environ, CHRONOQ_NODE_VERBOSE="1"))
        self.err: collections.deque[str] = collections.deque(maxlen=300)  # the client's log, its last lines
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        threading.Thread(target=lambda: self.err.extend(line for line in self.proc.stderr if "DEBUG" not in line),
                         daemon=True).start()

    def log(self) -> str:
        return "".join(list(self.err))[-8000:]

    def _read(self) -> None:
        for line in self.proc.stdout:
            if not line.startswith("{"):
                continue
            record = json.loads(line)
            if "deliveries" in record:
                with self.ledger.lock:
                    for body, message_id, address, at_ms, attempt in record["deliveries"]:
                        self.ledger.deliveries.append(Delivery(self.label, body.encode(), message_id,
                                                               int(address.rsplit(":", 1)[1]), at_ms / 1000, attempt))
            elif "sent" in record:
                with self.ledger.lock:
                    for m in record["sent"]:
                        body = m["body"].encode()
                        assert body not in self.ledger.sends
                        # (the Node client's send times are not reported: its whole run counts as in flight)
                        self.ledger.sends[body] = Sent(body, m["kind"], m["group"], m["seq"], m["due_ms"] / 1000,
                                                       m["acked"], m["failures"], self.started, time.time())
                self.sent.set()
            elif "done" in record:
                self.done = record

    def failover(self) -> None:
        """The Node producer keeps its first route for sending: have it make a new one."""
        self.proc.stdin.write("failover\n")
        self.proc.stdin.flush()

    def stop(self, timeout_s: float = 30) -> dict:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        self.reader.join(10)
        assert self.done.get("ok"), f"the Node load failed: {self.done}\n{self.log()}"
        return self.done


def describe_missing(ledger: Ledger, label: str, kill_at: float) -> str:
    """What a consumer group lacks, and what it got from each broker: for a failure's message."""
    missing = ledger.missing(label)
    with ledger.lock:
        kinds = Counter((ledger.sends[b].kind, ledger.sends[b].group) for b in missing)
        mine = [d for d in ledger.deliveries if d.consumer == label]
    ports = defaultdict(list)
    for d in mine:
        ports[d.port].append(d.at - kill_at)
    got = {port: (len(ats), round(min(ats), 1), round(max(ats), 1)) for port, ats in ports.items()}
    return (f"{label}: {len(missing)} acknowledged messages not received: {sorted(missing)[:12]}; by kind and "
            f"group {dict(kinds)}; received per broker port (count, first and last s after the kill): {got}")


# ---------------------------------------------------------------------------------------- consuming
class SimpleReceivers:
    """One official simple consumer, ``threads`` threads receiving and acking at once. (Several: the
    client receives round robin over the route's queues, and a receive from a drained queue waits
    its long poll out, while a FIFO consumer group has one batch of a queue in flight at a time:
    one thread would take a batch a poll.)"""

    def __init__(self, endpoint: str, group: str, topic: str, ledger: Ledger, label: str, threads: int) -> None:
        self.ledger, self.label = ledger, label
        self.consumer = SimpleConsumer(config(endpoint), group, {topic: FilterExpression("*")}, await_duration=1)
        self.stop = threading.Event()
        self.failed_receives = self.failed_acks = 0
        self.threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]
        # Acks go out on threads of their own: (the client's ack_async wants an event loop in the
        # calling thread) a receiving thread does not wait for them.
        self.acks = concurrent.futures.ThreadPoolExecutor(8)

    def start(self) -> None:
        self.consumer.startup()
        for t in self.threads:
            t.start()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(30)
        self.acks.shutdown(cancel_futures=True)
        self.consumer.shutdown()
        assert not any(t.is_alive() for t in self.threads), "a receiving thread did not stop"

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                messages = self.consumer.receive(32, INVISIBLE_S)
            except Exception:  # noqa: BLE001 - a dead endpoint, until the route names its replica
                self.failed_receives += 1
                time.sleep(0.1)
                continue
            for m in messages:
                self.ledger.deliver(self.label, m)
            for m in messages:  # (an ack the dead primary cannot take: the message comes back)
                self.acks.submit(self._ack, m)

    def _ack(self, message) -> None:
        try:
            self.consumer.ack(message)
        except Exception:  # noqa: BLE001 - its broker is dead: it comes back from the replica
            self.failed_acks += 1


# ------------------------------------------------------------------------------------------- judging
def judge(ledger: Ledger, label: str, kill_at: float, outage_end: float, killed_port: int,
          group_of_port: dict[int, str]) -> dict:
    """Assert what the module docstring says of one consumer group; returns its figures."""
    with ledger.lock:
        sends = dict(ledger.sends)
        mine = [d for d in ledger.deliveries if d.consumer == label]
    unknown = sorted({d.body for d in mine} - set(sends))
    assert not unknown, f"{label}: delivered but never sent: {unknown[:10]}"
    seen = {d.body for d in mine}
    lost = sorted(b for b, s in sends.items() if s.acked and b not in seen)
    assert not lost, f"{label}: {len(lost)} acknowledged messages never delivered: {lost[:20]}"

    early = {d.body: round(sends[d.body].due - d.at, 3) for d in mine if sends[d.body].due and d.at < sends[d.body].due}
    assert not early, f"{label}: delivered early (s before due): {early}"

    firsts: dict[bytes, int] = {}
    for i, d in enumerate(mine):
        firsts.setdefault(d.body, i)
    orders = defaultdict(list)
    for body in sorted(firsts, key=firsts.get):
        if sends[body].kind == "fifo":
            orders[sends[body].group].append(sends[body].seq)
    for group, order in orders.items():
        assert order == sorted(order), f"{label}: message group {group} out of order: {order}"
        acked = sorted(s.seq for s in sends.values() if s.group == group and s.acked)
        assert set(acked) <= set(order), (label, group)

    # Duplicates, explained one by one.
    copies: dict[tuple[bytes, str, str], list[Delivery]] = defaultdict(list)
    for d in mine:
        copies[(d.body, d.message_id, group_of_port[d.port])].append(d)
    stored = Counter(body for body, _id, _g in copies)
    twice_stored = sorted(b for b, n in stored.items() if n > 1)
    for body in twice_stored:
        s, ids = sends[body], {i for b, i, _g in copies if b == body}
        assert s.failures or len(ids) < stored[body], \
            f"{label}: {body} stored {stored[body]} times, never sent again: {s}"
        assert s.started <= outage_end and s.ended >= kill_at, \
            f"{label}: {body} stored {stored[body]} times, its sends not during the outage: {s}"
    redelivered, ages = [], []
    for (body, _id, _g), ds in copies.items():
        for prev, again in zip(ds, ds[1:]):
            age = kill_at - prev.at
            ok = prev.port == killed_port and again.port != killed_port and age <= DUPLICATE_WINDOW_S
            assert ok, (f"{label}: {body} delivered again (port {prev.port} at kill{-age:+.2f} s, then port "
                        f"{again.port} attempt {again.attempt}): not explained by the kill")
            redelivered.append(body)
            ages.append(age)
    return {"deliveries": len(mine), "messages": len(seen), "stored twice": len(twice_stored),
            "redelivered": len(redelivered), "oldest redelivered, s before the kill": round(max(ages, default=0), 2),
            "fifo groups": len(orders)}
