"""The console's schedules page against a real broker, read in headless Chromium: every schedule
created through the CLI is listed with the next firings the Admin service reports (in the
schedule's zone and in UTC) and its state. The page is also saved as a PNG in the test's tmp dir
(and, with ``CHRONOQ_UPDATE_SCREENSHOT=1``, as docs/images/console-schedules.png)."""

from __future__ import annotations

import os
import shutil
from datetime import datetime
from zoneinfo import ZoneInfo

import pytest

from .conftest import ROOT
from .test_cli import make_cli
from .test_console import CHROMIUM, PNG_MAGIC, chromium, page


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not on PATH (scripts/setup installs Debian's chromium "
                                             "when run as root)")
def test_console_lists_schedules_with_their_next_firings(chronoq_process, tmp_path):
    proc = chronoq_process()
    cli = make_cli(proc.endpoint)
    cli("topic", "create", "reports")
    cli("schedule", "create", "daily-report", "reports", "--cron", "30 9 * * 1-5", "--tz", "Europe/Berlin",
        "--body", "run the report")
    cli("schedule", "create", "nightly-cleanup", "reports", "--cron", "30 2 * * *", "--tz", "America/New_York",
        "--body", "clean", "--catch-up", "skip")
    cli("schedule", "create", "heartbeat", "reports", "--every", "3600", "--body", "ping", "--catch-up", "all")
    cli("schedule", "create", "lord-howe", "reports", "--cron", "0 */6 * * *", "--tz", "Australia/Lord_Howe",
        "--body", "x")
    cli("schedule", "pause", "lord-howe")
    listed = {s["name"]: s for s in cli.json("schedule", "list")}
    base = proc.http_url.rstrip("/")
    dom = page(tmp_path, base, "/console/schedules")
    for name, s in listed.items():
        row = dom.text(f"schedule-{name}")
        assert s["topic"] in row and s["time_zone"] in row and s["catch_up"] in row
        assert dom.cell(f"schedule-{name}", "state") == ("paused" if s["paused"] else "active")
        shown = list(dict.fromkeys(int(ms) for i, _c, ms, _t in dom.items if i == f"schedule-{name}" and ms))
        assert shown == [t for t in s["next_ms"]], name  # the page and the Admin service agree
        for t in shown:
            local = datetime.fromtimestamp(t / 1000, ZoneInfo(s["time_zone"])).strftime("%Y-%m-%d %H:%M:%S")
            assert local in row
    assert len(listed["daily-report"]["next_ms"]) == 5 and listed["lord-howe"]["next_ms"] == []
    assert all(datetime.fromtimestamp(t / 1000, ZoneInfo("Europe/Berlin")).strftime("%H:%M") == "09:30"
               for t in listed["daily-report"]["next_ms"])
    shot = tmp_path / "console-schedules.png"
    chromium(tmp_path, base + "/console/schedules", f"--screenshot={shot}", "--window-size=1280,1150")
    assert shot.read_bytes().startswith(PNG_MAGIC) and shot.stat().st_size > 10_000
    if os.environ.get("CHRONOQ_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(shot, os.path.join(ROOT, "docs", "images", "console-schedules.png"))
