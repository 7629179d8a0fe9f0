"""``chronoq.v1.Admin``: topics and consumer groups, beside ``MessagingService`` on the same port.

A thin shell over the ``Broker`` and the ``PopService``, like ``chronoq.server.messaging``: each RPC
checks the request, calls them, and encodes the answer. Errors never leave as gRPC errors: one
boundary per RPC (``_answer``) turns any exception into the response's ``Status`` through
``chronoq.protocol.rocketmq.status``, so the codes are the ``apache.rocketmq.v2.Code`` values the
MessagingService answers for the same mistake (``ILLEGAL_TOPIC``, ``CONSUMER_GROUP_NOT_FOUND``, ...).

Choices:

- ``CreateTopic`` and ``ListGroups`` are ``chronoq.features.catalog`` (its rules: "0 / empty = the
  default or keep", which groups and topics a lag report lists), the code the web console calls
  too, so both follow the same rules and show the same lag.
- ``CreateGroup`` creates or updates; settings whose ``set_*`` flag is false are kept. A value
  given without its flag is refused rather than silently ignored.
- ``Stats`` is the overview ``chronoq stats`` prints: the figures of the HTTP ``/metrics`` endpoint
  (``chronoq.server.metrics``), read the same way, so both always agree and the CLI needs only the gRPC
  endpoint and credentials it already has.
- ``TimerStats``, ``Recall`` and ``Reschedule`` serve delayed delivery (docs/timers.md). Recall and
  reschedule run on the event loop like every broker call, so an outcome is linearized against
  the timer's ticks exactly as ``Broker.recall`` documents; their fsync is the one blocking call
  an Admin RPC makes (they are rare operator actions). Definite outcomes, ``not_found``
  included, are answered with status OK and the outcome; only a malformed handle, a bad time
  or a storage error is a non-OK status.
- ``LookupMessage`` (``chronoq message show``) is ``chronoq.features.lookup.lookup_message``, the console's
  lookup: a bounded scan of the commit log's tail and of the trace. Its windows default to
  ``[console] lookup_scan_mib`` / ``trace_scan_mib``; a request may ask for others within the same
  limits. Nothing found is ``NOT_FOUND`` (a message older than the windows is not found either).
  Admins only (``chronoq.server.auth``: it shows keys and ids of every topic).
- ``CreateSchedule``, ``ListSchedules``, ``ShowSchedule``, ``PauseSchedule``, ``ResumeSchedule``,
  ``DeleteSchedule``: recurring schedules (``chronoq.features.schedules.book``, docs/timers.md).
  Admins only (no rule in ``chronoq.server.auth``: the default). Changes are saved (fsync) before
  the answer; pause and delete recall what was handed to the timer first, like ``Recall``. The
  list's next firings are computed on a worker thread (croniter lookups take ms each).
- ``DescribeTopic``, ``DeleteTopic``, ``ResetOffset``, ``DeleteGroup`` (``chronoq.features.operations``)
  and ``ListDeadLetters``, ``ResendDeadLetters`` (``chronoq.features.deadletters``): the day-two
  verbs of docs/cli.md; the rules are in those modules. Admins only (no rule in
  ``chronoq.server.auth``). ``DeleteTopic`` first waits until everything written is durable and
  dispatched (a send slipping in between is retried a few times, then TOO_MANY_REQUESTS);
  ``ResendDeadLetters`` writes through ``Broker.write`` (the one send path), waits until that is
  durable whatever the flush policy, and only then moves the resend cursor (fsync). Offsets are
  written on the loop (rare operator actions); the POP log's rewrite is made on the committer's
  thread and awaited before the answer.
- ``ListPending`` (``chronoq timers list``, the Spark source's ``pending`` read) is
  ``Broker.pending``: a page of pending delayed messages (``chronoq.timer.pending``). Admins only.
"""

from __future__ import annotations

import asyncio

from chronoq.core import console_settings, errors, model, validate
from chronoq.features import catalog, deadletters, lookup, operations
from chronoq.features.schedules.book import upcoming_view
from chronoq.server.metrics import BrokerMetrics
from chronoq.broker.trace import FLAG_DELAYED
from chronoq.timer.stats import LATENESS_BOUNDS_MS
from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.proto import chronoq_admin_pb2_grpc as apb_grpc
from chronoq.pop import operators as pop_operators
from chronoq.protocol.rocketmq import status
from chronoq.server import pendingpb
from chronoq.server.cluster import ClusterRpcs
from chronoq.server.pipeline import PipelineRpcs

TIMER_STATS_MINUTES_DEFAULT = 10
TIMER_STATS_MINUTES_MAX = 10_080  # a week of one-minute buckets (the timer's own cap)
DELETE_ATTEMPTS = 5  # DeleteTopic: fsync, then delete, while sends keep slipping in between
POP_REWRITE_WAIT_S = 30.0  # an operator's change waits this long for the POP log's rewrite to be durable


def add_to_server(server, broker, pop, committer=None, schedules=None) -> "AdminService":
    """Serve ``chronoq.v1.Admin`` on ``server`` (a ``grpc.aio.Server`` not yet started)."""
    service = AdminService(broker, pop, committer, schedules)
    service.start_pipeline()  # staged publish state (chronoq.features.staging): replayed at start
    apb_grpc.add_AdminServicer_to_server(service, server)
    return service


def _answer(response_type, what: str, fn, request):
    """The one exception boundary of an Admin RPC: any exception becomes the response's status."""
    try:
        return fn(request)
    except Exception as exc:  # noqa: BLE001 - this is the boundary
        code, message = status.code_and_message(exc, what)
        return response_type(status=apb.Status(code=code, message=message))


async def _answer_awaiting(response_type, what: str, fn, request):
    """``_answer`` for an RPC whose work awaits (``fn`` is a coroutine function)."""
    try:
        return await fn(request)
    except Exception as exc:  # noqa: BLE001 - this is the boundary
        code, message = status.code_and_message(exc, what)
        return response_type(status=apb.Status(code=code, message=message))


def _ok() -> apb.Status:
    return apb.Status(code=status.OK, message="OK")


def _topic_pb(cfg: model.TopicConfig) -> apb.Topic:
    return apb.Topic(name=cfg.name, queues=cfg.queues, message_type=cfg.message_type.name.lower())


class AdminService(PipelineRpcs, ClusterRpcs, apb_grpc.AdminServicer):
    # PipelineRpcs: QueueOffsets, ReadMessages, Stage, Publish, Abort, FlushTrace (docs/spark.md).
    # ClusterRpcs: PlaceTopic, ClusterGroups, and CreateTopic on a node with etcd (docs/cluster.md).
    def __init__(self, broker, pop, committer=None, schedules=None) -> None:
        self.broker = broker
        self.pop = pop
        self.committer = committer  # chronoq.broker.committer (None: embedded, fsyncs in place)
        self.schedules = schedules  # chronoq.features.schedules.book.ScheduleBook (None: not served)

    def _check_open(self) -> None:
        catalog.check_open(self.broker, self.pop)

    # ------------------------------------------------------------------ topics
    async def CreateTopic(self, request, context):
        if self.cluster is not None:  # a cluster: the topic's placement in etcd (chronoq.server.cluster)
            return await self._create_placed_topic(request)
        return _answer(apb.CreateTopicResponse, "CreateTopic", self._create_topic, request)

    def _create_topic(self, request) -> apb.CreateTopicResponse:
        self._check_open()
        if not request.HasField("topic"):
            raise errors.ClientError("CreateTopic needs a topic")
        want = request.topic
        cfg = catalog.create_or_update_topic(self.broker, self.pop, want.name, want.queues, want.message_type,
                                             force=request.force)
        return apb.CreateTopicResponse(status=_ok(), topic=_topic_pb(cfg))

    async def ListTopics(self, request, context):
        return _answer(apb.ListTopicsResponse, "ListTopics", self._list_topics, request)

    def _list_topics(self, request) -> apb.ListTopicsResponse:
        self._check_open()
        topics = self.broker.list_topics(include_system=request.include_system)
        return apb.ListTopicsResponse(status=_ok(), topics=[_topic_pb(t) for t in topics])

    # ------------------------------------------------------------------ groups
    async def CreateGroup(self, request, context):
        return _answer(apb.CreateGroupResponse, "CreateGroup", self._create_group, request)

    def _create_group(self, request) -> apb.CreateGroupResponse:
        self._check_open()
        if not request.HasField("group"):
            raise errors.ClientError("CreateGroup needs a group")
        want = request.group
        name = validate.group_name(want.name)
        if want.fifo and not request.set_fifo:
            raise errors.ClientError("group.fifo is true but set_fifo is false; set both to change it")
        if want.max_attempts and not request.set_max_attempts:
            raise errors.ClientError("group.max_attempts is given but set_max_attempts is false; "
                                     "set both to change it")
        cfg = self.pop.set_group(name, fifo=want.fifo if request.set_fifo else None,
                                 max_attempts=want.max_attempts if request.set_max_attempts else None)
        return apb.CreateGroupResponse(status=_ok(), group=apb.Group(
            name=cfg.name, fifo=cfg.fifo, max_attempts=cfg.max_attempts))

    async def ListGroups(self, request, context):
        return _answer(apb.ListGroupsResponse, "ListGroups", self._list_groups, request)

    def _list_groups(self, request) -> apb.ListGroupsResponse:
        self._check_open()
        rows = catalog.group_lags(self.broker, self.pop, request.group, request.topic)
        return apb.ListGroupsResponse(status=_ok(), groups=[_group_lag_pb(r) for r in rows])

    # ------------------------------------------------------------------ message lookup
    async def LookupMessage(self, request, context):
        # The lookup awaits (the trace is read in steps, other work served between).
        return await _answer_awaiting(apb.LookupMessageResponse, "LookupMessage", self._lookup_message, request)

    async def _lookup_message(self, request) -> apb.LookupMessageResponse:
        self._check_open()
        chosen = console_settings.parse(self.broker.config.extra.get("console"))  # validated at load
        scan_mib = _window_mib(request.scan_mib, chosen.lookup_scan_mib, "scan_mib", "lookup_scan_mib")
        trace_mib = _window_mib(request.trace_mib, chosen.trace_scan_mib, "trace_mib", "trace_scan_mib")
        found = await lookup.lookup_message(self.broker, self._durable, request.query, scan_mib << 20,
                                            trace_mib << 20)
        if not found.messages:
            raise errors.NotFound(
                f"no message with id or key {found.query!r} in the newest {scan_mib} MiB of the commit log "
                f"(offsets {found.scan.scanned_from}-{found.scan.scanned_to}) nor in the newest {trace_mib} MiB "
                "of the message trace" + ("" if found.trace.enabled else " (the trace is off)"))
        scan, trace = found.scan, found.trace
        return apb.LookupMessageResponse(
            status=_ok(), messages=[_looked_up_pb(m) for m in found.messages], scanned_from=scan.scanned_from,
            scanned_to=scan.scanned_to, truncated=scan.truncated, damage=scan.damage, trace_enabled=trace.enabled,
            trace_bytes_read=trace.bytes_read, trace_dropped=trace.dropped)

    # ------------------------------------------------------------------ delayed delivery
    async def Stats(self, request, context):
        return _answer(apb.StatsResponse, "Stats", self._stats, request)

    def _stats(self, request) -> apb.StatsResponse:
        self._check_open()
        s = BrokerMetrics(self.broker, lambda: self.pop).snapshot()  # the figures /metrics shows
        horizons = [apb.PendingHorizon(horizon=h, pending=n) for h, n in s.pop("pending_by_horizon").items()]
        for key in ("lateness_p50_ms", "lateness_p99_ms"):
            s[key] = -1 if s[key] is None else s[key]
        return apb.StatsResponse(status=_ok(), pending_by_horizon=horizons, **s)

    async def TimerStats(self, request, context):
        return _answer(apb.TimerStatsResponse, "TimerStats", self._timer_stats, request)

    def _timer_stats(self, request) -> apb.TimerStatsResponse:
        self._check_open()
        minutes = request.minutes or TIMER_STATS_MINUTES_DEFAULT
        if not 1 <= minutes <= TIMER_STATS_MINUTES_MAX:
            raise errors.ClientError(f"minutes must be between 1 and {TIMER_STATS_MINUTES_MAX}, not {minutes}")
        s = self.broker.timer_stats(horizon_ms=minutes * 60_000)
        return apb.TimerStatsResponse(
            status=_ok(), now_ms=s["now_ms"], bucket_ms=s["bucket_ms"], lateness=_lateness_pb(s["lateness"]),
            due_by_bucket=[apb.DueBucket(start_ms=b["start_ms"], end_ms=b["end_ms"], pending=b["pending"])
                           for b in s["due_by_bucket"]],
            overdue_pending=s["overdue_pending"], timer_lane=_lane_pb(s["timer_lane"]),
            levels=[apb.LevelBacklog(level=lv["level"], delay_ms=lv["delay_ms"], backlog=lv["backlog"],
                                     head_due_ms=lv["head_due_ms"] or 0, lane=_lane_pb(lv["lane"]))
                    for lv in s["levels"]],
            wheel_entries=s["wheel"]["entries"], buckets_on_disk=s["buckets"]["waiting_on_disk"],
            cursor=s["cursor"], lost=s["lost"],
            notes=list(s["notes"]) + [f"damaged schedule file: {d['path']} ({d['reason']})" for d in s["damage"]])

    async def Recall(self, request, context):
        # The answer awaits the committer (the tombstone durable, its fsync off the loop).
        return await _answer_awaiting(apb.RecallResponse, "Recall", self._recall, request)

    async def _recall(self, request) -> apb.RecallResponse:
        self._check_open()
        # A malformed handle raises ClientError. Embedded (no committer): the broker fsyncs in place.
        if self.cluster is not None:  # a handle of another broker group: its primary answers
            answer = await self.cluster.elsewhere(request.recall_handle, "/chronoq.v1.Admin/Recall", request,
                                                  apb.RecallResponse)
            if answer is not None:
                return answer
        committer = self.committer
        r = await committer.recall(request.recall_handle) if committer else self.broker.recall(request.recall_handle)
        return apb.RecallResponse(status=_ok(), outcome=r.outcome.value, topic=r.topic, message_id=r.message_id,
                                  deliver_at_ms=r.deliver_at_ms, detail=r.detail)

    async def Reschedule(self, request, context):
        return await _answer_awaiting(apb.RescheduleResponse, "Reschedule", self._reschedule, request)

    async def _reschedule(self, request) -> apb.RescheduleResponse:
        self._check_open()
        if not request.recall_handle:
            raise errors.ClientError("recall_handle is missing")
        if self.cluster is not None:  # a handle of another broker group: its primary answers
            answer = await self.cluster.elsewhere(request.recall_handle, "/chronoq.v1.Admin/Reschedule", request,
                                                  apb.RescheduleResponse)
            if answer is not None:
                return answer
        committer, handle, at = self.committer, request.recall_handle, request.deliver_at_ms
        r = await committer.reschedule(handle, at) if committer else self.broker.reschedule(handle, at)
        return apb.RescheduleResponse(status=_ok(), outcome=r.outcome.value, recall_handle=r.recall_handle,
                                      topic=r.topic, message_id=r.message_id, deliver_at_ms=r.deliver_at_ms,
                                      detail=r.detail)

    async def CancelByKey(self, request, context):
        # Admin only (chronoq.server.auth's default); answered once the recall records are durable.
        return await _answer_awaiting(apb.CancelByKeyResponse, "CancelByKey", self._cancel_by_key, request)

    async def _cancel_by_key(self, request) -> apb.CancelByKeyResponse:
        self._check_open()
        committer, topic, key = self.committer, request.topic, request.key
        r = await committer.cancel_by_key(topic, key) if committer else self.broker.cancel_by_key(topic, key)
        return apb.CancelByKeyResponse(
            status=_ok(), topic=r.topic, key=r.key, truncated=r.truncated,
            cancelled=[apb.KeyedMessage(message_id=m, deliver_at_ms=due) for m, due in r.cancelled],
            delivered=[apb.KeyedMessage(message_id=m, deliver_at_ms=due) for m, due in r.delivered])

    async def ListPending(self, request, context):
        return _answer(apb.ListPendingResponse, "ListPending", self._list_pending, request)

    def _list_pending(self, request) -> apb.ListPendingResponse:
        # On the loop like every broker call: a page reads at most a bucket file or so more than
        # its scan budget (chronoq.timer.pending).
        self._check_open()
        page = self.broker.pending(pendingpb.query_from(request))
        span = self.broker.pending_span() if request.span else None
        group = self.broker.timer.handle_group
        return apb.ListPendingResponse(
            status=_ok(), messages=[pendingpb.pending_pb(m, request.bodies, group) for m in page.messages],
            next_cursor=page.next_cursor, scanned=page.scanned,
            span_from_ms=span[0] if span else 0, span_to_ms=span[1] if span else 0)

    # ------------------------------------------------------------------ recurring schedules
    # The book's calls run on the loop; each change is saved (fsync) and, for pause and delete, the
    # handed-over occurrences recalled before the answer, like Recall (rare operator actions).
    def _book(self):
        self._check_open()
        if self.schedules is None:
            raise errors.ClientError("recurring schedules are not served by this broker")
        return self.schedules

    async def CreateSchedule(self, request, context):
        return _answer(apb.ScheduleResponse, "CreateSchedule", self._create_schedule, request)

    def _create_schedule(self, request) -> apb.ScheduleResponse:
        d = request.schedule
        s = self._book().create(d.name, d.topic, cron=d.cron, interval_ms=d.interval_ms, tz=d.time_zone or "UTC",
                                start_ms=d.start_ms, end_ms=d.end_ms, catch_up=d.catch_up, body=d.body, tag=d.tag,
                                keys=list(d.keys), properties=dict(d.properties))
        return apb.ScheduleResponse(status=_ok(), schedule=self._schedule_pb(s))

    async def ListSchedules(self, request, context):
        # The next firings are computed on a worker thread (upcoming_view).
        return await _answer_awaiting(apb.ListSchedulesResponse, "ListSchedules", self._list_schedules, request)

    async def _list_schedules(self, request) -> apb.ListSchedulesResponse:
        if not 0 <= request.next <= 100:
            raise errors.ClientError("next must be between 0 and 100")
        rows = [s for _n, s in sorted(self._book().schedules.items())]
        now, count = self.broker.clock.wall_ms(), request.next or 5
        nexts = await asyncio.to_thread(lambda: [upcoming_view(s, now, count) for s in rows])
        return apb.ListSchedulesResponse(status=_ok(), schedules=[
            self._schedule_pb(s, count, nxt) for s, nxt in zip(rows, nexts)])

    async def ShowSchedule(self, request, context):
        return _answer(apb.ScheduleResponse, "ShowSchedule", self._schedule_op, request)

    async def PauseSchedule(self, request, context):
        return _answer(apb.ScheduleResponse, "PauseSchedule", lambda r: self._schedule_op(r, "pause"), request)

    async def ResumeSchedule(self, request, context):
        return _answer(apb.ScheduleResponse, "ResumeSchedule", lambda r: self._schedule_op(r, "resume"), request)

    async def DeleteSchedule(self, request, context):
        return _answer(apb.ScheduleResponse, "DeleteSchedule", lambda r: self._schedule_op(r, "delete"), request)

    def _schedule_op(self, request, op: str = "") -> apb.ScheduleResponse:
        book = self._book()
        s = book.get(request.name)
        if op == "delete":
            book.delete(request.name)
            return apb.ScheduleResponse(status=_ok(), schedule=self._schedule_pb(s, 0))
        if op:
            s = getattr(book, op)(request.name)
        return apb.ScheduleResponse(status=_ok(), schedule=self._schedule_pb(s))

    # ------------------------------------------------------------------ day-two operations
    async def _durable(self) -> None:
        """Everything written so far durable and dispatched (embedded: fsynced here)."""
        if self.committer is not None:
            await self.committer.durable(self.broker.log_written)
        else:
            self.broker.flush()

    async def DescribeTopic(self, request, context):
        return _answer(apb.DescribeTopicResponse, "DescribeTopic", self._describe_topic, request)

    def _describe_topic(self, request) -> apb.DescribeTopicResponse:
        r = operations.describe_topic(self.broker, self.pop, request.topic)
        return apb.DescribeTopicResponse(
            status=_ok(), topic=_topic_pb(r.topic), messages=r.messages,
            queues=[apb.QueueDescription(queue_id=q.queue_id, min_offset=q.min_offset, max_offset=q.max_offset,
                                         messages=q.messages, oldest_ms=q.oldest_ms, newest_ms=q.newest_ms)
                    for q in r.queues],
            groups=[_group_lag_pb(g) for g in r.groups])

    async def DeleteTopic(self, request, context):
        return await _answer_awaiting(apb.DeleteTopicResponse, "DeleteTopic", self._delete_topic, request)

    async def _delete_topic(self, request) -> apb.DeleteTopicResponse:
        for attempt in range(DELETE_ATTEMPTS):  # a send may slip in between the fsync and the delete
            await self._durable()
            await self._pop_log_in_place()  # then no await until the operation: its rewrite starts
            try:
                d = operations.delete_topic(self.broker, self.pop, request.topic, request.force)
            except errors.TooManyRequests:
                if attempt == DELETE_ATTEMPTS - 1:
                    raise
                continue
            await self._pop_log_in_place()
            return apb.DeleteTopicResponse(status=_ok(), messages=d.messages, deleted=d.deleted, groups=d.groups)
        raise AssertionError("unreachable")

    async def _pop_log_in_place(self) -> None:
        """Wait until the POP log's current generation has its file (made on the committer's
        thread). Before an operation: its rewrite (``pop.operators.rewrite_log``) can start; after:
        it is durable, so an operator's reset or delete is answered only once a restart keeps it."""
        loop = asyncio.get_running_loop()
        give_up = loop.time() + POP_REWRITE_WAIT_S
        while not pop_operators.log_in_place(self.pop):
            if loop.time() > give_up:
                raise errors.StorageError("the POP log's rewrite is not durable yet (a sync keeps failing: see the "
                                          "broker's log); the change is in force and will be saved when it succeeds")
            await asyncio.sleep(0.005)

    async def ResetOffset(self, request, context):
        return await _answer_awaiting(apb.ResetOffsetResponse, "ResetOffset", self._reset_offset, request)

    async def _reset_offset(self, request) -> apb.ResetOffsetResponse:
        queue = request.queue_id if request.HasField("queue_id") else None
        await self._pop_log_in_place()
        rows = operations.reset_offset(self.broker, self.pop, request.group, request.topic, request.to,
                                       request.timestamp_ms, queue)
        await self._pop_log_in_place()
        return apb.ResetOffsetResponse(status=_ok(), queues=[
            apb.QueueReset(queue_id=r.queue_id, old_offset=r.old_offset, new_offset=r.new_offset) for r in rows])

    async def DeleteGroup(self, request, context):
        return await _answer_awaiting(apb.DeleteGroupResponse, "DeleteGroup", self._delete_group, request)

    async def _delete_group(self, request) -> apb.DeleteGroupResponse:
        await self._pop_log_in_place()
        topics = operations.delete_group(self.broker, self.pop, request.group)
        await self._pop_log_in_place()
        return apb.DeleteGroupResponse(status=_ok(), topics=topics)

    async def ListDeadLetters(self, request, context):
        return _answer(apb.ListDeadLettersResponse, "ListDeadLetters", self._list_dead_letters, request)

    def _list_dead_letters(self, request) -> apb.ListDeadLettersResponse:
        self._check_open()
        body_max = request.body_max or deadletters.BODY_DEFAULT
        if not 1 <= body_max <= deadletters.BODY_MAX:
            raise errors.ClientError(f"body_max must be between 1 and {deadletters.BODY_MAX}, not {body_max}")
        d = deadletters.list_dead(self.broker, request.group, request.limit, request.all)
        return apb.ListDeadLettersResponse(
            status=_ok(), min_offset=d.min_offset, max_offset=d.max_offset, cursor=d.cursor, messages=[
                apb.DeadLetter(offset=m.queue_offset, message_id=v.message_id, topic=v.topic, tag=v.tag,
                               keys=list(v.keys), stored_ms=m.stored_ms, body_bytes=len(m.body),
                               body=m.body[:body_max], resent=resent) for m, v, resent in d.letters])

    async def ResendDeadLetters(self, request, context):
        return await _answer_awaiting(apb.ResendDeadLettersResponse, "ResendDeadLetters", self._resend, request)

    async def _resend(self, request) -> apb.ResendDeadLettersResponse:
        self._check_open()
        r = await deadletters.resend(self.broker, self._durable, request.group, request.limit)
        return apb.ResendDeadLettersResponse(
            status=_ok(), resent=r.resent, duplicates=r.duplicates, skipped=r.skipped, from_offset=r.from_offset,
            to_offset=r.to_offset, remaining=r.remaining)

    def _schedule_pb(self, s, upcoming: int = 5, next_ms: list[int] | None = None) -> apb.Schedule:
        now = self.broker.clock.wall_ms()
        sp = s.spec
        return apb.Schedule(name=s.name, topic=s.topic, cron=sp.cron, interval_ms=sp.interval_ms, time_zone=sp.tz,
                            start_ms=sp.start_ms, end_ms=sp.end_ms, catch_up=s.catch_up, body=s.body, tag=s.tag,
                            keys=list(s.keys), properties=dict(s.properties), paused=s.paused,
                            created_ms=s.created_ms, cursor_ms=s.cursor_ms,
                            next_ms=next_ms if next_ms is not None else s.upcoming(now, upcoming) if upcoming else [],
                            pending=sum(1 for a, _h in s.ahead if a > now), refusal=s.refusal)


def _group_lag_pb(r: catalog.GroupLag) -> apb.GroupLag:
    return apb.GroupLag(group=apb.Group(name=r.group.name, fifo=r.group.fifo, max_attempts=r.group.max_attempts),
                        topic=r.topic, lag=r.lag, inflight=r.inflight)


def _lateness_pb(h: dict) -> apb.TimerLateness:
    buckets = [apb.LatenessBucket(le_ms=-1 if b["le_ms"] is None else b["le_ms"], count=b["count"])
               for b in h["buckets"]]
    assert len(buckets) == len(LATENESS_BOUNDS_MS) + 1
    return apb.TimerLateness(count=h["count"], sum_ms=h["sum_ms"], max_ms=h["max_ms"], early=h["early"],
                             p50_ms=h["p50_ms"] or 0, p99_ms=h["p99_ms"] or 0, p999_ms=h["p999_ms"] or 0,
                             buckets=buckets)


def _lane_pb(lane: dict) -> apb.TimerLane:
    return apb.TimerLane(pending=lane["pending"], pending_max=lane["pending_max"], failures=lane["failures"],
                         blocked=lane["blocked"], retry_at_ms=lane["retry_at_ms"] or 0,
                         last_error=lane["last_error"], delivered=lane["delivered"], skipped=lane["skipped"])


def _window_mib(asked: int, configured: int, field: str, setting: str) -> int:
    """A lookup window: the request's, within the [console] limits, or the configured one."""
    if asked == 0:
        return configured
    lo, hi = console_settings.ConsoleSettings.LIMITS[setting]
    if not lo <= asked <= hi:
        raise errors.ClientError(f"{field} must be between {lo} and {hi} MiB, not {asked}")
    return asked


def _looked_up_pb(m: dict) -> apb.LookedUpMessage:
    state = m["state"]
    groups = [apb.GroupOutcome(group=g, state=st, attempts=state["attempts"].get(g, 0))
              for g, st in sorted(state["groups"].items())]
    events = [apb.LifeEvent(kind=e["kind"], ts_ms=e["ts_ms"], due_ms=e["due_ms"],
                            delayed=bool(e["flags"] & FLAG_DELAYED), group=e["group"] or "", attempt=e["attempt"],
                            topic=e["topic"] or "", ref_topic=e["ref_topic"] or "", ref_queue=e["ref_queue"],
                            ref_offset=e["ref_offset"]) for e in m["events"]]
    records = [apb.LookupRecord(commit_offset=r.commit_offset, kind=r.kind, topic=r.topic, queue_id=r.queue_id,
                                queue_offset=r.queue_offset, message_id=r.message_id, tag=r.tag, keys=list(r.keys),
                                born_ms=r.born_ms, stored_ms=r.stored_ms, deliver_at_ms=r.deliver_at_ms,
                                body_bytes=r.body_bytes, recall_handle=r.recall_handle or "") for r in m["records"]]
    return apb.LookedUpMessage(message_id=m["id"], topic=m["topic"], status=state["status"],
                               stored_ms=state["stored_ms"] or 0, due_ms=state["due_ms"] or 0,
                               visible_ms=state["visible_ms"] or 0, recalled_ms=state["recalled_ms"] or 0,
                               groups=groups, events=events, records=records)
