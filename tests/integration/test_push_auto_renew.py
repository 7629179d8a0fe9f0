"""Auto-renew for push receives with the official Python PushConsumer (rocketmq-python-client).

The PushConsumer receives with ``auto_renew=true`` and no invisible duration (contract §1.3).
The broker runs with a 2 s push slice (``push_invisible_ms``) and the listener works 6 s on one
message: with auto-renew the message is delivered once and its ack (with the handle received)
succeeds; with renewal off (``auto_renew_max_ms = 0``, the control) the same listener sees it
again after the slice, which is what shows the setup can fail. Together the two cases also show
the request's shape: the 2 s slice applies only without an invisible duration, the renewal only
with ``auto_renew``.
"""

from __future__ import annotations

import time

import pytest

from .conftest import wait_until
from .test_official_python_client import (Recorder, make_message, producer, push_consumer, simple_consumer,
                                          unique)

SLICE_MS = 2_000
WORK_S = 6.0  # three slices


@pytest.mark.parametrize("renew", [True, False], ids=["auto-renew", "control-no-renew"])
def test_slow_push_listener_gets_no_redelivery_while_it_works(chronoq_process, renew):
    server = chronoq_process(f"push_invisible_ms = {SLICE_MS}\nauto_renew_max_ms = {60_000 if renew else 0}\n")
    topic, group = unique("renew"), unique("rgrp")
    slow = Recorder(delay_s=WORK_S)
    with push_consumer(server.endpoint, group, topic, slow, threads=2):
        with producer(server.endpoint, topic) as p:
            p.send(make_message(topic, b"slow"))
        wait_until(lambda: slow.bodies(), 20, what="the first delivery")
        first_at = slow.deliveries[0][0]
        # Until the listener is done, plus two slices: a redelivery would have come by then.
        wait_until(lambda: time.monotonic() > first_at + WORK_S + 2 * SLICE_MS / 1000 or len(slow.bodies()) > 1,
                   WORK_S + 10, what="the listener to finish")
        if not renew:
            assert len(slow.bodies()) >= 2, "without renewal the message must come back after the slice"
            assert slow.deliveries[1][3] == 2 and slow.deliveries[1][0] - first_at < WORK_S
            return
        assert slow.bodies() == [b"slow"], f"redelivered while the listener worked: {slow.deliveries}"
        assert slow.deliveries[0][3] == 1
    # The consumer has shut down (NotifyClientTermination): had its ack failed, the message would
    # now come back within a slice and the first retry back-off (1 s).
    with simple_consumer(server.endpoint, group, topic, await_s=2) as c:
        deadline = time.monotonic() + (SLICE_MS / 1000 + 3)
        while time.monotonic() < deadline:
            assert c.receive(32, 10) == [], "the acked message came back"
