"""The property tests' time budget: each property explores as many cases as fit in its
share of the suite's time, rather than the suite dropping properties to stay fast.

A property's budget is about 5 s of one core per suite run (the suite's promise is
10 minutes for ``python -m pytest -n 2`` on 2 cores), turned into a number of cases
by measuring the property on the project's machine: a fixed count, so a derandomized
run (CI, tests/conftest.py) takes the same cases every time. A developer run draws
new cases each time, so the cases explored add up over runs. No deadline is set: a
slow case on a loaded machine is not a failure.

``PROPERTY_EXAMPLES_SCALE=N`` takes N times as many cases, for a thorough run by hand
or on a schedule.
"""

from __future__ import annotations

import os

from hypothesis import settings

SCALE_VARIABLE = "PROPERTY_EXAMPLES_SCALE"


def budget(examples: int, **options) -> settings:
    """Settings for a property that takes ``examples`` cases in its budget (times the
    scale); ``options`` are any other settings it needs."""
    scale = float(os.environ.get(SCALE_VARIABLE, "1") or "1")
    return settings(
        max_examples=max(1, round(examples * scale)), deadline=None, database=None, **options
    )
