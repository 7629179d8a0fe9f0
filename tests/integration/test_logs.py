"""The log of a real ``chronoq serve``: every line with a time and a level, as text or JSON, and one
clear line (no traceback) when a gRPC client dials the HTTP port by mistake."""

from __future__ import annotations

import json
import re

import grpc
import pytest

from chronoq.core import errors
from chronoq.core.config import load_config

from .conftest import wait_until

TEXT_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) [\w.]+: ")
WRONG_PORT = "spoke HTTP/2 (gRPC?) to the HTTP port"


def dial_the_http_port(server) -> None:
    """A real gRPC call (the official stack, grpcio) to the broker's HTTP port."""
    with grpc.insecure_channel(f"127.0.0.1:{server.http_port}") as channel:
        with pytest.raises(grpc.RpcError) as info:
            channel.unary_unary("/apache.rocketmq.v2.MessagingService/QueryRoute")(b"", timeout=10)
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE


def stderr_of(server) -> str:
    with open(server.stderr_path, errors="replace") as fh:
        return fh.read()


def test_text_lines_and_a_grpc_client_on_the_http_port(chronoq_process):
    server = chronoq_process()
    dial_the_http_port(server)
    wait_until(lambda: WRONG_PORT in stderr_of(server), 15, 0.05, "the wrong-port line")
    text = stderr_of(server)
    assert "Traceback" not in text and "aiohttp" not in text, text
    said = [line for line in text.splitlines() if WRONG_PORT in line]
    assert len(said) == 1 and said[0].startswith(tuple("0123456789")), said
    assert f"gRPC clients belong on {server.endpoint}" in said[0]
    for line in text.splitlines():
        assert TEXT_LINE.match(line), line
    # stdout's start-up story stays plain text: scripts read "chronoq is ready; ..." from its start.
    ready = [line for line in server.lines if "chronoq is ready" in line]
    assert len(ready) == 1 and ready[0].startswith("chronoq is ready; RocketMQ gRPC on "), server.lines
    assert not any(TEXT_LINE.match(line) for line in server.lines), server.lines


def test_json_lines(chronoq_process):
    server = chronoq_process(extra_args=("--log-format", "json", "--log-level", "warning"))
    dial_the_http_port(server)
    wait_until(lambda: WRONG_PORT in stderr_of(server), 15, 0.05, "the wrong-port line")
    server.stop()
    logged = [json.loads(line) for line in stderr_of(server).splitlines()]
    records = logged + [json.loads(line) for line in server.lines]
    for record in records:
        assert set(record) <= {"time", "level", "logger", "message", "exception"}, record
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record["time"]), record
        assert record["level"] in ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    assert [r["level"] for r in records if WRONG_PORT in r["message"]] == ["WARNING"]
    assert any(r["logger"] == "chronoq.announce" and r["message"].startswith("chronoq is ready") for r in records)
    assert any(r["message"] == "chronoq stopped cleanly" for r in records)
    assert {r["level"] for r in logged} == {"WARNING"}  # --log-level: no INFO on stderr


def test_malformed_http_requests_are_counted_not_logged_one_traceback_each(chronoq_process):
    # aiohttp logged a 9-line ERROR traceback for every request its parser refused: anyone who
    # could reach the HTTP port, no credentials needed, could fill the log (a 9 KiB header, say).
    import http.client
    import urllib.request

    server = chronoq_process()
    for _ in range(40):
        conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
        try:
            conn.request("GET", "/console/", headers={"X-Big": "a" * 9000})
            assert conn.getresponse().status == 400
        finally:
            conn.close()
    def counted() -> str:
        text = urllib.request.urlopen(f"{server.http_url.rstrip('/')}/metrics", timeout=10).read().decode()
        return re.search(r'^chronoq_requests_refused_total\{reason="http_bad_request"\} (\S+)$', text, re.M).group(1)

    wait_until(lambda: counted() == "40.0", 15, 0.05, "40 refusals counted")
    text = stderr_of(server)
    assert "Traceback" not in text and "aiohttp" not in text, text[-3000:]
    said = [line for line in text.splitlines() if "refused http_bad_request" in line]
    assert len(said) == 1 and "malformed HTTP request on the HTTP port" in said[0], said  # 1 line per 10 s


def test_log_format_setting():
    assert load_config(None, env={}).log_format == "text"
    assert load_config(None, env={"CHRONOQ_LOG_FORMAT": "json"}).log_format == "json"
    assert load_config(None, env={}, overrides={"log_format": "json"}).log_format == "json"
    with pytest.raises(errors.ClientError, match="log_format must be 'text' or 'json'"):
        load_config(None, env={"CHRONOQ_LOG_FORMAT": "xml"})
    with pytest.raises(errors.ClientError, match="log_level must be"):
        load_config(None, env={"CHRONOQ_LOG_LEVEL": "loud"})
