"""How ``chronoq serve`` logs: every line with a time and a level, as text or as JSON (docs/deploy.md, "Logs").

Two streams, both formatted here:

- **stderr**: every logger (``chronoq.*`` and the libraries'), at ``log_level``.
- **stdout**: the broker's own announcements (``ANNOUNCE``: the data directory, the recovery
  summary, "chronoq is ready; ..." with the addresses, the stop), always shown. Scripts, service
  managers and tests read the ready line from stdout, so in text form these lines stay exactly as
  they always were (``chronoq is ready; RocketMQ gRPC on ...``): a stable interface, not a log.

``log_format = "text"``: stderr lines read ``2026-11-26T15:23:15.123Z INFO chronoq.runtime: message``.
``log_format = "json"``: one object a line, for log shippers (Vector, Fluent Bit, Promtail, the
journal's ``MESSAGE``): ``{"time": "2026-11-26T15:23:15.123Z", "level": "INFO", "logger":
"chronoq.runtime", "message": "...", "exception": "Traceback ..."}`` (``exception`` only with
one). Times are UTC with milliseconds, whatever the host's zone.
"""

from __future__ import annotations

import json
import logging
import sys
import time

ANNOUNCE = logging.getLogger("chronoq.announce")
FORMATS = ("text", "json")


def _utc(record: logging.LogRecord) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_utc(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.exc_text:
            line += "\n" + record.exc_text
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": _utc(record), "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def configure(level: str = "info", fmt: str = "text", stderr=None, stdout=None) -> None:
    """Install the two handlers (replacing any the root logger and ``ANNOUNCE`` had)."""
    assert fmt in FORMATS, fmt
    formatter = JsonFormatter() if fmt == "json" else TextFormatter()
    errors = logging.StreamHandler(stderr if stderr is not None else sys.stderr)
    errors.setFormatter(formatter)
    root = logging.getLogger()
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    root.addHandler(errors)
    root.setLevel(level.upper())
    announcements = logging.StreamHandler(stdout if stdout is not None else sys.stdout)
    announcements.setFormatter(formatter if fmt == "json" else logging.Formatter("%(message)s"))
    for handler in ANNOUNCE.handlers[:]:
        ANNOUNCE.removeHandler(handler)
    ANNOUNCE.addHandler(announcements)
    ANNOUNCE.setLevel(logging.INFO)  # shown whatever log_level is: they are the start-up story
    ANNOUNCE.propagate = False


def announce(text: str) -> None:
    """One announcement line on stdout (``Runtime.say`` under ``chronoq serve``). Without
    ``configure`` (a runtime made by a program of its own) a plain print, as before."""
    if ANNOUNCE.handlers:
        ANNOUNCE.info(text)
    else:
        print(text, flush=True)
