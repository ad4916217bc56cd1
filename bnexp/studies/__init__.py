"""Studies: commands that train sets of runs and judge or measure them (``bnexp claims``)."""
