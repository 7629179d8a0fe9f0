"""What POP consumption has done since the service started, for ``chronoq.server.metrics``. Pure.

Plain ints in plain dicts (a ``collections.Counter`` update costs several times a dict's), counted
per call: a receive adds its batch at once, ``ack_many`` its settled handles at once. Keys are
(group, topic), ``topic`` being the topic the consumer asked for (a retried message counts under
its origin topic, as ``PopService.inflight_by_topic`` does), or the group alone for what revive
decides per group.
"""

from __future__ import annotations


class PopCounters:
    __slots__ = ("received", "acked", "nacked", "revived", "retried", "dead_lettered")

    def __init__(self) -> None:
        self.received: dict[tuple[str, str], int] = {}  # messages handed out, each attempt
        self.acked: dict[tuple[str, str], int] = {}
        # Negative acknowledgements: a change of invisible time (the RocketMQ 5 way to nack).
        self.nacked: dict[tuple[str, str], int] = {}
        self.revived: dict[str, int] = {}  # invisible time ended unacked: retried, DLQ or FIFO again
        self.retried: dict[str, int] = {}  # copies written to %RETRY%{group}_{topic}
        # Copies written to %DLQ%{group}: max attempts reached, or forwarded by the client.
        self.dead_lettered: dict[str, int] = {}

    def revive_outcome(self, group: str, revived: int, retried: int, dead_lettered: int) -> None:
        """Count what one revive pass (or a client's forward to the DLQ) did for ``group``."""
        assert min(revived, retried, dead_lettered) >= 0
        for counts, n in ((self.revived, revived), (self.retried, retried), (self.dead_lettered, dead_lettered)):
            if n:
                counts[group] = counts.get(group, 0) + n
