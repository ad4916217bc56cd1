"""Paper reproduction on top of ``bnexp train``: presets, tables, plots, ``bnexp reproduce``.

- :mod:`~bnexp.report.reference`: the published numbers and the BNP learning-rate table;
- :mod:`~bnexp.report.presets`: ``configs/experiment`` presets, their run plans and cost;
- :mod:`~bnexp.report.results`: summary.json / metrics.csv files into pandas;
- :mod:`~bnexp.report.layouts`: each preset's table layout;
- :mod:`~bnexp.report.table`, :mod:`~bnexp.report.plot`, :mod:`~bnexp.report.reproduce`:
  the ``bnexp table``, ``bnexp plot`` and ``bnexp reproduce`` commands.
"""
