"""The answer budget: receive answers the peer has not taken yet, bounded in bytes and in time.

A receive takes messages out of the POP service and encodes them; its answer then waits until
the peer's HTTP/2 flow-control windows (and the socket) admit it. A client that announces a
window of 0 and keeps asking would make the broker hold every answer it asked for: gigabytes,
from one connection (issue 20 §2). The transports cannot bound this alone (a unary answer leaves
the handler before it is written, and grpcio holds it out of our sight), so the bound sits in the
handlers, above either transport (docs/security.md, "Answer budget"):

- ``AnswerBudget.allowance`` is asked before a receive takes messages: how many messages fit
  in the room left to its connection (``context.peer()``, one per connection in both
  ``grpc_server`` modes) and to the broker, at the topic's recent encoded size per message.
  None fits: the receive is refused at once, nothing taken, nothing encoded. Taking only what
  is likely to fit matters: a message taken and released counts a delivery attempt (as a nack
  does) and comes back after the group's retry back-off.
- ``AnswerBudget.fit`` then sizes the encoded answer exactly: the messages that fit are reserved,
  the rest are released at once for other consumers (a smaller batch, not a refusal); when none
  fits, the receive is refused. A connection holding nothing may always take one message, so a
  message larger than the budget can still be delivered. An answer that did not fit also marks
  its connection (or the broker) full: ``allowance`` is 0 until one of its answers is taken, so
  receives are refused before they take anything instead of taking and releasing over and over.
- The reservation is returned when the transport has taken the answer (the handler's ``yield``
  resumes: chronoq's server once the peer's windows admitted the bytes, grpcio once its core
  sent them) or when the call ends.
- ``AnswerBudget.expire`` finds reservations older than the send timeout: the caller releases
  their messages at once (other consumers get them, no invisible-time wait) and ends the call
  (``end_call``). chronoq's server resets the stream, which drops its bytes: the reservation is
  returned. grpcio offers no way to drop a message its core holds (cancelling the handler ends
  the handler, not the stream, seen with a peer announcing a window of 0), so there the
  reservation stays until grpcio's write returns or fails (the peer reads or the connection
  closes): the budget stays honest, and that connection stays refused meanwhile.

``AnswerBudget`` is pure bookkeeping (a dict update per call, never per message) with an
injected clock; ``end_call`` is the one place that knows how each transport ends a call.
"""

from __future__ import annotations

from typing import Callable

from chronoq.server import h2calls

SIZES_MAX = 10_000  # topics whose size per message is remembered


class Held:
    """One answer's reservation: its bytes, since when, and what to undo if it expires."""

    __slots__ = ("peer", "nbytes", "since_ns", "group", "topic", "popped", "context", "abandoned")

    def __init__(self, peer: str, nbytes: int, since_ns: int, group: str, topic: str, popped, context) -> None:
        self.peer = peer
        self.nbytes = nbytes
        self.since_ns = since_ns
        self.group = group
        self.topic = topic
        self.popped = popped        # the answer's messages (released if it expires)
        self.context = context
        self.abandoned = False      # expired: its messages were released and its call ended


class AnswerBudget:
    """Bytes of answers waiting on their peers, per connection and in all, and their age."""

    def __init__(self, per_connection: int, total: int, timeout_ns: int,
                 monotonic_ns: Callable[[], int]) -> None:
        assert 0 < per_connection <= total and timeout_ns > 0
        self.per_connection = per_connection
        self.total = total
        self.timeout_ns = timeout_ns
        self._now = monotonic_ns
        self.held = 0                          # bytes reserved, all connections
        self.by_peer: dict[str, int] = {}      # peer -> bytes reserved (no entry: none)
        self._open: dict[int, Held] = {}       # id -> reservation, oldest first (insertion order)
        self._stuck: dict[int, Held] = {}      # expired, still held (grpcio: until its write ends)
        self._full: set[str] = set()           # peers an answer did not fit, until one is taken
        self._all_full = False                 # the same for the broker-wide budget
        self._per_message: dict[str, int] = {}  # topic -> recent encoded bytes per message
        self.refused = 0                       # receives refused: no room at all
        self.trimmed = 0                       # answers cut to fit (messages released at once)
        self.expired = 0                       # answers ended by the send timeout

    def allowance(self, peer: str, topic: str, batch: int) -> int:
        """How many messages (at most ``batch``) ``peer`` may take from ``topic`` now: those
        likely to fit at the topic's recent size per message; 0: refuse without taking any."""
        if self._all_full or peer in self._full:
            return 0
        peer_held = self.by_peer.get(peer, 0)
        room = min(self.per_connection - peer_held, self.total - self.held)
        if room <= 0:
            return 0
        each = self._per_message.get(topic)
        if not each:  # nothing answered from this topic yet: fit() cuts the answer if need be
            return batch
        n = room // each
        if n == 0:  # an idle connection may always take one message, however big
            return 1 if peer_held == 0 else 0
        return n if n < batch else batch

    def fit(self, peer: str, sizes: list[int]) -> int:
        """How many of the answer's messages (of these encoded sizes, in order) can be reserved;
        fewer than all marks the connection, or the broker, full (``room``)."""
        peer_held = self.by_peer.get(peer, 0)
        peer_room, all_room = self.per_connection - peer_held, self.total - self.held
        n, used = 0, 0
        for size in sizes:
            if used + size > peer_room or used + size > all_room:
                break
            used += size
            n += 1
        if n == 0 and sizes and peer_held == 0 and (self.held == 0 or sizes[0] <= all_room):
            n, used = 1, sizes[0]  # one message per idle connection, however big: it must be deliverable
        if n < len(sizes):  # (a peer marked full holds an answer: its release unmarks it)
            if used + sizes[n] > all_room:
                self._all_full = True
            else:
                self._full.add(peer)
        return n

    def reserve(self, peer: str, nbytes: int, group: str = "", topic: str = "", popped=(),
                context=None) -> Held:
        """Count ``nbytes`` as held for ``peer`` (sized beforehand with ``fit``); the answer's
        size per message is what ``allowance`` expects of the topic's next answers."""
        held = Held(peer, nbytes, self._now(), group, topic, popped, context)
        if popped:
            sizes = self._per_message
            if len(sizes) >= SIZES_MAX and topic not in sizes:
                sizes.clear()  # (topics answered from are few; this only bounds the table)
            sizes[topic] = -(-nbytes // len(popped))
        self.held += nbytes
        self.by_peer[peer] = self.by_peer.get(peer, 0) + nbytes
        self._open[id(held)] = held
        return held

    def release(self, held: Held | None) -> None:
        """Return a reservation; a second release (or one already expired) does nothing."""
        if held is None or (self._open.pop(id(held), None) is None and self._stuck.pop(id(held), None) is None):
            return
        self._all_full = False  # room again: the next receive may try
        if self._full:
            self._full.discard(held.peer)
        self.held -= held.nbytes
        left = self.by_peer[held.peer] - held.nbytes
        if left:
            self.by_peer[held.peer] = left
        else:
            del self.by_peer[held.peer]  # an idle connection leaves no entry behind

    def expire(self) -> list[Held]:
        """Reservations older than the send timeout, oldest first, marked abandoned (each is
        returned once); the caller releases their messages, ends their calls and returns the
        reservations whose bytes the transport dropped."""
        if not self._open:
            return []
        limit = self._now() - self.timeout_ns
        out = []
        for held in self._open.values():  # oldest first: stop at the first young one
            if held.since_ns > limit:
                break
            out.append(held)
        for held in out:
            self._stuck[id(held)] = self._open.pop(id(held))
            held.abandoned = True
        self.expired += len(out)
        return out

    def __len__(self) -> int:
        """Answers waiting (not yet expired)."""
        return len(self._open)


def end_call(held: Held) -> bool:
    """End an expired answer's call so that its transport drops the bytes it still holds; True
    if it did (the reservation may be returned now).

    chronoq's server: ``Context.reset`` (RST_STREAM CANCEL) drops the stream's unsent frames at
    once and cancels its handler. grpcio: nothing drops the message its core holds (module
    docstring): False."""
    context = held.context
    if not isinstance(context, h2calls.Context):
        return False
    context.reset()
    return True
