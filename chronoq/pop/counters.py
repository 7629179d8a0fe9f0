"""What POP consumption has done since the service started, for ``chronoq.server.metrics``. Pure.

Plain ints in plain dicts (a ``collections.Counter`` update costs several times a dict's), counted
per call: a receive adds its batch at once, ``ack_many`` its settled handles at once. Keys are
(group, topic), ``topic`` being the topic the consumer asked for (a retried message counts under
its origin topic, as ``PopService.inflight_by_topic`` does), or the group alone for what revive
decides per group.

A deleted group or topic takes its keys along (``forget``): every key is a series on ``/metrics``,
and a topic or group per tenant or per day, deleted when done, would otherwise grow the scrape
until a restart. What they had counted stays in ``received_gone`` / ``acked_gone``, so the
service's totals (the console's history) never shrink.
"""

from __future__ import annotations


class PopCounters:
    __slots__ = ("received", "acked", "nacked", "revived", "retried", "dead_lettered", "received_gone", "acked_gone")

    def __init__(self) -> None:
        self.received: dict[tuple[str, str], int] = {}  # messages handed out, each attempt
        self.acked: dict[tuple[str, str], int] = {}
        # Negative acknowledgements: a change of invisible time (the RocketMQ 5 way to nack).
        self.nacked: dict[tuple[str, str], int] = {}
        self.revived: dict[str, int] = {}  # invisible time ended unacked: retried, DLQ or FIFO again
        self.retried: dict[str, int] = {}  # copies written to %RETRY%{group}_{topic}
        # Copies written to %DLQ%{group}: max attempts reached, or forwarded by the client.
        self.dead_lettered: dict[str, int] = {}
        self.received_gone = 0  # counted under keys since forgotten (deleted groups and topics)
        self.acked_gone = 0

    def total_received(self) -> int:
        return sum(self.received.values()) + self.received_gone

    def total_acked(self) -> int:
        return sum(self.acked.values()) + self.acked_gone

    def forget(self, group: str | None, topics: tuple[str, ...] = ()) -> None:
        """Drop the keys of ``group`` (its per-group ones too, when no ``topics``) and/or of
        ``topics`` (the rules of ``chronoq.pop.operators.forget``)."""
        def gone(key: tuple[str, str]) -> bool:
            return (group is None or key[0] == group) and (not topics or key[1] in topics)

        def drop(counts: dict) -> int:
            return sum(counts.pop(key) for key in [k for k in counts if gone(k)])

        self.received_gone += drop(self.received)
        self.acked_gone += drop(self.acked)
        drop(self.nacked)
        if group is not None and not topics:
            for counts in (self.revived, self.retried, self.dead_lettered):
                counts.pop(group, None)

    def revive_outcome(self, group: str, revived: int, retried: int, dead_lettered: int) -> None:
        """Count what one revive pass (or a client's forward to the DLQ) did for ``group``."""
        assert min(revived, retried, dead_lettered) >= 0
        for counts, n in ((self.revived, revived), (self.retried, retried), (self.dead_lettered, dead_lettered)):
            if n:
                counts[group] = counts.get(group, 0) + n
