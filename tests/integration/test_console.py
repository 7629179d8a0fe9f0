"""The web console (chronoq.console) against a real broker, read in headless Chromium.

The broker runs as a ``chronoq serve`` subprocess; traffic comes from the official RocketMQ
Python client: normal sends to two topics, timer messages due seconds, minutes, hours and days
ahead, a consumer that receives and acks some, and a group with max_attempts = 2 whose poison
message ends in the DLQ. Each page is then rendered by Debian's ``chromium`` (``--dump-dom``
returns the DOM after the page's scripts ran, so the charts are drawn) and must show the exact
figures of that traffic. The timer horizon page is also saved as a PNG in the test's tmp dir
(and, with ``CHRONOQ_UPDATE_SCREENSHOT=1``, as docs/images/console-timer-horizon.png).

Access control (401/403, admin-only writes) is checked over plain HTTP in the second test: it
is about status codes, not rendering.
"""

from __future__ import annotations

import base64
import gzip
import http.client
import os
import re
import shutil
import subprocess
import time
import urllib.parse
from html.parser import HTMLParser

import pytest
from rocketmq import ClientConfiguration, Credentials, Producer

from .conftest import ROOT, groups_toml, wait_until
from .test_official_python_client import Recorder, make_message, producer, push_consumer, simple_consumer, unique

CHROMIUM = shutil.which("chromium")
BROWSER_TIMEOUT_S = 90      # one chromium run (start, load, scripts, dump), hard bound
VIRTUAL_TIME_MS = 5000      # page scripts get this much virtual time before the dump
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DLQ_GROUP = "console-dlq"


# --------------------------------------------------------------------------- helpers
class Dom(HTMLParser):
    """Text of a rendered page, addressable by the nearest ancestor ``id`` and a class or data-ms."""

    VOID = {"area", "base", "br", "col", "embed", "hr", "img", "input", "link", "meta", "source", "track", "wbr"}

    def __init__(self, html: str):
        super().__init__()
        self.stack: list[dict] = []
        self.items: list[tuple[str | None, tuple[str, ...], str | None, str]] = []
        self.by_id: dict[str, str] = {}
        self.drawn = 0  # charts in the page (SVG drawn by the server)
        self.forms: list[dict] = []
        self.refreshes = 0  # auto-refreshes the page's script made (<body data-refreshes>)
        self.links: list[tuple[str | None, str, str]] = []  # (nearest data-ms, class, href)
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag == "svg" and "pygal-chart" in (a.get("class") or ""):
            self.drawn += 1
        if tag == "body":
            self.refreshes = int(a.get("data-refreshes") or 0)
        if tag == "form":
            self.forms.append({"action": a.get("action"), "fields": {}})
        if tag == "a" and a.get("href"):
            ms = next((e["data-ms"] for e in reversed(self.stack) if "data-ms" in e), None)
            self.links.append((ms, a.get("class", ""), a["href"]))
        if tag == "input" and self.forms and a.get("name"):
            self.forms[-1]["fields"][a["name"]] = a.get("value", "")
        if tag not in self.VOID:
            self.stack.append({"tag": tag, **a})

    def handle_endtag(self, tag):
        while self.stack:
            if self.stack.pop()["tag"] == tag:
                break

    def handle_data(self, data):
        text = data.strip()
        if not text or not self.stack:
            return
        ids = [e["id"] for e in self.stack if "id" in e]
        for i in ids:
            self.by_id[i] = (self.by_id.get(i, "") + " " + text).strip()
        ms = next((e["data-ms"] for e in reversed(self.stack) if "data-ms" in e), None)
        classes = tuple(self.stack[-1].get("class", "").split())
        self.items.append((ids[-1] if ids else None, classes, ms, text))

    def text(self, id_: str) -> str:
        return self.by_id[id_]

    def cell(self, id_: str, cls: str) -> str:
        hits = [t for i, c, _ms, t in self.items if i == id_ and cls in c]
        assert len(hits) == 1, (id_, cls, hits)
        return hits[0]

    def number(self, id_: str, cls: str | None = None) -> int:
        text = self.cell(id_, cls) if cls else self.text(id_)
        return int(text.split()[0].replace(",", ""))

    def column(self, id_: str, cls: str) -> list[str]:
        return [t for i, c, _ms, t in self.items if i == id_ and cls in c]

    def by_ms(self, id_: str) -> dict[int, int]:
        return {int(ms): int(t.replace(",", "")) for i, c, ms, t in self.items if i == id_ and ms and "pending" in c}


def chromium(tmp_path, url: str, *args: str) -> subprocess.CompletedProcess:
    profile = tmp_path / "chromium-profile"  # its own profile: no state shared with other runs
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--hide-scrollbars",
           f"--user-data-dir={profile}", f"--virtual-time-budget={VIRTUAL_TIME_MS}", *args, url]
    done = subprocess.run(cmd, capture_output=True, timeout=BROWSER_TIMEOUT_S)
    assert done.returncode == 0, done.stderr.decode(errors="replace")[-3000:]
    return done


def page(tmp_path, base: str, path: str) -> Dom:
    html = chromium(tmp_path, base + path, "--dump-dom").stdout.decode()
    assert "</html>" in html, html[-500:]
    return Dom(html)


def request(base: str, method: str, path: str, *, auth: tuple[str, str] | None = None, form: dict | None = None,
         headers: dict | None = None) -> tuple[int, dict, str]:
    """One request (redirects not followed): (status, headers, body)."""
    parts = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    h = dict(headers or {})
    if auth:
        h["Authorization"] = "Basic " + base64.b64encode(f"{auth[0]}:{auth[1]}".encode()).decode()
    body = None
    if form is not None:
        body = urllib.parse.urlencode(form)
        h["Content-Type"] = "application/x-www-form-urlencoded"
    try:
        conn.request(method, path, body=body, headers=h)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read().decode()
    finally:
        conn.close()


def receive_some(consumer, count: int, invisible_s: int, timeout_s: float = 20) -> list:
    got: list = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += consumer.receive(count - len(got), invisible_s)
    return got


def expected_bins(dues_ms: list[int], start_ms: int, step_ms: int, count: int) -> dict[int, int]:
    bins: dict[int, int] = {}
    for due in dues_ms:
        i = (due - start_ms) // step_ms
        if 0 <= i < count:
            bins[start_ms + i * step_ms] = bins.get(start_ms + i * step_ms, 0) + 1
    return bins


# --------------------------------------------------------------------------- the browser test
@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH (scripts/setup installs Debian's chromium "
                                             "when run as root with apt-get)")
def test_console_pages_show_the_real_numbers(chronoq_process, tmp_path):
    config = groups_toml({DLQ_GROUP: {"max_attempts": 2}}) + "[console]\nlateness_interval_s = 1\nhistory_interval_s = 1\n"
    broker = chronoq_process(config)
    ep, base = broker.endpoint, broker.http_url.rstrip("/")
    orders, audit, billing = unique("orders"), unique("audit"), unique("billing")
    now_s = int(time.time())
    # Timer messages: two due in seconds (delivered during the test), the rest minutes to days ahead.
    soon = {"soon1": now_s + 2, "soon2": now_s + 3}
    later = {"m5": now_s + 300, "m5b": now_s + 310, "m20": now_s + 1200, "h3": now_s + 3 * 3600,
             "h3b": now_s + 3 * 3600 + 60, "h30": now_s + 30 * 3600, "d3": now_s + 3 * 86400}
    # Background load for the horizon: a few messages in most minutes of the hour and in some
    # hours of the week (so the charts, and the screenshot, show a shape).
    for minute in range(2, 59):
        for j in range(1 if minute % 2 == 0 else minute % 3):
            later[f"pm{minute}-{j}"] = now_s + minute * 60 + 5 * j
    for hour in range(3, 166, 3):
        for j in range(4 + (hour * 5) % 17):
            later[f"ph{hour}-{j}"] = now_s + hour * 3600 + 150 + 30 * j  # (mid-hour: one bar per hour)
    ids: dict[str, str] = {}
    with producer(ep, orders, audit) as p:
        for i in range(5):
            ids[f"a{i}"] = p.send(make_message(orders, b"a%d" % i, keys=(f"key-a{i}",))).message_id
        for i in range(3):
            ids[f"b{i}"] = p.send(make_message(audit, b"b%d" % i, keys=(f"key-b{i}",))).message_id
        futures = {}
        for name, due in {**soon, **later}.items():
            m = make_message(orders, name.encode(), keys=(f"key-{name}",))
            m.delivery_timestamp = due
            futures[name] = p.send_async(m)
        ids.update({name: f.result(30).message_id for name, f in futures.items()})
        ids["poison"] = p.send(make_message(audit, b"poison", keys=("key-poison",))).message_id

    # Both soon messages delivered (the lateness page counts timer deliveries).
    wait_until(lambda: 'id="lat-count">2<' in request(base, "GET", "/console/lateness")[2], 20,
               what="two timer deliveries")
    # A consumer receives 4 of the 7 visible messages of `orders` and acks 3 of them.
    with simple_consumer(ep, billing, orders) as c:
        got = receive_some(c, 4, invisible_s=600)
        assert len(got) == 4
        for m in got[:3]:
            c.ack(m)
    # A group with max_attempts = 2 fails the poison message until it is dead-lettered.
    listener = Recorder(lambda m: m.body == b"poison")
    with push_consumer(ep, DLQ_GROUP, audit, listener):
        wait_until(lambda: re.search(r'class="n dlq"[^>]*>1<', request(base, "GET", "/console/")[2]), 40,
                   what="the poison message in the DLQ")
    assert listener.bodies().count(b"poison") == 2

    # ---- topics and groups
    dom = page(tmp_path, base, "/console/")
    assert dom.number("topic-" + orders, "messages") == 7  # 5 normal + 2 timer messages now visible
    assert dom.number("topic-" + audit, "messages") == 4
    assert dom.number("sum-topics") == 2
    assert dom.number("group-" + billing, "lag") == 3          # 7 visible, 4 received
    assert dom.number("group-" + billing, "inflight") == 1     # received, not acked
    assert dom.number("group-" + billing, "dlq") == 0
    assert dom.number("group-" + DLQ_GROUP, "dlq") == 1
    assert dom.number("group-" + DLQ_GROUP, "lag") == 0
    assert dom.number("group-" + DLQ_GROUP, "inflight") == 0
    assert dom.number("sum-dlq") == 1 and dom.number("sum-inflight") == 1
    assert dom.drawn == 2, "the traffic charts: rates and queue depth"
    kept = int(re.search(r"\((\d+) of at most\s+720\s+kept", dom.text("history-note")).group(1))
    assert kept >= 2  # one sample a second since the broker started
    assert "create-topic" not in dom.by_id and not [f for f in dom.forms if f["action"] == "/console/topics"], \
        "read-only: no create-topic form"
    save_screenshot(tmp_path, base, "/console/", "console-overview.png", 1500)

    # ---- one topic's page, and auto-refresh (the page's script fetches it again and swaps it in)
    dom = page(tmp_path, base, f"/console/topic/{orders}?refresh=1")
    assert dom.refreshes >= 1, "auto-refresh swapped the page in at least once"
    assert dom.text("t-type") == "mixed" and dom.number("t-queues") == 4
    assert sum(dom.number(f"queue-{q}", "messages") for q in range(4)) == dom.number("t-messages") == 7
    assert all(dom.number(f"queue-{q}", "min") == 0 for q in range(4))
    assert sum(dom.number(f"queue-{q}", "max") for q in range(4)) == dom.number("t-written") == 7
    assert dom.number("t-sent") == 5 + len(soon) + len(later)  # normal and timer sends to this topic
    assert dom.number("tg-" + billing, "lag") == 3 and dom.number("tg-" + billing, "inflight") == 1
    assert "tg-" + DLQ_GROUP not in dom.by_id  # it reads audit, not orders
    assert dom.drawn == 2, "the topic's horizon charts"
    start = int(next(ms for i, _c, ms, _t in dom.items if i == "t-horizon-start"))
    dues = [s * 1000 for s in later.values()]  # every pending timer message is in orders
    assert dom.by_ms("topic-hours") == expected_bins(dues, start, 3_600_000, 168)
    assert dom.number("t-due-week") == len(later)
    assert dom.number("t-due-hour") == sum(1 for d in dues if d < start + 3_600_000)
    other = page(tmp_path, base, f"/console/topic/{audit}")
    assert other.number("t-due-week") == 0 and other.by_ms("topic-hours") == {}
    save_screenshot(tmp_path, base, f"/console/topic/{orders}", "console-topic.png", 1500)
    status, _h, _b = request(base, "GET", "/console/topic/" + unique("none"))
    assert status == 404

    # ---- timer horizon (and its screenshot)
    dom = page(tmp_path, base, "/console/timers")
    assert dom.drawn == 2, "both horizon charts drawn"
    start = int(next(ms for i, _c, ms, _t in dom.items if i == "horizon-start"))
    dues = [s * 1000 for s in later.values()]
    assert dom.by_ms("minutes") == expected_bins(dues, start, 60_000, 60)
    assert dom.by_ms("hours") == expected_bins(dues, start, 3_600_000, 168)
    assert dom.number("due-hour") == sum(1 for d in dues if d < start + 3_600_000)
    assert dom.number("due-week") == len(later) and dom.number("overdue") == 0
    save_screenshot(tmp_path, base, "/console/timers", "console-timer-horizon.png", 1150)

    # ---- each bin links to the list of its pending messages (in due order, paged)
    # The bin of the ph3-* messages (due 150..690 s after the third hour from now: always inside one
    # bin, wherever the current bucket starts)
    h3_start = start + (later["ph3-0"] * 1000 - start) // 3_600_000 * 3_600_000
    [link] = [href for ms, cls, href in dom.links if ms == str(h3_start) and cls == "list"
              and "to=%d" % (h3_start + 3_600_000) in href]
    in_bin = {name: due * 1000 for name, due in later.items() if h3_start <= due * 1000 < h3_start + 3_600_000}
    assert len(in_bin) > 8 and {f"ph3-{j}" for j in range(19)} <= set(in_bin)
    listed, url, pages = [], link + "&limit=8", 0
    while url:  # bounded: a page is 8 of about 20
        pages += 1
        assert pages <= 5
        dom_list = page(tmp_path, base, url)
        listed += [(int(ms), t) for i, _c, ms, t in dom_list.items if i == "pending-" + t]
        url = next((href for _ms, _c, href in dom_list.links if "cursor=" in href), "")  # "next page"
    assert pages == 3
    # Exactly the bin's messages, in due order (their due times are distinct), each once.
    assert [t for _ms, t in listed] == [ids[n] for n in sorted(in_bin, key=in_bin.get)]
    assert [ms for ms, _t in listed] == sorted(in_bin.values())
    first = [href for ms, cls, href in dom.links if ms == str(start) and cls == "list"]
    assert all("from=" not in href for href in first)  # the first bin's list includes what is overdue
    dom_list = page(tmp_path, base, "/console/timers/pending?key=key-m20")
    assert [t for i, c, _ms, t in dom_list.items if i == "pending-" + ids["m20"] and c == ("keys",)] == ["key-m20"]
    save_screenshot(tmp_path, base, link.replace("&amp;", "&") + "&limit=12", "console-pending.png", 700)

    # ---- lateness
    dom = page(tmp_path, base, "/console/lateness")
    assert dom.drawn == 1
    assert dom.number("lat-count") == 2 and dom.number("lat-early") == 0
    assert sum(int(t) for t in dom.column("intervals", "count")) == 2  # every delivery in some interval

    # ---- message lookup: by key, an acked message; by id, the dead letter; a pending timer
    acked = got[0]
    key = f"key-{acked.body.decode()}"
    dom = page(tmp_path, base, "/console/lookup?q=" + key)
    kinds = dom.column("life-" + acked.message_id, "kind")
    assert kinds[-2:] == ["delivered", "acked"] and kinds[0] == "stored"
    assert kinds == (["stored", "visible", "delivered", "acked"] if acked.body.startswith(b"soon")
                     else ["stored", "delivered", "acked"])
    assert dom.text("status-" + acked.message_id) == f"acked ({billing})"
    original = next(t for i, c, _ms, t in dom.items if i and i.startswith("body-") and "body-text" in c)
    assert original == acked.body.decode(), "the body, as text"
    save_screenshot(tmp_path, base, "/console/lookup?q=" + key, "console-lookup.png", 700)

    dom = page(tmp_path, base, "/console/lookup?q=" + ids["poison"])
    assert dom.column("life-" + ids["poison"], "kind") == ["stored", "delivered", "delivered", "dead_lettered"]
    assert dom.text("status-" + ids["poison"]) == f"dead-lettered ({DLQ_GROUP})"

    dom = page(tmp_path, base, "/console/lookup?q=key-m20")
    assert dom.column("life-" + ids["m20"], "kind") == ["stored"]
    assert dom.text("status-" + ids["m20"]) == "pending"
    assert not [f for f in dom.forms if f["action"] == "/console/recall"], "read-only: no Recall button"

    # Access control is off: the console is read-only, a recall is refused and changes nothing.
    status, _h, body = request(base, "POST", "/console/recall", form={"handle": "x", "q": "key-m20"})
    assert status == 403 and "read-only" in body
    status, _h, _body = request(base, "POST", "/console/topics", form={"name": unique("nope")})
    assert status == 403
    assert 'id="status-%s">pending<' % ids["m20"] in request(base, "GET", "/console/lookup?q=key-m20")[2]


def save_screenshot(tmp_path, base: str, path: str, name: str, height: int) -> None:
    """A PNG of the page in the test's tmp dir (and in docs/images with CHRONOQ_UPDATE_SCREENSHOT=1)."""
    shot = tmp_path / name
    chromium(tmp_path, base + path, f"--screenshot={shot}", f"--window-size=1280,{height}")
    assert shot.read_bytes().startswith(PNG_MAGIC) and shot.stat().st_size > 10_000
    if os.environ.get("CHRONOQ_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, os.path.join(ROOT, "docs", "images", name))


def test_console_pages_and_files_go_out_compressed(chronoq_process):
    base = chronoq_process().http_url.rstrip("/")
    status, headers, zipped = raw(base, "/console/timers", {"Accept-Encoding": "gzip"})
    assert b"Timer horizon" in gzip.decompress(zipped)
    assert status == 200 and headers["content-encoding"] == "gzip" and headers["cache-control"] == "no-store"
    for name in ("console.js", "console.css"):
        status, headers, zipped = raw(base, f"/console/static/{name}", {"Accept-Encoding": "gzip"})
        assert status == 200 and headers["content-encoding"] == "gzip" and "max-age" in headers["cache-control"]
        status, plain_headers, plain = raw(base, f"/console/static/{name}", {})
        assert "content-encoding" not in plain_headers and gzip.decompress(zipped) == plain
        status, _h, _b = raw(base, f"/console/static/{name}", {"If-None-Match": headers["etag"]})
        assert status == 304
    assert request(base, "GET", "/console/static/plotly.min.js")[0] == 404


def test_without_access_control_the_console_answers_only_requests_addressed_to_this_machine(chronoq_process):
    # DNS rebinding: another site's name pointed at 127.0.0.1 is same-origin with the console for
    # the browser, so its page could read every console page, message bodies included.
    port_base = chronoq_process('[console]\nallowed_hosts = ["ops.internal"]\n').http_url.rstrip("/")
    port = urllib.parse.urlsplit(port_base).port
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"ops.internal:{port}"):
        assert request(port_base, "GET", "/console/", headers={"Host": host})[0] == 200, host
    status, _h, body = request(port_base, "GET", "/console/lookup?q=x", headers={"Host": f"evil.example:{port}"})
    assert status == 403 and "allowed_hosts" in body and "evil.example" in body
    assert request(port_base, "GET", "/metrics", headers={"Host": f"evil.example:{port}"})[0] == 200  # scrapers


def raw(base: str, path: str, headers: dict) -> tuple[int, dict, bytes]:
    parts = urllib.parse.urlsplit(base)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    try:
        conn.request("GET", path, headers=headers)
        resp = conn.getresponse()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read()
    finally:
        conn.close()


# --------------------------------------------------------------------------- access control
ADMIN, VIEWER = ("ops", "ops-secret-4c1d"), ("viewer", "viewer-secret-77e2")
AUTH_CONFIG = f"""
[auth]
enabled = true

[[auth.users]]
access_key = "{ADMIN[0]}"
secret_key = "{ADMIN[1]}"
admin = true

[[auth.users]]
access_key = "{VIEWER[0]}"
secret_key = "{VIEWER[1]}"
publish = ["*"]
subscribe = ["*", "%DLQ%*"]   # (dead letters: a pattern that spells the prefix out)
groups = ["*"]
"""


def test_console_needs_credentials_and_writes_need_an_admin(chronoq_process):
    broker = chronoq_process(AUTH_CONFIG)
    ep, base = broker.endpoint, broker.http_url.rstrip("/")
    topic = unique("cancel")
    p = Producer(ClientConfiguration(ep, Credentials(*ADMIN), request_timeout=3), (topic,))
    p.startup()
    try:
        m = make_message(topic, b"cancel me", keys=("key-cancel",))
        m.delivery_timestamp = int(time.time()) + 1800
        mid = p.send(m).message_id
    finally:
        p.shutdown()

    # Reading needs any valid user; without one, a challenge so the browser asks.
    status, headers, _ = request(base, "GET", "/console/")
    assert status == 401 and headers["www-authenticate"].startswith("Basic realm=")
    # No other site may frame a page (a framed console's buttons would be pressed by clicks on the
    # framing page: the same-origin check on posts cannot tell), on any answer of the port.
    for path, auth in (("/console/", None), ("/console/", VIEWER), ("/console/static/console.js", VIEWER),
                       ("/metrics", None), ("/healthz", None), ("/console/no-such-page", VIEWER)):
        _status, headers, _ = request(base, "GET", path, auth=auth)
        assert headers["x-frame-options"] == "DENY", (path, headers)
        assert headers["content-security-policy"] == "frame-ancestors 'none'", (path, headers)
        assert headers["x-content-type-options"] == "nosniff", (path, headers)
    assert request(base, "GET", "/console/timers", auth=(VIEWER[0], "wrong"))[0] == 401
    assert request(base, "GET", "/console/lookup?q=x", auth=("nobody", VIEWER[1]))[0] == 401
    status, _h, body = request(base, "GET", "/console/lookup?q=key-cancel", auth=VIEWER)
    assert status == 200 and f'id="status-{mid}">pending<' in body
    assert 'action="/console/recall"' not in body, "no Recall button for a user who may not recall"
    assert 'id="create-topic"' not in request(base, "GET", "/console/", auth=VIEWER)[2]
    body = request(base, "GET", "/console/lookup?q=key-cancel", auth=ADMIN)[2]
    handle = re.search(r'name="handle" value="([^"]+)"', body).group(1)  # an admin gets the button
    assert 'id="create-topic"' in request(base, "GET", "/console/", auth=ADMIN)[2]
    assert request(base, "GET", "/metrics")[0] == 200  # the console's access rule is its own: /metrics is apart

    # Writing needs an admin user, from the console's own pages.
    form = {"handle": handle, "q": "key-cancel"}
    status, _h, body = request(base, "POST", "/console/recall", auth=VIEWER, form=form)
    assert status == 403 and "admin" in body
    assert request(base, "POST", "/console/recall", form=form)[0] == 401
    status, _h, body = request(base, "POST", "/console/recall", auth=ADMIN, form=form,
                            headers={"Origin": "http://elsewhere.example"})
    assert status == 403 and "another site" in body
    assert f'id="status-{mid}">pending<' in request(base, "GET", "/console/lookup?q=key-cancel", auth=VIEWER)[2]

    status, headers, _ = request(base, "POST", "/console/recall", auth=ADMIN, form=form,
                              headers={"Origin": base})
    assert status == 303
    status, _h, body = request(base, "GET", headers["location"], auth=ADMIN)
    assert status == 200 and "cancelled" in body and f'id="status-{mid}">recalled<' in body

    name = unique("made-here")
    assert request(base, "POST", "/console/topics", auth=VIEWER, form={"name": name, "queues": "2"})[0] == 403
    status, headers, _ = request(base, "POST", "/console/topics", auth=ADMIN, form={"name": name, "queues": "2"})
    assert status == 303
    body = request(base, "GET", "/console/", auth=VIEWER)[2]
    assert re.search(rf'id="topic-{name}">.*?class="n queues">2<', body, re.S)
    status, _h, body = request(base, "POST", "/console/topics", auth=ADMIN, form={"name": "%DLQ%x"})
    assert status == 400 and "not created" in body


def test_a_user_sees_the_messages_of_the_topics_it_may_read_only(chronoq_process):
    """Any signed-in user could read every topic's messages in the console (bodies and keys in the
    lookup, ids and keys on the pending page, dead letters), whatever its rights on the gRPC
    port. A user now sees those of the topics it may subscribe to; an admin sees all."""
    narrow = ("orders-reader", "orders-secret-91aa")
    broker = chronoq_process(AUTH_CONFIG + f"""
[[auth.users]]
access_key = "{narrow[0]}"
secret_key = "{narrow[1]}"
subscribe = ["orders-*"]
groups = ["g-orders"]
""")
    ep, base = broker.endpoint, broker.http_url.rstrip("/")
    secret_topic, open_topic = unique("payroll"), unique("orders-")
    p = Producer(ClientConfiguration(ep, Credentials(*ADMIN), request_timeout=3), (secret_topic, open_topic))
    p.startup()
    try:
        for topic, text in ((secret_topic, b"salary 9000"), (open_topic, b"order 1")):
            m = make_message(topic, text, keys=("shared-key",))
            m.delivery_timestamp = int(time.time()) + 1800
            p.send(m)
    finally:
        p.shutdown()

    status, _h, body = request(base, "GET", "/console/lookup?q=shared-key", auth=narrow)
    assert status == 200 and "order 1" in body and "salary 9000" not in body and secret_topic not in body
    assert 'id="hidden">1 message(s)' in body
    body = request(base, "GET", "/console/lookup?q=shared-key", auth=ADMIN)[2]
    assert "order 1" in body and "salary 9000" in body and 'id="hidden"' not in body
    body = request(base, "GET", "/console/timers/pending", auth=narrow)[2]
    assert open_topic in body and secret_topic not in body
    assert secret_topic in request(base, "GET", "/console/timers/pending", auth=ADMIN)[2]
    assert request(base, "GET", "/console/dlq/g-payroll", auth=narrow)[0] == 403
