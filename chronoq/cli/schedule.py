"""``chronoq schedule``: recurring schedules (create, list, show, pause, resume, delete).

Each verb is one ``chronoq.v1.Admin`` call (admins only when access control is on); the broker
checks every field (docs/timers.md, "Recurring schedules")."""

from __future__ import annotations

import click

from chronoq.cli.params import Seconds
from chronoq.cli.remote import admin_call, remote_options
from chronoq.cli.render import iso_ms, print_json, print_table


@click.group()
def schedule() -> None:
    """Recurring schedules: a message into a topic on a cron expression or an interval, in a time zone."""


def _json(s) -> dict:
    return {"name": s.name, "topic": s.topic, "cron": s.cron or None, "interval_ms": s.interval_ms or None,
            "time_zone": s.time_zone, "start_ms": s.start_ms or None, "end_ms": s.end_ms or None,
            "catch_up": s.catch_up, "paused": s.paused, "created_ms": s.created_ms, "cursor_ms": s.cursor_ms,
            "pending": s.pending, "next_ms": list(s.next_ms), "tag": s.tag or None, "keys": list(s.keys),
            "properties": dict(s.properties), "body_bytes": len(s.body), "refusal": s.refusal or None}


def _when(s) -> str:
    return s.cron if s.cron else f"every {s.interval_ms / 1000:g} s"


def _show(rows, as_json: bool, title: str | None = None) -> None:
    if as_json:
        print_json([_json(s) for s in rows] if title is None else _json(rows[0]))
        return
    print_table(title, ["NAME", "TOPIC", "WHEN", "ZONE", "CATCH-UP", "STATE", "NEXT FIRINGS"],
                [[s.name, s.topic, _when(s), s.time_zone, s.catch_up,
                  "paused" if s.paused else f"refused: {s.refusal}" if s.refusal else "active",
                  " ".join(iso_ms(t) for t in s.next_ms) or "-"] for s in rows], wrap=("STATE", "NEXT FIRINGS"))


def _parse_ms(text: str | None, hint: str, tz: str | None = None) -> int:
    """A time option: epoch ms, or ISO 8601 (without an offset: a wall-clock time in ``tz``, for
    a schedule's --start/--end the zone its cron expression is read in; else this machine's)."""
    if not text:
        return 0
    from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

    from chronoq.cli.message import _parse_at

    zone = None
    if tz is not None:
        try:
            zone = ZoneInfo(tz or "UTC")
        except (ZoneInfoNotFoundError, ValueError):
            pass  # (the broker refuses the zone, naming it)
    try:
        return _parse_at(text, zone)
    except click.BadParameter as exc:
        raise click.BadParameter(exc.message, param_hint=hint) from None


@schedule.command("create")
@click.argument("name")
@click.argument("topic")
@click.option("--cron", default="", help='Cron expression, e.g. "30 9 * * 1-5" (6 fields: seconds last).')
@click.option("--every", type=Seconds(min=1, max=366 * 86_400), default=None, metavar="SECONDS", help="A fixed interval.")
@click.option("--tz", default="UTC", show_default=True, help="IANA time zone of the cron expression.")
@click.option("--start", default=None, metavar="TIME", help="First possible firing (epoch ms, or ISO 8601: without an offset, in --tz).")
@click.option("--end", default=None, metavar="TIME", help="Last possible firing (epoch ms, or ISO 8601: without an offset, in --tz).")
@click.option("--catch-up", type=click.Choice(["skip", "once", "all"]), default="once", show_default=True,
              help="After downtime: skip missed firings, fire the latest once, or fire all (bounded).")
@click.option("--body", required=True, help="The message body.")
@click.option("--tag", default="")
@click.option("--key", "keys", multiple=True, help="A message key (repeatable).")
@click.option("--property", "props", multiple=True, metavar="K=V", help="A user property (repeatable).")
@remote_options
def schedule_create(name, topic, cron, every, tz, start, end, catch_up, body, tag, keys, props, endpoint, timeout,
                    as_json) -> None:
    """Create schedule NAME producing into TOPIC."""
    from chronoq.proto import chronoq_admin_pb2 as apb

    properties = {}
    for p in props:
        k, sep, v = p.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{p!r} is not K=V", param_hint="--property")
        properties[k] = v
    req = apb.Schedule(name=name, topic=topic, cron=cron, interval_ms=int(every * 1000) if every else 0,
                       time_zone=tz, start_ms=_parse_ms(start, "--start", tz), end_ms=_parse_ms(end, "--end", tz),
                       catch_up=catch_up, body=body.encode(), tag=tag, keys=list(keys), properties=properties)
    s = admin_call(endpoint, timeout, "create_schedule", req)
    _show([s], as_json, f"schedule {s.name} created")


@schedule.command("list")
@click.option("--next", "next_firings", type=click.IntRange(1, 100), default=5, show_default=True,
              help="Next firings per schedule.")
@remote_options
def schedule_list(next_firings, endpoint, timeout, as_json) -> None:
    """Every schedule with its next firings."""
    _show(admin_call(endpoint, timeout, "list_schedules", next_firings), as_json)


def _verb(op: str, doc: str):
    @click.argument("name")
    @remote_options
    def command(name, endpoint, timeout, as_json) -> None:
        s = admin_call(endpoint, timeout, "schedule", op, name)
        _show([s], as_json, f"schedule {s.name}" + ("" if op == "show" else f": {op}d" if op != "show" else ""))
    command.__doc__ = doc
    schedule.command(op)(command)


_verb("show", "One schedule: its definition and next firings.")
_verb("pause", "Stop firing NAME (recalls what was handed to the timer); resume starts again from now.")
_verb("resume", "Fire NAME again from now on (what fell due while paused never fires).")
_verb("delete", "Delete NAME (recalls what was handed to the timer).")
