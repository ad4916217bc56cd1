"""The ``bnexp train`` Hydra application and the sweep machinery around it."""
