from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.features.transactions import HALF_TOPIC, Transactions

import pytest

from chronoq.core import errors


def _send_half(broker, txns, body=b"pay", msg_id=None):
    half = txns.half_message(OutgoingMessage("orders", body, message_id=msg_id))
    results = broker.send_batch([half], system=True)
    return results[0], txns.accepted(results, [half])[0]


def _visible(broker, topic="orders"):
    out = []
    for q in range(broker.topic(topic).queues):
        out += broker.read(topic, q, 0, 100).messages
    return out


def test_half_is_invisible_until_commit_and_survives_restart(tmp_path):
    cfg = BrokerConfig(data_dir=str(tmp_path))
    broker = Broker(cfg)
    txns = Transactions(broker)
    result, txid = _send_half(broker, txns)
    assert _visible(broker) == []
    broker.close()  # restart: the pending half is found again from the half queue
    broker = Broker(cfg)
    txns = Transactions(broker)
    assert list(txns.pending) == [int(txid, 16)]
    txns.end("orders", result.message_id, txid, commit=True)
    seen = _visible(broker)
    assert [m.body for m in seen] == [b"pay"] and seen[0].message_id == result.message_id
    with pytest.raises(errors.InvalidTransaction):
        txns.end("orders", result.message_id, txid, commit=True)
    broker.close()
    broker = Broker(cfg)
    assert Transactions(broker).pending == {}  # the op record resolved it for good
    broker.close()


def test_rollback_discards_and_wrong_ids_are_refused(tmp_path):
    broker = Broker(BrokerConfig(data_dir=str(tmp_path)))
    txns = Transactions(broker)
    result, txid = _send_half(broker, txns)
    with pytest.raises(errors.InvalidTransaction):
        txns.end("orders", "not-the-id", txid, commit=True)
    with pytest.raises(errors.InvalidTransaction):
        txns.end("orders", result.message_id, "zz-not-hex", commit=True)
    txns.end("orders", result.message_id, txid, commit=False)
    assert _visible(broker) == [] and txns.pending == {}
    assert broker.read(HALF_TOPIC, 0, 0, 10).messages  # the half stays in its system queue
    broker.close()


def test_checks_are_scheduled_and_expire_after_max(tmp_path):
    clock = FakeClock()
    broker = Broker(BrokerConfig(data_dir=str(tmp_path), txn_check_after_ms=1000, txn_check_interval_ms=500,
                                 txn_max_checks=2), clock=clock)
    txns = Transactions(broker)
    _send_half(broker, txns)
    assert txns.due_checks(clock.wall_ms()) == ([], [])
    clock.advance(1000)
    checks, expired = txns.due_checks(clock.wall_ms())
    assert len(checks) == 1 and checks[0][1].body == b"pay" and not expired
    clock.advance(499)
    assert txns.due_checks(clock.wall_ms()) == ([], [])
    clock.advance(1)
    assert len(txns.due_checks(clock.wall_ms())[0]) == 1
    clock.advance(500)
    checks, expired = txns.due_checks(clock.wall_ms())
    assert checks == [] and len(expired) == 1
    txns.expire(expired[0])
    assert txns.pending == {} and _visible(broker) == []
    broker.close()


def test_halves_resolved_above_an_open_one_stay_resolved_after_restart(tmp_path):
    """The replay floor stays at the oldest open half; halves after it resolved before the state
    was saved must not come back as pending (their producer would be asked again, a committed
    message published twice)."""
    cfg = BrokerConfig(data_dir=str(tmp_path))
    broker = Broker(cfg)
    txns = Transactions(broker)
    _open, open_txid = _send_half(broker, txns, b"open")
    for i in range(3):
        result, txid = _send_half(broker, txns, f"done{i}".encode())
        txns.end("orders", result.message_id, txid, commit=i % 2 == 0)
    txns.checkpoint()
    late, late_txid = _send_half(broker, txns, b"late")
    txns.checkpoint()
    broker.close()
    broker = Broker(cfg)
    assert sorted(Transactions(broker).pending) == sorted([int(open_txid, 16), int(late_txid, 16)])
    broker.close()


def test_due_checks_of_a_slice_skip_halves_resolved_since_the_snapshot(tmp_path):
    clock = FakeClock()
    broker = Broker(BrokerConfig(data_dir=str(tmp_path), txn_check_after_ms=1000), clock=clock)
    txns = Transactions(broker)
    sent = [_send_half(broker, txns) for _ in range(5)]
    clock.advance(1000)
    halves = list(txns.pending.values())  # the check loop's snapshot, looked at a slice at a time
    result, txid = sent[1]
    txns.end("orders", result.message_id, txid, commit=False)  # resolved meanwhile
    checks, expired = txns.due_checks(clock.wall_ms(), halves[:3])
    assert [h.offset for h, _ in checks] == [halves[0].offset, halves[2].offset] and not expired
    assert [h.offset for h, _ in txns.due_checks(clock.wall_ms(), halves[3:])[0]] == [h.offset for h in halves[3:]]
    assert txns.due_checks(clock.wall_ms()) == ([], [])  # all checked: next at the interval
    broker.close()


def test_pending_halves_stop_at_max_pending_transactions_and_ending_one_makes_room(tmp_path):
    cfg = BrokerConfig(data_dir=str(tmp_path), max_pending_transactions=3)
    broker = Broker(cfg)
    txns = Transactions(broker)
    sent = [_send_half(broker, txns, b"p%d" % i) for i in range(3)]
    written = broker.queue_bounds(HALF_TOPIC, 0)[1]
    with pytest.raises(errors.TooManyRequests, match=r"max_pending_transactions \(3\)"):
        txns.half_message(OutgoingMessage("orders", b"one too many"))
    assert broker.queue_bounds(HALF_TOPIC, 0)[1] == written  # refused before anything is written
    result, txid = sent[0]
    txns.end("orders", result.message_id, txid, commit=True)  # ending one is never refused
    _send_half(broker, txns, b"after a commit")
    assert len(txns.pending) == 3
    broker.close()


def test_a_batch_of_halves_is_admitted_whole_or_refused_whole(tmp_path):
    broker = Broker(BrokerConfig(data_dir=str(tmp_path), max_pending_transactions=4))
    txns = Transactions(broker)
    _send_half(broker, txns)
    with pytest.raises(errors.TooManyRequests, match="max_pending_transactions"):
        txns.half_messages([OutgoingMessage("orders", b"b%d" % i) for i in range(4)])
    halves = txns.half_messages([OutgoingMessage("orders", b"b%d" % i) for i in range(3)])
    txns.accepted(broker.send_batch(halves, system=True), halves)
    assert len(txns.pending) == 4
    broker.close()


def test_halves_being_written_count_and_a_failed_write_gives_its_room_back(tmp_path):
    broker = Broker(BrokerConfig(data_dir=str(tmp_path), max_pending_transactions=2))
    txns = Transactions(broker)
    first = txns.half_message(OutgoingMessage("orders", b"in flight"))
    second = txns.half_message(OutgoingMessage("orders", b"in flight too"))
    with pytest.raises(errors.TooManyRequests):  # two admitted, neither written yet: no room
        txns.half_message(OutgoingMessage("orders", b"third"))
    txns.abandoned([second])  # its write failed
    third = txns.half_message(OutgoingMessage("orders", b"third"))
    txns.accepted(broker.send_batch([first, third], system=True), [first, third])
    assert len(txns.pending) == 2
    broker.close()


def test_halves_restored_past_a_lowered_limit_are_all_kept_and_still_end(tmp_path):
    broker = Broker(BrokerConfig(data_dir=str(tmp_path)))
    txns = Transactions(broker)
    sent = [_send_half(broker, txns, b"p%d" % i) for i in range(5)]
    broker.close()
    broker = Broker(BrokerConfig(data_dir=str(tmp_path), max_pending_transactions=2))
    txns = Transactions(broker)
    assert sorted(txns.pending) == sorted(int(txid, 16) for _, txid in sent)  # durable state kept
    with pytest.raises(errors.TooManyRequests):
        txns.half_message(OutgoingMessage("orders", b"new"))
    for result, txid in sent[:3]:
        txns.end("orders", result.message_id, txid, commit=False)
    with pytest.raises(errors.TooManyRequests):  # 2 pending, the limit is 2
        txns.half_message(OutgoingMessage("orders", b"new"))
    txns.end("orders", sent[3][0].message_id, sent[3][1], commit=True)
    _send_half(broker, txns, b"new")
    broker.close()
