"""bnexp's packing launcher (``hydra/launcher=pack``): a sweep's seeds trained as packs.

The jobs of a multirun that differ only in ``trainer.seed`` are grouped
(:func:`bnexp.app.sweep.pack_groups`), cut into packs of at most ``max_pack`` distinct seeds
(:func:`bnexp.app.sweep.distinct_packs`), and each pack trains as one packed model in this
process (:mod:`bnexp.engine.pack`). A job alone in its pack, and the jobs of a group whose
settings cannot be packed (probes, a logger, dropout: :func:`bnexp.engine.pack.unpackable`), run
one at a time as Hydra's basic launcher runs them. Every job keeps its own run directory
and ledger entry.
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any, Optional, Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from bnexp.app.sweep import distinct_packs, pack_groups
from bnexp.support.errors import ConfigError

# Hydra imports every plugin module at its first plugin lookup, in every bnexp command that
# composes a config (a shell completion, a table): the launcher imports the engine, and so
# torch, in the methods that train.
log = logging.getLogger(__name__)


class PackLauncher(BasicLauncher):
    """Hydra's basic (in-process, one job after another) launcher, packing seeds."""

    def __init__(self, max_pack: int = 10) -> None:
        super().__init__()
        if not isinstance(max_pack, int) or max_pack < 1:
            raise ConfigError(f"hydra.launcher.max_pack={max_pack!r} is not valid: use an integer >= 1")
        self.max_pack = max_pack

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        from bnexp.engine.pack import unpackable

        setup_globals()
        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        returns: list[Optional[JobReturn]] = [None] * len(job_overrides)
        for group in pack_groups(job_overrides):
            configs = [self._job_config(job_overrides[i], initial_job_idx + i) for i in group]
            reasons = unpackable(configs[0])
            if reasons:
                log.info("not packed (%s): %s", ", ".join(reasons), " ".join(job_overrides[group[0]]))
                packs = [[i] for i in range(len(group))]
            else:
                packs = distinct_packs([int(c.trainer.seed) for c in configs], self.max_pack)
            for pack in packs:
                members = [configs[i] for i in pack]
                results = self._run(members[0], None) if len(pack) == 1 else self._run_pack(members)
                for i, result in zip(pack, results):
                    returns[group[i]] = result
                configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        return [r for r in returns if r is not None]

    def _job_config(self, overrides: Sequence[str], idx: int) -> DictConfig:
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = idx
            config.hydra.job.num = idx
        return config

    def _run(self, config: DictConfig, task: Any) -> list[JobReturn]:
        return [run_job(hydra_context=self.hydra_context, task_function=task or self.task_function, config=config,
                        job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")]

    def _run_pack(self, configs: list[DictConfig]) -> list[JobReturn]:
        """One pack: the first job's Hydra run trains them all; the others get their returns."""
        from bnexp.app.jobs import train_pack_job

        jobs = [_job(config) for config in configs]
        [first] = self._run(configs[0], lambda _: train_pack_job(jobs, sweeping=True))
        if first.status != JobStatus.COMPLETED:
            return [first] + [_return(job, first.status, first._return_value) for job in jobs[1:]]
        values = first.return_value
        first.return_value = values[0]
        return [first] + [_return(job, JobStatus.COMPLETED, value) for job, value in zip(jobs[1:], values[1:])]


def _job(config: DictConfig) -> Any:
    """A sweep job's config, Hydra config and run directory, as Hydra's run_job works them out."""
    from bnexp.app.jobs import Job

    HydraConfig.instance().set_config(config)
    run_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
    with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
        config.hydra.runtime.output_dir = str(run_dir.absolute())
    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return Job(task, copy.deepcopy(config.hydra), run_dir.absolute())


def _return(job: Any, status: JobStatus, value: Any) -> JobReturn:
    return JobReturn(overrides=OmegaConf.to_container(job.hydra_cfg.overrides.task), cfg=job.cfg,
                     hydra_cfg=OmegaConf.create({"hydra": job.hydra_cfg}), working_dir=str(Path.cwd()),
                     task_name=str(job.hydra_cfg.job.name), status=status, _return_value=value)
