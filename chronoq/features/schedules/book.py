"""Recurring schedules: their durable state and the rounds that hand occurrences to the timer.

Design. chronoq's delayed messages already fire exactly when due, durably and once (chronoq.timer).
So a schedule never fires anything itself: a *round* writes each schedule's next occurrences (those
due within ``horizon_ms``, at most ``ahead_max`` pending per schedule) as ordinary delayed messages
through the broker's one send path (``Broker.write``: validation, dedupe, metrics, trace; then the
committer's fsync), each with a deterministic id ``<name>-<generation>-<instant ms>`` and the user
properties ``CHRONOQ_SCHEDULE`` (name) and ``CHRONOQ_SCHEDULE_AT`` (the occurrence instant, epoch
ms). From then on the timer owns it: never early, delivered once across crashes, cancellable by its
recall handle (pause and delete recall what was handed over). The book records, per schedule, the
*cursor*: every occurrence at or before it is resolved (handed over or skipped by the policy).

State file ``schedules.json`` (``fsutil.write_json``: atomic, CRC-checked; a *source*, docs/storage.md)::

    {"version": 1, "next_gen": n,
     "schedules": {name: {"topic", "cron", "interval_ms", "tz", "start_ms", "end_ms", "anchor_ms",
                          "catch_up", "body_b64", "tag", "keys", "properties", "created_ms",
                          "gen", "paused", "cursor_ms", "deleted",
                          "ahead": [[instant_ms, recall_handle], ...]}},
     "intent": null | {"log_from": commit offset, "items": [[name, gen, [instant_ms, ...]], ...],
                       "cursors": {name: [gen, cursor_ms]}, "topics": {name: topic}}}

Crash reasoning (a round = intent, write, fsync, completion):

1. ``begin_round`` plans and records an *intent* (what it is about to write and the commit-log
   position ``log_from`` it will be written after); the caller saves the file (fsync) *before*
   writing anything.
2. ``write_round`` appends the occurrence messages (one ``Broker.write``: one contiguous batch).
3. The caller waits for the commit log's fsync (``GroupCommitter.durable`` / ``Broker.flush``).
4. ``finish_round`` moves the cursors, records the recall handles, clears the intent; saved.

A crash before 1 is saved: nothing was written, the old cursor re-plans the same occurrences.
A crash after 1 and before 4 is saved: the file still holds the intent, and at the next open
``resolve_intent`` reads the commit log from ``log_from`` to its end (after the store's recovery
cut any torn tail) and adopts exactly the planned messages found there (by topic and message id),
rebuilding their recall handles from their records; the cursor moves to the last one found. The
batch was appended in order and recovery only ever cuts a suffix of the log, so what was found is a
prefix of the plan: the rest was never written and is planned again (its ids were never stored, so
the dedupe window cannot answer for them). Nothing is written twice and nothing is skipped. The
dedupe window is not relied on: it is memory only and empty after a restart. The scan is bounded
by what was written between the intent and the crash (one round: milliseconds of traffic). A
failure inside a running process (a full disk, a failed fsync) takes the same path: the intent
stays, the next round first waits for the log to be durable and resolves it.

Pause and delete are saved first (paused; or deleting) and recall afterwards, then save again:
a crash in between leaves a paused schedule holding handles, and ``_settle`` (at open and before
each round) recalls them; the other order could leave an active schedule whose next occurrences
were recalled, lost. They recall every occurrence handed over and not yet due (an occurrence within the
timer's prewrite window answers ALREADY_DELIVERED: it fires, and the cursor stays at or past it);
an in-flight round's occurrences are recalled when it finishes (its schedule's generation
changed). Each pause, resume and create starts a new *generation*, which is part of the message
id: an occurrence re-handed-over after a resume never shares an id with the recalled one (the
dedupe window would answer the cancelled original).

Limits (each a constructor argument with a documented default, docs/timers.md): ``max_schedules``
(1,000), ``body_max`` (64 KiB of template body), ``ahead_max`` (100 occurrences handed over and
pending per schedule), ``horizon_ms`` (10 s ahead), ``catch_up_max`` (1,000 for ``all``).
"""

from __future__ import annotations

import base64
import logging
import os
import re
from dataclasses import dataclass, field

from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core import errors, fsutil, validate
from chronoq.features.schedules import occurrences as occ
from chronoq.store import record
from chronoq.timer import handle as handles
from chronoq.timer.service import RecallOutcome

log = logging.getLogger("chronoq.features.schedules")

STATE_FILE = "schedules.json"
PROP_SCHEDULE = "CHRONOQ_SCHEDULE"
PROP_SCHEDULE_AT = "CHRONOQ_SCHEDULE_AT"
BROKER_PROPS = "CHRONOQ_"  # properties the broker sets or reads (a template may set none)
NAME_MAX = 64
_NAME_RE = re.compile(r"[A-Za-z0-9_-]+")

MAX_SCHEDULES = 1_000
BODY_MAX = 64 * 1024
AHEAD_MAX = 100
HORIZON_MS = 10_000
CATCH_UP_MAX = 1_000
UPCOMING_SHOWN = 5
CACHED_AHEAD = 1  # next occurrences computed at least per lookup (Schedule.after)
REFUSED_BACKOFF_MAX_MS = 60_000  # a schedule whose occurrences are refused is tried again this often
# What the broker answers occurrences it will not take (against a storage failure, which fails the
# whole round and is resolved from the log): one schedule's trouble, not every schedule's.
REFUSALS = (errors.ClientError, errors.NotFound, errors.Unsupported, errors.TooManyRequests)


@dataclass(slots=True)
class Schedule:
    name: str
    topic: str
    spec: occ.Spec
    catch_up: str
    body: bytes
    tag: str = ""
    keys: list[str] = field(default_factory=list)
    properties: dict[str, str] = field(default_factory=dict)
    created_ms: int = 0
    gen: int = 0
    paused: bool = False
    cursor_ms: int = 0
    deleted: bool = False  # deleting: saved before its occurrences are recalled (ScheduleBook.delete)
    ahead: list[list] = field(default_factory=list)  # [instant_ms, recall handle], ascending
    # Not saved: the next occurrences after ``_after_ms`` (a cron lookup costs 0.3-0.7 ms, and the
    # round task asks for every schedule's next one each time it wakes: 1,000 schedules uncached
    # were most of a second of the event loop); ``_ended``: the list holds every one left.
    _after_ms: int = field(default=-1, repr=False, compare=False)
    _next: list = field(default_factory=list, repr=False, compare=False)
    _ended: bool = field(default=False, repr=False, compare=False)
    # Not saved either: why the broker last refused its occurrences ("" while it takes them), and
    # the back-off before they are planned again (ScheduleBook._refused).
    refusal: str = field(default="", compare=False)
    _retry_ms: int = field(default=0, repr=False, compare=False)
    _backoff_ms: int = field(default=0, repr=False, compare=False)

    def after(self, t_ms: int, count: int) -> list[int]:
        """The first ``count`` occurrences > ``t_ms`` (fewer when the schedule ends), cached."""
        if 0 <= self._after_ms <= t_ms:
            got = [a for a in self._next if a > t_ms]
            if len(got) >= count or self._ended:
                return got[:count]
        self._next = occ.upcoming(self.spec, t_ms, max(count, CACHED_AHEAD))
        self._after_ms, self._ended = t_ms, len(self._next) < max(count, CACHED_AHEAD)
        return self._next[:count]

    def message_id(self, instant_ms: int, gen: int | None = None) -> str:
        return f"{self.name}-{self.gen if gen is None else gen}-{instant_ms}"

    def to_json(self) -> dict:
        s = self.spec
        return {"topic": self.topic, "cron": s.cron, "interval_ms": s.interval_ms, "tz": s.tz,
                "start_ms": s.start_ms, "end_ms": s.end_ms, "anchor_ms": s.anchor_ms, "catch_up": self.catch_up,
                "body_b64": base64.b64encode(self.body).decode(), "tag": self.tag, "keys": list(self.keys),
                "properties": dict(self.properties), "created_ms": self.created_ms, "gen": self.gen,
                "paused": self.paused, "cursor_ms": self.cursor_ms, "ahead": [list(a) for a in self.ahead],
                "deleted": self.deleted}

    @classmethod
    def from_json(cls, name: str, d: dict) -> "Schedule":
        spec = occ.Spec(d["cron"], d["interval_ms"], d["tz"], d["start_ms"], d["end_ms"], d["anchor_ms"])
        return cls(name, d["topic"], spec, d["catch_up"], base64.b64decode(d["body_b64"]), d["tag"], list(d["keys"]),
                   dict(d["properties"]), d["created_ms"], d["gen"], d["paused"], d["cursor_ms"],
                   bool(d.get("deleted")), [list(a) for a in d["ahead"]])

    def upcoming(self, now_ms: int, count: int = UPCOMING_SHOWN) -> list[int]:
        """The next firings: those handed over still pending, then the planned ones (cached)."""
        if self.paused:
            return []
        pending = [a for a, _h in self.ahead if a > now_ms]
        return (pending + self.after(max(self.cursor_ms, now_ms), count))[:count]


def upcoming_view(s: Schedule, now_ms: int, count: int = UPCOMING_SHOWN) -> list[int]:
    """``Schedule.upcoming`` without its cache, for a worker thread: listing 1,000 cron schedules
    costs seconds of croniter lookups (0.3-1 ms each here), which must not hold the event loop.
    Reads a schedule the loop may change meanwhile: a display, never a decision."""
    if s.paused:
        return []
    pending = [a for a, _h in list(s.ahead) if a > now_ms]
    return (pending + occ.upcoming(s.spec, max(s.cursor_ms, now_ms), count))[:count]


@dataclass(slots=True)
class Round:
    """One round's plan and what writing it returned."""

    log_from: int
    items: list[tuple[str, int, list[int]]]          # (name, gen, instants)
    messages: list[OutgoingMessage]
    cursors: dict[str, list]                        # name -> [gen, cursor after the round]
    results: list = field(default_factory=list)      # SendResult per message, once written


class ScheduleBook:
    """Every schedule, the file that keeps them, and the rounds. Single-threaded (the event loop)."""

    def __init__(self, broker: Broker, *, max_schedules: int = MAX_SCHEDULES, body_max: int = BODY_MAX,
                 ahead_max: int = AHEAD_MAX, horizon_ms: int = HORIZON_MS, catch_up_max: int = CATCH_UP_MAX):
        self.broker = broker
        self.clock = broker.clock
        self.max_schedules, self.body_max, self.ahead_max = max_schedules, body_max, ahead_max
        self.horizon_ms, self.catch_up_max = horizon_ms, catch_up_max
        self.path = os.path.join(broker.data_dir, STATE_FILE)
        self.schedules: dict[str, Schedule] = {}
        self.next_gen = 1
        self.intent: dict | None = None
        self.fired_total = 0  # occurrences handed to the timer since open
        self.on_change = lambda: None  # the server's task: a schedule may need a round sooner
        self._load()
        self._settle()

    # ----------------------------------------------------------------- state
    def _load(self) -> None:
        try:
            doc = fsutil.read_json(self.path) or {}
        except ValueError as exc:  # a source: refusing to start beats silently losing every schedule
            raise errors.CorruptionError(self.path, 0, str(exc)) from None
        self.next_gen = int(doc.get("next_gen", 1))
        self.schedules = {n: Schedule.from_json(n, d) for n, d in doc.get("schedules", {}).items()}
        self.intent = doc.get("intent")

    def snapshot(self) -> dict:
        return {"version": 1, "next_gen": self.next_gen, "intent": self.intent,
                "schedules": {n: s.to_json() for n, s in sorted(self.schedules.items())}}

    def save(self) -> None:
        fsutil.write_json(self.path, self.snapshot())

    # ----------------------------------------------------------------- management
    def create(self, name: str, topic: str, *, cron: str = "", interval_ms: int = 0, tz: str = "UTC",
               start_ms: int = 0, end_ms: int = 0, catch_up: str = "", body: bytes | str = b"", tag: str = "",
               keys=(), properties: dict | None = None) -> Schedule:
        """A new schedule (durable when this returns). ``errors.ClientError`` names what is wrong."""
        if not isinstance(name, str) or not name or len(name) > NAME_MAX or not _NAME_RE.fullmatch(name):
            raise errors.ClientError(f"schedule name must be 1..{NAME_MAX} of letters, digits, '_' and '-'")
        if name in self.schedules:
            raise errors.ClientError(f"schedule {name!r} already exists (delete it first)")
        if len(self.schedules) >= self.max_schedules:
            raise errors.ClientError(f"{self.max_schedules} schedules exist, the limit (max_schedules)")
        topic = validate.user_topic(topic)
        self.broker.topic(topic)  # exists, or auto-created as configured (else TopicNotFound)
        catch_up = catch_up or occ.CATCH_UP_DEFAULT
        if catch_up not in occ.CATCH_UP_POLICIES:
            raise errors.ClientError(f"catch-up policy must be one of {', '.join(occ.CATCH_UP_POLICIES)}")
        body = body.encode() if isinstance(body, str) else bytes(body)
        if not body:
            raise errors.ClientError("the message body of a schedule is empty")
        if len(body) > self.body_max:
            raise errors.ClientError(f"template body is {len(body)} bytes; at most {self.body_max}")
        props = validate.properties(properties or {})
        if any(k.startswith(BROKER_PROPS) for k in props):
            # (CHRONOQ_SCHEDULE* are the book's; CHRONOQ_REPLACE_KEY would make each occurrence
            # handed over replace the one before it, so none would fire; CHRONOQ_DELAY_LEVEL
            # contradicts the occurrence's delivery time)
            raise errors.ClientError(f"properties starting with {BROKER_PROPS} are the broker's; a schedule's "
                                     "occurrences carry their own")
        keys = list(validate.keys(list(keys))) if keys else []
        tag = validate.tag(tag)
        now = self.clock.wall_ms()
        spec = occ.make_spec(cron, interval_ms, tz, start_ms, end_ms, now)
        s = Schedule(name, topic, spec, catch_up, body, tag, keys, props, created_ms=now, gen=0, cursor_ms=now)
        # An occurrence as the broker will see it, checked by its rules now (a topic typed for
        # other messages than delayed ones refuses it): a schedule whose every occurrence would be
        # refused is refused instead. (What changes later, a topic retyped or deleted, is the
        # round's to survive: write_round.)
        self.broker.prepare(self._message(s, now + self.horizon_ms))
        s.gen = self._new_gen()
        self.schedules[name] = s
        self.save()
        self.on_change()
        return s

    def _new_gen(self) -> int:
        gen, self.next_gen = self.next_gen, self.next_gen + 1
        return gen

    def get(self, name: str) -> Schedule:
        s = self.schedules.get(name)
        if s is None or s.deleted:
            raise errors.NotFound(f"no schedule named {name!r}")
        return s

    def pause(self, name: str) -> Schedule:
        """Stop firing: occurrences after now do not fire (those the timer already claimed, within
        its prewrite window, do). Durable when this returns.

        The pause is saved *before* anything is recalled: a crash in between leaves a paused
        schedule still holding handles, which ``_settle`` recalls at the next open or round. The
        other order could leave an active schedule whose next occurrences were recalled (lost)."""
        s = self.get(name)
        if not s.paused:
            s.paused = True
            s.gen = self._new_gen()
            self.save()
            self._recall_ahead(s)
            self.save()
        return s

    def resume(self, name: str) -> Schedule:
        """Fire again from now on: occurrences due while paused never fire."""
        s = self.get(name)
        if s.paused:
            s.paused = False
            s.gen = self._new_gen()
            s.cursor_ms = max(s.cursor_ms, self.clock.wall_ms())
            self.save()
            self.on_change()
        return s

    def delete(self, name: str) -> None:
        """Delete: saved as deleting first, then its handed-over occurrences recalled, then gone
        (a crash in between is finished by ``_settle``, as for ``pause``)."""
        s = self.get(name)
        s.deleted = s.paused = True
        s.gen = self._new_gen()
        self.save()
        self._recall_ahead(s)
        del self.schedules[name]
        self.save()

    def _settle(self) -> None:
        """Finish a pause or delete a crash or a failed recall interrupted: paused and deleting
        schedules hold no handed-over occurrences."""
        changed = False
        for s in list(self.schedules.values()):
            if s.paused and s.ahead:
                self._recall_ahead(s)
                changed = True
            if s.deleted:
                del self.schedules[s.name]
                changed = True
        if changed:
            self.save()

    def _recall_ahead(self, s: Schedule) -> None:
        """Recall what was handed over; the cursor ends at now or at the last one that fires anyway."""
        now = self.clock.wall_ms()
        floor = now
        for instant, handle in s.ahead:
            if instant > now and self.broker.recall(handle).outcome is RecallOutcome.ALREADY_DELIVERED:
                floor = max(floor, instant)
            elif instant <= now:
                floor = max(floor, instant)
        s.ahead = []
        s.cursor_ms = floor

    # ----------------------------------------------------------------- rounds
    def next_round_ms(self) -> int | None:
        """When a round next has work (may be in the past), or None: nothing to plan."""
        if self.intent is not None:
            return self.clock.wall_ms()
        best = None
        for s in self.schedules.values():
            if s.paused:
                continue
            nxt = s.after(s.cursor_ms, 1)
            if not nxt:
                continue
            due = max(nxt[0] - self.horizon_ms // 2, s._retry_ms)
            best = due if best is None else min(best, due)
        return best

    def begin_round(self, now_ms: int | None = None) -> Round | None:
        """Plan the occurrences due for hand-over and record the intent (save before writing)."""
        assert self.intent is None, "resolve the last round's intent first"
        self._settle()
        now = self.clock.wall_ms() if now_ms is None else now_ms
        items, messages, cursors = [], [], {}
        for s in self.schedules.values():
            s.ahead = [a for a in s.ahead if a[0] > now]  # fired: the timer owns them
            if s.paused:
                continue
            nxt = s.after(s.cursor_ms, 1)
            if not nxt or nxt[0] - self.horizon_ms // 2 > now or s._retry_ms > now:
                continue
            p = occ.plan(s.spec, s.catch_up, s.cursor_ms, now, self.horizon_ms, self.ahead_max - len(s.ahead),
                         self.catch_up_max)
            if p.missed_skipped:
                log.warning("schedule %s: occurrences missed before %d skipped (catch-up %s)", s.name, now,
                            s.catch_up)
            cursors[s.name] = [s.gen, p.cursor_ms]
            if p.fire:
                items.append((s.name, s.gen, list(p.fire)))
                messages.extend(self._message(s, at) for at in p.fire)
        if not cursors:
            return None
        rnd = Round(self.broker.log_written, items, messages, cursors)
        # The topics too: a schedule deleted before the intent is resolved must still be found
        # in the log (its occurrences are then recalled).
        self.intent = {"log_from": rnd.log_from, "items": [[n, g, list(a)] for n, g, a in items],
                       "cursors": cursors, "topics": {n: self.schedules[n].topic for n, _g, _a in items}}
        return rnd

    def _message(self, s: Schedule, at: int) -> OutgoingMessage:
        props = dict(s.properties)
        props[PROP_SCHEDULE] = s.name
        props[PROP_SCHEDULE_AT] = str(at)
        return OutgoingMessage(s.topic, s.body, tag=s.tag, keys=s.keys, properties=props,
                               message_id=s.message_id(at), deliver_at_ms=at)

    def write_round(self, rnd: Round) -> None:
        """Append the round's messages (page cache; durable with the next commit-log fsync).

        One batch, as a rule. When the broker refuses it (a schedule's topic retyped or deleted
        since its create, an occurrence's id sent by someone else within the dedupe window), it
        wrote nothing, and each schedule's occurrences are written as a batch of their own: a
        refused schedule is set aside (``_refused``: its cursor stays, it is tried again after a
        back-off) and the others fire. Refused or not, the log holds a prefix of each schedule's
        plan, in plan order, which is what ``resolve_intent`` relies on."""
        if not rnd.messages:
            return
        self.broker.check_space()
        try:
            rnd.results = self.broker.write(rnd.messages)
        except REFUSALS:
            rnd.results, at = [], 0
            for index, (_name, _gen, instants) in enumerate(rnd.items):
                try:
                    rnd.results.extend(self.broker.write(rnd.messages[at:at + len(instants)]))
                except REFUSALS as exc:
                    self._refused(rnd, index, len(rnd.results), exc)
                at += len(instants)
        assert len(rnd.results) == len(rnd.messages)

    def _refused(self, rnd: Round, index: int, first: int, exc: Exception) -> None:
        """Schedule ``rnd.items[index]``'s occurrences were refused (``exc``): none is handed
        over (their results from ``first`` are None), its cursor stays, and it is planned again
        after a back-off (1 s, doubling to REFUSED_BACKOFF_MAX_MS). Said once per reason."""
        name, _gen, instants = rnd.items[index]
        rnd.results[first:first] = [None] * len(instants)
        rnd.cursors.pop(name, None)
        s = self.schedules.get(name)
        if s is None:
            return
        now = self.clock.wall_ms()
        s._backoff_ms = min(REFUSED_BACKOFF_MAX_MS, max(1_000, s._backoff_ms * 2))
        s._retry_ms = now + s._backoff_ms
        if str(exc) != s.refusal:
            log.error("schedule %s: its occurrences are refused, none fires until they are accepted (tried again "
                      "every %d s at most): %s", name, REFUSED_BACKOFF_MAX_MS // 1000, exc)
        s.refusal = str(exc)

    def finish_round(self, rnd: Round) -> None:
        """The round's messages are durable: move the cursors, keep the handles, clear the intent."""
        handed = {}
        i = 0
        for name, gen, instants in rnd.items:
            for at in instants:
                result = rnd.results[i]
                i += 1
                if result is not None:
                    handed[(name, gen, at)] = result.recall_handle
            s = self.schedules.get(name)
            if s is not None and s.refusal and name in rnd.cursors:
                log.info("schedule %s: its occurrences are accepted again", name)
                s.refusal, s._backoff_ms = "", 0
        self._adopt(handed, rnd.cursors)
        self.intent = None

    def _adopt(self, handed: dict, cursors: dict) -> None:
        """Record handed-over occurrences: kept if their schedule and generation still stand,
        recalled otherwise (paused or deleted meanwhile)."""
        for (name, gen, at), handle in sorted(handed.items(), key=lambda kv: kv[0][2]):
            s = self.schedules.get(name)
            if s is None or s.gen != gen or s.paused:
                if handle:
                    self.broker.recall(handle)
                continue
            self.fired_total += 1
            if all(a[0] != at for a in s.ahead):
                s.ahead.append([at, handle])
        for name, (gen, cursor) in cursors.items():
            s = self.schedules.get(name)
            if s is not None and s.gen == gen and not s.paused:
                s.cursor_ms = max(s.cursor_ms, cursor)
        for s in self.schedules.values():
            s.ahead.sort()

    def resolve_intent(self) -> int:
        """After a crash or a failed round: adopt the planned messages the commit log holds (read
        from the intent's ``log_from`` to the end), forget the rest (planned again). Returns how
        many were found. Call once everything written is durable."""
        intent = self.intent
        if intent is None:
            return 0
        wanted = {}
        for name, gen, instants in intent["items"]:
            topic = intent.get("topics", {}).get(name)
            for at in instants:
                wanted[(topic, f"{name}-{gen}-{at}")] = (name, gen, at)
        handed = {}
        if wanted:
            for offset, raw in self.broker.scan_log(intent["log_from"]):
                f = record.decode(raw)
                key = wanted.get((f["topic"], f["message_id"]))
                if key is None:
                    continue
                kind = handles.TIMER if f["flags"] & record.FLAG_DELAYED else handles.IMMEDIATE
                handed[key] = handles.encode(kind, 0, offset, f["deliver_at_ms"], f["topic"], f["message_id"],
                                             self.broker.timer.handle_group)
        # Found: a prefix of each schedule's plan (one batch, in order; recovery cuts only a suffix).
        cursors = {}
        for name, gen, instants in intent["items"]:
            found = [at for at in instants if (name, gen, at) in handed]
            if found != instants[:len(found)]:
                log.error("schedule %s: the log holds occurrences %s of %s (not a prefix); the gaps are skipped",
                          name, found, instants)
            if found:
                cursors[name] = [gen, found[-1]]
        self._adopt(handed, cursors)
        self.intent = None
        log.info("schedules: a round interrupted by a crash or failure resolved from the log: %d of %d "
                 "occurrences were written", len(handed), len(wanted))
        return len(handed)

    def run_round_here(self, now_ms: int | None = None) -> int:
        """One whole round in place, for the embedded broker and tests (the server's task runs the
        same steps with the committer's fsync off the loop). Returns occurrences handed over."""
        if self.intent is not None:
            self.broker.flush()
            self.resolve_intent()
            self.save()
        rnd = self.begin_round(now_ms)
        if rnd is None:
            return 0
        self.save()
        self.write_round(rnd)
        self.broker.flush()
        self.finish_round(rnd)
        self.save()
        return len(rnd.messages)
