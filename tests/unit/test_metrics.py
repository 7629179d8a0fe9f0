"""chronoq.server.metrics against an in-process broker on a fake clock: every counter equals the traffic."""

from __future__ import annotations

import pytest
from prometheus_client import generate_latest

import chronoq
from chronoq.broker.broker import OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.core import errors
from chronoq.core.config import load_config
from chronoq.server.metrics import BrokerMetrics
from chronoq.pop.service import PopService

from metricskit import INVISIBLE_MS, T0, TICKS_MAX, advance_pop, open_broker, scrape, served, value
from timerkit import crash


def test_counters_equal_the_traffic(tmp_path):
    clock, broker, pop, metrics = served(tmp_path)
    try:
        pop.set_group("g", max_attempts=2)
        broker.send_batch([OutgoingMessage("a", b"a%d" % i) for i in range(3)])
        broker.send_batch([OutgoingMessage("b", b"b0"), OutgoingMessage("b", b"b1")])
        broker.send("a", b"dup", message_id="0123456789ABCDEF0123456789AB")
        broker.send("a", b"dup", message_id="0123456789ABCDEF0123456789AB")  # a resend: not counted
        broker.send("a", b"later", deliver_at_ms=T0 + 5_000)
        broker.send("b", b"much later", deliver_at_ms=T0 + 7_200_000)

        samples = scrape(metrics)
        assert value(samples, "chronoq_messages_sent_total", topic="a") == 5
        assert value(samples, "chronoq_messages_sent_total", topic="b") == 3
        assert value(samples, "chronoq_timer_pending_messages", horizon="1m") == 1
        assert value(samples, "chronoq_timer_pending_messages", horizon="1h") == 1
        assert value(samples, "chronoq_timer_pending_messages", horizon="1d") == 2
        assert value(samples, "chronoq_timer_pending_messages", horizon="inf") == 2
        assert value(samples, "chronoq_topic_messages", topic="a") == 4  # the delayed one is not visible yet

        clock.advance(5_000)
        for _ in range(TICKS_MAX):
            if not broker.timer_tick():
                break
        got = pop.receive("g", "a", max_messages=32, invisible_ms=INVISIBLE_MS)
        assert len(got) == 5
        pop.ack("g", "a", got[0].receipt_handle)
        assert pop.ack_many("g", "a", [got[1].receipt_handle, got[2].receipt_handle, "bogus"])[:2] == [None, None]
        pop.change_invisible("g", "a", got[3].receipt_handle, INVISIBLE_MS)  # a nack
        pop.ack("g", "a", got[4].receipt_handle)

        samples = scrape(metrics)
        assert value(samples, "chronoq_consumer_lag_messages", topic="a", group="g") == 0  # all received
        assert ("chronoq_consumer_lag_messages", frozenset({("topic", "b"), ("group", "g")})) not in samples
        assert value(samples, "chronoq_messages_received_total", topic="a", group="g") == 5
        assert value(samples, "chronoq_messages_acked_total", topic="a", group="g") == 4
        assert value(samples, "chronoq_messages_nacked_total", topic="a", group="g") == 1
        assert value(samples, "chronoq_inflight_messages", topic="a", group="g") == 1
        assert value(samples, "chronoq_timer_pending_messages", horizon="inf") == 1
        assert value(samples, "chronoq_timer_delivered_total", lane="timer") == 1
        assert value(samples, "chronoq_timer_lateness_seconds_count") == 1
        assert value(samples, "chronoq_timer_lateness_seconds_bucket", le="0.0") == 1  # the fake clock: on time
        assert value(samples, "chronoq_timer_early_deliveries_total") == 0

        # The nacked message is never acked: revived into the retry topic, delivered again, then
        # (max_attempts 2) dead-lettered.
        advance_pop(pop, clock, INVISIBLE_MS + 1)
        advance_pop(pop, clock, 5_000)  # the retry back-off
        # The retry copy waits in %RETRY%g_a: it is the group's lag on "a" until received.
        assert value(scrape(metrics), "chronoq_consumer_lag_messages", topic="a", group="g") == 1
        again = pop.receive("g", "a", max_messages=32, invisible_ms=INVISIBLE_MS)
        assert value(scrape(metrics), "chronoq_consumer_lag_messages", topic="a", group="g") == 0
        assert [p.delivery_attempt for p in again] == [2]
        advance_pop(pop, clock, INVISIBLE_MS + 1)

        samples = scrape(metrics)
        assert value(samples, "chronoq_messages_received_total", topic="a", group="g") == 6
        assert value(samples, "chronoq_messages_revived_total", group="g") == 2
        assert value(samples, "chronoq_messages_retried_total", group="g") == 1
        assert value(samples, "chronoq_messages_dead_lettered_total", group="g") == 1
        assert value(samples, "chronoq_dlq_messages", group="g") == 1
        assert value(samples, "chronoq_inflight_messages", topic="a", group="g") == 0
        assert value(samples, "chronoq_topics") == 2 and value(samples, "chronoq_consumer_groups") == 1

        log = broker.store.log
        assert value(samples, "chronoq_commitlog_bytes") == log.written > 0
        assert value(samples, "chronoq_commitlog_segments") == len(log.segments)
        fsyncs = value(samples, "chronoq_commitlog_fsync_seconds_count")
        assert fsyncs == log.sync_times.count > 0
        # The fake clock does not move during an fsync: every one lands in the first bucket.
        assert value(samples, "chronoq_commitlog_fsync_seconds_bucket", le="0.0001") == fsyncs
        assert value(samples, "chronoq_commitlog_fsync_seconds_sum") == 0

        snap = metrics.snapshot()
        assert snap["topics"] == 2 and snap["groups"] == 1 and snap["dlq"] == 1 and snap["in_flight"] == 0
        assert snap["pending_timers"] == 1 and snap["lateness_count"] == 1 and snap["lateness_p99_ms"] == 0
        assert snap["messages_stored"] == 5 + 2  # a: 4 sent + 1 delivered copy; b: 2
    finally:
        pop.close()
        broker.close()


def test_flow_control_pauses_are_counted(tmp_path):
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock, timer_pending_max=2)
    metrics = BrokerMetrics(broker)
    try:
        broker.send_batch([OutgoingMessage("t", b"m%d" % i, deliver_at_ms=T0 + 1_000) for i in range(5)])
        clock.advance(1_000)
        ticks = 0
        while broker.timer_tick() and ticks < TICKS_MAX:
            ticks += 1
        samples = scrape(metrics)
        assert value(samples, "chronoq_timer_delivered_total", lane="timer") == 5
        # The lane holds 2: it fills up twice (2, then 2 more), the last message fits.
        assert value(samples, "chronoq_timer_flow_control_pauses_total", lane="timer") == 2
        assert value(samples, "chronoq_timer_pending_messages", horizon="inf") == 0
        assert "chronoq_messages_received_total" not in {name for name, _ in samples}  # no POP service
    finally:
        broker.close()


def test_recovery_figures(tmp_path):
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock)
    broker.send_batch([OutgoingMessage("t", b"x" * 100) for _ in range(10)])
    broker.close()
    broker = open_broker(tmp_path / "data", clock)
    samples = scrape(BrokerMetrics(broker))
    assert value(samples, "chronoq_recovery_clean") == 1
    assert value(samples, "chronoq_recovery_truncated_bytes") == 0
    assert value(samples, "chronoq_recovery_duration_seconds") == 0  # the fake clock stood still
    assert value(samples, "chronoq_messages_sent_total", topic="t") == 0  # counters start at 0 per process
    assert value(samples, "chronoq_topic_messages", topic="t") == 10

    # kill -9 with a torn record at the end of the log.
    broker.send_batch([OutgoingMessage("t", b"y" * 100) for _ in range(5)])
    end = broker.store.log.written
    path = broker.store.log.active.path
    crash(broker)
    with open(path, "r+b") as fh:
        fh.seek(end - broker.store.log.active.base)
        fh.write(b"\x00\x00\x01\x00torn")
    broker = open_broker(tmp_path / "data", clock)
    try:
        samples = scrape(BrokerMetrics(broker))
        assert value(samples, "chronoq_recovery_clean") == 0
        assert value(samples, "chronoq_recovery_records_replayed") == 5  # those after the start's checkpoint
        assert value(samples, "chronoq_recovery_truncated_bytes") == sum(
            r.end - r.start for r in broker.recovery.truncated) > 0
        assert value(samples, "chronoq_topic_messages", topic="t") == 15
    finally:
        broker.close()


def test_http_listener_settings():
    assert load_config(None, env={}).http_port == 8082
    assert load_config(None, env={}).http_host == "127.0.0.1"
    assert load_config(None, env={"CHRONOQ_HTTP_PORT": "off"}).http_port == -1
    assert load_config(None, env={"CHRONOQ_HTTP_PORT": "0"}).http_port == 0
    assert load_config(None, env={}, overrides={"http_port": "OFF"}).http_port == -1
    assert load_config(None, env={}, overrides={"http_port": "-5"}).http_port == -5  # negative: no listener
    with pytest.raises(errors.ClientError, match="http_port 70000 is out of range"):
        load_config(None, env={"CHRONOQ_HTTP_PORT": "70000"})
    with pytest.raises(errors.ClientError, match="expected an integer"):
        load_config(None, env={"CHRONOQ_HTTP_PORT": "on"})


def test_a_delay_level_send_counts_under_its_own_topic(tmp_path):
    """A send with a delay level is stored in the system topic CHRONOQ_DELAY; the producer sent it
    to its own topic, and that is where ``chronoq_messages_sent_total`` counts it (single sends,
    batches mixing levels, times and plain messages, and topics the batch mixes)."""
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock)
    metrics = BrokerMetrics(broker)
    try:
        broker.send("orders", b"in 5 s", delay_level=2)
        broker.send_batch([OutgoingMessage("orders", b"lvl", delay_level=1),
                           OutgoingMessage("orders", b"timed", deliver_at_ms=T0 + 60_000),
                           OutgoingMessage("orders", b"now")])
        broker.send_batch([OutgoingMessage("bills", b"lvl", delay_level=3) for _ in range(2)])
        broker.send_batch([OutgoingMessage("bills", b"lvl", delay_level=1), OutgoingMessage("orders", b"now")])
        samples = scrape(metrics)
        assert value(samples, "chronoq_messages_sent_total", topic="orders") == 5
        assert value(samples, "chronoq_messages_sent_total", topic="bills") == 3
        assert not [labels for name, labels in samples
                    if name == "chronoq_messages_sent_total" and ("topic", "CHRONOQ_DELAY") in labels]
    finally:
        broker.close()


def test_service_figures_of_an_embedded_broker(tmp_path):
    """Build, process, disk, recall/reschedule outcomes and pending transaction halves: names, labels, values."""
    from types import SimpleNamespace

    from chronoq import __version__
    from chronoq.features.transactions import Transactions

    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock, disk_reserve_bytes=1)
    txns = Transactions(broker)
    metrics = BrokerMetrics(broker, source=SimpleNamespace(front_ends=[], txns=txns))
    try:
        samples = scrape(metrics)
        assert value(samples, "chronoq_build_info", version=__version__, build=chronoq.build()) == 1
        assert value(samples, "process_resident_memory_bytes") > 0  # the process collector
        assert value(samples, "process_cpu_seconds_total") > 0
        assert value(samples, "chronoq_disk_free_bytes") > 0
        assert value(samples, "chronoq_disk_reserve_bytes") == 1
        assert value(samples, "chronoq_disk_reserve_low") == 0
        assert value(samples, "chronoq_transaction_halves_pending") == 0

        first = broker.send("orders", b"x", deliver_at_ms=T0 + 60_000).recall_handle
        second = broker.send("orders", b"y", delay_level=3).recall_handle
        assert broker.reschedule(first, T0 + 120_000).outcome.value == "rescheduled"
        assert broker.recall(second).outcome.value == "cancelled"
        assert broker.recall(second).outcome.value == "cancelled"  # again: the same answer, counted again
        assert broker.recall(first).outcome.value == "not_found"  # the handle the reschedule replaced
        half = txns.half_message(OutgoingMessage("orders", b"pay"))
        txns.accepted(broker.send_batch([half], system=True), [half])
        samples = scrape(metrics)
        assert value(samples, "chronoq_timer_recalls_total", outcome="cancelled") == 2
        assert value(samples, "chronoq_timer_recalls_total", outcome="not_found") == 1
        assert value(samples, "chronoq_timer_reschedules_total", outcome="rescheduled") == 1
        assert value(samples, "chronoq_transaction_halves_pending") == 1
        assert value(samples, "chronoq_messages_sent_total", topic="orders") == 2  # the half is not a send yet
    finally:
        broker.close()


def test_the_disk_reserve_state_is_shown(tmp_path):
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock, disk_reserve_bytes=1 << 62)  # more than any disk
    try:
        with pytest.raises(errors.DiskFull):
            broker.send("orders", b"x")
        samples = scrape(BrokerMetrics(broker))
        assert value(samples, "chronoq_disk_reserve_low") == 1
        assert value(samples, "chronoq_disk_free_bytes") < 1 << 62
    finally:
        broker.close()


def _many(tmp_path, topics: int, groups: int):
    """A broker with ``topics`` topics (a message each) and ``groups`` groups, group g holding a
    message of topics g, g+groups, ... in flight: thousands of series."""
    clock = FakeClock(T0)
    broker = open_broker(tmp_path / "data", clock)
    pop = PopService(broker, clock)
    broker.send_batch([OutgoingMessage(f"t{i}", b"x") for i in range(topics)])
    for i in range(topics):
        pop.receive(f"g{i % groups}", f"t{i}", max_messages=1, invisible_ms=INVISIBLE_MS)
    return broker, pop, BrokerMetrics(broker, lambda: pop)


def test_render_in_slices_is_the_text_of_one_scrape(tmp_path):
    """``BrokerMetrics.render`` (the server's /metrics) gives generate_latest's text byte for
    byte (but the process_* figures and the disk's free space, which move), and lets the loop go between slices: with a slice of 0 s, at every chunk of samples
    and every pause point of the collector (1,200 topics: 1,200+ series in several families)."""
    import asyncio

    import chronoq.server.metrics as metrics_mod

    broker, pop, metrics = _many(tmp_path, 1200, 40)
    try:
        async def main():
            others = 0

            async def other():
                nonlocal others
                while True:
                    others += 1
                    await asyncio.sleep(0)

            task = asyncio.ensure_future(other())
            await asyncio.sleep(0)
            started = others
            text = await metrics.render(slice_s=0.0, pause_s=0.0)
            ran = others - started
            task.cancel()
            return text, ran

        text, ran = asyncio.run(main())

        def steady(blob: bytes) -> list[bytes]:  # (the process_* figures and the disk's free space
            return [line for line in blob.split(b"\n")   # move between two scrapes: other writers)
                    if b"process_" not in line and not line.startswith(b"chronoq_disk_free_bytes")]

        assert steady(text) == steady(generate_latest(metrics.registry))
        # Each family of 1,200 series: 1200 / RENDER_CHUNK chunks and 1200 / PAUSE_SERIES pauses.
        assert ran >= 4 * (1200 // metrics_mod.RENDER_CHUNK)
        assert value(scrape(metrics), "chronoq_inflight_messages", topic="t7", group="g7") == 1
    finally:
        pop.close()
        broker.close()
