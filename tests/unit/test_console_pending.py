"""The console's pending list reads its window from the URL: a value no date can show is a 400
with the page's own message, never a 500 (the page renders every time as a date)."""

from __future__ import annotations

import pytest

from chronoq.console.charts import iso
from chronoq.console.pending import MAX_MS, query_of
from chronoq.core import errors


def test_window_bounds_are_dates_the_page_can_show():
    q = query_of({"from": "0", "to": str(MAX_MS), "topic": " t ", "limit": "5"})
    assert (q.from_ms, q.to_ms, q.topic, q.limit) == (0, MAX_MS, "t", 5)
    assert iso(MAX_MS).startswith("9999-12-31") and iso(0) == "1970-01-01 00:00:00"
    assert query_of({"from": "", "to": " "}).from_ms is None


@pytest.mark.parametrize("name,text", [("to", "9999999999999999"), ("from", "99999999999999999999"),
                                       ("to", "-99999999999999999999"), ("from", "-1"), ("to", "soon")])
def test_out_of_range_or_malformed_values_are_refused_by_name(name, text):
    with pytest.raises(errors.ClientError, match=f"{name} must be epoch milliseconds"):
        query_of({name: text})


def test_a_limit_that_is_no_number_is_refused():
    with pytest.raises(errors.ClientError, match="limit must be a whole number"):
        query_of({"limit": "1e3"})
