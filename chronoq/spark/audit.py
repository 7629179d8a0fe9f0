"""The delivery audit: a PySpark job over the broker's message life trace (``chronoq audit``).

Input: the system topic ``CHRONOQ_TRACE`` (``chronoq.broker.trace``), read through the ``chronoq``
data source; each trace message holds up to 8192 events, decoded in bulk with NumPy inside
``mapInArrow``. The job first asks the broker to write out its trace buffer (``FlushTrace``).

A cluster (docs/cluster.md) is audited whole: every broker group records the life of the
messages it stores in its own ``CHRONOQ_TRACE``, so the job flushes and reads each group's at its
primary (the groups as the node given reads them from etcd) and tags every event with its group.
An ack names the record it acked by (topic, queue, offset), which each group numbers from 0: the
ack is joined to its delivery within its group.

Per message (topic, message id):

* **sent**: the broker stored it; **due**: its delivery time (the latest reschedule wins); an
  immediate message is due, and visible, when stored;
* **visible**: the timer made a delayed message visible; **lateness** = visible - due (delayed
  messages only);
* **delivered**: handed to a consumer group at least once (POP receive); **acked**: acked by a
  group; **dead-lettered**: moved to a group's DLQ; **recalled**: cancelled by its producer;
* **early**: visible, or first delivered, before it was due. Must be 0;
* **lost**: a delayed message, not recalled, due more than ``grace`` ago and never made visible;
* **waiting**: a delayed message not yet due (or due within ``grace``) and not yet visible.

Rows are per topic and per hour of the due time (UTC).
"""

from __future__ import annotations

import base64
import html
import io
import time
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from chronoq.broker import trace as tr
from chronoq.spark import cluster
from chronoq.spark import rpc

EVENT_DTYPE = np.dtype([("kind", "u1"), ("flags", "u1"), ("attempt", "<u2"), ("topic", "<u4"), ("mid", "<u4"),
                        ("group", "<u4"), ("rtopic", "<u4"), ("rqueue", "<u4"), ("ts", "<i8"), ("due", "<i8"),
                        ("roff", "<i8")])
assert EVENT_DTYPE.itemsize == tr.EVENT_SIZE
EVENTS_DDL = ("kind int, delayed boolean, attempt int, topic string, message_id string, grp string, "
              "ref_topic string, ref_queue int, ts_ms bigint, due_ms bigint, ref_offset bigint, broker_group string")
COUNTS = ("sent", "delayed", "visible", "delivered", "acked", "dead_lettered", "recalled", "early", "lost", "waiting")
LATENESS = ("lateness_p50_ms", "lateness_p99_ms", "lateness_max_ms")


def decode_body(body: bytes, broker_group: str = "") -> pa.RecordBatch:
    """The events of one trace record as a record batch with ``EVENTS_DDL``'s columns
    (``broker_group``: the group whose trace it is; "" for one node)."""
    table, raw, n = tr.decode(body)
    ev = np.frombuffer(raw, EVENT_DTYPE, count=n)
    strings = pa.array([s for s in table] + [None], pa.string())
    missing = len(table)

    def text(column: str) -> pa.Array:
        idx = ev[column].astype(np.int64)
        idx[idx == tr.NONE] = missing
        return strings.take(pa.array(idx))

    return pa.RecordBatch.from_arrays([
        pa.array(ev["kind"].astype(np.int32)),
        pa.array((ev["flags"] & tr.FLAG_DELAYED).astype(bool)),
        pa.array(ev["attempt"].astype(np.int32)),
        text("topic"), text("mid"), text("group"), text("rtopic"),
        pa.array(ev["rqueue"].astype(np.int32)),
        pa.array(ev["ts"]), pa.array(ev["due"]), pa.array(ev["roff"]),
        pa.array([broker_group] * n, pa.string()),
    ], names=["kind", "delayed", "attempt", "topic", "message_id", "grp", "ref_topic", "ref_queue", "ts_ms",
              "due_ms", "ref_offset", "broker_group"])


def _decode_batches(batches):
    for batch in batches:
        for body, group in zip(batch.column(0).to_pylist(), batch.column(1).to_pylist()):
            if body:
                yield decode_body(body, group or "")


# Connection keywords of ``run``/``trace_events`` -> the data source's option names.
CONNECTION_OPTIONS = {"access_key": "accessKey", "secret_key": "secretKey", "tls": "tls", "tls_ca_file": "tlsCaFile"}


def audited_groups(endpoints: str, **connection) -> list[tuple[str, str]]:
    """(broker group, endpoint) of every group the audit reads: each group of the cluster at its
    primary, or ``("", endpoints)`` for a node without etcd."""
    with rpc.AdminRpc(endpoints, **connection) as client:
        topology = cluster.read_topology(client)
    return topology.members() if topology.group else [("", endpoints)]


def trace_events(spark, endpoints: str, **connection):
    """A DataFrame of every recorded event (``EVENTS_DDL``) of every group, after flushing each
    group's trace buffer; the events the brokers dropped; the groups read ("" : one node). ``connection``: ``access_key``,
    ``secret_key``, ``tls``, ``tls_ca_file`` (as ``rpc.AdminRpc``)."""
    from pyspark.sql import functions as F

    frames, dropped = [], 0
    groups = audited_groups(endpoints, **connection)
    for group, endpoint in groups:
        with rpc.AdminRpc(endpoint, **connection) as client:
            flushed = client.flush_trace()
        if not flushed.enabled:
            raise RuntimeError(f"the broker{f' of group {group}' if group else ''} records no message trace "
                               "(trace_enabled = false): nothing to audit")
        dropped += flushed.dropped
        reader = (spark.read.format("chronoq").option("endpoints", endpoint).option("topic", tr.TRACE_TOPIC)
                  .option("failOnDataLoss", "false"))
        for key, value in connection.items():
            if value:
                reader = reader.option(CONNECTION_OPTIONS[key], str(value).lower() if isinstance(value, bool) else value)
        frames.append(reader.load().select("body", F.lit(group).alias("broker_group")))
    raw = frames[0]
    for frame in frames[1:]:
        raw = raw.unionByName(frame)
    return raw.mapInArrow(_decode_batches, EVENTS_DDL), dropped, [g for g, _e in groups]


def messages(events, now_ms: int, grace_ms: int):
    """One row per (topic, message id) with its life: due, visible, delivered, acked, ..."""
    from pyspark.sql import functions as F

    k = F.col("kind")
    ev = events.where(F.col("topic").isNotNull() | (k == tr.ACKED))
    # An ack names the record it acked (ref); the deliveries of that record name the message.
    delivered = ev.where(k == tr.DELIVERED)
    # (Within its broker group: each group numbers its queues' records from 0.)
    ref = ["broker_group", "ref_topic", "ref_queue", "ref_offset"]
    refs = delivered.select(*ref, "topic", "message_id").distinct()
    acks = (ev.where(k == tr.ACKED).select(*ref).distinct()
            .join(refs, ref).select("topic", "message_id").distinct()
            .withColumn("acked", F.lit(True)))
    per = (ev.where(k != tr.ACKED).groupBy("topic", "message_id").agg(
        F.min(F.when(k == tr.STORED, F.col("ts_ms"))).alias("stored_ms"),
        F.max(F.when(k == tr.STORED, F.col("due_ms"))).alias("stored_due_ms"),
        F.max(F.when(k == tr.STORED, F.col("delayed"))).alias("stored_delayed"),
        F.max_by(F.when(k == tr.RESCHEDULED, F.col("due_ms")),
                 F.when(k == tr.RESCHEDULED, F.col("ts_ms"))).alias("rescheduled_due_ms"),
        F.min(F.when(k == tr.VISIBLE, F.col("ts_ms"))).alias("visible_ms"),
        F.max(F.when(k == tr.VISIBLE, F.col("due_ms"))).alias("visible_due_ms"),
        F.min(F.when(k == tr.DELIVERED, F.col("ts_ms"))).alias("first_delivery_ms"),
        F.max(F.when(k == tr.DELIVERED, F.col("attempt"))).alias("attempts"),
        F.max(k == tr.DEAD_LETTERED).alias("dead_lettered"),
        F.max(k == tr.RECALLED).alias("recalled")))
    m = per.join(acks, ["topic", "message_id"], "left")
    delayed = (F.coalesce(F.col("stored_delayed"), F.lit(False)) | F.col("visible_ms").isNotNull()
               | F.col("rescheduled_due_ms").isNotNull())
    due = F.coalesce(F.col("rescheduled_due_ms"), F.col("visible_due_ms"),
                     F.when(delayed, F.col("stored_due_ms")).otherwise(F.col("stored_ms")),
                     F.col("first_delivery_ms"))
    m = (m.withColumn("delayed", delayed).withColumn("due_ms", due)
         .withColumn("acked", F.coalesce(F.col("acked"), F.lit(False)))
         .withColumn("seen_ms", F.when(F.col("delayed"), F.col("visible_ms")).otherwise(F.col("stored_ms")))
         .withColumn("lateness_ms", F.when(F.col("delayed"), F.col("visible_ms") - F.col("due_ms")))
         .withColumn("early", (F.col("seen_ms") < F.col("due_ms")) | (F.col("first_delivery_ms") < F.col("due_ms")))
         .withColumn("open", F.col("delayed") & F.col("visible_ms").isNull() & ~F.coalesce(F.col("recalled"),
                                                                                           F.lit(False)))
         .withColumn("lost", F.col("open") & (F.col("due_ms") + F.lit(grace_ms) < F.lit(now_ms)))
         .withColumn("waiting", F.col("open") & ~F.col("lost"))
         .withColumn("hour", F.date_trunc("hour", F.timestamp_millis(F.col("due_ms")))))
    return m


def report(msgs):
    """Rows per (topic, hour): the counts of ``COUNTS`` and the lateness quantiles."""
    from pyspark.sql import functions as F

    def count_if(cond):
        return F.sum(F.when(cond, 1).otherwise(0))

    return (msgs.groupBy("topic", "hour").agg(
        count_if(F.col("stored_ms").isNotNull()).alias("sent"),
        count_if(F.col("delayed")).alias("delayed"),
        count_if(F.col("seen_ms").isNotNull()).alias("visible"),
        count_if(F.col("first_delivery_ms").isNotNull()).alias("delivered"),
        count_if(F.col("acked")).alias("acked"),
        count_if(F.col("dead_lettered")).alias("dead_lettered"),
        count_if(F.col("recalled")).alias("recalled"),
        count_if(F.col("early")).alias("early"),
        count_if(F.col("lost")).alias("lost"),
        count_if(F.col("waiting")).alias("waiting"),
        F.percentile_approx("lateness_ms", 0.5, 10000).alias("lateness_p50_ms"),
        F.percentile_approx("lateness_ms", 0.99, 10000).alias("lateness_p99_ms"),
        F.max("lateness_ms").alias("lateness_max_ms"))
        .orderBy("topic", "hour"))


def lateness_histogram(msgs):
    """(topic, upper bound in ms, count): lateness in power-of-two buckets (0, 1, 2, 4, ... ms)."""
    from pyspark.sql import functions as F

    late = F.greatest(F.col("lateness_ms"), F.lit(0))
    bound = F.when(late == 0, F.lit(0)).otherwise(F.pow(F.lit(2), F.ceil(F.log2(late))).cast("long"))
    return (msgs.where(F.col("lateness_ms").isNotNull()).groupBy("topic", bound.alias("le_ms"))
            .count().orderBy("topic", "le_ms"))


@dataclass
class Audit:
    rows: list[dict]
    histogram: list[dict]
    now_ms: int
    grace_ms: int
    dropped_events: int
    totals: dict = field(default_factory=dict)
    groups: list[str] = field(default_factory=list)   # the broker groups audited ([""]: one node)

    @property
    def ok(self) -> bool:
        return not self.totals.get("early") and not self.totals.get("lost")


def run(spark, endpoints: str, topics: list[str] | None = None, grace_s: float = 60.0,
        now_ms: int | None = None, **connection) -> Audit:
    """Run the audit job; ``topics`` limits it (default: every topic with recorded events)."""
    from pyspark.sql import functions as F

    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    grace_ms = int(grace_s * 1000)
    events, dropped, groups = trace_events(spark, endpoints, **connection)
    if topics:
        events = events.where(F.col("topic").isin(list(topics)) | (F.col("kind") == tr.ACKED))
    msgs = messages(events, now_ms, grace_ms).cache()
    try:
        rows = [r.asDict() for r in report(msgs).collect()]
        hist = [r.asDict() for r in lateness_histogram(msgs).collect()]
    finally:
        msgs.unpersist()
    if topics:
        rows = [r for r in rows if r["topic"] in topics]
    totals = {c: sum(r[c] for r in rows) for c in COUNTS}
    late = [r["lateness_max_ms"] for r in rows if r["lateness_max_ms"] is not None]
    totals["lateness_max_ms"] = max(late) if late else None
    return Audit(rows, hist, now_ms, grace_ms, dropped, totals, groups)


# ---------------------------------------------------------------------------- output
def _hour(value) -> str:
    return value.strftime("%Y-%m-%d %H:00") if value is not None else "-"


def table_rows(audit: Audit) -> list[list]:
    return [[r["topic"], _hour(r["hour"]), *(r[c] for c in COUNTS),
             *("-" if r[c] is None else r[c] for c in LATENESS)] for r in audit.rows]


TABLE_COLUMNS = ["topic", "hour (UTC, due)", *COUNTS, "p50 ms", "p99 ms", "max ms"]


def plot_png(audit: Audit) -> bytes:
    """The lateness plot: per hour p50/p99/max by topic, and the lateness distribution."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    topics = sorted({r["topic"] for r in audit.rows if r["lateness_max_ms"] is not None})
    for topic in topics:
        rows = [r for r in audit.rows if r["topic"] == topic and r["lateness_max_ms"] is not None]
        hours = [r["hour"] for r in rows]
        for key, style in (("lateness_p50_ms", "o-"), ("lateness_p99_ms", "s--"), ("lateness_max_ms", "^:")):
            ax1.plot(hours, [max(r[key], 0) + 1 for r in rows], style, label=f"{topic} {key.split('_')[1]}")
    ax1.set_yscale("log")
    ax1.set_title("Lateness per hour of due time (ms + 1, log)")
    ax1.set_xlabel("hour (UTC)")
    if topics:
        ax1.legend(fontsize="small")
    fig.autofmt_xdate()
    bounds = sorted({h["le_ms"] for h in audit.histogram})
    for i, topic in enumerate(topics):
        counts = {h["le_ms"]: h["count"] for h in audit.histogram if h["topic"] == topic}
        xs = np.arange(len(bounds)) + i * 0.8 / max(len(topics), 1)
        ax2.bar(xs, [counts.get(b, 0) for b in bounds], width=0.8 / max(len(topics), 1), label=topic)
    ax2.set_xticks(np.arange(len(bounds)), [f"≤{b}" for b in bounds], rotation=45, fontsize="small")
    ax2.set_title("Lateness distribution (messages per bucket, ms)")
    if topics:
        ax2.legend(fontsize="small")
    fig.tight_layout()
    out = io.BytesIO()
    fig.savefig(out, format="png", dpi=90)
    plt.close(fig)
    return out.getvalue()


def write_html(audit: Audit, path: str) -> None:
    """A self-contained HTML report (the plot is an embedded PNG: nothing is fetched to view it)."""
    png = base64.b64encode(plot_png(audit)).decode()
    head = "".join(f"<th>{html.escape(c)}</th>" for c in TABLE_COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(v))}</td>" for v in row) + "</tr>"
                   for row in table_rows(audit))
    t = audit.totals
    verdict = "OK: no early delivery, no lost message" if audit.ok else \
        f"PROBLEM: {t.get('early', 0)} early, {t.get('lost', 0)} lost"
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(audit.now_ms / 1000))
    doc = f"""<!doctype html>
<html><head><meta charset="utf-8"><title>chronoq delivery audit</title>
<style>body{{font-family:sans-serif;margin:2em}} table{{border-collapse:collapse}}
td,th{{border:1px solid #bbb;padding:3px 8px;text-align:right}} td:first-child,th:first-child{{text-align:left}}
.ok{{color:#070}} .bad{{color:#b00}}</style></head><body>
<h1>chronoq delivery audit</h1>
<p>At {html.escape(when)}; lost = due more than {audit.grace_ms / 1000:g} s ago and never visible.{
    html.escape(f" Broker groups: {', '.join(audit.groups)}.") if any(audit.groups) else ""}
Trace events dropped by the broker (buffer full): {audit.dropped_events}.</p>
<p class="{'ok' if audit.ok else 'bad'}"><b>{html.escape(verdict)}</b></p>
<table><tr>{head}</tr>{body}</table>
<h2>Lateness (visible - due, delayed messages)</h2>
<img alt="lateness plot" src="data:image/png;base64,{png}">
</body></html>
"""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(doc)
