"""Spark fixtures: ONE local SparkSession for the whole test session, a fresh broker per test.

The session follows shared/spark/pyspark-datasource.md §9: ``local[2]``, loopback only, UI off,
errors-only logs, scratch files in a temporary directory, ``-Xss8m``. Each test gets its own
``chronoq serve`` subprocess (``broker``) and its own checkpoint directories (``tmp_path``).
Streaming tests use ``trigger(availableNow=True)`` and ``awaitTermination(timeout)``, not sleeps.
"""

from __future__ import annotations

import os
import shutil

import pytest

pytest.importorskip("pyspark")
pytest.importorskip("pyarrow")
if shutil.which("java") is None and not os.environ.get("JAVA_HOME"):
    pytest.skip("the Spark tests need Java 17 (java on PATH or JAVA_HOME)", allow_module_level=True)

from tests.integration.conftest import ChronoqProcess, wait_until  # noqa: E402,F401

QUERY_TIMEOUT_S = 120


@pytest.fixture(scope="session")
def spark(tmp_path_factory):
    from chronoq.spark.session import local_session

    scratch = tmp_path_factory.mktemp("spark")
    settings = {"spark.sql.shuffle.partitions": "2", "spark.default.parallelism": "2"}
    try:
        s = local_session("local[2]", app="chronoq-tests", scratch=str(scratch), extra=settings)
    except Exception as exc:  # noqa: BLE001 - one more try when the JVM did not come up (busy machine)
        if "JAVA_GATEWAY_EXITED" not in str(exc):
            raise
        s = local_session("local[2]", app="chronoq-tests", scratch=str(scratch), extra=settings)
    # Warm the JVM, the Python workers and the data source's planning path once (a throwaway
    # broker), so the first test does not pay ~20 s of cold start inside its timings.
    warm = ChronoqProcess(str(scratch / "warm-broker"))
    try:
        df = s.range(100).selectExpr("cast(id as string) as body", "cast(600000 as bigint) as delay_ms")
        write_rows(df, warm.endpoint, "warm-up")
        assert read_topic(s, warm.endpoint, "warm-up").count() == 0  # all delayed
    finally:
        warm.stop()
    yield s
    s.stop()


@pytest.fixture
def broker(tmp_path):
    """Factory: ``broker(config_text="")`` -> a started ``ChronoqProcess`` (stopped after the test)."""
    started: list[ChronoqProcess] = []

    def start(config_text: str = "", name: str = "data") -> ChronoqProcess:
        proc = ChronoqProcess(str(tmp_path / name), config_text)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.proc.returncode is None:
            proc.stop()


def read_topic(spark, endpoint: str, topic: str, **options):
    reader = spark.read.format("chronoq").option("endpoints", endpoint).option("topic", topic)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def write_rows(df, endpoint: str, topic: str, **options) -> None:
    writer = df.write.format("chronoq").option("endpoints", endpoint).option("topic", topic).mode("append")
    for key, value in options.items():
        writer = writer.option(key, value)
    writer.save()


def queue_totals(endpoint: str, topic: str) -> int:
    """Messages in ``topic`` (0 while it does not exist)."""
    from chronoq.spark.rpc import AdminRpc, BrokerError

    with AdminRpc(endpoint) as client:
        try:
            return sum(hi - lo for lo, hi in client.queue_offsets(topic).values())
        except BrokerError as exc:
            if "does not exist" in str(exc):
                return 0
            raise
