"""The web console: pages served by the broker's HTTP listener (docs/console.md).

``chronoq.server.http.build_app`` calls ``setup(app, runtime)`` once. Routes, all under
``/console/`` (``/`` redirects there):

===========================  =====================================================================
``GET  /console/``           topics (messages retained), consumer groups with lag, in-flight, DLQ
``GET  /console/timers``     timer horizon: due per minute (next hour) and per hour (next week)
``GET  /console/lateness``   timer lateness p50/p99/max per interval (in-memory ring)
``GET  /console/topic/NAME`` one topic: queues with min/max offsets, the groups reading it, their lag
``GET  /console/lookup?q=``  a message's records and life by message id or key
``GET  /console/cluster``    replication: role, epoch, replicas and their lag, etcd's view (``cluster``)
``POST /console/recall``     recall a pending delayed message (admin)
``POST /console/topics``     create a topic or add queues (admin)
``GET  /console/static/…``   the style sheet and the auto-refresh script (gzip, ETag, max-age)
===========================  =====================================================================

``GET /console/dlq/GROUP`` and ``POST /console/dlq/GROUP/resend`` (``dlq``): a group's dead letters,
resent by an admin (``chronoq.features.deadletters``).

``GET|POST /console/cancel-by-key`` (``cancelkey``): cancel every pending timer message of a topic
that carries a message key (the form; cancelling needs an admin).

Modules: ``access`` (who may do what), ``horizon``, ``lateness``, ``charts`` (SVG by pygal) and
``body`` (a message body as text or hex) are pure; ``views``, ``topics``, ``schedules``, ``cluster``, ``dlq`` and ``cancelkey``
(handlers) and ``app`` (routes, templates, static files, the sampler task) are the shell. The
overview's traffic charts read ``runtime.history`` (``chronoq.server.history``). The
message lookup is ``chronoq.features.lookup`` and ``chronoq.features.lifeline``, shared with the Admin RPC
``LookupMessage`` (``chronoq message show``).

This package's ``__init__`` imports nothing heavy: ``chronoq.core.config`` validates ``[console]`` with
``settings`` and the Admin service reads it, without loading aiohttp or jinja2.
"""

from __future__ import annotations


def setup(app, runtime) -> None:
    """Add the console's routes and its lateness sampler to ``app`` (before it is frozen)."""
    from chronoq.console import app as wiring

    wiring.setup(app, runtime)
