"""Consumer-group offsets: where each group resumes reading each queue.

File ``offsets.json`` in the data directory (``fsutil.write_json``, written whole)::

    {"<group>": {"<topic>": {"<queue id>": <next offset to consume>}}}

Written at a broker checkpoint (``checkpoint_interval_ms``) when something changed, and at a clean
stop; an unreadable file is logged and the groups restart from what the queues hold.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from chronoq.core import errors, fsutil, validate
from chronoq.core.model import TopicConfig

log = logging.getLogger("chronoq.broker.broker")

OFFSETS_FILE = "offsets.json"


def _is_int(value: object) -> bool:
    """An int that is not a bool (``True`` must not pass for queue 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


class ConsumerOffsets:
    """The offsets in memory (``offsets``, the dict ``Broker.offsets`` is) and whether they
    changed since last written (``dirty``)."""

    def __init__(self, data_dir: str):
        self.path = os.path.join(data_dir, OFFSETS_FILE)
        self.offsets: dict[str, dict[str, dict[int, int]]] = {}
        self.dirty = False
        self._valid_groups: set[str] = set()  # group names ``commit`` has validated

    def load(self) -> None:
        data = fsutil.read_state(self.path, log, "consumer offsets", "groups restart from their last durable state")
        self.offsets = {g: {t: {int(q): int(o) for q, o in qs.items()} for t, qs in ts.items()}
                        for g, ts in data.items()}

    def get(self, group: str, topic: str, queue_id: int) -> int | None:
        validate.group_name(group)
        return self.offsets.get(group, {}).get(topic, {}).get(queue_id)

    def commit(self, group: str, topic: str, queue_id: int, offset: int, cfg: TopicConfig | None,
               bounds: Callable[[str, int], tuple[int, int]]) -> None:
        """Record that ``group`` consumed ``topic``/``queue_id`` below ``offset``; ``cfg`` is the
        topic's configuration (None: no such topic), ``bounds`` the store's queue bounds."""
        if group not in self._valid_groups:  # POP commits after every ack: validate a name once
            validate.group_name(group)
            if len(self._valid_groups) > 10_000:
                self._valid_groups.clear()
            self._valid_groups.add(group)
        if cfg is None:
            raise errors.TopicNotFound(f"topic {topic!r} does not exist")
        if not _is_int(queue_id) or not 0 <= queue_id < cfg.queues:
            raise errors.InvalidQueue(f"queue {queue_id!r} does not exist in topic {topic}")
        lo, hi = bounds(topic, queue_id)
        if not _is_int(offset) or not 0 <= offset <= hi:
            raise errors.InvalidOffset(f"offset {offset!r} is outside 0..{hi} for {topic}/{queue_id}")
        self.offsets.setdefault(group, {}).setdefault(topic, {})[queue_id] = offset
        self.dirty = True

    def put(self, group: str, topic: str, queue_id: int, offset: int) -> None:
        """Set an offset as it is, up or down (``group reset-offset``, the DLQ resend cursor of
        ``chronoq.features.deadletters``, whose group name is the broker's own); the caller checked
        the queue and the offset. Saved by ``save``, or at the next checkpoint."""
        assert _is_int(queue_id) and _is_int(offset) and offset >= 0, (queue_id, offset)
        self.offsets.setdefault(group, {}).setdefault(topic, {})[queue_id] = offset
        self.dirty = True

    def drop_topic(self, topic: str) -> list[str]:
        """Forget every group's offsets for ``topic``; returns those groups."""
        groups = sorted(g for g, topics in self.offsets.items() if topics.pop(topic, None) is not None)
        self._prune()
        return groups

    def drop_group(self, group: str) -> list[str]:
        """Forget ``group``'s offsets; returns the topics it had offsets for."""
        topics = sorted(self.offsets.pop(group, {}))
        self.dirty = True
        return topics

    def _prune(self) -> None:
        for g in [g for g, topics in self.offsets.items() if not topics]:
            del self.offsets[g]
        self.dirty = True

    def groups(self) -> list[str]:
        return sorted(self.offsets)

    def save(self) -> None:
        """Write the file now if anything changed (a clean stop)."""
        if self.dirty:
            fsutil.write_json(self.path, self.doc())
            self.dirty = False

    def save_now(self) -> None:
        """Write the file now, and again at the next checkpoint: an admin change (``put``,
        ``drop_*``) is durable before its answer, and a checkpoint job that took the document
        before the change and writes it after cannot leave the old one for long."""
        fsutil.write_json(self.path, self.doc())
        self.dirty = True

    def take(self) -> dict | None:
        """For a checkpoint: the document to write if anything changed (None: nothing did), the
        offsets counted as written from here on; ``write_failed`` undoes that."""
        doc = self.doc() if self.dirty else None
        self.dirty = False
        return doc

    def write_failed(self) -> None:
        self.dirty = True  # written again at the next checkpoint

    def doc(self) -> dict:
        return {g: {t: {str(q): o for q, o in qs.items()} for t, qs in ts.items()} for g, ts in self.offsets.items()}
