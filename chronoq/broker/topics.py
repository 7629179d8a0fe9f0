"""The broker's topics: their configuration, the file that keeps it, and the name checks of a send.

File ``topics.json`` in the data directory (``fsutil.write_json``, written whole on every change;
the new topics of one send batch in one write, ``create_planned``)::

    {"topics": [{"name", "queues", "message_type"}, ...]}

sorted by name. It is a source (docs/storage.md): nothing else records a topic's queue count or
type. On open, the topics of queues found in the store but missing from it (the file lost, or a
crash between a topic's first record and the file) are adopted and the file saved again:

* a system topic with the queues the store has (up to its highest queue id): its owner asks for
  the count it needs before it writes there (``create(..., system=True)`` only grows, never
  refuses), so it ends as its owner made it (the trace topic at open, the delay-level topic at
  the next level send);
* a user topic with at least ``default_queues`` (more if the store has more) and type mixed (it
  accepts every type): a guess, said in the recovery report (``notes``). Queues that never held
  a message leave no trace, and the type is in no record.

A damaged file refuses the open (``CorruptionError`` naming it and what to do): guessing there
would hide the damage.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterable

from chronoq.core import errors, fsutil, model, validate
from chronoq.core.config import BrokerConfig
from chronoq.core.model import MessageType, TopicConfig

TOPICS_FILE = "topics.json"
# What an operator can do about a damaged topics.json (the refusal says it).
DAMAGED_ADVICE = ("It holds the topic configurations (queue counts, types). Restore it from a backup or "
                  "from a replica's data directory (replicas keep a copy), or move it aside to rebuild the "
                  "topic table from the store: system topics as their owners make them, user topics with "
                  "at least default_queues queues and type mixed (docs/storage.md).")
ADOPTED_SHOWN_MAX = 10  # topic names a recovery note lists

log = logging.getLogger("chronoq.broker.broker")


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
        self._encoded: dict[str, tuple[tuple, bytes]] = {}  # name -> (queues and type, its entry in the file)

    def load(self, store_queues: Iterable[tuple[str, int]], notes: list[str] | None = None) -> None:
        """Read the file, then adopt the store's queues it lacks (module docstring); what was
        adopted is appended to ``notes`` (the recovery report) and logged."""
        found = os.path.exists(self.path)
        data = fsutil.read_source(self.path, DAMAGED_ADVICE)
        try:
            for item in data.get("topics", []):
                cfg = TopicConfig.from_json(item)
                self.topics[cfg.name] = cfg
        except (AttributeError, KeyError, TypeError, ValueError, errors.ClientError) as exc:
            raise errors.CorruptionError(self.path, 0, f"a topic entry is not as written ({exc})",
                                         DAMAGED_ADVICE) from None
        # The entries encoded now, at start-up, not by the first save (a send's new topic): 27 ms
        # at 10,000 topics, one entry at a time.
        for cfg in self.topics.values():
            self._encode(cfg)
        highest: dict[str, int] = {}
        for (topic, qid) in list(store_queues):
            highest[topic] = max(highest.get(topic, 0), qid + 1)
        adopted, users = [], 0
        for topic, count in sorted(highest.items()):
            cfg = self.topics.get(topic)
            if cfg is None:
                queues = count if model.is_system_topic(topic) else max(self.config.default_queues, count)
                self.topics[topic] = TopicConfig(topic, queues)
                adopted.append(f"{topic} ({queues})")
                users += not model.is_system_topic(topic)
            elif count > cfg.queues:
                cfg.queues = count
                adopted.append(f"{topic} ({count}, grown)")
        if not adopted:
            return
        self.save()
        shown = ", ".join(adopted[:ADOPTED_SHOWN_MAX]) + (
            f" and {len(adopted) - ADOPTED_SHOWN_MAX} more" if len(adopted) > ADOPTED_SHOWN_MAX else "")
        if not users:
            # System topics only, e.g. CHRONOQ_EPOCH on a promoted replica: their owners size them,
            # nothing for an operator to check or restore (no line in the start-up report).
            log.info("%s: adopted the store's system topic(s) %s", TOPICS_FILE, shown)
            return
        note = (f"{TOPICS_FILE} {'lacked' if found else 'was missing:'} {len(adopted)} topic(s) the store has, "
                f"adopted with their queue counts: {shown}; a user topic adopted has at least default_queues "
                f"queues and type mixed (check `chronoq topic list`; restore {self.path} from a backup for "
                "the exact ones)")
        log.warning("%s", note)
        if notes is not None:
            notes.append(note)

    def save(self) -> None:
        """Write the file whole, each topic's entry encoded once and kept while its configuration
        stays (``_encoded``): encoding every entry again cost a new topic 11 ms of the event
        loop at 10,000 topics, 2.5 ms this way (the same bytes as ``fsutil.write_json`` of
        the whole document; tests/unit/test_topics_file.py)."""
        encoded, topics, parts = self._encoded, self.topics, []
        for name in sorted(topics):
            cfg = topics[name]
            key = (cfg.queues, cfg.message_type)  # (a TopicConfig may change in place: load's adoption)
            kept = encoded.get(name)
            parts.append(kept[1] if kept is not None and kept[0] == key else self._encode(cfg))
        if len(encoded) > len(topics):  # removed topics' entries
            for name in [n for n in encoded if n not in topics]:
                del encoded[name]
        fsutil.write_json_body(self.path, b'{"topics":[' + b",".join(parts) + b"]}")

    def _encode(self, cfg: TopicConfig) -> bytes:
        """``cfg``'s entry in the file, kept for the saves to come (``save``)."""
        entry = fsutil.dumps_json(cfg.to_json())
        self._encoded[cfg.name] = ((cfg.queues, cfg.message_type), entry)
        return entry

    def create(self, name: str, queues: int | None = None,
               message_type: MessageType | str = MessageType.MIXED, *, system: bool = False,
               held: Callable[[str], int] | None = None, save: bool = True) -> TopicConfig:
        """Create a topic, or update its queue count (only upwards) and type. Idempotent.

        With ``held`` (the messages a topic holds), changing the type of a topic that holds
        messages is refused: its producers and consumers were written for the old type, and its
        messages keep theirs. ``Broker.create_topic`` passes it unless forced. ``save`` False:
        the caller saves (``create_planned``)."""
        name = validate.topic_name(name) if system else validate.user_topic(name)
        if isinstance(message_type, str):
            message_type = MessageType.parse(message_type)
        queues = self.config.default_queues if queues is None else queues
        if not isinstance(queues, int) or not 1 <= queues <= self.config.max_queues:
            raise errors.InvalidQueue(f"queue count must be between 1 and {self.config.max_queues}, not {queues!r}")
        existing = self.topics.get(name)
        if existing is not None:
            if system and queues < existing.queues:
                # A system topic's owner asks for the queues it needs; more (an older adoption
                # of lost metadata made it default_queues) are left empty, never refused.
                queues = existing.queues
            if queues < existing.queues:
                raise errors.InvalidQueue(f"topic {name} has {existing.queues} queues; the count can only grow")
            if existing.queues == queues and existing.message_type == message_type:
                return existing
            count = held(name) if held is not None and existing.message_type != message_type else 0
            if count:
                raise errors.ClientError(
                    f"topic {name} holds {count} message{'' if count == 1 else 's'} of type "
                    f"{existing.message_type.name.lower()}; changing it to {message_type.name.lower()} is "
                    "refused unless forced (chronoq topic create --force)")
        if existing is None and not system:
            self.check_room(name)
        cfg = TopicConfig(name, queues, message_type)
        self.topics[name] = cfg
        if save:
            self.save()
        return cfg

    def create_planned(self, names: Iterable[str]) -> None:
        """Create the topics a valid send batch planned (``send_topic``'s ``new_topics``; default
        queues, type mixed) and save the file once for all of them, before the batch is written.
        One save per topic rewrote the whole, growing file with three fsyncs each: a batch of 500
        new topics held the event loop 0.8 s (bench/stalls.py --topics 2000), 100 new topics
        0.6 s at 6,000 topics. A save that fails forgets them again (the batch fails; a retry
        plans them anew)."""
        made = [name for name in dict.fromkeys(names) if name not in self.topics]
        if not made:
            return
        self.check_room(made[0], len(made) - 1, errors.TopicNotFound)
        try:
            for name in made:
                self.create(name, save=False)
            self.save()
        except BaseException:
            for name in made:
                self.topics.pop(name, None)
            raise

    def check_room(self, name: str, planned: int = 0, error: type[errors.ChronoqError] = errors.ClientError) -> None:
        """Refuse a new user topic past ``max_topics`` (``planned``: new ones a batch makes too).
        Clients create topics (auto-create): each costs its queues' files and state and a metrics
        series per topic, so their number is bounded like every other resource a client grows."""
        limit = self.config.max_topics
        if len(self.topics) + planned < limit:  # (system topics count here too: a handful)
            return
        users = sum(1 for t in self.topics if not model.is_system_topic(t)) + planned
        if users >= limit:
            raise error(f"topic {name!r} not created: the broker holds max_topics ({limit}) topics; "
                        "delete unused ones (chronoq topic delete) or raise max_topics")

    def remove(self, name: str) -> TopicConfig:
        """Forget topic ``name`` (saved at once); its queues are the store's to drop."""
        cfg = self.topics.pop(name, None)
        if cfg is None:
            raise errors.TopicNotFound(f"topic {name!r} does not exist")
        self.user_cache.pop(name, None)
        self.system_cache.pop(name, None)
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
            why = ("" if create else " (auto-create is off: create it first)" if self.config.auto_create_topics is False
                   else " (only a send or a route lookup creates one)")
            raise errors.TopicNotFound(f"topic {name!r} does not exist{why}")
        self.check_room(name, error=errors.TopicNotFound)
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
                    self.check_room(topic_name, len(new_topics), errors.TopicNotFound)
                    planned = new_topics[topic_name] = TopicConfig(topic_name, self.config.default_queues)
                return planned
            cfg = cache[topic_name] = self.get(topic_name)
        return cfg


# ----------------------------------------------------------------------------- figures of a topic's queues
def messages_in(store, cfg: TopicConfig) -> int:
    """Messages in the topic's queues (their entries from the oldest retained on)."""
    return sum(hi - lo for lo, hi in (store.bounds(cfg.name, q) for q in range(cfg.queues)))


def queue_figures(store, cfg: TopicConfig) -> list[tuple[int, int, int, int, int]]:
    """Per queue: (queue id, min offset, next offset, entry time of the oldest, of the newest;
    0 when the queue is empty). The entry time is the stored time (a timer copy's: its due time)."""
    out = []
    for q in range(cfg.queues):
        lo, hi = store.bounds(cfg.name, q)
        first = store.entries(cfg.name, q, lo, 1) if hi > lo else []
        last = store.entries(cfg.name, q, hi - 1, 1) if hi > lo else []
        out.append((q, lo, hi, first[0][3] if first else 0, last[0][3] if last else 0))
    return out


def offset_for_time(store, topic: str, queue_id: int, at_ms: int) -> int:
    """The first offset of the queue whose entry time is at or after ``at_ms`` (the next offset
    when none is): a binary search, since entry times follow the log's order (stored times; a
    delivered timer copy is stamped with its due time when it is written, also in order)."""
    lo, hi = store.bounds(topic, queue_id)
    while lo < hi:
        mid = (lo + hi) // 2
        entry = store.entries(topic, queue_id, mid, 1)
        if entry and entry[0][3] >= at_ms:
            hi = mid
        else:
            lo = mid + 1
    return lo
