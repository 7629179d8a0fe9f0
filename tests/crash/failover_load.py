"""The mixed load of the failover crash test (``test_failover_crash.py``), through the unmodified
official RocketMQ 5 Python client, and the ledger it keeps of what was acknowledged and delivered.

One round's load runs on threads until the test stops it (at the kill): a producer sending plain,
delayed (due 1-5 s ahead), FIFO (four message groups) and transactional messages (commit or
rollback, some left for the broker's check), recalling some delayed ones; and two simple
consumers (a plain group over the plain, delayed and transactional topics; a FIFO group over the
FIFO topic) receiving and acking at once; recalls run on a thread of their own. Every body is unique and says its kind, so a delivery
names its send. The producer's choices come from the round's seeded ``random.Random``; what the
threads manage before the kill depends on the machine's speed (the kill moment is seeded).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from dataclasses import dataclass, field

from rocketmq import (ClientConfiguration, Credentials, FilterExpression, Message, Producer, SimpleConsumer,
                      TransactionChecker, TransactionResolution)

TOPICS = {"plain": "fo-plain", "delayed": "fo-delayed", "fifo": "fo-fifo", "txn": "fo-txn"}
PLAIN_GROUP, FIFO_GROUP = "fo-consumers", "fo-fifo-consumers"
MESSAGE_GROUPS = ("mg-0", "mg-1", "mg-2", "mg-3")
INVISIBLE_S = 10  # a received message not acked comes back after this (consumers ack at once)
SENDS_MAX = 400   # a round's bound on sends besides its kill


@dataclass
class Send:
    body: bytes
    kind: str                  # plain | delayed | fifo | txn
    round: int
    acked: bool = False        # the send (for txn: the half) was answered OK
    message_id: str = ""
    due: float | None = None   # delayed: the delivery time asked for (s since the epoch)
    group: str = ""            # fifo: the message group; seq: its place in the group
    seq: int = -1
    recall: str = ""           # "" none | ok (cancelled) | late (already delivered) | unknown
    recall_at: float = 0.0     # when the recall was answered
    intent: str = ""           # txn: commit | rollback (the end sent and the checker's answer)
    end: str = ""              # txn: "" not sent (left to the check) | acked | unknown


@dataclass
class Delivery:
    body: bytes
    at: float                  # wall time the receive returned it (s since the epoch)
    epoch: int                 # the round whose primary delivered it
    attempt: int
    endpoint: str = ""         # the broker that handed it out (the message's queue names it)


@dataclass
class Ledger:
    sends: dict[bytes, Send] = field(default_factory=dict)
    deliveries: list[Delivery] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    fifo_seq: dict[str, int] = field(default_factory=dict)

    def record_send(self, send: Send) -> None:
        with self.lock:
            assert send.body not in self.sends, send.body
            self.sends[send.body] = send

    def record_delivery(self, delivery: Delivery) -> None:
        with self.lock:
            self.deliveries.append(delivery)


class Checker(TransactionChecker):
    """Answers a transaction check with the intent the body names (``txc-``: commit, ``txr-``:
    rollback), as a producer that remembers its transactions would."""

    def check(self, message):
        return TransactionResolution.COMMIT if message.body.startswith(b"txc-") else TransactionResolution.ROLLBACK


def client_config(endpoint: str) -> ClientConfiguration:
    return ClientConfiguration(endpoint, Credentials("", ""), request_timeout=3)


def _message(topic: str, body: bytes, *, group: str = "", due: int = 0) -> Message:
    m = Message()
    m.topic, m.body = topic, body
    if group:
        m.message_group = group
    if due:
        m.delivery_timestamp = due
    return m


class Load:
    """One round's clients against ``endpoint`` (the round's primary) and their threads."""

    def __init__(self, endpoint: str, ledger: Ledger, round_no: int, rng: random.Random, *, produce: bool = True):
        self.ledger, self.round, self.rng = ledger, round_no, rng
        self.endpoint = endpoint
        self.stop = threading.Event()
        self.errors: list[str] = []
        # Wall times of the last write ``endpoint`` answered OK (a send, a transaction's end, a
        # recall) and of the consumers' acks it answered OK: a fenced primary must answer none
        # (a route refreshed through it may move the clients to its successor: not counted).
        self.last_ok = self.last_ack_ok = 0.0
        self.producer = Producer(client_config(endpoint), tuple(TOPICS.values()), Checker())
        self.consumers = [
            SimpleConsumer(client_config(endpoint), PLAIN_GROUP,
                           {TOPICS[k]: FilterExpression("*") for k in ("plain", "delayed", "txn")}, await_duration=2),
            SimpleConsumer(client_config(endpoint), FIFO_GROUP, {TOPICS["fifo"]: FilterExpression("*")},
                           await_duration=2)]
        self.producer.startup()
        for c in self.consumers:
            c.startup()
        self.threads = [threading.Thread(target=self._consume, args=(c,), daemon=True) for c in self.consumers]
        # Recalls on a thread of their own: they go on while a send waits for the replica.
        self.recalls: queue.Queue = queue.Queue()
        if produce:
            self.threads += [threading.Thread(target=self._produce, daemon=True),
                             threading.Thread(target=self._recall_loop, daemon=True)]
        for t in self.threads:
            t.start()

    def close(self) -> None:
        """Stop the threads (each bounded by a client call's timeout), then the clients."""
        self.stop.set()
        for t in self.threads:
            t.join(30)
            assert not t.is_alive(), "a load thread did not stop"
        for client in (self.producer, *self.consumers):
            try:
                client.shutdown()
            except Exception:  # noqa: BLE001 - a client of a killed primary may fail to say goodbye
                pass

    # ------------------------------------------------------------------ consumers
    def _consume(self, consumer: SimpleConsumer) -> None:
        while not self.stop.is_set():
            try:
                got = consumer.receive(16, INVISIBLE_S)
            except Exception:  # noqa: BLE001 - the primary is gone (killed): the test stops us soon
                time.sleep(0.1)
                continue
            now = time.time()
            for m in got:
                by = str(m.endpoints)
                self.ledger.record_delivery(Delivery(m.body, now, self.round, m.delivery_attempt, by))
                try:
                    consumer.ack(m)
                except Exception:  # noqa: BLE001 - it comes back (a duplicate the test bounds)
                    continue
                if by == self.endpoint:
                    self.last_ack_ok = time.time()

    # ------------------------------------------------------------------ the producer
    def _produce(self) -> None:
        rng, n = self.rng, 0
        while not self.stop.is_set() and n < SENDS_MAX:
            n += 1
            kind = rng.choices(("plain", "delayed", "fifo", "txn"), (3, 4, 2, 2))[0]
            try:
                if kind == "plain":
                    self._send(Send(b"pl-%d-%d" % (self.round, n), "plain", self.round))
                elif kind == "delayed":
                    s = Send(b"dl-%d-%d" % (self.round, n), "delayed", self.round)
                    s.due = int(time.time()) + rng.randint(2, 5)  # (whole seconds: the client's unit)
                    receipt = self._send(s, due=int(s.due))
                    if receipt is not None and receipt.recall_handle and rng.random() < 0.3:
                        self.recalls.put((time.time() + rng.uniform(0.0, 1.0), s, receipt.recall_handle))
                elif kind == "fifo":
                    group = rng.choice(MESSAGE_GROUPS)
                    seq = self.ledger.fifo_seq.get(group, 0)
                    self.ledger.fifo_seq[group] = seq + 1
                    s = Send(b"ff-%s-%06d-%d" % (group.encode(), seq, self.round), "fifo", self.round,
                             group=group, seq=seq)
                    self._send(s, group=group)
                else:
                    self._transaction(n)
            except Exception as exc:  # noqa: BLE001 - a bug in this loop, not the broker's failure
                self.errors.append(repr(exc))
                return

    def _send(self, s: Send, *, group: str = "", due: int = 0, transaction=None):
        self.ledger.record_send(s)  # before it goes: a delivery of an unanswered send is allowed
        try:
            receipt = self.producer.send(_message(TOPICS[s.kind], s.body, group=group, due=due), transaction)
        except Exception:  # noqa: BLE001 - killed primary, or no replica in sync: not acknowledged
            return None
        s.message_id, s.acked = receipt.message_id, True
        if str(receipt.message_queue.endpoints) == self.endpoint:
            self.last_ok = time.time()
        return receipt

    def _transaction(self, n: int) -> None:
        intent = self.rng.choice(("commit", "rollback"))
        s = Send(b"%s-%d-%d" % (b"txc" if intent == "commit" else b"txr", self.round, n), "txn", self.round,
                 intent=intent)
        leave_to_check = self.rng.random() < 0.25
        tx = self.producer.begin_transaction()
        half = self._send(s, transaction=tx)
        if half is None or leave_to_check:
            return
        s.end = "unknown"
        try:
            tx.commit() if intent == "commit" else tx.rollback()
        except Exception:  # noqa: BLE001 - the broker's check resolves it (with the intent)
            return
        s.end = "acked"
        if str(half.message_queue.endpoints) == self.endpoint:  # (the end goes where the half went)
            self.last_ok = time.time()

    def _recall_loop(self) -> None:
        """Recall the delayed messages picked, up to 1 s after their send (never within 1.2 s of
        their due time: a recall then cancels, unless the primary dies meanwhile)."""
        while not self.stop.is_set():
            try:
                at, s, handle = self.recalls.get(timeout=0.1)
            except queue.Empty:
                continue
            while time.time() < at and not self.stop.is_set():
                time.sleep(0.02)
            if not self.stop.is_set() and time.time() < s.due - 1.2:
                self._recall(s, handle)

    def _recall(self, s: Send, handle: str) -> None:
        s.recall = "unknown"
        try:
            self.producer.recall_message(TOPICS["delayed"], handle)
        except Exception as exc:  # noqa: BLE001
            if "deliver" in str(exc).lower():  # BAD_REQUEST "already delivered": it will be delivered
                s.recall = "late"
            return
        s.recall, s.recall_at = "ok", time.time()
        self.last_ok = s.recall_at
