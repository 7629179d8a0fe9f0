"""The broker's HTTP listener: ``/metrics`` (Prometheus), ``/healthz``, and the web console.

An aiohttp application served on the broker's own asyncio loop, bound to
``config.http_host:config.http_port`` (default 127.0.0.1:8082; port 0 picks a free port; a negative
port, or ``off``, means no listener). The bound address is announced in the "chronoq is ready" line
as ``HTTP on http://HOST:PORT/`` (tests read it from there, see ``tests/integration/conftest.py``).

Routes owned here:

- ``GET /metrics``: the broker's metrics in the Prometheus text format (``chronoq.server.metrics``,
  docs/metrics.md).
- ``GET /healthz``: 200 ``ok`` while the broker serves; 503 ``not ready: <why>`` while it recovers
  (the listener starts before recovery: ``chronoq.server.front_ends.build_early``), starts its gRPC
  front end, or stops. ``/metrics`` answers 503 too until recovery is over.

The web console lives in ``chronoq.console``. When that package exists, ``build_app`` calls
``chronoq.console.setup(app, runtime)`` once, before the app is frozen, so it can add routes, static
files and middlewares. What the console may use from ``runtime`` (a ``chronoq.server.runtime.Runtime``);
all of it is read on the event loop thread, the same thread the gRPC front end runs on, so no locks:

- ``runtime.config``: the ``BrokerConfig`` (``extra`` holds the config file's tables, e.g. ``[auth]``).
- ``runtime.broker``: the ``chronoq.broker.broker.Broker``, None while it recovers (the listener
  starts first; ``runtime.state`` says what the runtime is doing) (topics: ``list_topics``, ``queue_bounds``,
  ``read``; consumer offsets: ``list_groups``, ``get_offset``; ``recovery``: the start-up report;
  ``store``: commit log; ``timer_stats()``).
- ``runtime.broker.timer``: the ``chronoq.timer.service.TimerService`` (pending timers).
- ``runtime.pop``: the ``chronoq.pop.service.PopService`` (groups, in-flight messages, retry/DLQ;
  ``chronoq.server.consumers``), or ``None`` before the runtime opened it.
- ``runtime.metrics``: the ``chronoq.server.metrics.BrokerMetrics`` (``.registry`` is its own
  ``CollectorRegistry``; ``.snapshot()`` a dict of the figures ``chronoq stats`` shows).

Nothing here may block the loop for long: a scrape reads counters the broker already keeps.

Connections (``CappedFactory``; docs/security.md, "HTTP listener"): at most ``http_max_connections``
are open at once. One more is answered ``503`` naming the limit and closed at once, before its
request is read; it costs no handler and holds no descriptor after that. It is an operator's port
(a Prometheus scraper, a few console tabs): 64 is far more than they use, and the descriptors
come out of the broker's own reserve (``chronoq.server.process.connections_that_fit``).

aiohttp closes a connection idle for ``keepalive_timeout`` (3630 s unless told), counted from the
connection's start or its last answer, and not moved by bytes of an unfinished request: so it is
also the bound on reading a request's headers (a client sending a byte a second, "slow loris").
It is set to ``http_idle_timeout_ms`` (30 s: a scraper polls every 15-60 s and reconnects at no
real cost). A connection still open ``LIFETIME_S`` after it was accepted is
aborted whatever it does (a body sent slowly, an answer never read: aiohttp bounds neither in time).
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from typing import Callable

from aiohttp import web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST

from chronoq.core import errors, refusals
from chronoq.core.refusals import Refusals

log = logging.getLogger("chronoq.http")

RUNTIME_KEY = web.AppKey("chronoq_runtime", object)  # app[RUNTIME_KEY] is the runtime
CONSOLE_MODULE = "chronoq.console"
# Any connection is aborted this long after it was accepted: no console page or scrape takes a
# fraction of it, so only a stalled or hostile peer (a body trickled in, an answer never read) meets it.
LIFETIME_S = 300.0
REFUSED_LOG_EVERY_S = 60.0  # refused connections are logged at most this often (a count)


def _load_console():
    """``chronoq.console`` if it is installed, else None. Only its own absence is tolerated."""
    try:
        return importlib.import_module(CONSOLE_MODULE)
    except ImportError as exc:
        if exc.name != CONSOLE_MODULE:  # the console exists but something it imports is missing
            raise
        return None


async def _metrics(request: web.Request) -> web.Response:
    runtime = request.app[RUNTIME_KEY]
    if runtime.metrics is None:  # recovering: the broker's figures do not exist yet
        return web.Response(status=503, text=f"not ready: {runtime.state}\n")
    body = await runtime.metrics.render()  # (in slices, the loop free between: BrokerMetrics.render)
    # A raw header: web.Response(content_type=...) refuses a value with parameters (version, charset).
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def _healthz(request: web.Request) -> web.Response:
    """200 ``ok`` once the broker serves (recovered, gRPC port listening), until it stops; else
    503 ``not ready: <why>`` (recovering, starting the gRPC front end, stopping)."""
    runtime = request.app[RUNTIME_KEY]
    broker = runtime.broker
    state = getattr(runtime, "state", "ready")  # (a runtime of a program's own may not say)
    if state == "ready" and (broker is None or broker.closed):
        state = "closed"
    if state != "ready":
        return web.Response(status=503, text=f"not ready: {state}\n")
    return web.Response(text="ok\n")


# Every answer of the HTTP port: no other site may frame its pages (a framed console would let a
# click on the attacker's page press the console's own buttons: the same-origin check on posts
# cannot see that), and no browser may guess a type other than the one declared.
SECURITY_HEADERS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "same-origin",
}


async def _security_headers(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in SECURITY_HEADERS.items():
        response.headers.setdefault(name, value)


def build_app(runtime) -> web.Application:
    app = web.Application()
    app[RUNTIME_KEY] = runtime
    app.on_response_prepare.append(_security_headers)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/healthz", _healthz)
    console = _load_console()
    setup = getattr(console, "setup", None)
    if setup is not None:
        setup(app, runtime)
    elif console is not None:  # e.g. a directory without __init__.py (a namespace package)
        log.warning("%s has no setup(app, runtime): the web console is not served", CONSOLE_MODULE)
    return app


H2_PREFACE_START = "PRI"  # the HTTP/2 preface's request line: "PRI * HTTP/2.0"


class BadRequestFilter(logging.Filter):
    """Turns aiohttp's traceback for a request its HTTP/1.1 parser refuses into one short line, at
    a bounded rate. aiohttp logs such a request ("Error handling request", ERROR, with a traceback,
    on ``aiohttp.server``) and answers 400 itself; nine lines a request let anyone who can reach
    the port, credentials or not, fill the log (a header over 8 KiB, say). Two kinds:

    * a gRPC (HTTP/2) client dialling the HTTP port: its first bytes are the HTTP/2 preface. One
      clear line per such request saying where gRPC clients belong (a mistake, not an attack;
      the client gives up at once);
    * any other malformed request: counted as ``http_bad_request`` and logged by ``refuse``
      (``Refusals``: at most one line per interval, the rest summed into the next).

    Every other record passes unchanged."""

    def __init__(self, http_port_text: str, grpc_endpoint: str, refuse: Callable[[str, str], None]) -> None:
        super().__init__()
        self.http_port_text = http_port_text
        self.grpc_endpoint = grpc_endpoint
        self.refuse = refuse

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        peer = str(record.args[0]) if isinstance(record.args, tuple) and record.args else "a client"
        if H2_PREFACE_START in str(exc):
            log.warning("%s spoke HTTP/2 (gRPC?) to the HTTP port %s, which serves /metrics, /healthz and the "
                        "console over HTTP/1.1; gRPC clients belong on %s", peer, self.http_port_text,
                        self.grpc_endpoint)
        else:
            # (The exception's text names the parser's complaint; capped: it may quote the request.)
            self.refuse(peer, f"malformed HTTP request on the HTTP port, answered 400: {str(exc)[:200]!r}")
        return False


_PICKS = 8  # picks of "any free port" before giving up (each refused one is the gRPC port)


class _Refused(asyncio.Protocol):
    """A connection past the limit: one 503 naming it, then closed."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer

    def connection_made(self, transport) -> None:
        # (A few hundred bytes: always fit the socket's buffer. A client whose request is already
        # in, unread, may see a reset instead: closing at once is what keeps refusals cheap.)
        transport.write(self.answer)
        transport.close()


class CappedFactory:
    """The protocol factory the HTTP listener accepts with: aiohttp's own (``AppRunner.server``, a
    ``web.Server``, documented as a protocol factory for ``loop.create_server``) behind a limit of
    ``limit`` connections open, each given a lifetime (``_Counted``). Only aiohttp's public API:
    its runner, its server as a factory, and the asyncio protocol calls.

    Counted when accepted (the factory), so a burst of accepts in one loop pass cannot pass the
    limit, and released when the connection is lost (``connection_lost``, every accepted one)."""

    def __init__(self, factory, limit: int) -> None:
        assert limit >= 1
        self.factory = factory
        self.limit = limit
        self.open = 0  # connections accepted and not yet lost
        self.refused = 0  # connections refused since start
        self._refused_logged = (0.0, 0)  # (loop time, ``refused``) at the last log line
        body = (f"too many HTTP connections: {limit} are open, the limit is http_max_connections ({limit}); "
                "close idle ones or raise http_max_connections\n").encode()
        self._answer = (b"HTTP/1.1 503 Service Unavailable\r\nConnection: close\r\nContent-Type: text/plain\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(body), body))

    def __call__(self) -> asyncio.Protocol:
        if self.open >= self.limit:
            self.refused += 1
            self._log_refused()
            return _Refused(self._answer)
        self.open += 1
        return _Counted(self, self.factory())

    def lost(self) -> None:
        self.open -= 1
        assert self.open >= 0, self.open

    def _log_refused(self) -> None:
        now = asyncio.get_running_loop().time()
        at, count = self._refused_logged
        if count and now - at < REFUSED_LOG_EVERY_S:
            return
        self._refused_logged = (now, self.refused)
        log.warning("HTTP listener: %d connection(s) refused since start (%d new): %d are open, the limit "
                    "is http_max_connections (%d)", self.refused, self.refused - count, self.open, self.limit)


class _Counted(asyncio.Protocol):
    """One accepted connection: aiohttp's handler does the work (every call passed on), this
    counts it out of ``CappedFactory.open`` when it is lost and aborts it ``LIFETIME_S`` after
    it was made."""

    __slots__ = ("cap", "handler", "deadline")

    def __init__(self, cap: CappedFactory, handler: asyncio.Protocol) -> None:
        self.cap = cap
        self.handler = handler
        self.deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:
        self.deadline = asyncio.get_running_loop().call_later(LIFETIME_S, transport.abort)
        self.handler.connection_made(transport)

    def connection_lost(self, exc) -> None:
        if self.deadline is not None:
            self.deadline.cancel()
        self.cap.lost()
        self.handler.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self.handler.data_received(data)

    def eof_received(self):
        return self.handler.eof_received()

    def pause_writing(self) -> None:
        self.handler.pause_writing()

    def resume_writing(self) -> None:
        self.handler.resume_writing()


class HttpFrontEnd:
    """Serves ``build_app(runtime)`` on ``config.http_host:config.http_port``."""

    def __init__(self, runtime) -> None:
        self.runtime = runtime
        self.config = runtime.config
        self.runner: web.AppRunner | None = None
        self.listener: asyncio.AbstractServer | None = None
        self.host = self.config.http_host
        self.port = 0  # the bound port, once started
        self._filter: logging.Filter | None = None
        self._early_refusals = Refusals(time.monotonic_ns)  # before the broker (and its count) exists

    async def start(self) -> None:
        assert self.config.http_port >= 0, "a negative http_port means no HTTP front end"
        # HTTP listens before recovery, gRPC after it: "any free port" could be handed the very port
        # gRPC is about to ask for, and the start would then fail on gRPC's bind. Such a pick is
        # kept open until the next one is bound (so the OS cannot hand it out again), then dropped.
        refused: list[tuple] = []
        try:
            for _ in range(_PICKS):
                runner, listener = await self._listen()
                if self.config.http_port != 0 or _bound_port(listener) != self.config.port:
                    break
                refused.append((runner, listener))
            else:
                raise errors.ClientError(f"no free HTTP port other than {self.config.port} in {_PICKS} picks")
        finally:
            for other, other_listener in refused:
                await _close(other, other_listener)
        self.runner, self.listener = runner, listener
        self.port = _bound_port(listener)
        assert 0 < self.port <= 65535
        self._filter = BadRequestFilter(f"{self.host}:{self.port}", self.config.endpoint, self._refuse_bad_request)
        logging.getLogger("aiohttp.server").addFilter(self._filter)

    def _refuse_bad_request(self, peer: str, detail: str) -> None:
        """Counted in the broker's refusals once it exists (chronoq_requests_refused_total); while
        it recovers, only logged, at the same bounded rate."""
        broker = getattr(self.runtime, "broker", None)
        refused = broker.refusals if broker is not None else self._early_refusals
        refused.refuse(refusals.HTTP_BAD_REQUEST, peer, detail)

    async def _listen(self) -> tuple[web.AppRunner, asyncio.AbstractServer]:
        runner = web.AppRunner(build_app(self.runtime), access_log=None, handle_signals=False,
                               keepalive_timeout=self.config.http_idle_timeout_ms / 1000)
        await runner.setup()
        cap = CappedFactory(runner.server, self.config.http_max_connections)
        try:
            listener = await asyncio.get_running_loop().create_server(cap, self.host, self.config.http_port,
                                                                      reuse_port=False)
        except OSError as exc:
            await runner.cleanup()
            raise errors.ClientError(f"cannot listen for HTTP on {self.host}:{self.config.http_port}: "
                                     f"{exc.strerror or exc} (set --http-port/CHRONOQ_HTTP_PORT, 0 for any free "
                                     "port, off for none; --http-host/CHRONOQ_HTTP_HOST)") from None
        return runner, listener

    async def stop(self) -> None:
        logging.getLogger("aiohttp.server").removeFilter(self._filter)
        if self.runner is not None:
            runner, listener, self.runner, self.listener = self.runner, self.listener, None, None
            await _close(runner, listener)

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/"

    def describe(self) -> str:
        return f"HTTP on {self.url}"


def _bound_port(listener: asyncio.AbstractServer) -> int:
    sockets = listener.sockets
    assert sockets, "the listener started but has no socket"
    return int(sockets[0].getsockname()[1])


async def _close(runner: web.AppRunner, listener: asyncio.AbstractServer) -> None:
    """Stop accepting, then let aiohttp end the connections it serves (its shutdown) and the app."""
    listener.close()
    await runner.cleanup()
