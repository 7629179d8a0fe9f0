"""The console's charts, drawn on the server as SVG by pygal and put inline in the page. Pure.

Why server-side SVG (docs/console.md, "Charts"): the console draws a handful of bar and line
charts, which needs no chart engine in the browser. pygal is a small (about 1.3 MB installed),
pure-Python, maintained library; the page carries its charts, so nothing is fetched by a script,
nothing comes from the network, and the page reads the same with scripts off. Pages are served
gzip-compressed (``app.render``). pygal's own tooltip script is not used (``js=[]``: it would be
loaded from the internet); the exact numbers are in the tables under each chart.

Times are UTC, as everywhere in the console.
"""

from __future__ import annotations

from datetime import datetime, timezone

import pygal
from pygal.style import Style

HEIGHT = 300
WIDTH = 1150
# A bar chart switches to a log scale when its tallest bar is this many times the median of its
# non-empty ones: on a linear axis the typical bar would be under ~3% of the plot's height (a few
# pixels), unreadable beside the one bin that dwarfs the rest.
LOG_RATIO = 30
DOTS_MAX = 60  # a line chart with at most this many points per series marks each point

_STYLE = Style(background="white", plot_background="white", font_family="system-ui, sans-serif",
               colors=("#3b6ea8", "#d9822b", "#3a9a5b", "#8e44ad"), label_font_size=11,
               major_label_font_size=11, title_font_size=14, legend_font_size=12)
_COMMON = {"js": [], "style": _STYLE, "width": WIDTH, "height": HEIGHT, "explicit_size": True,
           "disable_xml_declaration": True, "margin": 8, "truncate_label": -1, "x_label_rotation": 0}


def iso(ms: int) -> str:
    """Epoch ms as UTC date-time text."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _utc(ms: int) -> datetime:
    # Naive, in UTC: pygal formats the x axis with the formatter below, no local time involved.
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).replace(tzinfo=None)


def log_scale_wanted(values) -> bool:
    """Whether one value dwarfs the rest (see ``LOG_RATIO``)."""
    positive = sorted(v for v in values if v and v > 0)
    return bool(positive) and positive[-1] >= LOG_RATIO * positive[(len(positive) - 1) // 2]


def _log_options(values) -> dict:
    """A log axis with a label at every power of ten; zero values are left out (log 0)."""
    top = max(v for v in values if v)
    tens = [1]
    while tens[-1] < top:
        tens.append(tens[-1] * 10)
    # Bars grow from 0.5 (pygal's "zero"), so a bin of 1 still shows a bar above the axis line; the
    # axis ends at the next power of ten, so the top bar has a label above it.
    return {"logarithmic": True, "y_labels": tens, "zero": 0.5, "range": (0.5, tens[-1])}


def due_bars(view: dict, title: str) -> str:
    """Bars of pending messages per bin (a view of ``horizon.bins``), as an SVG element."""
    starts, step, pending = view["starts_ms"], view["step_ms"], view["pending"]
    hourly = step >= 3_600_000
    log = log_scale_wanted(pending)
    options = dict(_COMMON, show_legend=False, y_title="messages due", show_minor_x_labels=False,
                   x_labels_major_every=24 if hourly else 10,
                   title=title + (" (log scale)" if log else ""))
    if log:
        options.update(_log_options(pending))
    chart = pygal.Bar(**options)
    chart.x_labels = [datetime.fromtimestamp(s / 1000, tz=timezone.utc).strftime("%a %d %H:%M" if hourly else "%H:%M")
                      for s in starts]
    chart.add("due", [(n or None) if log else n for n in pending])
    return chart.render(is_unicode=True)


def time_lines(title: str, y_title: str, series: dict[str, list[tuple[int, float | None]]]) -> str:
    """Lines over time, one per name: (epoch ms, value) points; the x axis spans the points given
    (the data there is, not a fixed window); None values break a line. Always a linear axis: these
    series hold zeros (an idle second, a p50 of 0 ms), which a log axis cannot place."""
    options = dict(_COMMON, title=title, y_title=y_title, show_dots=False, legend_at_bottom=True,
                   legend_at_bottom_columns=max(1, len(series)), min_scale=4, max_scale=8,
                   x_value_formatter=lambda dt: dt.strftime("%H:%M:%S"), include_x_axis=True,
                   no_data_text="no data yet")
    points_max = max((len(points) for points in series.values()), default=0)
    options["show_dots"] = points_max <= DOTS_MAX  # few points: each one visible
    values = [v for points in series.values() for _t, v in points if v is not None]
    if values and all(float(v).is_integer() for v in values) and max(values) < 10:
        options["y_labels"] = list(range(0, int(max(values)) + 2))  # small counts: whole-number ticks
    chart = pygal.DateTimeLine(**options)
    for name, points in series.items():
        chart.add(name, [(_utc(t), v) for t, v in points])
    return chart.render(is_unicode=True)


def lateness_lines(samples: list) -> str:
    """p50, p99 and max lateness per interval (``lateness.Sample``), intervals with deliveries only."""
    with_data = [s for s in samples if s.count]
    series = {name: [(s.end_ms, getattr(s, f)) for s in with_data]
              for f, name in (("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max"))}
    return time_lines("Timer lateness per interval (visible time - due time)", "ms (bucket upper bound)", series)


def rate_lines(rates: list) -> str:
    """Sent, delivered and acked per second (``history.Rate``), at each interval's end."""
    series = {name: [(r.end_ms, round(getattr(r, f), 2)) for r in rates]
              for f, name in (("sent", "sent"), ("received", "delivered"), ("acked", "acked"))}
    return time_lines("Messages per second", "per second", series)


def depth_lines(samples: list) -> str:
    """Consumer lag, in flight and pending timers (``history.Sample``) over time."""
    series = {name: [(s.ts_ms, getattr(s, f)) for s in samples]
              for f, name in (("lag", "lag (not yet received)"), ("inflight", "in flight"),
                              ("timers", "delayed, not yet due"))}
    return time_lines("Queue depth", "messages", series)
