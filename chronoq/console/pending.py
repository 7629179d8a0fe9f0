"""The console's pending list (``/console/timers/pending``): the pending delayed messages of a
due window, a page at a time, in due order. Each bin of the timer horizon links here with its
window (``templates/timers.html``); the first bin's link has no start, as that bin also holds
what is overdue. Read-only: it is ``Broker.pending`` (``chronoq.timer.pending``), the query
behind ``chronoq timers list`` and the Admin RPC ``ListPending``; recalling a message is the
lookup page's (its id links there)."""

from __future__ import annotations

from aiohttp import web

from chronoq.console.views import Console, guarded, reader
from chronoq.core import acl, errors
from chronoq.timer.pending import LIMIT_DEFAULT, PendingQuery

FILTERS = ("topic", "key", "from", "to", "limit")
# The last millisecond of year 9999: the page shows each time as a date, and a date past it (or
# before 1970) has no text; such a value was a 500 and a traceback in the log.
MAX_MS = 253_402_300_799_999


def _ms(text: str | None, name: str) -> int | None:
    if text is None or text.strip() == "":
        return None
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_MS:
        raise errors.ClientError(f"{name} must be epoch milliseconds (0 to {MAX_MS}), not {text[:40]!r}")
    return value


def query_of(params) -> PendingQuery:
    """The query a page's URL asks (``from``/``to`` epoch ms); ClientError for a malformed one."""
    text = params.get("limit", "").strip()
    try:
        limit = int(text) if text else None  # (its range is the query's to check: Broker.pending)
    except ValueError:
        raise errors.ClientError(f"limit must be a whole number, not {text[:40]!r}") from None
    return PendingQuery(topic=params.get("topic", "").strip(), key=params.get("key", "").strip(),
                        from_ms=_ms(params.get("from"), "from"), to_ms=_ms(params.get("to"), "to"),
                        limit=LIMIT_DEFAULT if limit is None else limit, cursor=params.get("cursor", ""))


def rows_of(messages, now_ms: int) -> list[dict]:
    rows = []
    for m in messages:
        parts = m.parts
        rows.append({"due_ms": m.due_ms, "in_s": max(0, m.due_ms - now_ms) // 1000, "topic": m.topic,
                     "queue": m.queue_id, "level": m.level, "message_id": parts.message_id.decode(),
                     "keys": parts.keys.decode().split("\x01") if parts.keys else [],
                     "tag": parts.tag.decode(), "body_bytes": len(parts.body)})
    return rows


@guarded(write=False)
async def pending(request: web.Request, console: Console) -> web.Response:
    params = request.query
    kept = {k: params[k] for k in FILTERS if params.get(k, "").strip()}
    url = request.app.router["console-pending"].url_for()
    try:
        q = query_of(params)
        page = console.broker.pending(q)
    except errors.ClientError as exc:
        return console.render(request, "pending.html", status=400, error=str(exc), rows=[], filters=kept,
                              next_url="", first_url=str(url.with_query(kept)), more=False, scanned=0,
                              from_ms=None, to_ms=None)
    messages = page.messages
    user = reader(request, console)
    if user is not None:  # ids, keys and tags of the topics it may read only
        messages = [m for m in messages if user.allowed(acl.SUBSCRIBE, m.topic)]
    return console.render(request, "pending.html", error="", rows=rows_of(messages, console.now_ms()),
                          filters=kept, more=bool(page.next_cursor), scanned=page.scanned,
                          next_url=str(url.with_query({**kept, "cursor": page.next_cursor})) if page.next_cursor else "",
                          first_url=str(url.with_query(kept)) if params.get("cursor") else "",
                          from_ms=q.from_ms, to_ms=q.to_ms)
