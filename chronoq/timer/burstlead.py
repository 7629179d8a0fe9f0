"""How far ahead of its due time a timer copy is claimed and written (the *lead*). Pure: no clock,
no I/O; it is handed the wheel's counts of what falls due when and answers a number.

A timer copy is written ahead of its due time as a *held* record (hidden until due), so that the
fsync is behind it when it falls due (``timer_prewrite_ms``, 50 ms). A crowd of timers due at
about one instant (a campaign "at 09:00:00 for 300,000 users") cannot be written in 50 ms, nor in
a fixed second: each copy costs the broker ~9 us of CPU (``copies.delivered_copy`` ~4 us, the
write ~4 us) plus its share of the fsyncs and of the loop's other work. Measured on the 2-core
development machine beside another busy process (``bench/stalls.py --due-burst 300000 --due-in-s
30 --timers 0 --inflight 0``): with a fixed 1 s lead, 300,000 copies took ~3 s to write (~100,000
a second: the lane writes 2,000, waits for their fsync, writes the next 2,000), and 56,000-150,000
of them were visible more than 1 s late (eight runs of main; 94,000-118,000 in three with the tail
rule below); with this lead (7.75 s), none later than 5 ms (eight runs).

Method: claiming copies in due order at ``rate`` copies a second from time ``s`` writes the
first ``C(t)`` of them (those due by ``t``) by ``s + C(t) / rate``; each must be written by its
due time less ``margin``. So the latest start is ``min over t of (t - margin - C(t) / rate)``,
and the lead, measured from the earliest deadline ``first``, is

    lead = margin + need,   need = max over t >= first of (C(t) / rate - (t - first))

clamped to ``[lead_min_ms, lead_max_ms]``. ``t`` runs over the wheel's blocks of deadline
(``Counts``: 16 ms blocks for the first ``lead_min_ms``, 128 ms ones on to ``lead_max_ms``); a
block's entries are taken as due at its start (at ``first`` for the first block), so ``need`` is
never under-estimated, and over-estimated by less than a block. A crowd of ``n`` due at one
instant gets ``n / rate + margin``; the same crowd spread out needs less (what is due later has
its own time); steady traffic ahead of a crowd is counted in (it is written first: claims go in
due order).

Once claiming has started, each claim of ``k`` entries lowers ``need`` by ``k / rate``, so the
start of the next claim moves ``k / rate`` later: claims are paced at ``rate`` while on schedule
(2,000 copies every 50 ms at 40,000/s, ~18 ms of CPU each, the loop free between them), and run
back to back when behind (a slower machine, a busier loop): then the margin is what is left.

Why a constant rate, not one the broker measures: while on schedule claims are paced at the rate
assumed, so copies per second of wall time would measure the assumption, not the machine; and the
lead must be chosen before the crowd's first copy is written. ``COPY_RATE_PER_S`` is ~40% of
the ~100,000/s measured above, so a loop also busy with sends and receives, or a VM at half speed
(seen on the development machine, ``python_speed_mips`` 13-15 against 29-32), still finishes on
time; too low a rate only writes copies earlier than needed (see the price below).

When: a *burst* is at least ``due_min`` due within ``lead_min_ms`` of the earliest (20,000 a
second: four times the 5,000/s the lateness target is set at, so steady traffic keeps
``prewrite_ms``), or copies the short lead cannot write in time (``need`` over half of
``prewrite_ms``, where its claims start: more than 1,000 due within ~16 ms at 40,000/s; steady
traffic only past ~60,000/s). The second rule also keeps a crowd's *tail* in the burst: with the
first rule alone, once fewer than 20,000 were left to claim the lead fell back to 50 ms and claiming
stopped until 25 ms before the due time, so the last ~20,000 copies of a crowd were written after it:
of 100,000 due at one instant, 16,000 were visible more than 20 ms late; with this rule and the
fixed 1 s lead, none (three runs each). Below both, ``prewrite_ms``
(claims start half of it ahead). ``lead_max_ms`` equal to ``lead_min_ms`` is a fixed burst lead.

The price of a longer lead: a held copy hides everything behind it in its queue until it is due,
so a message sent to the same queue right behind a burst's held copy waits up to the lead. And a
timer whose copy is written answers a recall ``ALREADY_DELIVERED``: up to the lead before its due
time. ``lead_max_ms`` bounds both, and the store's restart, which looks back ``hold_window_ms``
(15 s) by entry time for held records still in the future, needs every copy written less than
that before its due time: ``check_hold_window``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from itertools import accumulate, chain
from operator import sub
from typing import NamedTuple

from chronoq.timer.wheel import COARSE_MS, COARSE_SHIFT, FINE_MS, FINE_SHIFT

# Timers due faster than this (per second) over ``lead_min_ms`` are a burst (see above).
BURST_DUE_PER_S = 20_000
# Copies the broker is assumed to claim and write per second of wall time (see above): 25 us a
# copy, ~2.7x the ~9 us of CPU one costs (~40% of the ~100,000/s measured), for the fsyncs, the
# loop's other work, a slower VM.
COPY_RATE_PER_S = 40_000
# Slack for what the rate does not cover: the first claim's tick running late, the last group's
# fsync (0.5-20 ms), the release tick.
MARGIN_MS = 250
# The store's restart looks back ``hold_window_ms`` (15 s) for held records still in the future;
# a lead must stay this far inside it, for a wall clock that moves between a write and a restart.
HOLD_WINDOW_SLACK_MS = 5_000


class Counts(NamedTuple):
    """What the wheel holds due from the earliest deadline ``first_due`` on (``Deliver._lead``):
    entries per ``FINE_MS`` block from ``first_due``'s block to the end of the ``COARSE_MS``
    block holding ``first_due + lead_min_ms`` (``fine``), then per ``COARSE_MS`` block from the
    next to ``first_due + lead_max_ms``'s (``coarse``; empty when that is not further)."""

    first_due: int
    fine: list[int]
    coarse: list[int]

    @staticmethod
    def spans(first_due: int, lead_min_ms: int, lead_max_ms: int) -> tuple[int, int, int]:
        """(end of the fine span, start and end of the coarse span), ms, for ``due_per_block``;
        the coarse span is empty (start > end) when the fine one reaches ``lead_max_ms``."""
        split = (((first_due + lead_min_ms) >> COARSE_SHIFT) + 1) << COARSE_SHIFT
        return split - 1, split, first_due + lead_max_ms


@dataclass(frozen=True)
class LeadPolicy:
    """The timer's leads. ``lead_min_ms`` 0: no burst lead (``prewrite_ms`` always)."""

    prewrite_ms: int
    lead_min_ms: int = 0
    lead_max_ms: int = 0
    due_min: int = 1  # a burst: at least this many due within lead_min_ms of the earliest
    rate_per_s: int = COPY_RATE_PER_S
    margin_ms: int = MARGIN_MS

    def __post_init__(self):
        assert self.prewrite_ms >= 0 and self.due_min >= 1 and self.rate_per_s > 0 and self.margin_ms >= 0
        assert self.lead_min_ms == 0 or self.lead_max_ms >= self.lead_min_ms > self.prewrite_ms > 0

    @classmethod
    def of(cls, prewrite_ms: int, lead_min_ms: int, lead_max_ms: int) -> "LeadPolicy":
        """From the configuration: the burst lead only with holds (``prewrite_ms`` > 0: a copy
        written early must stay hidden until due) and when longer than ``prewrite_ms``."""
        if not 0 < prewrite_ms < lead_min_ms:
            return cls(prewrite_ms)
        return cls(prewrite_ms, lead_min_ms, max(lead_min_ms, lead_max_ms),
                   max(1, BURST_DUE_PER_S * lead_min_ms // 1000))

    @property
    def bursts(self) -> bool:
        return self.lead_min_ms > 0

    @property
    def longest_ms(self) -> int:
        """The longest lead this policy ever answers: no copy is written earlier before its due."""
        return max(self.prewrite_ms, self.lead_max_ms)

    def lead(self, counts: Counts) -> tuple[int, int]:
        """(how far ahead of now copies are claimed, how close the earliest deadline must be to
        now for a claim to start), for a wheel holding ``counts``: ``(prewrite_ms, prewrite_ms
        // 2)``, or in a burst the same number twice, from ``lead_min_ms`` to ``lead_max_ms``.

        A burst: at least ``due_min`` due within ``lead_min_ms`` of the earliest; or copies that
        the short lead cannot write in time (``need_ms`` over half of ``prewrite_ms``, where its
        claims start: more than 1,000 due at about one instant at 40,000/s; also the tail of a
        crowd, whose claiming must not stop to wait for the short lead when fewer than
        ``due_min`` are left).

        Ensures: the lead is ``prewrite_ms`` or within [lead_min_ms, lead_max_ms]; it depends
        on ``counts`` alone (not on now), so the tick a deadline of ``first_due - ahead`` brings
        finds the same answer and claims.
        """
        short = self.prewrite_ms, self.prewrite_ms // 2
        if not self.bursts:
            return short
        first_due = counts.first_due
        in_min = ((first_due + self.lead_min_ms) >> FINE_SHIFT) - (first_due >> FINE_SHIFT) + 1
        need = need_ms(counts, self.rate_per_s)
        if sum(counts.fine[:in_min]) < self.due_min and need <= self.prewrite_ms // 2:
            return short
        lead = min(self.lead_max_ms, max(self.lead_min_ms, math.ceil(need + self.margin_ms)))
        assert self.lead_min_ms <= lead <= self.lead_max_ms
        return lead, lead


def need_ms(counts: Counts, rate_per_s: int) -> float:
    """``max over t of (C(t) / rate - (t - first_due))`` (ms) over the blocks of ``counts``,
    each block's entries taken as due at its start (the first block's at ``first_due``). 0 for
    no entries. (At C speed, ``accumulate`` and ``map``: it runs at every tick of steady traffic,
    ~134 blocks with the defaults; an empty block only lowers its term, so it needs no skipping.)"""
    first_due = counts.first_due
    fine0 = (first_due >> FINE_SHIFT) << FINE_SHIFT
    into = first_due - fine0  # (0..FINE_MS-1: the first block starts before first_due, taken as at it)
    fine_end = len(counts.fine) * FINE_MS - into  # the coarse span starts where the fine one ends
    since = chain((0,), range(FINE_MS - into, fine_end, FINE_MS),
                  range(fine_end, fine_end + len(counts.coarse) * COARSE_MS, COARSE_MS))  # t - first_due
    late = map(sub, map((1000 / rate_per_s).__mul__, accumulate(chain(counts.fine, counts.coarse))), since)
    return max(0.0, max(late, default=0.0))


def check_hold_window(longest_lead_ms: int, hold_window_ms: int) -> None:
    """Refuse a lead the store's restart could not find held copies for (see the module doc)."""
    if longest_lead_ms + HOLD_WINDOW_SLACK_MS > hold_window_ms:
        raise ValueError(f"a timer lead of {longest_lead_ms} ms needs a store hold window of at least "
                         f"{longest_lead_ms + HOLD_WINDOW_SLACK_MS} ms, not {hold_window_ms}")
