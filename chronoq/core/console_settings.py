"""The ``[console]`` table of the config file (the web console, ``chronoq.console``, and the Admin
lookup, ``chronoq.server.admin``, read it). Pure; here in core so ``core.config`` can check it at
load without importing upward.

::

    [console]
    lateness_interval_s = 10   # one lateness sample (p50/p99/max) per this many seconds
    lateness_samples = 360     # samples kept (360 x 10 s = the last hour)
    lookup_scan_mib = 32       # newest MiB of the commit log a lookup scans for an id or key
    trace_scan_mib = 64        # newest MiB of the trace topic a lookup reads for a message's life
    history_interval_s = 5     # one traffic sample (counters, lag, timers) per this many seconds
    history_samples = 720      # samples kept (720 x 5 s = the last hour; chronoq.server.history)
    allowed_hosts = []         # with access control off: host names (besides IP addresses and
                               # localhost) requests may be addressed to (DNS rebinding)
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from chronoq.core import errors


@dataclass(frozen=True, slots=True)
class ConsoleSettings:
    lateness_interval_s: float = 10.0
    lateness_samples: int = 360
    lookup_scan_mib: int = 32
    trace_scan_mib: int = 64
    history_interval_s: float = 5.0
    history_samples: int = 720
    allowed_hosts: tuple[str, ...] = ()

    # Upper limits: each bounds memory or the time one request holds the event loop.
    LIMITS = {"lateness_interval_s": (0.1, 3600), "lateness_samples": (1, 100_000), "lookup_scan_mib": (1, 1024),
              "trace_scan_mib": (1, 4096), "history_interval_s": (0.1, 3600), "history_samples": (2, 100_000)}


def parse(table: object) -> ConsoleSettings:
    """``ConsoleSettings`` from ``config.extra.get("console")``; ``errors.ClientError`` if wrong."""
    if table is None:
        return ConsoleSettings()
    if not isinstance(table, dict):
        raise errors.ClientError("[console] in the config file must be a table")
    known = {f.name: f for f in fields(ConsoleSettings)}
    unknown = set(table) - set(known)
    if unknown:
        raise errors.ClientError(f"unknown setting(s) {', '.join(sorted(unknown))} in [console]; known: "
                                 + ", ".join(sorted(known)))
    values = {}
    for name, value in table.items():
        if name == "allowed_hosts":
            values[name] = _hosts(value)
            continue
        lo, hi = ConsoleSettings.LIMITS[name]
        integral = name not in ("lateness_interval_s", "history_interval_s")
        if isinstance(value, bool) or not isinstance(value, int if integral else (int, float)):
            raise errors.ClientError(f"[console] {name} must be a{'n integer' if integral else ' number'}, "
                                     f"not {value!r}")
        if not lo <= value <= hi:
            raise errors.ClientError(f"[console] {name} must be between {lo} and {hi}, not {value}")
        values[name] = value
    return ConsoleSettings(**values)


def _hosts(value: object) -> tuple[str, ...]:
    """``allowed_hosts``: a list of host names (as in a URL, without port), lowercased."""
    if not isinstance(value, list) or not all(isinstance(h, str) for h in value):
        raise errors.ClientError(f"[console] allowed_hosts must be a list of host names, not {value!r}")
    hosts = tuple(h.strip().lower() for h in value)
    bad = [h for h in hosts if not h or len(h) > 253 or not all(c.isalnum() or c in "-._" for c in h)]
    if bad:
        raise errors.ClientError(f"[console] allowed_hosts: {bad[0]!r} is not a host name (no port, no scheme)")
    return hosts
