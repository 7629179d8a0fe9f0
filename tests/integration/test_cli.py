"""The ``chronoq`` command line (docs/cli.md), run as real subprocesses against ``chronoq serve``.

Each call is ``python -m chronoq ...`` with the shared server's endpoint in ``CHRONOQ_ENDPOINT``,
so the whole path is exercised: click parsing, the gRPC clients, ``chronoq.v1.Admin`` and
``MessagingService`` in the server, and the exit statuses (0 done, 1 refused, 2 usage, 3 no answer).
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import uuid

import pytest

from .conftest import ROOT, free_port

CLI_TIMEOUT_S = 30


@pytest.fixture(scope="module")
def cli(chronoq_endpoint):
    return make_cli(chronoq_endpoint)


def make_cli(default_endpoint: str | None):
    """``run(*args, expect=0)``: ``python -m chronoq ARGS`` against ``default_endpoint``; ``run.json``
    adds --json and parses stdout."""
    def run(*args: str, input: bytes | None = None, endpoint: str | None = default_endpoint,
            expect: int | None = 0) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("CHRONOQ_ENDPOINT", None)
        if endpoint is not None:
            env["CHRONOQ_ENDPOINT"] = endpoint
        proc = subprocess.run([sys.executable, "-m", "chronoq", *args], cwd=ROOT, env=env, input=input,
                              stdin=None if input is not None else subprocess.DEVNULL,
                              capture_output=True, timeout=CLI_TIMEOUT_S)
        proc.out = proc.stdout.decode()
        proc.err = proc.stderr.decode()
        if expect is not None:
            assert proc.returncode == expect, f"exit {proc.returncode} for {args}:\n{proc.out}\n{proc.err}"
        return proc

    def run_json(*args: str, **kw):
        return json.loads(run(*args, "--json", **kw).out)

    run.json = run_json
    return run


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def table_rows(out: str) -> dict[str, list[str]]:
    """Body rows of a rich table, keyed by their first cell."""
    rows = {}
    for line in out.splitlines():
        if line.startswith("│"):
            cells = [c.strip() for c in line.split("│")[1:-1]]
            rows[cells[0]] = cells
    return rows


def test_topic_create_and_list(cli):
    name, plain = unique("cli-topic"), unique("cli-mixed")
    assert cli.json("topic", "create", name, "--queues", "3", "--type", "normal") == {
        "name": name, "queues": 3, "message_type": "normal"}
    # Idempotent: a create without --queues/--type keeps what the topic has.
    assert cli.json("topic", "create", name) == {"name": name, "queues": 3, "message_type": "normal"}
    created = cli.json("topic", "create", plain)
    assert created["message_type"] == "mixed" and created["queues"] >= 1

    listed = {t["name"]: t for t in cli.json("topic", "list")}
    assert listed[name] == {"name": name, "queues": 3, "message_type": "normal"}
    assert listed[plain]["message_type"] == "mixed"
    assert not any(n.startswith(("%", "CHRONOQ_")) for n in listed)

    table = cli("topic", "list").out
    assert "TOPIC" in table and "QUEUES" in table and "TYPE" in table
    assert table_rows(table)[name] == [name, "3", "normal"]


def test_group_create_and_list(cli):
    name = unique("cli-group")
    assert cli.json("group", "create", name, "--fifo", "--max-attempts", "4") == {
        "name": name, "fifo": True, "max_attempts": 4}
    # Unnamed settings are kept.
    assert cli.json("group", "create", name, "--no-fifo") == {"name": name, "fifo": False, "max_attempts": 4}
    assert cli.json("group", "list", "--group", name) == [
        {"name": name, "fifo": False, "max_attempts": 4, "topic": None, "lag": 0, "inflight": 0}]
    assert any(g["name"] == name for g in cli.json("group", "list"))

    table = cli("group", "list").out
    assert "LAG" in table and "IN FLIGHT" in table
    assert table_rows(table)[name] == [name, "no", "4", "-", "0", "0"]


def test_send_then_receive_round_trip(cli):
    topic, group = unique("cli-rt"), unique("cli-rt-g")
    cli("topic", "create", topic, "--queues", "1")
    sent = cli.json("send", topic, "hello chronoq", "--tag", "created", "--key", "order-42", "--key", "k2",
                    "--property", "a=1", "--property", "b=x=y")
    assert sent["topic"] == topic and sent["sent"] == 1
    [receipt] = sent["messages"]
    assert receipt["offset"] == 0 and receipt["recall_handle"] is None

    [m] = cli.json("receive", group, topic, "--wait", "5")
    assert m["topic"] == topic
    assert m["message_id"] == receipt["message_id"]
    assert m["body"] == "hello chronoq"
    assert base64.b64decode(m["body_base64"]) == b"hello chronoq"
    assert m["tag"] == "created"
    assert m["keys"] == ["order-42", "k2"]
    assert m["properties"] == {"a": "1", "b": "x=y"}
    assert m["message_group"] is None
    assert (m["queue_id"], m["queue_offset"]) == (0, 0)
    assert m["delivery_attempt"] == 1
    assert 0 < m["born_ms"] <= m["store_ms"]
    assert m["deliver_at_ms"] is None
    assert m["receipt_handle"]
    assert m["acked"] is True
    # Acked: nothing comes back.
    assert cli.json("receive", group, topic, "--wait", "0") == []

    # A binary body from stdin, and the table output for people.
    body = b"\x00\xffbinary\n"
    cli("send", topic, input=body)
    out = cli("receive", group, topic, "--wait", "5").out
    assert "not UTF-8" in out and "received and acknowledged 1 message\n" in out
    cli("send", topic, "--file", "-", input=body)
    [m] = cli.json("receive", group, topic, "--wait", "5")
    assert m["body"] is None and base64.b64decode(m["body_base64"]) == body


def test_group_list_lag_falls_as_messages_are_received(cli):
    topic, group = unique("cli-lag"), unique("cli-lag-g")
    cli("topic", "create", topic, "--queues", "2")
    sent = cli.json("send", topic, "work", "--count", "10", "--batch-size", "4")
    assert sent["sent"] == 10 and len({r["message_id"] for r in sent["messages"]}) == 10

    def row(*filters):
        [r] = cli.json("group", "list", "--group", group, *filters)
        return r["topic"], r["lag"], r["inflight"]

    cli("group", "create", group)
    assert row("--topic", topic) == (topic, 10, 0)   # before the first receive: named topic only
    got = cli.json("receive", group, topic, "--max", "4", "--no-ack", "--wait", "5")
    assert len(got) == 4 and not any(m["acked"] for m in got)
    assert row() == (topic, 6, 4)
    rest = cli.json("receive", group, topic, "--count", "6", "--max", "32", "--wait", "5")
    assert len(rest) == 6 and all(m["acked"] for m in rest)
    assert row() == (topic, 0, 4)  # the unacked four stay in flight until their invisible time ends
    assert {m["message_id"] for m in got + rest} == {r["message_id"] for r in sent["messages"]}


def test_send_table_bulk_and_fifo(cli):
    topic = unique("cli-send")
    out = cli("send", topic, "one").out
    assert "MESSAGE ID" in out and table_rows(out)[topic][2] == "0"
    assert "sent 50 messages to " + topic in cli("send", topic, "bulk", "--count", "50").out
    fifo = cli.json("send", topic, "ordered", "--group", "order-7")
    assert fifo["sent"] == 1


def test_send_delayed(cli):
    proc = cli("send", unique("cli-delay"), "later", "--delay", "3600", "--json", expect=None)
    assert proc.returncode == 0, proc.err
    [r] = json.loads(proc.out)["messages"]
    assert r["recall_handle"]


@pytest.mark.parametrize("args, code, words", [
    (("topic", "create", "bad name"), "ILLEGAL_TOPIC", "bad name"),
    (("topic", "create", "%DLQ%mine"), "ILLEGAL_TOPIC", "reserved"),
    (("topic", "create", "x" * 200), "ILLEGAL_TOPIC", "at most 127"),
    (("group", "create", "bad group!"), "ILLEGAL_CONSUMER_GROUP", "bad group!"),
    (("group", "create", "fine-group", "--max-attempts", "0"), "BAD_REQUEST", "max_attempts"),
    (("group", "list", "--group", "no-such-group-x1"), "CONSUMER_GROUP_NOT_FOUND", "no-such-group-x1"),
    (("group", "list", "--topic", "no-such-topic-x1"), "TOPIC_NOT_FOUND", "no-such-topic-x1"),
    (("send", "bad topic", "x"), "ILLEGAL_TOPIC", "bad topic"),
    (("send", "cli-bad-tag", "x", "--tag", "a|b"), "ILLEGAL_MESSAGE_TAG", "a|b"),
    (("send", "cli-bad-prop", "x", "--property", "__GROUP=1"), "ILLEGAL_MESSAGE_PROPERTY_KEY", "reserved"),
    (("send", "cli-empty", ""), "MESSAGE_BODY_EMPTY", "empty"),
    (("receive", "bad group", "cli-rt"), "ILLEGAL_CONSUMER_GROUP", "bad group"),
])
def test_refused_requests_exit_1_with_the_code(cli, args, code, words):
    proc = cli(*args, expect=1)
    assert proc.err.startswith("chronoq: error: " + code + ": "), proc.err
    assert words in proc.err
    assert "Traceback" not in proc.err and proc.out == ""


@pytest.mark.parametrize("args, words", [
    (("send", "t", "x", "--property", "novalue"), "KEY=VALUE"),
    (("send", "t", "x", "--file", "-"), "not both"),
    (("send", "t", "x", "--group", "g", "--delay", "5"), "cannot be combined"),
    (("receive", "g", "t", "--max", "33"), "--max"),
    (("receive", "g", "t", "--invisible", "0.1"), "--invisible"),  # the range, as for --max: exit 2
    (("receive", "g", "t", "--invisible", "50000"), "--invisible"),
    (("topic", "create", "t", "--type", "lite"), "--type"),
    (("topic", "list", "--endpoint", "no-port"), "host:port"),
])
def test_bad_usage_exits_2(cli, args, words):
    proc = cli(*args, expect=2)
    assert words in proc.err and "Traceback" not in proc.err


@pytest.mark.parametrize("args, via_env", [
    (("topic", "list"), True),
    (("group", "create", "g"), False),
    (("send", "t", "x"), True),
    (("receive", "g", "t", "--wait", "0"), False),
])
def test_unreachable_broker_exits_3(cli, args, via_env):
    endpoint = f"127.0.0.1:{free_port()}"  # nothing listens there
    if via_env:  # CHRONOQ_ENDPOINT
        proc = cli(*args, endpoint=endpoint, expect=3)
    else:
        proc = cli(*args, "--endpoint", endpoint, "--timeout", "5", endpoint=None, expect=3)
    assert proc.err.startswith(f"chronoq: error: cannot reach a broker at {endpoint}"), proc.err
    assert "chronoq serve" in proc.err and "Traceback" not in proc.err and proc.out == ""
