"""``chronoq send`` and ``chronoq receive``: produce messages and POP-consume them through
``chronoq.client.client``."""

from __future__ import annotations

import base64
import os
import sys
import time

import click

from chronoq.cli.params import Seconds
from chronoq.cli.remote import call, connection, remote_options
from chronoq.cli.render import iso_ms, plural, print_json, print_table, progress_bar

RECEIVE_MAX_MESSAGES = 32   # per request (the protocol's batch limit)
LONG_POLL_MAX_S = 60.0      # the broker parks a receive at most this long
INVISIBLE_MAX_S = 12 * 3600  # the broker's range for a receive's invisible time (pop.names)
SEND_BATCH_DEFAULT = 100
SEND_BATCH_MAX = 1024       # messages per SendMessage request the broker accepts
BODY_PREVIEW_CHARS = 60     # body column of the receive table


def _parse_properties(values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in values:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.BadParameter(f"{item!r} is not KEY=VALUE", param_hint="--property")
        out[key] = value
    return out


def _read_body(body: str | None, file) -> bytes:
    if body is not None and file is not None:
        raise click.UsageError("give the body either as BODY or with --file, not both")
    if body is not None:
        return os.fsencode(body)  # the bytes given on the command line, also when not UTF-8
    if file is not None:
        return file.read()
    if sys.stdin.isatty():
        raise click.UsageError("no body: give BODY, --file FILE, or pipe it on stdin")
    return sys.stdin.buffer.read()


def _parse_delay(text: str | None) -> int | None:
    """``--delay``: a duration with a unit (``90s``, ``30m``, ``2h``, ``1d``, ``1500ms``) or plain
    seconds (``90``, ``1.5``); returns ms."""
    if text is None:
        return None
    try:
        seconds = float(text)
    except ValueError:
        from chronoq.core import errors
        from chronoq.core.delay_levels import parse_duration

        try:
            return parse_duration(text, what="--delay")
        except errors.ClientError as exc:
            raise click.BadParameter(f"{text!r} is not a duration: a number of seconds, or a whole number with "
                                     "a unit (ms, s, m, h, d), e.g. 90s, 30m, 2h, 1d", param_hint="--delay") from exc
    if not seconds >= 0 or seconds == float("inf"):
        raise click.BadParameter(f"{text!r} must be zero or more seconds", param_hint="--delay")
    return round(seconds * 1000)


def _parse_at(text: str | None) -> int | None:
    """``--at``: an ISO 8601 time with its zone (``2026-12-24T18:00:00+01:00``, ``...Z``); epoch ms."""
    if text is None:
        return None
    import datetime

    try:
        when = datetime.datetime.fromisoformat(text.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 time, e.g. 2026-12-24T18:00:00+01:00",
                                 param_hint="--at") from None
    if when.tzinfo is None:
        raise click.BadParameter(f"{text!r} has no time zone, so it could mean any of 24 hours; add one, e.g. "
                                 f"{when.isoformat()}Z (UTC) or {when.isoformat()}+01:00", param_hint="--at")
    return int(when.timestamp() * 1000)


def _due_ms(receipt, deliver_at_ms: int | None) -> int | None:
    """When a sent message is due: the time asked for, or (a delay level) the one its recall
    handle carries (the broker's level table decides it)."""
    if deliver_at_ms is not None:
        return deliver_at_ms
    if receipt.recall_handle:
        from chronoq.timer import handle as recall_handles

        return recall_handles.decode(receipt.recall_handle).due_ms
    return None


@click.command()
@click.argument("topic")
@click.argument("body", required=False)
@click.option("--file", "file", type=click.File("rb"), default=None,
              help="Read the body from FILE ('-': stdin). Default: BODY, else stdin.")
@click.option("--tag", default="", help="Message tag (consumers can filter on it).")
@click.option("--key", "keys", multiple=True, help="Message key, for lookups; repeat for several.")
@click.option("--property", "properties", multiple=True, metavar="KEY=VALUE",
              help="User property; repeat for several.")
@click.option("--group", "message_group", default=None,
              help="Message group: sends a FIFO message (ordered within the group).")
@click.option("--delay", default=None, metavar="DURATION",
              help="Deliver this long from now: 90s, 30m, 2h, 1d, 1500ms, or plain seconds (90, 1.5).")
@click.option("--at", "at", default=None, metavar="TIME",
              help="Deliver at this ISO 8601 time with its zone: 2026-12-24T18:00:00+01:00, or ...Z for UTC.")
@click.option("--level", type=click.IntRange(min=1), default=None,
              help="Deliver after delay level N of the broker's table (timer_delay_levels; RocketMQ's "
                   "1s 5s 10s 30s 1m ... by default).")
@click.option("--replace-key", default=None,
              help="With --delay or --at: replace the pending message of TOPIC sent with the same replace "
                   "key (debounce; docs/timers.md). What it replaced is printed.")
@click.option("--count", type=click.IntRange(min=1), default=1, show_default=True,
              help="Send the body this many times (bulk), in batches.")
@click.option("--batch-size", type=click.IntRange(1, SEND_BATCH_MAX), default=SEND_BATCH_DEFAULT,
              show_default=True, help="Messages per SendMessage request with --count.")
@remote_options
def send(topic, body, file, tag, keys, properties, message_group, delay, at, level, replace_key, count,
         batch_size, endpoint, timeout, as_json) -> None:
    """Send a message to TOPIC. The body is BODY, --file FILE, or stdin.

    A delayed message (--delay, --at or --level, one of them) prints its due time; its recall
    handle, to cancel or move it (chronoq message recall|reschedule), is in --json."""
    props = _parse_properties(properties)
    timing = [name for name, value in (("--delay", delay), ("--at", at), ("--level", level)) if value is not None]
    if len(timing) > 1:
        raise click.UsageError(f"{' and '.join(timing)} cannot be combined: give one delivery time")
    if message_group is not None and timing:
        raise click.UsageError(f"--group (FIFO) and {timing[0]} cannot be combined: a message has one type")
    delay_ms, at_ms = _parse_delay(delay), _parse_at(at)
    if replace_key is not None and not replace_key:  # (an unset $KEY: it would send no replace key)
        raise click.BadParameter("a replace key is 1 to 1,024 characters, not empty", param_hint="--replace-key")
    if replace_key is not None and delay_ms is None and at_ms is None:
        raise click.UsageError("--replace-key needs --delay or --at: it replaces a pending delayed message")
    data = _read_body(body, file)
    from chronoq.client.client import OutgoingMessage
    from chronoq.client.routed import RoutedSender

    receipts: list = []
    due: list = []

    async def work(advance):
        # Over every broker group holding the topic (a cluster: docs/cluster.md), else --endpoint alone.
        async with RoutedSender(endpoint, request_timeout_s=timeout, **connection()) as client:
            left = count
            while left:
                n = min(left, batch_size)
                deliver_at_ms = at_ms if delay_ms is None else int(time.time() * 1000) + delay_ms
                batch = [OutgoingMessage(topic, data, tag=tag, keys=keys, properties=props,
                                         message_group=message_group, deliver_at_ms=deliver_at_ms, delay_level=level,
                                         replace_key=replace_key)
                         for _ in range(n)]
                sent = await client.send_batch(batch)
                receipts.extend(sent)
                due.extend(_due_ms(r, deliver_at_ms) for r in sent)
                advance(n)
                left -= n

    started = time.monotonic()
    try:
        # A bar only for bulk sends of more than one request (one request is over at once).
        with progress_bar(f"sending to {topic}", count, as_json or count <= batch_size) as advance:
            call(endpoint, timeout, work(advance))
    finally:
        if receipts and len(receipts) < count:  # a later batch failed: say what is stored
            click.echo(f"chronoq: {len(receipts):,} of {plural(count, 'message')} were sent before the error", err=True)
    elapsed_s = time.monotonic() - started
    if as_json:
        print_json({"topic": topic, "sent": len(receipts), "elapsed_s": round(elapsed_s, 3), "messages": [
            {"message_id": r.message_id, "offset": r.offset, "due_ms": d, "due": iso_ms(d),
             "recall_handle": r.recall_handle or None, **({"replaced": r.replaced} if r.replaced else {})}
            for r, d in zip(receipts, due)]})
        return
    if count == 1:
        r, d = receipts[0], due[0]
        # A delayed message has no queue offset until it is due (the broker answers -1).
        columns, row = ["TOPIC", "MESSAGE ID", "OFFSET"], [topic, r.message_id, r.offset if r.offset >= 0 else "-"]
        if d is not None:
            columns.append("DUE (UTC)")
            row.append(iso_ms(d))
        if r.replaced:
            columns.append("REPLACED")
            row.append(r.replaced)
        print_table(None, columns, [row], right=("OFFSET",), optional=("OFFSET",))
        if r.recall_handle:
            click.echo("its recall handle, to cancel or move it, is in the --json answer")
    else:
        rate = len(receipts) / elapsed_s if elapsed_s > 0 else float("inf")
        when = ""
        if due and due[0] is not None:
            first, last = min(due), max(due)
            when = f", due at {iso_ms(first)}" if first == last else f", due from {iso_ms(first)} to {iso_ms(last)}"
        click.echo(f"sent {plural(len(receipts), 'message')} to {topic} in {elapsed_s:.2f} s "
                   f"({rate:,.0f} msg/s){when}")


# ----------------------------------------------------------------------------- receive
def _body_text(body: bytes) -> str | None:
    try:
        return body.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _message_json(m, acked: bool) -> dict:
    return {
        "topic": m.topic, "message_id": m.message_id, "body": _body_text(m.body),
        "body_base64": base64.b64encode(m.body).decode("ascii"), "tag": m.tag or None, "keys": m.keys,
        "properties": m.properties, "message_group": m.message_group or None, "queue_id": m.queue_id,
        "queue_offset": m.queue_offset, "delivery_attempt": m.delivery_attempt, "born_ms": m.born_ms,
        "store_ms": m.store_ms, "deliver_at_ms": m.deliver_at_ms or None, "receipt_handle": m.receipt_handle,
        "acked": acked,
    }


def _body_preview(body: bytes) -> str:
    text = _body_text(body)
    if text is None:
        return f"<{plural(len(body), 'byte')}, not UTF-8>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= BODY_PREVIEW_CHARS else text[:BODY_PREVIEW_CHARS - 1] + "…"


@click.command()
@click.argument("group")
@click.argument("topic")
@click.option("--max", "max_messages", type=click.IntRange(1, RECEIVE_MAX_MESSAGES), default=16,
              show_default=True, help="Messages per receive request.")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="Keep receiving until this many messages arrived, or a receive waited --wait "
                   "seconds for nothing. Default: one receive request.")
@click.option("--invisible", type=Seconds(1, INVISIBLE_MAX_S), default=30.0, show_default=True,
              help="Seconds a received message stays invisible to other consumers (1 to 43200).")
@click.option("--wait", type=Seconds(0, LONG_POLL_MAX_S), default=5.0, show_default=True,
              help="Seconds to wait (long poll) when no message is ready.")
@click.option("--tag", "tag_filter", default="*", show_default=True,
              help="Tag filter: '*', a tag, or tags joined by '||'.")
@click.option("--no-ack", is_flag=True,
              help="Do not acknowledge: the messages come back after --invisible seconds, or after "
                   "the group's retry back-off if that is longer (docs/rocketmq.md).")
@remote_options
def receive(group, topic, max_messages, count, invisible, wait, tag_filter, no_ack,
            endpoint, timeout, as_json) -> None:
    """Receive (POP) messages of TOPIC for consumer GROUP, print and acknowledge them.

    A topic spread over several broker groups (a cluster) is received from every group holding
    it, each acknowledgement going to the message's own group."""
    from chronoq.client.routed import RoutedReceiver

    got: list[tuple[object, bool]] = []

    async def work(advance):
        async with RoutedReceiver(endpoint, request_timeout_s=timeout, **connection()) as client:
            want = count or max_messages
            while len(got) < want:
                batch = await client.receive(group, topic, max_messages=min(max_messages, want - len(got)),
                                             invisible_s=invisible, wait_s=wait, tag=tag_filter)
                if not batch:
                    return
                if not no_ack:
                    try:
                        await client.ack(group, topic, batch)
                    except BaseException:
                        got.extend((m, False) for m in batch)
                        raise
                got.extend((m, not no_ack) for m in batch)
                advance(len(batch))
                if count is None:
                    return

    try:
        # A bar only with --count (several requests until that many arrived).
        with progress_bar(f"receiving {topic} for {group}", count, as_json or count is None) as advance:
            call(endpoint, timeout, work(advance))
    except SystemExit:  # a later request failed: still show what arrived (and whether it was acked)
        if got:
            _print_received(got, group, topic, invisible, wait, as_json)
        raise
    _print_received(got, group, topic, invisible, wait, as_json)


def _print_received(got: list, group: str, topic: str, invisible: float, wait: float, as_json: bool) -> None:
    if as_json:
        print_json([_message_json(m, acked) for m, acked in got])
        return
    if not got:
        click.echo(f"no messages for {group} on {topic} (waited {wait:g} s)")
        return
    print_table(None, ["MESSAGE ID", "QUEUE", "OFFSET", "ATTEMPT", "TAG", "KEYS", "BODY"],
                 [[m.message_id, m.queue_id, m.queue_offset, m.delivery_attempt, m.tag, ", ".join(m.keys),
                   _body_preview(m.body)] for m, _ in got], right=("QUEUE", "OFFSET", "ATTEMPT"),
                 wrap=("TAG", "KEYS", "BODY"), optional=("KEYS", "ATTEMPT", "QUEUE", "OFFSET", "TAG"))
    acked = sum(1 for _, a in got if a)
    if acked == len(got):
        click.echo(f"received and acknowledged {plural(len(got), 'message')}")
    else:
        click.echo(f"received {plural(len(got), 'message')}, acknowledged {acked:,}; the others become visible again "
                   f"{invisible:g} s after they were received")
