"""The console's aiohttp wiring: routes, templates, static files, the lateness sampler (see the
package docstring for the routes)."""

from __future__ import annotations

import asyncio
import contextlib
import importlib.resources

import jinja2
from aiohttp import web

from chronoq.core import acl
from chronoq.console import charts, pending, schedules, views
from chronoq.core import console_settings
from chronoq.console.lateness import LatenessRing

PREFIX = "/console"
STATIC_MAX_AGE_S = 3600


def _plotly_js_path() -> str:
    """plotly.min.js as shipped inside the plotly package (the broker serves it: works offline)."""
    path = importlib.resources.files("plotly") / "package_data" / "plotly.min.js"
    if not path.is_file():
        raise RuntimeError("plotly.min.js is missing from the installed plotly package; reinstall chronoq")
    return str(path)


def _templates() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.PackageLoader("chronoq.console", "templates"),
                             autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["utc"] = lambda ms: charts.iso(ms) if ms else "-"
    env.filters["mib"] = lambda n: f"{n / (1 << 20):,.1f} MiB"
    env.filters["num"] = lambda n: "-" if n is None else f"{n:,}"
    return env


def setup(app: web.Application, runtime) -> None:
    """Add the console's routes and its lateness sampler to ``app`` (before it is frozen)."""
    config = runtime.config
    chosen = console_settings.parse(config.extra.get("console"))
    console = views.Console(runtime=runtime, settings=chosen, access=acl.from_config(config.extra.get("auth")),
                            templates=_templates(), ring=LatenessRing(chosen.lateness_samples))
    app[views.CONSOLE_KEY] = console
    static = importlib.resources.files("chronoq.console") / "static"
    plotly_js = _plotly_js_path()

    async def redirect(_request: web.Request) -> web.Response:
        raise web.HTTPFound(PREFIX + "/")

    async def plotly(_request: web.Request) -> web.FileResponse:
        return web.FileResponse(plotly_js, headers={"Cache-Control": f"max-age={STATIC_MAX_AGE_S}",
                                                    "Content-Type": "application/javascript"})

    r = app.router
    r.add_get("/", redirect)
    r.add_get(PREFIX, redirect)
    r.add_get(PREFIX + "/", views.overview, name="console-overview")
    r.add_get(PREFIX + "/timers", views.timers, name="console-timers")
    r.add_get(PREFIX + "/timers/pending", pending.pending, name="console-pending")
    r.add_get(PREFIX + "/lateness", views.lateness, name="console-lateness")
    r.add_get(PREFIX + "/lookup", views.lookup_page, name="console-lookup")
    r.add_get(PREFIX + "/schedules", schedules.schedules, name="console-schedules")
    r.add_post(PREFIX + "/recall", views.recall, name="console-recall")
    r.add_post(PREFIX + "/topics", views.create_topic, name="console-create-topic")
    r.add_get(PREFIX + "/static/plotly.min.js", plotly)
    r.add_static(PREFIX + "/static/", str(static), name="console-static")

    async def sampler(_app: web.Application):
        task = asyncio.get_running_loop().create_task(views.sample_lateness(console), name="chronoq-console-lateness")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(sampler)
