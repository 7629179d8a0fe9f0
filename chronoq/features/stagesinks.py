"""The published batch ids of every staging sink (``chronoq.features.staging``), their limits, and
their part of the state file ``staging.json``.

A sink id names one writer's sequence of batch ids (a streaming query, or one ``df.write`` job:
``job:<jobId>``). For each, the broker remembers which batch ids are published, so a replayed
batch is not published twice. State file part (under ``"sinks"``)::

    {"<sink id>": {"below": <int>, "published": [<batch id>, ...], "used_ms": <ms>}}

A batch id is published iff it is in ``published`` or below ``below`` (every id of a contiguous
run from 0 is folded into ``below``; nothing else is: an id is never counted published on a
guess, which would answer a late partition's publish ``already_published`` and drop its rows).
A sink unused for ``SINK_FORGET_MS`` is forgotten.

Limits (a client choosing sink ids and batch ids could otherwise make the broker hold any number):

* ``max_stage_sinks`` sinks. Each costs ~420 bytes of memory and ~95 bytes of the state file
  (``bench/stage_sink_memory.py``), and the whole file is rewritten (on the event loop) at most
  every ``CHECKPOINT_EVERY_MS`` while publishes go on: 10,000 sinks are ~1 MB and 20-50 ms a rewrite.
* ``max_stage_published_ids`` batch ids held in ``published`` sets, every sink together. Ids in
  a contiguous run cost nothing (``below``); an id above a gap costs ~78 bytes of memory and ~11 of
  the file. It is the one bound on them: ids above a gap are kept until the gap is filled (a
  sink once folded its oldest past 100,000 into ``below`` as if published, the loss above).

A ``Publish`` that would add a sink, or an id above a gap, past its limit is refused
(``TooManyRequests``) before anything is written. Publishes that began before (a durable
``begin``, finished at start-up) and sinks and ids restored from the state file or the log are
never refused or dropped: the limits only stop new ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from chronoq.core import errors

log = logging.getLogger("chronoq.features.staging")

SINK_FORGET_MS = 30 * 86_400_000
IDLE_SCAN_EVERY_MS = 5_000  # a refused new sink looks for idle sinks to forget at most this often


@dataclass(slots=True)
class Sink:
    below: int = 0
    published: set[int] = field(default_factory=set)
    used_ms: int = 0

    def has(self, batch: int) -> bool:
        return batch < self.below or batch in self.published

    def add(self, batch: int, now_ms: int) -> None:
        published = self.published
        published.add(batch)
        self.used_ms = max(self.used_ms, now_ms)
        while self.below in published:  # a contiguous run from ``below`` needs no set entries
            published.discard(self.below)
            self.below += 1


class Sinks:
    """Every sink's published batch ids, with ``ids_held`` (the ids in ``published`` sets) kept
    at every change so a limit check is one compare."""

    def __init__(self, max_sinks: int, max_ids: int):
        self.max_sinks = max_sinks
        self.max_ids = max_ids
        self.by_name: dict[str, Sink] = {}
        self.ids_held = 0
        self._idle_scan_ms = -IDLE_SCAN_EVERY_MS

    def __len__(self) -> int:
        return len(self.by_name)

    def get(self, name: str) -> Sink | None:
        return self.by_name.get(name)

    def has(self, name: str, batch: int) -> bool:
        s = self.by_name.get(name)
        return s is not None and s.has(batch)

    def add(self, name: str, batch: int, now_ms: int) -> None:
        """Record ``batch`` of sink ``name`` as published; never refused (the publish is durable)."""
        s = self.by_name.get(name)
        if s is None:
            s = self.by_name[name] = Sink()
        before = len(s.published)
        s.add(batch, now_ms)
        self.ids_held += len(s.published) - before
        assert self.ids_held >= 0, self.ids_held

    def admit(self, name: str, batch: int, now_ms: int, in_flight: int) -> None:
        """Let a new publish of ``batch`` of sink ``name`` go ahead, or raise ``TooManyRequests``
        (nothing changed) if it would add a sink or an id past a limit. ``in_flight``: publishes
        under way (each may add an id when it ends). Ensures: an admitted new sink is held at once
        (an empty ``Sink``), so concurrent publishes of new sinks cannot pass ``max_sinks``."""
        s = self.by_name.get(name)
        if s is None and len(self.by_name) >= self.max_sinks and now_ms - self._idle_scan_ms >= IDLE_SCAN_EVERY_MS:
            self._idle_scan_ms = now_ms  # (a scan of every sink: not at every refused request)
            self.forget_idle(now_ms)
        if s is None and len(self.by_name) >= self.max_sinks:
            raise errors.TooManyRequests(
                f"{len(self.by_name)} staging sinks are held (a sink is forgotten {SINK_FORGET_MS // 86_400_000} "
                f"days after its last publish), the limit is max_stage_sinks ({self.max_sinks}); a new sink id "
                f"({name}) cannot publish until one is forgotten: reuse a sink id (the jobId option of a batch "
                "write) or raise max_stage_sinks")
        if batch != (s.below if s is not None else 0) and self.ids_held + in_flight >= self.max_ids:
            raise errors.TooManyRequests(
                f"{self.ids_held} published batch ids above a gap are held (and {in_flight} publishes under way), "
                f"the limit is max_stage_published_ids ({self.max_ids}); publish the missing lower batch ids of "
                "the sinks (they fold the ids above into one number), or raise max_stage_published_ids")
        if s is None:
            self.by_name[name] = Sink(used_ms=now_ms)

    def forget_idle(self, now_ms: int) -> int:
        """Forget sinks unused for ``SINK_FORGET_MS``; returns how many."""
        idle = [n for n, s in self.by_name.items() if now_ms - s.used_ms > SINK_FORGET_MS]
        for name in idle:
            self.ids_held -= len(self.by_name.pop(name).published)
        assert self.ids_held >= 0, self.ids_held
        return len(idle)

    # ----------------------------------------------------------------- state file
    def load(self, doc: dict) -> None:
        """Restore the ``"sinks"`` part of the state file: every sink is kept, whatever the limits."""
        for name, s in doc.items():
            sink = self.by_name[name] = Sink(int(s.get("below", 0)), {int(b) for b in s.get("published", [])},
                                             int(s.get("used_ms", 0)))
            self.ids_held += len(sink.published)

    def warn_if_over(self) -> None:
        if len(self.by_name) >= self.max_sinks or self.ids_held >= self.max_ids:
            log.warning("%d staging sinks holding %d published batch ids restored, max_stage_sinks is %d and "
                        "max_stage_published_ids %d: all kept, publishes past the limits refused for now",
                        len(self.by_name), self.ids_held, self.max_sinks, self.max_ids)

    def to_state(self) -> dict:
        return {n: {"below": s.below, "published": sorted(s.published), "used_ms": s.used_ms}
                for n, s in sorted(self.by_name.items())}
