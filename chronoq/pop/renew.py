"""Auto-renew for push receives: which checkpoints stay invisible past their deadline, and until when.

Pure core: no I/O and no clock; every call takes ``now_ms``. ``service.py`` asks it at each
revive, ``inflight.py`` keeps the per-CK fields (``renew_until_ms``, ``client_id``).

RocketMQ 5 push consumers receive with ``auto_renew=true`` and (usually) no invisible duration,
and expect the server to keep what they received invisible while their listener works, however
long that takes (the proxy renews each handle about 10 s before expiry, up to 3 h in total).
chronoq does the same with one difference: the invisible deadline is extended *in place*, on the
same CK, so the receipt handle the client holds stays valid and no handle mapping is needed.

The rule, applied when a CK's invisible time ends (``PopService.tick`` finds it due):

- a CK received with auto-renew carries ``renew_until_ms = pop time + max_ms`` and the client id
  (``until``); a receive without a client id (no ``x-mq-client-id`` header) gets no auto-renew,
  since nothing could tell when that client is gone;
- it is extended to ``min(now + slice_ms, renew_until_ms)`` instead of revived (``extend``) while
  ``now < renew_until_ms`` and its client is *alive*: seen (a heartbeat, a receive) within
  ``client_silence_ms`` and not terminated (``gone``);
- otherwise it is revived as usual (retry topic, back-off, DLQ).

Renewal stops on ack (the entry is settled; a fully settled CK is gone), on nack
(change-invisible-time moves the entry to a successor CK that does not renew: the client chose its
time) and when the client terminates or falls silent (its CKs revive at their current deadline,
at most ``slice_ms`` later). Renewals live in memory: after a restart a CK recovered from the POP
log revives at the deadline it was logged with (at-least-once holds; the consumer may see the
message again).
"""

from __future__ import annotations

# Official clients heartbeat every 10 s (Python, Node); three missed beats and a bit mean "gone".
CLIENT_SILENCE_MS = 35_000
SLICE_MS_MIN = 1_000           # the receive minimum (names.RECEIVE_INVISIBLE_MS_MIN)
MAX_MS_LIMIT = 24 * 3600 * 1000
CLIENTS_MAX = 100_000          # remembered client ids; the oldest are forgotten past this


class Renewals:
    """Client liveness and the renew decision."""

    def __init__(self, slice_ms: int, max_ms: int, client_silence_ms: int = CLIENT_SILENCE_MS):
        assert slice_ms >= SLICE_MS_MIN and 0 <= max_ms <= MAX_MS_LIMIT and client_silence_ms > 0
        self.slice_ms = slice_ms
        self.max_ms = max_ms
        self.client_silence_ms = client_silence_ms
        self._seen: dict[str, int] = {}  # client id -> last seen (insertion order ~ age)

    def seen(self, client_id: str, now_ms: int) -> None:
        """The client showed it is alive (heartbeat, receive)."""
        if not client_id:
            return
        seen = self._seen
        seen.pop(client_id, None)  # re-insert: the dict stays ordered by last sight
        seen[client_id] = now_ms
        if len(seen) > CLIENTS_MAX:
            del seen[next(iter(seen))]

    def gone(self, client_id: str) -> None:
        """The client terminated: its CKs are no longer renewed (a later sight revives it)."""
        self._seen.pop(client_id, None)

    def alive(self, client_id: str, now_ms: int) -> bool:
        last = self._seen.get(client_id)
        return last is not None and now_ms - last <= self.client_silence_ms

    def until(self, client_id: str, now_ms: int) -> int:
        """``renew_until_ms`` for a CK received now with auto-renew (0: no auto-renew)."""
        if not client_id or not self.max_ms:
            return 0
        self.seen(client_id, now_ms)
        return now_ms + self.max_ms

    def extend(self, client_id: str, renew_until_ms: int, now_ms: int) -> int | None:
        """The new deadline of a due CK that auto-renews, or None: revive it.

        Ensures: a returned deadline is > now_ms and <= renew_until_ms.
        """
        if renew_until_ms <= now_ms or not self.alive(client_id, now_ms):
            return None
        deadline = min(now_ms + self.slice_ms, renew_until_ms)
        assert now_ms < deadline <= renew_until_ms
        return deadline

    def prune(self, now_ms: int) -> None:
        """Forget clients silent for longer than the window (bounded memory)."""
        seen = self._seen
        stale = [c for c, t in seen.items() if now_ms - t > self.client_silence_ms]
        for c in stale:
            del seen[c]
