"""Semantics across broker groups (issue 23 step 3, docs/cluster.md): recall, reschedule and
cancel by key find their message wherever it lives; transactions resolve on the group holding
the half message; FIFO order per message group; ``chronoq group list`` sums lag and ``chronoq
receive`` takes from every group. Real ``chronoq serve`` processes (two groups, a primary each),
a real etcd on loopback, the official RocketMQ 5 Python client and the CLI.

One cluster serves the whole module (started once: the CI budget); each test uses topics and
consumer groups of its own."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter

import pytest
from rocketmq import Producer, TransactionChecker, TransactionResolution

from chronoq.timer import handle as recall_handles

from .conftest import ChronoqProcess, wait_until
from .etcd_fixture import start_etcd
from .test_official_python_client import config, make_message, producer, simple_consumer, unique
from .test_replication import cli

# The half messages' check comes soon (the default waits a minute).
TXN_CHECK = "txn_check_after_ms = 1000\ntxn_check_interval_ms = 500\n"


@pytest.fixture(scope="module")
def groups(tmp_path_factory):
    """A cluster of two groups, g1 and g2, each a primary: (g1's node, g2's node)."""
    base = tmp_path_factory.mktemp("xgroup")
    etcd = start_etcd(str(base / "etcd"))
    cluster, nodes = unique("c"), []
    try:
        for group in ("g1", "g2"):
            nodes.append(ChronoqProcess(str(base / group), etcd.config(cluster) + f'group_name = "{group}"\n'
                                        + TXN_CHECK))
        yield nodes[0], nodes[1]
    finally:
        for node in reversed(nodes):
            node.stop()
        etcd.stop()


def admin(node: ChronoqProcess, method: str, *args, **kwargs):
    """One ``AdminClient`` call, in this process (a CLI process costs a second of start-up), on a
    thread of its own (the official client wants the test thread's event loop left alone)."""
    import asyncio
    import concurrent.futures

    from chronoq.client.admin import AdminClient

    async def ask():
        async with AdminClient(node.endpoint) as client:
            return await getattr(client, method)(*args, **kwargs)

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, ask()).result(30)


def spread_topic(a: ChronoqProcess, b: ChronoqProcess, queues: int = 2, kind: str = "") -> str:
    """A new topic with ``queues`` queues on each group (placed through g1), both parts made."""
    topic = unique("t")
    admin(a, "create_topic", topic, queues, kind)
    wait_until(lambda: {t.name: t.queues for t in admin(b, "list_topics")}.get(topic) == queues, 20,
               what="g2's part of the topic")
    return topic


def broker_of(receipt) -> str:
    """The broker group an official send receipt's queue names (str: "group.topic.queue")."""
    return str(receipt.message_queue).partition(".")[0]


def cli_json(*args: str):
    done = cli(*args, "--json")
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return json.loads(done.stdout)


def test_recall_reschedule_and_cancel_by_key_find_their_message_on_either_group(groups):
    """The official producer, given g1's address, sends delayed messages that land on both groups;
    their handles name their group. Recalls through that same producer (it sends them to g1) and
    reschedules through g1 or g2 reach the group holding each message; cancel by key on g1
    cancels on both groups."""
    a, b = groups
    topic, consumers = spread_topic(a, b), unique("g")
    later = int(time.time()) + 600  # never due during the test
    with producer(a.endpoint, topic) as p:
        receipts = []
        for i in range(8):
            m = make_message(topic, b"d%d" % i)
            m.delivery_timestamp = later
            receipts.append((m.body, p.send(m)))
        keyed = []
        for i in range(6):
            m = make_message(topic, b"k%d" % i, keys=("order-7",))
            m.delivery_timestamp = later
            keyed.append(p.send(m).message_id)
        by_group = Counter(recall_handles.decode(r.recall_handle).group for _b, r in receipts)
        assert set(by_group) == {"g1", "g2"}, by_group  # round robin: both groups hold some
        # The handles a group shows again (pending list, lookup) name it too.
        for node, group in ((a, "g1"), (b, "g2")):
            listed = admin(node, "list_pending", topic=topic).messages
            assert len(listed) >= by_group[group] and {recall_handles.decode(m.recall_handle).group
                                                       for m in listed} == {group}, listed
        mine = next(r for _b, r in receipts if recall_handles.decode(r.recall_handle).group == "g2")
        found = admin(b, "lookup_message", mine.message_id).messages[0].records
        assert [r.recall_handle for r in found if r.recall_handle] == [mine.recall_handle], found

        # Recall: the official client sends every recall to its configured address (g1); four
        # consecutive sends over the route's four queues land on both groups.
        recalled = {body for body, _r in receipts[:4]}
        assert {recall_handles.decode(r.recall_handle).group for _b, r in receipts[:4]} == {"g1", "g2"}
        for _body, r in receipts[:4]:
            assert p.recall_message(topic, r.recall_handle) == r.message_id
    # Reschedule through the node of the group not holding the message (chronoq's Admin call,
    # passed on), to 1 s from now: the new handle names the same group.
    moved = {}
    for body, r in receipts[4:]:
        group = recall_handles.decode(r.recall_handle).group
        via = b if group == "g1" else a
        out = cli_json("message", "reschedule", r.recall_handle, "--in", "1", "--endpoint", via.endpoint)
        assert out["outcome"] == "rescheduled", out
        assert recall_handles.decode(out["recall_handle"]).group == group
        moved[body] = out["recall_handle"]
    # A recall already done answers "cancelled" again, asked through the other group's node.
    done = next(r for _b, r in receipts[:4] if recall_handles.decode(r.recall_handle).group == "g1")
    again = cli_json("message", "recall", done.recall_handle, "--endpoint", b.endpoint)
    assert (again["outcome"], again["message_id"]) == ("cancelled", done.message_id), again

    cancelled = cli_json("timers", "cancel", topic, "--key", "order-7", "--endpoint", a.endpoint)
    assert sorted(m["message_id"] for m in cancelled["cancelled"]) == sorted(keyed), cancelled
    assert cancelled["broker_groups"] == 2

    got = Counter()
    with simple_consumer(b.endpoint, consumers, topic) as c:
        deadline = time.monotonic() + 20
        while len(got) < len(moved) and time.monotonic() < deadline:
            for m in c.receive(16, 30):
                got[m.body] += 1
                c.ack(m)
        time.sleep(1)
        for m in c.receive(16, 30):  # nothing more: the recalled and the keyed ones stay cancelled
            got[m.body] += 1
    assert set(got) == set(moved) and max(got.values()) == 1, got
    assert not recalled & set(got)


def test_cancel_by_key_refuses_while_a_group_holding_the_topic_has_no_primary(tmp_path):
    """A route leaves out a group with no primary; cancelling on the others alone would answer
    "done" while the dead group's keyed messages fire once it is back. Nothing is cancelled and
    the command fails naming the group; with the group back, the cancel reaches both."""
    from .test_etcd_failover import start
    from .test_replication import kill_9

    etcd = start_etcd(str(tmp_path / "etcd"))
    cluster, nodes = unique("c"), []
    try:
        for group in ("g1", "g2"):
            nodes.append(ChronoqProcess(str(tmp_path / group), etcd.config(cluster) + f'group_name = "{group}"\n'))
        a, b = nodes
        topic = spread_topic(a, b, queues=1)
        later = int(time.time()) + 600
        with producer(a.endpoint, topic) as p:
            for i in range(4):  # (round robin over the two groups' queues: two on each)
                m = make_message(topic, b"k%d" % i, keys=("order-7",))
                m.delivery_timestamp = later
                p.send(m)
        kill_9(b)
        wait_until(lambda: etcd.view(cluster, "g2").leader is None, 30, what="g2's leader key to expire")
        refused = cli("timers", "cancel", topic, "--key", "order-7", "--endpoint", a.endpoint)
        assert refused.returncode == 1 and "g2" in refused.stderr and "none was" in refused.stderr, refused
        assert len(admin(a, "list_pending", topic=topic).messages) == 2  # g1's: not cancelled either
        nodes[1] = b = start(tmp_path, "g2", etcd.config(cluster) + 'group_name = "g2"\n', port=b.port)  # (its endpoint)
        done = cli_json("timers", "cancel", topic, "--key", "order-7", "--endpoint", a.endpoint)
        assert len(done["cancelled"]) == 4 and done["broker_groups"] == 2, done
    finally:
        for node in reversed(nodes):
            node.stop(check=False)
        etcd.stop()


class Checker(TransactionChecker):
    """The producer's answer to a half message's check: by its body."""

    def __init__(self):
        self.seen: list[bytes] = []
        self.lock = threading.Lock()

    def check(self, message):
        with self.lock:
            self.seen.append(message.body)
        return TransactionResolution.COMMIT if message.body.startswith(b"check-commit") \
            else TransactionResolution.ROLLBACK


def test_transactions_resolve_on_the_group_holding_each_half_message(groups):
    """Halves land on both groups (round robin); commit and rollback go to the half's group; the
    halves left open are checked by the group holding each, through the producer's stream to it.
    The consumer gets every committed message once and nothing rolled back."""
    a, b = groups
    topic, consumers = spread_topic(a, b, kind="transaction"), unique("g")
    checker = Checker()
    p = Producer(config(a.endpoint), (topic,), checker)
    p.startup()
    try:
        halves = Counter()
        want = set()
        for i in range(6):
            for what in ("commit", "rollback", "check-commit", "check-rollback"):
                body = b"%s-%d" % (what.encode(), i)
                tx = p.begin_transaction()
                receipt = p.send(make_message(topic, body), tx)
                halves[broker_of(receipt)] += 1
                if what == "commit":
                    tx.commit()
                elif what == "rollback":
                    tx.rollback()
                if what.endswith("commit"):
                    want.add(body)
        assert set(halves) == {"g1", "g2"}, halves
        wait_until(lambda: len(set(checker.seen)) >= 12, 30, what="every open half checked by its group")

        got = Counter()
        with simple_consumer(b.endpoint, consumers, topic) as c:
            deadline = time.monotonic() + 20
            while set(got) != want and time.monotonic() < deadline:
                for m in c.receive(16, 30):
                    got[m.body] += 1
                    c.ack(m)
            time.sleep(1.5)  # (a check answered twice would publish a second copy by now)
            for m in c.receive(16, 30):
                got[m.body] += 1
        assert set(got) == want and max(got.values()) == 1, (sorted(want - set(got)), got.most_common(3))
        assert {body[:len(b"check-")] for body in checker.seen} == {b"check-"}  # only the open ones
    finally:
        p.shutdown()


def test_group_list_sums_lag_and_receive_takes_from_every_group(groups):
    a, b = groups
    topic, consumers = spread_topic(a, b), unique("g")
    sent = cli_json("send", topic, "m", "--count", "40", "--batch-size", "5", "--endpoint", a.endpoint)
    assert sent["sent"] == 40
    first = cli_json("receive", consumers, topic, "--count", "10", "--max", "5", "--endpoint", a.endpoint)
    assert len(first) == 10 and all(m["acked"] for m in first)

    def lag():
        rows = cli_json("group", "list", "--group", consumers, "--topic", topic, "--endpoint", a.endpoint)
        assert [(r["name"], r["topic"]) for r in rows] == [(consumers, topic)], rows
        return rows[0]["lag"]

    assert lag() == 30  # 40 stored over both groups, 10 received
    rest = cli_json("receive", consumers, topic, "--count", "30", "--max", "8", "--wait", "2",
                    "--endpoint", b.endpoint)
    ids = Counter(m["message_id"] for m in first + rest)
    assert len(ids) == 40 and max(ids.values()) == 1, ids.most_common(2)
    assert {m["message_id"] for m in sent["messages"]} == set(ids)
    assert lag() == 0
    # A consumer group made on g1 only (not yet received from g2): g1's part, and no refusal.
    only_g1 = unique("g")
    admin(a, "create_group", only_g1)
    rows = cli_json("group", "list", "--group", only_g1, "--topic", topic, "--endpoint", b.endpoint)
    assert [(r["name"], r["lag"]) for r in rows] == [(only_g1, 20)], rows


def test_fifo_order_holds_per_message_group_across_two_groups(groups):
    """A FIFO topic over both groups, a FIFO consumer group on each: the official producer's
    message groups hash to one queue each, so to one broker group; the consumer sees each message
    group in order. (Guards behaviour the route already had: passes before step 3 as well.)"""
    a, b = groups
    topic, consumers = spread_topic(a, b, kind="fifo"), unique("g")
    for node in (a, b):
        admin(node, "create_group", consumers, fifo=True)
    message_groups, each = 6, 12
    with producer(a.endpoint, topic) as p:
        where = Counter()
        for i in range(each):
            for g in range(message_groups):
                receipt = p.send(make_message(topic, b"%d-%d" % (g, i), group=f"mg-{g}"))
                where[(g, broker_of(receipt))] += 1
    assert {name for _g, name in where} == {"g1", "g2"}, where
    assert len(where) == message_groups  # each message group on one broker group only
    bodies = []
    with simple_consumer(b.endpoint, consumers, topic) as c:
        deadline = time.monotonic() + 30
        while len(bodies) < message_groups * each and time.monotonic() < deadline:
            for m in c.receive(16, 30):
                bodies.append(m.body)
                c.ack(m)
    assert len(bodies) == message_groups * each, len(bodies)
    for g in range(message_groups):
        mine = [x for x in bodies if x.startswith(b"%d-" % g)]
        assert mine == [b"%d-%d" % (g, i) for i in range(each)], mine
