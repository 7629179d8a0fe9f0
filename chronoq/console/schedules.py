"""The console's schedules page (``/console/schedules``): every recurring schedule with its next
firings, in UTC and in the schedule's own time zone. Read-only; managing them is ``chronoq
schedule`` or the Admin service (docs/timers.md, "Recurring schedules")."""

from __future__ import annotations

from datetime import datetime
from zoneinfo import ZoneInfo

import asyncio

from aiohttp import web

from chronoq.console.views import Console, guarded
from chronoq.features.schedules.book import upcoming_view

NEXT_SHOWN = 5


def _local(ms: int, tz: str) -> str:
    return datetime.fromtimestamp(ms / 1000, ZoneInfo(tz)).strftime("%Y-%m-%d %H:%M:%S %Z")


def schedule_rows(schedules: list, now_ms: int) -> list[dict]:
    """The page's rows; runs on a worker thread (``upcoming_view``: croniter lookups take ms)."""
    rows = []
    for s in schedules:
        name, sp = s.name, s.spec
        nxt = upcoming_view(s, now_ms, NEXT_SHOWN)
        rows.append({"name": name, "topic": s.topic, "when": sp.cron or f"every {sp.interval_ms / 1000:g} s",
                     "tz": sp.tz, "catch_up": s.catch_up, "paused": s.paused,
                     "pending": sum(1 for a, _h in s.ahead if a > now_ms),
                     "next": [{"ms": t, "local": _local(t, sp.tz)} for t in nxt]})
    return rows


@guarded(write=False)
async def schedules(request: web.Request, console: Console) -> web.Response:
    book = getattr(console.runtime, "schedules", None)
    schedules = [s for _n, s in sorted(book.schedules.items())] if book is not None else []
    rows = await asyncio.to_thread(schedule_rows, schedules, console.now_ms())
    return console.render(request, "schedules.html", rows=rows, served=book is not None)
