"""The ``chronoq`` sink: batch and streaming writes of rows as (delayed) messages (docs/spark.md,
"Writing").

Every Spark task stages its rows (``Stage``) under (sink id, batch id); the commit publishes the
batch (``Publish``), exactly once per (sink id, batch id) however often Spark commits it;
``abort`` discards by (sink id, batch id).

Across a cluster (a topic placed over several broker groups, ``chronoq.spark.cluster``) rows are
spread as the route spreads sends (``chronoq.client.routed``): each staged chunk goes whole to
one group, round robin over the groups taking sends (starting at the task's partition id, so
tasks start on different groups), and a row with a message group always to the group its crc32
picks among them, by name (its order holds: one group, one queue). A task stages on each group it
sends to (one stage per group), and the commit publishes, on each group, that group's stages:
every group keeps its own exactly-once record of (sink id, batch id). The groups are those taking
sends when the write was planned (the writer is made on the driver), so a replayed batch spreads
its rows as the first attempt did (given deterministic input): the groups that published keep
their record, the others publish the replay's.
"""

from __future__ import annotations

import logging
import uuid
import zlib
from dataclasses import dataclass
from typing import Iterator

import numpy as np
import pyarrow as pa
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage

from chronoq.spark import cluster
from chronoq.spark import rpc

log = logging.getLogger("chronoq.spark")

STAGE_ROWS = 16_384                # rows per Stage call ...
STAGE_BYTES = 4 * 1024 * 1024      # ... and about this many body bytes (the broker's limits are higher)
Target = tuple[str, str]           # (broker group, its primary's endpoint); ("", "") : the node given


def targets(settings) -> tuple[Target, ...]:
    """Where a write's rows go: the groups taking sends of a placed topic, or the node given."""
    with settings.client() as client:
        topology = cluster.read_topology(client)
    return tuple(topology.writable(settings.topic)) if topology.spread(settings.topic) else (("", ""),)


@dataclass(frozen=True)
class StageCommit(WriterCommitMessage):
    stage_id: str
    chunks: int
    rows: int
    group: str = ""       # the broker group it is staged on ("": the node given) ...
    endpoint: str = ""    # ... at this endpoint


@dataclass(frozen=True)
class TaskStages(WriterCommitMessage):
    """What one task attempt staged: a stage per group it sent rows to."""
    stages: tuple[StageCommit, ...]


class _Stager:
    """One task attempt's stage on one target: its calls, at most two outstanding (the next chunk
    is converted and sent while the broker stages this one)."""

    def __init__(self, settings, target: Target):
        self.group, self.endpoint = target
        self.client = settings.client(self.endpoint)
        self.stage_id = uuid.uuid4().hex
        self.chunks = self.rows = 0
        self.waiting = None

    def send(self, sink_id: str, batch_id: int, topic: str, piece: pa.RecordBatch) -> None:
        call = self.client.stage_async(sink_id, batch_id, self.stage_id, self.chunks, topic, rpc.batch_to_rows(piece))
        self.chunks += 1
        if self.waiting is not None:
            self.rows += self.waiting()
        self.waiting = call

    def finish(self) -> StageCommit:
        if self.waiting is not None:
            self.rows += self.waiting()
            self.waiting = None
        return StageCommit(self.stage_id, self.chunks, self.rows, self.group, self.endpoint)


def _spread(piece: pa.RecordBatch, turn: int, n: int) -> list[tuple[int, pa.RecordBatch]]:
    """(target index, rows) of a chunk: whole to target ``turn % n``, but rows with a message
    group to ``crc32(group) % n`` (as ``RoutedSender``)."""
    if n == 1:
        return [(0, piece)]
    index = piece.schema.get_field_index("message_group")
    column = piece.column(index) if index >= 0 else None
    if column is None or column.null_count == len(column):
        return [(turn % n, piece)]
    picks = np.array([turn % n if g is None else zlib.crc32(g.encode()) % n for g in column.to_pylist()])
    return [(t, piece.filter(pa.array(picks == t))) for t in sorted(set(picks.tolist()))]


def _stage(settings, sink_id: str, batch_id: int, batches, where: tuple[Target, ...], turn: int = 0) -> TaskStages:
    """Stage every row of ``batches``: one stage per target it sends rows to."""
    stagers: dict[int, _Stager] = {}
    try:
        for batch in batches:
            for piece in rpc.split_batch(batch, STAGE_ROWS, STAGE_BYTES):
                for t, rows in _spread(piece, turn, len(where)):
                    stager = stagers.get(t)
                    if stager is None:
                        stager = stagers[t] = _Stager(settings, where[t])
                    stager.send(sink_id, batch_id, settings.topic, rows)
                turn += 1
        return TaskStages(tuple(stagers[t].finish() for t in sorted(stagers)))
    finally:
        for stager in stagers.values():
            stager.client.close()


def _publish(settings, sink_id: str, batch_id: int, messages, where: tuple[Target, ...]) -> None:
    """Publish the stages of ``messages``, on each group that holds some (one node: always, even
    with nothing staged, so the batch is recorded)."""
    by_target: dict[Target, list] = {}
    for m in messages:
        for st in (m.stages if isinstance(m, TaskStages) else ()):
            if st.chunks:
                by_target.setdefault((st.group, st.endpoint), []).append((st.stage_id, st.chunks, st.rows))
    if where == (("", ""),):
        by_target.setdefault(("", ""), [])
    for (group, endpoint), stages in sorted(by_target.items()):
        with settings.client(endpoint) as client:
            resp = client.publish(sink_id, batch_id, stages)
        log.info("chronoq sink %s batch %d%s: %s %d messages", sink_id, batch_id,
                 f" on group {group}" if group else "",
                 "already published," if resp.already_published else "published", resp.messages)


def _abort(settings, sink_id: str, batch_id: int, where: tuple[Target, ...]) -> None:
    for _group, endpoint in where:
        with settings.client(endpoint) as client:
            client.abort(sink_id, batch_id)


def _partition_id() -> int:
    from pyspark import TaskContext

    ctx = TaskContext.get()
    return ctx.partitionId() if ctx is not None else 0


class ChronoqBatchWriter(DataSourceArrowWriter):
    """``df.write``: one job (sink ``job:<jobId>``).

    Default: each task publishes its partition as soon as it has staged it (batch id = the
    partition id), so the broker publishes while other tasks still run; a task retried after its
    publish publishes nothing again, and a job re-run with the same ``jobId`` publishes only the
    partitions that are missing. ``atomic=true``: the whole job is batch 0, published by the
    job's commit, all or nothing.
    """

    def __init__(self, settings, sink_id: str, where: tuple[Target, ...] = (("", ""),)):
        self.settings = settings
        self.sink_id = sink_id
        self.where = where

    def write(self, iterator: Iterator) -> TaskStages:
        partition = _partition_id()
        if self.settings.atomic:
            return _stage(self.settings, self.sink_id, 0, iterator, self.where, partition)
        staged = _stage(self.settings, self.sink_id, partition, iterator, self.where, partition)
        _publish(self.settings, self.sink_id, partition, [staged], self.where)
        return staged

    def commit(self, messages) -> None:
        if self.settings.atomic:
            _publish(self.settings, self.sink_id, 0, messages, self.where)

    def abort(self, messages) -> None:
        _abort(self.settings, self.sink_id, 0 if self.settings.atomic else -1, self.where)


class ChronoqStreamWriter(DataSourceStreamArrowWriter):
    """``writeStream``: exactly once per (sink id, batch id)."""

    def __init__(self, settings, sink_id: str, where: tuple[Target, ...] = (("", ""),)):
        self.settings = settings
        self.sink_id = sink_id
        self.where = where

    def write(self, iterator: Iterator) -> TaskStages:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        batch = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
        if batch is None:
            raise RuntimeError("chronoq stream sink: Spark did not say which micro-batch this task writes")
        return _stage(self.settings, self.sink_id, int(batch), iterator, self.where, ctx.partitionId())

    def commit(self, messages, batchId: int) -> None:
        _publish(self.settings, self.sink_id, batchId, messages, self.where)

    def abort(self, messages, batchId: int) -> None:
        _abort(self.settings, self.sink_id, batchId, self.where)
