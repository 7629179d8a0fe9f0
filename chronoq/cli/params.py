"""Option types shared by the CLI's commands."""

from __future__ import annotations

import math

import click

# Epoch milliseconds of 9999-12-31T23:59:59.999Z: the last instant a date can show.
MAX_EPOCH_MS = 253_402_300_799_999


class Seconds(click.FloatRange):
    """A number of seconds within bounds: click's FloatRange, which lets ``nan`` through (it
    compares false with every bound) and ``inf`` when no maximum is set; both are refused here,
    with the usage error (exit 2) rather than a traceback further on."""

    name = "seconds"

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number of seconds", param, ctx)
        return number
