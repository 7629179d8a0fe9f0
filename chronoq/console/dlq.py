"""The console's dead-letter page of a consumer group (``/console/dlq/{group}``) and its Resend
button (``POST /console/dlq/{group}/resend``). Both are ``chronoq.features.deadletters``, the
functions behind the Admin RPCs ``ListDeadLetters`` and ``ResendDeadLetters`` (``chronoq dlq``):
one code path. Showing the page needs a signed-in user; resending needs an admin, and the page
answers only once the resent messages and the moved cursor are durable (the committer's
``durable``, as the Admin service awaits it)."""

from __future__ import annotations

import logging

from aiohttp import web

from chronoq.console import body
from chronoq.console.views import Console, guarded, reader
from chronoq.core import acl, errors
from chronoq.pop import names
from chronoq.features import deadletters

log = logging.getLogger("chronoq.console")

PAGE_LETTERS = 50   # dead letters listed per page (the oldest retained or from the cursor)
BODY_SHOWN = 64     # bytes of each body shown in the table


def letter_rows(d: deadletters.DeadLetters) -> list[dict]:
    rows = []
    for record, v, was_resent in d.letters:
        shown = body.body_view(record.body[:BODY_SHOWN], len(record.body))
        rows.append({"offset": record.queue_offset, "message_id": v.message_id, "topic": v.topic, "tag": v.tag,
                     "keys": list(v.keys), "body": shown.text, "body_kind": shown.kind,
                     "body_bytes": len(record.body), "resent": was_resent})
    return rows


def _page(request: web.Request, console: Console, group: str, *, status: int = 200, result=None,
          error: str | None = None) -> web.Response:
    everything = request.query.get("all") == "1"
    user = reader(request, console)
    if user is not None and not (user.allowed(acl.GROUP, group) and user.allowed(acl.SUBSCRIBE, names.dlq_topic(group))):
        return console.render(request, "refused.html", status=403, reason=(
            f"access key {user.access_key!r} may not read the dead letters of {group!r}: that needs the group "
            f"and subscribe rights on {names.dlq_topic(group)!r} (as a receive of them would), or admin = true"))
    try:
        d = deadletters.list_dead(console.broker, group, PAGE_LETTERS, everything)
    except (errors.NotFound, errors.ClientError) as exc:
        return console.render(request, "refused.html", status=404, reason=str(exc))
    return console.render(request, "dlq.html", status=status, group=group, rows=letter_rows(d), everything=everything,
                          min_offset=d.min_offset, max_offset=d.max_offset, cursor=d.cursor,
                          waiting=d.max_offset - d.cursor, result=result, error=error)


@guarded(write=False)
async def dlq_page(request: web.Request, console: Console) -> web.Response:
    return _page(request, console, request.match_info["group"])


@guarded(write=True)
async def resend(request: web.Request, console: Console) -> web.Response:
    group = request.match_info["group"]
    form = await request.post()
    try:
        limit = int(str(form.get("limit", "") or 0))
    except ValueError:
        return _page(request, console, group, status=400, error="limit must be a whole number")
    broker = console.broker
    committer = console.runtime.committer

    async def durable() -> None:
        """Everything written so far durable and dispatched (as ``AdminService._durable``)."""
        if committer is not None:
            await committer.durable(broker.log_written)
        else:
            broker.flush()

    try:
        result = await deadletters.resend(broker, durable, group, limit)
    except errors.NotFound as exc:
        return console.render(request, "refused.html", status=404, reason=str(exc))
    except errors.ClientError as exc:
        return _page(request, console, group, status=400, error=f"resend refused: {exc}")
    log.info("console: %s resent %d dead letter(s) of group %s (offsets %d-%d)",
             request.get("console_user") or "anonymous", result.resent, group, result.from_offset, result.to_offset)
    return _page(request, console, group, result=result)
