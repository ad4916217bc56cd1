"""Packed runs (``trainer.pack``): the seeds of one cell trained together as one model.

K runs whose configs differ only in ``trainer.seed`` are trained in one process as one
packed model (:mod:`bnexp.models.packing`): run ``k`` keeps its own initial weights (its
model is built right after seeding, as alone), its own batches (its own sampler stream and
augmentation draws: its global random state is swapped in around its batches) and its own
mean loss; the loss differentiated is the sum of the runs' losses, so each run's gradient
is its own, and SGD, weight decay, the schedule and AMAT's learning rate act per element.

Each run writes its own directory as a run trained alone does (``config.yaml``,
``metrics.csv``, ``weights.csv``, ``summary.json`` with ``packed_with``, periodic
checkpoints and ``checkpoint.pt`` holding that run's state only), so reports, ``bnexp
table`` and a plain ``bnexp train`` of one of the runs see no difference. A pack resumes
from its runs' periodic checkpoints at the newest step all of them hold. A run whose
training loss turns non-finite is marked ``diverged`` where a run alone would be (at the
next finite-loss check) and frozen: its loss leaves the sum, and its parameters and
momentum are zeroed and kept at zero while the others go on. A pack resumed after one of
its runs diverged keeps that run, frozen, in its slot (it writes nothing more): the packed
model keeps its shapes, so the others' float rounding, and so their results, are those of
the pack never interrupted.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn
from tqdm import tqdm

from bnexp.data import build_data, data_identity
from bnexp.data.loaders import build_loaders, drop_last
from bnexp.engine import checkpoint
from bnexp.engine.accel import Accelerated
from bnexp.engine.callbacks import Callback, TrainState
from bnexp.engine.config import validate
from bnexp.engine.identity import differences, fingerprint, run_differences
from bnexp.engine.method_hooks import WeightNormLog, method_callbacks
from bnexp.engine.optim import build_optimizer, build_schedule, to_steps
from bnexp.engine.preemption import Preempted, PreemptionGuard
from bnexp.engine.trainer import (
    CheckpointClock,
    TrainMeter,
    callback_key,
    check_batch_size,
    check_last_batch,
    checkpoint_or_stop,
    end_step,
    eval_row,
    evaluate,
    record_eval,
    stop_if_signalled,
    total_steps,
    train_step,
)
from bnexp.models import build_model, count_parameters
from bnexp.models.packing import pack_inputs, pack_models, pack_state, packed_losses, unpack_state
from bnexp.nn.create_norm import uses_batch_statistics
from bnexp.support.distributed import Dist
from bnexp.support.errors import ConfigError, OtherRunThere
from bnexp.support.runinfo import (
    MetricsWriter,
    RunLogFile,
    configure_backends,
    resolve_device,
    seed_everything,
    version_stamp,
    write_json,
)

log = logging.getLogger("bnexp.engine.pack")

PACK_KEY = "trainer.pack"


@dataclass
class Member:
    """One run of a pack: its settings, directory, summary and what it writes."""

    index: int
    cfg: DictConfig
    run_dir: Path
    summary: dict[str, Any]
    metrics: MetricsWriter = field(init=False)
    weights_log: WeightNormLog = field(init=False)
    rng: dict[str, Any] = field(default_factory=dict)  # its global random state between its batches
    stream: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None
    status: str = "running"
    frozen: bool = False  # diverged before this process: holds its slot in the pack, writes nothing

    def __post_init__(self) -> None:
        self.metrics = MetricsWriter(self.run_dir / "metrics.csv", enabled=not self.frozen)
        if self.frozen:
            self.status = "diverged"

    def next_batch(self, swap_rng: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """This run's next training batch, drawn under its own random state when the loader
        draws augmentation from the global generators (the DataLoader path)."""
        assert self.stream is not None
        if not swap_rng:
            return next(self.stream)
        outside = checkpoint.capture_rng()
        checkpoint.restore_rng(self.rng)
        try:
            return next(self.stream)
        finally:
            self.rng = checkpoint.capture_rng()
            checkpoint.restore_rng(outside)


def unpackable(cfg: DictConfig) -> list[str]:
    """The settings of ``cfg`` that keep its runs from training as a pack: a pack is one
    process whose probes, logger, fp16 loss scale and resume file its runs would share, and
    random dropout / stochastic-depth masks cannot be drawn per run as alone."""
    unsupported = {
        "trainer.nproc>1": int(cfg.trainer.nproc) > 1,
        "probes": bool(cfg.get("probes")),
        f"logger={cfg.logger.get('name', 'none')}": cfg.logger.get("name", "none") != "none",
        "trainer.amp=fp16": str(cfg.trainer.get("amp")) == "fp16",
        "trainer.resume=<file>": str(cfg.trainer.resume) not in ("auto", "never"),
        "model.dropout": bool(cfg.model.get("dropout")),
        "model.stochastic_depth": bool(cfg.model.get("stochastic_depth")),
        "trainer.init_from": bool(cfg.trainer.get("init_from")),
    }
    return [key for key, on in unsupported.items() if on]


def check_pack(cfgs: Sequence[DictConfig]) -> None:
    """A ConfigError unless ``cfgs`` can train as one pack: the same settings but the seed,
    distinct seeds, and nothing :func:`unpackable`."""
    first = cfgs[0]
    seeds = [int(c.trainer.seed) for c in cfgs]
    if len(set(seeds)) != len(seeds):
        raise ConfigError(f"{PACK_KEY}: the runs of a pack need distinct trainer.seed values, got {seeds}")
    common = OmegaConf.to_container(first, resolve=True)
    for cfg in cfgs[1:]:
        other = OmegaConf.to_container(cfg, resolve=True)
        other["trainer"]["seed"] = first.trainer.seed
        if fingerprint(other) != fingerprint(common):
            raise ConfigError(f"{PACK_KEY}: the runs of a pack may differ in trainer.seed only; "
                              f"{differences(common, other)}")
    chosen = unpackable(first)
    if chosen:
        raise ConfigError(f"runs cannot train as a pack with {', '.join(chosen)} (a pack is one process whose probes, "
                          "logger, fp16 loss scale and resume file its runs would share, and it cannot draw dropout "
                          "masks per run): train them one at a time (trainer.pack=1, or another hydra/launcher)")


def seeded_models(cfgs: Sequence[DictConfig], spec: Any, device: torch.device) -> tuple[list[nn.Module], list[dict]]:
    """Each run's model, initialized as the run alone initializes it (seeded first), and
    each run's random state right after (from which its augmentation draws)."""
    models, states = [], []
    for cfg in cfgs:
        seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
        models.append(build_model(cfg.model, cfg.norm, cfg.act.name, spec).to(device))
        states.append(checkpoint.capture_rng())
    return models, states


class FreezeDiverged(Callback):
    """Last of the step's hooks: zeroes the gradients of the frozen (diverged) runs, whose
    parameters and momentum :meth:`freeze` zeroed, so SGD keeps them at zero."""

    def __init__(self, runs: int) -> None:
        self.runs = runs
        self.frozen: list[int] = []

    def freeze(self, state: TrainState, run: int) -> None:
        self.frozen.append(run)
        with torch.no_grad():
            for p in state.model.parameters():  # chunks along dim 0: any memory layout (channels_last)
                p.chunk(self.runs)[run].zero_()
                momentum = state.optimizer.state.get(p, {}).get("momentum_buffer")
                if momentum is not None:
                    momentum.chunk(self.runs)[run].zero_()

    def after_backward(self, state: TrainState) -> None:
        if not self.frozen:
            return
        with torch.no_grad():
            for p in state.model.parameters():
                if p.grad is not None:
                    parts = p.grad.chunk(self.runs)
                    for run in self.frozen:
                        parts[run].zero_()


class Pack:
    """The shared training state of a pack and its members' outputs."""

    def __init__(self, members: list[Member], state: TrainState, net: Accelerated, shared: list[Callback],
                 freezer: FreezeDiverged, test: Any, num_classes: int) -> None:
        self.members = members
        self.test, self.num_classes = test, num_classes  # the test batches every run is evaluated on
        self.state = state
        self.net = net
        self.shared = shared  # the methods' hooks (AMAT lr, BNP), one for all runs
        self.freezer = freezer
        self.callbacks = [*shared, *(m.weights_log for m in members), freezer]
        self.meter = TrainMeter(state.device, len(members))
        self.alive = torch.ones(len(members), dtype=torch.bool, device=state.device)
        self.elapsed_before = 0.0
        self.started = time.perf_counter()

    @property
    def runs(self) -> int:
        return len(self.members)

    def seconds(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def criterion(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Each run's mean loss, frozen runs' replaced by 0 (their NaN never enters a sum)."""
        return torch.where(self.alive, packed_losses(logits, y), 0.0)

    def run_callbacks(self, member: Member) -> list[Callback]:
        """The callbacks of ``member`` in the order a run alone lists them (for its checkpoint)."""
        return [*self.shared, member.weights_log]

    def payloads(self) -> list[dict[str, Any]]:
        """Each run's checkpoint, the payload of that run trained alone."""
        s = self.state
        models = unpack_state(s.model.state_dict(), self.runs)
        optimizers = unpack_state(s.optimizer.state_dict(), self.runs)
        shared = [unpack_state(cb.state_dict(), self.runs) for cb in self.shared]
        meter = self.meter.state().cpu()
        out = []
        for m in self.members:
            callbacks = [state[m.index] for state in shared] + [m.weights_log.state_dict()]
            names = [callback_key(i, cb) for i, cb in enumerate(self.run_callbacks(m))]
            out.append({
                "model": models[m.index], "optimizer": optimizers[m.index], "scheduler": s.scheduler.state_dict(),
                "step": s.step, "scaler": self.net.scaler.state_dict(), "rng": [m.rng],
                "meter": meter[m.index: m.index + 1].clone(), "metrics": m.metrics.rows,
                "callbacks": dict(zip(names, callbacks)), "seconds": self.seconds(),
                "config": OmegaConf.to_container(m.cfg, resolve=True), "data_files": m.summary.get("data_files", {}),
            })
        return out

    def restore(self, payloads: list[dict[str, Any]]) -> None:
        s = self.state
        s.model.load_state_dict(pack_state([p["model"] for p in payloads]))
        s.optimizer.load_state_dict(pack_state([p["optimizer"] for p in payloads]))
        s.scheduler.load_state_dict(payloads[0]["scheduler"])
        s.step = payloads[0]["step"]
        self.meter.load(torch.cat([p["meter"].view(1, 3) for p in payloads]))
        for i, cb in enumerate(self.shared):
            cb.load_state_dict(pack_state([p["callbacks"].get(callback_key(i, cb), {}) for p in payloads]))
        for m, p in zip(self.members, payloads):
            m.rng = p["rng"][0]
            if m.frozen:
                continue
            m.metrics.restore(p["metrics"])
            for row in p["metrics"]:
                record_eval(m.summary, row)
            m.weights_log.load_state_dict(p["callbacks"].get(callback_key(len(self.shared), m.weights_log), {}))
        self.elapsed_before = payloads[0]["seconds"]
        self.started = time.perf_counter()

    def resume(self, mode: str) -> None:
        """``auto``: the newest periodic checkpoint step that every run holds, if any, written
        with these settings; ``never``: start over. Frozen runs (:attr:`Member.frozen`) take
        no part: their slots are filled with another run's state, then zeroed."""
        if mode == "never":
            return
        live = [m for m in self.members if not m.frozen]
        found = common_checkpoints([m.run_dir for m in live])
        start = 0 if found is None else checkpoint_step(found[0][0])
        for m in live:  # checkpoints past the pack's starting step would outlive the ones it writes
            for path in checkpoint.periodic_checkpoints(m.run_dir):
                if checkpoint_step(path) > start:
                    log.warning("%s: not resumed from (the pack's other runs hold no checkpoint of step %d); "
                                "removed", path, checkpoint_step(path))
                    path.unlink(missing_ok=True)
                    checkpoint.checksum_path(path).unlink(missing_ok=True)
        if found is None:
            return
        for m, (path, payload) in zip(live, found):
            change = run_differences(payload.get("config", {}), m.cfg, payload.get("data_files"))
            if change:
                raise OtherRunThere(f"{path} was written by a run with other settings ({change}): run with "
                                    "trainer.resume=never to start over in this directory, or use another one")
            m.summary["resumed_from"] = str(path)
        payloads = iter(payload for _, payload in found)
        self.restore([found[0][1] if m.frozen else next(payloads) for m in self.members])
        log.info("pack of %d resumed at step %d", self.runs, self.state.step)

    def save_periodic(self) -> None:
        """Every live run's periodic checkpoint (a failure is logged, training goes on)."""
        for m, payload in zip(self.members, self.payloads()):  # diverged runs keep their last ones
            if m.status == "running" and save(m, payload, checkpoint.periodic_path(m.run_dir, self.state.step)):
                checkpoint.prune(m.run_dir, int(m.cfg.trainer.keep_checkpoints))

    def evaluate(self, lr: float, only: Member | None = None) -> None:
        """Each running run's evaluation row (only ``only``'s, without resetting the others'
        training sums, for a run that diverged before its first evaluation)."""
        train = self.meter.read_runs()
        if only is None:
            self.meter.reset()
        s = self.state
        tests = evaluate(self.net, self.test, s.device, self.num_classes, self.runs)
        for m, run_train, test in zip(self.members, train, tests):
            if m is not only and (only is not None or m.status != "running"):
                continue
            row = eval_row(s, lr, run_train, test, self.seconds())
            m.metrics.write(row)
            record_eval(m.summary, row)
            m.weights_log.on_eval(s, row)

    def check_losses(self, lr: float) -> list[float]:
        """Mark and freeze the runs whose training loss since the last check is not finite;
        one that has no evaluation yet gets one first, as a run alone does when it stops.
        Returns each run's mean training loss since the last evaluation."""
        losses = [loss for loss, _ in self.meter.read_runs()]
        for m, loss in zip(self.members, losses):
            if m.status == "running" and not math.isfinite(loss):
                if not m.metrics.rows:
                    self.evaluate(lr, only=m)
                m.status = "diverged"
                m.summary.update(status="diverged", steps=self.state.step, epochs=round(self.state.epoch, 4))
                write_json(m.run_dir / "summary.json", m.summary)  # final now (rewritten with the wall time at the end)
                log.warning("%s: non-finite training loss at step %d: run frozen (status diverged), the other "
                            "runs of its pack go on", m.run_dir, self.state.step)
                self.freeze(m)
        return losses

    def freeze(self, member: Member) -> None:
        """Take a diverged run out of training: zeroed, its loss out of the sum."""
        self.freezer.freeze(self.state, member.index)
        self.alive[member.index] = False


def save(member: Member, payload: dict[str, Any], path: Path) -> bool:
    """Write one run's checkpoint; a failure is logged and noted in its summary."""
    try:
        checkpoint.save(payload, path)
    except (OSError, RuntimeError) as err:
        log.error("checkpoint %s could not be written (%s: %s); training goes on", path, type(err).__name__, err)
        member.summary.setdefault("checkpoint_errors", []).append(
            f"step {payload['step']}, {path.name}: {type(err).__name__}: {err}")
        return False
    return True


def checkpoint_step(path: Path) -> int:
    """The step of a periodic checkpoint, from its name (``step-000000040.pt``)."""
    return int(path.stem.split("-")[1])


def common_checkpoints(run_dirs: Sequence[Path]) -> list[tuple[Path, dict[str, Any]]] | None:
    """Each run's periodic checkpoint at the newest step for which all of them load, or None."""
    names = [{p.name for p in checkpoint.periodic_checkpoints(d)} for d in run_dirs]
    for name in sorted(set.intersection(*names), reverse=True):
        try:
            return [(d / checkpoint.CHECKPOINT_DIR / name, checkpoint.load(d / checkpoint.CHECKPOINT_DIR / name))
                    for d in run_dirs]
        except ValueError as err:
            log.warning("%s; trying an earlier step", err)
    return None


def fit_pack(members: list[Member]) -> None:
    """Train the runs of ``members`` as one packed model, each writing its own outputs."""
    cfgs = [m.cfg for m in members]
    check_pack(cfgs)
    cfg = cfgs[0]
    backends = configure_backends(cfg.trainer.tf32, cfg.trainer.deterministic)
    device = resolve_device(cfg.trainer.device)
    bundle = build_data(cfg.data)
    data_files = data_identity(cfg.data)
    batch_size, one_process = int(cfg.trainer.batch_size), Dist()
    check_batch_size(cfg, bundle, batch_size, one_process)
    last = drop_last(cfg.data, uses_batch_statistics(cfg.norm))
    loaders = [build_loaders(bundle, c.data, batch_size, c.trainer.seed, device.type == "cuda", device,
                             drop_last=last) for c in cfgs]
    check_last_batch(cfg, loaders[0], batch_size, one_process)
    models, rngs = seeded_models(cfgs, bundle.spec, device)
    model = pack_models(models)
    net = Accelerated.from_config(model, device, cfg.trainer)
    optimizer = build_optimizer(model, cfg.optim)
    steps_per_epoch = loaders[0].steps_per_epoch
    scheduler = build_schedule(optimizer, cfg.schedule, steps_per_epoch)
    state = TrainState(cfg, members[0].run_dir, device, model, optimizer, scheduler, steps_per_epoch,
                       total_steps(cfg.trainer, steps_per_epoch), train_data=bundle.train)
    shared = [cb for cb in method_callbacks(cfg) if not isinstance(cb, WeightNormLog)]
    for m, rng in zip(members, rngs):
        m.rng = rng
        m.weights_log = WeightNormLog(m.run_dir, m.index, len(members))
        if bundle.skipped_images:
            m.summary["skipped_images"] = len(bundle.skipped_images)
        m.summary.update(backends=backends, params=count_parameters(models[0]), device=str(device),
                         steps_per_epoch=steps_per_epoch, loader=loaders[0].kind, world_size=1,
                         num_classes=bundle.spec.num_classes, data_files=data_files,
                         packed_with=[str(o.run_dir) for o in members if o is not m])
    pack = Pack(members, state, net, shared, FreezeDiverged(len(members)), loaders[0].test, bundle.spec.num_classes)
    for cb in pack.callbacks:
        cb.on_train_start(state)
    pack.resume(str(cfg.trainer.resume))
    for m in members:
        if m.frozen:
            pack.freeze(m)
    train_pack_steps(pack, loaders)


def train_pack_steps(pack: Pack, loaders: list[Any]) -> None:
    """The pack's step loop, evaluations, checkpoints and final outputs."""
    state, cfg = pack.state, pack.state.cfg
    for m, loader in zip(pack.members, loaders):
        m.stream = loader.epochs_from(state.step)
    swap_rng = loaders[0].kind == "torch"
    eval_every = max(1, to_steps(cfg.trainer.eval_every, cfg.trainer.eval_unit, state.steps_per_epoch))
    log_every = int(cfg.trainer.log_every)
    clock = CheckpointClock(cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_unit, state.steps_per_epoch, log_every)
    state.model.train()
    bar = tqdm(total=state.total_steps, initial=state.step, desc=f"train x{pack.runs}", disable=not sys.stderr.isatty(),
               dynamic_ncols=True)
    lr = state.lr
    with PreemptionGuard() as guard:
        while state.step < state.total_steps and any(m.status == "running" for m in pack.members):
            batches = [m.next_batch(swap_rng) for m in pack.members]
            x = pack_inputs([b[0].to(state.device, non_blocking=True) for b in batches])
            y = torch.stack([b[1] for b in batches], 1).to(state.device, non_blocking=True)
            lr = state.lr
            logits, losses = train_step(pack.net, state.optimizer, pack.callbacks, state, x, y, pack.criterion)
            last = end_step(state, pack.meter, pack.callbacks, losses, logits, y, bar)
            if state.step % log_every == 0 or state.step % eval_every == 0 or last:
                losses = pack.check_losses(lr)
                if bar.disable and state.step % log_every == 0:
                    log.info("step %d/%d epoch %.2f loss %s lr %.4g", state.step, state.total_steps, state.epoch,
                             " ".join(f"{v:.4f}" for v in losses), lr)
            if state.step % eval_every == 0 or last:
                pack.evaluate(lr)
            running = [m.summary for m in pack.members if m.status == "running"]
            checkpoint_or_stop(guard, clock, state, last, pack.save_periodic, running)
        bar.close()
        finish(pack, lr)  # a signal while the final checkpoints are written waits for them
        stop_if_signalled(guard)


def finish(pack: Pack, lr: float) -> None:
    """Final summaries and checkpoints of the runs that completed."""
    state = pack.state
    if any(m.status == "running" and not m.metrics.rows for m in pack.members):
        pack.evaluate(lr)
    payloads = pack.payloads()
    for m, payload in zip(pack.members, payloads):
        if m.status != "running":
            continue
        m.status = "completed"
        m.summary.update(status="completed", steps=state.step, epochs=round(state.epoch, 4))
        if save(m, payload, m.run_dir / checkpoint.FINAL):
            checkpoint.prune(m.run_dir, 0)
    for cb in pack.callbacks:
        cb.on_train_end(state, "completed")


@contextmanager
def member_logs(members: Sequence[Member]) -> Iterator[None]:
    """The pack's log also in the ``train.log`` of every run but the first (whose file Hydra's
    job logging opens), in the same format; nothing when no log file is open."""
    root = logging.getLogger()
    like = next((h for h in root.handlers if isinstance(h, logging.FileHandler)), None)
    handlers: list[logging.Handler] = []
    for m in [m for m in members[1:] if not m.frozen] if like is not None else []:
        handler = RunLogFile(m.run_dir / "train.log", delay=True)
        handler.setFormatter(like.formatter)
        handler.setLevel(like.level)
        root.addHandler(handler)
        handlers.append(handler)
    try:
        yield
    finally:
        for handler in handlers:
            root.removeHandler(handler)
            handler.close()


def train_pack(cfgs: Sequence[DictConfig], run_dirs: Sequence[Path],
               frozen: Sequence[bool] = ()) -> list[dict[str, Any]]:
    """Train ``cfgs`` (one per run, in ``run_dirs``) as one pack; returns the summaries of the
    runs not ``frozen`` (runs that diverged in an earlier process of this pack: they hold
    their slots and write nothing). Exceptions are recorded in every run's summary, then
    re-raised."""
    members = []
    for i, (cfg, run_dir) in enumerate(zip(cfgs, run_dirs)):
        member = Member(i, cfg, run_dir, {}, frozen=i < len(frozen) and frozen[i])
        if not member.frozen:
            run_dir.mkdir(parents=True, exist_ok=True)
            checkpoint.remove_partial_files(run_dir)
            OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
            member.summary.update({"status": "failed", **version_stamp(), "fingerprint": fingerprint(cfg),
                                   "config": OmegaConf.to_container(cfg, resolve=True)})
        members.append(member)
    written = [m for m in members if not m.frozen]
    started = time.perf_counter()
    try:
        for cfg in cfgs:
            validate(cfg)
        with member_logs(members):
            fit_pack(members)
    except Preempted:
        raise
    except KeyboardInterrupt:
        for m in written:
            if m.summary["status"] != "diverged":
                m.summary.update(status="interrupted", error="KeyboardInterrupt: stopped by Ctrl-C")
        raise
    except BaseException as err:
        for m in written:
            if m.summary["status"] != "diverged":
                m.summary.update(status="failed", error=f"{type(err).__name__}: {err}",
                                 traceback=traceback.format_exc())
        raise
    finally:
        for m in written:
            m.summary["wall_seconds"] = round(time.perf_counter() - started, 3)
            write_json(m.run_dir / "summary.json", m.summary)
    return [m.summary for m in written]
