"""The console shows a write button only to a visitor who may use it (docs/console.md, "Access"):
the Recall button on the lookup page and the create-topic form on the overview. Rendered by the
console's own ``Console.render`` and templates; the request carries the visitor's credentials."""

from __future__ import annotations

import base64
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import make_mocked_request

from chronoq.console import app, body, views
from chronoq.console.lateness import LatenessRing
from chronoq.core import acl, console_settings
from chronoq.core.clock import FakeClock
from chronoq.features.lookup import Found, ScanReport, TraceReport

USERS = acl.AccessControl([acl.User("ops", b"s3cret", admin=True), acl.User("viewer", b"look", subscribe=("*",))])


def _console(access) -> views.Console:
    broker = SimpleNamespace(closed=False, clock=FakeClock(wall_ms=1_800_000_000_000))
    return views.Console(runtime=SimpleNamespace(broker=broker), settings=console_settings.ConsoleSettings(),
                         access=access, templates=app._templates(), ring=LatenessRing(3))


def _request(user: str | None, password: str = ""):
    headers = {}
    if user:
        headers["Authorization"] = "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
    return make_mocked_request("GET", "/console/lookup?q=k", headers=headers)


def _lookup_page(console: views.Console, request) -> str:
    due = 1_800_000_600_000
    record = Found(4096, "orders", 0, 0, "MID1", "MID1", "orders", "scheduled", "", ("k",), 0, 0, due, 2,
                   recall_handle="HANDLE1", body_head=b"hi")
    message = {"id": "MID1", "topic": "orders", "events": [], "records": [record], "state": {"status": "pending"}}
    response = console.render(request, "lookup.html", query="k", scan_mib=32, trace_mib=64, notice="", error="",
                              scan=ScanReport(records=[record]), trace=TraceReport(), messages=[message],
                              bodies={4096: body.body_view(b"hi", 2)})
    return response.text


def _overview_page(console: views.Console, request) -> str:
    summary = {"topics": 0, "groups": 0, "inflight": 0, "dlq": 0, "log_bytes": 0, "segments": 1, "timers_delivered": 0}
    return console.render(request, "overview.html", topics=[], groups=[], group_topics=[], summary=summary,
                          pop_missing=False, notice="", figs=None, history=None).text


@pytest.mark.parametrize("access, user, password, shown", [
    (None, None, "", False),              # access control off: read-only, for everyone
    (USERS, "viewer", "look", False),     # a user without the admin role
    (USERS, "ops", "s3cret", True),       # an admin
])
def test_write_buttons_are_shown_only_to_who_may_use_them(access, user, password, shown):
    console = _console(access)
    page = _lookup_page(console, _request(user, password))
    assert 'id="message-MID1"' in page
    assert ('action="/console/recall"' in page) is shown
    assert ("HANDLE1" in page) is shown
    assert ('id="create-topic"' in _overview_page(console, _request(user, password))) is shown
