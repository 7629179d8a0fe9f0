"""Plotly figure specifications (plain dicts) for the console's charts. Pure.

The figures are drawn in the browser by plotly.js, which the ``plotly`` package ships and the
console serves itself (``/console/static/plotly.min.js``): nothing comes from the network.
Times are UTC, as everywhere in the console.
"""

from __future__ import annotations

import json
import math
from datetime import datetime, timezone

_FONT = {"family": "system-ui, sans-serif", "size": 12}
_BAR = "#3b6ea8"


def iso(ms: int) -> str:
    """Epoch ms as the UTC date-time text plotly reads on a date axis."""
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _layout(title: str, y_title: str, x_title: str = "due time (UTC)") -> dict:
    return {"title": {"text": title, "font": {"size": 14}}, "font": _FONT, "height": 300,
            "margin": {"l": 60, "r": 20, "t": 40, "b": 50}, "bargap": 0.1,
            "xaxis": {"type": "date", "title": {"text": x_title}},
            "yaxis": {"title": {"text": y_title}, "rangemode": "tozero"}}


def _count_ticks(top: int) -> dict:
    """Y-axis ticks for a count: whole numbers only (plotly would draw 0.5 steps for small counts)."""
    return {"tick0": 0, "dtick": max(1, math.ceil(top / 5)), "tickformat": ",d"}


def due_bars(view: dict, title: str) -> dict:
    """Bars of pending messages per bin (a view of ``horizon.horizon``), over the whole range."""
    starts, step = view["starts_ms"], view["step_ms"]
    x = [iso(s + step // 2) for s in starts]  # centred in its bin, so the bar covers the bin
    layout = _layout(title, "messages due")
    layout["yaxis"].update(_count_ticks(max(view["pending"], default=0)))
    if starts:
        layout["xaxis"]["range"] = [iso(starts[0]), iso(starts[-1] + step)]
    return {"data": [{"type": "bar", "x": x, "y": view["pending"], "width": step * 0.9, "marker": {"color": _BAR},
                      "name": "messages due", "customdata": [iso(s) for s in starts],
                      "hovertemplate": "from %{customdata}: %{y} due<extra></extra>"}],
            "layout": layout}


def lateness_lines(samples: list, window_ms: int, now_ms: int) -> dict:
    """p50, p99 and max lateness per interval (``lateness.Sample``), empty intervals left out,
    over the ring's whole window (``window_ms`` up to ``now_ms``)."""
    with_data = [s for s in samples if s.count]
    x = [iso(s.end_ms) for s in with_data]
    data = [{"type": "scatter", "mode": "lines+markers", "x": x, "y": [getattr(s, f) for s in with_data],
             "name": name} for f, name in (("p50_ms", "p50"), ("p99_ms", "p99"), ("max_ms", "max"))]
    layout = _layout("Timer lateness per interval (visible time - due time)", "lateness (ms, bucket upper bound)",
                     "end of interval (UTC)")
    layout["xaxis"]["range"] = [iso(now_ms - window_ms), iso(now_ms)]
    layout["legend"] = {"orientation": "h", "y": -0.25}
    return {"data": data, "layout": layout}


def script_json(figure: dict) -> str:
    """The figure as JSON safe inside a ``<script type="application/json">`` element."""
    return json.dumps(figure, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e")
