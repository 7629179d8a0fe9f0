"""``chronoq message``: a message's life by id or key (show); recall or reschedule a delayed one
by its recall handle."""

from __future__ import annotations

import sys
import time

import click

from chronoq.cli.params import MAX_EPOCH_MS, Seconds
from chronoq.cli.remote import EXIT_NOT_DONE, admin_call, call, connection, remote_options
from chronoq.cli.render import echo_wrapped, iso_ms, plural, print_json, print_table, size_text


@click.group()
def message() -> None:
    """Show a message's life by id or key; recall or reschedule a delayed one by its recall handle."""


def _outcome_json(r, new_handle: bool) -> dict:
    out = {"outcome": r.outcome, "topic": r.topic or None, "message_id": r.message_id or None,
           "deliver_at_ms": r.deliver_at_ms or None, "detail": r.detail or None}
    if new_handle:
        out["recall_handle"] = r.recall_handle or None
    return out


def _print_outcome(r, as_json: bool, done: str, new_handle: bool = False) -> None:
    if as_json:
        print_json(_outcome_json(r, new_handle))
    else:
        columns = ["OUTCOME", "TOPIC", "MESSAGE ID", "DUE (UTC)"]
        row = [r.outcome, r.topic, r.message_id, iso_ms(r.deliver_at_ms)]
        print_table(None, columns, [row], optional=("TOPIC",))
        # On lines of their own: a sentence and a handle are longer than a column can be at 80.
        if r.detail:
            click.echo(r.detail)
        if new_handle and r.recall_handle:
            click.echo(f"new recall handle: {r.recall_handle}")
    if r.outcome != done:
        sys.exit(EXIT_NOT_DONE)


@message.command("recall")
@click.argument("handle")
@remote_options
def message_recall(handle, endpoint, timeout, as_json) -> None:
    """Cancel the delayed message HANDLE (the recall handle its send returned).

    Exit 0 when it is cancelled (also when it already was), 4 when it was already delivered
    or no pending message matches the handle.
    """
    r = admin_call(endpoint, timeout, "recall", handle)
    _print_outcome(r, as_json, "cancelled")


def _parse_at(text: str, zone=None) -> int:
    """Epoch milliseconds, or an ISO 8601 time (without an offset: in ``zone``, a ``tzinfo``, else
    this machine's local time)."""
    import datetime

    value = text.strip()
    if value.isascii() and value.isdigit():
        if int(value) > MAX_EPOCH_MS:
            raise click.BadParameter(f"{value} epoch milliseconds is after the year 9999", param_hint="--at")
        return int(value)
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither epoch milliseconds nor an ISO 8601 time "
                                 "(e.g. 2030-01-31T09:00:00Z)", param_hint="--at") from None
    if when.tzinfo is None and zone is not None:
        # As a schedule reads its local times: one the clocks skip (spring forward) is the
        # transition, one they repeat its first pass (fold=0 alone would read a skipped 02:30
        # as 03:30 and lose the 03:00 firing).
        from chronoq.features.schedules.occurrences import to_instant_ms

        return to_instant_ms(when.replace(microsecond=0), zone) + when.microsecond // 1000
    return int(when.timestamp() * 1000)


@message.command("reschedule")
@click.argument("handle")
@click.option("--at", "at", default=None, metavar="TIME",
              help="New delivery time: epoch milliseconds or ISO 8601 (e.g. 2030-01-31T09:00:00Z; "
                   "without an offset, this machine's local time).")
@click.option("--in", "in_s", type=Seconds(min=0, max=100 * 365 * 86_400), default=None, metavar="SECONDS",
              help="New delivery time, this many seconds from now.")
@remote_options
def message_reschedule(handle, at, in_s, endpoint, timeout, as_json) -> None:
    """Move the delayed message HANDLE to a new delivery time; prints its new recall handle.

    Exit 0 when it was moved, 4 when it was already delivered, cancelled, or no pending message
    matches the handle (then nothing changed).
    """
    if (at is None) == (in_s is None):
        raise click.UsageError("give the new time with exactly one of --at or --in")
    deliver_at_ms = _parse_at(at) if at is not None else int(time.time() * 1000 + in_s * 1000)
    r = admin_call(endpoint, timeout, "reschedule", handle, deliver_at_ms)
    _print_outcome(r, as_json, "rescheduled", new_handle=True)


@message.command("show")
@click.argument("query", metavar="ID_OR_KEY")
@click.option("--scan-mib", type=click.IntRange(min=1), default=None,
              help="Newest MiB of the commit log to search (at most 1024). Default: the broker's [console] "
                   "lookup_scan_mib (32).")
@click.option("--trace-mib", type=click.IntRange(min=1), default=None,
              help="Newest MiB of the message trace to read (at most 4096). Default: the broker's [console] "
                   "trace_scan_mib (64).")
@remote_options
def message_show(query, scan_mib, trace_mib, endpoint, timeout, as_json) -> None:
    """The life of the message with id or key ID_OR_KEY: stored, due, visible, each delivery
    attempt, ack or dead letter; and its records in the commit log (the console's lookup page).

    Searches only the newest part of the log and trace (see --scan-mib, --trace-mib). Exit 0 when
    found, 4 when nothing there has that id or key.
    """
    from rocketmq.grpc_protocol.definition_pb2 import Code

    from chronoq.client.admin import AdminClient
    from chronoq.client.client import ClientError

    async def work():
        async with AdminClient(endpoint, request_timeout_s=timeout, **connection()) as admin:
            try:
                return await admin.lookup_message(query, scan_mib or 0, trace_mib or 0)
            except ClientError as exc:
                if exc.code != Code.NOT_FOUND:  # the broker's answer for "nothing in the windows"
                    raise
                return exc  # a definite answer, not a failure of the call

    answer = call(endpoint, timeout, work())
    if isinstance(answer, ClientError):
        if as_json:
            print_json({"query": query, "found": False, "detail": answer.status_message, "messages": []})
        click.echo(f"chronoq: not found: {answer.status_message}", err=True)
        sys.exit(EXIT_NOT_DONE)
    if as_json:
        print_json(_lookup_json(query, answer))
    else:
        _print_lookup(answer)


def _event_json(e) -> dict:
    return {"kind": e.kind, "ts_ms": e.ts_ms, "due_ms": e.due_ms or None, "delayed": e.delayed,
            "group": e.group or None, "attempt": e.attempt or None, "topic": e.topic or None,
            "ref": {"topic": e.ref_topic, "queue": e.ref_queue, "offset": e.ref_offset} if e.ref_topic else None}


def _record_json(r) -> dict:
    return {"kind": r.kind, "commit_offset": r.commit_offset, "topic": r.topic, "queue_id": r.queue_id,
            "queue_offset": r.queue_offset, "message_id": r.message_id, "tag": r.tag or None, "keys": list(r.keys),
            "born_ms": r.born_ms, "stored_ms": r.stored_ms, "deliver_at_ms": r.deliver_at_ms or None,
            "body_bytes": r.body_bytes, "recall_handle": r.recall_handle or None}


def _lookup_json(query: str, a) -> dict:
    return {
        "query": query, "found": True,
        "messages": [{"message_id": m.message_id, "topic": m.topic, "status": m.status,
                      "stored_ms": m.stored_ms or None, "due_ms": m.due_ms or None, "visible_ms": m.visible_ms or None,
                      "recalled_ms": m.recalled_ms or None,
                      "groups": [{"group": g.group, "state": g.state, "attempts": g.attempts} for g in m.groups],
                      "events": [_event_json(e) for e in m.events], "records": [_record_json(r) for r in m.records]}
                     for m in a.messages],
        "scanned": {"from_offset": a.scanned_from, "to_offset": a.scanned_to, "truncated": a.truncated,
                    "damage": a.damage or None},
        "trace": {"enabled": a.trace_enabled, "bytes_read": a.trace_bytes_read, "dropped": a.trace_dropped},
    }


def _event_detail(e) -> str:
    """The detail column of a life event (as the console's lookup page words it)."""
    if e.kind == "stored":
        return f"due {iso_ms(e.due_ms)}" if e.delayed else "visible at once"
    if e.kind in ("visible", "recalled", "rescheduled"):
        late = f", {e.ts_ms - e.due_ms:,} ms late" if e.kind == "visible" else ""
        return f"due {iso_ms(e.due_ms)}{late}"
    if e.ref_topic:
        return f"{e.ref_topic}/{e.ref_queue}@{e.ref_offset}"
    return ""


def _record_place(r) -> str:
    """topic/queue@offset; a timer message's scheduled record sits in no queue yet (no offset)."""
    from chronoq.core.delay_levels import DELAY_TOPIC

    if r.kind == "scheduled" and r.topic != DELAY_TOPIC:
        return f"{r.topic}/{r.queue_id}"
    return f"{r.topic}/{r.queue_id}@{r.queue_offset}"


def _print_lookup(a) -> None:
    if a.damage:
        click.echo(f"warning: {a.damage}")
    if not a.trace_enabled:
        click.echo("note: the broker records no message trace (trace_enabled = false): only records are shown")
    elif a.trace_dropped:
        click.echo(f"note: the trace buffer dropped {plural(a.trace_dropped, 'event')} since start: a life may be incomplete")
    for m in a.messages:
        echo_wrapped(f"message {m.message_id} in {m.topic}: {m.status}")
        print_table("life", ["TIME (UTC)", "EVENT", "GROUP", "ATTEMPT", "DETAIL"],
                     [[iso_ms(e.ts_ms), e.kind, e.group, e.attempt or None, _event_detail(e)] for e in m.events]
                     or [["-", "no trace events in the window read", None, None, None]],
                     right=("ATTEMPT",), wrap=("DETAIL",), optional=("ATTEMPT", "GROUP"))
        print_table("records in the commit log", ["WHAT", "TOPIC/QUEUE@OFFSET", "COMMIT OFFSET", "STORED (UTC)",
                                                   "DUE (UTC)", "KEYS", "BODY", "RECALL HANDLE"],
                     [[r.kind, _record_place(r), r.commit_offset, iso_ms(r.stored_ms),
                       iso_ms(r.deliver_at_ms), ", ".join(r.keys), f"{r.body_bytes:,} B", r.recall_handle or None]
                      for r in m.records] or [["-", "no record in the scanned part of the log"] + [None] * 6],
                     right=("COMMIT OFFSET", "BODY"), wrap=("KEYS",),
                     optional=("RECALL HANDLE", "COMMIT OFFSET", "KEYS", "STORED (UTC)", "BODY"))
        click.echo("")
    click.echo(f"searched commit-log offsets {a.scanned_from:,} to {a.scanned_to:,}"
               + (" (stopped at 200 matching records)" if a.truncated else "")
               + f" and {size_text(a.trace_bytes_read)} of the message trace")
