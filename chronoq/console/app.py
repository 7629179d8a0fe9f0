"""The console's aiohttp wiring: routes, templates, static files, the lateness sampler (see the
package docstring for the routes)."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import importlib.resources
from dataclasses import dataclass

import jinja2
from aiohttp import web

from chronoq.core import acl
from chronoq.console import cancelkey, charts, cluster, dlq, pending, schedules, topics, views
from chronoq.core import console_settings
from chronoq.console.lateness import LatenessRing

PREFIX = "/console"
STATIC_MAX_AGE_S = 3600
_TYPES = {".css": "text/css", ".js": "application/javascript"}


@dataclass(frozen=True, slots=True)
class StaticFile:
    """One file of ``static/``, read and gzip-compressed once at start (they are small)."""
    body: bytes
    gzipped: bytes
    etag: str
    content_type: str


def _static_files() -> dict[str, StaticFile]:
    out = {}
    for entry in (importlib.resources.files("chronoq.console") / "static").iterdir():
        kind = _TYPES.get("." + entry.name.rpartition(".")[2])
        if kind is None or not entry.is_file():
            continue
        body = entry.read_bytes()
        out[entry.name] = StaticFile(body, gzip.compress(body, mtime=0), '"%s"' % hashlib.sha256(body).hexdigest()[:16],
                                     kind)
    return out


def _serve_static(files: dict[str, StaticFile]):
    async def static(request: web.Request) -> web.Response:
        f = files.get(request.match_info["name"])
        if f is None:
            raise web.HTTPNotFound()
        headers = {"Cache-Control": f"public, max-age={STATIC_MAX_AGE_S}", "ETag": f.etag, "Vary": "Accept-Encoding"}
        if request.headers.get("If-None-Match") == f.etag:
            return web.Response(status=304, headers=headers)
        if "gzip" in request.headers.get("Accept-Encoding", ""):
            headers["Content-Encoding"] = "gzip"
            return web.Response(body=f.gzipped, content_type=f.content_type, headers=headers)
        return web.Response(body=f.body, content_type=f.content_type, headers=headers)
    return static


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

    async def redirect(_request: web.Request) -> web.Response:
        raise web.HTTPFound(PREFIX + "/")

    r = app.router
    r.add_get("/", redirect)
    r.add_get(PREFIX, redirect)
    r.add_get(PREFIX + "/", views.overview, name="console-overview")
    r.add_get(PREFIX + "/timers", views.timers, name="console-timers")
    r.add_get(PREFIX + "/timers/pending", pending.pending, name="console-pending")
    r.add_get(PREFIX + "/lateness", views.lateness, name="console-lateness")
    r.add_get(PREFIX + "/topic/{name}", topics.topic_page, name="console-topic")
    r.add_get(PREFIX + "/lookup", views.lookup_page, name="console-lookup")
    r.add_get(PREFIX + "/schedules", schedules.schedules, name="console-schedules")
    r.add_get(PREFIX + "/cluster", cluster.cluster_page, name="console-cluster")
    r.add_post(PREFIX + "/recall", views.recall, name="console-recall")
    r.add_post(PREFIX + "/topics", views.create_topic, name="console-create-topic")
    r.add_get(PREFIX + "/cancel-by-key", cancelkey.cancel_form, name="console-cancel-form")
    r.add_post(PREFIX + "/cancel-by-key", cancelkey.cancel_by_key, name="console-cancel-by-key")
    r.add_get(PREFIX + "/dlq/{group}", dlq.dlq_page, name="console-dlq")
    r.add_post(PREFIX + "/dlq/{group}/resend", dlq.resend, name="console-dlq-resend")
    r.add_get(PREFIX + "/static/{name}", _serve_static(_static_files()), name="console-static")

    async def sampler(_app: web.Application):
        task = asyncio.get_running_loop().create_task(views.sample_lateness(console), name="chronoq-console-lateness")
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    app.cleanup_ctx.append(sampler)
