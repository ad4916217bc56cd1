"""Probes: measurements taken during any run, written to ``<run dir>/probes.csv``.

``probes=[grad_norm,grad_var,eta_tau,weights,time,loss,hessian]`` turns them on and
``probe.<name>.<setting>=...`` tunes them (``configs/probe/default.yaml``); none of them
changes the training trajectory. ``docs/instruments/`` describes each one. The study
commands ``bnexp lrsearch`` and ``bnexp hessian`` and the probe plots build on them.
"""

from bnexp.probes import eta_tau, gradients, hessian, loss, timing, weights  # noqa: F401  (register the probes: amat and eta_tau live in eta_tau)
from bnexp.probes.callback import ALL, COLUMNS, PROBES, PROBES_FILE, enable_probe, read_probes

__all__ = ["ALL", "COLUMNS", "PROBES", "PROBES_FILE", "enable_probe", "read_probes"]
