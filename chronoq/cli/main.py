"""The ``chronoq`` command line: ``serve`` runs the broker; the rest talk to one over gRPC.

``topic`` and ``group`` use chronoq's own ``chronoq.v1.Admin`` service; ``send`` and ``receive``
use ``apache.rocketmq.v2.MessagingService`` through ``chronoq.client.client``. Every remote command takes
``--endpoint`` (env ``CHRONOQ_ENDPOINT``), ``--timeout`` and ``--json``, prints a table for people
or one JSON document for scripts, and exits with a documented status (docs/cli.md):

    0  done
    1  the broker refused the request (bad name, unknown group, ...); stderr names the code
    2  bad usage, caught before anything was sent (click's own status)
    3  no answer: the broker is unreachable, timed out, or is not chronoq
    4  ``message recall``/``reschedule``: answered, but the message was not changed
       (already delivered, already cancelled, or not found); the outcome says which.
       ``message show``: nothing with that id or key in the windows searched
    5  ``audit`` only: the audit found early deliveries or lost messages

Names and values are checked by the broker, the one authority on them; the CLI checks only what
it must parse itself (endpoint, ``k=v`` properties, the body source).
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import sys
import time

import click

from chronoq.core import errors
from chronoq.core.config import load_config

DEFAULT_ENDPOINT = "127.0.0.1:8081"
EXIT_REFUSED = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NOT_DONE = 4           # answered definitely, but nothing changed (already delivered, not found)
RECEIVE_MAX_MESSAGES = 32   # per request (the protocol's batch limit)
LONG_POLL_MAX_S = 60.0      # the broker parks a receive at most this long
SEND_BATCH_DEFAULT = 100
SEND_BATCH_MAX = 1024       # messages per SendMessage request the broker accepts
BODY_PREVIEW_CHARS = 60     # body column of the receive table
TABLE_WIDTH_PIPED = 400     # table width limit when stdout is not a terminal


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="chronoq")
def main() -> None:
    """chronoq: a durable broker for delayed and scheduled messages."""


@main.command()
@click.option("--data-dir", type=click.Path(file_okay=False), default=None,
              help="Where data lives. Default ./chronoq-data (env CHRONOQ_DATA_DIR).")
@click.option("--port", type=int, default=None, help="gRPC port. Default 8081 (env CHRONOQ_PORT).")
@click.option("--host", default=None, help="Address to bind. Default 127.0.0.1 (env CHRONOQ_HOST).")
@click.option("--http-port", default=None,
              help="HTTP port (/metrics, console). Default 8082; 0: any free port; off: none "
                   "(env CHRONOQ_HTTP_PORT).")
@click.option("--http-host", default=None, help="Address the HTTP listener binds. Default 127.0.0.1 "
                                                "(env CHRONOQ_HTTP_HOST).")
@click.option("--config", "config_file", type=click.Path(dir_okay=False), default=None,
              help="TOML config file (see docs/configuration.md).")
@click.option("--flush-policy", type=click.Choice(["sync", "async"]), default=None,
              help="sync (default): fsync before acknowledging; async: fsync every flush_interval_ms.")
@click.option("--quarantine", is_flag=True, default=None,
              help="On corruption in a sealed segment or mid-log, copy the damaged bytes to "
                   "quarantine/, mark them lost and start anyway (default: refuse to start).")
@click.option("--log-level", default=None, help="debug, info (default), warning, error.")
def serve(data_dir, port, host, http_port, http_host, config_file, flush_policy, quarantine, log_level) -> None:
    """Run the broker until SIGTERM or SIGINT."""
    try:
        cfg = load_config(config_file, overrides={
            "data_dir": data_dir, "port": port, "host": host, "http_port": http_port, "http_host": http_host,
            "flush_policy": flush_policy,
            "quarantine": quarantine, "log_level": log_level,
        })
    except errors.ChronoqError as exc:
        raise click.UsageError(exc.message) from None
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from chronoq.server.runtime import run

    try:
        run(cfg)
    except errors.CorruptionError as exc:
        click.echo(f"chronoq: cannot start: {exc.message}", err=True)
        sys.exit(2)
    except errors.ChronoqError as exc:
        click.echo(f"chronoq: cannot start: {exc.message}", err=True)
        sys.exit(1)


# ----------------------------------------------------------------------------- remote plumbing
def _check_endpoint(ctx, param, value: str) -> str:
    host, sep, port = value.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise click.BadParameter(f"{value!r} is not host:port (e.g. {DEFAULT_ENDPOINT})")
    return value


def _keep_connection_option(ctx, param, value):
    """Connection settings (credentials, TLS) go to ``ctx.meta``, not to every command's arguments."""
    ctx.meta[f"chronoq.{param.name}"] = value
    return value


def _connection() -> dict:
    """Keyword arguments for ``Client``/``AdminClient``: credentials and TLS of this invocation."""
    meta = click.get_current_context().meta
    return {"access_key": meta.get("chronoq.access_key") or "", "secret_key": meta.get("chronoq.secret_key") or "",
            "tls": bool(meta.get("chronoq.tls")), "tls_ca_file": meta.get("chronoq.tls_ca_file") or ""}


def _remote(fn):
    """The options every command that talks to a broker takes."""
    fn = click.option("--tls-ca-file", envvar="CHRONOQ_TLS_CA_FILE", type=click.Path(dir_okay=False, exists=True),
                      default=None, expose_value=False, callback=_keep_connection_option,
                      help="PEM certificates to trust for TLS (implies --tls; env CHRONOQ_TLS_CA_FILE). "
                           "Default: the system's roots.")(fn)
    fn = click.option("--tls", is_flag=True, envvar="CHRONOQ_TLS", default=False, expose_value=False,
                      callback=_keep_connection_option, help="Connect over TLS (env CHRONOQ_TLS=1).")(fn)
    fn = click.option("--secret-key", envvar="CHRONOQ_SECRET_KEY", default=None, expose_value=False,
                      callback=_keep_connection_option,
                      help="Secret key to sign requests with (prefer the env CHRONOQ_SECRET_KEY: a flag "
                           "shows in the process list).")(fn)
    fn = click.option("--access-key", envvar="CHRONOQ_ACCESS_KEY", default=None, expose_value=False,
                      callback=_keep_connection_option,
                      help="Access key, when the broker has access control on (env CHRONOQ_ACCESS_KEY).")(fn)
    fn = click.option("--json", "as_json", is_flag=True, help="Print one JSON document (for scripts).")(fn)
    fn = click.option("--timeout", type=click.FloatRange(min=0.1), default=10.0, show_default=True,
                      help="Seconds to wait for each answer.")(fn)
    fn = click.option("--endpoint", envvar="CHRONOQ_ENDPOINT", default=DEFAULT_ENDPOINT, show_default=True,
                      callback=_check_endpoint, help="host:port of the broker (env CHRONOQ_ENDPOINT).")(fn)
    return fn


def _fail(message: str, exit_code: int):
    click.echo(f"chronoq: error: {message}", err=True)
    sys.exit(exit_code)


def _code_name(code: int) -> str:
    from rocketmq.grpc_protocol import definition_pb2

    return definition_pb2.Code.Name(code) if code in definition_pb2.Code.values() else str(code)


def _transport_message(endpoint: str, timeout_s: float, exc) -> str:
    import grpc

    code, details = exc.code(), (exc.details() or "").strip()
    if code == grpc.StatusCode.UNAVAILABLE:
        return (f"cannot reach a broker at {endpoint} ({details}). Is `chronoq serve` running there? "
                "Set --endpoint or CHRONOQ_ENDPOINT.")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {endpoint} within {timeout_s:g} s (raise --timeout if the broker is busy)"
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return (f"the server at {endpoint} does not offer this call ({details}); is it chronoq? "
                "(a RocketMQ proxy has no chronoq.v1.Admin service)")
    return f"{code.name} from {endpoint}: {details}"


def _call(endpoint: str, timeout_s: float, work):
    """Run the coroutine ``work``; a failure becomes one line on stderr and an exit status."""
    import grpc

    from chronoq.client.client import ClientError, run

    try:
        return run(work)
    except ClientError as exc:
        _fail(f"{_code_name(exc.code)}: {exc.status_message}", EXIT_REFUSED)
    except grpc.aio.AioRpcError as exc:
        _fail(_transport_message(endpoint, timeout_s, exc), EXIT_UNREACHABLE)
    except KeyboardInterrupt:
        _fail("interrupted", 130)


def _print_json(value) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def _print_table(title: str | None, columns: list[str], rows: list[list], *, right: tuple[str, ...] = (),
                 wrap: tuple[str, ...] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold")
    for name in columns:
        # Names and ids are printed whole (no wrapping, so they can be copied); free text folds.
        table.add_column(name, justify="right" if name in right else "left", overflow="fold",
                         no_wrap=name not in wrap)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console = Console()
    if not console.is_terminal:  # piped: no terminal width to respect, so never cut a row
        console = Console(width=TABLE_WIDTH_PIPED)
    console.print(table)


@contextlib.contextmanager
def _progress(description: str, total: int | None, hidden: bool):
    """A rich progress bar for long work, shown only to a person: stdout is a terminal and not
    ``hidden`` (--json, or work too short for one; scripts and pipes get nothing extra). Yields ``advance(n)``; ``total`` None: a
    spinner with the elapsed time (work whose size is unknown). The bar is removed when done,
    so the command's own output follows as usual."""
    if hidden or not sys.stdout.isatty():
        yield lambda n=1: None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    columns = ([TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
               if total is not None else [SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()])
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)


def _admin(endpoint: str, timeout_s: float, method: str, *args, **kwargs):
    """Call one ``AdminClient`` method against ``endpoint``."""
    from chronoq.client.client import AdminClient

    async def work():
        async with AdminClient(endpoint, request_timeout_s=timeout_s, **_connection()) as admin:
            return await getattr(admin, method)(*args, **kwargs)

    return _call(endpoint, timeout_s, work())


# ----------------------------------------------------------------------------- topic
TOPIC_TYPES = ("mixed", "normal", "fifo", "delay", "transaction")


def _topic_json(t) -> dict:
    return {"name": t.name, "queues": t.queues, "message_type": t.message_type}


def _topic_rows(topics) -> list[list]:
    return [[t.name, t.queues, t.message_type] for t in topics]


@main.group()
def topic() -> None:
    """Create and list topics."""


@topic.command("create")
@click.argument("name")
@click.option("--queues", type=click.IntRange(min=1), default=None,
              help="Queue count (can only grow). Default: the broker's default_queues; an existing "
                   "topic keeps its count.")
@click.option("--type", "message_type", type=click.Choice(TOPIC_TYPES, case_sensitive=False), default=None,
              help="Message types the topic accepts. Default mixed (every type); an existing topic "
                   "keeps its type.")
@_remote
def topic_create(name, queues, message_type, endpoint, timeout, as_json) -> None:
    """Create topic NAME, or grow its queues / change its type. Idempotent."""
    t = _admin(endpoint, timeout, "create_topic", name, queues or 0, (message_type or "").lower())
    if as_json:
        _print_json(_topic_json(t))
    else:
        _print_table(f"topic {t.name} ready", ["TOPIC", "QUEUES", "TYPE"], _topic_rows([t]), right=("QUEUES",))


@topic.command("list")
@click.option("--system", is_flag=True, help="Include the broker's own topics (%RETRY%, %DLQ%, ...).")
@_remote
def topic_list(system, endpoint, timeout, as_json) -> None:
    """List topics with their queue count and message type."""
    topics = _admin(endpoint, timeout, "list_topics", system)
    if as_json:
        _print_json([_topic_json(t) for t in topics])
    elif not topics:
        click.echo("no topics")
    else:
        _print_table(None, ["TOPIC", "QUEUES", "TYPE"], _topic_rows(topics), right=("QUEUES",))


# ----------------------------------------------------------------------------- group
def _group_json(g) -> dict:
    return {"name": g.name, "fifo": g.fifo, "max_attempts": g.max_attempts}


@main.group()
def group() -> None:
    """Create and list consumer groups (with lag)."""


@group.command("create")
@click.argument("name")
@click.option("--fifo/--no-fifo", default=None,
              help="FIFO group: a message group's next message waits until the previous one is acked. "
                   "Default: off for a new group; unchanged for an existing one.")
@click.option("--max-attempts", type=int, default=None,
              help="Deliveries before a message goes to %DLQ%<group> (1-1000). Default 17 for a new "
                   "group; unchanged for an existing one.")
@_remote
def group_create(name, fifo, max_attempts, endpoint, timeout, as_json) -> None:
    """Create consumer group NAME, or change its settings."""
    g = _admin(endpoint, timeout, "create_group", name, fifo=fifo, max_attempts=max_attempts)
    if as_json:
        _print_json(_group_json(g))
    else:
        _print_table(f"group {g.name} ready", ["GROUP", "FIFO", "MAX ATTEMPTS"],
                     [[g.name, "yes" if g.fifo else "no", g.max_attempts]], right=("MAX ATTEMPTS",))


@group.command("list")
@click.option("--group", "only_group", default="", help="Only this group.")
@click.option("--topic", "only_topic", default="",
              help="Lag on this topic for every listed group, even one that has not received from it yet.")
@_remote
def group_list(only_group, only_topic, endpoint, timeout, as_json) -> None:
    """List consumer groups: per topic consumed, the lag (not yet received) and in-flight count."""
    rows = _admin(endpoint, timeout, "list_groups", only_group, only_topic)
    if as_json:
        _print_json([dict(_group_json(r.group), topic=r.topic or None, lag=r.lag, inflight=r.inflight)
                     for r in rows])
    elif not rows:
        click.echo("no consumer groups")
    else:
        _print_table(None, ["GROUP", "FIFO", "MAX ATTEMPTS", "TOPIC", "LAG", "IN FLIGHT"],
                     [[r.group.name, "yes" if r.group.fifo else "no", r.group.max_attempts, r.topic or "-",
                       r.lag, r.inflight] for r in rows], right=("MAX ATTEMPTS", "LAG", "IN FLIGHT"))


# ----------------------------------------------------------------------------- send
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


@main.command()
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
@click.option("--delay", type=click.FloatRange(min=0), default=None,
              help="Deliver this many seconds from now (a delay message; its recall handle is printed).")
@click.option("--count", type=click.IntRange(min=1), default=1, show_default=True,
              help="Send the body this many times (bulk), in batches.")
@click.option("--batch-size", type=click.IntRange(1, SEND_BATCH_MAX), default=SEND_BATCH_DEFAULT,
              show_default=True, help="Messages per SendMessage request with --count.")
@_remote
def send(topic, body, file, tag, keys, properties, message_group, delay, count, batch_size,
         endpoint, timeout, as_json) -> None:
    """Send a message to TOPIC. The body is BODY, --file FILE, or stdin."""
    props = _parse_properties(properties)
    if message_group is not None and delay is not None:
        raise click.UsageError("--group (FIFO) and --delay cannot be combined: a message has one type")
    data = _read_body(body, file)
    from chronoq.client.client import Client, OutgoingMessage

    receipts: list = []

    async def work(advance):
        async with Client(endpoint, request_timeout_s=timeout, **_connection()) as client:
            left = count
            while left:
                n = min(left, batch_size)
                deliver_at_ms = None if delay is None else int(time.time() * 1000 + delay * 1000)
                batch = [OutgoingMessage(topic, data, tag=tag, keys=keys, properties=props,
                                         message_group=message_group, deliver_at_ms=deliver_at_ms)
                         for _ in range(n)]
                receipts.extend(await client.send_batch(batch))
                advance(n)
                left -= n

    started = time.monotonic()
    try:
        # A bar only for bulk sends of more than one request (one request is over at once).
        with _progress(f"sending to {topic}", count, as_json or count <= batch_size) as advance:
            _call(endpoint, timeout, work(advance))
    finally:
        if receipts and len(receipts) < count:  # a later batch failed: say what is stored
            click.echo(f"chronoq: {len(receipts)} of {count} messages were sent before the error", err=True)
    elapsed_s = time.monotonic() - started
    if as_json:
        _print_json({"topic": topic, "sent": len(receipts), "elapsed_s": round(elapsed_s, 3), "messages": [
            {"message_id": r.message_id, "offset": r.offset, "recall_handle": r.recall_handle or None}
            for r in receipts]})
        return
    if count == 1:
        r = receipts[0]
        columns, row = ["TOPIC", "MESSAGE ID", "OFFSET"], [topic, r.message_id, r.offset]
        if r.recall_handle:
            columns.append("RECALL HANDLE")
            row.append(r.recall_handle)
        _print_table(None, columns, [row], right=("OFFSET",))
    else:
        rate = len(receipts) / elapsed_s if elapsed_s > 0 else float("inf")
        click.echo(f"sent {len(receipts)} messages to {topic} in {elapsed_s:.2f} s ({rate:,.0f} msg/s)")


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
        return f"<{len(body)} bytes, not UTF-8>"
    text = text.replace("\n", "\\n")
    return text if len(text) <= BODY_PREVIEW_CHARS else text[:BODY_PREVIEW_CHARS - 1] + "…"


@main.command()
@click.argument("group")
@click.argument("topic")
@click.option("--max", "max_messages", type=click.IntRange(1, RECEIVE_MAX_MESSAGES), default=16,
              show_default=True, help="Messages per receive request.")
@click.option("--count", type=click.IntRange(min=1), default=None,
              help="Keep receiving until this many messages arrived, or a receive waited --wait "
                   "seconds for nothing. Default: one receive request.")
@click.option("--invisible", type=float, default=30.0, show_default=True,
              help="Seconds a received message stays invisible to other consumers (at least 1).")
@click.option("--wait", type=click.FloatRange(0, LONG_POLL_MAX_S), default=5.0, show_default=True,
              help="Seconds to wait (long poll) when no message is ready.")
@click.option("--tag", "tag_filter", default="*", show_default=True,
              help="Tag filter: '*', a tag, or tags joined by '||'.")
@click.option("--no-ack", is_flag=True,
              help="Do not acknowledge: the messages come back after --invisible seconds.")
@_remote
def receive(group, topic, max_messages, count, invisible, wait, tag_filter, no_ack,
            endpoint, timeout, as_json) -> None:
    """Receive (POP) messages of TOPIC for consumer GROUP, print and acknowledge them."""
    from chronoq.client.client import Client

    got: list[tuple[object, bool]] = []

    async def work(advance):
        async with Client(endpoint, request_timeout_s=timeout, **_connection()) as client:
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
        with _progress(f"receiving {topic} for {group}", count, as_json or count is None) as advance:
            _call(endpoint, timeout, work(advance))
    except SystemExit:  # a later request failed: still show what arrived (and whether it was acked)
        if got:
            _print_received(got, group, topic, invisible, wait, as_json)
        raise
    _print_received(got, group, topic, invisible, wait, as_json)


def _print_received(got: list, group: str, topic: str, invisible: float, wait: float, as_json: bool) -> None:
    if as_json:
        _print_json([_message_json(m, acked) for m, acked in got])
        return
    if not got:
        click.echo(f"no messages for {group} on {topic} (waited {wait:g} s)")
        return
    _print_table(None, ["MESSAGE ID", "QUEUE", "OFFSET", "ATTEMPT", "TAG", "KEYS", "BODY"],
                 [[m.message_id, m.queue_id, m.queue_offset, m.delivery_attempt, m.tag, " ".join(m.keys),
                   _body_preview(m.body)] for m, _ in got], right=("QUEUE", "OFFSET", "ATTEMPT"),
                 wrap=("TAG", "KEYS", "BODY"))
    acked = sum(1 for _, a in got if a)
    if acked == len(got):
        click.echo(f"received and acknowledged {len(got)} messages")
    else:
        click.echo(f"received {len(got)} messages, acknowledged {acked}; the others become visible again "
                   f"{invisible:g} s after they were received")


# ----------------------------------------------------------------------------- timers
TIMERS_MINUTES_MAX = 10_080  # a week (the broker's limit)
BAR_WIDTH = 40              # characters of the longest bar in the text histograms


def _iso_ms(ms: int | None) -> str | None:
    """Epoch ms as an ISO 8601 UTC time with milliseconds, for people."""
    if not ms:
        return None
    import datetime

    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


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


def _bars(rows: list[tuple[str, int]]) -> None:
    """A text histogram: label, bar scaled to the largest count, count."""
    top = max((count for _, count in rows), default=0)
    width = max((len(label) for label, _ in rows), default=0)
    for label, count in rows:
        bar = "#" * (round(count * BAR_WIDTH / top) if top else 0)
        if count and not bar:
            bar = "."  # some, but less than one character's worth
        click.echo(f"  {label.rjust(width)} | {bar.ljust(BAR_WIDTH)} {count:,}")


def _duration_text(ms: int) -> str:
    from chronoq.timer.levels import format_duration

    return format_duration(ms)


def _print_timers(st, minutes: int) -> None:
    h = st.lateness
    click.echo(f"timer clock {_iso_ms(st.now_ms)}; buckets of {_duration_text(st.bucket_ms)}; "
               f"{st.wheel_entries:,} timers in memory, {st.buckets_on_disk:,} buckets waiting on disk; "
               f"cursor {st.cursor:,}")
    lane = st.timer_lane
    _print_table(None, ["LANE", "DELIVERED", "IN FLIGHT", "BACKLOG", "NEXT DUE", "STATE"],
                 [["timer (deliver_at)", lane.delivered, lane.pending, sum(b.pending for b in st.due_by_bucket)
                   + st.overdue_pending, None, _lane_state(lane)]] +
                 [[f"level {lv.level} ({_duration_text(lv.delay_ms)})", lv.lane.delivered, lv.lane.pending,
                   lv.backlog, _iso_ms(lv.head_due_ms) if lv.backlog else None, _lane_state(lv.lane)]
                  for lv in st.levels],
                 right=("DELIVERED", "IN FLIGHT", "BACKLOG"), wrap=("STATE",))
    click.echo("(timer backlog: within the next %d minutes, plus %d overdue)" % (minutes, st.overdue_pending))
    click.echo("")
    if h.count:
        click.echo(f"lateness (visible - due) of {h.count:,} deliveries: p50 <= {h.p50_ms} ms, p99 <= {h.p99_ms} ms, "
                   f"p99.9 <= {h.p999_ms} ms, max {h.max_ms} ms, early {h.early}")
        rows = []
        prev = None
        for b in h.buckets:
            label = f"> {prev} ms" if b.le_ms < 0 else ("0 ms" if b.le_ms == 0 else f"<= {b.le_ms} ms")
            rows.append((label, b.count))
            prev = b.le_ms
        while rows and rows[-1][1] == 0:  # no empty tail rows
            rows.pop()
        _bars(rows)
    else:
        click.echo("lateness: nothing delivered since the broker started")
    click.echo("")
    per_minute = _by_minute(st.due_by_bucket)
    click.echo(f"timer messages due per minute, next {minutes} minutes "
               f"({sum(m['pending'] for m in per_minute):,} pending; overdue now: {st.overdue_pending:,}):")
    _bars([(_iso_ms(m["start_ms"])[11:16] + "Z", m["pending"]) for m in per_minute])
    for note in st.notes:
        click.echo(f"note: {note}")


@main.command()
@click.option("--minutes", type=click.IntRange(1, TIMERS_MINUTES_MAX), default=10, show_default=True,
              help="How far ahead to count pending timer messages per minute.")
@_remote
def timers(minutes, endpoint, timeout, as_json) -> None:
    """Delayed delivery: lateness histogram, what fires per minute, backlog per delay level."""
    st = _admin(endpoint, timeout, "timer_stats", minutes)
    if as_json:
        _print_json(_timers_json(st))
    else:
        _print_timers(st, minutes)


# ----------------------------------------------------------------------------- stats
def _stats_json(st) -> dict:
    out = {name: getattr(st, name) for name in STATS_FIELDS}
    for key in ("lateness_p50_ms", "lateness_p99_ms"):
        out[key] = None if out[key] < 0 else out[key]
    out["pending_by_horizon"] = {h.horizon: h.pending for h in st.pending_by_horizon}
    return out


STATS_FIELDS = ("topics", "groups", "messages_stored", "in_flight", "dlq", "pending_timers", "commitlog_bytes",
                "commitlog_segments", "lateness_count", "lateness_p50_ms", "lateness_p99_ms", "messages_sent",
                "messages_received", "messages_acked", "messages_dead_lettered")


def _size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def _print_stats(st) -> None:
    due = ", ".join(f"{h.horizon}: {h.pending:,}" for h in st.pending_by_horizon if h.horizon != "inf")
    lateness = "none measured yet" if st.lateness_count == 0 else \
        f"p50 {st.lateness_p50_ms:,} ms, p99 {st.lateness_p99_ms:,} ms ({st.lateness_count:,} deliveries)"
    rows = [
        ["topics", f"{st.topics:,}"], ["consumer groups", f"{st.groups:,}"],
        ["messages stored", f"{st.messages_stored:,}"], ["in flight", f"{st.in_flight:,}"],
        ["dead-lettered (stored)", f"{st.dlq:,}"],
        ["pending timers", f"{st.pending_timers:,}" + (f" (due within {due})" if st.pending_timers else "")],
        ["timer lateness", lateness],
        ["commit log", f"{_size_text(st.commitlog_bytes)} in {st.commitlog_segments:,} segment(s)"],
        ["since start", f"{st.messages_sent:,} sent, {st.messages_received:,} received, "
                        f"{st.messages_acked:,} acked, {st.messages_dead_lettered:,} dead-lettered"],
    ]
    _print_table("broker overview", ["WHAT", "VALUE"], rows, wrap=("VALUE",))


@main.command()
@_remote
def stats(endpoint, timeout, as_json) -> None:
    """Broker overview: topics, groups, stored, in flight, DLQ, pending timers, commit log, lateness."""
    st = _admin(endpoint, timeout, "stats")
    if as_json:
        _print_json(_stats_json(st))
    else:
        _print_stats(st)


# ----------------------------------------------------------------------------- message
@main.group()
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
        _print_json(_outcome_json(r, new_handle))
    else:
        columns = ["OUTCOME", "TOPIC", "MESSAGE ID", "DUE", "DETAIL"]
        row = [r.outcome, r.topic, r.message_id, _iso_ms(r.deliver_at_ms), r.detail]
        if new_handle and r.recall_handle:
            columns.append("NEW RECALL HANDLE")
            row.append(r.recall_handle)
        _print_table(None, columns, [row], wrap=("DETAIL",))
    if r.outcome != done:
        sys.exit(EXIT_NOT_DONE)


@message.command("recall")
@click.argument("handle")
@_remote
def message_recall(handle, endpoint, timeout, as_json) -> None:
    """Cancel the delayed message HANDLE (the recall handle its send returned).

    Exit 0 when it is cancelled (also when it already was), 4 when it was already delivered
    or no pending message matches the handle.
    """
    r = _admin(endpoint, timeout, "recall", handle)
    _print_outcome(r, as_json, "cancelled")


def _parse_at(text: str) -> int:
    """Epoch milliseconds, or an ISO 8601 time (without an offset: this machine's local time)."""
    import datetime

    value = text.strip()
    if value.isascii() and value.isdigit():
        return int(value)
    try:
        when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00") if value.endswith("Z") else value)
    except ValueError:
        raise click.BadParameter(f"{text!r} is neither epoch milliseconds nor an ISO 8601 time "
                                 "(e.g. 2030-01-31T09:00:00Z)", param_hint="--at") from None
    return int(when.timestamp() * 1000)


@message.command("reschedule")
@click.argument("handle")
@click.option("--at", "at", default=None, metavar="TIME",
              help="New delivery time: epoch milliseconds or ISO 8601 (e.g. 2030-01-31T09:00:00Z; "
                   "without an offset, this machine's local time).")
@click.option("--in", "in_s", type=click.FloatRange(min=0), default=None, metavar="SECONDS",
              help="New delivery time, this many seconds from now.")
@_remote
def message_reschedule(handle, at, in_s, endpoint, timeout, as_json) -> None:
    """Move the delayed message HANDLE to a new delivery time; prints its new recall handle.

    Exit 0 when it was moved, 4 when it was already delivered, cancelled, or no pending message
    matches the handle (then nothing changed).
    """
    if (at is None) == (in_s is None):
        raise click.UsageError("give the new time with exactly one of --at or --in")
    deliver_at_ms = _parse_at(at) if at is not None else int(time.time() * 1000 + in_s * 1000)
    r = _admin(endpoint, timeout, "reschedule", handle, deliver_at_ms)
    _print_outcome(r, as_json, "rescheduled", new_handle=True)


@message.command("show")
@click.argument("query", metavar="ID_OR_KEY")
@click.option("--scan-mib", type=click.IntRange(min=1), default=None,
              help="Newest MiB of the commit log to search (at most 1024). Default: the broker's [console] "
                   "lookup_scan_mib (32).")
@click.option("--trace-mib", type=click.IntRange(min=1), default=None,
              help="Newest MiB of the message trace to read (at most 4096). Default: the broker's [console] "
                   "trace_scan_mib (64).")
@_remote
def message_show(query, scan_mib, trace_mib, endpoint, timeout, as_json) -> None:
    """The life of the message with id or key ID_OR_KEY: stored, due, visible, each delivery
    attempt, ack or dead letter; and its records in the commit log (the console's lookup page).

    Searches only the newest part of the log and trace (see --scan-mib, --trace-mib). Exit 0 when
    found, 4 when nothing there has that id or key.
    """
    from rocketmq.grpc_protocol.definition_pb2 import Code

    from chronoq.client.client import AdminClient, ClientError

    async def work():
        async with AdminClient(endpoint, request_timeout_s=timeout, **_connection()) as admin:
            try:
                return await admin.lookup_message(query, scan_mib or 0, trace_mib or 0)
            except ClientError as exc:
                if exc.code != Code.NOT_FOUND:  # the broker's answer for "nothing in the windows"
                    raise
                return exc  # a definite answer, not a failure of the call

    answer = _call(endpoint, timeout, work())
    if isinstance(answer, ClientError):
        if as_json:
            _print_json({"query": query, "found": False, "detail": answer.status_message, "messages": []})
        click.echo(f"chronoq: not found: {answer.status_message}", err=True)
        sys.exit(EXIT_NOT_DONE)
    if as_json:
        _print_json(_lookup_json(query, answer))
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
        return f"due {_iso_ms(e.due_ms)}" if e.delayed else "visible at once"
    if e.kind in ("visible", "recalled", "rescheduled"):
        late = f", {e.ts_ms - e.due_ms:,} ms late" if e.kind == "visible" else ""
        return f"due {_iso_ms(e.due_ms)}{late}"
    if e.ref_topic:
        return f"{e.ref_topic}/{e.ref_queue}@{e.ref_offset}"
    return ""


def _record_place(r) -> str:
    """topic/queue@offset; a timer message's scheduled record sits in no queue yet (no offset)."""
    from chronoq.timer.levels import DELAY_TOPIC

    if r.kind == "scheduled" and r.topic != DELAY_TOPIC:
        return f"{r.topic}/{r.queue_id}"
    return f"{r.topic}/{r.queue_id}@{r.queue_offset}"


def _print_lookup(a) -> None:
    if a.damage:
        click.echo(f"warning: {a.damage}")
    if not a.trace_enabled:
        click.echo("note: the broker records no message trace (trace_enabled = false): only records are shown")
    elif a.trace_dropped:
        click.echo(f"note: the trace buffer dropped {a.trace_dropped:,} events since start: a life may be incomplete")
    for m in a.messages:
        click.echo(f"message {m.message_id} in {m.topic}: {m.status}")
        _print_table("life", ["TIME (UTC)", "EVENT", "GROUP", "ATTEMPT", "DETAIL"],
                     [[_iso_ms(e.ts_ms), e.kind, e.group, e.attempt or None, _event_detail(e)] for e in m.events]
                     or [["-", "no trace events in the window read", None, None, None]],
                     right=("ATTEMPT",), wrap=("DETAIL",))
        _print_table("records in the commit log", ["WHAT", "TOPIC/QUEUE@OFFSET", "COMMIT OFFSET", "STORED (UTC)",
                                                   "DUE (UTC)", "KEYS", "BODY", "RECALL HANDLE"],
                     [[r.kind, _record_place(r), r.commit_offset, _iso_ms(r.stored_ms),
                       _iso_ms(r.deliver_at_ms), " ".join(r.keys), f"{r.body_bytes:,} B", r.recall_handle or None]
                      for r in m.records] or [["-", "no record in the scanned part of the log"] + [None] * 6],
                     right=("COMMIT OFFSET", "BODY"), wrap=("KEYS",))
        click.echo("")
    click.echo(f"searched commit-log offsets {a.scanned_from:,} to {a.scanned_to:,}"
               + (" (stopped at 200 matching records)" if a.truncated else "")
               + f" and {_size_text(a.trace_bytes_read)} of the message trace")


# ----------------------------------------------------------------------------- audit (Spark)
EXIT_AUDIT_PROBLEM = 5      # the audit found early deliveries or lost messages


def _audit_json(result) -> dict:
    rows = [{**r, "hour": r["hour"].strftime("%Y-%m-%dT%H:00:00Z") if r["hour"] else None} for r in result.rows]
    return {"ok": result.ok, "at_ms": result.now_ms, "grace_ms": result.grace_ms,
            "dropped_trace_events": result.dropped_events, "totals": result.totals, "rows": rows}


@main.command()
@click.option("--topic", "topics", multiple=True,
              help="Only this topic; repeat for several. Default: every topic in the trace.")
@click.option("--grace", type=click.FloatRange(min=0), default=60.0, show_default=True,
              help="Seconds after its due time from which a delayed message never made visible counts as lost.")
@click.option("--html", "html_path", default="chronoq-audit.html", show_default=True,
              help="Where to write the HTML report with the lateness plot ('' for none).")
@click.option("--master", default="local[*]", show_default=True,
              help="Spark master for the job (an active SparkSession in this process is used as it is).")
@_remote
def audit(topics, grace, html_path, master, endpoint, timeout, as_json) -> None:
    """Delivery audit: a PySpark job over the broker's message life trace (docs/spark.md).

    Per topic and hour of due time: sent, visible, delivered, acked, dead-lettered, recalled,
    early (must be 0), lost (delayed, past due + --grace, never visible), waiting; lateness
    (visible - due) p50/p99/max. Prints a table (or --json) and writes an HTML report.
    Exit 0 when nothing was early or lost, 5 when something was.
    """
    try:
        from pyspark.sql import SparkSession

        from chronoq.spark import audit as job
        from chronoq.spark.rpc import BrokerError
        from chronoq.spark.session import local_session
    except ImportError as exc:
        _fail(f"the audit needs the spark extra (pip install 'chronoq[spark]' and Java 17): {exc}", EXIT_USAGE)
    owned = SparkSession.getActiveSession() is None
    with _progress("starting Spark", None, as_json):
        spark = local_session(master, app="chronoq-audit")
    try:
        # The Spark job's size is unknown up front: a spinner with the elapsed time.
        with _progress("auditing the message trace with Spark", None, as_json):
            result = job.run(spark, endpoint, list(topics), grace, **_connection())
        if html_path:
            job.write_html(result, html_path)
    except BrokerError as exc:
        _fail(str(exc), EXIT_UNREACHABLE if exc.code == -1 else EXIT_REFUSED)
    finally:
        if owned:
            spark.stop()
    if as_json:
        _print_json(_audit_json(result))
    else:
        _print_table("chronoq delivery audit", job.TABLE_COLUMNS, job.table_rows(result),
                     right=tuple(job.TABLE_COLUMNS[2:]))
        t = result.totals
        click.echo(("OK: no early delivery, no lost message" if result.ok else
                    f"PROBLEM: {t['early']} early, {t['lost']} lost")
                   + (f"; report: {html_path}" if html_path else ""))
    if not result.ok:
        sys.exit(EXIT_AUDIT_PROBLEM)
