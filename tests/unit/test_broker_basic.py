from chronoq.broker.broker import Broker
from chronoq.core.config import BrokerConfig


def test_send_read_roundtrip(tmp_path):
    with Broker(BrokerConfig(data_dir=str(tmp_path))) as b:
        r = b.send("orders", b"hello", tag="t", keys=["k1"], properties={"a": "b"})
        got = b.read("orders", r.queue_id, 0, 10)
        assert [m.body for m in got.messages] == [b"hello"]
        assert got.messages[0].message_id == r.message_id
