"""PopService across restarts and crashes: what comes back, what stays acknowledged, the POP
log's torn tail, checkpoints and the skip set (the rest of its behaviour: test_pop_service.py).
Driven by a FakeClock; nothing sleeps."""

from __future__ import annotations

import pytest
from popkit import REDELIVERY_BOUND_MS, G, T, Node, drain, opened_node, send

from chronoq.core import errors
from chronoq.broker.broker import OutgoingMessage
from chronoq.pop import names
from chronoq.pop.service import PopService


@pytest.fixture
def node(tmp_path):
    yield from opened_node(tmp_path)


# --------------------------------------------------------------------------------- restart
def test_groups_persist_and_list(node):
    node.pop.set_group("b-group", fifo=True, max_attempts=5)
    node.pop.group("a-group")
    node.restart(clean=True)
    listed = [(g.name, g.fifo, g.max_attempts) for g in node.pop.list_groups()]
    assert listed == [("a-group", False, 17), ("b-group", True, 5)]


def test_crash_before_anything_is_durable_redelivers_at_once(node):
    ids = send(node, 4)
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=60_000)
    assert len(got) == 4
    node.crash()  # the CKs were still in the merge buffer
    node.open()
    again = drain(node)
    assert sorted(p.message.message_id for p in again) == sorted(ids)


def test_unacked_come_back_after_crash_and_acked_do_not(node):
    ids = send(node, 6)
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=30_000)
    acked = got[:3]
    for p in acked:
        node.pop.ack(G, T, p.receipt_handle)
    node.advance(REDELIVERY_BOUND_MS + 1)  # the acks are now beyond the stated bound
    node.crash()
    node.open()
    node.advance(0)
    assert drain(node, ack=False) == []  # the unacked ones stay invisible until their time
    node.advance(30_000)
    back = drain(node)
    assert sorted(p.message.message_id for p in back) == sorted(p.message.message_id for p in got[3:])
    assert set(ids) == {p.message.message_id for p in got}
    node.pop.check()


def test_clean_restart_keeps_inflight_and_handles(node):
    send(node, 3)
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=30_000)
    node.pop.ack(G, T, got[0].receipt_handle)
    node.restart(clean=True)
    assert drain(node, ack=False) == []
    node.pop.ack(G, T, got[1].receipt_handle)  # a handle from before the restart still works
    node.advance(30_000)
    back = drain(node)
    assert [p.message.message_id for p in back] == [got[2].message.message_id]
    assert back[0].delivery_attempt == 2


def test_revive_happens_for_checkpoints_recovered_after_restart(node):
    node.pop.set_group(G, fifo=True)
    ids = send(node, 2, group="g")
    [p] = node.pop.receive(G, T, max_messages=1, invisible_ms=10_000)
    node.advance(3_000)  # the CK outlives the merge buffer and is logged
    node.crash()
    node.open()
    assert node.pop.group(G).fifo  # group settings are durable
    assert drain(node, ack=False) == []  # FIFO: the recovered CK still blocks the queue
    node.advance(7_000)
    again = drain(node)
    assert [q.message.message_id for q in again] == ids
    assert again[0].delivery_attempt == 2


def test_torn_pop_log_tail_is_truncated(node, tmp_path):
    send(node, 2)
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=30_000)
    node.advance(3_000)
    path = node.pop._journal.log.path
    node.crash()
    with open(path, "ab") as fh:
        fh.write(b"\xde\xad\xbe\xef" * 5)
    node.open()
    assert node.pop.recovery.truncated_bytes == 20
    node.advance(27_000)
    back = drain(node)
    assert sorted(p.message.message_id for p in back) == sorted(p.message.message_id for p in got)


def test_closed_service_refuses_calls(tmp_path):
    n = Node(str(tmp_path)).open()
    n.pop.close()
    with pytest.raises(errors.ClosedError):
        n.pop.receive(G, T, max_messages=1, invisible_ms=10_000)
    n.broker.close()


def test_sync_flush_policy_and_default_clock(tmp_path):
    from chronoq.broker.broker import Broker
    from chronoq.core.config import BrokerConfig

    broker = Broker(BrokerConfig(data_dir=str(tmp_path), flush_policy="sync"))
    pop = PopService(broker)  # the clock defaults to the broker's
    broker.send(T, b"x")
    [p] = pop.receive(G, T, max_messages=32, invisible_ms=10_000)
    pop.ack(G, T, p.receipt_handle)
    pop.close()
    broker.close()


def test_crash_after_offsets_were_persisted_but_before_the_ck_was_durable(node):
    """The consume offset persisted by a broker checkpoint must not pass a CK still in the
    merge buffer (it would lose the message)."""
    ids = send(node, 2)
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=60_000)
    assert len(got) == 2
    node.advance(1_500)  # a broker checkpoint ran; the CKs are still only in memory
    node.crash()
    node.open()
    again = drain(node)
    assert sorted(p.message.message_id for p in again) == sorted(ids)


def test_skip_set_survives_repeated_crashes(node):
    """Offsets of a recovered CK that was then acked are not read again, even after the CK's
    own record was compacted away by later snapshots (they carry SEEN records)."""
    node.broker.send_batch([OutgoingMessage(T, f"m{i}".encode(), queue_id=0) for i in range(2)])
    got = node.pop.receive(G, T, max_messages=32, invisible_ms=60_000)
    node.advance(2_100)  # logged and fsynced; the committed offset is not persisted yet
    node.crash()
    node.open()  # the CK is recovered; the persisted offset is still below it
    for p in got:
        node.pop.ack(G, T, p.receipt_handle)  # handles from before the crash still work
    node.advance(100)
    for _ in range(2):  # each restart writes a new snapshot without the finished CK
        node.advance(60_000)
        node.crash()
        node.open()
    assert drain(node) == []



def test_change_invisible_then_a_revive_of_its_sibling_then_a_crash_loses_nothing(node):
    """The Hypothesis machine's stored failure, step by step. Receive two messages in one CK
    (only in memory), move one to a successor CK (change-invisible-time, also only in memory),
    let the other one's invisible time end: the revive logs the source CK, whose bitmap says the
    moved entry is settled. Its successor must be in the log before it, or after a crash the
    restart's skip set covers the offset and nobody holds it: the message is never delivered
    again."""
    node.broker.send_batch([OutgoingMessage(T, f"m{i}".encode(), queue_id=0) for i in range(2)])
    [stale] = node.pop.receive(G, T, max_messages=1, invisible_ms=1_000)
    node.crash()
    node.open()
    got = node.pop.receive(G, T, max_messages=2, invisible_ms=1_000)
    assert [p.message.queue_offset for p in got] == [0, 1]
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, stale.receipt_handle)  # from before the crash
    node.pop.change_invisible(G, T, got[0].receipt_handle, 5_000)
    node.advance(1_000)  # got[1] is revived into the retry topic; got[0] waits for 5 s
    node.crash()
    node.open()
    node.advance(12_000)
    again = drain(node)
    assert sorted(p.message.message_id for p in again) == sorted(p.message.message_id for p in got)
    node.pop.check()


@pytest.mark.parametrize("chain", [1, 2])
def test_a_moved_entry_survives_a_crash_when_its_source_is_logged_first(node, chain):
    """Same, minimal, with the change made ``chain`` times (the successor's successor must be
    logged too, also when the middle CK was settled only in memory)."""
    node.broker.send_batch([OutgoingMessage(T, f"m{i}".encode(), queue_id=0) for i in range(2)])
    got = node.pop.receive(G, T, max_messages=2, invisible_ms=1_000)
    handle = got[0].receipt_handle
    for _ in range(chain):
        handle = node.pop.change_invisible(G, T, handle, 5_000)
    node.advance(1_000)
    node.crash()
    node.open()
    node.advance(12_000)
    again = drain(node)
    assert sorted(p.message.message_id for p in again) == sorted(p.message.message_id for p in got)


def test_fifo_redelivery_in_place_survives_a_crash_after_its_source_is_sealed(node):
    """The FIFO twin: an expired CK (only in memory) hands its first entry on in place to a
    successor; forwarding its second entry to the DLQ logs it, bitmap and all. The successor
    must be logged first, or the restart skips the first message for good."""
    node.pop.set_group(G, fifo=True)
    ids = send(node, 2, group="g")
    batch = node.pop.receive(G, T, max_messages=2, invisible_ms=1_000)
    assert [p.message.message_id for p in batch] == ids
    node.advance(1_000)  # expired: both wait for in-place redelivery
    [again] = node.pop.receive(G, T, max_messages=1, invisible_ms=5_000)
    assert again.message.message_id == ids[0] and again.delivery_attempt == 2
    node.pop.forward_to_dlq(G, T, batch[1].receipt_handle)  # still waiting: its handle is valid
    node.crash()
    node.open()
    node.pop.set_group(G, fifo=True)
    node.advance(5_000)
    back = drain(node)
    assert [p.message.message_id for p in back] == [ids[0]]

@pytest.mark.parametrize("logged", [False, True])
def test_crash_right_after_a_revive_does_not_copy_it_twice(node, logged):
    """tick fsyncs the retry copy, then the CK's DONE record (logging the CK first if it was
    only in memory), before it returns: a crash just after cannot revive the CK again, nor
    read the message again from its origin queue."""
    [mid] = send(node, 1)
    # Logged: it outlived the merge buffer first. Not logged: revived from memory at 1.5 s, so
    # the broker's last offsets checkpoint (at 1 s) is still below the message.
    invisible_ms = 3_000 if logged else 1_500
    node.pop.receive(G, T, max_messages=1, invisible_ms=invisible_ms)
    node.advance(invisible_ms)
    assert node.broker.queue_bounds(names.retry_topic(G, T), 0) == (0, 1)
    node.crash()
    node.open()
    node.advance(10_000)
    again = drain(node)
    assert [p.message.message_id for p in again] == [mid]
    assert again[0].delivery_attempt == 2
    assert node.broker.queue_bounds(names.retry_topic(G, T), 0) == (0, 1)
