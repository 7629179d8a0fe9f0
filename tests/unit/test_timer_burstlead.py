"""The burst lead, pure (``chronoq.timer.burstlead``): the lead from counts of what falls due when.

Exact numbers, no clock: a crowd of n due at one instant gets n / rate + margin; a crowd spread
out, or steady traffic, needs less; steady traffic ahead of a crowd counts in; the lead stays
within [lead_min, lead_max] and the tail of a crowd keeps the burst lead; the hold window bounds
the longest lead. (The claim schedule this gives, tick by tick, is in test_timer_burst_schedule.py.)
"""

from __future__ import annotations

from collections import Counter

import pytest

from chronoq.core import errors
from chronoq.core.config import TIMER_BURST_LEAD_LIMIT_MS, BrokerConfig
from chronoq.store.store import StoreOptions
from chronoq.timer.burstlead import (COPY_RATE_PER_S, HOLD_WINDOW_SLACK_MS, MARGIN_MS, Counts, LeadPolicy,
                                     check_hold_window, need_ms)
from chronoq.timer.wheel import COARSE_MS, TimingWheel

PREWRITE, MIN, MAX = 50, 1_000, 10_000
POLICY = LeadPolicy.of(PREWRITE, MIN, MAX)
FIRST = 1_700_000_000_000 + 5  # (not on a block boundary)


def _spread(first: int, n: int, per_ms: float) -> Counter:
    """``n`` timers from ``first``, ``per_ms`` a millisecond."""
    return Counter(first + int(i / per_ms) for i in range(n))


def _counts(dues: dict[int, int], policy: LeadPolicy = POLICY) -> Counts:
    """Counts as ``Deliver._lead`` takes them from a wheel holding ``n`` due at each ``due: n``."""
    w = TimingWheel()
    k = 0
    for due, n in dues.items():
        for _ in range(n):
            w.add(k, due)
            k += 1
    first = w.next_deadline()
    fine_end, coarse_start, coarse_end = Counts.spans(first, policy.lead_min_ms, policy.lead_max_ms)
    return Counts(first, w.due_per_block(first, fine_end), w.due_per_block(coarse_start, coarse_end, coarse=True))


def test_the_policy_from_the_configuration():
    assert (POLICY.lead_min_ms, POLICY.lead_max_ms, POLICY.due_min) == (MIN, MAX, 20_000)
    assert POLICY.bursts and POLICY.longest_ms == MAX
    for prewrite, lead_min in [(0, MIN), (PREWRITE, 0), (PREWRITE, PREWRITE)]:  # no holds, off, not longer
        p = LeadPolicy.of(prewrite, lead_min, MAX)
        assert not p.bursts and p.longest_ms == prewrite
        assert p.lead(_counts({FIRST: 100_000}, POLICY)) == (prewrite, prewrite // 2)
    assert LeadPolicy.of(PREWRITE, MIN, MIN).lead_max_ms == MIN  # a fixed lead


def test_a_crowd_at_one_instant_gets_its_copies_time_plus_the_margin():
    for n, lead in [(100_000, 2_500 + MARGIN_MS), (300_000, 7_500 + MARGIN_MS), (60_000, 1_500 + MARGIN_MS)]:
        assert n * 1000 // COPY_RATE_PER_S + MARGIN_MS == lead
        assert POLICY.lead(_counts({FIRST: n})) == (lead, lead)
    assert POLICY.lead(_counts({FIRST: 1_000_000})) == (MAX, MAX)  # 25 s wanted: the most allowed
    assert POLICY.lead(_counts({FIRST: 20_000})) == (MIN, MIN)  # 0.75 s wanted: the least of a burst


def test_a_fixed_lead_when_the_longest_is_the_shortest():
    fixed = LeadPolicy.of(PREWRITE, MIN, MIN)
    assert fixed.lead(_counts({FIRST: 300_000}, fixed)) == (MIN, MIN)
    assert fixed.lead(_counts({FIRST: 500}, fixed)) == (PREWRITE, PREWRITE // 2)


def test_below_both_rules_the_short_lead():
    """Steady traffic under 20,000/s keeps the short lead, as does a small crowd the short lead's
    claims (half of it ahead) can write: 1,000 copies in 25 ms at 40,000/s."""
    steady = _spread(FIRST, 19_000 * 10, 19)  # 19,000/s for 10 s
    assert POLICY.lead(_counts(steady)) == (PREWRITE, PREWRITE // 2)
    assert POLICY.lead(_counts({FIRST: 1_000})) == (PREWRITE, PREWRITE // 2)
    assert POLICY.lead(_counts({FIRST: 1_001})) == (MIN, MIN)  # 25.025 ms of copies: does not fit


def test_twenty_thousand_a_second_over_the_shortest_burst_lead_is_a_burst():
    spread = _spread(FIRST, 20_000, 20)  # 20 a ms for 1 s: 20,000/s
    assert need_ms(_counts(spread), COPY_RATE_PER_S) <= PREWRITE // 2
    assert POLICY.lead(_counts(spread)) == (MIN, MIN)
    spread[max(spread)] -= 1
    assert POLICY.lead(_counts(spread)) == (PREWRITE, PREWRITE // 2)


def test_the_tail_of_a_crowd_keeps_the_burst_lead():
    """Fewer than 20,000 left of a crowd still need more than the short lead (the first rule alone
    let the lead fall back to 50 ms, and claiming waited until 25 ms before the due time)."""
    assert POLICY.lead(_counts({FIRST: 19_999})) == (MIN, MIN)
    assert POLICY.lead(_counts({FIRST: 5_000})) == (MIN, MIN)


def test_a_crowd_spread_out_needs_less_than_at_one_instant():
    at_once = need_ms(_counts({FIRST: 200_000}), COPY_RATE_PER_S)
    over_2s = need_ms(_counts(_spread(FIRST, 200_000, 100)), COPY_RATE_PER_S)  # 100 a ms
    assert at_once == 5_000.0
    # The last copies are due 2 s later (in a coarse block: taken as due at its start, never later).
    assert 5_000 - 2_000 <= over_2s < 5_000 - 2_000 + COARSE_MS
    slower = _spread(FIRST, 300_000, 30)  # 30,000/s for 10 s: below the rate
    assert need_ms(_counts(slower), COPY_RATE_PER_S) <= 30_000 * COARSE_MS / COPY_RATE_PER_S + 1


def test_steady_traffic_ahead_of_a_crowd_counts_in_and_the_crowd_is_seen_from_afar():
    """5,000/s for 4 s, then 200,000 at one instant: claims must start so that the steady copies
    and the crowd's are written by its time: (20,000 + 200,000) / 40,000/s = 5.5 s of copies, less
    the 4 s before it, from the earliest deadline; the crowd is counted from 4 s away (in the
    coarse blocks), not once it is the earliest."""
    dues = _spread(FIRST, 20_000, 5)
    dues[FIRST + 4_000] += 200_000
    counts = _counts(dues)
    need = need_ms(counts, COPY_RATE_PER_S)
    assert 5_500 - 4_000 <= need <= 5_500 - 4_000 + COARSE_MS  # (a coarse block's start: never less)
    lead = POLICY.lead(counts)[0]
    assert lead == int(-(-(need + MARGIN_MS) // 1))
    beyond = _spread(FIRST, 20_000, 5)
    beyond[FIRST + MAX + COARSE_MS] += 200_000  # past the longest lead: not looked at yet
    assert POLICY.lead(_counts(beyond)) == (PREWRITE, PREWRITE // 2)


def test_the_lead_depends_on_the_counts_alone():
    c = _counts({FIRST: 100_000})
    assert POLICY.lead(c) == POLICY.lead(Counts(c.first_due, list(c.fine), list(c.coarse)))


def test_claiming_lowers_the_lead_by_what_it_took():
    """Each claim of k copies moves the next claim's start k / rate later (pacing)."""
    leads = []
    for left in range(100_000, 0, -2_000):
        leads.append(POLICY.lead(_counts({FIRST: left}))[0])
    assert leads[:36] == [left * 1000 // COPY_RATE_PER_S + MARGIN_MS for left in range(100_000, 28_000, -2_000)]
    assert all(b - a == -50 for a, b in zip(leads[:36], leads[1:36]))
    assert set(leads[36:]) == {MIN}  # down to the last 2,000: still a burst, the least lead


def test_the_hold_window_bounds_the_longest_lead():
    """A restart finds held copies by looking back StoreOptions.hold_window_ms (15 s) by entry time:
    the configurable longest lead stays HOLD_WINDOW_SLACK_MS inside it."""
    assert TIMER_BURST_LEAD_LIMIT_MS + HOLD_WINDOW_SLACK_MS <= StoreOptions().hold_window_ms
    check_hold_window(TIMER_BURST_LEAD_LIMIT_MS, StoreOptions().hold_window_ms)
    with pytest.raises(ValueError, match="hold window"):
        check_hold_window(TIMER_BURST_LEAD_LIMIT_MS + 1, StoreOptions().hold_window_ms)


@pytest.mark.parametrize("lead_min, lead_max", [(1_000, 999), (1_000, TIMER_BURST_LEAD_LIMIT_MS + 1), (0, -1)])
def test_the_longest_burst_lead_is_checked(lead_min, lead_max):
    with pytest.raises(errors.ClientError, match="timer_burst_lead_max_ms"):
        BrokerConfig(timer_burst_lead_ms=lead_min, timer_burst_lead_max_ms=lead_max).validate()


def test_the_longest_burst_lead_defaults_to_the_limit():
    cfg = BrokerConfig()
    cfg.validate()
    assert (cfg.timer_burst_lead_ms, cfg.timer_burst_lead_max_ms) == (1_000, TIMER_BURST_LEAD_LIMIT_MS)
