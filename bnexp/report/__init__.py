"""Paper reproduction on top of ``bnexp train``: presets, tables, plots, ``bnexp reproduce``.

- :mod:`~bnexp.report.presets`: ``configs/experiment`` presets, their sweeps and cost;
- :mod:`~bnexp.report.results`: summary.json / metrics.csv files into pandas;
- :mod:`~bnexp.report.layouts`: a preset's table layout, from its report block;
- :mod:`~bnexp.report.stability`: the largest-stable-lr rule (CBN Table 6);
- :mod:`~bnexp.report.table`, :mod:`~bnexp.report.plot`, :mod:`~bnexp.report.reproduce`:
  the ``bnexp table``, ``bnexp plot`` and ``bnexp reproduce`` commands.
"""
