"""The forged message group of issue 20 §4, on every embedded entry point.

``message_group="g\\x02evil\\x01yes"`` used to be stored as is and read back as group ``g`` plus a
user property ``evil=yes``. Each entry point must refuse it by name (``InvalidMessageGroup``,
naming the message or row) and store nothing: ``send_batch``, ``send``, a delayed send, Stage.
A transaction half cannot carry a group at all; there the lone surrogate, which used to escape
as a ``UnicodeEncodeError``, stands in. (gRPC: tests/integration/test_validate_entry_points.py.)
"""

from __future__ import annotations

import pytest

from chronoq.core import errors
from chronoq.broker.broker import Broker, OutgoingMessage
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.features.staging import Rows, Staging
from chronoq.features.transactions import Transactions

FORGED_GROUP = "g\x02evil\x01yes"


@pytest.fixture
def broker(tmp_path):
    b = Broker(BrokerConfig(data_dir=str(tmp_path)), clock=FakeClock())
    yield b
    b.close()


def _log_end(broker) -> int:
    return broker.store.log.written


def test_send_batch_refuses_the_forged_group(broker):
    end = _log_end(broker)
    with pytest.raises(errors.InvalidMessageGroup, match="message 1 of the batch"):
        broker.send_batch([OutgoingMessage("t", b"ok"), OutgoingMessage("t", b"x", message_group=FORGED_GROUP)])
    assert _log_end(broker) == end and "t" not in broker.topics  # nothing stored, no topic created


def test_send_refuses_the_forged_group(broker):
    broker.create_topic("t")
    end = _log_end(broker)
    with pytest.raises(errors.InvalidMessageGroup, match="id 'm-1'"):
        broker.send("t", b"x", message_group=FORGED_GROUP, message_id="m-1")
    assert _log_end(broker) == end


def test_a_delayed_send_refuses_the_forged_group(broker):
    broker.create_topic("t")
    end = _log_end(broker)
    with pytest.raises(errors.InvalidMessageGroup):
        broker.send("t", b"x", message_group=FORGED_GROUP, deliver_at_ms=broker.clock.wall_ms() + 60_000)
    assert _log_end(broker) == end


def test_stage_refuses_the_forged_group(broker):
    staging = Staging(broker)
    end = _log_end(broker)
    rows = Rows([b"a", b"b"], groups=["g", FORGED_GROUP])
    with pytest.raises(errors.InvalidMessageGroup, match="row 1"):
        staging.stage("sink", 0, "s0", 0, "t", rows)
    assert _log_end(broker) == end and staging.batches == {}


def test_a_transaction_half_refuses_lone_surrogates_by_name(broker):
    txns = Transactions(broker)
    end = _log_end(broker)
    with pytest.raises(errors.InvalidProperty):
        txns.half_message(OutgoingMessage("t", b"x", properties={"k": "\ud800"}))
    half = txns.half_message(OutgoingMessage("t", b"x", tag="\ud800"))  # the tag is the broker's to check
    with pytest.raises(errors.InvalidTag):
        broker.send_batch([half], system=True)
    assert _log_end(broker) == end and txns.pending == {}
