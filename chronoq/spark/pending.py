"""The ``chronoq`` source's read of what is still scheduled (option ``pending=true``;
docs/spark.md, "Reading pending messages").

A normal read returns what is visible in a topic's queues; a message still waiting for its
delivery time is in none of them. ``pending=true`` reads those instead, through the Admin RPC
``ListPending`` (``chronoq.timer.pending`` on the broker): the same columns as a normal read,
``offset`` and ``visible`` null (it has neither yet), plus ``due``, when it fires.

Partitions are due-time slices: the driver asks the broker for the span of pending due times
(``span``, from the bucket starts and the level queues: no schedule file is read), cuts the
window into ``pendingPartitions`` equal slices per topic, and each task pages through its slice
with the cursor (``LIST_PAGE`` messages per call). The first slice is open below unless
``dueFrom`` is given (overdue messages), the last open above unless ``dueTo`` is given (messages
scheduled after the planning), so together the slices cover the whole window. Like any read of a
moving target it is not a snapshot: a message that fires (or is recalled) before its slice is read
is absent, one scheduled later may appear; each message appears at most once per slice walk
(the cursor is stable while timers fire) and slices do not overlap.

A topic placed over a cluster's broker groups (``chronoq.spark.cluster``) is read on each group
holding it (each group's timers hold what it stored): slices per group, at its primary.
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
from pyspark.sql.datasource import DataSourceReader, InputPartition

from chronoq.spark import cluster
from chronoq.spark import rpc

PENDING_OPTIONS = ("pending", "dueFrom", "dueTo", "messageKey", "pendingPartitions")
PARTITIONS_DEFAULT = 4
PARTITIONS_MAX = 1024
LIST_PAGE = 1000  # the broker's most per ListPending (chronoq.timer.pending.LIMIT_MAX)
PENDING_COLUMNS = rpc.READ_COLUMNS + [("due", "timestamp", rpc.TIMESTAMP)]
PENDING_DDL = ", ".join(f"{name} {ddl}" for name, ddl, _ in PENDING_COLUMNS)
PENDING_ARROW_SCHEMA = pa.schema([pa.field(name, t) for name, _, t in PENDING_COLUMNS])
# A normal read's options that mean nothing for a read of what is pending.
_OFFSET_OPTIONS = ("startingOffsets", "startingTimestamp", "endingOffsets", "maxRecordsPerTrigger",
                   "maxOffsetsPerTrigger", "maxRecordsPerPartition", "failOnDataLoss")


def wanted(options) -> bool:
    """Whether the options ask for a read of pending messages; its own options need it."""
    from chronoq.spark.source import _flag

    on = _flag(options, "pending", False)
    if not on:
        given = [name for name in PENDING_OPTIONS[1:] if options.get(name) is not None]
        if given:
            raise ValueError(f"option(s) {', '.join(given)} only apply with pending=true")
    return on


@dataclass(frozen=True)
class PendingPlan:
    """A pending read's own options (plain values, pickled to the workers)."""
    due_from: int | None
    due_to: int | None
    key: str
    partitions: int

    @classmethod
    def parse(cls, options) -> "PendingPlan":
        from chronoq.spark.source import _positive

        given = [name for name in _OFFSET_OPTIONS if options.get(name) is not None]
        if given:
            raise ValueError(f"option(s) {', '.join(given)} do not apply to a read of pending messages "
                             "(it has no offsets: use dueFrom/dueTo)")
        due_from, due_to = _ms(options, "dueFrom"), _ms(options, "dueTo")
        if due_from is not None and due_to is not None and due_to <= due_from:
            raise ValueError(f"dueTo ({due_to}) must be after dueFrom ({due_from})")
        parts = _positive(options, "pendingPartitions", PARTITIONS_DEFAULT)
        if parts > PARTITIONS_MAX:
            raise ValueError(f"option pendingPartitions is at most {PARTITIONS_MAX}, not {parts}")
        return cls(due_from, due_to, options.get("messageKey") or "", parts)


def _ms(options, name: str) -> int | None:
    text = options.get(name)
    if text is None:
        return None
    try:
        return int(text)
    except ValueError:
        raise ValueError(f"option {name} must be epoch milliseconds, not {text!r}") from None


@dataclass(frozen=True)
class DueSlice(InputPartition):
    topic: str
    due_from: int | None   # None: unbounded
    due_to: int | None
    group: str = ""        # the broker group holding it ("": the node given) ...
    endpoint: str = ""     # ... at its primary


def slices(lo: int | None, hi: int | None, span: tuple[int, int] | None, count: int) -> list[tuple]:
    """``count`` (at most) due-time slices covering ``[lo, hi)`` (None: unbounded), cut evenly over
    the part of it where something is pending (``span``). Ensures: adjacent, non-overlapping, the
    first starts at ``lo``, the last ends at ``hi``."""
    if span is None:
        return [(lo, hi)]
    first = span[0] if lo is None else max(lo, span[0])
    end = span[1] if hi is None else min(hi, span[1])
    if end - first < count or count == 1:
        return [(lo, hi)]
    step = -(-(end - first) // count)
    cuts = [first + i * step for i in range(1, count) if first + i * step < end]
    edges = [lo, *cuts, hi]
    out = list(zip(edges, edges[1:]))
    assert out[0][0] == lo and out[-1][1] == hi
    return out


def _cut(settings, pending: PendingPlan, endpoint: str) -> list[tuple]:
    with settings.client(endpoint) as client:
        resp = client.list_pending(limit=1, span=True)
    span = (resp.span_from_ms, resp.span_to_ms) if resp.span_to_ms else None
    return slices(pending.due_from, pending.due_to, span, pending.partitions)


def plan(settings, pending: PendingPlan, topics: list[str]) -> list[DueSlice]:
    with settings.client() as client:
        topology = cluster.read_topology(client)
    cuts: dict[str, list[tuple]] = {}
    out = []
    for topic in topics:
        places = topology.readable(topic, strict=True) if topology.spread(topic) else [("", "")]
        for group, endpoint in places:
            if endpoint not in cuts:
                cuts[endpoint] = _cut(settings, pending, endpoint)
            out.extend(DueSlice(topic, lo, hi, group, endpoint) for lo, hi in cuts[endpoint])
    return out


def pending_to_arrow(messages, group: str = "") -> pa.RecordBatch:
    """A record batch (``PENDING_ARROW_SCHEMA``) of ``PendingMessage`` answers."""
    def times(values, null_when_zero):
        return pa.array([v * 1000 if v or not null_when_zero else None for v in values], rpc.TIMESTAMP)

    n = len(messages)
    arrays = [
        pa.array([m.topic for m in messages], pa.string()),
        pa.array([m.queue for m in messages], pa.int32()),
        pa.nulls(n, pa.int64()),
        pa.array([m.message_id for m in messages], pa.string()),
        pa.array([list(m.keys) for m in messages], pa.list_(pa.string())),
        pa.array([m.tag or None for m in messages], pa.string()),
        pa.array([list(m.properties.items()) for m in messages], pa.map_(pa.string(), pa.string())),
        pa.array([m.message_group or None for m in messages], pa.string()),
        pa.array([m.body for m in messages], pa.binary()),
        times([m.born_ms for m in messages], False),
        times([m.stored_ms for m in messages], True),
        times([m.deliver_at_ms for m in messages], True),
        pa.nulls(n, rpc.TIMESTAMP),
        pa.array([group] * n, pa.string()) if group else pa.nulls(n, pa.string()),
        times([m.due_ms for m in messages], False),
    ]
    return pa.RecordBatch.from_arrays(arrays, schema=PENDING_ARROW_SCHEMA)


class PendingReader(DataSourceReader):
    """``spark.read.format("chronoq").option("pending", "true")``: batch only."""

    def __init__(self, settings, pending: PendingPlan, topics: list[str]):
        self.settings = settings
        self.pending = pending
        self.topics = topics

    def partitions(self):
        return plan(self.settings, self.pending, self.topics)

    def read(self, partition: DueSlice):
        """Page through the slice with the cursor (pure: a rerun reads what is pending then)."""
        cursor = ""
        with self.settings.client(partition.endpoint) as client:
            for _ in range(1 << 40):  # ends when the broker answers no cursor
                resp = client.list_pending(topic=partition.topic, key=self.pending.key, from_ms=partition.due_from,
                                           to_ms=partition.due_to, limit=LIST_PAGE, cursor=cursor, bodies=True)
                if resp.messages:
                    yield pending_to_arrow(resp.messages, partition.group)
                if not resp.next_cursor:
                    return
                cursor = resp.next_cursor
