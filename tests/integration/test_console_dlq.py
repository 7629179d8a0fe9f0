"""The console's dead-letter page and Resend button (chronoq.console.dlq) against ``chronoq serve``
with access control on: a group with max_attempts = 2 dead-letters a poison message; any user
sees it, only an admin gets (and may use) the Resend button, the page answers once the resend is
durable, and after a kill -9 the resent message and the moved cursor are still there. The
admin's page is rendered in headless Chromium (credentials in the URL) and saved as
docs/images/console-dlq.png with ``CHRONOQ_UPDATE_SCREENSHOT=1``."""

from __future__ import annotations

import pytest
from rocketmq import ClientConfiguration, Credentials, FilterExpression, Producer, PushConsumer

from .conftest import groups_toml, wait_until
from .test_console import ADMIN, AUTH_CONFIG, CHROMIUM, VIEWER, page, request, save_screenshot
from .test_official_python_client import Recorder, make_message, unique

GROUP = "console-dlq-resend"


def dead_letter_one(ep: str, base: str, topic: str) -> str:
    """Send a poison message and fail it twice (max_attempts = 2): it lands in %DLQ%GROUP."""
    cfg = ClientConfiguration(ep, Credentials(*ADMIN), request_timeout=3)
    p = Producer(cfg, (topic,))
    p.startup()
    try:
        mid = p.send(make_message(topic, b"poison body", tag="bad", keys=("order-9",))).message_id
    finally:
        p.shutdown()
    listener = Recorder(lambda m: True)
    c = PushConsumer(cfg, GROUP, listener, {topic: FilterExpression("*")}, consumption_thread_count=2)
    c.startup()
    try:
        wait_until(lambda: 'id="dl-0"' in request(base, "GET", f"/console/dlq/{GROUP}", auth=VIEWER)[2], 40,
                   what="the poison message in the DLQ")
    finally:
        c.shutdown()
    return mid


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH")
def test_dead_letters_resent_from_the_console_by_an_admin_durably(chronoq_process, tmp_path):
    config = AUTH_CONFIG + groups_toml({GROUP: {"max_attempts": 2}})
    broker = chronoq_process(config)
    base = broker.http_url.rstrip("/")
    topic = unique("console-dlq")
    mid = dead_letter_one(broker.endpoint, base, topic)

    # Any user sees the dead letter; a visitor who may not resend gets no button.
    status, _h, body = request(base, "GET", f"/console/dlq/{GROUP}", auth=VIEWER)
    assert status == 200 and mid in body and "poison body" in body and topic in body
    assert 'id="dlq-waiting">1<' in body
    assert 'id="resend"' not in body and "/resend" not in body, "no Resend button for a non-admin"
    assert f'href="/console/dlq/{GROUP}"' in request(base, "GET", "/console/", auth=VIEWER)[2]
    assert request(base, "GET", "/console/dlq/no-such-group", auth=VIEWER)[0] == 404

    # The admin's page, in the browser: the button is there.
    admin_base = base.replace("http://", f"http://{ADMIN[0]}:{ADMIN[1]}@")
    dom = page(tmp_path, admin_base, f"/console/dlq/{GROUP}")
    assert "resend" in dom.by_id and dom.text("dlq-waiting") == "1"
    assert [f for f in dom.forms if f["action"] == f"/console/dlq/{GROUP}/resend"]
    save_screenshot(tmp_path, admin_base, f"/console/dlq/{GROUP}", "console-dlq.png", 520)

    # Resending needs an admin, from the console's own page.
    path = f"/console/dlq/{GROUP}/resend"
    status, _h, body = request(base, "POST", path, auth=VIEWER, form={}, headers={"Origin": base})
    assert status == 403 and "admin" in body
    assert request(base, "POST", path, form={})[0] == 401
    status, _h, body = request(base, "POST", path, auth=ADMIN, form={}, headers={"Origin": "http://elsewhere.example"})
    assert status == 403 and "another site" in body
    assert 'id="dlq-waiting">1<' in request(base, "GET", f"/console/dlq/{GROUP}", auth=VIEWER)[2]
    status, _h, body = request(base, "POST", path, auth=ADMIN, form={"limit": "x"}, headers={"Origin": base})
    assert status == 400 and "whole number" in body

    status, _h, body = request(base, "POST", path, auth=ADMIN, form={}, headers={"Origin": base})
    assert status == 200 and 'id="resent">1 resent (0 already sent before), 0 skipped' in body
    assert 'id="dlq-waiting">0<' in body

    # kill -9 right after the answer: the resent message and the cursor survive.
    broker.proc.kill()
    broker.proc.wait(10)
    broker = chronoq_process(config)
    base = broker.http_url.rstrip("/")
    body = request(base, "GET", f"/console/dlq/{GROUP}?all=1", auth=VIEWER)[2]
    assert 'id="dlq-waiting">0<' in body and 'class="resent">yes<' in body
    status, _h, body = request(base, "GET", f"/console/topic/{topic}", auth=VIEWER)
    assert status == 200 and 'id="t-messages">2<' in body, "the poison message and its resent copy"
    status, _h, body = request(base, "POST", path, auth=ADMIN, form={}, headers={"Origin": base})
    assert status == 200 and 'id="resent">0 resent' in body
