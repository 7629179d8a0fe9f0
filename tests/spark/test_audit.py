"""The delivery audit (``chronoq audit``): its figures equal what the test sent and consumed, on a
real broker; and it reports early and lost messages when the trace shows them."""

from __future__ import annotations

import asyncio
import json
import time

from click.testing import CliRunner

from tests.spark.conftest import queue_totals, wait_until, write_rows

GROUPS = '[groups."g-dlq"]\nmax_attempts = 1\n'


async def _receive(endpoint: str, group: str, topic: str, want: int, ack: int, timeout_s: float,
                   invisible_s: float = 30) -> int:
    """Receive ``want`` messages (each once), ack the first ``ack`` of them."""
    from chronoq.client.client import Client

    got = []
    async with Client(endpoint) as client:
        end = time.monotonic() + timeout_s
        while len(got) < want and time.monotonic() < end:
            got += await client.receive(group, topic, max_messages=32, invisible_s=invisible_s, wait_s=1)
        await client.ack(group, topic, got[:ack])
    return len(got)


async def _send_delayed_and_recall(endpoint: str, topic: str) -> None:
    from chronoq.client.client import Client

    ahead_ms = int(time.time() * 1000) + 3_600_000
    async with Client(endpoint) as client:
        keep = await client.send(topic, b"waiting", deliver_at_ms=ahead_ms)
        gone = await client.send(topic, b"recalled", deliver_at_ms=ahead_ms)
        await client.recall(topic, gone.recall_handle)
    assert keep.recall_handle


def _by_topic(rows: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for r in rows:
        t = out.setdefault(r["topic"], {})
        for key, value in r.items():
            if isinstance(value, int) and not key.startswith("lateness"):
                t[key] = t.get(key, 0) + value
        late = r.get("lateness_max_ms")
        if late is not None:
            t["lateness_max_ms"] = max(t.get("lateness_max_ms", late), late)
    return out


def test_audit_figures_match_what_was_sent_and_consumed(spark, broker, tmp_path):
    from pyspark.sql import functions as F

    from chronoq.cli.main import main
    from chronoq.spark import audit

    b = broker(GROUPS)
    ep = b.endpoint
    write_rows(spark.range(30).selectExpr("concat('now-', id) as body"), ep, "audit-now")
    # delay_ms counts from the moment the broker stages the rows: due ~2.5 s later, however slow the write
    write_rows(spark.range(20).select(F.concat(F.lit("later-"), "id").alias("body"),
                                      (F.lit(2500) + F.col("id") * 10).alias("delay_ms")), ep, "audit-later")
    asyncio.run(_send_delayed_and_recall(ep, "audit-later"))
    write_rows(spark.range(5).selectExpr("concat('dlq-', id) as body"), ep, "audit-dlq")

    assert asyncio.run(_receive(ep, "g1", "audit-now", 30, ack=25, timeout_s=30)) == 30
    assert asyncio.run(_receive(ep, "g2", "audit-later", 20, ack=20, timeout_s=60)) == 20
    assert asyncio.run(_receive(ep, "g-dlq", "audit-dlq", 5, ack=0, timeout_s=30, invisible_s=1)) == 5
    wait_until(lambda: queue_totals(ep, "%DLQ%g-dlq") == 5, 30, interval_s=0.2, what="5 dead-lettered messages")

    result = audit.run(spark, ep, grace_s=30)
    got = _by_topic(result.rows)
    assert set(got) == {"audit-now", "audit-later", "audit-dlq"}
    now, later, dlq = got["audit-now"], got["audit-later"], got["audit-dlq"]
    assert (now["sent"], now["delayed"], now["visible"], now["delivered"], now["acked"], now["dead_lettered"]) == \
        (30, 0, 30, 30, 25, 0)
    assert (later["sent"], later["delayed"], later["visible"], later["delivered"], later["acked"]) == \
        (22, 22, 20, 20, 20)
    assert (later["recalled"], later["waiting"], later["lost"]) == (1, 1, 0)
    assert (dlq["sent"], dlq["delivered"], dlq["acked"], dlq["dead_lettered"]) == (5, 5, 0, 5)
    assert result.totals["early"] == 0 and result.totals["lost"] == 0 and result.ok
    late_rows = [r for r in result.rows if r["topic"] == "audit-later" and r["lateness_max_ms"] is not None]
    assert late_rows and all(0 <= r["lateness_p50_ms"] <= r["lateness_p99_ms"] <= r["lateness_max_ms"] < 30_000
                             for r in late_rows)
    assert sum(h["count"] for h in result.histogram) == 20

    # The command line runs the same job (in this process it uses the test's SparkSession).
    report = tmp_path / "audit.html"
    res = CliRunner().invoke(main, ["audit", "--endpoint", ep, "--html", str(report), "--json", "--grace", "30"])
    assert res.exit_code == 0, res.output
    doc = json.loads(res.output)
    assert doc["ok"] and doc["totals"]["sent"] == 57 and doc["totals"]["acked"] == 45
    text = report.read_text()
    assert "chronoq delivery audit" in text and "data:image/png;base64," in text and "audit-later" in text
    res = CliRunner().invoke(main, ["audit", "--endpoint", ep, "--html", "", "--topic", "audit-dlq"])
    assert res.exit_code == 0 and "audit-dlq" in res.output and "audit-now" not in res.output


def test_audit_reports_early_and_lost_messages(spark):
    """The checks can fail: a trace with an early and a lost message is flagged."""
    from chronoq.broker import trace as tr
    from chronoq.spark import audit

    now = 1_800_000_000_000
    rows = [  # (kind, delayed, attempt, topic, id, group, ref_topic, ref_queue, ts, due, ref_offset, broker group)
        (tr.STORED, True, 0, "t", "early", None, None, 0, now - 60_000, now - 10_000, 0, ""),
        (tr.VISIBLE, False, 0, "t", "early", None, None, 0, now - 10_500, now - 10_000, 0, ""),
        (tr.STORED, True, 0, "t", "lost", None, None, 0, now - 60_000, now - 50_000, 0, ""),
        (tr.STORED, True, 0, "t", "fine", None, None, 0, now - 60_000, now - 40_000, 0, ""),
        (tr.VISIBLE, False, 0, "t", "fine", None, None, 0, now - 39_990, now - 40_000, 0, ""),
        (tr.DELIVERED, False, 1, "t", "fine", "g", "t", 0, now - 39_000, 0, 7, ""),
        (tr.ACKED, False, 0, None, None, "g", "t", 0, now - 38_000, 0, 7, ""),
    ]
    events = spark.createDataFrame(rows, audit.EVENTS_DDL)
    out = audit.report(audit.messages(events, now, grace_ms=30_000)).collect()
    assert len(out) == 1
    r = out[0]
    assert (r.sent, r.visible, r.delivered, r.acked, r.early, r.lost) == (3, 2, 1, 1, 1, 1)
    assert r.lateness_max_ms == 10 and r.lateness_p50_ms == -500
