"""The HTTP/2 limits' bookkeeping (chronoq.server.h2limits), with a hand-turned clock."""

from chronoq.core.config import BrokerConfig
import pytest

from chronoq.server.h2limits import MAX_UNREAD_ANSWER_BYTES_TOTAL, IdleWatch, Limits, TokenBucket, UnreadAnswers


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_token_bucket_allows_a_burst_then_its_rate():
    clock = Clock()
    bucket = TokenBucket(1000, 33.0, clock)
    assert all(bucket.take() for _ in range(1000))
    assert not bucket.take()
    clock.now += 1.0  # 33 more
    assert sum(bucket.take() for _ in range(100)) == 33
    clock.now += 3600.0  # never more than the burst, however long it rested
    assert sum(bucket.take() for _ in range(5000)) == 1000


def test_idle_watch_needs_a_whole_interval_without_streams():
    watch = IdleWatch()
    assert watch.check(0, 0)  # never opened a stream in the first interval
    watch = IdleWatch()
    assert not watch.check(1, 1)   # a call open at the check
    assert not watch.check(0, 1)   # it ended during the interval: not idle for a whole one yet
    assert watch.check(0, 1)       # a whole interval with no stream and no new one
    watch = IdleWatch()
    assert not watch.check(0, 3)   # calls came and went since the last check
    assert not watch.check(0, 5)
    assert watch.check(0, 5)


def test_limits_from_config_and_for_grpcio():
    cfg = BrokerConfig(h2_max_connections=7, h2_max_concurrent_streams=9, h2_preface_timeout_ms=1500,
                       h2_idle_timeout_ms=60_000, h2_max_header_list_bytes=8192).validate()
    limits = Limits.from_config(cfg)
    assert (limits.max_connections, limits.max_concurrent_streams, limits.preface_timeout_s,
            limits.idle_timeout_s, limits.max_header_list) == (7, 9, 1.5, 60.0, 8192)
    options = dict(limits.grpcio_options())
    assert options["grpc.max_concurrent_streams"] == 9
    assert options["grpc.max_allowed_incoming_connections"] == 7
    assert options["grpc.server_handshake_timeout_ms"] == 1500
    assert options["grpc.max_connection_idle_ms"] == 60_000
    assert options["grpc.max_metadata_size"] == 8192
    defaults = Limits.from_config(BrokerConfig())
    assert defaults == Limits()  # the config's defaults are the module's


def test_unread_answers_are_counted_as_they_change_and_never_below_0():
    total = UnreadAnswers(1000)
    total.add(600)
    assert total.room(400) and not total.room(401)
    total.add(-200)  # some left for their peer
    assert total.held == 400 and total.room(600)
    total.add(-400)
    assert total.held == 0
    with pytest.raises(AssertionError, match="below 0"):  # bytes taken off that were never added
        total.add(-1)
    assert total.held == 0  # the refused change left nothing behind
    assert Limits().max_unread_answer_bytes_total == MAX_UNREAD_ANSWER_BYTES_TOTAL == 256 << 20
    assert Limits().max_unread_answer_bytes <= Limits().max_unread_answer_bytes_total


def test_connections_fit_what_the_open_files_limit_leaves():
    from chronoq.server.process import CONNECTIONS_MIN, connections_that_fit

    assert connections_that_fit(1000, 65536, 8192) == 1000  # plenty: the configured limit
    assert connections_that_fit(1000, 1024, 256) == 512  # 1,024 - 256 queue files - 256 kept
    assert connections_that_fit(1000, 512, 128) == 256  # a quarter of the limit is kept below 1,024
    assert connections_that_fit(100, 512, 128) == 100  # a lower configured limit stays
    assert connections_that_fit(1000, 100, 64) == CONNECTIONS_MIN  # hopeless, but a few are taken
    # The HTTP listener's connections (http_max_connections) are kept on top of the reserve.
    assert connections_that_fit(1000, 1024, 256, 64) == 448
    assert connections_that_fit(1000, 512, 128, 64) == 192
    assert connections_that_fit(100, 512, 128, 64) == 100
