"""The console's request handlers: gather figures from the running broker, render a template.

Everything runs on the broker's event loop (the broker API is single-threaded), reads what the
broker already keeps and reuses its reports: group lag and in-flight counts are
``chronoq.features.catalog.group_lags`` (as for the Admin service's ``ListGroups``), pending
timers are ``TimerService.pending_by_horizon`` (as for ``/metrics``) and ``stats``, lateness is
the timer's histogram. The first view of the timer
horizon after many timers arrived reads their schedule files once (about 1 s per 100k pending
timers on the development machine); later views read only files that changed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from dataclasses import dataclass

import jinja2
from aiohttp import web

from chronoq.core import acl
from chronoq.core import errors
from chronoq.features import catalog, lookup
from chronoq.console import access, body, charts, horizon
from chronoq.console.lateness import LatenessRing
from chronoq.core.console_settings import ConsoleSettings
from chronoq.pop import names

log = logging.getLogger("chronoq.console")

LATENESS_ROWS = 30  # newest samples listed in the table under the chart


@dataclass
class Console:
    """Per-app state: the runtime, the settings, access control, templates, the lateness ring."""

    runtime: object
    settings: ConsoleSettings
    access: acl.AccessControl | None
    templates: jinja2.Environment
    ring: LatenessRing
    topic_counts: object = None  # chronoq.timer.topic_horizon.TopicCounts, made by the first topic page

    @property
    def broker(self):
        broker = self.runtime.broker
        if broker is None or broker.closed:  # None: still recovering (the HTTP listener starts first)
            state = getattr(self.runtime, "state", "closed")
            raise web.HTTPServiceUnavailable(text=f"the broker is not ready: {state}\n")
        return broker

    def now_ms(self) -> int:
        return self.broker.clock.wall_ms()

    def may_write(self, request: web.Request) -> bool:
        """Whether this visitor may use the write actions (so the page shows their buttons)."""
        return access.decide(self.access, request.headers.get("Authorization"), write=True).status == 200

    def render(self, request: web.Request, name: str, status: int = 200, **context) -> web.Response:
        context.setdefault("user", request.get("console_user"))
        context.setdefault("auth_on", self.access is not None)
        context.setdefault("can_write", self.may_write(request))
        context.setdefault("now_ms", self.now_ms())
        text = self.templates.get_template(name).render(page=name.split(".")[0], **context)
        response = web.Response(text=text, status=status, content_type="text/html", charset="utf-8",
                                headers={"Cache-Control": "no-store"})
        response.enable_compression()  # gzip or deflate, as the browser's Accept-Encoding allows
        return response


CONSOLE_KEY = web.AppKey("chronoq_console", Console)


def guarded(*, write: bool):
    """Check access (``access.decide``) before the handler; writes also need the same origin."""
    def wrap(handler):
        @functools.wraps(handler)
        async def checked(request: web.Request) -> web.StreamResponse:
            console = request.app[CONSOLE_KEY]
            if console.access is None and not access.addressed_here(request.host, console.settings.allowed_hosts):
                return console.render(request, "refused.html", status=403, reason=(
                    f"this console has no access control and answers only requests addressed to an IP "
                    f"address or localhost, not {request.host[:80]!r} (a page of another site can point its "
                    "own name at this machine); list the name in [console] allowed_hosts, or turn [auth] on"))
            decision = access.decide(console.access, request.headers.get("Authorization"), write=write)
            if decision.status == 401:
                raise web.HTTPUnauthorized(text=decision.reason + "\n", headers={
                    "WWW-Authenticate": f'Basic realm="{access.REALM}", charset="UTF-8"'})
            request["console_user"] = decision.user
            if decision.status != 200:
                return console.render(request, "refused.html", status=decision.status, reason=decision.reason)
            if write and not access.same_origin(request.host, request.headers.get("Origin"),
                                                request.headers.get("Referer")):
                return console.render(request, "refused.html", status=403,
                                      reason="this request comes from another site's page; use the console's own forms")
            return await handler(request, console)
        return checked
    return wrap


def reader(request: web.Request, console: "Console") -> acl.User | None:
    """The signed-in user whose rights limit what a page shows of messages (bodies, keys, ids):
    None when nothing is limited (access control off, or an admin). A user sees the messages of
    the topics it may subscribe to, as on the gRPC port; the Admin service's reads are admins'."""
    if console.access is None:
        return None
    user = console.access.users.get(request.get("console_user") or "")
    return None if user is None or user.admin else user


# ---------------------------------------------------------------------------- overview
def topic_rows(broker) -> list[dict]:
    rows = []
    for cfg in broker.list_topics():
        bounds = [broker.queue_bounds(cfg.name, q) for q in range(cfg.queues)]
        rows.append({"name": cfg.name, "queues": cfg.queues, "type": cfg.message_type.name.lower(),
                     "messages": sum(hi - lo for lo, hi in bounds), "written": sum(hi for _lo, hi in bounds)})
    return rows


def dlq_count(broker, group: str) -> int:
    """Messages in the group's dead-letter topic (still retained)."""
    cfg = broker.topics.get(names.dlq_topic(group))
    if cfg is None:
        return 0
    return sum(hi - lo for lo, hi in (broker.queue_bounds(cfg.name, q) for q in range(cfg.queues)))


def group_rows(broker, pop) -> tuple[list[dict], list[dict]]:
    """(per group, per group and topic), from ``catalog.group_lags`` (one code path for lag and
    in-flight counts: ``chronoq group list``, the gRPC Admin API and this page)."""
    if pop is None:
        return [], []
    per_topic, per_group = [], {}
    for row in catalog.group_lags(broker, pop):
        g = row.group
        entry = per_group.setdefault(g.name, {"name": g.name, "fifo": g.fifo, "max_attempts": g.max_attempts,
                                               "lag": 0, "inflight": 0, "topics": 0,
                                               "dlq": dlq_count(broker, g.name), "dlq_topic": names.dlq_topic(g.name)})
        if row.topic:
            per_topic.append({"group": g.name, "topic": row.topic, "lag": row.lag, "inflight": row.inflight})
            entry["lag"] += row.lag
            entry["inflight"] += row.inflight
            entry["topics"] += 1
    return list(per_group.values()), per_topic


@guarded(write=False)
async def overview(request: web.Request, console: Console) -> web.Response:
    broker = console.broker
    groups, group_topics = group_rows(broker, console.runtime.pop)
    log_bytes, segments, _ = broker.log_figures()
    hist = broker.timer.histogram
    summary = {"topics": len(broker.list_topics()), "groups": len(groups),
               "inflight": sum(g["inflight"] for g in groups), "dlq": sum(g["dlq"] for g in groups),
               "log_bytes": log_bytes, "segments": segments,
               "timers_delivered": hist.count}
    if console.runtime.replication is not None:  # the cluster line (chronoq.console.cluster imports this module)
        from chronoq.console.cluster import gather

        summary["cluster"] = gather(console)["summary"]
    history = getattr(console.runtime, "history", None)
    figs = None
    if history is not None:  # copies taken here, on the loop: the sampler appends to the ring on it
        figs = await asyncio.to_thread(history_charts, list(history.samples), history.rates())
    return console.render(request, "overview.html", topics=topic_rows(broker), groups=groups,
                          group_topics=group_topics, summary=summary, pop_missing=console.runtime.pop is None,
                          notice=request.query.get("notice", ""), figs=figs, history=history)


def history_charts(samples: list, rates: list) -> dict:
    """The overview's traffic charts from the runtime's ``HistoryRing`` (``chronoq.server.history``)."""
    return {"rates": charts.rate_lines(rates), "depth": charts.depth_lines(samples)}


# ---------------------------------------------------------------------------- timers
def horizon_data(console: Console) -> dict:
    """The timer page's figures. ``pending_by_horizon`` reads a schedule file only when it changed
    since it last counted it (a cache it shares with ``/metrics``), so a refresh costs little."""
    timer = console.broker.timer
    stats = timer.stats(horizon_ms=0)  # the cards and tables: wheel, buckets, levels, lanes, overdue
    plan = horizon.view_plan(console.now_ms(), stats["bucket_ms"])
    return {"stats": stats, "view": horizon.bins(plan, timer.pending_by_horizon(tuple(plan["horizons_ms"]))),
            "computed_ms": plan["now_ms"]}


@guarded(write=False)
async def timers(request: web.Request, console: Console) -> web.Response:
    data = horizon_data(console)
    view, stats = data["view"], data["stats"]
    figs = await asyncio.to_thread(lambda: {
        "minutes": charts.due_bars(view["minutes"], "Messages due per minute, next hour"),
        "hours": charts.due_bars(view["hours"], "Messages due per hour, next week")})
    minute_rows, hour_rows = ([{"start_ms": s, "pending": p} for s, p in zip(view[v]["starts_ms"], view[v]["pending"])]
                              for v in ("minutes", "hours"))
    return console.render(request, "timers.html", view=view, stats=stats, figs=figs,
                          minute_rows=minute_rows, hour_rows=hour_rows,
                          total_hour=sum(view["minutes"]["pending"]), computed_ms=data["computed_ms"])


# ---------------------------------------------------------------------------- lateness
@guarded(write=False)
async def lateness(request: web.Request, console: Console) -> web.Response:
    broker = console.broker
    snapshot = broker.timer.histogram.snapshot()
    current = console.ring.current(snapshot, console.now_ms())
    samples = list(console.ring.samples) + ([current] if current.count else [])
    fig = await asyncio.to_thread(charts.lateness_lines, samples)
    rows = [s for s in reversed(samples) if s.count][:LATENESS_ROWS]
    return console.render(request, "lateness.html", totals=snapshot, fig=fig, rows=rows,
                          interval_s=console.settings.lateness_interval_s, kept=len(console.ring.samples),
                          capacity=console.ring.samples.maxlen)


async def sample_lateness(console: Console) -> None:
    """Close one lateness interval every ``lateness_interval_s`` (runs until cancelled)."""
    while True:
        await asyncio.sleep(console.settings.lateness_interval_s)
        broker = console.runtime.broker
        if broker is None:  # recovering: nothing to sample yet
            continue
        if broker.closed:
            return
        try:
            console.ring.observe(broker.timer.histogram.snapshot(), broker.clock.wall_ms())
        except Exception:  # noqa: BLE001 - a bad sample must not end the sampler
            log.exception("lateness sample failed")


# ---------------------------------------------------------------------------- lookup
@guarded(write=False)
async def lookup_page(request: web.Request, console: Console) -> web.Response:
    query = request.query.get("q", "").strip()
    context = {"query": query, "scan_mib": console.settings.lookup_scan_mib,
               "trace_mib": console.settings.trace_scan_mib, "notice": request.query.get("notice", ""), "error": ""}
    if not query:
        return console.render(request, "lookup.html", **context)
    if len(query) > lookup.QUERY_CHARS_MAX or not query.isprintable():
        context["error"] = f"a message id or key is at most {lookup.QUERY_CHARS_MAX} printable characters"
        return console.render(request, "lookup.html", status=400, **context)
    # The same lookup as the Admin RPC LookupMessage (chronoq message show): chronoq.features.lookup.
    found = await lookup.lookup_message(console.broker, console.runtime.committer.barrier, query,
                                        console.settings.lookup_scan_mib << 20, console.settings.trace_scan_mib << 20)
    messages = found.messages
    user = reader(request, console)
    if user is not None:  # only the topics it may read (every topic's messages were shown to any user)
        messages = [m for m in messages if m["topic"] and user.allowed(acl.SUBSCRIBE, m["topic"])]
    context["hidden"] = len(found.messages) - len(messages)
    bodies = {r.commit_offset: body.body_view(r.body_head, r.body_bytes)
              for m in messages for r in m["records"]}
    return console.render(request, "lookup.html", scan=found.scan, trace=found.trace, messages=messages,
                          bodies=bodies, **context)


# ---------------------------------------------------------------------------- write actions
@guarded(write=True)
async def recall(request: web.Request, console: Console) -> web.Response:
    form = await request.post()
    handle = str(form.get("handle", "")).strip()
    back = str(form.get("q", "")).strip()
    try:
        result = await console.runtime.committer.recall(handle)  # answered once the tombstone is durable
    except errors.ClientError as exc:
        return console.render(request, "refused.html", status=400, reason=f"recall refused: {exc}")
    log.info("console: %s recalled %s (%s): %s", request.get("console_user") or "anonymous", result.message_id,
             result.topic, result.outcome.value)
    notice = f"recall of {result.message_id}: {result.outcome.value}" + (f" ({result.detail})" if result.detail else "")
    raise web.HTTPSeeOther(request.app.router["console-lookup"].url_for().with_query(q=back or result.message_id,
                                                                                     notice=notice))


@guarded(write=True)
async def create_topic(request: web.Request, console: Console) -> web.Response:
    form = await request.post()
    name = str(form.get("name", "")).strip()
    queues_text = str(form.get("queues", "")).strip()
    try:
        queues = int(queues_text) if queues_text else 0
    except ValueError:
        return console.render(request, "refused.html", status=400,
                              reason=f"queues must be a number, not {queues_text!r}")
    if console.runtime.pop is None:  # the catalog needs the gRPC front end's POP service
        return console.render(request, "refused.html", status=503, reason="the gRPC front end is not running")
    existed = name in console.broker.topics
    # The Admin service's CreateTopic (chronoq.features.catalog): the same validation and
    # "0 / empty = keep" rules as ``chronoq topic create`` and the gRPC Admin API.
    try:
        cfg = catalog.create_or_update_topic(console.broker, console.runtime.pop, name, queues,
                                             str(form.get("type", "")))
    except errors.ClientError as exc:
        return console.render(request, "refused.html", status=400, reason=f"topic not created: {exc}")
    log.info("console: %s created or updated topic %s", request.get("console_user") or "anonymous", cfg.name)
    notice = (f"topic {cfg.name} {'updated' if existed else 'created'}: {cfg.queues} queues, "
              f"{cfg.message_type.name.lower()}")
    raise web.HTTPSeeOther(request.app.router["console-overview"].url_for().with_query(notice=notice))


__all__ = ["Console", "CONSOLE_KEY", "overview", "timers", "lateness", "lookup_page", "recall", "create_topic",
           "sample_lateness"]
