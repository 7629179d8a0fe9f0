"""Plain sends to a topic go round its queues in turn, across batches of any size
(``Sender._queues``: a slice of a kept cycle of queue numbers, ``_CYCLES``, bounded)."""

from __future__ import annotations

from chronoq.broker import sending
from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.config import BrokerConfig


def test_plain_sends_take_the_queues_in_turn_across_batches_of_any_size(tmp_path):
    broker = Broker(BrokerConfig(data_dir=str(tmp_path)).validate())
    try:
        for queues in (1, 3, 7):
            topic = f"rr{queues}"
            broker.create_topic(topic, queues)
            got = []
            for n in (1, 2, 5, 1, 31, 32, 100, 1, sending._CYCLE_KEEP + 5, 3, 2 * sending._CYCLE_KEEP):
                got += [r.queue_id for r in broker.send_batch([OutgoingMessage(topic, b"x")] * n)]
            assert got == [i % queues for i in range(len(got))]
        assert all(len(c) <= 2 * sending._CYCLE_KEEP for c in sending._CYCLES.values())  # (kept bounded)
    finally:
        broker.close()
