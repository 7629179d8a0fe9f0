"""``chronoq message show`` (docs/cli.md) against a real ``chronoq serve``: the Admin RPC
``LookupMessage`` and the lookup it shares with the console (chronoq.features.lookup).

Traffic comes from the official RocketMQ Python client: one message received and acked, one
received and never acked by a group with max_attempts = 1 (so the first end of its invisible
time sends it to %DLQ%), and one timer message an hour ahead (pending, recallable). The CLI runs
as a subprocess; its JSON must list the events of each life, its table must show them to people,
and an id nothing has must answer "not found" with exit 4.
"""

from __future__ import annotations

import time

from .conftest import groups_toml, wait_until
from .test_cli import make_cli, unique
from .test_official_python_client import make_message, producer, simple_consumer

GROUP = "show-g"


def kinds(message: dict) -> list[tuple]:
    return [(e["kind"], e["group"], e["attempt"]) for e in message["events"]]


def test_message_show_lists_the_life_of_acked_dead_lettered_and_pending_messages(chronoq_process, monkeypatch):
    broker = chronoq_process(groups_toml({GROUP: {"max_attempts": 1}}))
    cli = make_cli(broker.endpoint)
    topic = unique("show")
    with producer(broker.endpoint, topic) as p:
        fine = p.send(make_message(topic, b"fine", keys=("key-fine",))).message_id
        poison = p.send(make_message(topic, b"poison", keys=("key-poison",))).message_id
        later = make_message(topic, b"later", keys=("key-later",))
        later.delivery_timestamp = int(time.time()) + 3600
        pending = p.send(later).message_id

    with simple_consumer(broker.endpoint, GROUP, topic) as c:
        got: list = []
        deadline = time.monotonic() + 20
        while len(got) < 2 and time.monotonic() < deadline:
            got += c.receive(2 - len(got), 2)  # invisible 2 s: poison comes back after it, dead
        assert sorted(m.body for m in got) == [b"fine", b"poison"]
        c.ack(next(m for m in got if m.body == b"fine"))

    def poison_life() -> dict:
        return cli.json("message", "show", poison)["messages"][0]

    wait_until(lambda: any(e["kind"] == "dead_lettered" for e in poison_life()["events"]), 30,
               interval_s=0.5, what="the poison message's dead-letter event")

    # Acked, found by its key.
    shown = cli.json("message", "show", "key-fine")
    assert shown["found"] is True and shown["query"] == "key-fine"
    [m] = shown["messages"]
    assert m["message_id"] == fine and m["topic"] == topic
    assert kinds(m) == [("stored", None, None), ("delivered", GROUP, 1), ("acked", GROUP, None)]
    assert m["status"] == f"acked ({GROUP})"
    assert m["groups"] == [{"group": GROUP, "state": "acked", "attempts": 1}]
    assert [r["kind"] for r in m["records"]] == ["stored"]
    assert m["records"][0]["keys"] == ["key-fine"] and m["records"][0]["body_bytes"] == 4
    assert m["stored_ms"] and m["visible_ms"] == m["stored_ms"]  # not delayed: visible when stored

    # Dead-lettered, found by its id: one delivery (max_attempts = 1), then the DLQ.
    m = poison_life()
    assert m["message_id"] == poison
    assert kinds(m) == [("stored", None, None), ("delivered", GROUP, 1), ("dead_lettered", GROUP, None)]
    assert m["status"] == f"dead-lettered ({GROUP})"
    assert [r["kind"] for r in m["records"]] == ["stored", "dead letter"]
    assert m["records"][1]["topic"] == "%DLQ%" + GROUP
    assert all(r["recall_handle"] is None for r in m["records"])

    # Pending timer message: stored with its due time, a recall handle on its scheduled record.
    [m] = cli.json("message", "show", pending)["messages"]
    assert m["status"] == "pending"
    [ev] = m["events"]
    assert ev["kind"] == "stored" and ev["delayed"] is True and ev["due_ms"] == m["due_ms"] > ev["ts_ms"]
    [rec] = m["records"]
    assert rec["kind"] == "scheduled" and rec["recall_handle"]
    assert rec["deliver_at_ms"] == m["due_ms"]

    # For people: the status line and both tables.
    out = cli("message", "show", poison).out
    assert f"message {poison} in {topic}: dead-lettered ({GROUP})" in out
    assert "dead_lettered" in out and "delivered" in out and "%DLQ%" + GROUP in out
    assert "records in the commit log" in out

    # The status line folds at word boundaries to the terminal's width, as the docs say (it was
    # one line however long: several groups' states make it long).
    monkeypatch.setenv("COLUMNS", "50")
    lines = cli("message", "show", poison).out.splitlines()
    first = lines.index(next(line for line in lines if line.startswith("message ")))
    assert len(lines[first]) <= 50 and lines[first + 1].startswith("  "), lines[:3]
    assert " ".join(part.strip() for part in lines[first:first + 2]).startswith(f"message {poison} in {topic}")
    monkeypatch.delenv("COLUMNS")

    # Nothing has this id: a clear "not found" and exit 4, also with --json.
    missing = cli("message", "show", "no-such-message-id", expect=4)
    assert "not found" in missing.err and "no-such-message-id" in missing.err
    assert missing.out == ""
    missing = cli("message", "show", "no-such-message-id", "--json", expect=4)
    assert '"found": false' in missing.out
    # A query that cannot be an id or key is refused by the broker (exit 1), not "not found".
    bad = cli("message", "show", "x" * 300, expect=1)
    assert "printable characters" in bad.err
    # Windows: within the broker's limits (it is the authority on them), else refused.
    assert cli.json("message", "show", "key-fine", "--scan-mib", "1", "--trace-mib", "1")["messages"][0][
        "message_id"] == fine
    bad = cli("message", "show", "key-fine", "--scan-mib", "5000", expect=1)
    assert "scan_mib must be between 1 and 1024" in bad.err
