"""kill -9 while retention rolls pending timers forward and deletes segments (chronoq.timer.roll).

A child process (this module run as a script) fills a broker with far-future timers (some then
recalled or rescheduled) and ten segments of plain traffic after them, lets the timer checkpoint
past them, and runs retention with a fault hook that SIGKILLs it at one bad moment:

* ``tear-roll``: inside the ``pwrite`` of the roll records (a seeded prefix reaches the file);
* ``unlink-1``: roll records durable, before the first segment is deleted;
* ``unlink-2``: after the first segment (the one the timers were sent in) is deleted;
* ``served-fsync``, ``served-unlink-1``: retention as the server runs it (``GroupCommitter.retention``:
  the roll records written on the loop, fsynced on the committer's thread, the deletion after),
  killed on that thread just before its fsync, or before the first deletion; there the child
  also reports which threads fsynced the commit log since retention began (only the committer's).

Then, on copies of the directory: the ordinary restart and a rebuild from the logs alone (every
derived file deleted) must both hold exactly the timers pending before the kill (same idents,
due times and bytes), and after the restarted broker runs retention to the end, a rebuild must
still agree. On the code before roll forward, the rebuild lost the timers whose segment went.
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from chronoq.broker.broker import Broker, OutgoingMessage  # noqa: E402
from chronoq.broker.digest import derived_digest  # noqa: E402
from chronoq.core.clock import FakeClock  # noqa: E402
from chronoq.core.config import BrokerConfig  # noqa: E402
from chronoq.store import commitlog  # noqa: E402
from tests.integration.test_rebuild_from_log import _delete_derived  # noqa: E402
from writer import tear_next_log_write  # noqa: E402

START_MS = 1_700_000_000_000
MOMENTS = ("tear-roll", "unlink-1", "unlink-2", "served-fsync", "served-unlink-1")
FSYNC_THREAD = "chronoq-fsync"  # chronoq/store/fsyncer.py


def _config(data_dir: str) -> BrokerConfig:
    return BrokerConfig(data_dir=data_dir, segment_bytes=64 * 1024, retention_max_bytes=1,
                        checkpoint_interval_ms=1000, timer_checkpoint_interval_ms=1000)


def _child(data_dir: str, moment: str, seed: int) -> None:
    rng = random.Random(seed)
    clock = FakeClock(START_MS)
    broker = Broker(_config(data_dir), clock=clock)
    handles = [r.recall_handle for r in broker.send_batch(
        [OutgoingMessage("later", f"far{i}".encode() * rng.randint(1, 50),
                         deliver_at_ms=START_MS + 3_600_000 + rng.randrange(86_400_000)) for i in range(40)])]
    for h in handles[:5]:
        broker.recall(h)
    for h in handles[5:8]:
        broker.reschedule(h, START_MS + 7_200_000)
    for _ in range(40):  # ~10 segments of plain messages after them
        broker.send_batch([OutgoingMessage("orders", bytes(1024)) for _ in range(16)])
        clock.advance(100)
        broker.timer_tick()
        broker.maintenance()
    broker.timer.checkpoint()
    broker.checkpoint()
    pending = derived_digest(broker)["timers"]
    print(f"pending {len(pending)} {clock.wall_ms()}", flush=True)
    if moment.startswith("served-"):
        _served(broker, moment.split("-", 1)[1])
    else:
        _arm(broker, moment, rng)
        broker.retention()
    print("done", flush=True)  # the hook did not fire: the parent fails the run


def _served(broker: Broker, moment: str) -> None:
    """Retention through a started committer (the server's path), killed at ``moment``."""
    import asyncio
    import threading

    from chronoq.broker.committer import GroupCommitter

    threads = []  # the threads that fsynced the commit log since retention began
    real_sync = broker.store.sync

    def direct_sync():  # an fsync on the loop's thread would be recorded here
        threads.append(threading.current_thread().name)
        return real_sync()

    def before_fsync(_fd):  # the committer's fsync thread, before each of its fsyncs
        threads.append(threading.current_thread().name)
        if moment == "fsync" and broker.store.log.written > broker.store.log.synced:
            print("threads", *sorted(set(threads)), flush=True)
            os.kill(os.getpid(), signal.SIGKILL)

    def kill_at_unlink(path, *args, **kwargs):
        print("threads", *sorted(set(threads)), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    async def main():
        committer = GroupCommitter(broker)
        committer.start()
        committer.fsyncer.before_fsync = before_fsync
        broker.store.sync = direct_sync
        if moment == "unlink-1":
            commitlog.os.unlink = kill_at_unlink
        await committer.retention()

    asyncio.run(main())


def _arm(broker: Broker, moment: str, rng: random.Random) -> None:
    """Fault hooks on the commit log's own calls: SIGKILL this process at ``moment``."""
    if moment == "tear-roll":
        tear_next_log_write(broker, rng)
        return
    kill_at = int(moment.split("-")[1])
    real_unlink = os.unlink
    calls = [0]

    def unlink(path, *args, **kwargs):
        calls[0] += 1
        if calls[0] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return real_unlink(path, *args, **kwargs)

    commitlog.os.unlink = unlink


def _timers(data_dir: str, now_ms: int, rebuild: bool, retain: bool = False) -> list:
    if rebuild:
        _delete_derived(data_dir)
    with Broker(_config(data_dir), clock=FakeClock(now_ms)) as broker:
        if retain:  # finish what the killed pass began
            broker.retention()
            assert broker.store.log.min_offset > 0
        return derived_digest(broker)["timers"]


@pytest.mark.parametrize("moment", MOMENTS)
def test_kill_9_during_retention_keeps_every_pending_timer_in_the_log(tmp_path, moment):
    data = str(tmp_path / "data")
    child = subprocess.run([sys.executable, os.path.abspath(__file__), data, moment, "11"], capture_output=True,
                           text=True, timeout=300, cwd=ROOT)
    lines = child.stdout.split()
    assert child.returncode == -signal.SIGKILL, f"{child.returncode}: {child.stdout}\n{child.stderr[-3000:]}"
    assert lines[0] == "pending" and "done" not in lines, child.stdout
    if moment.startswith("served-"):  # every commit-log fsync of retention on the committer's thread
        assert lines[3] == "threads" and lines[4:] == [FSYNC_THREAD], child.stdout
    count, now_ms = int(lines[1]), int(lines[2])
    assert count == 35  # 40 sent, 5 recalled (3 moved: new idents, still pending)

    with Broker(_config(data), clock=FakeClock(now_ms)) as before:  # what the kill left, recovered
        live = derived_digest(before)["timers"]
    assert len(live) == count
    copies = {}
    for name in ("rebuilt", "retained", "retained-rebuilt"):
        copies[name] = str(tmp_path / name)
        shutil.copytree(data, copies[name])
    assert _timers(copies["rebuilt"], now_ms, rebuild=True) == live
    assert _timers(copies["retained"], now_ms, rebuild=False, retain=True) == live
    _timers(copies["retained-rebuilt"], now_ms, rebuild=False, retain=True)
    assert _timers(copies["retained-rebuilt"], now_ms, rebuild=True) == live


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2], int(sys.argv[3]))
