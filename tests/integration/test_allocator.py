"""``chronoq serve`` keeps freed buffers for reuse (``chronoq.server.process.keep_freed_memory``).

glibc, left to itself, hands big freed buffers back to the kernel, and every page of the next one
is a fresh page fault: a broker shipping pull answers or taking big batches paid ~1.8 us a page.
The probe below allocates four 256 KiB buffers at once and frees them, 200 times, in a fresh
process: with the setting it faults (almost) no page; without it, tens of thousands. An operator's
own ``GLIBC_TUNABLES`` for the allocator wins over the broker's choice.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from chronoq.server import process

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="glibc on Linux")

PROBE = """
import resource, sys
from chronoq.server import process
if sys.argv[1] == "kept":
    print(process.keep_freed_memory(), file=sys.stderr)
def cycle():
    held = [b"x" * (256 << 10) for _ in range(4)]  # 1 MiB live at once, then all freed
    del held
for _ in range(5):
    cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(200):
    cycle()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def page_faults(how: str, env_extra: dict | None = None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env.update(env_extra or {})
    done = subprocess.run([sys.executable, "-c", PROBE, how], capture_output=True, text=True, env=env,
                          check=True, timeout=60)
    return int(done.stdout.strip()), done.stderr.strip()


def test_freed_buffers_are_reused_not_faulted_in_again():
    plain, _ = page_faults("plain")
    if plain < 200 * 64:
        pytest.skip(f"this C library reuses freed buffers by itself ({plain} faults): nothing to show")
    kept, said = page_faults("kept")
    assert said.startswith("allocator: buffers up to"), said
    assert kept < 200, (kept, plain)  # 200 cycles of 1 MiB: at most a fault a cycle, against ~256


def test_an_operators_glibc_tunables_win():
    faults, said = page_faults("kept", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4096"})
    assert "left as configured" in said, said
    plain, _ = page_faults("plain", {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=4096"})
    assert faults > 200 * 64 and plain > 200 * 64, (faults, plain)  # their setting, not ours


def test_serve_sets_it_at_start(chronoq_process):
    server = chronoq_process('log_level = "debug"\n')
    server.stop()
    expected = (f"allocator: buffers up to {process.MMAP_THRESHOLD_BYTES >> 20} MiB from the heap, "
                f"up to {process.TRIM_THRESHOLD_BYTES >> 20} MiB of freed heap kept for reuse")
    assert expected in server.output(), server.output()
