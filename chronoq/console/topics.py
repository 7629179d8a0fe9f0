"""The console's page of one topic (``/console/topic/{name}``): its queues with their offsets, the
consumer groups reading it with their lag, and its timer messages by due time (the timer horizon
of this topic alone: ``chronoq.timer.topic_horizon``). Read-only."""

from __future__ import annotations

import asyncio

from aiohttp import web

from chronoq.console import charts, horizon
from chronoq.console.views import Console, guarded
from chronoq.timer.topic_horizon import TopicCounts
from chronoq.core import validate
from chronoq.features import catalog


def queue_rows(broker, topic: str, queues: int) -> list[dict]:
    """Per queue: the oldest retained offset, the next offset to be written, messages retained."""
    rows = []
    for qid in range(queues):
        lo, hi = broker.queue_bounds(topic, qid)
        rows.append({"queue": qid, "min": lo, "max": hi, "messages": hi - lo})
    return rows


@guarded(write=False)
async def topic_page(request: web.Request, console: Console) -> web.Response:
    broker = console.broker
    name = request.match_info["name"]
    cfg = broker.topics.get(name)
    if cfg is None or validate.is_system_topic(name):
        return console.render(request, "refused.html", status=404, reason=f"no topic named {name!r}")
    queues = queue_rows(broker, name, cfg.queues)
    pop = console.runtime.pop
    # The same rows as ``chronoq group list --topic``: every group that consumes this topic.
    groups = ([row for row in catalog.group_lags(broker, pop) if row.topic == name] if pop is not None else [])
    summary = {"type": cfg.message_type.name.lower(), "queues": cfg.queues,
               "messages": sum(q["messages"] for q in queues), "written": sum(q["max"] for q in queues),
               "sent": broker.sent_by_topic.get(name, 0), "lag": sum(g.lag for g in groups),
               "inflight": sum(g.inflight for g in groups)}
    view = await topic_horizon(console, name)
    figs = await asyncio.to_thread(lambda: {
        "minutes": charts.due_bars(view["minutes"], f"Timer messages of {name} due per minute, next hour"),
        "hours": charts.due_bars(view["hours"], f"Timer messages of {name} due per hour, next week")})
    hour_rows = [{"start_ms": s, "pending": p} for s, p in zip(view["hours"]["starts_ms"], view["hours"]["pending"])]
    return console.render(request, "topic.html", topic=name, queue_rows=queues, groups=groups, summary=summary,
                          pop_missing=pop is None, view=view, figs=figs, hour_rows=hour_rows,
                          total_hour=sum(view["minutes"]["pending"]))


async def topic_horizon(console: Console, name: str) -> dict:
    """The topic's pending timer messages in the timer page's bins (``horizon.bins``)."""
    timer = console.broker.timer
    counts = console.topic_counts
    if counts is None or counts.timer is not timer:
        counts = console.topic_counts = TopicCounts(timer)
    await counts.refresh()  # (the files counted on a worker thread)
    plan = horizon.view_plan(console.now_ms(), timer.width)
    return horizon.bins(plan, counts.pending_by_horizon(name, tuple(plan["horizons_ms"])))
