"""The console's cancel-by-key form (chronoq.console.cancelkey) against ``chronoq serve`` with access
control on, over plain HTTP: the page for any user, the form and the cancelling for admins from the console's own
page, and a definite answer."""

from __future__ import annotations

import time

from rocketmq import ClientConfiguration, Credentials, Producer

from .test_console import ADMIN, AUTH_CONFIG, VIEWER, request
from .test_official_python_client import make_message, unique


def test_cancel_by_key_from_the_console_needs_an_admin_and_answers_what_it_cancelled(chronoq_process):
    broker = chronoq_process(AUTH_CONFIG)
    ep, base = broker.endpoint, broker.http_url.rstrip("/")
    topic = unique("console-key")
    p = Producer(ClientConfiguration(ep, Credentials(*ADMIN), request_timeout=3), (topic,))
    p.startup()
    try:
        ids = []
        for body in (b"a", b"b"):
            m = make_message(topic, body, keys=("order-5",))
            m.delivery_timestamp = int(time.time()) + 1800
            ids.append(p.send(m).message_id)
    finally:
        p.shutdown()
    status, _h, body = request(base, "GET", "/console/cancel-by-key", auth=VIEWER)
    # A viewer sees the page but not a form it could not use (issue 25: no buttons a visitor cannot use).
    assert status == 200 and 'action="/console/cancel-by-key"' not in body and 'id="read-only"' in body
    status, _h, body = request(base, "GET", "/console/cancel-by-key", auth=ADMIN)
    assert status == 200 and 'action="/console/cancel-by-key"' in body and "Cancel by key" in body
    form = {"topic": topic, "key": "order-5"}
    status, _h, body = request(base, "POST", "/console/cancel-by-key", auth=VIEWER, form=form, headers={"Origin": base})
    assert status == 403 and "admin" in body
    assert request(base, "POST", "/console/cancel-by-key", form=form)[0] == 401
    status, _h, body = request(base, "POST", "/console/cancel-by-key", auth=ADMIN, form=form,
                               headers={"Origin": "http://elsewhere.example"})
    assert status == 403 and "another site" in body
    status, _h, body = request(base, "POST", "/console/cancel-by-key", auth=ADMIN, form=form, headers={"Origin": base})
    assert status == 200 and "2 cancelled, 0 already delivered" in body
    assert all(mid in body for mid in ids)
    status, _h, body = request(base, "POST", "/console/cancel-by-key", auth=ADMIN, form=form, headers={"Origin": base})
    assert status == 200 and "0 cancelled, 0 already delivered" in body
    status, _h, body = request(base, "POST", "/console/cancel-by-key", auth=ADMIN, form={"topic": topic, "key": ""},
                               headers={"Origin": base})
    assert status == 400 and "cancel refused" in body
