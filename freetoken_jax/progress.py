"""Progress bars for the waits a person sees (loading, converting, benchmark rows): tqdm on
stderr, shown only on a terminal."""

from __future__ import annotations

import sys


def progress(total: int, desc: str, unit: str = "B"):
    """A bar of `total` units (bytes by default, shown with SI prefixes and a rate)."""
    from tqdm import tqdm

    return tqdm(total=total, unit=unit, unit_scale=unit == "B", desc=desc, disable=None, file=sys.stderr, leave=False)
