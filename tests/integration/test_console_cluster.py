"""The console's cluster page (``/console/cluster``, chronoq.console.cluster) against real
processes: a primary with a real replica (``chronoq serve --replica-of``) fed through the official
Python client, and a single node with access control on. Read over plain HTTP: the page is
tables and two server-drawn charts, nothing a script changes; Chromium only takes its picture."""

from __future__ import annotations

import re

from .conftest import ChronoqProcess, wait_until
from .etcd_fixture import etcd  # noqa: F401 - the fixture
from .test_console import ADMIN, AUTH_CONFIG, CHROMIUM, VIEWER, request, save_screenshot
from .test_official_python_client import make_message, producer, unique
from .test_etcd_failover import start
from .test_replication import cluster_status

HISTORY = "[console]\nhistory_interval_s = 0.2\n"


def cell(body: str, row_id: str, cls: str) -> str:
    found = re.search(rf'<tr id="{re.escape(row_id)}">.*?class="[^"]*\b{cls}\b[^"]*"[^>]*>([^<]*)<', body, re.S)
    assert found, (row_id, cls, body[-3000:])
    return found.group(1).strip()


def card(body: str, id_: str) -> str:
    found = re.search(rf'id="{id_}">([^<]*)<', body)
    assert found, (id_, body[-3000:])
    return found.group(1).strip()


def test_cluster_page_shows_the_replica_its_position_and_in_sync(tmp_path):
    """... and, with chromium on PATH, saves it as a PNG (docs/images/console-cluster.png with
    ``CHRONOQ_UPDATE_SCREENSHOT=1``)."""
    primary = ChronoqProcess(str(tmp_path / "p"), HISTORY)
    replica = None
    try:
        replica = ChronoqProcess(str(tmp_path / "r"), HISTORY, extra_args=("--replica-of", primary.endpoint))
        assert replica.http_url is None  # a replica serves no HTTP listener (documented on the page)
        topic = unique("repl")
        with producer(primary.endpoint, topic) as p:
            for i in range(50):
                p.send(make_message(topic, b"m%d" % i + b"x" * 1000))
        base = primary.http_url.rstrip("/")
        row = f"replica-{replica.endpoint}"

        def caught_up():
            status, _h, body = request(base, "GET", "/console/cluster")
            assert status == 200, body
            if row not in body:
                return None
            end = int(card(body, "commit-end").replace(",", ""))
            pos = int(cell(body, row, "position").replace(",", ""))
            return body if pos == end and end > 50_000 and 'id="chart-repl-bytes"' in body else None

        body = wait_until(caught_up, 30, 0.2, "the page to show the replica caught up")
        assert cell(body, row, "endpoint") == replica.endpoint
        assert cell(body, row, "insync") == "in sync"
        assert cell(body, row, "lag-bytes") == "0"
        assert card(body, "role") == "primary" and card(body, "epoch") == "0" and card(body, "mode") == "async"
        assert card(body, "replica-count") == "1" and 'id="single-node"' not in body
        assert "chronoq promote" in card_text(body, "read-only") and "<form" not in body  # read-only
        # The replica holds what the page says it reported (its own status, asked over gRPC).
        shown = int(cell(body, row, "position").replace(",", ""))
        assert cluster_status(replica.endpoint).commit_end >= shown
        assert [r.endpoint for r in cluster_status(primary.endpoint).replicas] == [replica.endpoint]
        overview = request(base, "GET", "/console/")[2]
        assert "primary, epoch 0: 1 replica(s), 1 in sync" in overview
        if CHROMIUM is not None:
            save_screenshot(tmp_path, base, "/console/cluster", "console-cluster.png", 1250)
    finally:
        if replica is not None:
            replica.stop()
        primary.stop()


def card_text(body: str, id_: str) -> str:
    found = re.search(rf'id="{id_}">(.*?)</p>', body, re.S)
    assert found, id_
    return found.group(1)


def test_single_node_page_says_so_and_a_viewer_may_read_it(chronoq_process):
    broker = chronoq_process(AUTH_CONFIG)
    base = broker.http_url.rstrip("/")
    status, headers, _ = request(base, "GET", "/console/cluster")
    assert status == 401 and headers["www-authenticate"].startswith("Basic realm=")
    assert request(base, "GET", "/console/cluster", auth=(VIEWER[0], "wrong"))[0] == 401
    for user in (VIEWER, ADMIN):
        status, _h, body = request(base, "GET", "/console/cluster", auth=user)
        assert status == 200, body
        assert "Single node (no replicas)" in card_text(body, "single-node")
        assert 'id="replicas"' not in body and card(body, "replica-count") == "0"
        assert card(body, "role") == "primary" and 'id="etcd"' not in body
    assert "single node (no replicas)" in request(base, "GET", "/console/", auth=VIEWER)[2]
    assert request(base, "POST", "/console/cluster", auth=ADMIN)[0] == 405  # nothing to change here


def test_with_etcd_the_page_shows_the_leader_the_in_sync_set_and_fencing(tmp_path, etcd):  # noqa: F811
    cluster = unique("c")
    a = start(tmp_path, "a", etcd.config(cluster))
    b = None
    try:
        b = start(tmp_path, "b", etcd.config(cluster))  # follows a: etcd names a the leader
        base = a.http_url.rstrip("/")

        def shown():
            body = request(base, "GET", "/console/cluster")[2]
            ok = f'id="replica-{b.endpoint}"' in body and b.endpoint in card(body, "etcd-insync")
            return body if ok and cell(body, f"replica-{b.endpoint}", "insync") == "in sync" else None

        body = wait_until(shown, 30, 0.2, "the page to show b in etcd's in-sync set")
        # (The node's own epoch is ClusterStatus's: a first leader's epoch record at log offset 0 is
        # not in its epoch history today, so both say 0 there while etcd says 1.)
        assert card(body, "epoch") == str(cluster_status(a.endpoint).epoch) and card(body, "etcd-epoch") == "1"
        assert card(body, "etcd-leader") == f"{a.endpoint} (epoch 1)"
        assert a.endpoint in card(body, "etcd-insync") and "leads, not fenced" in card(body, "fenced-state")
        assert b.endpoint in card(body, "etcd-members") and 'id="fenced"' not in body
        etcd.stop()  # a primary that cannot renew its lease fences itself; the page says so

        def fenced():
            text = request(base, "GET", "/console/cluster")[2]
            return text if 'id="fenced"' in text else None

        body = wait_until(fenced, 30, 0.2, "the page to show a fenced primary")
        assert card(body, "fenced-state").startswith("fenced") and "could not read" in body
    finally:
        if b is not None:
            b.stop(check=False)
        a.stop(check=False)
