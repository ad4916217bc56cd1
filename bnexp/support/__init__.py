"""Support code: errors, the name registry, option parsing, torch.distributed helpers and run-directory bookkeeping."""
