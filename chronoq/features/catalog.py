"""Topics and consumer groups as operators see them: create or update a topic, and each group's
lag and in-flight count per topic it consumes.

Shared by the Admin service (``chronoq.server.admin``: ``chronoq topic create``, ``chronoq group
list``) and the web console (``chronoq.console.views``: its overview and "create topic" form), so
a topic created from either follows the same rules and both show the same lag. Everything runs
on the event loop like every broker call, so a report is a consistent snapshot.

Rules:

- ``create_or_update_topic`` is idempotent. ``queues = 0`` and ``message_type = ""`` mean "the
  default" for a new topic (``default_queues``; ``mixed``, which accepts every message type) and
  "keep" for an existing one, so re-running a create never fails on a topic that grew meanwhile.
- ``group_lags`` reports the groups ``PopService`` knows (created, configured, or having
  received) and groups that only hold consume offsets (pull by offset), each with default
  settings if it was never configured. Rows are per (group, topic): the topics the group has
  POP state or consume offsets for; lag is ``PopService.lag`` (not yet received, retry copies
  included) and in-flight is ``PopService.inflight_by_topic``.
"""

from __future__ import annotations

from dataclasses import dataclass

from chronoq.core import errors, model, validate
from chronoq.pop.names import DEFAULT_MAX_ATTEMPTS


@dataclass(frozen=True, slots=True)
class GroupInfo:
    name: str
    fifo: bool
    max_attempts: int


@dataclass(frozen=True, slots=True)
class GroupLag:
    group: GroupInfo
    topic: str      # "": the group consumes no topic yet (one row, lag and in-flight 0)
    lag: int        # messages of the topic (and the group's retry copies) not received yet
    inflight: int   # deliveries handed out and not settled


def check_open(broker, pop) -> None:
    if broker.closed or pop.closed:
        raise errors.ClosedError("the broker is stopping")


def create_or_update_topic(broker, pop, name: str, queues: int, message_type: str,
                           force: bool = False) -> model.TopicConfig:
    """Create topic ``name`` or grow its queues / change its type (0 and "": the default or keep);
    changing the type of a topic that holds messages needs ``force`` (``Broker.create_topic``)."""
    check_open(broker, pop)
    name = validate.user_topic(name)
    existing = broker.topics.get(name)
    if queues < 0:
        raise errors.InvalidQueue(f"queue count must be positive, not {queues}")
    queues = queues or (existing.queues if existing is not None else None)
    if message_type:
        kind = model.MessageType.parse(message_type)
    else:
        kind = existing.message_type if existing is not None else model.MessageType.MIXED
    return broker.create_topic(name, queues, kind, force=force)


def known_groups(broker, pop) -> dict[str, GroupInfo]:
    """Every group POP knows, and the groups that only hold consume offsets (default settings)."""
    groups = {g.name: GroupInfo(g.name, g.fifo, g.max_attempts) for g in pop.list_groups()}
    for name in broker.list_groups():  # groups that only hold consume offsets
        if name in groups:
            continue
        try:
            validate.group_name(name)
        except errors.ClientError:  # an internal consumer of the broker's own: not listed
            continue
        groups[name] = GroupInfo(name, False, DEFAULT_MAX_ATTEMPTS)
    return groups


def group_lags(broker, pop, group: str = "", topic: str = "") -> list[GroupLag]:
    """Lag and in-flight per (group, topic), sorted by group; ``group``/``topic`` narrow it (a
    topic given is reported for every listed group, even one that never received from it)."""
    check_open(broker, pop)
    groups = known_groups(broker, pop)
    if group:
        name = validate.group_name(group)
        if name not in groups:
            raise errors.GroupNotFound(f"consumer group {name!r} does not exist")
        groups = {name: groups[name]}
    only_topic = None
    if topic:
        only_topic = validate.user_topic(topic)
        if only_topic not in broker.topics:
            raise errors.TopicNotFound(f"topic {only_topic!r} does not exist")
    inflight = pop.inflight_by_topic()
    consumed = pop.consumed_topics(inflight)
    rows = []
    for name in sorted(groups):
        topics = [only_topic] if only_topic is not None else sorted(consumed.get(name, ()))
        for t in topics:
            rows.append(GroupLag(groups[name], t, pop.lag(name, t), inflight.get((name, t), 0)))
        if not topics:
            rows.append(GroupLag(groups[name], "", 0, 0))
    return rows
