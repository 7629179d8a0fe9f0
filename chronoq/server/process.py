"""What ``chronoq serve`` sets for its own process at start: its scheduling priority
(``priority_boost``), how the C allocator returns freed memory to the kernel, and its soft limit
on open files; and how many connections that limit leaves room for (``connection_limits``).

Both are process-wide, so only the broker's own process sets them (``runtime.run``), never a
``Runtime`` run inside somebody else's process (tests, an embedding application).
"""

from __future__ import annotations

import ctypes
import logging
import os
import resource

log = logging.getLogger("chronoq.process")

# glibc's mallopt(3) parameters.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Buffers up to this size come from the heap, not from a mapping of their own. The broker's big
# buffers are a replica's pull answers (4 MiB at most by default, chronoq.replication.shipper)
# and its copies on the way out, and batches of sends: all below it.
MMAP_THRESHOLD_BYTES = 8 << 20
# Free memory at the top of a heap is kept, up to this much, for the next buffers instead of being
# returned to the kernel at once: the bound on what the process holds beyond what it uses.
TRIM_THRESHOLD_BYTES = 32 << 20
# The soft open-files limit asked for when the hard one is unlimited (Linux caps it at nr_open).
OPEN_FILES_UNLIMITED = 1 << 20
# Descriptors kept for what the broker opens besides connections and consume-queue files: commit-log
# segments (one per segment read), schedule buckets (up to 256 written at once), the POP log,
# checkpoints' temporary files, the event loop's own. An idle broker holds ~24; a quarter of the
# limit, at most this many, is kept. The HTTP listener's connections (http_max_connections) are
# kept on top of it (connections_that_fit), so they cannot eat into it.
FD_RESERVE_MAX = 256
CONNECTIONS_MIN = 16  # taken whatever the limit: a broker that cannot take a few is useless anyway


def keep_freed_memory() -> str:
    """Let freed buffers be reused rather than handed back to the kernel and faulted in again;
    returns a line saying what was done.

    Why: glibc maps a buffer above its mmap threshold (128 KiB at first, raised as such buffers
    are freed) on its own, and returns the top of the heap to the kernel once more than twice that
    is free there. A broker that ships ~150 KiB pull answers or receives big batches crosses both
    lines many times a second, and every page of every such buffer is then a fresh zeroed page
    fault: ~1.8 us each on this project's 2-core VM. Serializing one 150 KiB pull answer took
    123 us that way and 2.5 us with these settings (68 faults -> 0). Setting either parameter
    turns glibc's own adjustment of both off, hence both are set.

    An operator's ``GLIBC_TUNABLES`` naming any ``glibc.malloc.`` tunable wins: nothing is set.
    Other C libraries (musl has no mallopt) are left alone."""
    if "glibc.malloc." in os.environ.get("GLIBC_TUNABLES", ""):
        return "allocator: GLIBC_TUNABLES sets glibc.malloc.*: left as configured"
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return "allocator: no mallopt (not glibc): left alone"
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    if not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
        log.warning("mallopt refused the allocator settings: freed buffers go back to the kernel")
        return "allocator: mallopt refused: left alone"
    return (f"allocator: buffers up to {MMAP_THRESHOLD_BYTES >> 20} MiB from the heap, "
            f"up to {TRIM_THRESHOLD_BYTES >> 20} MiB of freed heap kept for reuse")


def raise_priority(boost: int) -> str:
    """Lower this process's nice value by ``boost`` (to at least -20); returns a line saying what
    happened. Never raises: without the right to (CAP_SYS_NICE) the broker runs as it was started.

    Linux keeps a nice value per thread: every thread running now is changed, and threads started
    later inherit their creator's. Timer lateness is why: on a 2-CPU host shared with busy clients,
    a loop thread woken at a due time can otherwise wait behind them for a scheduler slice (the
    measured effect on the late tail, modest and noisy: docs/timers.md, "CPU priority").
    """
    before = os.getpriority(os.PRIO_PROCESS, 0)
    target = max(-20, before - boost)
    try:
        threads = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # not Linux: the process's value
        threads = [0]
    try:
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, target)
            except ProcessLookupError:  # a thread that just ended
                pass
    except PermissionError:
        return (f"scheduling priority unchanged (nice {before}): lowering it needs CAP_SYS_NICE; "
                "timer lateness may grow when other processes keep the CPUs busy (priority_boost)")
    return f"scheduling priority raised: nice {before} -> {target} (priority_boost)"


def raise_open_files_limit() -> str:
    """Raise the soft RLIMIT_NOFILE to the hard one; returns a line saying what was done.

    Why: the soft limit is often 1,024 (systemd's and most shells' default) while the broker
    may hold up to ``h2_max_connections`` (1,000) connections plus its files: the commit log's
    segments, consume-queue files (capped at a quarter of this limit, ``store/fdbudget.py``),
    schedule buckets, the POP log. Raising the soft limit up to the hard one needs no privilege
    (Go's runtime does the same for every program since 1.19)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else OPEN_FILES_UNLIMITED
    if soft == resource.RLIM_INFINITY or soft >= target:
        return f"open files: limit {soft}"
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError) as exc:
        return f"open files: limit {soft} (raising it to {target} failed: {exc})"
    return f"open files: limit raised {soft} -> {target}"


def connections_that_fit(wanted: int, open_files: int, cq_files: int, http_connections: int = 0) -> int:
    """The connections a broker may hold under the open-files limit ``open_files`` when its
    consume-queue files may take ``cq_files`` descriptors and its HTTP listener
    ``http_connections``: ``wanted`` (``h2_max_connections``) when everything fits, else what is
    left after those and the reserve.

    Why: a descriptor taken by a connection is one the broker cannot use to write a checkpoint or
    roll a segment. Measured under a hard limit of 512 (before this): 488 idle HTTP/2 connections
    took every descriptor left, and until they closed every checkpoint failed with EMFILE."""
    reserve = min(FD_RESERVE_MAX, open_files // 4)
    return max(CONNECTIONS_MIN, min(wanted, open_files - cq_files - http_connections - reserve))


def connection_limits(cfg):
    """``h2limits.Limits.from_config(cfg)`` with ``max_connections`` lowered to what the process's
    open-files limit leaves room for (one WARNING line saying so and how to raise it)."""
    from dataclasses import replace

    from chronoq.server import h2limits
    from chronoq.store import fdbudget

    limits = h2limits.Limits.from_config(cfg)
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return limits
    cq_files = cfg.cq_open_files or fdbudget.default_limit()  # (as the store sizes its budget)
    http = cfg.http_max_connections if cfg.http_port >= 0 else 0  # (negative port: no HTTP listener)
    fit = connections_that_fit(limits.max_connections, soft, cq_files, http)
    if fit >= limits.max_connections:
        return limits
    log.warning("open files: the limit of %d descriptors leaves room for %d connections, not "
                "h2_max_connections (%d): consume-queue files may take %d (cq_open_files), the HTTP listener "
                "%d (http_max_connections), and %d are kept for the broker's other files; at most %d "
                "connections are taken. Raise the hard open-files limit (systemd LimitNOFILE=, ulimit -Hn, "
                "docker --ulimit nofile=) or lower h2_max_connections to silence this", soft, fit,
                limits.max_connections, cq_files, http, min(FD_RESERVE_MAX, soft // 4), fit)
    return replace(limits, max_connections=fit)
