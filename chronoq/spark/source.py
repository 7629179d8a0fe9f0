"""The ``chronoq`` PySpark data source: batch and streaming reads and writes (docs/spark.md).

Where each piece runs (shared/spark notes, §3): options are parsed in the process that makes the
``DataSource``; readers and writers are pickled to other processes, so they hold only plain
values, and every method that talks to the broker opens its own channel (``rpc.AdminRpc``).

Reading: a topic by (queue, offset) ranges. ``read`` is pure (it reruns for sampling, retries and
replays) and yields Arrow record batches. The stream reader keeps no consumer position in the
broker: the offsets in Spark's checkpoint are the position (canonical JSON, ``offsets.py``).

Across a cluster (``chronoq.spark.cluster``): a topic placed over several broker groups is
planned over every (group, queue); each partition names its group's primary, offsets name the
group (``"g1/0"``), and a write stages each chunk on one group, as the route spreads sends, and
publishes on each group it staged on.

Writing: every Spark task stages its rows (``Stage``) under (sink id, batch id); the commit
publishes the batch (``Publish``), exactly once per (sink id, batch id) however often Spark
commits it; ``abort`` discards by (sink id, batch id). A streaming sink's id comes from the
``sinkId`` option or the checkpoint location (stable across restarts); a batch write is one job,
``jobId`` option or a random id, batch 0.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import urllib.parse
import uuid
from dataclasses import dataclass

from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadMaxRows, SupportsTriggerAvailableNow

from chronoq.spark import cluster
from chronoq.spark import offsets as offs
from chronoq.spark import pending
from chronoq.spark import rpc
from chronoq.spark.sink import ChronoqBatchWriter, ChronoqStreamWriter, targets as _targets

log = logging.getLogger("chronoq.spark")

NAME = "chronoq"
READ_PAGE_MESSAGES = 8192          # messages per ReadMessages call
READ_PAGE_BYTES = 8 * 1024 * 1024
PARTITION_MESSAGES = 250_000       # messages per input partition (option maxRecordsPerPartition)
TIMEOUT_S = 120.0
# The read options, as written in docs/spark.md (Spark hands them back lowercased). Kafka source
# names that mean the same are aliases: maxOffsetsPerTrigger, subscribe, subscribePattern,
# startingTimestamp.
READ_OPTIONS = ("endpoints", "endpoint", "topic", "subscribe", "subscribePattern", "startingOffsets",
                "startingTimestamp", "endingOffsets", "maxRecordsPerTrigger", "maxOffsetsPerTrigger", "maxRecordsPerPartition",
                "failOnDataLoss", "timeoutSeconds", "accessKey", "secretKey", "tls", "tlsCaFile",
                *pending.PENDING_OPTIONS)
_READ_OPTIONS_LOWER = {name.lower() for name in READ_OPTIONS}
# The write options (docs/spark.md, "Writing"): a batch write's jobId and atomic, a stream's
# sinkId and checkpointLocation (Spark hands the query's own in the options), and the connection.
WRITE_OPTIONS = ("endpoints", "endpoint", "topic", "jobId", "atomic", "sinkId", "checkpointLocation",
                 "timeoutSeconds", "accessKey", "secretKey", "tls", "tlsCaFile")
_WRITE_OPTIONS_LOWER = {name.lower() for name in WRITE_OPTIONS}


def _flag(options, name: str, default: bool) -> bool:
    value = options.get(name)
    if value is None:
        return default
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ValueError(f"option {name} must be true or false, not {value!r}")


def _seconds(options, name: str, default: float) -> float:
    value = options.get(name)
    if value is None or value == "":
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds <= 86_400:  # (nan fails too)
        raise ValueError(f"option {name} must be a number of seconds above 0 and at most 86400, not {value!r}")
    return seconds


def _positive(options, name: str, default: int | None) -> int | None:
    value = options.get(name)
    if value is None:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n <= 0:
        raise ValueError(f"option {name} must be a positive integer, not {value!r}")
    return n


def _check_options(options, reading: bool) -> None:
    """An option the source does not know is an error: a typo must not be silently ignored (a
    misspelt jobId would be a random id, and a re-run would publish everything again)."""
    known, names, way = ((_READ_OPTIONS_LOWER, READ_OPTIONS, "read") if reading
                         else (_WRITE_OPTIONS_LOWER, WRITE_OPTIONS, "write"))
    unknown = sorted(k for k in options if k.lower() not in known)
    if unknown:
        hint = " (save() takes no path: name the topic with option topic)" if "path" in unknown else ""
        raise ValueError(f"the chronoq source does not know the {way} option(s) {', '.join(unknown)}; "
                         f"it takes {', '.join(names)} (docs/spark.md){hint}")


def _not_here(options, names: tuple[str, ...], here: str, instead: str) -> None:
    """Options of the other kind of read or write are refused too, not ignored: a stream given
    endingOffsets read on past it, a batch write given a sinkId was not named by it."""
    given = [name for name in names if options.get(name) is not None]
    if given:
        raise ValueError(f"option(s) {', '.join(given)} do not apply to {here}: {instead} (docs/spark.md)")


def _read_topics(options) -> tuple[tuple[str, ...], str | None]:
    """(the topics named by ``topic`` or ``subscribe``, or the ``subscribePattern`` regex)."""
    given = [name for name in ("topic", "subscribe", "subscribePattern") if options.get(name)]
    if len(given) != 1:
        named = " and ".join(given) if given else "none"
        raise ValueError("the chronoq source reads what one of the options topic, subscribe (topics, "
                         f"comma-separated) or subscribePattern (a regex) names; {named} given")
    if given[0] == "subscribePattern":
        pattern = options.get("subscribePattern")
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ValueError(f"option subscribePattern {pattern!r} is not a regular expression: {exc}") from None
        return (), pattern
    topics = tuple(dict.fromkeys(t.strip() for t in options.get(given[0]).split(",") if t.strip()))
    if not topics:
        raise ValueError(f"option {given[0]} names no topic")
    return topics, None


def _max_per_trigger(options) -> int | None:
    ours = _positive(options, "maxRecordsPerTrigger", None)
    kafka = _positive(options, "maxOffsetsPerTrigger", None)  # Kafka's name for the same limit
    if ours is not None and kafka is not None and ours != kafka:
        raise ValueError(f"options maxRecordsPerTrigger ({ours}) and maxOffsetsPerTrigger ({kafka}) are the same "
                         "limit; give one")
    return ours if ours is not None else kafka


def _starting_ms(options) -> int | None:
    text = options.get("startingTimestamp")
    if text is None:
        return None
    if options.get("startingOffsets") is not None:
        raise ValueError("give startingOffsets or startingTimestamp, not both")
    try:
        ms = int(text)
    except ValueError:
        ms = -1
    if ms < 0:
        raise ValueError(f"option startingTimestamp must be epoch milliseconds (as Kafka's), not {text!r}")
    return ms


@dataclass(frozen=True)
class Settings:
    """The parsed options: plain values, pickled to every worker."""

    endpoints: tuple[str, ...]
    topic: str
    starting: str | None
    ending: str | None
    max_per_trigger: int | None
    per_partition: int
    fail_on_data_loss: bool
    timeout_s: float
    sink_id: str | None
    job_id: str | None
    checkpoint: str | None
    atomic: bool
    access_key: str = ""
    secret_key: str = ""
    tls: bool = False
    tls_ca_file: str = ""
    topics: tuple[str, ...] = ()     # reading: the topics named (topic, or subscribe's list) ...
    pattern: str | None = None       # ... or the subscribePattern regex, matched at each planning
    starting_ms: int | None = None   # startingTimestamp: epoch ms (instead of startingOffsets)

    @classmethod
    def parse(cls, options, reading: bool = False) -> "Settings":
        _check_options(options, reading)
        endpoints = options.get("endpoints") or options.get("endpoint")
        if not endpoints:
            raise ValueError("the chronoq source needs option endpoints (host:port of the broker)")
        topics, pattern = (), None
        if reading:
            topics, pattern = _read_topics(options)
            topic = topics[0] if topics else ""
        else:
            topic = options.get("topic")
            if not topic:
                raise ValueError("the chronoq sink needs option topic")
        return cls(tuple(rpc.parse_endpoints(endpoints)), topic, options.get("startingOffsets"),
                   options.get("endingOffsets"), _max_per_trigger(options),
                   _positive(options, "maxRecordsPerPartition", PARTITION_MESSAGES),
                   _flag(options, "failOnDataLoss", True), _seconds(options, "timeoutSeconds", TIMEOUT_S),
                   options.get("sinkId"), options.get("jobId"), options.get("checkpointLocation"),
                   _flag(options, "atomic", False), options.get("accessKey") or "",
                   options.get("secretKey") or "", _flag(options, "tls", False), options.get("tlsCaFile") or "",
                   topics, pattern, _starting_ms(options) if reading else None)

    def client(self, endpoint: str = "") -> rpc.AdminRpc:
        """A client of the endpoints given, or of one broker group's primary (``endpoint``)."""
        return rpc.AdminRpc([endpoint] if endpoint else list(self.endpoints), self.timeout_s, access_key=self.access_key,
                            secret_key=self.secret_key, tls=self.tls, tls_ca_file=self.tls_ca_file)


class ChronoqDataSource(DataSource):
    """``spark.read.format("chronoq")`` / ``readStream`` / ``write`` / ``writeStream``."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def schema(self):
        return pending.PENDING_DDL if pending.wanted(self.options) else rpc.READ_DDL

    def _settings(self, reading: bool = False) -> Settings:
        return Settings.parse(self.options, reading)

    def reader(self, schema):
        settings = self._settings(reading=True)
        if pending.wanted(self.options):  # what is still scheduled (chronoq.spark.pending)
            return pending.PendingReader(settings, pending.PendingPlan.parse(self.options), _topics(settings))
        return ChronoqBatchReader(settings)

    def streamReader(self, schema):
        if pending.wanted(self.options):
            raise ValueError("pending=true is a batch read (what is scheduled now); read it with spark.read")
        _not_here(self.options, ("endingOffsets",), "a stream",
                  "it reads on as messages come; trigger(availableNow=True) stops at the end")
        return ChronoqStreamReader(self._settings(reading=True))

    def writer(self, schema, overwrite: bool):
        settings = self._settings()
        _not_here(self.options, ("sinkId", "checkpointLocation"), "a batch write",
                  "it is one job, named by option jobId")
        _check_write_schema(schema, overwrite)
        job_id = settings.job_id or uuid.uuid4().hex
        return ChronoqBatchWriter(settings, f"job:{job_id}", _targets(settings))

    def streamWriter(self, schema, overwrite: bool):
        _not_here(self.options, ("jobId", "atomic"), "a stream write",
                  "its sink is named by option sinkId or the checkpoint, each micro-batch published whole")
        settings = self._settings()
        _check_write_schema(schema, overwrite)
        return ChronoqStreamWriter(settings, _sink_id(settings), _targets(settings))


def _sink_id(settings: Settings) -> str:
    if settings.sink_id:
        return settings.sink_id
    if not settings.checkpoint:
        raise ValueError("a chronoq stream sink needs option sinkId or a checkpointLocation (a stable id "
                         "makes the sink exactly-once across restarts)")
    path = checkpoint_key(settings.checkpoint)
    query = _query_id(path)
    key = path if query is None else f"{path}#{query}"
    return "ckpt:" + (key if len(key) <= 150 and key.isprintable() else hashlib.sha256(key.encode()).hexdigest())


def _query_id(path: str) -> str | None:
    """The query id Spark keeps in a local checkpoint (its ``metadata`` file, written when the
    query starts, before its sink is made): a checkpoint deleted and used again at the same path
    is a new query with a new id, so it gets a new sink id (with the path alone its batch ids,
    restarted at 0, were answered ``already_published`` and every row dropped). None for another
    file system, which this driver does not read: the path alone, as documented."""
    if "://" in path:
        return None
    try:
        with open(os.path.join(path, "metadata"), encoding="utf-8") as fh:
            found = json.loads(fh.readline()).get("id")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) and 0 < len(found) <= 64 and found.isprintable() else None


def checkpoint_key(location: str) -> str:
    """One spelling per checkpoint location, for the sink id: a restart that names the same
    checkpoint another way (relative or absolute, with or without ``file:``, a trailing slash)
    must find the same sink, or the batch Spark replays is published a second time. A local path
    is made absolute on the driver (as Spark resolves a relative checkpoint location against its
    working directory) and normalised; another file system's URI is kept as given, less
    trailing slashes."""
    path = location.strip()
    if path.startswith("file:"):
        path = urllib.parse.urlsplit(path).path or path[len("file:"):]
    if "://" in path:
        return path.rstrip("/")
    return os.path.normpath(os.path.abspath(path))


def _check_write_schema(schema, overwrite: bool) -> None:
    if overwrite:
        raise ValueError("chronoq topics are append-only: write with mode('append')")
    names = [f.name for f in schema.fields]
    unknown = [n for n in names if n not in rpc.WRITE_COLUMNS]
    if unknown or "body" not in names:
        raise ValueError(
            f"the chronoq sink takes the columns {', '.join(f'{k} ({v})' for k, v in rpc.WRITE_COLUMNS.items())}; "
            + (f"unknown: {', '.join(unknown)}" if unknown else "body is missing"))
    wrong = [f"{f.name} is {f.dataType.simpleString()}, not {rpc.WRITE_COLUMNS[f.name]}"
             for f in schema.fields if not _column_type_ok(f.name, f.dataType)]
    if wrong:  # at planning, not as an executor's Arrow error (an int body) or a wrong meaning (a
        raise ValueError("chronoq sink: " + "; ".join(wrong))  # timestamp taken as delay_ms)


def _column_type_ok(name: str, dtype) -> bool:
    """Whether a write column's Spark type is one ``rpc.row_columns`` reads as documented."""
    from pyspark.sql import types as T

    if isinstance(dtype, T.NullType):  # (a null literal: an optional column left empty)
        return name != "body"
    if name in ("body", "key", "tag", "message_group"):
        return isinstance(dtype, (T.StringType, T.BinaryType))
    if name == "keys":
        return isinstance(dtype, T.ArrayType) and isinstance(dtype.elementType, (T.StringType, T.BinaryType))
    if name == "properties":
        return (isinstance(dtype, T.MapType) and isinstance(dtype.keyType, (T.StringType, T.BinaryType))
                and isinstance(dtype.valueType, (T.StringType, T.BinaryType)))
    if name == "deliver_at":
        return isinstance(dtype, (T.TimestampType, T.TimestampNTZType))
    return isinstance(dtype, (T.LongType, T.IntegerType, T.ShortType, T.ByteType))  # deliver_at_ms, delay_ms


# ---------------------------------------------------------------------------- reading
@dataclass(frozen=True)
class QueueRange(InputPartition):
    topic: str
    queue: int
    start: int
    end: int
    group: str = ""       # the broker group holding the queue ("": the topic on the node given) ...
    endpoint: str = ""    # ... and its primary when planned


def _group_endpoint(settings: Settings, part: QueueRange) -> str:
    """The endpoint to read ``part`` at: the planned primary of its group, or the group's primary
    now when that one does not serve the topic (it died, or came back as a replica, which refuses
    Admin calls, after a replica took over since the planning)."""
    if not part.group:
        return ""
    try:
        with settings.client(part.endpoint) as client:
            client.queue_offsets(part.topic)
        return part.endpoint
    except rpc.BrokerError as exc:
        failed = exc
    with settings.client() as client:
        found = cluster.read_topology(client).leaders.get(part.group)
    if found == part.endpoint:
        raise failed
    if not found:
        raise RuntimeError(f"chronoq: broker group {part.group!r} has no primary now: cannot read "
                           f"{part.topic}/{part.group}/{part.queue} ({failed})")
    return found


def _read_range(settings: Settings, part: QueueRange):
    """Record batches of the messages in ``part`` (pure: safe to run again)."""
    topic = part.topic
    with settings.client(_group_endpoint(settings, part)) as client:
        offset = part.start
        while offset < part.end:
            res = client.read(topic, part.queue, offset, min(READ_PAGE_MESSAGES, part.end - offset), READ_PAGE_BYTES)
            if offset < res.min_offset and settings.fail_on_data_loss:
                raise RuntimeError(
                    f"chronoq: {topic}/{part.queue} offsets {offset}..{res.min_offset - 1} were removed by "
                    "retention before this query read them (set failOnDataLoss=false to skip them)")
            if res.messages.count:
                yield rpc.columns_to_arrow(topic, part.queue, res.messages, part.group)
            if res.next_offset <= offset:
                if offset >= res.max_offset:  # the range reaches past the queue's end: it shrank?
                    where = f"{part.group}/{part.queue}" if part.group else part.queue
                    raise RuntimeError(f"chronoq: {topic}/{where} ends at {res.max_offset}, "
                                       f"before the planned offset {part.end}")
                break
            offset = res.next_offset


@dataclass
class Plan:
    """What a planning found: every topic's queues' bounds, and where the groups' queues are."""
    bounds: dict[str, offs.Bounds]
    where: dict[tuple[str, str], str]    # (topic, group) -> the group's primary
    topology: cluster.Topology


def _plan(settings: Settings, strict: bool = True) -> Plan:
    """Every topic the query reads now -> its queues' bounds: on the node given, or, for a topic
    placed over a cluster's groups, every group's queues (``strict``: a group without a primary
    fails the planning; else its queues are left out for now). A pattern is matched against the
    broker's user topics at each call, so a topic created later joins the stream (from its start)."""
    bounds: dict[str, offs.Bounds] = {}
    where: dict[tuple[str, str], str] = {}
    with settings.client() as client:
        topology = cluster.read_topology(client)
        for topic in _topics(settings, client, topology):
            if not topology.spread(topic):
                bounds[topic] = client.queue_offsets(topic)
                continue
            bounds[topic] = {}
            for group, endpoint in topology.readable(topic, strict):
                where[(topic, group)] = endpoint
                with settings.client(endpoint) as member:
                    for q, b in member.queue_offsets(topic).items():
                        bounds[topic][offs.GroupQueue(group, q)] = b
    return Plan(bounds, where, topology)


def _topics(settings: Settings, client: rpc.AdminRpc | None = None,
            topology: cluster.Topology | None = None) -> list[str]:
    """The topics named, or the user topics the pattern matches now (the node's and the
    cluster's placed ones)."""
    if settings.pattern is None:
        return list(settings.topics)
    regex = re.compile(settings.pattern)
    if client is None:
        with settings.client() as own:
            return _topics(settings, own, topology)
    names = set(client.list_topics()) | set(topology.placements if topology else ())
    return sorted(t for t in names if regex.fullmatch(t))


def _start(settings: Settings, plan: Plan, default: str) -> dict[offs.Key, int]:
    """Where a query begins: ``startingOffsets`` (or ``default``), or per queue the first message
    that entered it at or after ``startingTimestamp`` (the queue's end when none did yet)."""
    if settings.starting_ms is None:
        return offs.parse_option_many(settings.starting, default, plan.bounds, "startingOffsets")
    out = {}
    for topic, queues in plan.bounds.items():
        for q, (lo, hi) in queues.items():
            group, local = (q.group, q.queue) if isinstance(q, offs.GroupQueue) else ("", q)
            with settings.client(plan.where.get((topic, group), "")) as client:
                def visible_ms(offset: int, topic=topic, local=local) -> int:
                    res = client.read(topic, local, offset, 1, 1)
                    return res.messages.visible_ms[0] if res.messages.count else 1 << 62
                out[(topic, q)] = offs.first_at_or_after(lo, hi, visible_ms, settings.starting_ms)
    return out


def _named(settings: Settings) -> frozenset[str] | None:
    """The topics a checkpoint may hold: those named, or any (a pattern)."""
    return None if settings.pattern is not None else frozenset(settings.topics)


def _ranges(start: dict, end: dict, per_partition: int, where: dict[tuple[str, str], str]) -> list[QueueRange]:
    out = []
    for (topic, q), lo, hi in offs.ranges(start, end, per_partition):
        if isinstance(q, offs.GroupQueue):
            out.append(QueueRange(topic, q.queue, lo, hi, q.group, where.get((topic, q.group), "")))
        else:
            out.append(QueueRange(topic, q, lo, hi))
    return out


def _spread_topics(positions: dict[offs.Key, int]) -> set[str]:
    return {topic for topic, q in positions if isinstance(q, offs.GroupQueue)}


class ChronoqBatchReader(DataSourceReader):
    def __init__(self, settings: Settings):
        self.settings = settings

    def partitions(self):
        s = self.settings
        plan = _plan(s, strict=True)
        start = _start(s, plan, "earliest")
        end = offs.parse_option_many(s.ending, "latest", plan.bounds, "endingOffsets")
        offs.check_batch_range(start, end, plan.bounds)
        return _ranges(start, end, s.per_partition, plan.where) or [QueueRange(s.topic, 0, 0, 0)]

    def read(self, partition: QueueRange):
        if partition.end > partition.start:
            yield from _read_range(self.settings, partition)


class ChronoqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Offsets are the checkpoint's; ``maxRecordsPerTrigger`` is honoured, also by availableNow."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self._target: dict[offs.Key, int] | None = None  # availableNow: stop here

    def initialOffset(self) -> dict:
        s = self.settings
        return offs.canonical_many(_start(s, _plan(s, strict=True), "latest"))

    def getDefaultReadLimit(self):
        n = self.settings.max_per_trigger
        return ReadMaxRows(n) if n else ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = _ends(_plan(self.settings, strict=False).bounds)

    def latestOffset(self, start: dict, limit) -> dict:
        s = self.settings
        plan = _plan(s, strict=False)
        begin = _restarted(_adopted(offs.positions_many(start, _named(s)), plan.topology), plan.bounds,
                           s.fail_on_data_loss)
        end = _ends(plan.bounds)
        if self._target is not None:
            end = {k: min(hi, self._target.get(k, 0)) for k, hi in end.items()}
        end = {k: max(hi, begin.get(k, 0)) for k, hi in end.items()}  # never move backwards
        max_rows = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        end = offs.limit_rows(begin, end, max_rows)
        # A group without a primary now keeps its queues' positions (read once it is back).
        end.update({k: off for k, off in begin.items()
                    if k not in end and isinstance(k[1], offs.GroupQueue) and k[0] in plan.bounds})
        latest = offs.canonical_many(end)
        return start if latest == start else latest

    def partitions(self, start: dict, end: dict):
        s = self.settings
        begin, stop = offs.positions_many(start), offs.positions_many(end)
        where: dict[tuple[str, str], str] = {}
        if _spread_topics(stop):
            with s.client() as client:
                topology = cluster.read_topology(client)
            begin = _adopted(begin, topology, _spread_topics(stop))
            where = {(topic, q.group): topology.leaders.get(q.group, "") for topic, q in stop
                     if isinstance(q, offs.GroupQueue)}
        # A queue whose end went back (``_restarted``, failOnDataLoss=false) is read from its start.
        begin = {k: (0 if k in stop and stop[k] < off else off) for k, off in begin.items()}
        return _ranges(begin, stop, s.per_partition, where)

    def read(self, partition: QueueRange):
        yield from _read_range(self.settings, partition)

    def commit(self, end: dict) -> None:
        """Nothing to do: the checkpoint owns the position (no acks, no consumer offsets)."""


def _restarted(begin: dict[offs.Key, int], bounds: dict[str, offs.Bounds], fail: bool) -> dict[offs.Key, int]:
    """``begin`` less the queues whose end is now before the query's position there: the topic
    was deleted and created again (or a rejoin cut the log), so what follows that position is not
    what the query read up to. With failOnDataLoss (the default) that fails the query, as the
    Kafka source does when a partition's offsets go back; without, such a queue is read again
    from its start (its position counts as 0)."""
    back = {(topic, q): (begin[(topic, q)], hi) for topic, queues in bounds.items()
            for q, (_lo, hi) in queues.items() if hi < begin.get((topic, q), 0)}
    if back and fail:
        (topic, q), (was, now) = min(back.items(), key=lambda kv: (kv[0][0], str(kv[0][1])))
        raise RuntimeError(
            f"chronoq: {topic}/{q} ends at {now}, before this query's position {was}"
            f"{f' (and {len(back) - 1} other queues)' if len(back) > 1 else ''}: the topic was deleted and "
            "created again, or a replica's rejoin cut its log; messages may have been missed (set "
            "failOnDataLoss=false to read such queues again from their start)")
    return {k: (0 if k in back else off) for k, off in begin.items()}


def _ends(bounds: dict[str, offs.Bounds]) -> dict[offs.Key, int]:
    return {(topic, q): hi for topic, queues in bounds.items() for q, (_lo, hi) in queues.items()}


def _adopted(positions: dict[offs.Key, int], topology: cluster.Topology,
             spread: set[str] | None = None) -> dict[offs.Key, int]:
    """A checkpoint's bare queue ids of a topic that has since been placed over the cluster's
    groups belong to the group of the node the query reads through (where the topic was)."""
    topics = {t for t, _q in positions if topology.spread(t)} if spread is None else spread
    if not topics or not topology.group:
        return positions
    return offs.adopt(positions, {t: topology.group for t in topics})
