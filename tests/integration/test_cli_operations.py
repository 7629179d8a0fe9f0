"""Day-two verbs and send options of the ``chronoq`` CLI (docs/cli.md), as real subprocesses
against a real ``chronoq serve``: ``send --delay/--at/--level``, ``topic describe|delete``,
``topic create --force``, ``group reset-offset|delete``, ``dlq list|resend``; exit codes,
``--json``, the refusals, tables at 80 columns and the settings errors name."""

from __future__ import annotations

import base64
import datetime
import json
import os
import socket
import subprocess
import sys
import time

import pytest

from . import test_security
from .conftest import ROOT, free_port, groups_toml, wait_until
from .test_cli import make_cli, table_rows, unique

DAY_MS = 86_400_000


@pytest.fixture(scope="module")
def cli(chronoq_endpoint):
    return make_cli(chronoq_endpoint)


def sent_one(cli, *args) -> tuple[dict, int, int]:
    """``send --json``: the one receipt, and the wall clock (ms) just before and after the call."""
    before = int(time.time() * 1000)
    out = cli.json("send", *args)
    after = int(time.time() * 1000)
    [receipt] = out["messages"]
    return receipt, before, after


def widest_table_line(text: str) -> int:
    """The widest line of the tables in ``text`` (a sentence may be longer: the terminal folds it
    at a space; a table row cut so is unreadable)."""
    return max(len(line) for line in text.splitlines() if line[:1] in "┏┃┡│└")


# ----------------------------------------------------------------------------- send: when to deliver
@pytest.mark.parametrize("delay, ms", [("90s", 90_000), ("30m", 1_800_000), ("2h", 7_200_000), ("1d", DAY_MS),
                                       ("1500ms", 1_500), ("45", 45_000), ("1.5", 1_500)])
def test_send_delay_takes_units_or_plain_seconds(cli, delay, ms):
    r, before, after = sent_one(cli, unique("cli-delay"), "later", "--delay", delay)
    assert before + ms <= r["due_ms"] <= after + ms
    assert r["recall_handle"] and r["due"].endswith("Z")


def test_send_at_an_iso_time_with_its_zone(cli):
    local = datetime.datetime.now(datetime.timezone(datetime.timedelta(hours=2))).replace(microsecond=0) \
        + datetime.timedelta(days=1)
    r, _before, _after = sent_one(cli, unique("cli-at"), "later", "--at", local.isoformat())
    assert r["due_ms"] == int(local.timestamp() * 1000)
    utc = local.astimezone(datetime.timezone.utc).replace(tzinfo=None).isoformat() + "Z"
    r, _before, _after = sent_one(cli, unique("cli-at"), "later", "--at", utc)
    assert r["due_ms"] == int(local.timestamp() * 1000)


def test_send_level_is_due_after_the_level_delay(cli):
    r, before, after = sent_one(cli, unique("cli-level"), "later", "--level", "2")  # 5s in the default table
    assert before + 5_000 <= r["due_ms"] <= after + 5_000 and r["recall_handle"]


def test_send_table_shows_the_due_time_not_the_recall_handle(cli):
    topic = unique("cli-due")
    out = cli("send", topic, "later", "--delay", "1h").out
    row = table_rows(out)[topic]
    assert "DUE (UTC)" in out and row[-1].endswith("Z") and row[2] == "-"  # no offset until it is due
    assert "RECALL HANDLE" not in out and "--json" in out
    plain = cli("send", topic, "now").out
    assert "DUE" not in plain and "recall" not in plain


def test_send_out_of_range_level_is_refused_by_the_broker(cli):
    proc = cli("send", unique("cli-level"), "x", "--level", "99", expect=1)
    assert proc.err.startswith("chronoq: error: ") and "99" in proc.err


@pytest.mark.parametrize("args, words", [
    (("--at", "2030-01-01T09:00:00"), "has no time zone"),
    (("--at", "next tuesday"), "not an ISO 8601 time"),
    (("--delay", "5 minutes"), "90s, 30m, 2h, 1d"),
    (("--delay", "-3"), "zero or more"),
    (("--delay", "5m", "--at", "2030-01-01T09:00:00Z"), "--delay and --at cannot be combined"),
    (("--delay", "5m", "--level", "2"), "--delay and --level cannot be combined"),
    (("--at", "2030-01-01T09:00:00Z", "--level", "2"), "--at and --level cannot be combined"),
    (("--group", "g", "--level", "2"), "--group (FIFO) and --level cannot be combined"),
    (("--level", "0"), "0 is not in the range"),
])
def test_send_timing_mistakes_exit_2_naming_the_flag(cli, args, words):
    proc = cli("send", "cli-timing", "x", *args, expect=2)
    assert words in proc.err and "Traceback" not in proc.err


# ----------------------------------------------------------------------------- topic describe / create --force
def test_topic_describe_per_queue_offsets_and_consumers(cli):
    topic, group = unique("cli-desc"), unique("cli-desc-g")
    cli("topic", "create", topic, "--queues", "2", "--type", "normal")
    cli("send", topic, "x", "--count", "3")
    d = cli.json("topic", "describe", topic)
    assert (d["name"], d["queues"], d["message_type"], d["messages"]) == (topic, 2, "normal", 3)
    assert [q["queue_id"] for q in d["per_queue"]] == [0, 1]
    assert sum(q["max_offset"] - q["min_offset"] for q in d["per_queue"]) == 3
    assert all(q["oldest_ms"] and q["newest_ms"] >= q["oldest_ms"] for q in d["per_queue"] if q["messages"])
    assert d["groups"] == []
    cli("receive", group, topic, "--max", "1", "--no-ack")
    d = cli.json("topic", "describe", topic)
    assert d["groups"] == [{"group": group, "lag": 2, "inflight": 1}]
    out = cli("topic", "describe", topic).out
    assert f"topic {topic}: type normal, 2 queues, 3 messages" in out and "MAX OFFSET" in out
    assert table_rows(out)[group] == [group, "2", "1"]
    proc = cli("topic", "describe", unique("cli-none"), expect=1)
    assert proc.err.startswith("chronoq: error: TOPIC_NOT_FOUND: ")


def test_topic_create_refuses_a_type_change_while_it_holds_messages(cli):
    topic = unique("cli-retype")
    cli("topic", "create", topic, "--type", "normal")
    assert cli.json("topic", "create", topic, "--type", "fifo")["message_type"] == "fifo"  # empty: allowed
    cli("send", topic, "ordered", "--group", "g1")
    proc = cli("topic", "create", topic, "--type", "normal", expect=1)
    assert "holds 1 message of type fifo" in proc.err and "--force" in proc.err
    assert cli.json("topic", "create", topic, "--type", "fifo", "--queues", "8")["queues"] == 8  # no change of type
    assert cli.json("topic", "create", topic, "--type", "normal", "--force")["message_type"] == "normal"


# ----------------------------------------------------------------------------- topic delete
def test_topic_delete_refused_while_a_group_lags_then_forced(cli):
    topic, group = unique("cli-del"), unique("cli-del-g")
    cli("send", topic, "x", "--count", "3")
    cli("receive", group, topic, "--max", "1")
    proc = cli("topic", "delete", topic, expect=1)
    assert proc.err.startswith("chronoq: error: BAD_REQUEST: ") and f"{group} (2 not received)" in proc.err
    assert "--force" in proc.err and topic in {t["name"] for t in cli.json("topic", "list")}
    d = cli.json("topic", "delete", topic, "--force")
    assert d == {"deleted": [topic], "messages": 3, "groups": [group]}
    assert topic not in {t["name"] for t in cli.json("topic", "list")}
    assert cli("topic", "describe", topic, expect=1).err.startswith("chronoq: error: TOPIC_NOT_FOUND")
    cli("topic", "delete", topic, expect=1)


def test_topic_delete_refused_while_messages_are_in_flight_even_forced(cli):
    topic, group = unique("cli-del"), unique("cli-del-g")
    cli("send", topic, "x")
    cli("receive", group, topic, "--no-ack", "--invisible", "60")
    proc = cli("topic", "delete", topic, "--force", expect=1)
    assert "in flight" in proc.err and "force does not override" in proc.err


def test_topic_delete_of_a_drained_topic_and_its_answer(cli):
    topic, group = unique("cli-del"), unique("cli-del-g")
    cli("send", topic, "x")
    cli("receive", group, topic)
    out = cli("topic", "delete", topic).out
    assert f"deleted topic {topic}: 1 message; offsets dropped for 1 group ({group})" in out


def test_deleted_topics_and_groups_leave_the_metrics(cli, chronoq_server):
    # Their series stayed until a restart: a topic (or group) per tenant or per day, deleted when
    # done, grew /metrics without bound.
    import urllib.request

    def scrape() -> str:
        return urllib.request.urlopen(chronoq_server.http_url.rstrip("/") + "/metrics", timeout=10).read().decode()

    topic, group, other = unique("cli-met"), unique("cli-met-g"), unique("cli-met-g2")
    cli("send", topic, "x", "--count", "2")
    cli("receive", group, topic, "--max", "1")
    cli("receive", other, topic, "--max", "2")
    text = scrape()
    assert f'chronoq_messages_sent_total{{topic="{topic}"}} 2.0' in text
    assert f'chronoq_messages_acked_total{{group="{group}",topic="{topic}"}} 1.0' in text
    cli("group", "delete", group)
    text = scrape()
    assert f'group="{group}"' not in text and f'group="{other}",topic="{topic}"' in text
    cli("topic", "delete", topic, "--force")
    text = scrape()
    assert [line for line in text.splitlines() if topic in line] == []


def test_system_topics_cannot_be_deleted(cli):
    proc = cli("topic", "delete", "%DLQ%someone", "--force", expect=1)
    assert proc.err.startswith("chronoq: error: ILLEGAL_TOPIC: ")


# ----------------------------------------------------------------------------- group reset-offset / delete
def received_bodies(cli, group: str, topic: str) -> list[str]:
    return [m["body"] for m in cli.json("receive", group, topic, "--max", "32", "--wait", "2")]


def test_group_reset_offset_earliest_latest_and_a_time(cli):
    topic, group = unique("cli-reset"), unique("cli-reset-g")
    cli("topic", "create", topic, "--queues", "1")
    for body in ("a", "b", "c"):  # separate processes: stored in separate milliseconds
        cli("send", topic, body)
    assert received_bodies(cli, group, topic) == ["a", "b", "c"]
    r = cli.json("group", "reset-offset", group, topic, "--to", "earliest")
    assert r["queues"] == [{"queue_id": 0, "old_offset": 3, "new_offset": 0}]
    assert received_bodies(cli, group, topic) == ["a", "b", "c"]
    [q] = cli.json("topic", "describe", topic)["per_queue"]
    assert cli.json("group", "reset-offset", group, topic, "--to", "latest")["queues"][0]["new_offset"] == 3
    second = cli.json("receive", unique("cli-peek"), topic, "--max", "2")[1]  # "b": its stored time
    at = datetime.datetime.fromtimestamp(second["store_ms"] / 1000, datetime.timezone.utc).isoformat()
    r = cli.json("group", "reset-offset", group, topic, "--to", at)
    assert r["queues"][0]["new_offset"] == 1 and r["timestamp_ms"] == second["store_ms"]
    assert received_bodies(cli, group, topic) == ["b", "c"]
    r = cli.json("group", "reset-offset", group, topic, "--to", str(q["oldest_ms"]))  # epoch ms
    assert r["queues"][0]["new_offset"] == 0
    out = cli("group", "reset-offset", group, topic, "--to", "latest").out
    assert f"group {group} on {topic} reset to latest, 1 queue:" in out and table_rows(out)["0"][-1] == "+3"


def test_group_reset_offset_of_one_queue(cli):
    topic, group = unique("cli-reset"), unique("cli-reset-g")
    cli("topic", "create", topic, "--queues", "2")
    cli("send", topic, "x", "--count", "4")
    assert len(received_bodies(cli, group, topic)) == 4
    r = cli.json("group", "reset-offset", group, topic, "--to", "earliest", "--queue", "1")
    assert [q["queue_id"] for q in r["queues"]] == [1]
    assert [m["queue_id"] for m in cli.json("receive", group, topic, "--max", "32", "--wait", "2")] == [1, 1]


@pytest.mark.parametrize("args, code, words", [
    (("group", "reset-offset", "cli-nobody-x1", "cli-rt", "--to", "earliest"), "CONSUMER_GROUP_NOT_FOUND",
     "cli-nobody-x1"),
    (("group", "delete", "cli-nobody-x1"), "CONSUMER_GROUP_NOT_FOUND", "cli-nobody-x1"),
    (("dlq", "list", "cli-nobody-x1"), "NOT_FOUND", "no dead letters"),
    (("dlq", "resend", "cli-nobody-x1"), "NOT_FOUND", "no dead letters"),
])
def test_unknown_names_exit_1(cli, args, code, words):
    proc = cli(*args, expect=1)
    assert proc.err.startswith(f"chronoq: error: {code}: ") and words in proc.err


@pytest.mark.parametrize("to", ["yesterday", "2030-01-01T00:00:00"])
def test_group_reset_offset_bad_to_exits_2(cli, to):
    proc = cli("group", "reset-offset", "g", "t", "--to", to, expect=2)
    assert "--to" in proc.err


def test_group_delete_refused_in_flight_then_forgets_the_group(cli):
    topic, group = unique("cli-gdel"), unique("cli-gdel-g")
    cli("send", topic, "x")
    [m] = cli.json("receive", group, topic, "--no-ack", "--invisible", "60")
    proc = cli("group", "delete", group, expect=1)
    assert "in flight" in proc.err
    cli("group", "reset-offset", group, topic, "--to", "latest")  # in flight stays in flight
    assert cli("group", "delete", group, expect=1).returncode == 1
    assert m["receipt_handle"]


def test_group_delete(cli):
    topic, group = unique("cli-gdel"), unique("cli-gdel-g")
    cli("send", topic, "x")
    cli("receive", group, topic)
    assert cli.json("group", "delete", group) == {"deleted": group, "topics": [topic]}
    cli("group", "list", "--group", group, expect=1)
    # The same name again is a new group: it starts at the oldest retained message.
    assert received_bodies(cli, group, topic) == ["x"]


# ----------------------------------------------------------------------------- dead letters
def test_dlq_list_and_resend(cli):
    topic, group = unique("cli-dlq"), unique("cli-dlq-g")
    cli("topic", "create", topic, "--queues", "1")
    cli("group", "create", group, "--max-attempts", "1")
    cli("send", topic, "first", "--key", "k1", "--tag", "t1")
    cli("send", topic, "second")
    assert len(cli.json("receive", group, topic, "--no-ack", "--invisible", "1")) == 2
    def dead_letters():
        proc = cli("dlq", "list", group, "--json", expect=None)  # exit 1 until the first one
        return proc.returncode == 0 and len(json.loads(proc.out)["messages"]) == 2 and json.loads(proc.out)

    listed = wait_until(dead_letters, 30, 0.3, "both messages dead-lettered")
    assert [m["topic"] for m in listed["messages"]] == [topic, topic]
    assert listed["messages"][0]["keys"] == ["k1"] and listed["messages"][0]["tag"] == "t1"
    assert base64.b64decode(listed["messages"][1]["body_base64"]) == b"second"
    short = cli.json("dlq", "list", group, "--body-bytes", "3")["messages"][1]
    assert (base64.b64decode(short["body_base64"]), short["body_bytes"]) == (b"sec", 6)
    assert (listed["cursor"], listed["not_resent"]) == (0, 2)
    out = cli("dlq", "list", group).out
    assert f"2 dead letters of {group} retained, 2 dead letters not resent" in out

    r = cli.json("dlq", "resend", group, "--limit", "1")
    assert (r["resent"], r["from_offset"], r["to_offset"], r["remaining"]) == (1, 0, 1, 1)
    assert "resent 1 dead letter of" in cli("dlq", "resend", group).out
    assert cli.json("dlq", "resend", group)["resent"] == 0  # nothing left: nothing sent twice
    assert [m["resent"] for m in cli.json("dlq", "list", group, "--all")["messages"]] == [True, True]
    assert cli.json("dlq", "list", group)["messages"] == []
    back = cli.json("receive", group, topic, "--max", "32", "--wait", "2")
    assert sorted(m["body"] for m in back) == ["first", "second"]
    assert {m["delivery_attempt"] for m in back} == {1}
    assert [m["keys"] for m in back if m["body"] == "first"] == [["k1"]]


# ----------------------------------------------------------------------------- tables at 80 columns
def test_tables_fit_80_columns_and_say_1_message(cli, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    topic, group = unique("cli-narrow-topic-with-a-long-name"), unique("cli-narrow-g")
    cli("send", topic, "a body long enough to fold in a narrow table: " + "words " * 12, "--key", "key-one",
        "--tag", "tagged")
    outs = [cli("send", topic, "later", "--delay", "1h").out, cli("topic", "describe", topic).out]
    received = cli("receive", group, topic)
    outs += [received.out, cli("group", "list").out, cli("topic", "list").out]
    for out in outs:
        assert widest_table_line(out) <= 80, out
    assert "MESSAGE ID" in received.out and "BODY" in received.out
    assert "received and acknowledged 1 message\n" in received.out
    # The same commands, piped without COLUMNS: nothing dropped.
    monkeypatch.delenv("COLUMNS")
    wide = cli("receive", group, topic, "--wait", "0").out
    assert "no messages" in wide
    assert "ATTEMPT" in cli("receive", unique("cli-narrow-g2"), topic).out


# ----------------------------------------------------------------------------- errors name the setting
# The access-controlled broker of test_security (users app: no admin role; root: admin).
auth_server = test_security.auth_server


@pytest.mark.parametrize("args", [
    ("topic", "describe", "t"), ("topic", "delete", "t"), ("group", "reset-offset", "g", "t", "--to", "latest"),
    ("group", "delete", "g"), ("dlq", "list", "g"), ("dlq", "resend", "g"),
])
def test_new_verbs_need_the_admin_role(auth_server, monkeypatch, args):
    run = make_cli(auth_server.endpoint)
    monkeypatch.setenv("CHRONOQ_ACCESS_KEY", "app")
    monkeypatch.setenv("CHRONOQ_SECRET_KEY", test_security.USERS["app"])
    proc = run(*args, expect=1)
    assert proc.err.startswith("chronoq: error: FORBIDDEN: ") and "admin role" in proc.err
    assert "CHRONOQ_ACCESS_KEY" in proc.err
    monkeypatch.setenv("CHRONOQ_ACCESS_KEY", "root")
    monkeypatch.setenv("CHRONOQ_SECRET_KEY", test_security.USERS["root"])
    assert "FORBIDDEN" not in run(*args, expect=None).err


def test_missing_credentials_name_the_settings(auth_server):
    proc = make_cli(auth_server.endpoint)("topic", "list", expect=1)
    assert proc.err.startswith("chronoq: error: UNAUTHORIZED: ")
    assert "--access-key" in proc.err and "CHRONOQ_ACCESS_KEY" in proc.err and "CHRONOQ_SECRET_KEY" in proc.err


def test_tls_to_a_plain_broker_names_the_tls_settings(cli):
    proc = cli("topic", "list", "--tls", "--timeout", "5", expect=3)
    assert "--tls" in proc.err and "CHRONOQ_TLS" in proc.err and "CHRONOQ_ENDPOINT" in proc.err


@pytest.mark.parametrize("taken, words", [("--port", ("--port", "CHRONOQ_PORT")),
                                          ("--http-port", ("--http-port", "CHRONOQ_HTTP_PORT"))])
def test_serve_on_a_taken_port_names_the_setting(tmp_path, taken, words):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = str(busy.getsockname()[1])
        ports = {"--port": str(free_port()), "--http-port": str(free_port()), taken: port}
        proc = subprocess.run([sys.executable, "-m", "chronoq", "serve", "--data-dir", str(tmp_path / "data"),
                               "--host", "127.0.0.1", "--port", ports["--port"], "--http-port", ports["--http-port"]],
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1, proc.stderr
    assert "chronoq: cannot start: cannot listen" in proc.stderr and all(w in proc.stderr for w in words)


def test_serve_on_a_data_dir_it_cannot_create_says_so_in_one_line(tmp_path):
    # A file where the directory should be (set through the environment, which --data-dir's own
    # check does not see) ended in a Python traceback.
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    for where in (blocker, blocker / "below"):
        env = dict(os.environ, PYTHONPATH=ROOT, CHRONOQ_DATA_DIR=str(where))
        proc = subprocess.run([sys.executable, "-m", "chronoq", "serve", "--host", "127.0.0.1",
                               "--port", str(free_port()), "--http-port", "off"],
                              cwd=ROOT, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr, proc.stderr
        assert f"chronoq: cannot start: cannot use data directory {where}" in proc.stderr
        assert "CHRONOQ_DATA_DIR" in proc.stderr


def test_a_bad_endpoint_from_the_environment_names_it():
    proc = make_cli("no-port-here")("topic", "list", expect=2)
    assert "CHRONOQ_ENDPOINT" in proc.err and "host:port" in proc.err


# ----------------------------------------------------------------------------- counts for people
def test_counts_of_a_thousand_and_more_have_separators_json_stays_raw(cli):
    topic, group = unique("cli-many"), unique("cli-many-g")
    cli("topic", "create", topic, "--queues", "1")
    assert f"sent 1,234 messages to {topic}" in cli("send", topic, "x", "--count", "1234").out
    out = cli("topic", "describe", topic).out
    assert f"topic {topic}: type mixed, 1 queue, 1,234 messages" in out
    assert table_rows(out)["0"][3] == "1,234"  # MESSAGES (offsets stay plain: they are typed back)
    d = cli.json("topic", "describe", topic)
    assert d["messages"] == 1234 and d["per_queue"][0]["messages"] == 1234
    cli("receive", group, topic, "--max", "1")
    [row] = [r for r in cli.json("group", "list", "--group", group) if r["topic"] == topic]
    assert row["lag"] == 1233
    assert table_rows(cli("group", "list", "--group", group).out)[group][4] == "1,233"  # LAG


# ----------------------------------------------------------------------------- lost or damaged topics/groups.json
def test_serve_reopens_a_data_dir_whose_topics_json_is_lost(chronoq_process):
    """The trace is on by default, so every served data directory holds CHRONOQ_TRACE records:
    without topics.json it did not open ("topic CHRONOQ_TRACE has 4 queues; the count can only
    grow"). Now the table is rebuilt from the store and the start says so."""
    server = chronoq_process()
    topic = unique("cli-lost")
    make_cli(server.endpoint)("send", topic, "kept", "--count", "3")
    server.stop()  # a clean stop writes the trace buffer
    assert os.path.isdir(os.path.join(server.data_dir, "consumequeue", "CHRONOQ_TRACE"))
    os.remove(os.path.join(server.data_dir, "topics.json"))
    again = chronoq_process()  # the same data directory ("data")
    d = make_cli(again.endpoint).json("topic", "describe", topic)
    assert (d["messages"], d["message_type"]) == (3, "mixed")
    assert any("recovery:" in line and "topics.json was missing" in line for line in again.lines), again.output()


@pytest.mark.parametrize("name, words", [("topics.json", "topic configurations"),
                                         ("groups.json", "consumer groups' settings")])
def test_serve_on_a_damaged_topics_or_groups_file_exits_2_naming_it(chronoq_process, name, words):
    server = chronoq_process()
    cli = make_cli(server.endpoint)
    cli("topic", "create", unique("cli-damaged"))
    cli("group", "create", unique("cli-damaged-g"), "--fifo")
    server.stop()
    path = os.path.join(server.data_dir, name)
    with open(path, "r+b") as fh:  # cut in the middle, as a copy that ran out of space
        fh.truncate(os.path.getsize(path) // 2)
    proc = subprocess.run([sys.executable, "-m", "chronoq", "serve", "--data-dir", server.data_dir,
                           "--host", "127.0.0.1", "--port", str(free_port()), "--http-port", "-1"],
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert f"chronoq: cannot start: corrupt data in {path} at byte 0: " in proc.stderr
    assert words in proc.stderr and "Restore it from a backup" in proc.stderr and "move it aside" in proc.stderr
    assert "Traceback" not in proc.stderr and "--quarantine" not in proc.stderr


# ----------------------------------------------------------------------------- groups of the config file
def test_group_delete_of_a_config_file_group_is_refused_until_the_config_drops_it(chronoq_process):
    """A group of the config file came back after ``group delete`` and a restart (every start
    applies ``[groups.*]``). Now the delete says where the group is defined; once the table is
    gone from the config file, the group deleted stays deleted across restarts."""
    group, topic = unique("cli-cfg-g"), unique("cli-cfg")
    config = groups_toml({group: {"fifo": True, "max_attempts": 3}})
    server = chronoq_process(config)
    cli = make_cli(server.endpoint)
    cli("send", topic, "x")
    cli("receive", group, topic)
    proc = cli("group", "delete", group, expect=1)
    assert proc.err.startswith("chronoq: error: BAD_REQUEST: ") and f"[groups.{group}]" in proc.err
    assert "config file" in proc.err and "restart" in proc.err
    [row] = cli.json("group", "list", "--group", group)  # nothing was dropped
    assert (row["fifo"], row["max_attempts"], row["topic"]) == (True, 3, topic)
    server.stop()

    server = chronoq_process("")  # the operator removed the table and restarted
    cli = make_cli(server.endpoint)
    assert cli.json("group", "list", "--group", group)[0]["fifo"] is True  # kept in groups.json until deleted
    assert cli.json("group", "delete", group) == {"deleted": group, "topics": [topic]}
    server.stop()
    server = chronoq_process("")
    cli = make_cli(server.endpoint)
    cli("group", "list", "--group", group, expect=1)  # deleted stays deleted
