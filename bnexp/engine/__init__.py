"""The training engine: one run (or a pack of K seeds) from a composed config to its run directory."""
