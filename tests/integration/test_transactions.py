"""Transactions with the unmodified official Python client: commit, rollback, server check."""

from __future__ import annotations

import threading

from rocketmq import Producer, TransactionChecker, TransactionResolution

from .conftest import wait_until
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
