"""``chronoq dlq``: a consumer group's dead letters (``%DLQ%<group>``): list them, send them back
to their topics (``chronoq.features.deadletters``)."""

from __future__ import annotations

import base64

import click

from chronoq.cli.remote import admin_call, remote_options
from chronoq.cli.render import iso_ms, plural, print_json, print_table, progress_bar

LIMIT_MAX = 1000           # dead letters per request the broker accepts
BODY_PREVIEW_CHARS = 40


@click.group()
def dlq() -> None:
    """List a consumer group's dead letters; send them back to their topics."""


def _preview(body: bytes, size: int) -> str:
    try:
        text = body.decode("utf-8").replace("\n", "\\n")
    except UnicodeDecodeError:
        return f"<{plural(size, 'byte')}, not UTF-8>"
    cut = len(text) > BODY_PREVIEW_CHARS or size > len(body)
    return text[:BODY_PREVIEW_CHARS - 1] + "…" if cut else text


@dlq.command("list")
@click.argument("group")
@click.option("--limit", type=click.IntRange(1, LIMIT_MAX), default=20, show_default=True,
              help="Dead letters to show.")
@click.option("--body-bytes", type=click.IntRange(1, 4096), default=64, show_default=True,
              help="Bytes of each body to fetch (the table shows the start of them).")
@click.option("--all", "everything", is_flag=True,
              help="From the oldest retained, those resent already included. Default: the ones a resend sends next.")
@remote_options
def dlq_list(group, limit, body_bytes, everything, endpoint, timeout, as_json) -> None:
    """The dead letters of consumer GROUP: messages it failed max-attempts times."""
    r = admin_call(endpoint, timeout, "call", "ListDeadLetters", group=group, limit=limit, all=everything,
                   body_max=body_bytes)
    waiting = r.max_offset - r.cursor
    if as_json:
        print_json({"group": group, "min_offset": r.min_offset, "max_offset": r.max_offset, "cursor": r.cursor,
                    "not_resent": waiting, "messages": [
                        {"offset": m.offset, "message_id": m.message_id, "topic": m.topic, "tag": m.tag or None,
                         "keys": list(m.keys), "stored_ms": m.stored_ms, "body_bytes": m.body_bytes,
                         "body_base64": base64.b64encode(m.body).decode("ascii"), "resent": m.resent}
                        for m in r.messages]})
        return
    click.echo(f"{plural(r.max_offset - r.min_offset, 'dead letter')} of {group} retained, "
               f"{plural(waiting, 'dead letter')} not resent")
    if r.messages:
        print_table(None, ["OFFSET", "MESSAGE ID", "TOPIC", "DEAD SINCE (UTC)", "RESENT", "BODY"],
                    [[m.offset, m.message_id, m.topic, iso_ms(m.stored_ms), "yes" if m.resent else "no",
                      _preview(m.body, m.body_bytes)] for m in r.messages],
                    right=("OFFSET",), wrap=("BODY",), optional=("DEAD SINCE (UTC)", "RESENT", "OFFSET", "BODY"))


@dlq.command("resend")
@click.argument("group")
@click.option("--limit", type=click.IntRange(min=1), default=None,
              help="Resend at most this many. Default: every dead letter not resent yet.")
@remote_options
def dlq_resend(group, limit, endpoint, timeout, as_json) -> None:
    """Send consumer GROUP's dead letters back to their topics, oldest first.

    Each request writes up to 1,000 and answers once they are durable; then the resend cursor
    moves past them. Interrupted (Ctrl-C, a crash), run it again: nothing is lost, and at worst
    the last request's messages are delivered twice (docs/cli.md).
    """
    totals = {"resent": 0, "duplicates": 0, "skipped": 0}
    first = last = None
    left = limit
    with progress_bar(f"resending dead letters of {group}", limit, as_json or (limit or 0) <= LIMIT_MAX) as advance:
        while left is None or left > 0:
            n = LIMIT_MAX if left is None else min(left, LIMIT_MAX)
            r = admin_call(endpoint, timeout, "call", "ResendDeadLetters", group=group, limit=n)
            first = r.from_offset if first is None else first
            last = r
            for key in totals:
                totals[key] += getattr(r, key)
            advance(r.resent)
            if left is not None:
                left -= r.resent + r.skipped
            if not r.remaining or r.to_offset == r.from_offset:
                break
    if as_json:
        print_json(dict(totals, group=group, from_offset=first, to_offset=last.to_offset, remaining=last.remaining))
        return
    click.echo(f"resent {plural(totals['resent'], 'dead letter')} of {group} to their topics"
               + (f" ({totals['duplicates']:,} answered as duplicates)" if totals["duplicates"] else "")
               + (f"; {plural(totals['skipped'], 'dead letter')} gone (retention)" if totals["skipped"] else "")
               + f"; {plural(last.remaining, 'dead letter')} left")
