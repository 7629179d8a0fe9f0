"""``chronoq serve`` raises its scheduling priority at start when asked and the OS allows (``priority_boost``).

Every thread of the served process ends with the lowered nice value (Linux keeps one per thread),
or, without the right to lower it, all keep the value they were started with and the broker says
why. By default (``priority_boost = 0``) it leaves the priority alone: an operator's ``Nice=`` stays.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="per-thread nice values are Linux's")

BOOST = 5


def thread_nice_values(pid: int) -> dict[int, int]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:  # a thread that just ended
            continue
        # proc(5): after "(comm)", field 19 (nice) is the 17th.
        out[int(tid)] = int(stat.rsplit(")", 1)[1].split()[16])
    return out


def may_lower_nice() -> bool:
    """Whether a process started from here may lower its nice value (root or CAP_SYS_NICE)."""
    probe = ("import os\ntry:\n    os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) - 1)\n"
             "    print('yes')\nexcept PermissionError:\n    print('no')\n")
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          check=True).stdout.strip() == "yes"


def test_serve_raises_its_priority_when_allowed(chronoq_process):
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    server = chronoq_process(f"priority_boost = {BOOST}\n")
    values = thread_nice_values(server.proc.pid)
    assert len(values) > 1, "the broker runs worker threads beside its loop"
    said = [line for line in server.lines if "scheduling priority" in line]
    assert len(said) == 1, server.output()
    if may_lower_nice():
        expected = max(-20, ours - BOOST)
        assert f"nice {ours} -> {expected}" in said[0]
    else:
        expected = ours
        assert "unchanged" in said[0] and "CAP_SYS_NICE" in said[0]
    assert set(values.values()) == {expected}, values


@pytest.mark.parametrize("config", ["", "priority_boost = 0\n"], ids=["default", "zero"])
def test_boost_off_by_default_and_zero_leaves_the_priority_alone(chronoq_process, config):
    ours = os.getpriority(os.PRIO_PROCESS, 0)
    server = chronoq_process(config)
    assert set(thread_nice_values(server.proc.pid).values()) == {ours}
    assert not any("scheduling priority" in line for line in server.lines), server.output()


def test_boost_out_of_range_is_refused(tmp_path):
    config = tmp_path / "bad.toml"
    config.write_text("priority_boost = 21\n")
    done = subprocess.run([sys.executable, "-m", "chronoq", "serve", "--config", str(config),
                           "--data-dir", str(tmp_path / "d")], capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "priority_boost must be 0 to 20" in done.stdout + done.stderr
