"""bnexp's packing launchers (``hydra/launcher=pack``, ``hydra/launcher=pack_slurm``): a sweep
trained as packs, by one process or by several workers per GPU.

The jobs of a multirun that differ only in the keys a pack's runs may differ in (the seed,
rho and the learning rates: :data:`bnexp.engine.identity.PER_RUN_KEYS`; the rates only under
SGD, :func:`bnexp.engine.pack.apart`) are grouped (:func:`bnexp.app.sweep.pack_groups`) and
cut into packs of distinct runs (:func:`bnexp.app.sweep.distinct_packs`) of at most
``trainer.pack`` runs: a number, or ``auto`` (measured: :mod:`bnexp.engine.pack_size`); the
launcher's ``max_pack`` when ``trainer.pack`` is 1, its default. Each pack trains as one packed model
(:mod:`bnexp.engine.pack`). A job alone in its pack, and the jobs of a group whose settings
cannot be packed (probes, a logger, dropout: :func:`bnexp.engine.pack.unpackable`), run one
at a time as Hydra's basic launcher runs them. Every job keeps its own run directory and
ledger entry.

With one worker (``per_gpu=1`` and at most one GPU) the packs train one after another in
this process. Otherwise ``per_gpu`` workers per GPU (``per_gpu`` on a machine without one)
take the packs among them (:mod:`bnexp.app.workers`): :class:`PackLauncher` starts them as
processes here, :class:`PackSlurmLauncher` as the tasks of a SLURM job (submitit; its
``cluster=local`` runs the same tasks as processes here). A worker keeps its compiled
graphs from one pack to the next of the same shapes (:func:`bnexp.engine.pack.fit_pack`).
When every worker has ended and some packs are unfinished because a worker was killed, one
more round of workers resumes them.
"""

from __future__ import annotations

import copy
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.hydra_config import HydraConfig
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, configure_log, run_job, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from bnexp.app.compose import prepare_config_tree
from bnexp.app.sweep import distinct_packs, pack_groups, record
from bnexp.app.torchrun import die_with_parent
from bnexp.app.workers import PackClaims, bind_device, read_plan, visible_gpus, write_plan
from bnexp.engine.identity import fingerprint
from bnexp.support.errors import ConfigError

# Hydra imports every plugin module at its first plugin lookup, in every bnexp command that
# composes a config (a shell completion, a table): the launcher imports the engine, and so
# torch, in the methods that train.
log = logging.getLogger(__name__)
ROUNDS = 2  # rounds of workers: the second resumes the packs of workers that were killed


class PackLauncher(BasicLauncher):
    """Hydra's basic (in-process, one job after another) launcher, packing runs; with more
    than one worker, worker processes on this machine."""

    def __init__(self, max_pack: int = 10, per_gpu: int = 1) -> None:
        super().__init__()
        for key, value in (("max_pack", max_pack), ("per_gpu", per_gpu)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"hydra.launcher.{key}={value!r} is not valid: use an integer >= 1")
        self.max_pack = max_pack
        self.per_gpu = per_gpu
        self.auto_sizes: dict[str, int] = {}  # trainer.pack=auto, measured once per kind of run

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.hydra_context is not None and self.config is not None and self.task_function is not None
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        Path(str(self.config.hydra.sweep.dir)).mkdir(parents=True, exist_ok=True)
        configs = [self._job_config(o, initial_job_idx + i) for i, o in enumerate(job_overrides)]
        packs = self.plan(job_overrides, configs)
        gpus = visible_gpus()
        workers = self.worker_count(gpus)
        if self.in_process(workers):
            returns: list[Optional[JobReturn]] = [None] * len(configs)
            for pack in packs:
                for i, result in zip(pack, self.run_pack([configs[i] for i in pack])):
                    returns[i] = result
                configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
            return [r for r in returns if r is not None]
        folder = Path(str(self.config.hydra.sweep.dir)) / ".packs" / uuid.uuid4().hex[:12]
        write_plan(folder, [[(initial_job_idx + i, list(job_overrides[i])) for i in pack] for pack in packs])
        log.info("%d packs for %d workers (%d per GPU, %s)", len(packs), workers, self.per_gpu,
                 f"GPUs {','.join(gpus)}" if gpus else "no GPU")
        for _ in range(ROUNDS):
            killed = self.start_workers(folder, workers, gpus)
            if not killed or not PackClaims(folder).unfinished():
                break
            log.warning("a worker was killed (%s): another round resumes its packs", ", ".join(killed))
        returns = self.collect(folder, configs, initial_job_idx)
        if not PackClaims(folder).unfinished():
            shutil.rmtree(folder, ignore_errors=True)
        return returns

    def plan(self, job_overrides: Sequence[Sequence[str]], configs: list[DictConfig]) -> list[list[int]]:
        """The sweep's packs (positions of its jobs); a job that cannot be packed alone."""
        from bnexp.engine.pack import apart, per_run_values, unpackable

        packs = []
        for group in pack_groups(job_overrides, apart=[apart(c) for c in configs]):
            reasons = unpackable(configs[group[0]])
            if reasons:
                log.info("not packed (%s): %s", ", ".join(reasons), " ".join(job_overrides[group[0]]))
                packs += [[i] for i in group]
                continue
            size = self.pack_size(configs[group[0]], len(group))
            runs = [per_run_values(configs[i]) for i in group]
            packs += [[group[i] for i in pack] for pack in distinct_packs(runs, size)]
        return packs

    def pack_size(self, config: DictConfig, runs: int) -> int:
        """The largest pack for the group of ``config``: ``trainer.pack`` (``auto``: measured
        once per kind of run, for the ``per_gpu`` workers that share a device), or ``max_pack``
        when it is 1."""
        pack = config.trainer.get("pack", 1)
        if pack != "auto":
            return self.max_pack if pack == 1 else int(pack)
        from bnexp.engine.identity import shared_settings
        from bnexp.engine.pack_size import measured_pack

        kind = fingerprint(shared_settings(task_config(config)))
        if kind not in self.auto_sizes:
            self.auto_sizes[kind], line = measured_pack(config, self.per_gpu)
            print(f"bnexp: {line}", flush=True)
        return min(self.auto_sizes[kind], runs)

    def worker_count(self, gpus: list[str]) -> int:
        """``per_gpu`` workers per GPU of ``gpus`` (``per_gpu`` without one)."""
        return self.per_gpu * max(1, len(gpus))

    def in_process(self, workers: int) -> bool:
        """Whether this process trains the packs itself (one worker)."""
        return workers == 1

    def _job_config(self, overrides: Sequence[str], idx: int) -> DictConfig:
        config = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
        with open_dict(config):
            config.hydra.job.id = idx
            config.hydra.job.num = idx
        return config

    def _run(self, config: DictConfig, task: Any) -> list[JobReturn]:
        return [run_job(hydra_context=self.hydra_context, task_function=task or self.task_function, config=config,
                        job_dir_key="hydra.sweep.dir", job_subdir_key="hydra.sweep.subdir")]

    def run_pack(self, configs: list[DictConfig]) -> list[JobReturn]:
        """One pack: a job alone as Hydra runs it; otherwise the first job's Hydra run trains
        them all and the others get their returns."""
        if len(configs) == 1:
            return self._run(configs[0], None)
        from bnexp.app.jobs import train_pack_job

        jobs = [_job(config) for config in configs]
        [first] = self._run(configs[0], lambda _: train_pack_job(jobs, sweeping=True))
        if first.status != JobStatus.COMPLETED:
            return [first] + [_return(job, first.status, first._return_value) for job in jobs[1:]]
        values = first.return_value
        first.return_value = values[0]
        return [first] + [_return(job, JobStatus.COMPLETED, value) for job, value in zip(jobs[1:], values[1:])]

    def start_workers(self, folder: Path, workers: int, gpus: list[str]) -> list[str]:
        """One round: ``workers`` processes here, each taking packs until none is left. Returns
        how the killed ones ended; a worker stopped by a signal it handled (preemption, Ctrl-C:
        its runs checkpointed) ends this process with its exit code, once all have ended."""
        from bnexp.engine.preemption import PreemptionGuard

        context = multiprocessing.get_context("spawn")
        state = hydra_state()
        procs = [context.Process(target=work, args=(self, folder, slot, workers, gpus, os.getpid(), state),
                                 name=f"bnexp-worker-{slot}") for slot in range(workers)]
        for proc in procs:
            proc.start()

        def forward(signum: int) -> None:  # Ctrl-C reaches the workers from the terminal itself
            for proc in procs:
                if signum != signal.SIGINT and proc.pid is not None:
                    os.kill(proc.pid, signal.SIGTERM)

        with PreemptionGuard(on_signal=forward):
            running = list(procs)
            while running:  # reaped as each ends: a killed worker is gone for the run locks it held
                multiprocessing.connection.wait([p.sentinel for p in running])
                for proc in [p for p in running if not p.is_alive()]:
                    proc.join()
                    running.remove(proc)
        return ended(procs)

    def collect(self, folder: Path, configs: list[DictConfig], initial_job_idx: int) -> list[JobReturn]:
        """Every job's return from the workers' outcomes; a job whose pack no worker finished
        is recorded as failed in the sweep's ledger."""
        claims = PackClaims(folder)
        done = {i: (status, value) for pack in range(claims.count) for i, status, value in claims.outcome(pack) or []}
        returns = []
        for idx, config in enumerate(configs, start=initial_job_idx):
            job = _job(config)
            if idx not in done:
                record(job.run_dir, "failed", "the workers that took its pack were killed; re-run to resume it")
            status, value = done.get(idx, ("COMPLETED", math.nan))
            returns.append(_return(job, JobStatus[status], value))
        return returns


def ended(procs: Sequence[Any]) -> list[str]:
    """The killed workers of ``procs`` (all ended), as ``name: signal``; a worker that ended
    with an exit code of a stop (preemption 75, Ctrl-C 130) or an error ends this process so."""
    codes = [p.exitcode for p in procs if p.exitcode]
    stops = [c for c in codes if c > 0]
    if stops:
        sys.exit(max(stops))
    return [f"{p.name}: {signal.Signals(-p.exitcode).name}" for p in procs if p.exitcode and p.exitcode < 0]


def hydra_state() -> Any:
    """Hydra's singletons (its config, the plugins, the job's runtime) for a worker. The
    OmegaConf resolvers are left out (closures do not pickle): a worker registers Hydra's and
    bnexp's own again (:func:`work`)."""
    return Singleton.get_state()["instances"]


def work(launcher: PackLauncher, folder: Path, slot: int, workers: int, gpus: list[str], parent: int | None,
         state: Any) -> None:
    """A worker: bind a device, then train the plan's packs until none is left, writing each
    pack's outcome. Started as a process (``parent``: the launcher, which it does not outlive)
    or as a SLURM task (``parent`` None)."""
    if parent is not None:
        die_with_parent(parent)
    where = bind_device(slot, launcher.per_gpu, gpus, workers)
    Singleton._instances = state  # Singleton.set_state would also drop OmegaConf's own resolvers
    setup_globals()
    prepare_config_tree()
    configure_log(launcher.config.hydra.hydra_logging, launcher.config.hydra.verbose)
    plan = read_plan(folder)
    claims = PackClaims(folder)
    for pack in claims.take():
        log.info("worker %d (%s): pack %d of %d, %d runs", slot, where, pack + 1, len(plan), len(plan[pack]))
        configs = [launcher._job_config(overrides, idx) for idx, overrides in plan[pack]]
        results = launcher.run_pack(configs)
        claims.finish(pack, [(idx, r.status.name, _value(r)) for (idx, _), r in zip(plan[pack], results)])


def _value(result: JobReturn) -> Any:
    """A job's return value as JSON holds it (NaN as null): a number, or the error's text."""
    value = result._return_value
    if isinstance(value, BaseException):
        return f"{type(value).__name__}: {value}"
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _job(config: DictConfig) -> Any:
    """A sweep job's config, Hydra config and run directory, as Hydra's run_job works them out."""
    from bnexp.app.jobs import Job

    HydraConfig.instance().set_config(config)
    run_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
    with read_write(config.hydra.runtime), open_dict(config.hydra.runtime):
        config.hydra.runtime.output_dir = str(run_dir.absolute())
    return Job(task_config(config), copy.deepcopy(config.hydra), run_dir.absolute())


def task_config(config: DictConfig) -> DictConfig:
    """A sweep job's config without its ``hydra`` node: what its run trains with."""
    task = copy.deepcopy(config)
    with read_write(task), open_dict(task):
        del task["hydra"]
    return task


def _return(job: Any, status: JobStatus, value: Any) -> JobReturn:
    if status == JobStatus.FAILED and not isinstance(value, BaseException):
        value = RuntimeError(str(value))
    return JobReturn(overrides=OmegaConf.to_container(job.hydra_cfg.overrides.task), cfg=job.cfg,
                     hydra_cfg=OmegaConf.create({"hydra": job.hydra_cfg}), working_dir=str(Path.cwd()),
                     task_name=str(job.hydra_cfg.job.name), status=status,
                     _return_value=math.nan if value is None else value)


class PackSlurmLauncher(PackLauncher):
    """The packing launcher whose workers are the tasks of a SLURM job, submitted with
    submitit (``pip install 'bnexp[slurm]'``): ``nodes`` x ``gpus_per_node`` x ``per_gpu``
    tasks (``per_gpu`` per node without GPUs). ``cluster=local`` runs the same tasks as
    processes on this machine (submitit's local executor). The job is requeued when SLURM
    preempts it or its time runs out; its tasks then go on with the packs left."""

    def __init__(self, max_pack: int = 10, per_gpu: int = 1, cluster: str = "slurm", nodes: int = 1,
                 gpus_per_node: int = 1, timeout_min: int = 4320, partition: Optional[str] = None,
                 cpus_per_task: Optional[int] = None, mem_gb: Optional[int] = None,
                 additional_parameters: Optional[Mapping[str, Any]] = None) -> None:
        super().__init__(max_pack, per_gpu)
        if cluster not in ("slurm", "local"):
            raise ConfigError(f"hydra.launcher.cluster={cluster!r} is not valid: use slurm or local")
        self.cluster, self.nodes, self.gpus_per_node = cluster, nodes, gpus_per_node
        self.submitit = {"timeout_min": timeout_min, "slurm_partition": partition, "cpus_per_task": cpus_per_task,
                         "mem_gb": mem_gb, "slurm_additional_parameters": dict(additional_parameters or {})}

    def start_workers(self, folder: Path, workers: int, gpus: list[str]) -> list[str]:
        """One round: one job of ``nodes`` x ``tasks`` SLURM tasks; returns the tasks that failed."""
        try:
            import submitit
        except ImportError as err:
            raise ConfigError("hydra/launcher=pack_slurm needs submitit: pip install 'bnexp[slurm]'") from err
        tasks = self.per_gpu * max(1, self.gpus_per_node)
        executor = submitit.AutoExecutor(folder=folder / "submitit" / "%j", cluster=self.cluster)
        params = {k: v for k, v in self.submitit.items() if v} if self.cluster == "slurm" else {
            "timeout_min": self.submitit["timeout_min"]}
        executor.update_parameters(nodes=self.nodes, tasks_per_node=tasks, gpus_per_node=self.gpus_per_node,
                                   name="bnexp-packs", **params)
        node_gpus = [str(i) for i in range(self.gpus_per_node)]
        job = executor.submit(SlurmWorker(self, folder, tasks, node_gpus, hydra_state()))
        log.info("SLURM job %s: %d tasks for %d packs", job.job_id, tasks * self.nodes, PackClaims(folder).count)
        try:
            job.results()
        except Exception as err:  # submitit's UncompletedJobError / FailedJobError: a task died or was killed
            return [f"SLURM job {job.job_id}: {str(err).splitlines()[0] if str(err) else type(err).__name__}"]
        return []

    def worker_count(self, gpus: list[str]) -> int:
        return self.nodes * self.per_gpu * max(1, self.gpus_per_node)

    def in_process(self, workers: int) -> bool:
        return False

    def pack_size(self, config: DictConfig, runs: int) -> int:
        if config.trainer.get("pack", 1) == "auto":
            raise ConfigError("trainer.pack=auto measures the device of the process that launches; with "
                              "hydra/launcher=pack_slurm give the pack size (trainer.pack=K)")
        return super().pack_size(config, runs)


class SlurmWorker:
    """One SLURM task of a :class:`PackSlurmLauncher` job: a worker (:func:`work`) whose slot
    is the task's rank on its node. submitit requeues the job when it is preempted or timed out
    (:meth:`checkpoint`); the runs in training have checkpointed by then (bnexp's signal
    handling runs first), and the requeued tasks take the packs left."""

    def __init__(self, launcher: PackSlurmLauncher, folder: Path, workers: int, gpus: list[str], state: Any) -> None:
        self.launcher, self.folder, self.workers, self.gpus, self.state = launcher, folder, workers, gpus, state

    def __call__(self) -> int:
        import submitit

        env = submitit.JobEnvironment()
        gpus = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(self.gpus))
        work(self.launcher, self.folder, env.local_rank, self.workers, [g for g in gpus.split(",") if g], None,
             self.state)
        return env.global_rank

    def checkpoint(self, *args: Any, **kwargs: Any) -> Any:
        import submitit

        return submitit.helpers.DelayedSubmission(self)
