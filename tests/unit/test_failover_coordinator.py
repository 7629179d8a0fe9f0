"""Automatic failover's pure parts (chronoq/replication/coordinator.py) and the committer's
fencing (chronoq/broker/committer.py): the lease deadline on a FakeClock, the start-up and
takeover decisions, the in-sync set, the keys' values. etcd itself: tests/integration/test_etcd_failover.py."""

from __future__ import annotations

import asyncio

import pytest

from chronoq.broker.broker import OutgoingBatch, OutgoingMessage
from chronoq.core import errors
from chronoq.core.clock import FakeClock
from chronoq.core.config import load_config
from chronoq.replication import coordinator as co
from tests.unit.test_committer import _run  # a broker and a started committer on a temporary directory

S = 1_000_000_000  # ns


# ------------------------------------------------------------------------------ the lease deadline
def test_the_deadline_runs_from_when_the_keep_alive_was_sent_less_a_margin():
    clock = FakeClock(monotonic_ns=100 * S)
    lease = co.LeaseDeadline(clock, 2000)
    assert lease.margin_ms == 500 and not lease.holds()  # nothing held before the grant
    sent = clock.monotonic_ns()
    clock.advance(300)  # the answer comes late: the deadline still counts from the request
    lease.renewed(sent, 2)
    assert lease.deadline_ns == sent + 1500 * 1_000_000
    clock.advance(1199)
    assert lease.holds() and lease.remaining_ms() == 1
    clock.advance(1)
    assert not lease.holds() and lease.remaining_ms() == 0


def test_a_pause_past_the_deadline_is_seen_on_resume_and_an_older_renewal_does_not_move_it_back():
    clock = FakeClock()
    lease = co.LeaseDeadline(clock, 5000)
    assert lease.margin_ms == 1000
    lease.renewed(clock.monotonic_ns(), 5)
    late = clock.monotonic_ns()
    clock.advance(4000)
    lease.renewed(clock.monotonic_ns(), 5)
    lease.renewed(late, 5)  # an answer to an earlier request arriving last
    assert lease.deadline_ns == clock.monotonic_ns() + 4000 * 1_000_000
    clock.advance(60_000)  # SIGSTOP: CLOCK_MONOTONIC kept running
    assert not lease.holds()


def test_a_lost_lease_stays_lost():
    clock = FakeClock()
    lease = co.LeaseDeadline(clock, 2000)
    lease.renewed(clock.monotonic_ns(), 2)
    lease.lose("its etcd lease expired")
    lease.renewed(clock.monotonic_ns(), 2)
    assert not lease.holds() and lease.lost == "its etcd lease expired"
    lease.lose("later")
    assert lease.lost == "its etcd lease expired"


def test_lease_seconds_round_up():
    assert [co.lease_seconds(ms) for ms in (1000, 1001, 2000, 5500)] == [1, 2, 2, 6]


# ------------------------------------------------------------------------------ decisions
def _view(leader=None, epoch=0, insync=None):
    return co.View(leader, epoch, 7 if epoch else 0, insync)


def test_start_up_decisions():
    a, b = "10.0.0.1:8081", "10.0.0.2:8081"
    assert co.decide(_view(), a, 0)[0] == co.CAMPAIGN  # a new group
    leader = co.Leader(b, "id", b, 3)
    assert co.decide(_view(leader, 3), a, 0) == (co.FOLLOW, f"{b} leads epoch 3")
    assert co.decide(_view(co.Leader(a, "old", a, 3), 3), a, 0)[0] == co.WAIT  # its own earlier process
    insync = co.InSync(3, b, {b: 900, a: 500})
    assert co.decide(_view(None, 3, insync), a, 500)[0] == co.CAMPAIGN
    kind, why = co.decide(_view(None, 3, insync), a, 499)  # an older copy of its directory
    assert kind == co.WAIT and "before 500" in why
    kind, why = co.decide(_view(None, 3, co.InSync(3, b, {b: 900})), a, 10_000)
    assert kind == co.WAIT and "not in the in-sync set" in why
    assert co.decide(_view(None, 3, None), a, 0)[0] == co.WAIT
    assert co.decide(_view(None, 3, None), a, 0, force=True)[0] == co.CAMPAIGN
    assert co.next_epoch(_view(None, 3), 5) == 6 and co.next_epoch(_view(None, 3), 0) == 4


def test_values_round_trip_and_the_key_layout():
    leader = co.Leader("h:1", "abc", "h:1", 4)
    assert co.Leader.decode(leader.encode()) == leader and co.Leader.decode(b"") is None
    insync = co.InSync(4, "h:1", {"h:1": 10, "h:2": 8})
    assert co.InSync.decode(insync.encode()) == insync
    assert co.leader_key("c", "g") == b"/chronoq/c/g/leader"
    assert co.epoch_key("c", "g") == b"/chronoq/c/g/epoch"
    assert co.insync_key("c", "g") == b"/chronoq/c/g/insync"
    assert co.member_key("c", "g", "h:2") == b"/chronoq/c/g/members/h:2"


# ------------------------------------------------------------------------------ the in-sync set
def test_a_replica_joins_caught_up_stays_while_briefly_behind_and_leaves_when_silent_or_behind():
    t = co.InSyncTracker(bound_ms=1000)
    t.report("r1", 50, synced=100, now_ms=0)
    assert t.wanted(0) == set()  # behind at its first pull: not yet
    t.report("r1", 100, synced=100, now_ms=100)
    t.report("r2", 100, synced=100, now_ms=100)
    assert t.wanted(100) == {"r1", "r2"}
    t.published = t.required = {"r1", "r2"}
    t.report("r1", 150, synced=200, now_ms=200)  # behind, within the bound: stays
    assert t.wanted(900) == {"r1", "r2"}
    t.report("r2", 200, synced=200, now_ms=1000)
    t.report("r1", 180, synced=250, now_ms=1100)  # behind since 200: 900 ms
    assert t.wanted(1200) == {"r1", "r2"}
    t.report("r1", 240, synced=300, now_ms=1300)  # still behind: 1100 ms > bound
    assert t.wanted(1300) == {"r2"}
    assert t.wanted(2100) == set()  # r2 silent for 1100 ms


def test_a_sync_acknowledgement_needs_every_required_replica():
    t = co.InSyncTracker(bound_ms=1000)
    assert not t.acked(0)  # nobody required: never acknowledged by replicas
    t.report("r1", 100, 100, 0)
    t.report("r2", 60, 100, 0)
    t.required = {"r1", "r2"}
    assert t.acked(60) and not t.acked(100)
    t.required = {"r1"}
    assert t.acked(100)


# ------------------------------------------------------------------------------ fencing in the committer
class _Lease:
    def __init__(self) -> None:
        self.held = True

    def holds(self) -> bool:
        return self.held

    def refusal(self) -> str:
        return "this broker lost leadership of c/g (epoch 1): test"


def test_a_fenced_committer_acknowledges_nothing_and_writes_no_new_send(tmp_path):
    async def scenario(broker, committer):
        committer.leadership = _Lease()
        await committer.send([OutgoingMessage("orders", b"held")])
        committer.leadership.held = False
        assert committer.fenced
        written = broker.store.log.written
        with pytest.raises(errors.PreconditionFailed, match="lost leadership"):
            await committer.send([OutgoingMessage("orders", b"after")])
        assert broker.store.log.written == written  # not even written

    _run(tmp_path, scenario)


def test_writes_waiting_for_their_fsync_when_the_lease_lapses_are_refused_and_not_made_visible(tmp_path):
    async def scenario(broker, committer):
        committer.leadership = _Lease()
        sent = broker.write_batch(OutgoingBatch.of([OutgoingMessage("orders", b"pending")]))  # (written, no fsync yet)
        ticket = broker.store.log.written
        committer.leadership.held = False  # lapses before the fsync is reported
        with pytest.raises(errors.PreconditionFailed, match="lost leadership"):
            await committer.durable(ticket)
        assert broker.store.dispatched < ticket  # never made visible to consumers
        assert sent.message_ids

    _run(tmp_path, scenario)


def test_etcd_settings_are_checked():
    ok = load_config(env={}, overrides={"etcd_endpoints": "127.0.0.1:2379, 10.0.0.2:2379", "lease_ttl_ms": 3000})
    assert ok.etcd_list == ["127.0.0.1:2379", "10.0.0.2:2379"]
    assert load_config(env={}).etcd_list == []  # off by default
    for bad, text in (({"etcd_endpoints": "nohost"}, "etcd_endpoints must be host:port"),
                      ({"etcd_endpoints": "h:1", "lease_ttl_ms": 500}, "lease_ttl_ms must be"),
                      ({"etcd_endpoints": "h:1", "cluster_name": "a/b"}, "cluster_name must be"),
                      ({"etcd_endpoints": "h:1", "replica_of": "h:2"}, "exclude each other"),
                      ({"force_leader": True}, "force_leader needs etcd_endpoints")):
        with pytest.raises(errors.ClientError, match=text):
            load_config(env={}, overrides=bad)


# ------------------------------------------------------------------------------ the leader's duty
class _Coord:
    """An etcd session whose in-sync writes wait for ``gate`` (etcd slow to answer)."""

    cluster, group = "c", "g"

    def __init__(self, clock) -> None:
        self.deadline = co.LeaseDeadline(clock, 1_000_000)
        self.deadline.renewed(clock.monotonic_ns(), 1000)
        self.gate = asyncio.Event()
        self.gate.set()
        self.published: list[set] = []

    async def call(self, coro):
        return await coro

    async def register(self, *_args) -> None:
        pass

    async def publish_insync(self, insync) -> bool:
        await self.gate.wait()
        self.published.append(set(insync.members))
        return True


def test_a_sync_acknowledgement_a_leaving_replica_lacks_waits_until_etcd_no_longer_names_it():
    from types import SimpleNamespace

    from chronoq.server.failover import PrimaryDuty

    async def scenario():
        clock = FakeClock()
        store = SimpleNamespace(log=SimpleNamespace(synced=100))
        runtime = SimpleNamespace(
            config=SimpleNamespace(endpoint="a:1", replication_sync_timeout_ms=1000), _stop=asyncio.Event(),
            broker=SimpleNamespace(store=store, clock=clock), coordinator=_Coord(clock))
        coord = runtime.coordinator
        duty = PrimaryDuty(runtime, 1)
        task = asyncio.ensure_future(duty.run())
        duty.report("b:1", 100)
        duty.report("c:1", 100)
        for _ in range(100):
            await asyncio.sleep(0.01)
            if duty.tracker.published == {"b:1", "c:1"}:
                break
        assert coord.published[-1] == {"a:1", "b:1", "c:1"}
        coord.gate.clear()  # etcd is slow from here on
        store.log.synced = 200
        clock.advance(100)
        duty.report("b:1", 200)  # b has the new record, c falls silent
        ack = asyncio.get_running_loop().create_future()
        duty.replica_wait(200, ack.set_result)  # (settled with None, or with the refusal)
        clock.advance(1001)  # c silent past the bound: it must leave the set
        duty.report("b:1", 200)  # (b keeps pulling)
        await asyncio.sleep(0.5)
        assert not ack.done(), "acknowledged while etcd still names a replica lacking the record"
        coord.gate.set()
        assert await asyncio.wait_for(ack, 5) is None
        assert coord.published[-1] == {"a:1", "b:1"} and duty.tracker.required == {"b:1"}
        runtime._stop.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(scenario())


# ------------------------------------------------------------------------------ the step-down
def test_a_fenced_committer_closing_refuses_what_still_waits_instead_of_acknowledging_it(tmp_path):
    """The step-down closes the broker: the close's final flush must not answer OK what waited."""
    from chronoq.broker.broker import Broker
    from chronoq.broker.committer import GroupCommitter
    from chronoq.core.config import BrokerConfig

    async def scenario():
        broker = Broker(BrokerConfig(data_dir=str(tmp_path), segment_bytes=1 << 20).validate())
        committer = GroupCommitter(broker)
        committer._loop = asyncio.get_running_loop()  # (no flusher thread: the close's own flush answers)
        committer.leadership = _Lease()
        try:
            broker.write_batch(OutgoingBatch.of([OutgoingMessage("orders", b"pending")]))  # (written, no fsync yet)
            waiter = asyncio.ensure_future(committer.durable(broker.store.log.written))
            await asyncio.sleep(0)
            committer.leadership.held = False  # fenced before anything was acknowledged
            await committer.close()
            with pytest.raises(errors.PreconditionFailed, match="lost leadership"):
                await waiter
        finally:
            broker.close()

    asyncio.run(scenario())


def _route_service(tmp_path, clock):
    from chronoq.broker.broker import Broker
    from chronoq.broker.committer import GroupCommitter
    from chronoq.core.config import BrokerConfig
    from chronoq.features.transactions import Transactions
    from chronoq.server.messaging.service import MessagingService

    config = BrokerConfig(data_dir=str(tmp_path), segment_bytes=1 << 20, port=7001).validate()
    broker = Broker(config, clock=clock)
    committer = GroupCommitter(broker)
    return broker, committer, MessagingService(config, broker, committer, None, Transactions(broker))


def test_a_fenced_primary_routes_to_the_new_leader_or_refuses_retryably_never_to_itself(tmp_path):
    from rocketmq.grpc_protocol import definition_pb2 as pb
    from rocketmq.grpc_protocol import service_pb2 as sv

    from chronoq.server.failover import Leadership

    class Coord:
        cluster, group = "c", "g"

    clock = FakeClock()
    coord = Coord()
    coord.deadline = co.LeaseDeadline(clock, 2000)
    coord.deadline.renewed(clock.monotonic_ns(), 2)
    leadership = Leadership(coord, 1)
    broker, committer, service = _route_service(tmp_path, clock)
    committer.leadership = leadership
    request = sv.QueryRouteRequest(topic=pb.Resource(name="orders"))

    def endpoints(answer) -> set[str]:
        return {f"{a.host}:{a.port}" for q in answer.message_queues for a in q.broker.endpoints.addresses}

    async def scenario():
        here = await service.QueryRoute(request, None)
        assert here.status.code == pb.Code.OK and endpoints(here) == {"127.0.0.1:7001"}
        clock.advance(2000)  # the lease deadline passes: fenced
        coord.deadline = co.LeaseDeadline(clock, 2000)  # a step-down's fresh lease renews nothing of the term's
        coord.deadline.renewed(clock.monotonic_ns(), 2)
        unknown = await service.QueryRoute(request, None)
        assert unknown.status.code == pb.Code.INTERNAL_SERVER_ERROR and not unknown.message_queues
        assert "no new leader is known yet" in unknown.status.message
        leadership.new_leader = "127.0.0.1:7002"
        moved = await service.QueryRoute(request, None)
        assert moved.status.code == pb.Code.OK and endpoints(moved) == {"127.0.0.1:7002"}
        assert len(moved.message_queues) == len(here.message_queues)
        with pytest.raises(errors.PreconditionFailed, match="lost leadership"):
            committer.check_leader()

    try:
        asyncio.run(scenario())
    finally:
        broker.close()


class _SteppingCoord(_Coord):
    """An etcd session for a fenced leader: who leads, and fresh leases that fail ``refusals`` times first."""

    node = "a:1"

    def __init__(self, clock, refusals: int) -> None:
        super().__init__(clock)
        self.clock = clock
        self.refusals = refusals
        self.fresh = 0

    async def view(self):
        return co.View(co.Leader("b:1", "id-b", "b:1", 2), 2, 7, None)

    async def fresh_lease(self) -> None:
        if self.refusals:
            self.refusals -= 1
            raise ConnectionError("etcd away")
        self.fresh += 1
        self.deadline = co.LeaseDeadline(self.clock, 1_000_000)
        self.deadline.renewed(self.clock.monotonic_ns(), 1000)


def test_a_fenced_leader_steps_down_once_it_holds_a_fresh_lease_and_stays_fenced_for_good(monkeypatch):
    from types import SimpleNamespace

    from chronoq.server import failover
    from chronoq.server.failover import PrimaryDuty

    monkeypatch.setattr(failover, "ETCD_RETRY_S", 0.01)

    async def scenario():
        clock = FakeClock()
        store = SimpleNamespace(log=SimpleNamespace(synced=100))
        runtime = SimpleNamespace(
            config=SimpleNamespace(endpoint="a:1", replication_sync_timeout_ms=1000), _stop=asyncio.Event(),
            broker=SimpleNamespace(store=store, clock=clock), coordinator=_SteppingCoord(clock, refusals=2))
        coord = runtime.coordinator
        duty = PrimaryDuty(runtime, 1)
        task = asyncio.ensure_future(duty.run())
        await asyncio.sleep(0.3)
        assert not duty.stepped_down.is_set() and duty.leadership.holds()
        clock.advance(1_000_001)  # past the term's deadline (a pause)
        await asyncio.wait_for(duty.stepped_down.wait(), 5)
        await asyncio.wait_for(task, 5)
        assert coord.fresh == 1 and coord.refusals == 0  # (it kept trying while etcd was away)
        assert duty.leadership.new_leader == "b:1" and "the primary is now b:1" in duty.leadership.refusal()
        assert coord.deadline.holds() and not duty.leadership.holds()  # the fresh lease is not the term's

    asyncio.run(scenario())


def test_a_lapse_the_leader_saw_once_is_final_even_if_a_later_keep_alive_is_answered():
    """etcd stopped, then resumed before it expired the lease: the keep-alive answered after the
    deadline must not make a broker that already refused (fenced) acknowledge again."""
    from chronoq.server.failover import Leadership

    class Coord:
        cluster, group = "c", "g"

    clock = FakeClock(monotonic_ns=100 * S)
    coord = Coord()
    coord.deadline = co.LeaseDeadline(clock, 2000)
    coord.deadline.renewed(clock.monotonic_ns(), 2)
    leadership = Leadership(coord, 1)
    assert leadership.holds()
    clock.advance(1500)  # the deadline passes: a send is refused
    assert not leadership.holds()
    coord.deadline.renewed(clock.monotonic_ns(), 2)  # etcd answers again, the lease alive on its side
    assert not leadership.holds() and "deadline passed" in leadership.refusal()
