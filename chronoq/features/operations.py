"""Day-two operations on topics and consumer groups, with their rules: describe a topic, delete a
topic, move a group's offsets, delete a group (``chronoq topic describe|delete``, ``chronoq group
reset-offset|delete``; the Admin service calls these, docs/cli.md says what each does to data).

The broker (``Broker.delete_topic``, ``set_offsets``, ``drop_group_offsets``) and POP
(``chronoq.pop.operators``) each do their part; here is what must hold first and the order:

- ``delete_topic`` is refused while a group that consumes the topic lags on it (messages not yet
  received, its retry copies included) unless ``force``, and, even forced, while deliveries of
  it are in flight (their acks and revives would need the state being dropped). The topic goes
  with its consumers' retry topics (``%RETRY%<group>_<topic>``); dead letters stay in each
  group's ``%DLQ%<group>``. The records stay in the commit log until retention deletes their
  segment; a delayed message of the topic still pending is delivered when due and makes the
  topic anew, as a send would (accepted messages are delivered unless recalled).
- ``reset_offset`` moves the consume offset and the POP read position of one queue or all:
  ``earliest`` (the oldest retained), ``latest`` (the next to be written: skip the backlog) or
  the first message stored at or after a time. Deliveries in flight stay in flight.
- ``delete_group`` drops the group's settings, offsets and POP state; refused while deliveries
  are in flight. Its ``%RETRY%`` and ``%DLQ%`` topics are kept (``dlq list|resend`` still work).
  Refused for a group the config file defines (``[groups.<name>]``): every start applies those
  tables, so the group would come back at the next restart; the config file is the place to
  remove it (then restart, then delete what the broker still keeps of it).
"""

from __future__ import annotations

from dataclasses import dataclass

from chronoq.core import errors, validate
from chronoq.features import catalog
from chronoq.pop import names, operators

TO_CHOICES = ("earliest", "latest", "timestamp")


@dataclass(frozen=True, slots=True)
class QueueFigures:
    queue_id: int
    min_offset: int
    max_offset: int     # the next offset: readable offsets are min..max-1
    oldest_ms: int      # entry time of the oldest message (0: empty)
    newest_ms: int

    @property
    def messages(self) -> int:
        return self.max_offset - self.min_offset


@dataclass(frozen=True, slots=True)
class TopicReport:
    topic: object                   # chronoq.core.model.TopicConfig
    queues: list[QueueFigures]
    groups: list[catalog.GroupLag]  # the groups consuming it

    @property
    def messages(self) -> int:
        return sum(q.messages for q in self.queues)


def _user_topic(broker, name: str):
    name = validate.user_topic(name)
    cfg = broker.topics.get(name)
    if cfg is None:
        raise errors.TopicNotFound(f"topic {name!r} does not exist")
    return cfg


def _consumers(broker, pop, topic: str) -> list[catalog.GroupLag]:
    """``group list``'s rows for ``topic``, of the groups that consume it."""
    consuming = {g for g, topics in pop.consumed_topics().items() if topic in topics}
    return [r for r in catalog.group_lags(broker, pop, topic=topic) if r.group.name in consuming]


def describe_topic(broker, pop, name: str) -> TopicReport:
    catalog.check_open(broker, pop)
    cfg = _user_topic(broker, name)
    queues = [QueueFigures(*f) for f in broker.queue_figures(cfg.name)]
    return TopicReport(cfg, queues, _consumers(broker, pop, cfg.name))


@dataclass(frozen=True, slots=True)
class TopicDeleted:
    messages: int
    deleted: list[str]   # the topic, then its retry topics
    groups: list[str]    # groups whose offsets for them were dropped


def delete_topic(broker, pop, name: str, force: bool = False) -> TopicDeleted:
    """Delete user topic ``name`` and its retry topics (rules above). Everything written must be
    dispatched first (the Admin service awaits the committer's barrier)."""
    catalog.check_open(broker, pop)
    cfg = _user_topic(broker, name)
    lagging = [r for r in _consumers(broker, pop, cfg.name) if r.lag]
    if lagging and not force:
        who = ", ".join(f"{r.group.name} ({r.lag} not received)" for r in lagging)
        raise errors.ClientError(f"consumer groups lag on topic {cfg.name}: {who}; delete it anyway with force "
                                 "(chronoq topic delete --force)")
    groups = catalog.known_groups(broker, pop)
    retries = sorted(t for t in (names.retry_topic(g, cfg.name) for g in groups) if t in broker.topics)
    topics = (cfg.name, *retries)
    busy = operators.in_flight(pop, None, topics)
    if busy:
        raise errors.ClientError(f"{busy} deliveries of topic {cfg.name} are in flight; delete it once they are "
                                 "acked or their invisible time ends (force does not override this)")
    operators.forget(pop, None, topics)
    dropped = sorted({g for t in topics for g in broker.offsets if t in broker.offsets[g]})
    messages = broker.delete_topic(cfg.name)
    for retry in retries:
        broker.drop_system_topic(retry)
    operators.rewrite_log(pop)
    return TopicDeleted(messages, list(topics), dropped)


@dataclass(frozen=True, slots=True)
class QueueReset:
    queue_id: int
    old_offset: int
    new_offset: int


def _known_group(broker, pop, group: str) -> str:
    name = validate.group_name(group)
    if name not in catalog.known_groups(broker, pop):
        raise errors.GroupNotFound(f"consumer group {name!r} does not exist")
    return name


def reset_offset(broker, pop, group: str, topic: str, to: str, at_ms: int = 0,
                 queue_id: int | None = None) -> list[QueueReset]:
    """Move ``group``'s offsets of ``topic`` (every queue, or ``queue_id``) ``to`` earliest,
    latest or the first message stored at or after ``at_ms``; durable before this returns."""
    catalog.check_open(broker, pop)
    group = _known_group(broker, pop, group)
    cfg = _user_topic(broker, topic)
    if to not in TO_CHOICES:
        raise errors.ClientError(f"to must be one of {', '.join(TO_CHOICES)}, not {to!r}")
    if to == "timestamp" and at_ms <= 0:
        raise errors.ClientError("to timestamp needs the time (epoch ms > 0)")
    if queue_id is not None and not 0 <= queue_id < cfg.queues:
        raise errors.InvalidQueue(f"queue {queue_id} does not exist in topic {cfg.name} (queues 0-{cfg.queues - 1})")
    queues = range(cfg.queues) if queue_id is None else (queue_id,)
    targets = {}
    for q in queues:
        lo, hi = broker.queue_bounds(cfg.name, q)
        targets[q] = lo if to == "earliest" else hi if to == "latest" else broker.offset_for_time(cfg.name, q, at_ms)
    olds = {}
    for q in queues:  # the position before: POP's read position, else the committed offset
        committed = broker.offsets.get(group, {}).get(cfg.name, {}).get(q)
        olds[q] = committed if committed is not None else broker.queue_bounds(cfg.name, q)[0]
    broker.set_offsets(group, cfg.name, targets)
    for q in queues:
        old = operators.reset_position(pop, group, cfg.name, q, targets[q])
        if old is not None:
            olds[q] = old
    operators.rewrite_log(pop)
    return [QueueReset(q, olds[q], targets[q]) for q in queues]


def delete_group(broker, pop, group: str) -> list[str]:
    """Forget ``group``: settings, offsets, POP state (rules above). Returns the topics it had
    offsets for."""
    catalog.check_open(broker, pop)
    group = _known_group(broker, pop, group)
    configured = broker.config.extra.get("groups")
    if isinstance(configured, dict) and group in configured:
        raise errors.ClientError(f"group {group} is defined in the config file ([groups.{group}]) and would come back "
                                 f"at the next start: remove [groups.{group}] from the config file, restart the "
                                 "broker, then delete the group")
    busy = operators.in_flight(pop, group)
    if busy:
        raise errors.ClientError(f"{busy} deliveries of group {group} are in flight; delete it once they are acked "
                                 "or their invisible time ends")
    operators.forget(pop, group)
    topics = broker.drop_group_offsets(group)
    operators.rewrite_log(pop)
    return topics
