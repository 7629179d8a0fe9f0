"""``/metrics`` of a real ``chronoq serve``: the counters equal the traffic the official client sent.

A broker of its own (counters start at zero), traffic from the unmodified official Python client:
sends on two topics (one of them delayed), a SimpleConsumer receive + ack, a change of invisible
time (a nack), and one message never acked with a short invisible time, so it is revived into the
retry topic, delivered again, and dead-lettered (its group has max_attempts = 2). The endpoint is
scraped over HTTP and parsed with prometheus_client's own parser.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ROOT, ChronoqProcess, groups_toml, wait_until
from .test_official_python_client import make_message, producer, receive_all, simple_consumer

GROUP_A, GROUP_B = "metrics-a", "metrics-b"
SHORT_INVISIBLE_S = 2
CLI_TIMEOUT_S = 60


def scrape(url: str) -> dict:
    with urllib.request.urlopen(url + "metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(samples: dict, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_metrics_count_the_traffic(chronoq_process):
    server = chronoq_process(groups_toml({GROUP_A: {"max_attempts": 2}}))
    assert server.http_url, server.output()
    with urllib.request.urlopen(server.http_url + "healthz", timeout=10) as reply:
        assert reply.read() == b"ok\n"
    endpoint = server.endpoint
    topic_a, topic_b = "metrics-orders", "metrics-reminders"

    with producer(endpoint, topic_a, topic_b) as p:
        for i in range(3):
            p.send(make_message(topic_a, b"a%d" % i))
        p.send(make_message(topic_b, b"b0"))
        p.send(make_message(topic_b, b"b1"))
        delayed = make_message(topic_b, b"later")
        delayed.delivery_timestamp = int(time.time()) + 2  # epoch seconds
        p.send(delayed)

    samples = scrape(server.http_url)
    assert value(samples, "chronoq_messages_sent_total", topic=topic_a) == 3
    assert value(samples, "chronoq_messages_sent_total", topic=topic_b) == 3
    assert value(samples, "chronoq_timer_pending_messages", horizon="1m") == 1
    assert value(samples, "chronoq_timer_pending_messages", horizon="inf") == 1

    # Group A: ack two, leave one unacked with a short invisible time.
    with simple_consumer(endpoint, GROUP_A, topic_a) as c:
        got = receive_all(c, 3, invisible_s=30)
        assert len(got) == 3
        c.ack(got[0])
        c.ack(got[1])
        c.change_invisible_duration(got[2], SHORT_INVISIBLE_S)  # a nack; never acked after this
        again = receive_all(c, 1, invisible_s=SHORT_INVISIBLE_S, timeout_s=20)
        assert [(m.body, m.delivery_attempt) for m in again] == [(got[2].body, 2)]
    wait_until(lambda: value(scrape(server.http_url), "chronoq_messages_dead_lettered_total", group=GROUP_A) == 1,
               20, 0.2, "the unacked message to be dead-lettered")

    # Group B: the two immediate messages and the delayed one once due, all acked.
    with simple_consumer(endpoint, GROUP_B, topic_b) as c:
        got = receive_all(c, 3, invisible_s=30, timeout_s=20)
        assert sorted(m.body for m in got) == [b"b0", b"b1", b"later"]
        for m in got:
            c.ack(m)

    samples = scrape(server.http_url)
    expected = {
        ("chronoq_messages_received_total", topic_a, GROUP_A): 4,  # 3 + the retried one
        ("chronoq_messages_acked_total", topic_a, GROUP_A): 2,
        ("chronoq_messages_nacked_total", topic_a, GROUP_A): 1,
        ("chronoq_inflight_messages", topic_a, GROUP_A): 0,
        ("chronoq_messages_received_total", topic_b, GROUP_B): 3,
        ("chronoq_messages_acked_total", topic_b, GROUP_B): 3,
        ("chronoq_messages_nacked_total", topic_b, GROUP_B): 0,
        ("chronoq_inflight_messages", topic_b, GROUP_B): 0,
        ("chronoq_consumer_lag_messages", topic_a, GROUP_A): 0,  # all received (the retry copy too)
        ("chronoq_consumer_lag_messages", topic_b, GROUP_B): 0,
    }
    got_values = {key: value(samples, key[0], topic=key[1], group=key[2]) for key in expected}
    assert got_values == expected
    # Revived twice (attempt 1 -> retry topic, attempt 2 -> DLQ).
    assert value(samples, "chronoq_messages_revived_total", group=GROUP_A) == 2
    assert value(samples, "chronoq_messages_retried_total", group=GROUP_A) == 1
    assert value(samples, "chronoq_messages_dead_lettered_total", group=GROUP_A) == 1
    assert value(samples, "chronoq_dlq_messages", group=GROUP_A) == 1
    assert value(samples, "chronoq_messages_dead_lettered_total", group=GROUP_B) == 0
    # The delayed message: delivered once, on time or late, never early; nothing pending.
    assert value(samples, "chronoq_timer_delivered_total", lane="timer") == 1
    assert value(samples, "chronoq_timer_lateness_seconds_count") == 1
    assert value(samples, "chronoq_timer_lateness_seconds_bucket", le="+Inf") == 1
    assert value(samples, "chronoq_timer_early_deliveries_total") == 0
    assert value(samples, "chronoq_timer_pending_messages", horizon="inf") == 0
    # Sends are counted once (the retry and DLQ copies and the delivered copy are not sends).
    assert value(samples, "chronoq_messages_sent_total", topic=topic_a) == 3
    assert value(samples, "chronoq_messages_sent_total", topic=topic_b) == 3
    assert value(samples, "chronoq_topic_messages", topic=topic_b) == 3
    # Storage and start-up figures are there and plausible.
    assert value(samples, "chronoq_commitlog_bytes") > 0 and value(samples, "chronoq_commitlog_segments") >= 1
    assert value(samples, "chronoq_commitlog_fsync_seconds_count") >= 1
    assert value(samples, "chronoq_recovery_clean") == 1
    assert value(samples, "chronoq_topics") == 2
    # The event-loop probe ran all along (every 0.1 s, seconds of traffic above): lags observed,
    # each within the histogram, the largest no more than their sum.
    lags = value(samples, "chronoq_event_loop_lag_seconds_count")
    assert lags >= 5 and value(samples, "chronoq_event_loop_lag_seconds_bucket", le="+Inf") == lags
    assert 0 <= value(samples, "chronoq_event_loop_lag_max_seconds") <= value(samples, "chronoq_event_loop_lag_seconds_sum")


def _cli(endpoint: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), CHRONOQ_ENDPOINT=endpoint)
    proc = subprocess.run([sys.executable, "-m", "chronoq", *args], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=CLI_TIMEOUT_S)
    assert proc.returncode == 0, f"exit {proc.returncode} for {args}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_chronoq_stats_matches_the_traffic_and_the_metrics(chronoq_process):
    server = chronoq_process()
    topic, group = "stats-orders", "stats-group"
    _cli(server.endpoint, "send", topic, "now", "--count", "4")
    _cli(server.endpoint, "send", topic, "in two hours", "--delay", "7200")
    _cli(server.endpoint, "receive", group, topic, "--count", "3", "--max", "3")  # acked
    _cli(server.endpoint, "receive", group, topic, "--max", "1", "--no-ack", "--invisible", "300")

    st = json.loads(_cli(server.endpoint, "stats", "--json").stdout)
    assert st == {
        "topics": 1, "groups": 1, "messages_stored": 4, "in_flight": 1, "dlq": 0, "pending_timers": 1,
        "pending_by_horizon": {"1m": 0, "10m": 0, "1h": 0, "1d": 1, "inf": 1},
        "commitlog_bytes": st["commitlog_bytes"], "commitlog_segments": 1,
        "lateness_count": 0, "lateness_p50_ms": None, "lateness_p99_ms": None,
        "messages_sent": 5, "messages_received": 4, "messages_acked": 3, "messages_dead_lettered": 0,
    }
    samples = scrape(server.http_url)  # the same figures as /metrics
    # The log only grows meanwhile (the broker's own trace records are written every second).
    assert 0 < st["commitlog_bytes"] <= value(samples, "chronoq_commitlog_bytes")
    assert value(samples, "chronoq_inflight_messages", topic=topic, group=group) == 1

    table = _cli(server.endpoint, "stats").stdout
    assert "broker overview" in table
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip() for line in table.splitlines()
            if line.startswith("│")}
    assert rows["messages stored"] == "4" and rows["in flight"] == "1"
    assert rows["pending timers"] == "1 (due within 1m: 0, 10m: 0, 1h: 0, 1d: 1)"
    assert rows["since start"] == "5 sent, 4 received, 3 acked, 0 dead-lettered"


def test_http_listener_off_and_port_taken(chronoq_process, tmp_path):
    server = chronoq_process(name="off", extra_args=("--http-port", "off"))
    assert server.http_url is None and "HTTP on" not in "\n".join(server.lines)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(RuntimeError) as info:  # the broker refuses to start, as for the gRPC port
            ChronoqProcess(str(tmp_path / "taken"), extra_args=("--http-port", str(port)))
    assert f"cannot listen for HTTP on 127.0.0.1:{port}" in str(info.value)
