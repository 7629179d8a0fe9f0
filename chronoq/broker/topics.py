"""The broker's topics: their configuration, the file that keeps it, and the name checks of a send.

File ``topics.json`` in the data directory (``fsutil.write_json``, written whole on every change)::

    {"topics": [{"name", "queues", "message_type"}, ...]}

sorted by name. Queues found in the store but missing from it (lost metadata) are adopted on open.
"""

from __future__ import annotations

import os
from typing import Iterable

from chronoq.core import errors, fsutil, model, validate
from chronoq.core.config import BrokerConfig
from chronoq.core.model import MessageType, TopicConfig

TOPICS_FILE = "topics.json"


class TopicRegistry:
    """Every topic by name (``topics``, the dict ``Broker.topics`` is), and the validated names
    a send looks up first (``user_cache``/``system_cache``: the name rules cost more than the
    rest of a send)."""

    def __init__(self, data_dir: str, config: BrokerConfig):
        self.path = os.path.join(data_dir, TOPICS_FILE)
        self.config = config
        self.topics: dict[str, TopicConfig] = {}
        self.user_cache: dict[str, TopicConfig] = {}
        self.system_cache: dict[str, TopicConfig] = {}

    def load(self, store_queues: Iterable[tuple[str, int]]) -> None:
        try:
            data = fsutil.read_json(self.path)
        except ValueError as exc:
            raise errors.CorruptionError(self.path, 0, str(exc)) from None
        for item in (data or {}).get("topics", []):
            cfg = TopicConfig.from_json(item)
            self.topics[cfg.name] = cfg
        # Queues found in the store but missing from topics.json (e.g. lost metadata) are adopted.
        for (topic, qid) in list(store_queues):
            cfg = self.topics.get(topic)
            if cfg is None:
                self.topics[topic] = TopicConfig(topic, max(self.config.default_queues, qid + 1))
            elif qid >= cfg.queues:
                cfg.queues = qid + 1

    def save(self) -> None:
        fsutil.write_json(self.path,
                          {"topics": [t.to_json() for t in sorted(self.topics.values(), key=lambda t: t.name)]})

    def create(self, name: str, queues: int | None = None,
               message_type: MessageType | str = MessageType.MIXED, *, system: bool = False) -> TopicConfig:
        """Create a topic, or update its queue count (only upwards) and type. Idempotent."""
        name = validate.topic_name(name) if system else validate.user_topic(name)
        if isinstance(message_type, str):
            message_type = MessageType.parse(message_type)
        queues = self.config.default_queues if queues is None else queues
        if not isinstance(queues, int) or not 1 <= queues <= self.config.max_queues:
            raise errors.InvalidQueue(f"queue count must be between 1 and {self.config.max_queues}, not {queues!r}")
        existing = self.topics.get(name)
        if existing is not None:
            if queues < existing.queues:
                raise errors.InvalidQueue(f"topic {name} has {existing.queues} queues; the count can only grow")
            if existing.queues == queues and existing.message_type == message_type:
                return existing
        cfg = TopicConfig(name, queues, message_type)
        self.topics[name] = cfg
        self.save()
        return cfg

    def list(self, include_system: bool = False) -> list[TopicConfig]:
        return sorted((t for t in self.topics.values() if include_system or not model.is_system_topic(t.name)),
                      key=lambda t: t.name)

    def get(self, name: str, *, create: bool | None = None) -> TopicConfig:
        """The topic ``name``; auto-created (``create`` None: as configured) unless a system topic."""
        cfg = self.topics.get(name)
        if cfg is not None:
            return cfg
        validate.topic_name(name)
        if create is None:
            create = self.config.auto_create_topics
        if not create or model.is_system_topic(name):
            raise errors.TopicNotFound(f"topic {name!r} does not exist"
                                       + ("" if create else " (auto-create is off: create it first)"))
        return self.create(name)

    def send_topic(self, name: object, system: bool,
                   new_topics: dict[str, TopicConfig] | None = None) -> TopicConfig:
        """The topic a message goes to. With ``new_topics``, a topic auto-create would make is only
        planned there (not saved), so a batch that fails validation creates nothing."""
        # Validated topics are cached: the name rules cost more than the rest of a send.
        cache = self.system_cache if system else self.user_cache
        cfg = cache.get(name) if type(name) is str else None  # (an unhashable name must not raise TypeError)
        if cfg is None or self.topics.get(name) is not cfg:  # type: ignore[arg-type]
            topic_name = validate.topic_name(name) if system else validate.user_topic(name)
            if new_topics is not None and topic_name not in self.topics:
                planned = new_topics.get(topic_name)
                if planned is None:
                    if not self.config.auto_create_topics or model.is_system_topic(topic_name):
                        self.get(topic_name)  # raises TopicNotFound, worded as usual
                    planned = new_topics[topic_name] = TopicConfig(topic_name, self.config.default_queues)
                return planned
            cfg = cache[topic_name] = self.get(topic_name)
        return cfg
