"""Replace by key and cancel by key (docs/timers.md) against ``chronoq serve``: the replace key set as
a user property by the unmodified official Python client, the answer read through
``chronoq.client`` (the entry's status message), cancel by message key through the CLI
(``chronoq timers cancel``) and the Admin API; ``chronoq send --replace-key``.

No timing assertions: outcomes only; waits are bounded.
"""

from __future__ import annotations

import asyncio
import time

from chronoq.client.admin import AdminClient
from chronoq.client.client import Client, OutgoingMessage
from chronoq.server import auth

from .conftest import wait_until
from .test_cli_timers import cli  # noqa: F401 (the fixture)
from .test_official_python_client import make_message, producer, receive_all, simple_consumer, unique

REPLACE = "CHRONOQ_REPLACE_KEY"


def _official_send(p, topic: str, body: bytes, due_s: int, props=None, keys=()):
    m = make_message(topic, body, props=props, keys=keys)
    m.delivery_timestamp = due_s
    return p.send(m)


def test_the_official_client_replaces_by_key_and_only_the_last_is_delivered(chronoq_endpoint):
    topic, group = unique("replace"), unique("replace-g")
    due = int(time.time()) + 4
    with producer(chronoq_endpoint, topic) as p, simple_consumer(chronoq_endpoint, group, topic) as c:
        first = _official_send(p, topic, b"v1", due, {REPLACE: "order-1"})
        second = _official_send(p, topic, b"v2", due, {REPLACE: "order-1"})
        other = _official_send(p, topic, b"other", due, {REPLACE: "order-2"})
        assert first.recall_handle and second.recall_handle and other.recall_handle

        async def last():
            async with Client(chronoq_endpoint) as client:
                # (an id of its own: this process's official client makes ids of the same form)
                return await client.send(topic, b"v3", deliver_at_ms=due * 1000, replace_key="order-1",
                                         message_id=unique("v3"))
        third = asyncio.run(last())
        assert third.replaced == f"replaced:{second.message_id}"
        # The replaced one cannot be recalled: it is cancelled already.
        assert p.recall_message(topic, first.recall_handle) == first.message_id
        got = receive_all(c, 2, timeout_s=20)
        for m in got:
            c.ack(m)
        assert sorted(m.body for m in got) == [b"other", b"v3"]
        assert all(m.properties.get(REPLACE) for m in got)  # consumers see the key, not the broker's bookkeeping
        assert not any(k.startswith("__") for m in got for k in m.properties)
        assert receive_all(c, 1, timeout_s=3) == []


def test_cancel_by_message_key_through_the_cli_and_the_admin_api(chronoq_endpoint, cli):  # noqa: F811
    topic, group = unique("cancel-key"), unique("cancel-key-g")
    due = int(time.time()) + 5
    with producer(chronoq_endpoint, topic) as p, simple_consumer(chronoq_endpoint, group, topic) as c:
        doomed = {_official_send(p, topic, b"d%d" % i, due + i % 2, keys=("order-9",)).message_id for i in range(3)}
        keep = _official_send(p, topic, b"keep", due, keys=("order-10",))
        out = cli.json("timers", "cancel", topic, "--key", "order-9")
        assert {m["message_id"] for m in out["cancelled"]} == doomed
        assert out["delivered"] == [] and not out["truncated"]
        text = cli("timers", "cancel", topic, "--key", "order-9").out
        assert "0 pending messages" in text

        async def again():
            async with AdminClient(chronoq_endpoint) as admin:
                return await admin.cancel_by_key(topic, "order-9")
        r = asyncio.run(again())
        assert list(r.cancelled) == [] and list(r.delivered) == []
        got = receive_all(c, 1, timeout_s=20)
        for m in got:
            c.ack(m)
        assert [m.message_id for m in got] == [keep.message_id]
        assert receive_all(c, 1, timeout_s=3) == []


def test_chronoq_send_replace_key_prints_what_it_replaced(cli):  # noqa: F811
    topic = unique("cli-replace")
    first = cli.json("send", topic, "a", "--delay", "60", "--replace-key", "k")["messages"][0]
    assert first["replaced"] == "none"
    second = cli.json("send", topic, "b", "--delay", "60", "--replace-key", "k")["messages"][0]
    assert second["replaced"] == f"replaced:{first['message_id']}"
    assert cli("send", topic, "c", "--replace-key", "k", expect=2).returncode == 2  # needs --delay
    cli.json("timers", "cancel", topic, "--key", "nothing")  # (nothing with that message key)
    assert cli.json("message", "recall", second["recall_handle"])["outcome"] == "cancelled"

    # Each cancelled message's life ends with one "recalled" event: the replaced one's too (with
    # none, `chronoq audit` counted it lost), and a recall of a handle cancelled earlier adds none.
    assert cli.json("message", "recall", first["recall_handle"])["outcome"] == "cancelled"  # (replaced)
    assert cli.json("message", "recall", second["recall_handle"])["outcome"] == "cancelled"  # again

    def lives() -> dict:
        return {m["message_id"]: m for m in
                (cli.json("message", "show", mid)["messages"][0] for mid in (first["message_id"], second["message_id"]))}
    wait_until(lambda: all(m["status"] == "recalled" for m in lives().values()), 20, 0.2, "both recalled")
    for m in lives().values():
        assert [e["kind"] for e in m["events"]] == ["stored", "recalled"], m["events"]


def test_timers_cancel_on_a_topic_that_does_not_exist_fails_and_creates_nothing(cli):  # noqa: F811
    # It used to look the topic's route up first, which created it (auto_create_topics), and
    # answered "0 pending messages cancelled": a misspelt topic looked like success.
    topic = unique("no-such-topic")
    proc = cli("timers", "cancel", topic, "--key", "k", expect=1)
    assert "TOPIC_NOT_FOUND" in proc.stderr.decode() and topic in proc.stderr.decode()
    assert topic not in {t["name"] for t in cli.json("topic", "list")}


def test_cancel_by_key_is_for_admins_only():
    assert auth.ADMIN_SERVICE + "CancelByKey" not in auth.RULES  # the default rule: admin only


def test_a_batch_of_the_chronoq_client_answers_each_replace(chronoq_endpoint):
    topic = unique("replace-batch")
    at = int(time.time() * 1000) + 60_000

    async def work():
        async with Client(chronoq_endpoint) as client:
            return await client.send_batch([OutgoingMessage(topic, b"a", deliver_at_ms=at, replace_key="x"),
                                            OutgoingMessage(topic, b"b", deliver_at_ms=at, replace_key="x"),
                                            OutgoingMessage(topic, b"c", deliver_at_ms=at)])
    a, b, c = asyncio.run(work())
    assert (a.replaced, b.replaced, c.replaced) == ("none", f"replaced:{a.message_id}", "")
