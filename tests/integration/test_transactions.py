"""Transactions with the unmodified official Python client: commit, rollback, server check."""

from __future__ import annotations

import signal
import threading
import time

import grpc
import pytest
from rocketmq import Producer, TransactionChecker, TransactionResolution
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc
from rocketmq.v5.exception import TooManyRequestsException

from .conftest import wait_until
from .test_metrics import scrape, value
from .test_official_python_client import config, make_message, receive_all, simple_consumer, unique


class Checker(TransactionChecker):
    def __init__(self, answer):
        self.answer = answer
        self.seen: list[str] = []
        self.lock = threading.Lock()

    def check(self, message):
        with self.lock:
            self.seen.append(message.message_id)
        return self.answer


def _producer(endpoint, topic, checker):
    p = Producer(config(endpoint), (topic,), checker)
    p.startup()
    return p


def test_commit_publishes_and_rollback_discards(chronoq_endpoint):
    topic, group = unique("txn"), unique("txn-g")
    p = _producer(chronoq_endpoint, topic, Checker(TransactionResolution.ROLLBACK))
    try:
        with simple_consumer(chronoq_endpoint, group, topic) as consumer:
            assert receive_all(consumer, 1, timeout_s=2) == []
            tx = p.begin_transaction()
            p.send(make_message(topic, b"committed"), tx)
            assert receive_all(consumer, 1, timeout_s=2) == []  # a half message is invisible
            tx.commit()
            tx2 = p.begin_transaction()
            p.send(make_message(topic, b"rolled back"), tx2)
            tx2.rollback()
            got = receive_all(consumer, 2, timeout_s=6)
            assert [m.body for m in got] == [b"committed"]
            for m in got:
                consumer.ack(m)
    finally:
        p.shutdown()


def test_unresolved_transaction_is_checked_with_the_producer(chronoq_process):
    proc = chronoq_process("txn_check_after_ms = 1000\ntxn_check_interval_ms = 1000\n")
    topic, group = unique("txn-check"), unique("txn-check-g")
    checker = Checker(TransactionResolution.COMMIT)
    p = _producer(proc.endpoint, topic, checker)
    try:
        tx = p.begin_transaction()
        receipt = p.send(make_message(topic, b"decided by the checker"), tx)
        # No commit: the broker asks the producer through its Telemetry stream, the checker says
        # COMMIT, the client answers EndTransaction(SOURCE_SERVER_CHECK) and the message appears.
        wait_until(lambda: checker.seen, 20, what="a transaction check")
        assert checker.seen[0] == receipt.message_id
        with simple_consumer(proc.endpoint, group, topic) as consumer:
            got = receive_all(consumer, 1, timeout_s=10)
            assert [m.body for m in got] == [b"decided by the checker"]
            consumer.ack(got[0])
    finally:
        p.shutdown()


class Answers(Checker):
    """A checker answering from a list, in turn (the last answer repeats)."""

    def __init__(self, *answers):
        super().__init__(answers[-1])
        self.answers = list(answers)

    def check(self, message):
        super().check(message)
        with self.lock:
            return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def test_a_check_goes_only_to_a_producer_of_the_topic(chronoq_process):
    """A half message is checked with a producer of its topic only. Another application's
    producer, connected the whole time, is never asked (its checker would answer for a
    transaction it knows nothing of); the topic's producer, back after a restart, is asked and
    its answer holds. Its checker's first answer is "not known yet" (the Python client's
    TRANSACTION_RESOLUTION_UNSPECIFIED): the half stays pending and is checked again."""
    proc = chronoq_process("txn_check_after_ms = 1000\ntxn_check_interval_ms = 1000\n")
    orders, other = unique("txn-orders"), unique("txn-other")
    stranger = Checker(TransactionResolution.ROLLBACK)
    bystander = _producer(proc.endpoint, other, stranger)
    try:
        first = _producer(proc.endpoint, orders, Checker(TransactionResolution.ROLLBACK))
        try:
            tx = first.begin_transaction()
            receipt = first.send(make_message(orders, b"order 42 paid"), tx)
        finally:
            first.shutdown()  # gone before any check: its half is left pending
        time.sleep(3.5)  # three check intervals with only the other application connected
        assert stranger.seen == []
        owner = Answers(TransactionResolution.TRANSACTION_RESOLUTION_UNSPECIFIED, TransactionResolution.COMMIT)
        again = _producer(proc.endpoint, orders, owner)
        try:
            wait_until(lambda: len(owner.seen) >= 2, 20, what="a check, 'not known yet', then a second check")
            assert set(owner.seen) == {receipt.message_id}
            with simple_consumer(proc.endpoint, unique("txn-orders-g"), orders) as consumer:
                got = receive_all(consumer, 1, timeout_s=10)
                assert [m.body for m in got] == [b"order 42 paid"]
                consumer.ack(got[0])
        finally:
            again.shutdown()
        assert stranger.seen == []
    finally:
        bystander.shutdown()


def test_a_half_sent_to_an_undeclared_topic_is_checked_with_its_sender(chronoq_process):
    """A producer that declared no topic at start-up and sent a half message to one (its settings
    name the topic only minutes later) is the one checked for it."""
    proc = chronoq_process("txn_check_after_ms = 1000\ntxn_check_interval_ms = 1000\n")
    topic = unique("txn-late")
    checker = Checker(TransactionResolution.COMMIT)
    p = Producer(config(proc.endpoint), (), checker)
    p.startup()
    try:
        receipt = p.send(make_message(topic, b"late topic"), p.begin_transaction())
        wait_until(lambda: checker.seen, 20, what="a transaction check")
        assert checker.seen[0] == receipt.message_id
        with simple_consumer(proc.endpoint, unique("txn-late-g"), topic) as consumer:
            assert [m.body for m in receive_all(consumer, 1, timeout_s=10)] == [b"late topic"]
    finally:
        p.shutdown()


PENDING_LIMIT = 50
NO_CHECKS = "txn_check_after_ms = 600000\n"  # every half stays pending for the whole test


def _pending(proc) -> float:
    return value(scrape(proc.http_url), "chronoq_transaction_halves_pending")


def test_pending_transactions_stop_at_the_limit_and_all_survive_a_kill_9(chronoq_process, monkeypatch):
    monkeypatch.setenv("CHRONOQ_MAX_PENDING_TRANSACTIONS", str(PENDING_LIMIT))
    proc = chronoq_process(NO_CHECKS)
    topic, group = unique("txn-limit"), unique("txn-limit-g")
    p = _producer(proc.endpoint, topic, Checker(TransactionResolution.ROLLBACK))
    sent = []  # (message id, transaction id) of every accepted half
    try:
        refused = None
        for i in range(PENDING_LIMIT + 10):  # bounded: the limit, then a few more
            tx = p.begin_transaction()
            try:
                receipt = p.send(make_message(topic, b"t%d" % i), tx)
            except TooManyRequestsException as exc:
                refused = exc
                break
            sent.append((tx, receipt))
        assert len(sent) == PENDING_LIMIT and refused is not None
        assert refused.code == pb.TOO_MANY_REQUESTS
        assert "max_pending_transactions (50)" in str(refused), str(refused)
        sent[0][0].commit()  # ending one works at the limit and makes room for one
        tx = p.begin_transaction()
        sent.append((tx, p.send(make_message(topic, b"after a commit"), tx)))
        with pytest.raises(TooManyRequestsException, match="max_pending_transactions"):
            p.send(make_message(topic, b"full again"), p.begin_transaction())
    finally:
        p.shutdown()
    pending = [(r.message_id, r.transaction_id) for _, r in sent[1:]]
    assert _pending(proc) == PENDING_LIMIT
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)

    # Restart with a lower limit: every pending half is restored all the same; only new ones wait.
    monkeypatch.setenv("CHRONOQ_MAX_PENDING_TRANSACTIONS", "20")
    proc = chronoq_process(NO_CHECKS)
    assert _pending(proc) == PENDING_LIMIT
    assert "50 pending transactions restored, max_pending_transactions is 20" in proc.output()
    p = _producer(proc.endpoint, topic, Checker(TransactionResolution.ROLLBACK))
    try:
        with pytest.raises(TooManyRequestsException, match=r"max_pending_transactions \(20\)"):
            p.send(make_message(topic, b"over the lowered limit"), p.begin_transaction())
    finally:
        p.shutdown()
    with grpc.insecure_channel(proc.endpoint) as channel:  # each restored half ends, as itself
        stub = service_pb2_grpc.MessagingServiceStub(channel)
        for message_id, txid in pending:
            end = stub.EndTransaction(sv.EndTransactionRequest(
                topic=pb.Resource(name=topic), message_id=message_id, transaction_id=txid,
                resolution=pb.COMMIT), timeout=30)
            assert end.status.code == pb.OK, end.status
    assert _pending(proc) == 0
    with simple_consumer(proc.endpoint, group, topic) as consumer:
        got = receive_all(consumer, PENDING_LIMIT + 1, timeout_s=30)
        expected = {b"t%d" % i for i in range(PENDING_LIMIT)} | {b"after a commit"}
        assert sorted(m.body for m in got) == sorted(expected)
