"""Start-up progress: the store's callback sequence (per segment, never per record) on a real
in-process broker reopening a data dir with several segments, and the reporter's rate limit
(chronoq.server.progress) on a fake clock. The terminal bar itself needs a terminal: not here.
"""

from __future__ import annotations

import logging
import os

from chronoq.broker.broker import Broker
from chronoq.core.clock import FakeClock
from chronoq.core.config import BrokerConfig
from chronoq.server.progress import StartupProgress
from chronoq.store.store import CHECKPOINT_FILE

SEGMENT_BYTES = 64 * 1024
BODY = b"p" * 2000


def _filled(tmp_path) -> tuple[BrokerConfig, list[int]]:
    """A data dir whose log spans several segments; returns the config and the segment ends."""
    cfg = BrokerConfig(data_dir=str(tmp_path), segment_bytes=SEGMENT_BYTES, trace_enabled=False)
    broker = Broker(cfg, clock=FakeClock())
    for i in range(200):  # ~400 KiB: seven segments
        broker.send(f"t{i % 3}", BODY, keys=(f"k{i}",))
    broker.close()
    broker = Broker(cfg, clock=FakeClock())
    ends = [seg.end for seg in broker.store.log.segments]
    broker.close()
    assert len(ends) >= 5
    return cfg, ends


def test_rebuild_reports_each_segment_once_and_ends_at_the_total(tmp_path):
    cfg, ends = _filled(tmp_path)
    calls: list[tuple[str, int, int]] = []
    # A clean reopen has nothing long to do: no calls at all.
    Broker(cfg, clock=FakeClock(), progress=lambda *a: calls.append(a)).close()
    assert calls == []

    os.remove(os.path.join(str(tmp_path), CHECKPOINT_FILE))  # R7: verify everything, rebuild the queues
    broker = Broker(cfg, clock=FakeClock(), progress=lambda *a: calls.append(a))
    log_end = ends[-1]
    assert broker.recovery.rebuilt_queues and broker.recovery.records_replayed == 200
    verify = [c for c in calls if c[0] == "verify"]
    replay = [c for c in calls if c[0] == "replay"]
    assert calls == verify + replay, "verify first, then replay"
    # Verify: one call per segment, at its end.
    assert verify == [("verify", end, log_end) for end in ends]
    # Replay: one call per segment boundary passed (at the first record after it), then the end.
    assert len(replay) == len(ends)
    assert all(total == log_end for _p, _d, total in replay)
    done = [d for _p, d, _t in replay]
    assert done == sorted(done) and done[-1] == log_end
    for end, d in zip(ends[:-1], done[:-1]):
        assert end <= d < end + SEGMENT_BYTES  # the first record at or after the segment's end
    broker.close()


def test_reporter_logs_at_most_every_two_seconds_and_always_at_a_phase_end(caplog):
    clock = FakeClock()
    progress = StartupProgress(clock.monotonic_ns, bar=False)
    caplog.set_level(logging.INFO, logger="chronoq.recovery")
    total = 100 << 20
    for i in range(1, 11):  # ten segments, 0.5 s each: logged at 2 s, 4 s, and at the end
        clock.advance(500)
        progress("verify", i * total // 10, total)
    clock.advance(1000)
    progress("replay", total // 2, total)  # a new phase: its first step within 2 s is not logged
    clock.advance(1000)
    progress("replay", total, total)
    progress.close()
    lines = [r.getMessage() for r in caplog.records if r.name == "chronoq.recovery"]
    assert lines == progress.logged
    assert lines == [
        "recovery: verify 40% (41,943,040 of 104,857,600 bytes, 20.0 MiB/s)",
        "recovery: verify 80% (83,886,080 of 104,857,600 bytes, 20.0 MiB/s)",
        "recovery: verify 100% (104,857,600 of 104,857,600 bytes, 20.0 MiB/s)",
        "recovery: replay 100% (104,857,600 of 104,857,600 bytes, 50.0 MiB/s)",
    ]
