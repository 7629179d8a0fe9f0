"""Routes across a failover, with real processes on loopback (docs/replication.md, "Routes and
failover"): an official Python client given a replica's address is routed to its primary; after
``kill -9`` of the primary and ``chronoq promote`` of the replica, clients given the replica's
address carry on against it (the time they take is printed); receipt handles minted by the old
primary are answered by the promoted node correctly (acked when their POP state was copied) or
with INVALID_RECEIPT_HANDLE (when it was not)."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as sv
from rocketmq.grpc_protocol import service_pb2_grpc

from chronoq.protocol.rocketmq import status as codes

from .conftest import ChronoqProcess, wait_until
from .test_official_python_client import make_message, producer, receive_all, simple_consumer, unique
from .test_replication import CONFIG, cli, cluster_status, kill_9, wait_caught_up


@pytest.fixture
def pair(tmp_path):
    """A primary and its replica (left running, SIGCONT first, and stopped after the test)."""
    primary = ChronoqProcess(str(tmp_path / "p"), CONFIG)
    replica = None
    try:
        replica = ChronoqProcess(str(tmp_path / "r"), CONFIG, extra_args=("--replica-of", primary.endpoint))
        yield primary, replica
    finally:
        if replica is not None:
            if replica.proc.poll() is None:
                os.kill(replica.proc.pid, signal.SIGCONT)
            replica.stop()
        primary.stop(check=False)


def test_a_client_given_the_replica_is_routed_to_the_primary(pair):
    primary, replica = pair
    topic, group = unique("routed"), unique("g")
    with producer(replica.endpoint, topic) as p:
        ids = {p.send(make_message(topic, b"m%d" % i)).message_id for i in range(5)}
    with simple_consumer(replica.endpoint, group, topic) as c:
        got = receive_all(c, len(ids), timeout_s=20)
        for m in got:
            c.ack(m)
    assert {m.message_id for m in got} == ids
    # They went to the primary: it wrote them, the replica copied them.
    wait_caught_up(replica, cluster_status(primary.endpoint).commit_end)
    # Anything but a route call is still refused by the replica, naming the primary.
    with grpc.insecure_channel(replica.endpoint) as channel:
        resp = service_pb2_grpc.MessagingServiceStub(channel).SendMessage(
            sv.SendMessageRequest(messages=[pb.Message(topic=pb.Resource(name=topic), body=b"x")]), timeout=10)
    assert resp.status.code == codes.Code.PRECONDITION_FAILED
    assert primary.endpoint in resp.status.message


def _ack(endpoint: str, group: str, topic: str, message) -> int:
    """AckMessage of ``message``'s receipt handle sent to ``endpoint`` (the official client sends an
    ack to the endpoint the message came from: the dead primary); the entry's status code."""
    req = sv.AckMessageRequest(group=pb.Resource(name=group), topic=pb.Resource(name=topic), entries=[
        sv.AckMessageEntry(message_id=message.message_id, receipt_handle=message.receipt_handle)])
    with grpc.insecure_channel(endpoint) as channel:
        resp = service_pb2_grpc.MessagingServiceStub(channel).AckMessage(req, timeout=10)
    return resp.entries[0].status.code if resp.entries else resp.status.code


def _receive_one(consumer) -> list:
    deadline = time.monotonic() + 20
    got: list = []
    while not got and time.monotonic() < deadline:
        got = consumer.receive(1, 60)
    return got


def _send_until_ok(client, message, timeout_s: float = 90.0) -> tuple[float, int]:
    """Send ``message`` until it is acknowledged: (the monotonic time then, attempts); bounded by
    ``timeout_s``."""
    start, attempts = time.monotonic(), 0
    while True:
        attempts += 1
        try:
            client.send(message)
            return time.monotonic(), attempts
        except Exception:  # noqa: BLE001 - the dead primary: try again, bounded by the deadline
            assert time.monotonic() - start < timeout_s, "the producer never reached the promoted node"
            time.sleep(0.2)


def _pop_position(node: ChronoqProcess) -> tuple[int, int]:
    st = cluster_status(node.endpoint)
    return st.pop_generation, st.pop_offset


def _pop_copied(primary: ChronoqProcess, replica: ChronoqProcess) -> bool:
    p, r = cluster_status(primary.endpoint), cluster_status(replica.endpoint)
    return (r.pop_generation, r.pop_offset) == (p.pop_generation, p.pop_offset) and r.commit_end >= p.commit_end


def test_after_failover_clients_given_the_replica_carry_on_and_old_receipt_handles_are_answered(pair):
    primary, replica = pair
    topic, group = unique("failover"), unique("g")
    # Clients that live across the failover, both given the replica's address.
    with producer(replica.endpoint, topic) as p, simple_consumer(replica.endpoint, group, topic) as c, \
            producer(f"{primary.endpoint};{replica.endpoint}", topic) as both:
        p.send(make_message(topic, b"copied"))
        p.send(make_message(topic, b"not-copied"))
        before = _pop_position(primary)
        first = _receive_one(c)
        assert [m.body for m in first] == [b"copied"]
        # Its CK reaches the POP log once it is buffer_ms (2 s) old, then the replica.
        wait_until(lambda: _pop_position(primary) != before and _pop_copied(primary, replica), 30,
                   interval_s=0.1, what="the delivery's CK in the POP log, copied")
        replica.proc.send_signal(signal.SIGSTOP)  # what the primary does now, the replica never gets
        try:
            second = _receive_one(c)
            assert [m.body for m in second] == [b"not-copied"]
            kill_9(primary)
        finally:
            replica.proc.send_signal(signal.SIGCONT)

        promoted_at = time.monotonic()
        promoted = cli("promote", "--endpoint", replica.endpoint)
        assert promoted.returncode == 0, promoted.stderr
        # The old primary's handles: the copied delivery is acked, the other is unknown here.
        assert _ack(replica.endpoint, group, topic, first[0]) == codes.Code.OK
        assert _ack(replica.endpoint, group, topic, second[0]) == codes.Code.INVALID_RECEIPT_HANDLE

        with producer(replica.endpoint, topic) as fresh:  # a client started after the promotion
            fresh.send(make_message(topic, b"fresh"))
        fresh_s = time.monotonic() - promoted_at

        # The clients that were routed to the old primary: their sends fail until their next
        # route refresh (every 30 s in the Python client) names the promoted node.
        switch_at, attempts = _send_until_ok(p, make_message(topic, b"after"))
        both_at, both_attempts = _send_until_ok(both, make_message(topic, b"after-both"))
        switch_s, both_s = switch_at - promoted_at, both_at - promoted_at
        print(f"\nfailover routing: promote to first send of a client started after it {fresh_s:.2f} s; "
              f"of a client given the replica and routed to the old primary {switch_s:.2f} s ({attempts} attempts); "
              f"of one given both addresses {both_s:.2f} s ({both_attempts} attempts)")

        # The acked one is not read again; the one whose delivery was not copied comes back at once.
        bodies, deadline = [], time.monotonic() + 60
        while len(bodies) < 4 and time.monotonic() < deadline:
            try:  # (the consumer's own route refresh may come later than the producer's)
                got = c.receive(32, 30)
            except Exception:  # noqa: BLE001 - the dead primary, until then
                time.sleep(0.2)
                continue
            for m in got:
                bodies.append(m.body)
                c.ack(m)
        assert sorted(bodies) == [b"after", b"after-both", b"fresh", b"not-copied"]
