"""Click parameter types that every command line shares."""
from __future__ import annotations

import math
from typing import Any

import click


class FiniteFloat(click.FloatRange):
    """A float option that refuses ``nan`` and ``inf`` as well as values outside its bounds.

    WHY: click's ``FloatRange`` lets ``nan`` through every bound (``nan < 0`` is false), and a float option
    without a range takes ``inf`` too.  A NaN learning rate or noise trains for the whole budget and writes a
    draft of NaNs; a NaN sampling temperature fails in the middle of a corpus run; an infinite queue timeout
    never answers.  Refused here, they are a usage error before anything loads.

    >>> FiniteFloat(0).convert("nan", None, None)
    Traceback (most recent call last):
    click.exceptions.BadParameter: 'nan' is not a finite number.
    """

    name = "finite float"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return number
