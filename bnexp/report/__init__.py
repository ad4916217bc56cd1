"""Paper reproduction on top of ``bnexp train``: presets, tables, plots, ``bnexp reproduce``.

- :mod:`~bnexp.report.presets`: ``configs/experiment`` presets, their sweeps and cost;
- :mod:`~bnexp.report.results`: summary.json / metrics.csv files into pandas
  (:func:`load_runs`, one row per run, for scripts and notebooks);
- :mod:`~bnexp.report.layouts`: a preset's table layout, from its report block;
- :mod:`~bnexp.report.verdicts`: the tests of a cell against its published value;
- :mod:`~bnexp.report.stability`: the largest-stable-lr rule (CBN Table 6);
- :mod:`~bnexp.report.table`, :mod:`~bnexp.report.plot`, :mod:`~bnexp.report.reproduce`:
  the ``bnexp table``, ``bnexp plot`` and ``bnexp reproduce`` commands.
"""

from typing import Any


def __getattr__(name: str) -> Any:
    """``bnexp.report.load_runs``, imported on first use (importing :mod:`bnexp.report` alone
    stays free of pandas)."""
    if name == "load_runs":
        from bnexp.report.results import load_runs

        return load_runs
    raise AttributeError(f"module 'bnexp.report' has no attribute {name!r}")
