"""Offsets of the chronoq source as canonical JSON dicts, and read limits. Pure: no I/O, no Spark.

An offset names, per queue of one topic, the next message offset to read::

    {"orders": {"0": 120, "1": 97, "2": 130, "3": 101}}

Spark stores it in its checkpoint with ``json.dumps`` and compares offsets *as JSON text*, so
every dict made here has one canonical form: queue ids as decimal strings, in ascending numeric
order (a dict keeps insertion order; ``json.loads`` of a stored offset keeps the stored order,
which is this one). A micro-batch covers ``[start[q], end[q])`` of each queue.

A query of several topics has a key per topic (``canonical_many``), topics in sorted order.

A topic spread over several broker groups (docs/cluster.md) has queues per group, each group's
local ids starting at 0: its queues are named ``"<group>/<queue>"`` (``GroupQueue``), ordered by
group name then queue id::

    {"orders": {"g1/0": 120, "g1/1": 97, "g2/0": 130, "g2/1": 101}}

A topic on one node keeps the bare ids above (a plain ``int`` here). Group names never hold
``/`` (letters, digits, ``-``, ``_``, ``.``), so the two forms cannot be confused.

``startingOffsets`` / ``endingOffsets`` options: ``earliest``, ``latest``, or JSON in the same
shape where ``-2`` means the queue's earliest retained offset and ``-1`` its latest (Kafka's
convention). A queue missing from a JSON option starts at its earliest offset and (ending) stops
at its latest.
"""

from __future__ import annotations

import json
from typing import Callable, NamedTuple

EARLIEST = -2
LATEST = -1


class GroupQueue(NamedTuple):
    """A queue of a topic spread over broker groups: the group's name and its local queue id."""
    group: str
    queue: int

    def __str__(self) -> str:
        return f"{self.group}/{self.queue}"


QueueId = int | GroupQueue   # a bare id: the topic on the node asked (no placement)
Bounds = dict[QueueId, tuple[int, int]]  # queue -> (min offset, next offset)


def queue_order(q: QueueId) -> tuple[str, int]:
    """Sort key of a queue id: bare ids first, in numeric order; then by group, queue."""
    return ("", q) if isinstance(q, int) else (q.group, q.queue)


def _key_order(k) -> tuple:
    """Sort key of a queue id or of a (topic, queue id) key (``limit_rows``, ``ranges``)."""
    if isinstance(k, (int, GroupQueue)):
        return queue_order(k)
    return (k[0], queue_order(k[1]))


def parse_queue(text) -> QueueId:
    """``"3"`` -> 3; ``"g1/3"`` -> GroupQueue("g1", 3); anything else: ValueError."""
    text = str(text)
    group, sep, queue = text.rpartition("/")
    if queue.isdigit() and (not sep or (group and "/" not in group)):
        return GroupQueue(group, int(queue)) if sep else int(queue)
    raise ValueError(f"{text!r} is not a queue id (\"3\", or \"<group>/3\" for a topic spread over broker groups)")


def canonical(topic: str, positions: dict[QueueId, int]) -> dict:
    """The one JSON-able form of ``positions`` (queue -> offset)."""
    return {topic: {str(q): int(positions[q]) for q in sorted(positions, key=queue_order)}}


def positions(topic: str, offset: dict | None) -> dict[QueueId, int]:
    """queue -> offset of a canonical offset dict (as Spark hands it back)."""
    if not offset:
        return {}
    if list(offset) != [topic]:
        raise ValueError(f"the checkpoint's offsets are for topic(s) {sorted(offset)}, but this query reads "
                         f"{topic!r}: use a new checkpoint location for a different topic")
    return {parse_queue(q): int(o) for q, o in offset[topic].items()}


def parse_option(topic: str, text: str | None, default: str, bounds: Bounds, what: str) -> dict[int, int]:
    """Resolve ``earliest`` / ``latest`` / JSON against the queues' current bounds."""
    text = (text or default).strip()
    if text == "earliest":
        return {q: lo for q, (lo, _hi) in bounds.items()}
    if text == "latest":
        return {q: hi for q, (_lo, hi) in bounds.items()}
    try:
        data = json.loads(text)
    except ValueError:
        raise ValueError(f"{what} must be 'earliest', 'latest' or JSON like "
                         f'{{"{topic}": {{"0": 42, "1": -2}}}}, not {text!r}') from None
    if not isinstance(data, dict) or list(data) != [topic] or not isinstance(data[topic], dict):
        raise ValueError(f'{what} JSON must name this topic only: {{"{topic}": {{"<queue>": <offset>, ...}}}}')
    given = {}
    for q, off in data[topic].items():
        try:
            qid = parse_queue(q)
        except ValueError:
            qid = None
        if qid not in bounds:
            names = [str(b) for b in sorted(bounds, key=queue_order)]
            shown = f"0..{len(bounds) - 1}" if all(isinstance(b, int) for b in bounds) else ", ".join(names)
            raise ValueError(f"{what}: topic {topic} has no queue {q!r} (queues {shown})")
        if not isinstance(off, int) or isinstance(off, bool) or off < EARLIEST:
            raise ValueError(f"{what}: offset of queue {q} must be an integer >= -2, not {off!r}")
        given[qid] = off
    out = {}
    fallback_latest = what == "endingOffsets"
    for q, (lo, hi) in bounds.items():
        off = given.get(q, LATEST if fallback_latest else EARLIEST)
        out[q] = lo if off == EARLIEST else hi if off == LATEST else off
    return out


def limit_rows(start: dict[int, int], end: dict[int, int], max_rows: int | None) -> dict[int, int]:
    """``end`` cut so that at most ``max_rows`` messages lie between ``start`` and it, shared fairly.

    A queue missing from ``start`` counts from 0 (see ``ranges``).
    Every queue with data gets an equal share; the share a short queue leaves over goes to the
    others (so a limit is always filled when enough data exists). Queues are visited in order.
    """
    if max_rows is None:
        return dict(end)
    assert max_rows > 0
    avail = {q: max(0, end[q] - start.get(q, 0)) for q in end}
    take = {q: 0 for q in end}
    left = max_rows
    open_queues = [q for q in sorted(avail, key=_key_order) if avail[q] > 0]
    while left > 0 and open_queues:
        share = max(1, left // len(open_queues))
        still = []
        for q in open_queues:
            n = min(share, avail[q] - take[q], left)
            take[q] += n
            left -= n
            if take[q] < avail[q]:
                still.append(q)
            if left == 0:
                break
        open_queues = still
    return {q: start.get(q, 0) + take[q] if avail[q] else end[q] for q in end}


def ranges(start: dict[int, int], end: dict[int, int], per_partition: int) -> list[tuple[int, int, int]]:
    """(queue, from, to) pieces of at most ``per_partition`` messages covering start..end.

    A queue missing from ``start`` (the topic grew) is read from 0 (the read skips to the queue's
    earliest retained offset), so a replay of the same offsets plans the same ranges.
    """
    out = []
    for q in sorted(end, key=_key_order):
        lo, hi = start.get(q, 0), end[q]
        while lo < hi:
            step = min(per_partition, hi - lo)
            out.append((q, lo, lo + step))
            lo += step
    return out


# ---------------------------------------------------------------------------- several topics
# A query may read several topics (``subscribe`` with a list, ``subscribePattern``). Its offsets
# are the same JSON with a key per topic, topics in sorted order; positions are flattened to
# (topic, queue) keys, which ``limit_rows`` and ``ranges`` take as they take queue ids.
Key = tuple[str, QueueId]


def canonical_many(positions: dict[Key, int]) -> dict:
    """The one JSON-able form of ``positions`` ((topic, queue) -> offset): topics sorted, each as ``canonical``."""
    by_topic: dict[str, dict[int, int]] = {}
    for (topic, q), off in positions.items():
        by_topic.setdefault(topic, {})[q] = off
    return {topic: canonical(topic, by_topic[topic])[topic] for topic in sorted(by_topic)}


def positions_many(offset: dict | None, topics: frozenset[str] | None = None) -> dict[Key, int]:
    """(topic, queue) -> offset of a canonical offset dict. ``topics``: the topics the query reads
    when it names them (a pattern: None, any topic may appear)."""
    if not offset:
        return {}
    if topics is not None and not set(offset) <= topics:
        raise ValueError(f"the checkpoint's offsets are for topic(s) {sorted(offset)}, but this query reads "
                         f"{sorted(topics)}: use a new checkpoint location for different topics")
    return {(topic, parse_queue(q)): int(o) for topic, queues in offset.items() for q, o in queues.items()}


def adopt(positions: dict[Key, int], spread: dict[str, str]) -> dict[Key, int]:
    """Bare queue ids of topics now spread over broker groups, named as the group's queues.

    ``spread``: topic -> the group a bare id belongs to (the group of the node that answered for
    the topic before its placement: a checkpoint written before the topic was spread resumes on
    that group's queues, and reads the other groups' from their start)."""
    out = {}
    for (topic, q), off in positions.items():
        group = spread.get(topic)
        out[(topic, GroupQueue(group, q) if group and isinstance(q, int) else q)] = off
    return out


def parse_option_many(text: str | None, default: str, bounds: dict[str, Bounds], what: str) -> dict[Key, int]:
    """``parse_option`` over several topics: ``earliest``/``latest`` for all, or JSON naming some
    of them (a topic the JSON leaves out starts at its earliest, and ends at its latest)."""
    text = (text or default).strip()
    if text in ("earliest", "latest"):
        per_topic = {topic: text for topic in bounds}
    else:
        try:
            data = json.loads(text)
        except ValueError:
            data = None
        if not isinstance(data, dict):
            example = json.dumps({topic: {"0": 42} for topic in sorted(bounds)[:2]} or {"orders": {"0": 42}})
            raise ValueError(f"{what} must be 'earliest', 'latest' or JSON like {example}, not {text!r}")
        unknown = sorted(set(data) - set(bounds))
        if unknown:
            raise ValueError(f"{what} names topic(s) {unknown} this query does not read (it reads {sorted(bounds)})")
        per_topic = {topic: json.dumps({topic: data[topic]}) if topic in data else
                     ("latest" if what == "endingOffsets" else "earliest") for topic in bounds}
    out: dict[Key, int] = {}
    for topic, topic_text in per_topic.items():
        for q, off in parse_option(topic, topic_text, default, bounds[topic], what).items():
            out[(topic, q)] = off
    return out


def check_batch_range(start: dict[Key, int], end: dict[Key, int], bounds: dict[str, Bounds]) -> None:
    """A batch read's offsets make sense now, as Kafka's source asks: no queue ends past its
    newest message (the read would fail on an executor later, naming less) and none starts after
    it ends (it read nothing, silently). ValueError naming the queue and both offsets."""
    for (topic, q), stop in end.items():
        lo, hi = bounds[topic][q]
        if stop > hi:
            raise ValueError(f"endingOffsets: queue {q} of topic {topic} ends at offset {hi}; {stop} is past "
                             "it (-1 is its latest)")
        begin = start.get((topic, q), lo)
        if begin > stop:
            raise ValueError(f"startingOffsets {begin} is after endingOffsets {stop} for queue {q} of topic "
                             f"{topic} (its messages are offsets {lo} to {hi - 1})")


def first_at_or_after(lo: int, hi: int, time_at: Callable[[int], int], at_ms: int) -> int:
    """The first offset in [lo, hi) whose message entered its queue at or after ``at_ms``, or
    ``hi`` when none did (``startingTimestamp``). Binary search: a queue's messages enter it in
    offset order, so their times do not decrease. ``time_at(offset)`` reads one message's time;
    about log2(hi - lo) reads."""
    assert lo <= hi
    steps = 0
    while lo < hi:
        mid = (lo + hi) // 2
        if time_at(mid) >= at_ms:
            hi = mid
        else:
            lo = mid + 1
        steps += 1
        assert steps <= 64, "a binary search over int64 offsets ends within 64 steps"
    return lo
