"""``chronoq stats``: the broker overview."""

from __future__ import annotations

import click

from chronoq.cli.remote import admin_call, remote_options
from chronoq.cli.render import plural, print_json, print_table, size_text


def _stats_json(st) -> dict:
    out = {name: getattr(st, name) for name in STATS_FIELDS}
    for key in ("lateness_p50_ms", "lateness_p99_ms"):
        out[key] = None if out[key] < 0 else out[key]
    out["pending_by_horizon"] = {h.horizon: h.pending for h in st.pending_by_horizon}
    return out


STATS_FIELDS = ("topics", "groups", "messages_stored", "in_flight", "dlq", "pending_timers", "commitlog_bytes",
                "commitlog_segments", "lateness_count", "lateness_p50_ms", "lateness_p99_ms", "messages_sent",
                "messages_received", "messages_acked", "messages_dead_lettered")


def _print_stats(st) -> None:
    due = ", ".join(f"{h.horizon}: {h.pending:,}" for h in st.pending_by_horizon if h.horizon != "inf")
    lateness = "none measured yet" if st.lateness_count == 0 else \
        f"p50 {st.lateness_p50_ms:,} ms, p99 {st.lateness_p99_ms:,} ms ({plural(st.lateness_count, 'delivery', 'deliveries')})"
    rows = [
        ["topics", f"{st.topics:,}"], ["consumer groups", f"{st.groups:,}"],
        ["messages stored", f"{st.messages_stored:,}"], ["in flight", f"{st.in_flight:,}"],
        ["dead-lettered (stored)", f"{st.dlq:,}"],
        ["pending timers", f"{st.pending_timers:,}" + (f" (due within {due})" if st.pending_timers else "")],
        ["timer lateness", lateness],
        ["commit log", f"{size_text(st.commitlog_bytes)} in {plural(st.commitlog_segments, 'segment')}"],
        ["since start", f"{st.messages_sent:,} sent, {st.messages_received:,} received, "
                        f"{st.messages_acked:,} acked, {st.messages_dead_lettered:,} dead-lettered"],
    ]
    print_table("broker overview", ["WHAT", "VALUE"], rows, wrap=("VALUE",))


@click.command()
@remote_options
def stats(endpoint, timeout, as_json) -> None:
    """Broker overview: topics, groups, stored, in flight, DLQ, pending timers, commit log, lateness."""
    st = admin_call(endpoint, timeout, "stats")
    if as_json:
        print_json(_stats_json(st))
    else:
        _print_stats(st)
