"""The planner's progress bar: ``make_plan(..., progress="bar")`` (the command line's default) shows a tqdm bar on
stderr over the combinations, each finished one counted, the last one's label beside it. Off when stderr is not a
terminal (tqdm's ``disable=None``), so logs and captured output stay clean."""
from __future__ import annotations

import sys

__all__ = ["Bar"]


class Bar:
    """A progress callback (``bar(row)``) with a total that can shrink once known (``set_total``); ``close()``."""

    def __init__(self, total: int):
        from tqdm import tqdm

        class _NoMonitor(tqdm):
            monitor_interval = 0  # no monitor thread: the planner may fork its workers after the bar appears

        self._bar = _NoMonitor(total=total, desc="plan", unit="comb", file=sys.stderr, disable=None,
                               dynamic_ncols=True)

    def __call__(self, row: dict) -> None:
        self._bar.set_postfix_str(row.get("label", "")[:48], refresh=False)
        self._bar.update(1)

    def set_total(self, total: int) -> None:
        self._bar.total = total
        self._bar.refresh()

    def close(self) -> None:
        self._bar.close()
