"""Staging sinks are bounded (max_stage_sinks, max_stage_published_ids: chronoq.features.stagesinks)
through a real ``chronoq serve`` and the Spark sink's own writer code (no Spark session: the
writer's ``write`` runs as a task would, partition 0).

A batch write of a new job past ``max_stage_sinks`` fails loudly (``BrokerError`` naming the limit
and ``TOO_MANY_REQUESTS``) and publishes nothing; sinks already held publish on; after ``kill -9``
and a restart with a lower limit every sink is still remembered (a replay publishes nothing).
"""

from __future__ import annotations

import signal

import pyarrow as pa
import pytest

from chronoq.protocol.rocketmq import status
from chronoq.spark.rpc import AdminRpc, BrokerError
from chronoq.spark.sink import ChronoqBatchWriter
from chronoq.spark.source import Settings
from tests.integration.conftest import ChronoqProcess


def _write(proc: ChronoqProcess, job: str, rows: int) -> None:
    settings = Settings.parse({"endpoints": proc.endpoint, "topic": "out", "jobId": job})
    batch = pa.RecordBatch.from_pydict({"body": [f"{job}-{i}".encode() for i in range(rows)]})
    ChronoqBatchWriter(settings, f"job:{job}").write(iter([batch]))


def _count(proc: ChronoqProcess) -> int:
    with AdminRpc(proc.endpoint) as rpc:
        return sum(hi - lo for lo, hi in rpc.queue_offsets("out").values())


def _kill(proc: ChronoqProcess) -> None:
    proc.proc.send_signal(signal.SIGKILL)
    proc.proc.wait(10)
    proc.stop(check=False)


def test_a_new_sink_past_max_stage_sinks_fails_the_write_and_restored_sinks_are_kept(tmp_path, monkeypatch):
    data = str(tmp_path / "data")
    monkeypatch.setenv("CHRONOQ_MAX_STAGE_SINKS", "3")
    proc = ChronoqProcess(data)
    try:
        for job in ("a", "b", "c"):
            _write(proc, job, 5)
        assert _count(proc) == 15
        with pytest.raises(BrokerError, match=r"max_stage_sinks \(3\)") as refused:
            _write(proc, "d", 5)
        assert refused.value.code == status.Code.TOO_MANY_REQUESTS
        assert _count(proc) == 15  # staged, never published
        with AdminRpc(proc.endpoint) as rpc:
            assert rpc.abort("job:d", -1) == 5  # (Abort is never refused)
            assert rpc.publish("job:a", 1, []).messages == 0  # a held sink publishes on
    finally:
        _kill(proc)
    monkeypatch.setenv("CHRONOQ_MAX_STAGE_SINKS", "2")
    proc = ChronoqProcess(data)
    try:
        assert "all kept" in proc.output()
        for job in ("a", "b", "c"):  # a job re-run: every sink remembered, nothing published twice
            _write(proc, job, 5)
        assert _count(proc) == 15
        with AdminRpc(proc.endpoint) as rpc:
            assert rpc.publish("job:b", 0, []).already_published
            with pytest.raises(BrokerError, match="max_stage_sinks"):
                rpc.publish("job:e", 0, [])
    finally:
        proc.stop()
