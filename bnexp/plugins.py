"""Import the modules that register training callbacks (see bnexp.callbacks.callback_factory)."""
