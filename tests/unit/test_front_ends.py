"""A broker whose gRPC front end cannot be imported refuses to start instead of serving nothing."""

import sys

import pytest

from chronoq.server import front_ends


def test_a_missing_grpc_front_end_stops_the_start(monkeypatch):
    monkeypatch.setitem(sys.modules, "chronoq.server.grpc_server", None)  # import raises ImportError
    with pytest.raises(ImportError):
        front_ends.build(runtime=object())
