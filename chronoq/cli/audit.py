"""``chronoq audit``: the delivery audit, a PySpark job over the broker's message life trace."""

from __future__ import annotations

import sys

import click

from chronoq.cli.params import Seconds
from chronoq.cli.remote import EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE, connection, fail, remote_options
from chronoq.cli.render import print_json, print_table, progress_bar

EXIT_AUDIT_PROBLEM = 5      # the audit found early deliveries or lost messages


def _audit_json(result) -> dict:
    rows = [{**r, "hour": r["hour"].strftime("%Y-%m-%dT%H:00:00Z") if r["hour"] else None} for r in result.rows]
    return {"ok": result.ok, "at_ms": result.now_ms, "grace_ms": result.grace_ms,
            "dropped_trace_events": result.dropped_events, "totals": result.totals, "rows": rows,
            "broker_groups": [g for g in result.groups if g]}


@click.command()
@click.option("--topic", "topics", multiple=True,
              help="Only this topic; repeat for several. Default: every topic in the trace.")
@click.option("--grace", type=Seconds(min=0), default=60.0, show_default=True,
              help="Seconds after its due time from which a delayed message never made visible counts as lost.")
@click.option("--html", "html_path", default="chronoq-audit.html", show_default=True,
              help="Where to write the HTML report with the lateness plot ('' for none).")
@click.option("--master", default="local[*]", show_default=True,
              help="Spark master for the job (an active SparkSession in this process is used as it is).")
@remote_options
def audit(topics, grace, html_path, master, endpoint, timeout, as_json) -> None:
    """Delivery audit: a PySpark job over the broker's message life trace (docs/spark.md).

    Per topic and hour of due time: sent, visible, delivered, acked, dead-lettered, recalled,
    early (must be 0), lost (delayed, past due + --grace, never visible), waiting; lateness
    (visible - due) p50/p99/max. Prints a table (or --json) and writes an HTML report.
    Exit 0 when nothing was early or lost, 5 when something was. On a node of a cluster
    (docs/cluster.md) the audit reads every broker group's trace, each at its primary.
    """
    try:
        from pyspark.sql import SparkSession

        from chronoq.spark import audit as job
        from chronoq.spark.rpc import BrokerError
        from chronoq.spark.session import local_session
    except ImportError as exc:
        fail(f"the audit needs the spark extra (pip install 'chronoq[spark]' and Java 17): {exc}", EXIT_USAGE)
    owned = SparkSession.getActiveSession() is None
    with progress_bar("starting Spark", None, as_json):
        spark = local_session(master, app="chronoq-audit")
    try:
        # The Spark job's size is unknown up front: a spinner with the elapsed time.
        with progress_bar("auditing the message trace with Spark", None, as_json):
            result = job.run(spark, endpoint, list(topics), grace, **connection())
        if html_path:
            job.write_html(result, html_path)
    except BrokerError as exc:
        fail(str(exc), EXIT_UNREACHABLE if exc.code == -1 else EXIT_REFUSED)
    except RuntimeError as exc:  # a group without a primary, a broker without a trace: said, not a traceback
        fail(str(exc), EXIT_REFUSED)
    finally:
        if owned:
            spark.stop()
    if as_json:
        print_json(_audit_json(result))
    else:
        print_table("chronoq delivery audit", job.TABLE_COLUMNS, job.table_rows(result),
                     right=tuple(job.TABLE_COLUMNS[2:]),
                     # At 80 columns: topic, hour, acked, dead-lettered, early, lost, p99 stay.
                     optional=("max ms", "p50 ms", "waiting", "recalled", "visible", "delayed", "delivered", "sent"))
        t = result.totals
        groups = [g for g in result.groups if g]
        click.echo((f"broker groups audited: {', '.join(groups)}; " if groups else "")
                   + ("OK: no early delivery, no lost message" if result.ok else
                    f"PROBLEM: {t['early']} early, {t['lost']} lost")
                   + (f"; report: {html_path}" if html_path else ""))
    if not result.ok:
        sys.exit(EXIT_AUDIT_PROBLEM)
