"""Import the modules that register training callbacks (see bnexp.callbacks.callback_factory)."""

import bnexp.methods  # noqa: F401  (AMAT lr, BNP, batch-renorm ramp, weights.csv)
import bnexp.loggers  # noqa: F401  (logger=tensorboard)
