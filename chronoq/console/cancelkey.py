"""The console's cancel-by-key form (``/console/cancel-by-key``): cancel every pending timer
message of a topic that carries a message key (docs/timers.md, "Cancel by key"). Showing the form
needs a signed-in user; cancelling needs an admin (as ``chronoq timers cancel`` and the Admin RPC
``CancelByKey``), and is answered once the cancellations are durable."""

from __future__ import annotations

import logging

from aiohttp import web

from chronoq.console.views import Console, guarded
from chronoq.core import errors

log = logging.getLogger("chronoq.console")


@guarded(write=False)
async def cancel_form(request: web.Request, console: Console) -> web.Response:
    return console.render(request, "cancel_by_key.html", topic="", key="", result=None, error=None)


@guarded(write=True)
async def cancel_by_key(request: web.Request, console: Console) -> web.Response:
    form = await request.post()
    topic, key = str(form.get("topic", "")).strip(), str(form.get("key", "")).strip()
    try:
        result = await console.runtime.committer.cancel_by_key(topic, key)
    except errors.ClientError as exc:
        return console.render(request, "cancel_by_key.html", status=400, topic=topic, key=key, result=None,
                              error=f"cancel refused: {exc}")
    log.info("console: %s cancelled %d pending message(s) of %s with key %r", request.get("console_user") or
             "anonymous", len(result.cancelled), topic, key)
    return console.render(request, "cancel_by_key.html", topic=topic, key=key, result=result, error=None)
