"""``python -m tests.integration.schedule_faults serve ...``: ``chronoq`` with a kill point in the
recurring-schedules round, for the kill -9 test in test_schedules.py. The broker itself carries no
fault seam: this launcher wraps two methods of the round (``ScheduleBook.write_round`` and
``finish_round``) before it hands over to the CLI, and SIGKILLs the process the N-th time the round
reaches the point named by ``CRASH_AT_ENV`` ("POINT:N"):

- ``intent``: the round's intent is saved, nothing written (on entry to ``write_round``);
- ``written``: the occurrences are in the page cache, not fsynced (on return from ``write_round``);
- ``synced``: fsynced, the cursors not yet saved (on entry to ``finish_round``).
"""

from __future__ import annotations

import os
import signal

from chronoq.features.schedules.book import ScheduleBook

CRASH_AT_ENV = "CHRONOQ_TEST_SCHEDULES_CRASH_AT"


def install(spec: str) -> None:
    point, _, count = spec.partition(":")
    if point not in ("intent", "written", "synced"):
        raise SystemExit(f"{CRASH_AT_ENV}: unknown point {point!r}")
    left = [int(count or 1)]

    def reached(at: str) -> None:
        if at == point:
            left[0] -= 1
            if left[0] <= 0:
                os.kill(os.getpid(), signal.SIGKILL)

    write_round, finish_round = ScheduleBook.write_round, ScheduleBook.finish_round

    def write_round_with_faults(self, rnd):
        reached("intent")
        write_round(self, rnd)
        reached("written")

    def finish_round_with_faults(self, rnd):
        reached("synced")
        finish_round(self, rnd)

    ScheduleBook.write_round = write_round_with_faults
    ScheduleBook.finish_round = finish_round_with_faults


if __name__ == "__main__":
    spec = os.environ.get(CRASH_AT_ENV)
    if spec:
        install(spec)
    from chronoq.cli.main import main

    main()
