"""bnexp's Hydra sweeper plugin (``hydra/sweeper=bnexp``, the default of ``bnexp train -m``).

Hydra loads plugins only from the ``hydra_plugins`` package; which jobs a multirun makes is
:func:`bnexp.app.sweep.expand`.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from hydra.core.hydra_config import HydraConfig
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from omegaconf import DictConfig, OmegaConf, read_write

from bnexp.app.cells import place, start_list, will_list
from bnexp.app.sweep import Sweep, describe_jobs, expand, plan, shape_representatives
from bnexp.engine.identity import run_name
from bnexp.support.errors import BnexpError, ConfigError
from bnexp.support.options import print_error


class BnexpSweeper(Sweeper):
    """Hydra's basic sweeper over the union of several sweeps (configs/hydra/sweeper/bnexp.yaml).

    ``report`` is not used here: it describes the preset's table for ``bnexp table``.
    ``dry_run`` prints the jobs, their run directories and what the sweep would do with
    each instead of running them. A sweep folder named after the command line lists its
    cells, which train where single runs do (:mod:`bnexp.app.cells`).
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
        listing = will_list(sweep_dir, run_name(self.config.hydra.overrides.task))
        if self.dry_run:
            places = [place(sweep_dir, self.run_dir(job), job, listing) for job in jobs]
            fresh = str(self.config.trainer.get("resume", "auto")) == "never"
            print(describe_jobs(jobs, sweep_dir, places, self.job_settings if listing else None, fresh), flush=True)
            return []
        if listing:
            start_list(sweep_dir)
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

    def run_dir(self, job: Sequence[str]) -> Path:
        """Where ``bnexp train <job>`` trains (``hydra.run.dir`` with the job's overrides)."""
        hydra_node = HydraConfig.get()
        sweep_task = hydra_node.overrides.task
        with read_write(hydra_node):
            hydra_node.overrides.task = list(job)
            try:
                return Path(str(hydra_node.run.dir))
            finally:
                hydra_node.overrides.task = sweep_task

    def job_settings(self, job: Sequence[str]) -> DictConfig:
        """A job's config as its run gets it (for ``--dry-run``'s search of finished runs)."""
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(job))
        HydraConfig.instance().set_config(config)  # the job's ${hydra:...}, as it runs
        try:
            task = {k: v for k, v in OmegaConf.to_container(config).items() if k != "hydra"}
            return OmegaConf.create(OmegaConf.to_container(OmegaConf.create(task), resolve=True))
        finally:
            HydraConfig.instance().set_config(self.config)
