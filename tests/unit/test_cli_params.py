"""Number and time options the CLI refuses itself (a usage error, exit 2, naming the option),
rather than passing them on to a traceback: nan, infinity, and times no date can show."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from chronoq.cli.main import main as cli
from chronoq.cli.render import iso_ms
from chronoq.core import errors
from chronoq.features.schedules import occurrences


@pytest.mark.parametrize("args, option", [
    (["message", "reschedule", "H", "--in", "nan"], "--in"),
    (["message", "reschedule", "H", "--in", "inf"], "--in"),
    (["message", "reschedule", "H", "--in", "1e30"], "--in"),
    (["message", "reschedule", "H", "--at", "99999999999999999999"], "--at"),
    (["schedule", "create", "s", "t", "--body", "x", "--every", "inf"], "--every"),
    (["schedule", "create", "s", "t", "--body", "x", "--every", "nan"], "--every"),
    (["schedule", "create", "s", "t", "--body", "x", "--every", "60", "--start", "99999999999999999999"], "--start"),
    (["receive", "t", "g", "--wait", "nan"], "--wait"),
    (["topic", "list", "--timeout", "inf"], "--timeout"),
])
def test_numbers_and_times_out_of_reach_are_usage_errors(args, option):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2, (result.exit_code, result.output, result.exception)
    assert option in result.output and "Traceback" not in result.output


def test_a_schedule_starting_after_the_year_9999_is_refused():
    for start in (253_402_300_800_000, 1 << 62):
        with pytest.raises(errors.ClientError, match="after the year 9999"):
            occurrences.make_spec("", 60_000, "UTC", start, 0, 1_800_000_000_000)


def test_times_no_date_can_show_are_printed_as_numbers():
    assert iso_ms(1 << 62) == f"{1 << 62} ms"
    assert iso_ms(1_800_000_000_000) == "2027-01-15T08:00:00.000Z"
