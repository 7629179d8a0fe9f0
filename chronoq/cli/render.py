"""How the command line prints: one JSON document for scripts, rich tables and text histograms for
people, a progress bar for long work shown only on a terminal, and the time and size texts."""

from __future__ import annotations

import contextlib
import json
import sys

import click

TABLE_WIDTH_PIPED = 400     # table width limit when stdout is not a terminal
BAR_WIDTH = 40              # characters of the longest bar in the text histograms


def print_json(value) -> None:
    click.echo(json.dumps(value, indent=2, ensure_ascii=False))


def print_table(title: str | None, columns: list[str], rows: list[list], *, right: tuple[str, ...] = (),
                 wrap: tuple[str, ...] = ()) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left", header_style="bold")
    for name in columns:
        # Names and ids are printed whole (no wrapping, so they can be copied); free text folds.
        table.add_column(name, justify="right" if name in right else "left", overflow="fold",
                         no_wrap=name not in wrap)
    for row in rows:
        table.add_row(*("" if v is None else str(v) for v in row))
    console = Console()
    if not console.is_terminal:  # piped: no terminal width to respect, so never cut a row
        console = Console(width=TABLE_WIDTH_PIPED)
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

    return datetime.datetime.fromtimestamp(ms / 1000, datetime.timezone.utc).isoformat(timespec="milliseconds") \
        .replace("+00:00", "Z")


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


