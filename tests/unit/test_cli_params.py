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


def test_a_local_start_the_clocks_skip_is_the_transition():
    """--start 2027-03-28T02:30 in Europe/Berlin (clocks go from 02:00 to 03:00): 03:00 CEST, as a
    schedule reads such a time (fold=0 alone gave 03:30 CEST, losing a 03:00 firing)."""
    from zoneinfo import ZoneInfo

    from chronoq.cli.message import _parse_at

    berlin = ZoneInfo("Europe/Berlin")
    assert _parse_at("2027-03-28T02:30:00", berlin) == 1_806_195_600_000  # 2027-03-28T01:00:00Z
    assert _parse_at("2027-10-31T02:30:00.250", berlin) == 1_824_942_600_250  # first pass, CEST
    assert _parse_at("2027-03-28T02:30:00Z", berlin) == 1_806_201_000_000  # (an offset given: as it is)


def test_an_empty_replace_key_is_a_usage_error():
    result = CliRunner().invoke(cli, ["send", "t", "x", "--delay", "10s", "--replace-key", ""])
    assert result.exit_code == 2 and "--replace-key" in result.output, result.output
