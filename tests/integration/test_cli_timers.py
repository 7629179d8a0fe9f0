"""``chronoq timers`` and ``chronoq message recall|reschedule`` as real subprocesses against
``chronoq serve`` (the shared server), plus the delay-level property through ``chronoq.client.client``.

No timing assertions: only outcomes, exit statuses, and never-early checks on broker-stamped
times (a delivered copy's store time is at or after its due time). Waits are bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import uuid

import pytest

from chronoq.client.client import Client, ClientError, OutgoingMessage

from .conftest import ROOT, wait_until

CLI_TIMEOUT_S = 30
def test_timers_overview_says_one_delivery_and_fits_80_columns(chronoq_process):
    """A fresh broker with exactly one timer delivery: singular words, no line over 80 columns."""
    ep = chronoq_process().endpoint

    def run(*args: str) -> str:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   CHRONOQ_ENDPOINT=ep, COLUMNS="80")
        proc = subprocess.run([sys.executable, "-m", "chronoq", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                              capture_output=True, timeout=CLI_TIMEOUT_S)
        assert proc.returncode == 0, proc.stderr.decode()
        return proc.stdout.decode()

    run("send", unique("cli-plural"), "x", "--delay", "1s")
    wait_until(lambda: json.loads(run("timers", "--json"))["lateness"]["count"] == 1, 20, what="one timer delivery")
    out = run("timers", "--minutes", "1")
    assert "of 1 delivery:" in out and "1 deliveries" not in out
    assert "next 1 minute " in out and "within the next 1 minute," in out
    too_long = [line for line in out.splitlines() if len(line) > 80]
    assert not too_long, too_long


EXIT_NOT_DONE = 4


@pytest.fixture(scope="module")
def cli(chronoq_endpoint):
    def run(*args: str, expect: int | None = 0) -> subprocess.CompletedProcess:
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   CHRONOQ_ENDPOINT=chronoq_endpoint)
        proc = subprocess.run([sys.executable, "-m", "chronoq", *args], cwd=ROOT, env=env,
                              stdin=subprocess.DEVNULL, capture_output=True, timeout=CLI_TIMEOUT_S)
        proc.out, proc.err = proc.stdout.decode(), proc.stderr.decode()
        if expect is not None:
            assert proc.returncode == expect, f"exit {proc.returncode} for {args}:\n{proc.out}\n{proc.err}"
        return proc

    def run_json(*args: str, expect: int | None = 0):
        return json.loads(run(*args, "--json", expect=expect).out)

    run.json = run_json
    return run


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def send_delayed(cli, topic: str, delay_s: float, body: str = "hello") -> tuple[str, str]:
    """(message id, recall handle) of one delayed message sent with ``chronoq send --delay``."""
    out = cli.json("send", topic, body, "--delay", str(delay_s))
    m = out["messages"][0]
    assert m["recall_handle"]
    return m["message_id"], m["recall_handle"]


def receive(cli, group: str, topic: str, wait_s: float) -> list[dict]:
    return cli.json("receive", group, topic, "--wait", str(wait_s))


def test_timers_shows_what_fires_per_minute_levels_and_lateness(cli):
    topic = unique("cli-timers")
    cli("send", topic, "x", "--delay", "300", "--count", "3")
    st = cli.json("timers", "--minutes", "15")
    assert st["bucket_ms"] > 0 and st["now_ms"] > 0
    assert sum(m["pending"] for m in st["due_by_minute"]) >= 3
    assert sum(b["pending"] for b in st["due_by_bucket"]) == sum(m["pending"] for m in st["due_by_minute"])
    assert [lv["level"] for lv in st["levels"]] == list(range(1, 19))
    assert all(lv["delay_ms"] > 0 and lv["backlog"] >= 0 for lv in st["levels"])
    lateness = st["lateness"]
    assert lateness["early"] == 0 and lateness["buckets"][-1]["le_ms"] is None
    assert sum(b["count"] for b in lateness["buckets"]) == lateness["count"]
    table = cli("timers").out
    assert "LANE" in table and "level 18" in table and "due per minute" in table
    assert "lateness" in table
    refused = cli("timers", "--minutes", "0", expect=2)  # bad usage, caught by the CLI
    assert "minutes" in refused.err


def test_recall_outcomes_cancelled_already_delivered_not_found_and_malformed(cli):
    topic, group = unique("cli-recall"), unique("cli-recall-g")
    mid, handle = send_delayed(cli, topic, 600)
    r = cli.json("message", "recall", handle)
    assert (r["outcome"], r["topic"], r["message_id"]) == ("cancelled", topic, mid)
    assert cli.json("message", "recall", handle)["outcome"] == "cancelled"  # again: still cancelled, exit 0
    table = cli("message", "recall", handle).out
    assert "cancelled" in table and mid in table
    # Due in 1 s: once it has been received it can only be already delivered.
    mid2, handle2 = send_delayed(cli, topic, 1, "soon")
    got = []
    for _ in range(10):  # bounded: ~10 long polls of 2 s
        got += receive(cli, group, topic, 2)
        if got:
            break
    assert [m["message_id"] for m in got] == [mid2]
    assert got[0]["store_ms"] >= got[0]["deliver_at_ms"]  # never early (broker-stamped times)
    done = cli.json("message", "recall", handle2, expect=EXIT_NOT_DONE)
    assert done["outcome"] == "already_delivered"
    # A handle that was rescheduled answers not_found (use the new handle).
    _mid3, handle3 = send_delayed(cli, topic, 600)
    moved = cli.json("message", "reschedule", handle3, "--in", "900")
    assert moved["outcome"] == "rescheduled" and moved["recall_handle"]
    gone = cli.json("message", "recall", handle3, expect=EXIT_NOT_DONE)
    assert gone["outcome"] == "not_found" and "rescheduled" in gone["detail"]
    assert cli.json("message", "recall", moved["recall_handle"])["outcome"] == "cancelled"
    bad = cli("message", "recall", "not-a-handle", expect=1)
    assert "BAD_REQUEST" in bad.err
    assert receive(cli, group, topic, 0.5) == []  # none of the cancelled ones ever arrives


def test_reschedule_moves_a_message_later_then_earlier(cli):
    topic, group = unique("cli-resched"), unique("cli-resched-g")
    sent_at = time.time()
    mid, handle = send_delayed(cli, topic, 6, "moved")
    later = cli.json("message", "reschedule", handle, "--in", "600")
    assert later["outcome"] == "rescheduled", later
    assert later["deliver_at_ms"] >= int(sent_at * 1000) + 600_000 - 60_000
    # Its first due time passes: nothing arrives (bounded wait until 2 s after it).
    wait_s = max(0.5, sent_at + 8 - time.time())
    assert receive(cli, group, topic, wait_s) == []
    # Earlier again, by an exact time (epoch ms), then by an ISO time for the last move.
    due_ms = int(time.time() * 1000) + 1_500
    iso = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(due_ms / 1000)) + f".{due_ms % 1000:03d}Z"
    far = cli.json("message", "reschedule", later["recall_handle"], "--at", str(due_ms + 3_600_000))
    earlier = cli.json("message", "reschedule", far["recall_handle"], "--at", iso)
    assert earlier["outcome"] == "rescheduled" and earlier["deliver_at_ms"] == due_ms
    got = []
    for _ in range(10):  # bounded
        got += receive(cli, group, topic, 2)
        if got:
            break
    assert [(m["message_id"], m["body"]) for m in got] == [(mid, "moved")]
    assert got[0]["deliver_at_ms"] == due_ms and got[0]["store_ms"] >= due_ms
    # Every old handle is dead; the last one is already delivered.
    for old in (handle, later["recall_handle"], far["recall_handle"]):
        assert cli.json("message", "recall", old, expect=EXIT_NOT_DONE)["outcome"] == "not_found"
    assert cli.json("message", "reschedule", earlier["recall_handle"], "--in", "60",
                    expect=EXIT_NOT_DONE)["outcome"] == "already_delivered"
    usage = cli("message", "reschedule", handle, expect=2)  # neither --at nor --in
    assert "--at" in usage.err
    cli("message", "reschedule", handle, "--at", "tomorrow", expect=2)


def test_delay_levels_through_the_grpc_property(chronoq_endpoint):
    topic, group = unique("level-prop"), unique("level-prop-g")

    async def go():
        async with Client(chronoq_endpoint) as c:
            r = (await c.send_batch([OutgoingMessage(topic, b"lvl", delay_level=1, properties={"k": "v"})]))[0]
            assert r.recall_handle
            got = []
            for _ in range(10):  # bounded long polls
                got += await c.receive(group, topic, wait_s=2)
                if got:
                    break
            assert [m.body for m in got] == [b"lvl"]
            m = got[0]
            assert m.deliver_at_ms >= m.born_ms + 1_000 and m.store_ms >= m.deliver_at_ms  # level 1 = 1 s
            assert m.properties == {"k": "v"}  # the level property is not delivered
            await c.ack(group, topic, got)
            with pytest.raises(ClientError) as info:
                await c.send_batch([OutgoingMessage(topic, b"bad", delay_level=99)])
            assert "ILLEGAL_DELIVERY_TIME" in str(info.value) and "levels are 1..18" in str(info.value)

    asyncio.run(asyncio.wait_for(go(), 60))


def test_timers_list_pages_filters_and_exit_statuses(cli):
    topic, other = unique("cli-pending"), unique("cli-pending-o")
    sent = [send_delayed(cli, topic, 600 + 60 * i, f"m{i}") for i in range(5)]
    keyed = cli.json("send", topic, "keyed", "--delay", "900", "--key", "order-7")["messages"][0]
    send_delayed(cli, other, 650)
    want = [mid for mid, _h in sent[:5]]
    want.insert(5, keyed["message_id"])  # due after 900 s, between m4 (840 s) and nothing
    first = cli.json("timers", "list", topic, "--limit", "4")
    assert [m["message_id"] for m in first["messages"]] == want[:4] and first["next_cursor"]
    assert all(m["topic"] == topic for m in first["messages"])
    dues = [m["due_ms"] for m in first["messages"]]
    assert dues == sorted(dues)
    rest = cli.json("timers", "list", topic, "--limit", "4", "--cursor", first["next_cursor"])
    assert [m["message_id"] for m in rest["messages"]] == want[4:] and rest["next_cursor"] is None
    by_key = cli.json("timers", "list", "--key", "order-7")
    assert [(m["message_id"], m["keys"]) for m in by_key["messages"]] == [(keyed["message_id"], ["order-7"])]
    window = cli.json("timers", "list", topic, "--from", str(dues[1]), "--to", str(dues[3]))
    assert [m["message_id"] for m in window["messages"]] == want[1:3]
    # The table: readable ids, and the cursor line when more may follow.
    table = cli("timers", "list", topic, "--limit", "2").out
    assert want[0] in table and want[1] in table and want[2] not in table and "more: --cursor " in table
    # The handle a listed message carries recalls it; then it is no longer listed.
    handle = first["messages"][0]["recall_handle"]
    assert cli.json("message", "recall", handle)["outcome"] == "cancelled"
    assert want[0] not in [m["message_id"] for m in cli.json("timers", "list", topic)["messages"]]
    # Empty is a normal answer; a bad cursor is refused by the broker (1); bad usage is 2.
    empty = cli("timers", "list", unique("cli-pending-none"))
    assert "no pending messages match" in empty.out
    assert cli.json("timers", "list", unique("cli-pending-none"))["messages"] == []
    assert "cursor" in cli("timers", "list", "--cursor", "bogus", expect=1).err
    assert "limit" in cli("timers", "list", "--limit", "0", expect=2).err.lower()
    assert "--from" in cli("timers", "list", "--from", "yesterday", expect=2).err
