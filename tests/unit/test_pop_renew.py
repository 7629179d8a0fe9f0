"""Auto-renew for push receives (chronoq/pop/renew.py and PopService): messages stay invisible
while the consumer is alive, until acked, nacked, the client goes away, or the maximum passes.
Driven by a FakeClock; nothing sleeps."""

from __future__ import annotations

import pytest
from popkit import BUFFER_MS, FLUSH_INTERVAL_MS, Node

from chronoq.core import errors
from chronoq.pop import names
from chronoq.pop.renew import CLIENT_SILENCE_MS, Renewals
from chronoq.pop.service import PopService

G, T = "grp", "orders"
CLIENT = "client-1@1@1"
SLICE_MS = 10_000
MAX_MS = 120_000
BEAT_MS = 10_000  # the official clients' heartbeat period


@pytest.fixture
def node(tmp_path):
    n = Node(str(tmp_path)).open()
    n.pop.close()
    n.pop = PopService(n.broker, n.clock, buffer_ms=BUFFER_MS, flush_interval_ms=FLUSH_INTERVAL_MS,
                       push_invisible_ms=SLICE_MS, auto_renew_max_ms=MAX_MS)
    yield n
    if n.pop is not None and not n.pop.closed:
        n.close()


def send(node, count):
    return [node.broker.send(T, f"m{i}".encode()).message_id for i in range(count)]


def push_receive(node, client=CLIENT, n=32):
    return node.pop.receive(G, T, max_messages=n, invisible_ms=None, auto_renew=True, client_id=client)


def live_for(node, ms, client=CLIENT):
    """Advance ``ms`` with the client heartbeating every BEAT_MS; returns what tick reported."""
    handled = 0
    for _ in range(ms // BEAT_MS):
        node.pop.client_seen(client)
        handled += node.advance(BEAT_MS)
    return handled


def retried(node) -> int:
    cfg = node.broker.topics.get(names.retry_topic(G, T))
    return 0 if cfg is None else sum(node.broker.queue_bounds(cfg.name, q)[1] for q in range(cfg.queues))


# ------------------------------------------------------------------------------ pure rule
def test_rule_extends_only_live_clients_within_the_maximum():
    r = Renewals(slice_ms=SLICE_MS, max_ms=MAX_MS, client_silence_ms=30_000)
    assert r.until("", 0) == 0  # no client id: nothing could tell when it is gone
    until = r.until(CLIENT, 1_000)
    assert until == 1_000 + MAX_MS
    assert r.extend(CLIENT, until, 11_000) == 21_000
    assert r.extend(CLIENT, until, 31_000) == 41_000  # seen at 1 000: 30 s of silence is allowed
    assert r.extend(CLIENT, until, 31_001) is None    # ... and no more
    r.seen(CLIENT, 100_000)
    assert r.extend(CLIENT, until, 115_000) == until  # capped at the maximum
    assert r.extend(CLIENT, until, until) is None
    r.gone(CLIENT)
    assert r.extend(CLIENT, until, 100_001) is None
    r.seen("other", 0)
    r.prune(30_001)
    assert not r.alive("other", 30_001)
    assert Renewals(SLICE_MS, 0).until(CLIENT, 0) == 0  # max 0: renewal off


# ------------------------------------------------------------------------------ service
def test_push_receive_stays_invisible_while_the_client_lives_then_acks(node):
    ids = send(node, 3)
    got = push_receive(node)
    assert sorted(p.message.message_id for p in got) == sorted(ids)
    assert all(p.invisible_until_ms == node.clock.wall_ms() + SLICE_MS for p in got)
    assert live_for(node, 6 * SLICE_MS) == 0  # six slices: renewed, never revived
    assert push_receive(node) == []
    assert retried(node) == 0
    node.pop.check()
    for p in got:  # the handles the client holds are still the valid ones
        node.pop.ack(G, T, p.receipt_handle)
    node.pop.check()
    live_for(node, 3 * SLICE_MS)
    assert push_receive(node) == [] and retried(node) == 0


def test_partial_ack_keeps_renewing_the_rest(node):
    send(node, 3)
    first, *rest = push_receive(node)
    node.pop.ack(G, T, first.receipt_handle)
    assert live_for(node, 4 * SLICE_MS) == 0
    for p in rest:
        node.pop.ack(G, T, p.receipt_handle)
    assert retried(node) == 0 and node.pop.inflight_count() == 0


def test_renewal_stops_at_the_maximum(node):
    [mid] = send(node, 1)
    [p] = push_receive(node)
    assert live_for(node, MAX_MS - BEAT_MS) == 0
    assert live_for(node, 2 * BEAT_MS) == 1  # revived once the maximum has passed
    with pytest.raises(errors.InvalidReceiptHandle):
        node.pop.ack(G, T, p.receipt_handle)
    [again] = push_receive(node)
    assert again.message.message_id == mid and again.delivery_attempt == 2


def test_nack_stops_renewal(node):
    send(node, 1)
    [p] = push_receive(node)
    live_for(node, 2 * SLICE_MS)
    node.pop.change_invisible(G, T, p.receipt_handle, 1_000)  # the push consumer's nack
    assert live_for(node, BEAT_MS) == 1  # the nack's 1 s, not another slice
    [again] = push_receive(node)
    assert again.delivery_attempt == 2


def test_terminated_client_is_renewed_no_more(node):
    send(node, 1)
    push_receive(node)
    live_for(node, 2 * SLICE_MS)
    node.pop.client_gone(CLIENT)
    assert node.advance(SLICE_MS) == 1  # revived when the current slice ends


def test_silent_client_is_renewed_no_more(node):
    send(node, 1)
    push_receive(node)
    # No heartbeat at all: renewed while the last sight (the receive) is recent enough.
    handled = node.advance(CLIENT_SILENCE_MS)
    assert handled == 0 and retried(node) == 0
    assert node.advance(SLICE_MS) == 1


def test_no_client_id_or_no_auto_renew_means_one_slice(node):
    send(node, 2)
    assert len(node.pop.receive(G, T, max_messages=1, invisible_ms=None, auto_renew=True)) == 1
    assert len(node.pop.receive(G, T, max_messages=1, invisible_ms=SLICE_MS, client_id=CLIENT)) == 1
    assert live_for(node, SLICE_MS) == 2
    with pytest.raises(errors.InvalidInvisibleTime):
        node.pop.receive(G, T, max_messages=1, invisible_ms=None)


def test_fifo_group_renews_and_keeps_the_queue_blocked(node):
    node.pop.set_group(G, fifo=True)
    for i in range(2):
        node.broker.send(T, f"f{i}".encode(), message_group="g1")
    [p] = push_receive(node, n=1)
    assert live_for(node, 3 * SLICE_MS) == 0
    assert push_receive(node) == []  # the next message of the group waits for the first
    node.pop.ack(G, T, p.receipt_handle)
    [q] = push_receive(node)
    assert q.message.body == b"f1" and q.delivery_attempt == 1


def test_renewal_is_not_durable_after_a_crash(node):
    """A restart forgets renewals: the logged CK revives at its logged deadline (at least once)."""
    send(node, 1)
    [p] = push_receive(node)
    live_for(node, 3 * SLICE_MS)
    node.restart()
    assert node.advance(1) == 1  # logged with the first slice's deadline, long past
    [again] = push_receive(node)
    assert again.message.message_id == p.message.message_id


def test_service_rejects_bad_settings(node):
    with pytest.raises(errors.ClientError):
        PopService(node.broker, node.clock, push_invisible_ms=10)
    with pytest.raises(errors.ClientError):
        PopService(node.broker, node.clock, auto_renew_max_ms=-1)
