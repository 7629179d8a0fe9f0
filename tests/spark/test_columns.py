"""Arrow <-> protobuf columns of the Spark data source, without a SparkSession."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from chronoq.proto import chronoq_admin_pb2 as apb
from chronoq.server.pipeline import rows_from_columns
from chronoq.spark import rpc
from chronoq.core import errors


def test_write_columns_round_trip_with_nulls_slices_maps_and_microseconds():
    props = pa.array([[("a", "1")], None, [("b", "2"), ("c", "")], []], pa.map_(pa.string(), pa.string()))
    batch = pa.RecordBatch.from_arrays([
        pa.array([b"x", b"yy", b"zzz", b"w"]),
        pa.array(["k1", None, "k3", None]),
        pa.array(["t", None, "", "t4"]),
        props,
        pa.array([None, "g", None, None]),
        # 1 µs after a millisecond: rounded up, never early
        pa.array([1_800_000_000_000_001, None, 1_800_000_000_000_000, 0], pa.timestamp("us", tz="UTC")),
    ], names=["body", "key", "tag", "properties", "message_group", "deliver_at"])
    for piece, first in ((batch, 0), (batch.slice(1, 3), 1)):
        rows = rows_from_columns(apb.RowColumns.FromString(rpc.batch_to_rows(piece).SerializeToString()))
        expect_bodies = [b"x", b"yy", b"zzz", b"w"][first:]
        assert rows.bodies == expect_bodies
        assert rows.keys == [["k1"], [], ["k3"], []][first:]
        assert rows.tags == ["t", "", "", "t4"][first:]
        assert rows.properties == [{"a": "1"}, {}, {"b": "2", "c": ""}, {}][first:]
        assert rows.groups == ["", "g", "", ""][first:]
        assert rows.deliver_at_ms == [1_800_000_000_001, 0, 1_800_000_000_000, 0][first:]


def test_split_batch_bounds_rows_and_bytes():
    batch = pa.RecordBatch.from_arrays([pa.array([b"x" * 100] * 50)], names=["body"])
    pieces = rpc.split_batch(batch, 20, 1000)
    assert [p.num_rows for p in pieces] == [10, 10, 10, 10, 10]
    assert sum(p.num_rows for p in rpc.split_batch(batch, 7, 1 << 20)) == 50


def test_bad_column_shapes_are_client_errors():
    rows = apb.RowColumns(count=2, bodies=b"abc", body_lengths=[1, 1])
    with pytest.raises(errors.ClientError, match="lengths add up"):
        rows_from_columns(rows)
    with pytest.raises(errors.ClientError, match="need a body"):
        rows_from_columns(apb.RowColumns(count=1))
    with pytest.raises(errors.ClientError):
        rows_from_columns(apb.RowColumns(count=1, bodies=b"a", body_lengths=[1], deliver_at_ms=[1, 2]))
    with pytest.raises(errors.ClientError):
        rows_from_columns(apb.RowColumns(count=1, bodies=b"a", body_lengths=[1], key_counts=[2], keys=b"k",
                                         key_lengths=[1]))


def test_message_columns_to_arrow():
    cols = apb.MessageColumns(
        count=2, offsets=[7, 8], message_ids=b"AB", message_id_lengths=[1, 1], tags=b"t", tag_lengths=[1, 0],
        key_counts=[0, 2], keys=b"k1k2", key_lengths=[2, 2], property_counts=[1, 0], property_keys=b"p",
        property_key_lengths=[1], property_values=b"v", property_value_lengths=[1], bodies=b"xyz",
        body_lengths=[1, 2], born_ms=[1, 2], stored_ms=[0, 3], deliver_at_ms=[0, 4], visible_ms=[5, 6])
    b = rpc.columns_to_arrow("t", 3, cols)
    assert b.schema == rpc.READ_ARROW_SCHEMA
    d = b.to_pydict()
    assert d["topic"] == ["t", "t"] and d["queue"] == [3, 3] and d["offset"] == [7, 8]
    assert d["message_id"] == ["A", "B"] and d["tag"] == ["t", None] and d["keys"] == [[], ["k1", "k2"]]
    assert d["properties"] == [[("p", "v")], []] and d["body"] == [b"x", b"yz"]
    assert d["message_group"] == [None, None]
    assert d["stored"][0] is None and d["deliver_at"][0] is None
    assert np.asarray(b.column("visible").cast(pa.int64())).tolist() == [5000, 6000]
