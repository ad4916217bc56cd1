"""Studies: commands that train sets of runs and measure or judge them.

- :mod:`~bnexp.studies.lrsearch`: ``bnexp lrsearch``, the largest stable lr (CBN Table 6);
- :mod:`~bnexp.studies.hessian`: ``bnexp hessian``, Hessian condition numbers (BNP Fig. 8);
- :mod:`~bnexp.studies.claims`: ``bnexp claims``, the papers' claims on real digits;
- :mod:`~bnexp.studies.runs`: composing and training (or reusing) one run of a study.

They share the stability rule of :mod:`bnexp.report.stability`.
"""
