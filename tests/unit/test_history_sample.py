"""A traffic-history sample (chronoq.server.history.take_sample) on a real broker and POP service:
the lag is summed over every consumed (group, topic) in slices, the loop let go between (with
10,000 of each it held the loop ~260 ms a sample); a topic deleted during a pause counts no more."""

from __future__ import annotations

import asyncio

import pytest
from popkit import opened_node, send

from chronoq.features import operations
from chronoq.server.history import take_sample


@pytest.fixture
def node(tmp_path):
    yield from opened_node(tmp_path)


def _consumed(node, topics=("ta", "tb", "tc"), groups=("g1", "g2")):
    for topic in topics:
        send(node, 5, topic=topic)
        for group in groups:
            got = node.pop.receive(group, topic, max_messages=2, invisible_ms=30_000)
            for p in got:  # 2 received and acked: lag 3 each
                node.pop.ack(group, topic, p.receipt_handle)
    pairs = [(g, t) for g, ts in node.pop.consumed_topics().items() for t in ts]
    assert len(pairs) == len(topics) * len(groups)
    return pairs


def test_the_lag_is_summed_in_slices_with_the_loop_let_go_between(node):
    pairs = _consumed(node)
    ticks = iter(range(10_000))
    slept = []

    async def run():
        real_sleep = asyncio.sleep

        async def counted(s):
            slept.append(s)
            await real_sleep(0)
        asyncio.sleep, saved = counted, asyncio.sleep
        try:  # a clock that moves a whole second a look: every pair starts a new slice
            return await take_sample(node.broker, node.pop, 1_000, slice_s=0.5, pause_s=0.25,
                                     clock=lambda: float(next(ticks)))
        finally:
            asyncio.sleep = saved

    sample = asyncio.run(run())
    assert sample.lag == sum(node.pop.lag(g, t) for g, t in pairs) == 3 * len(pairs)
    assert slept == [0.25] * len(pairs)
    assert (sample.received, sample.acked) == (2 * len(pairs), 2 * len(pairs))


def test_a_topic_deleted_during_a_pause_counts_no_more(node):
    _consumed(node)
    calls = []

    def clock() -> float:
        calls.append(1)
        if len(calls) == 2:  # the first pause: delete a topic meanwhile
            operations.delete_topic(node.broker, node.pop, "tc", force=True)
        return float(len(calls))

    sample = asyncio.run(take_sample(node.broker, node.pop, 1_000, slice_s=0.5, pause_s=0, clock=clock))
    assert sample is not None and sample.lag == 3 * 4  # ta and tb, two groups each


def test_no_sample_until_the_timer_has_counted_its_buckets_once(node):
    """After a start the timer counts the buckets on disk a few at a time; until that is done a
    sample would read every schedule file at once (millions pending: seconds on the loop), so
    there is none, and each try counts a few more."""
    now = node.clock.wall_ms()
    for minute in range(1, 41):  # 40 one-minute buckets on disk
        node.broker.send("ta", b"later", deliver_at_ms=now + minute * 60_000)
    node.restart(clean=True)
    timer = node.broker.timer
    assert not timer._horizon_warm
    ticks = [0]

    def slow_ns() -> int:  # every look at the clock takes 3 ms: one bucket per 2 ms budget
        ticks[0] += 3_000_000
        return ticks[0]
    timer.clock.monotonic_ns = slow_ns
    samples = [asyncio.run(take_sample(node.broker, node.pop, 1_000)) for _ in range(60)]
    first = next(i for i, s in enumerate(samples) if s is not None)
    assert 10 <= first < 60 and all(s is None for s in samples[:first])
    assert samples[first].timers == 40 and timer._horizon_warm
