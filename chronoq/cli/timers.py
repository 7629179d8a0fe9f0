"""``chronoq timers``: delayed delivery seen from the broker (lateness, what fires per minute,
backlog per delay level)."""

from __future__ import annotations

import click

from chronoq.cli.remote import EXIT_REFUSED, admin_call, call, connection, fail, remote_options
from chronoq.cli.render import bars, duration_text, echo_wrapped, iso_ms, plural, print_json, print_table

TIMERS_MINUTES_MAX = 10_080  # a week (the broker's limit)


def _lane_json(lane) -> dict:
    return {"pending": lane.pending, "pending_max": lane.pending_max, "failures": lane.failures,
            "blocked": lane.blocked, "retry_at_ms": lane.retry_at_ms or None, "last_error": lane.last_error or None,
            "delivered": lane.delivered, "skipped": lane.skipped}


def _lane_state(lane) -> str:
    if lane.blocked:
        return f"BLOCKED ({lane.failures} failures: {lane.last_error})"
    if lane.failures:
        return f"retrying ({lane.failures} failures: {lane.last_error})"
    return "ok"


def _by_minute(buckets) -> list[dict]:
    """Pending per minute of due time (buckets narrower than a minute are added up; wider ones
    count in the minute they start)."""
    minutes: dict[int, int] = {}
    for b in buckets:
        start = b.start_ms - b.start_ms % 60_000
        minutes[start] = minutes.get(start, 0) + b.pending
    return [{"start_ms": start, "pending": minutes[start]} for start in sorted(minutes)]


def _timers_json(st) -> dict:
    h = st.lateness
    return {
        "now_ms": st.now_ms, "bucket_ms": st.bucket_ms, "cursor": st.cursor, "wheel_entries": st.wheel_entries,
        "buckets_on_disk": st.buckets_on_disk, "overdue_pending": st.overdue_pending, "lost": st.lost,
        "notes": list(st.notes),
        "lateness": {"count": h.count, "sum_ms": h.sum_ms, "max_ms": h.max_ms, "early": h.early,
                     "p50_ms": h.p50_ms if h.count else None, "p99_ms": h.p99_ms if h.count else None,
                     "p999_ms": h.p999_ms if h.count else None,
                     "buckets": [{"le_ms": None if b.le_ms < 0 else b.le_ms, "count": b.count} for b in h.buckets]},
        "timer_lane": _lane_json(st.timer_lane),
        "levels": [{"level": lv.level, "delay_ms": lv.delay_ms, "backlog": lv.backlog,
                    "head_due_ms": lv.head_due_ms or None, "lane": _lane_json(lv.lane)} for lv in st.levels],
        "due_by_bucket": [{"start_ms": b.start_ms, "end_ms": b.end_ms, "pending": b.pending}
                          for b in st.due_by_bucket],
        "due_by_minute": _by_minute(st.due_by_bucket),
    }


def _print_timers(st, minutes: int) -> None:
    h = st.lateness
    echo_wrapped(f"timer clock {iso_ms(st.now_ms)}; buckets of {duration_text(st.bucket_ms)}; "
                 f"{plural(st.wheel_entries, 'timer')} in memory, {plural(st.buckets_on_disk, 'bucket')} waiting "
                 f"on disk; cursor {st.cursor:,}")
    lane = st.timer_lane
    print_table(None, ["LANE", "DELIVERED", "IN FLIGHT", "BACKLOG", "NEXT DUE", "STATE"],
                 [["timer (deliver_at)", f"{lane.delivered:,}", f"{lane.pending:,}",
                   f"{sum(b.pending for b in st.due_by_bucket) + st.overdue_pending:,}", None, _lane_state(lane)]] +
                 [[f"level {lv.level} ({duration_text(lv.delay_ms)})", f"{lv.lane.delivered:,}", f"{lv.lane.pending:,}",
                   f"{lv.backlog:,}", iso_ms(lv.head_due_ms) if lv.backlog else None, _lane_state(lv.lane)]
                  for lv in st.levels],
                 right=("DELIVERED", "IN FLIGHT", "BACKLOG"), wrap=("STATE",))
    echo_wrapped(f"(timer backlog: within the next {plural(minutes, 'minute')}, plus {st.overdue_pending:,} overdue)")
    click.echo("")
    if h.count:
        echo_wrapped(f"lateness (visible - due) of {plural(h.count, 'delivery', 'deliveries')}: p50 <= {h.p50_ms} ms, "
                     f"p99 <= {h.p99_ms} ms, p99.9 <= {h.p999_ms} ms, max {h.max_ms} ms, early {h.early}")
        rows = []
        prev = None
        for b in h.buckets:
            label = f"> {prev} ms" if b.le_ms < 0 else ("0 ms" if b.le_ms == 0 else f"<= {b.le_ms} ms")
            rows.append((label, b.count))
            prev = b.le_ms
        while rows and rows[-1][1] == 0:  # no empty tail rows
            rows.pop()
        bars(rows)
    else:
        click.echo("lateness: nothing delivered since the broker started")
    click.echo("")
    per_minute = _by_minute(st.due_by_bucket)
    echo_wrapped(f"timer messages due per minute, next {plural(minutes, 'minute')} "
                 f"({sum(m['pending'] for m in per_minute):,} pending; overdue now: {st.overdue_pending:,}):")
    bars([(iso_ms(m["start_ms"])[11:16] + "Z", m["pending"]) for m in per_minute])
    for note in st.notes:
        echo_wrapped(f"note: {note}")


@click.group(invoke_without_command=True)
@click.option("--minutes", type=click.IntRange(1, TIMERS_MINUTES_MAX), default=10, show_default=True,
              help="How far ahead to count pending timer messages per minute.")
@remote_options
@click.pass_context
def timers(ctx, minutes, endpoint, timeout, as_json) -> None:
    """Delayed delivery: lateness histogram, what fires per minute, backlog per delay level.

    Without a subcommand: the overview. `chronoq timers list` lists what is pending;
    `chronoq timers cancel TOPIC --key K` cancels by message key."""
    if ctx.invoked_subcommand is not None:
        return
    st = admin_call(endpoint, timeout, "timer_stats", minutes)
    if as_json:
        print_json(_timers_json(st))
    else:
        _print_timers(st, minutes)


# ------------------------------------------------------------------ timers cancel (cancel by key)
@timers.command("cancel")
@click.argument("topic")
@click.option("--key", required=True, help="The RocketMQ message key: every pending timer message of TOPIC "
                                           "carrying it is cancelled.")
@remote_options
def timers_cancel(topic, key, endpoint, timeout, as_json) -> None:
    """Cancel every pending timer message of TOPIC carrying message key --key (admin only).

    A topic spread over several broker groups (a cluster): each group holding it cancels its own
    messages (keys live on the group that stored the message); the answer sums them. While a group
    holding it has no primary, nothing is cancelled and the command fails naming the group (its
    messages would fire: run it again once the group is back)."""
    from chronoq.client.admin import AdminClient
    from chronoq.client.routed import key_cancel_targets

    async def work():
        down, primaries = await key_cancel_targets(endpoint, topic, request_timeout_s=timeout, **connection())
        if down:
            return down, []
        answers = []
        for primary in primaries:
            async with AdminClient(primary, request_timeout_s=timeout, **connection()) as admin:
                answers.append(await admin.cancel_by_key(topic, key))
        return [], answers

    down, answers = call(endpoint, timeout, work())
    if down:
        fail(f"broker group(s) {', '.join(down)} holding {topic} have no primary now: their pending messages "
             "cannot be cancelled, so none was (run it again once they are back)", EXIT_REFUSED)
    cancelled = [{"message_id": m.message_id, "deliver_at_ms": m.deliver_at_ms} for r in answers for m in r.cancelled]
    delivered = [{"message_id": m.message_id, "deliver_at_ms": m.deliver_at_ms} for r in answers for m in r.delivered]
    truncated = any(r.truncated for r in answers)
    if as_json:
        print_json({"topic": topic, "key": key, "cancelled": cancelled, "delivered": delivered,
                    "truncated": truncated, "broker_groups": len(answers)})
        return
    click.echo(f"{plural(len(cancelled), 'pending message')} of {topic} with key {key!r} cancelled"
               + (f" on {len(answers)} broker groups" if len(answers) > 1 else "")
               + (f"; {len(delivered)} already delivered" if delivered else "")
               + ("; more remain: run it again" if truncated else ""))
    rows = [[m["message_id"], iso_ms(m["deliver_at_ms"]), "cancelled"] for m in cancelled]
    rows += [[m["message_id"], iso_ms(m["deliver_at_ms"]), "already delivered"] for m in delivered]
    if rows:
        print_table(None, ["MESSAGE ID", "DUE", "OUTCOME"], rows)



# ---------------------------------------------------------------------------- timers list
LIST_LIMIT_MAX = 1000  # the broker's (chronoq.timer.pending.LIMIT_MAX)


def _pending_json(m) -> dict:
    return {"due_ms": m.due_ms, "topic": m.topic, "queue": m.queue, "message_id": m.message_id,
            "keys": list(m.keys), "tag": m.tag or None, "level": m.level or None, "ident": m.ident,
            "properties": dict(m.properties), "message_group": m.message_group or None, "born_ms": m.born_ms,
            "stored_ms": m.stored_ms, "body_bytes": m.body_bytes, "recall_handle": m.recall_handle}


@timers.command("list")
@click.argument("topic", required=False, default="")
@click.option("--key", default="", metavar="KEY", help="Only messages carrying this message key.")
@click.option("--from", "from_", default=None, metavar="TIME",
              help="Due at or after TIME (epoch ms or ISO 8601, e.g. 2030-01-31T09:00:00Z).")
@click.option("--to", default=None, metavar="TIME", help="Due before TIME (epoch ms or ISO 8601).")
@click.option("--limit", type=click.IntRange(1, LIST_LIMIT_MAX), default=100, show_default=True,
              help="Messages per page.")
@click.option("--cursor", default="", metavar="C", help="Continue after the page that printed C.")
@remote_options
def timers_list(topic, key, from_, to, limit, cursor, endpoint, timeout, as_json) -> None:
    """Pending delayed messages (not yet delivered, not recalled), in order of due time.

    One page per call; when more may follow, the last line gives the --cursor for the next page
    (same filters). Exit 0 (also for an empty page), 1 when the broker refuses the query.
    """
    from chronoq.cli.schedule import _parse_ms

    from_ms = _parse_ms(from_, "--from") if from_ else None
    to_ms = _parse_ms(to, "--to") if to else None
    page = admin_call(endpoint, timeout, "list_pending", topic=topic, key=key, from_ms=from_ms, to_ms=to_ms,
                      limit=limit, cursor=cursor)
    if as_json:
        print_json({"messages": [_pending_json(m) for m in page.messages], "next_cursor": page.next_cursor or None,
                    "scanned": page.scanned})
        return
    if page.messages:
        print_table(None, ["DUE (UTC)", "TOPIC", "MESSAGE ID", "KEYS"],
                    [[iso_ms(m.due_ms)[:19].replace("T", " "), m.topic if not m.level else f"{m.topic} (L{m.level})",
                      m.message_id, ", ".join(m.keys)] for m in page.messages], wrap=("TOPIC", "KEYS"))
    else:
        click.echo("no pending messages match" + (" on this page" if page.next_cursor else ""))
    if page.next_cursor:
        click.echo(f"more: --cursor {page.next_cursor}")
