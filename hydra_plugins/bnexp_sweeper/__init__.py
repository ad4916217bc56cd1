"""bnexp's Hydra sweeper plugin (``hydra/sweeper=bnexp``, the default of ``bnexp train -m``).

Hydra loads plugins only from the ``hydra_plugins`` package; which jobs a multirun makes is
:func:`bnexp.app.sweep.expand`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf

from bnexp.app.sweep import Sweep, describe_jobs, expand, plan, shape_representatives
from bnexp.support.errors import BnexpError, ConfigError
from bnexp.support.options import print_error


class BnexpSweeper(Sweeper):
    """Hydra's basic sweeper over the union of several sweeps (configs/hydra/sweeper/bnexp.yaml).

    ``report`` is not used here: it describes the preset's table for ``bnexp table``.
    ``dry_run`` prints the jobs and their run directories instead of running them.
    """

    def __init__(self, max_batch_size: Optional[int] = None, sweeps: Optional[Sequence[Sweep]] = None,
                 params: Optional[Sweep] = None, report: Optional[Mapping[str, Any]] = None,
                 dry_run: bool = False) -> None:
        super().__init__()
        self.max_batch_size = max_batch_size
        self.dry_run = dry_run
        self.sweeps = [dict(s) for s in OmegaConf.to_container(OmegaConf.create(list(sweeps or [])))]
        self.params = dict(params or {})

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        from hydra.core.plugins import Plugins

        self.hydra_context = hydra_context
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(hydra_context=hydra_context,
                                                                task_function=task_function, config=config)

    def sweep(self, arguments: list[str]) -> Any:
        parser = OverridesParser.create(config_loader=self.hydra_context.config_loader)
        try:
            jobs = expand(self.sweeps, self.params, arguments, parser)
            if not jobs:
                raise ConfigError(f"the sweeps {self.sweeps} make no job: each key of a sweep needs at least one value")
        except BnexpError as err:  # one line, not Hydra's traceback around it
            print_error(str(err))
            sys.exit(err.exit_code)
        sweep_dir = Path(self.config.hydra.sweep.dir)
        if self.dry_run:
            print(describe_jobs(jobs, sweep_dir), flush=True)
            return []
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(self.config, sweep_dir / "multirun.yaml")
        plan(len(jobs))
        size = self.max_batch_size or max(1, len(jobs))
        returns = []
        for start in range(0, len(jobs), size):
            batch = jobs[start : start + size]
            # Hydra's check composes every job, which the launcher does again; one job per
            # shape finds whether each composes (CBN's Table 1: 35 composes instead of 1,350).
            self.validate_batch_is_legal(shape_representatives(batch, parser))
            results = self.launcher.launch(batch, initial_job_idx=start)
            for result in results:
                _ = result.return_value  # raises if the job raised
            returns.append(results)
        return returns
