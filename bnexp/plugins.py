"""Import the modules that register training callbacks (see bnexp.callbacks.callback_factory)."""

# Probes first: in after_backward they read the raw gradients, before BNP rewrites them.
import bnexp.probes  # noqa: F401  (probes=[...], probes.csv)
import bnexp.methods  # noqa: F401  (AMAT lr, BNP, batch-renorm ramp, weights.csv)
import bnexp.loggers  # noqa: F401  (logger=tensorboard)
