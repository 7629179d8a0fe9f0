"""The store's side of replication, in process: what a primary ships (``Store.read_shipped``),
how a replica appends it (``Store.append_shipped``, ``CommitLog.append`` with a segment base),
the prefix check's tail, the epoch record, and the package's place in the layers."""

from __future__ import annotations

import os

import pytest

from chronoq.core import errors
from chronoq.replication import position
from chronoq.store import record
from chronoq.store.digest import queue_digest

from storekit import SMALL_SEGMENT, body_for, fill, open_store, prep
from test_layers import imports_of


def copy(primary, replica, max_bytes: int = 1 << 20) -> int:
    """What a follower does, without the network: pull until nothing is left; the pulls made."""
    pulls = 0
    while True:
        at = max(replica.log.synced, primary.log.min_offset)  # (an empty replica: the primary's start)
        base, data = primary.read_shipped(at, max_bytes)
        if not data:
            return pulls
        replica.append_shipped(at, base, data)
        replica.sync()
        replica.dispatch_shipped()
        pulls += 1


def as_sent(answer):
    """A pull's answer as the replica reads it (``Parts``: the commit-log bytes written by hand)."""
    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.protocol.h2 import Parts
    return apb.PullResponse.FromString(bytes(answer)) if type(answer) is Parts else answer


def segment_files(store) -> dict[str, bytes]:
    out = {}
    for seg in store.log.segments:
        with open(seg.path, "rb") as fh:
            out[os.path.basename(seg.path)] = fh.read()[:seg.size]
    return out


def test_a_copy_is_the_log_byte_for_byte_with_the_same_segments_and_queues(tmp_path):
    primary = open_store(tmp_path / "p", segment_bytes=SMALL_SEGMENT)
    replica = open_store(tmp_path / "r", segment_bytes=1 << 30)  # its own setting never decides a roll
    fill(primary, 400, batch=9)
    assert len(primary.log.segments) > 3
    assert copy(primary, replica, max_bytes=20_000) > len(primary.log.segments)
    assert segment_files(replica) == segment_files(primary)
    assert queue_digest(replica) == queue_digest(primary)
    assert position.tail(replica, replica.log.synced) == position.tail(primary, primary.log.synced)


def test_written_bytes_are_shipped_before_their_fsync(tmp_path):
    # (the replica's fsync overlaps the primary's: chronoq.replication.shipper)
    primary = open_store(tmp_path / "p")
    fill(primary, 20)
    durable = primary.log.synced
    primary.write([prep("a", 0, b"not yet durable", "late")])
    assert primary.log.written > durable
    base, data = primary.read_shipped(0, 1 << 20)
    assert (base, len(data)) == (0, primary.log.written)
    assert primary.read_shipped(durable, 1 << 20)[1] == data[durable:]
    assert primary.read_shipped(primary.log.written, 1 << 20)[1] == b""


def test_a_pull_ends_at_an_append_boundary_or_a_whole_record(tmp_path):
    primary = open_store(tmp_path / "p")
    primary.append([prep("a", 0, body_for(f"m{i}", 1000), f"m{i}") for i in range(10)])  # one append
    one = primary.log.synced
    primary.append([prep("a", 0, body_for("n", 1000), "n")])
    base, data = primary.read_shipped(0, one + 500)  # room for the first append, not the second
    assert len(data) == one
    base, data = primary.read_shipped(0, 2500)  # less than the append: whole records, no torn one
    pos = 0
    while pos < len(data):
        pos += record.check(data, pos, len(data))
    assert pos == len(data) and 0 < len(data) <= 2500
    base, data = primary.read_shipped(0, 10)  # less than a record: that record, whole
    assert record.check(data, 0, len(data)) == len(data)


def test_bad_shipments_write_nothing(tmp_path):
    primary, replica = open_store(tmp_path / "p"), open_store(tmp_path / "r")
    fill(primary, 10)
    base, data = primary.read_shipped(0, 1 << 20)
    damaged = bytearray(data)
    damaged[len(damaged) // 2] ^= 0x40
    with pytest.raises(errors.CorruptionError):
        replica.append_shipped(0, base, bytes(damaged))
    with pytest.raises(errors.ClientError):
        replica.append_shipped(100, base, data)  # not where this log ends
    with pytest.raises(errors.ChronoqError):
        replica.append_shipped(0, base, data[:-3])  # a torn record
    assert replica.log.written == 0 and os.path.getsize(replica.log.active.path) == 0


def test_an_empty_replica_starts_where_the_primary_log_starts(tmp_path):
    primary = open_store(tmp_path / "p", segment_bytes=SMALL_SEGMENT)
    fill(primary, 200, batch=5)
    primary.log.delete_before(primary.log.segments[2].base)  # what retention does
    replica = open_store(tmp_path / "r")
    copy(primary, replica)
    assert replica.log.min_offset == primary.log.min_offset > 0
    assert segment_files(replica) == segment_files(primary)
    assert sorted(os.listdir(tmp_path / "r" / "commitlog")) == sorted(os.listdir(tmp_path / "p" / "commitlog"))


def test_the_tail_tells_a_diverged_log(tmp_path):
    a, b = open_store(tmp_path / "a"), open_store(tmp_path / "b")
    fill(a, 10)
    copy(a, b)
    end = b.log.synced
    assert position.tail(a, end) == position.tail(b, end)
    a.append([prep("a", 0, b"primary's", "x1")])
    b.append([prep("a", 0, b"replica's", "x1")])  # same length, other bytes
    assert a.log.synced == b.log.synced
    assert position.tail(a, a.log.synced) != position.tail(b, b.log.synced)


def test_the_epoch_is_the_newest_epoch_record(tmp_path):
    store = open_store(tmp_path / "s")
    assert position.current_epoch(store) == 0
    store.append([position.epoch_record(1, "n1", 1)])
    fill(store, 3)
    store.append([position.epoch_record(2, "n2", 2)])
    assert position.current_epoch(store) == 2
    replica = open_store(tmp_path / "r")
    copy(store, replica)
    assert position.current_epoch(replica) == 2  # rebuilt from the shipped log


def test_snapshot_names_are_their_owners():
    from chronoq.broker.offsets import OFFSETS_FILE
    from chronoq.broker.topics import TOPICS_FILE
    from chronoq.features.schedules.book import STATE_FILE as SCHEDULES
    from chronoq.features.staging import STATE_FILE as STAGING
    from chronoq.pop.groups import GROUPS_FILE
    from chronoq.pop.poplog import POP_DIR, SUFFIX
    from chronoq.store.commitlog import LOST_FILE

    assert position.SNAPSHOT_FILES == (TOPICS_FILE, OFFSETS_FILE, GROUPS_FILE, SCHEDULES, STAGING,
                                       f"commitlog/{LOST_FILE}")
    assert (position.POP_DIR, position.POP_SUFFIX) == (POP_DIR, SUFFIX)


def test_replication_sits_below_the_shells():
    for module, names in imports_of("replication").items():
        bad = {n for n in names for shell in ("chronoq.server", "chronoq.cli", "chronoq.console", "chronoq.spark")
               if n == shell or n.startswith(shell + ".")}
        assert not bad, f"{module} imports {sorted(bad)}"


def test_a_lagging_answer_carries_configuration_only(tmp_path):
    """Topics and groups travel with any answer; what names log positions only with the log that
    reaches it (``PrimaryNode._answer``)."""
    from chronoq.broker.broker import Broker, OutgoingMessage
    from chronoq.core.config import BrokerConfig
    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.replication.shipper import PrimaryNode

    broker = Broker(BrokerConfig(data_dir=str(tmp_path / "p")))
    try:
        broker.send_batch([OutgoingMessage("orders", b"x" * 500) for _ in range(20)])
        for name in ("offsets.json", "schedules.json"):  # (contents do not matter here)
            with open(tmp_path / "p" / name, "wb") as fh:
                fh.write(b"{}")
        node = PrimaryNode(broker, None, "primary")
        lagging, data, _ = node._answer(apb.PullRequest(node_id="r", max_bytes=600))
        assert data and len(data) < broker.store.log.synced
        assert {s.name for s in lagging.snapshots} == {"topics.json"}
        whole, data, _ = node._answer(apb.PullRequest(node_id="r"))
        assert len(data) == broker.store.log.synced
        assert {"topics.json", "offsets.json", "schedules.json"} <= {s.name for s in whole.snapshots}
    finally:
        broker.close()


def test_a_replica_is_in_sync_while_it_holds_what_was_written_a_bound_ago(tmp_path):
    """``PrimaryNode.in_sync`` (what ``replication = "sync"`` refuses at once without): a pull within
    the bound, reporting at least the written end of a bound ago. One that pulls often but lags
    further stays out until it catches up; one a round behind under a steady load stays in."""
    from chronoq.broker.broker import Broker, OutgoingMessage
    from chronoq.core.clock import FakeClock
    from chronoq.core.config import BrokerConfig
    from chronoq.replication.shipper import PrimaryNode

    clock = FakeClock()
    broker = Broker(BrokerConfig(data_dir=str(tmp_path / "p"), replication_sync_timeout_ms=1000), clock=clock)
    try:
        node = PrimaryNode(broker, None, "primary")
        ends = []
        for _ in range(30):  # a steady load: a write and an fsync ring every 100 ms for 3 s
            broker.send_batch([OutgoingMessage("orders", b"x" * 200)])
            node.written()
            ends.append(broker.store.log.written)
            clock.advance(100)
        now = clock.wall_ms()
        assert len(node._written_at) <= 1000 // 50 + 2  # (bounded: one sample per 50 ms at most, a bound's worth)
        a_bound_ago = ends[-10]  # the end written at now - 1000 ms (write k at 100 k ms, now at 3000)
        assert node.in_sync(ends[-1], now, now)  # holds everything
        assert node.in_sync(ends[-2], now - 100, now)  # a round behind: still in
        assert node.in_sync(a_bound_ago, now, now)
        assert not node.in_sync(a_bound_ago - 1, now, now)  # pulls, but lags more than the bound
        assert not node.in_sync(ends[-1], now - 1001, now)  # holds everything, but silent too long
        assert PrimaryNode(broker, None, "fresh").in_sync(0, now, now)  # nothing sampled yet: nothing required
    finally:
        broker.close()


def test_a_parked_pull_is_answered_at_the_ring_at_once(tmp_path):
    """A pull with nothing to ship is parked (``PrimaryNode.pull``); the fsync ring
    (``written``) answers it there and then, the bytes read at that moment; a dispatch alone
    (the arrival listener, which may run inside a handler) answers it one loop pass later; with
    neither, it ends empty at its deadline."""
    import asyncio

    from chronoq.broker.broker import Broker, OutgoingMessage
    from chronoq.core.config import BrokerConfig
    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.replication.shipper import PrimaryNode

    broker = Broker(BrokerConfig(data_dir=str(tmp_path / "p")))

    async def run() -> None:
        node = PrimaryNode(broker, None, "primary")
        broker.send_batch([OutgoingMessage("orders", b"a" * 300)])  # (the topic made: topics.json)
        held = node._answer(apb.PullRequest(node_id="r"))[0]  # the snapshots now held by the replica

        def pull_at(end: int) -> apb.PullRequest:
            req = apb.PullRequest(node_id="r", wait_ms=5_000, epoch=node.epoch)
            req.position.commit = end
            req.tail_from, req.tail_crc = position.tail(broker.store, end)
            for snap in held.snapshots:
                req.snapshot_versions[snap.name] = snap.version
            return req

        async def parked(req) -> asyncio.Task:
            task = asyncio.ensure_future(node.pull(req))
            for _ in range(10):
                await asyncio.sleep(0)
            assert not task.done() and len(node._parked) == 1
            return task

        end = broker.store.log.written
        task = await parked(pull_at(end))
        broker.send_batch([OutgoingMessage("orders", b"b" * 300)])  # dispatched: a look asked for
        node.written()  # the ring: answered in this very step
        assert not node._parked and not task.done()  # answered: the call goes on at its next step
        resp = as_sent(await task)
        assert resp.commit_offset == end and len(resp.commit_bytes) == broker.store.log.written - end

        end = broker.store.log.written
        task = await parked(pull_at(end))
        broker.send_batch([OutgoingMessage("orders", b"c" * 300)])  # the arrival listener only
        fut = next(iter(node._parked))
        assert not fut.done()
        await asyncio.sleep(0)  # its look runs at the end of this pass
        assert fut.done()
        assert len(as_sent(await task).commit_bytes) == broker.store.log.written - end

        req = pull_at(broker.store.log.written)
        req.wait_ms = 120  # nothing comes: two ticks, then the empty answer at the deadline
        loop = asyncio.get_running_loop()
        began = loop.time()
        resp = as_sent(await node.pull(req))
        assert not resp.commit_bytes and loop.time() - began >= 0.12 and not node._parked

    try:
        asyncio.run(run())
    finally:
        broker.close()


def test_a_rewritten_snapshot_is_shipped_at_the_next_answer(tmp_path):
    """``PrimaryNode._snapshot_versions`` looks at the files again as soon as one was rewritten
    through ``fsutil.atomic_write`` (every owner's way), and within ``WAIT_TICK_S`` for one written
    behind its back."""
    from chronoq.broker.broker import Broker, OutgoingMessage
    from chronoq.core import fsutil
    from chronoq.core.clock import FakeClock
    from chronoq.core.config import BrokerConfig
    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.replication import shipper
    from chronoq.replication.shipper import PrimaryNode

    clock = FakeClock()
    broker = Broker(BrokerConfig(data_dir=str(tmp_path / "p")), clock=clock)
    try:
        broker.send_batch([OutgoingMessage("orders", b"x" * 100)])
        node = PrimaryNode(broker, None, "primary")
        req = apb.PullRequest(node_id="r")
        for snap in node._answer(req)[0].snapshots:
            req.snapshot_versions[snap.name] = snap.version
        req.position.commit = broker.store.log.written
        assert not node._answer(req)[2]  # nothing new
        fsutil.write_json(str(tmp_path / "p" / "offsets.json"), {"a": 1})
        resp, _data, news = node._answer(req)
        assert news and [s.name for s in resp.snapshots] == ["offsets.json"]
        assert b'"a"' in resp.snapshots[0].content
        req.snapshot_versions["offsets.json"] = resp.snapshots[0].version
        with open(tmp_path / "p" / "schedules.json", "wb") as fh:  # not through atomic_write
            fh.write(b"{}")
        clock.advance(int(shipper.WAIT_TICK_S * 1000) - 1)
        assert not node._answer(req)[2]  # (not looked at again yet: the count did not move)
        clock.advance(1)
        resp, _data, news = node._answer(req)
        assert news and [s.name for s in resp.snapshots] == ["schedules.json"]
    finally:
        broker.close()


def test_a_primary_tracks_a_bounded_number_of_replicas(tmp_path):
    """Every node id that pulls is tracked (status, metrics, the in-sync set, sync
    acknowledgements): at most ``MAX_REPLICAS``. A new one past that takes the place of the one
    silent longest once that one has been silent for ``QUIET_MS``; before, it is refused with
    TOO_MANY_REQUESTS (a replica retries). Oversized names are refused before anything is kept."""
    import asyncio

    from chronoq.broker.broker import Broker
    from chronoq.core.clock import FakeClock
    from chronoq.core.config import BrokerConfig
    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.replication import shipper

    clock = FakeClock()
    broker = Broker(BrokerConfig(data_dir=str(tmp_path / "p")), clock=clock)
    node = shipper.PrimaryNode(broker, None, "primary")

    async def pull(node_id: str, endpoint: str = "127.0.0.1:1") -> None:
        await node.pull(apb.PullRequest(node_id=node_id, endpoint=endpoint, wait_ms=0))

    async def scenario() -> None:
        for i in range(shipper.MAX_REPLICAS):
            await pull(f"r{i}")
            clock.advance(10)
        with pytest.raises(errors.TooManyRequests, match="replicas pulled from this primary"):
            await pull("newcomer")
        assert len(node.replicas) == shipper.MAX_REPLICAS and "newcomer" not in node.replicas
        await pull("r0")  # a tracked replica pulls on, whatever the count
        clock.advance(shipper.QUIET_MS)
        await pull("newcomer")  # r1 has been silent longest, and long enough: it makes room
        assert "newcomer" in node.replicas and "r1" not in node.replicas and "r0" in node.replicas
        assert len(node.replicas) == shipper.MAX_REPLICAS
        for bad in (dict(node_id=""), dict(node_id="n" * (shipper.NODE_ID_MAX + 1)),
                    dict(node_id="ok", endpoint="e" * (shipper.ENDPOINT_MAX + 1))):
            with pytest.raises(errors.ClientError, match="names its node id"):
                await pull(**bad)
        assert len(node.replicas) == shipper.MAX_REPLICAS and "ok" not in node.replicas

    try:
        asyncio.run(scenario())
    finally:
        broker.close()


@pytest.mark.parametrize("size", [0, 1, 127, 128, 16_383, 16_384, 2_097_151, 2_097_152])
def test_an_answer_in_parts_reads_as_the_whole_message(size):
    """``shipper.wire``: the response serialized, then the commit-log bytes as field 4 by hand
    (its varint length at every width), reads back as the message with ``commit_bytes`` set;
    without bytes it is the response itself. ``ReplicationService`` joins the parts for a server
    that cannot send them (grpcio's)."""
    import asyncio

    from chronoq.proto import chronoq_admin_pb2 as apb
    from chronoq.protocol.h2 import Parts
    from chronoq.replication import shipper
    from chronoq.replication.service import ReplicationService

    data = bytes(i % 251 for i in range(size))
    resp = apb.PullResponse(segment_base=7, commit_offset=99, primary_synced=1 << 40, epoch=3, node_id="p",
                            wall_ms=5, pop_generation=2, pop_bytes=b"pop", pop_generation_now=2)
    resp.status.code = 20000
    resp.snapshots.add(name="topics.json", version="v1", content=b"{}")
    want = apb.PullResponse()
    want.CopyFrom(resp)
    want.commit_bytes = data
    answer = shipper.wire(resp, data)
    assert (type(answer) is Parts) == bool(data)
    assert as_sent(answer) == want
    if data:
        assert answer.buffers[-1] is data  # the bytes as read, not a copy
        assert bytes(answer)[:2] == resp.SerializeToString()[:2]  # the Status first (the server's answer code)

    class Node:
        async def pull(self, req):
            return shipper.wire(resp, data)

    for takes_parts in (False, True):
        got = asyncio.run(ReplicationService(Node(), takes_parts=takes_parts).Pull(apb.PullRequest(), None))
        if takes_parts or not data:
            assert as_sent(got) == want
        else:
            assert type(got) is apb.PullResponse and got == want
