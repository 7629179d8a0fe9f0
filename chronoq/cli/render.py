"""How the command line prints: one JSON document for scripts, rich tables and text histograms for
people, a progress bar for long work shown only on a terminal, and the time and size texts."""

from __future__ import annotations

import contextlib
import io
import json
import sys

import click

TABLE_WIDTH_PIPED = 400     # table width limit when stdout is not a terminal and COLUMNS is not set
BAR_WIDTH = 40              # characters of the longest bar in the text histograms
WRAP_MIN = 12               # a column that folds (free text) is never squeezed below this
BORDER = 3                  # characters a rich table adds per column ("│ " + " "), plus 1 in all


def plural(n: int, word: str, words: str | None = None) -> str:
    """``1 message``, ``2 messages``, ``12,345 messages``; ``words`` for an irregular plural.
    (People read these; ``--json`` keeps the raw numbers.)"""
    return f"{n:,} {word if n == 1 else (words or word + 's')}"


def whole_writes() -> None:
    """Make every write to stdout and stderr whole. Under ``PYTHONUNBUFFERED=1`` (or ``python -u``,
    common in container images) the text streams sit right on the file descriptors, and Python's
    text layer drops what a short write left over: a terminal read slowly takes part of a large
    write, and the rest of a ``--json`` answer was lost while the command still exited 0. A
    buffered layer in between writes the rest; flushed at each line, the output stays as prompt."""
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        raw = getattr(stream, "buffer", None)
        if isinstance(raw, io.RawIOBase):  # (a BufferedWriter already finishes short writes)
            # The old wrapper stays referenced (sys.__stdout__/__stderr__), so it never closes the descriptor.
            setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(raw), encoding=stream.encoding,
                                                errors=stream.errors, line_buffering=True))


def print_json(value) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def _console():
    """A console as wide as the terminal, or ``COLUMNS``; piped without it, wide enough never
    to cut a row (scripts read the lines whole)."""
    import os

    from rich.console import Console

    console = Console()
    if not console.is_terminal and not os.environ.get("COLUMNS", "").isdigit():
        console = Console(width=TABLE_WIDTH_PIPED)
    return console


def echo_wrapped(text: str, indent: str = "  ") -> None:
    """A line of text for people, folded at word boundaries to the console's width (as tables:
    the terminal or ``COLUMNS``); folded lines are indented by ``indent``."""
    import textwrap

    click.echo(textwrap.fill(text, width=_console().width, subsequent_indent=indent, break_long_words=False,
                             break_on_hyphens=False))


def fit_columns(width: int, columns: list[str], rows: list[list], wrap: tuple[str, ...],
                optional: tuple[str, ...]) -> list[str]:
    """The columns to show in ``width`` characters: all of them if they fit, else without the
    ``optional`` ones, dropped in the order given (least useful first) until the rest fits. A
    column is as wide as its widest cell, a folding one (``wrap``) at least ``WRAP_MIN``, and
    no column narrower than its header: rather a column less than columns of two characters."""
    def need(names: list[str]) -> int:
        total = 1
        for name in names:
            i = columns.index(name)
            widest = max([len(name)] + [len(str(r[i])) if r[i] is not None else 0 for r in rows])
            total += BORDER + (min(widest, max(WRAP_MIN, len(name))) if name in wrap else widest)
        return total

    shown = list(columns)
    for name in optional:
        if need(shown) <= width:
            break
        shown.remove(name)
    return shown


def print_table(title: str | None, columns: list[str], rows: list[list], *, right: tuple[str, ...] = (),
                wrap: tuple[str, ...] = (), optional: tuple[str, ...] = ()) -> None:
    """A table for people. Names and ids are printed whole (no wrapping, so they can be copied);
    ``wrap`` columns (free text) fold; ``optional`` columns are dropped, least useful first, when
    the table would not fit the terminal (or ``COLUMNS``): ``fit_columns``."""
    from rich.table import Table

    console = _console()
    shown = fit_columns(console.width, columns, rows, wrap, optional)
    keep = [columns.index(name) for name in shown]
    table = Table(title=title, title_justify="left", header_style="bold")
    for name in shown:
        table.add_column(name, justify="right" if name in right else "left", overflow="fold",
                         no_wrap=name not in wrap, min_width=min(len(name), WRAP_MIN) if name in wrap else len(name))
    for row in rows:
        table.add_row(*("" if row[i] is None else str(row[i]) for i in keep))
    console.print(table)


@contextlib.contextmanager
def progress_bar(description: str, total: int | None, hidden: bool):
    """A rich progress bar for long work, shown only to a person: stdout is a terminal and not
    ``hidden`` (--json, or work too short for one; scripts and pipes get nothing extra). Yields
    ``advance(n)``; ``total`` None: a spinner with the elapsed time (work whose size is unknown).
    The bar is removed when done, so the command's own output follows as usual."""
    if hidden or not sys.stdout.isatty():
        yield lambda n=1: None
        return
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    columns = ([TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn()]
               if total is not None else [SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn()])
    with Progress(*columns, transient=True) as progress:
        task = progress.add_task(description, total=total)
        yield lambda n=1: progress.advance(task, n)



def iso_ms(ms: int | None) -> str | None:
    """Epoch ms as an ISO 8601 UTC time with milliseconds, for people."""
    if not ms:
        return None
    import datetime

    try:
        when = datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc)
    except (OverflowError, ValueError, OSError):  # past what a date can show: the number as it is
        return f"{ms} ms"
    return when.isoformat(timespec="milliseconds").replace("+00:00", "Z")


def bars(rows: list[tuple[str, int]]) -> None:
    """A text histogram: label, bar scaled to the largest count, count."""
    top = max((count for _, count in rows), default=0)
    width = max((len(label) for label, _ in rows), default=0)
    for label, count in rows:
        bar = "#" * (round(count * BAR_WIDTH / top) if top else 0)
        if count and not bar:
            bar = "."  # some, but less than one character's worth
        click.echo(f"  {label.rjust(width)} | {bar.ljust(BAR_WIDTH)} {count:,}")


def duration_text(ms: int) -> str:
    from chronoq.core.delay_levels import format_duration

    return format_duration(ms)


def size_text(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,} B" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


