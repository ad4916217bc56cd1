"""The training loop: one run from a composed config to metrics.csv and summary.json.

Read it top to bottom: build data, model, optimizer and schedule; resume from the newest
checkpoint if there is one; loop over steps (forward, backward, hooks, optimizer step);
evaluate every ``trainer.eval_every`` and checkpoint every ``trainer.checkpoint_every``;
stop on the step budget, a non-finite loss or a preemption signal; write the summary
whatever happens.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from bnexp.data import DataBundle, build_data, data_identity
from bnexp.data.loaders import Loaders, build_loaders, drop_last
from bnexp.engine import checkpoint
from bnexp.engine.accel import Accelerated
from bnexp.engine.callbacks import Callback, TrainState, ended_on_stop
from bnexp.engine.config import validate
from bnexp.engine.identity import fingerprint, run_differences
from bnexp.engine.loggers import logger_callback
from bnexp.engine.method_hooks import method_callbacks
from bnexp.engine.optim import build_optimizer, build_schedule, to_steps
from bnexp.engine.preemption import Preempted, PreemptionGuard
from bnexp.engine.schema import RESUME_MODES
from bnexp.models import build_model, count_parameters
from bnexp.models.packing import pack_inputs, per_run
from bnexp.nn.create_norm import uses_batch_statistics
from bnexp.probes.callback import probes_callback
from bnexp.support import distributed
from bnexp.support.distributed import Dist, gather_objects, max_over_ranks, sum_over_ranks
from bnexp.support.errors import ConfigError, OtherRunThere
from bnexp.support.runinfo import MetricsWriter, configure_backends, resolve_device, seed_everything, version_stamp, write_json

log = logging.getLogger("bnexp.train")


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, num_classes: int,
             runs: int = 1) -> list[dict[str, float]]:
    """Mean cross-entropy and top-1 (and top-5 when there are more than 5 classes) in percent,
    over this process's share of the test set summed with the other processes' shares; one
    dict per run of a packed model (``runs``, :mod:`bnexp.models.packing`), each run seeing
    every test image."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(runs, 3, device=device, dtype=torch.float64)  # loss, top-1, top-k per run
    count, full = 0, None
    k = 5 if num_classes > 5 else 1
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        full = full or len(x)
        x = pack_inputs([pad_batch(x, full) if getattr(model, "compiled", False) else x] * runs)
        logits = per_run(model(x)[: len(y)], runs)
        for run in range(runs):
            sums[run, 0] += F.cross_entropy(logits[:, run], y, reduction="sum").double()
            hits = logits[:, run].topk(k, dim=1).indices.eq(y[:, None])
            sums[run, 1:] += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum()]).double()
        count += len(y)
    model.train(was_training)
    totals = sum_over_ranks(torch.cat([sums.flatten(), sums.new_tensor([count])])).tolist()
    count = totals.pop()
    rows = []
    for loss_sum, top1, topk in zip(totals[0::3], totals[1::3], totals[2::3]):
        row = {"test_loss": loss_sum / count, "test_acc": 100 * top1 / count}
        if k == 5:
            row["test_top5"] = 100 * topk / count
        rows.append(row)
    return rows


def pad_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` with zero images appended up to ``size``: a compiled model in eval mode (each
    image on its own) then runs every evaluation batch through one graph."""
    return x if len(x) == size else torch.cat([x, x.new_zeros(size - len(x), *x.shape[1:])])


class TrainMeter:
    """Sums loss and correct predictions on the device (five small kernels a step, no sync;
    the count of images stays on the host); read (one sync) when reported. One row of sums
    per run of a packed model (``runs``)."""

    def __init__(self, device: torch.device, runs: int = 1) -> None:
        self.sums = torch.zeros(runs, 3, device=device, dtype=torch.float64)  # loss*n, correct, n (filled on read)
        self.count = 0

    def reset(self) -> None:
        self.sums.zero_()
        self.count = 0

    def add(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        """A step's mean loss (one per run), logits (``(N, runs * classes)``) and targets
        (``(N,)``, or ``(N, runs)`` for a pack)."""
        n, runs = len(y), len(self.sums)
        self.sums[:, 0].add_(loss.reshape(runs), alpha=n)  # in float64
        self.sums[:, 1].add_(per_run(logits, runs).argmax(dim=2).eq(y.view(n, runs)).sum(0))
        self.count += n

    def state(self) -> torch.Tensor:
        """``[loss * n, correct, n]`` per run summed since the last reset (for checkpoints and reads)."""
        self.sums[:, 2].fill_(self.count)
        return self.sums

    def load(self, sums: torch.Tensor, rank: int = 0) -> None:
        """Sums as :meth:`state` gave them (3 values in a single run's checkpoint from before
        packing existed), or one block of them per process (``(processes, runs, 3)``,
        :meth:`Run.payload`), of which process ``rank`` takes its own."""
        self.sums.copy_(sums[rank] if sums.dim() == 3 else sums)
        self.count = int(self.sums[0, 2])

    def read_runs(self) -> list[tuple[float, float]]:
        """(mean loss, accuracy in percent) per run over all processes since the last reset;
        NaN if non-finite."""
        sums = sum_over_ranks(self.state().clone()).tolist()
        return [(loss_sum / n, 100 * correct / n) if n else (float("nan"), float("nan")) for loss_sum, correct, n in sums]

    def read(self) -> tuple[float, float]:
        """:meth:`read_runs` of a single run."""
        return self.read_runs()[0]


def total_steps(cfg: DictConfig, steps_per_epoch: int) -> int:
    """``trainer.max_steps`` when set, else ``trainer.epochs`` worth of steps."""
    if cfg.max_steps is not None:
        return int(cfg.max_steps)
    return int(round(cfg.epochs * steps_per_epoch))


def record_eval(summary: dict[str, Any], row: dict[str, Any]) -> None:
    """Keep the final and best test accuracies of a run in its summary."""
    summary["final_top1"] = row["test_acc"]
    summary["final_test_loss"] = row["test_loss"]
    summary["final_train_loss"] = row["train_loss"]
    summary["best_top1"] = max(summary.get("best_top1", -math.inf), row["test_acc"])
    if "test_top5" in row:
        summary["final_top5"] = row["test_top5"]
        summary["best_top5"] = max(summary.get("best_top5", -math.inf), row["test_top5"])


def callback_key(index: int, cb: Callback) -> str:
    """Where a checkpoint keeps the state of the ``index``-th callback of a run."""
    return f"{index}:{type(cb).__name__}"


def eval_row(state: TrainState, lr: float, train: tuple[float, float], test: dict[str, float],
             seconds: float) -> dict[str, Any]:
    """One metrics.csv row: where training is, the training sums since the last row, the test metrics."""
    return {"step": state.step, "epoch": round(state.epoch, 4), "lr": lr, "train_loss": train[0],
            "train_acc": train[1], **test, "seconds": round(seconds, 3)}


class Run:
    """The mutable pieces of one run that a checkpoint must capture besides the model."""

    def __init__(self, state: TrainState, callbacks: list[Callback], summary: dict[str, Any], net: Accelerated) -> None:
        self.state = state
        self.net = net  # the model under the run's amp / channels_last / compile settings
        self.callbacks = callbacks
        self.summary = summary
        self.meter = TrainMeter(state.device)
        self.metrics = MetricsWriter(state.run_dir / "metrics.csv", enabled=state.dist.is_main)
        self.elapsed_before = 0.0  # seconds trained before the latest resume
        self.started = time.perf_counter()

    def seconds(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    def payload(self) -> dict[str, Any]:
        """Everything needed to continue this run bit-for-bit."""
        s = self.state
        return {
            "model": s.model.state_dict(),
            "optimizer": s.optimizer.state_dict(),
            "scheduler": s.scheduler.state_dict(),
            "step": s.step,
            "scaler": self.net.scaler.state_dict(),
            "rng": gather_objects(checkpoint.capture_rng()),  # one entry per process
            "meter": torch.stack(gather_objects(self.meter.state().cpu())),  # each process's own sums
            "metrics": self.metrics.rows,
            "callbacks": {callback_key(i, cb): cb.state_dict() for i, cb in enumerate(self.callbacks)},
            "seconds": self.seconds(),
            "config": OmegaConf.to_container(s.cfg, resolve=True),
            "data_files": self.summary.get("data_files", {}),
        }

    def restore(self, payload: dict[str, Any]) -> None:
        s = self.state
        s.model.load_state_dict(payload["model"])
        s.optimizer.load_state_dict(payload["optimizer"])
        s.scheduler.load_state_dict(payload["scheduler"])
        s.step = payload["step"]
        if payload.get("scaler"):  # empty unless trainer.amp=fp16
            self.net.scaler.load_state_dict(payload["scaler"])
        checkpoint.restore_rng(payload["rng"][s.dist.rank])
        self.meter.load(payload["meter"], s.dist.rank)
        self.metrics.restore(payload["metrics"])
        for row in payload["metrics"]:
            record_eval(self.summary, row)
        for i, cb in enumerate(self.callbacks):
            cb.load_state_dict(payload["callbacks"].get(callback_key(i, cb), {}))
        self.elapsed_before = payload["seconds"]
        self.started = time.perf_counter()

    def resume(self, mode: str) -> None:
        """``auto``: newest valid periodic checkpoint, if any, written with this run's settings;
        ``never``; or a file path (other settings allowed, with a warning)."""
        run_dir, cfg = self.state.run_dir, self.state.cfg
        if mode == "never":
            return
        if mode not in RESUME_MODES:  # a file (validate checked it exists)
            path = Path(mode)
            try:
                found: tuple[Path, dict[str, Any]] | None = (path, checkpoint.load(path, require_checksum=False))
            except ValueError as err:
                raise ConfigError(f"trainer.resume={mode}: {err}") from err
        else:
            found = checkpoint.newest_valid(run_dir)
            if found is None and checkpoint.resume_candidates(run_dir):
                log.warning("no valid checkpoint in %s: starting over", run_dir)
        if found is not None:
            change = run_differences(found[1].get("config", {}), cfg, found[1].get("data_files"))
            if change:
                if mode == "auto":
                    raise OtherRunThere(f"{found[0]} was written by a run with other settings ({change}): run with "
                                      "trainer.resume=never to start over in this directory, or use another one")
                log.warning("resuming from %s, written with other settings: %s", found[0], change)
            self.restore(found[1])
            self.summary["resumed_from"] = str(found[0])
            log.info("resumed from %s at step %d", found[0], self.state.step)

    def save_periodic(self) -> None:
        """Write a periodic checkpoint; a failure (a full disk) is logged, not fatal."""
        run_dir = self.state.run_dir
        payload = self.payload()  # every process takes part (it gathers their RNG states)
        if not self.state.dist.is_main:
            return
        if self.save(payload, checkpoint.periodic_path(run_dir, self.state.step), "training goes on (earlier "
                     "checkpoints untouched)"):
            checkpoint.prune(run_dir, int(self.state.cfg.trainer.keep_checkpoints))

    def save(self, payload: dict[str, Any], path: Path, then: str) -> bool:
        """Write a checkpoint; a failure (a full disk, a quota, torch's zip writer) is logged
        with ``then`` (what happens next) and recorded under ``checkpoint_errors``."""
        try:
            checkpoint.save(payload, path)
        except (OSError, RuntimeError) as err:
            log.error("checkpoint %s at step %d could not be written (%s: %s); %s", path.name, self.state.step,
                      type(err).__name__, err, then)
            self.summary.setdefault("checkpoint_errors", []).append(f"step {self.state.step}, {path.name}: "
                                                                    f"{type(err).__name__}: {err}")
            return False
        return True

    def evaluate(self, loader: DataLoader, num_classes: int, lr: float) -> None:
        train = self.meter.read()
        self.meter.reset()
        s = self.state
        row = eval_row(s, lr, train, evaluate(self.net, loader, s.device, num_classes)[0], self.seconds())
        self.metrics.write(row)
        record_eval(self.summary, row)
        for cb in self.callbacks:
            cb.on_eval(s, row)


def build_callbacks(cfg: DictConfig) -> list[Callback]:
    """The callbacks a run's config asks for, in the order every hook calls them:

    1. the probes (``probes=[...]``): in ``after_backward`` they must read the gradients the
       step computed, before anything rewrites them;
    2. the methods' hooks: AMAT's learning rate, BNP's gradient rewrite,
       the scale-invariant weights' log;
    3. the logger (``logger=...``), which mirrors what the others produced.
    """
    ordered = [probes_callback(cfg), *method_callbacks(cfg), logger_callback(cfg)]
    return [cb for cb in ordered if cb is not None]


def train_step(net: Accelerated, optimizer: torch.optim.Optimizer, callbacks: list[Callback], state: TrainState,
               x: torch.Tensor, y: torch.Tensor,
               criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimization step on ``(x, y)``: callbacks around forward, loss, backward and update.

    Returns the logits and the loss: ``criterion``'s, the mean cross-entropy, or for a packed
    model one mean loss per run, whose sum is differentiated (each run's gradient is its
    own). The learning-rate schedule, buffer averaging and the step count are the caller's
    (``bnexp bench step`` times exactly this function).
    """
    for cb in callbacks:
        cb.before_step(state)
    logits = net(x)
    loss = criterion(logits, y)
    optimizer.zero_grad(set_to_none=True)
    net.backward(loss.sum() if loss.dim() else loss, optimizer)
    for cb in callbacks:
        cb.after_backward(state)
    net.step(optimizer)
    return logits, loss


def end_step(state: TrainState, meter: TrainMeter, callbacks: list[Callback], loss: torch.Tensor,
             logits: torch.Tensor, y: torch.Tensor, bar: tqdm) -> bool:
    """After a training step: the lr schedule, buffer averaging (under torchrun), the step
    count, the meter and the hooks' ``after_step``. Whether it was the last step."""
    state.scheduler.step()
    distributed.average_buffers(state.model)
    state.step += 1
    meter.add(loss.detach(), logits.detach(), y)
    for cb in callbacks:
        cb.after_step(state)
    bar.update(1)
    return state.step == state.total_steps


def checkpoint_or_stop(guard: PreemptionGuard, clock: CheckpointClock, state: TrainState, last: bool,
                       save: Callable[[], None], summaries: list[dict[str, Any]]) -> None:
    """After a step: on a signal, checkpoint (``save``), mark ``summaries`` with the stop's
    status and raise :class:`Preempted`; otherwise a periodic checkpoint when ``clock`` says so."""
    if guard.agreed():
        save()
        for summary in summaries:
            summary.update(status=Preempted(guard.signum).status, steps=state.step, epochs=round(state.epoch, 4))
        stop(guard)
    if not last and clock.due(state.step):
        save()
        clock.saved()


def stop(guard: PreemptionGuard) -> None:
    """Hand the received signal to the handler installed before ours, then raise :class:`Preempted`."""
    guard.forward()
    raise Preempted(guard.signum)


def stop_if_signalled(guard: PreemptionGuard) -> None:
    """After a run's final checkpoint: a signal that came while it was written (or after the
    last step's check) leaves the run completed, then stops the process as any signal does,
    so that a sweep stops there too."""
    if guard.agreed():
        log.warning("%s came while the run finished: the run is complete and stops here",
                    signal.Signals(guard.signum).name)
        stop(guard)


class CheckpointClock:
    """When a periodic checkpoint is due: every N steps or epochs, or once N minutes of wall
    time have passed since the last one (``unit="minute"``). Time is looked at every
    ``check_every`` steps only, and under torchrun the processes agree on it (one
    all-reduce of a flag then), so all of them checkpoint at the same step."""

    now = staticmethod(time.monotonic)

    def __init__(self, every: float, unit: str, steps_per_epoch: int, check_every: int) -> None:
        self.seconds = 60.0 * every if unit == "minute" else None
        self.steps = 0 if self.seconds is not None else to_steps(every, unit, steps_per_epoch)
        self.check_every = check_every
        self.last = self.now()

    def due(self, step: int) -> bool:
        if self.seconds is None:
            return self.steps > 0 and step % self.steps == 0
        if self.seconds <= 0 or step % self.check_every:
            return False
        return bool(max_over_ranks(int(self.now() - self.last >= self.seconds)))

    def saved(self) -> None:
        self.last = self.now()


def init_weights(model: nn.Module, source: Path) -> None:
    """``trainer.init_from``: the weights of a checkpoint (file or run directory) into ``model``,
    every key and shape matching; a ConfigError naming the differences otherwise."""
    weights = checkpoint.load_weights(source)
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        first = str(err).splitlines()[1:3]
        raise ConfigError(f"trainer.init_from={source}: its weights do not fit this model (same model, norm, "
                          f"placement and classes needed): {' '.join(s.strip() for s in first)}") from err


def check_batch_size(cfg: DictConfig, bundle: DataBundle, batch_size: int, d: Dist) -> None:
    """A ConfigError for a batch (``batch_size`` per process) larger than the training set."""
    share = -(-len(bundle.train) // d.world_size)  # training images per process
    if batch_size > share:
        per = f" ({share} per process)" if d.world_size > 1 else ""
        raise ConfigError(f"trainer.batch_size={cfg.trainer.batch_size} is larger than the {len(bundle.train)} training "
                          f"images{per}: use trainer.batch_size <= {share * d.world_size}")


def check_last_batch(cfg: DictConfig, loaders: Loaders, batch_size: int, d: Dist) -> None:
    """A ConfigError for a last batch of one image under a norm with batch statistics."""
    pooled = d.world_size if cfg.norm.get("sync") else 1  # norm.sync: statistics over every process's share
    if uses_batch_statistics(cfg.norm) and loaders.sampler.smallest_batch * pooled < 2:
        raise ConfigError(f"norm={cfg.norm.name} normalizes with batch statistics, and with data.drop_last=false the "
                          f"last batch of each epoch holds one image ({loaders.sampler.size} images, batches of "
                          f"{batch_size}): set data.drop_last=true (or null) or another trainer.batch_size")


def fit(cfg: DictConfig, run_dir: Path, summary: dict[str, Any], extra_callbacks: list[Callback]) -> None:
    """Train one run, writing metrics.csv and checkpoints; fill ``summary`` as it goes."""
    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
    summary["backends"] = configure_backends(cfg.trainer.tf32, cfg.trainer.deterministic)
    d = distributed.from_environment()
    device = resolve_device(cfg.trainer.device, d.local_rank if d.enabled else None)
    distributed.init_process_group(d, device, float(cfg.trainer.dist_timeout))
    batch_size = distributed.split_batch(cfg.trainer.batch_size, d)
    bundle = build_data(cfg.data)
    summary["data_files"] = data_identity(cfg.data)  # compared by a re-run (the fingerprint holds settings only)
    if bundle.skipped_images:  # data.check_images=true data.bad_images=skip
        summary["skipped_images"] = len(bundle.skipped_images)
    check_batch_size(cfg, bundle, batch_size, d)
    loaders = build_loaders(bundle, cfg.data, batch_size, cfg.trainer.seed, device.type == "cuda", device,
                            rank=d.rank, world_size=d.world_size,
                            drop_last=drop_last(cfg.data, uses_batch_statistics(cfg.norm)))
    check_last_batch(cfg, loaders, batch_size, d)
    model = build_model(cfg.model, cfg.norm, cfg.act.name, bundle.spec).to(device)
    if cfg.trainer.get("init_from"):
        init_weights(model, Path(cfg.trainer.init_from))
        summary["init_from"] = str(cfg.trainer.init_from)
    if d.enabled:  # same initial weights everywhere, then each process its own random stream
        seed_everything(cfg.trainer.seed + d.rank, cfg.trainer.deterministic)
    net = Accelerated.from_config(model, device, cfg.trainer, distributed=d.enabled)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_schedule(optimizer, cfg.schedule, loaders.steps_per_epoch)
    state = TrainState(cfg, run_dir, device, model, optimizer, scheduler, loaders.steps_per_epoch,
                       total_steps(cfg.trainer, loaders.steps_per_epoch), dist=d, train_data=bundle.train,
                       summary=summary)
    run = Run(state, build_callbacks(cfg) + extra_callbacks, summary, net)
    summary.update(params=count_parameters(model), device=str(device), steps_per_epoch=state.steps_per_epoch,
                   loader=loaders.kind, world_size=d.world_size, num_classes=bundle.spec.num_classes)
    for cb in run.callbacks:
        cb.on_train_start(state)
    with PreemptionGuard() as guard:  # a signal while the final checkpoint is written waits for it
        with ended_on_stop(run.callbacks, state):  # trackers close as preempted or failed on a stop
            run.resume(str(cfg.trainer.resume))
            status, lr = run_steps(run, loaders, bundle.spec.num_classes, guard)
            finish_run(run, status, loaders.test, bundle.spec.num_classes, lr)
        for cb in run.callbacks:
            cb.on_train_end(state, status)
        stop_if_signalled(guard)


def run_steps(run: Run, loaders: Loaders, num_classes: int, guard: PreemptionGuard) -> tuple[str, float]:
    """Train from the run's current step to its last: log, evaluate and checkpoint on their
    schedules. Returns the status (completed, or diverged at a non-finite training loss) and
    the last step's lr; a signal (``guard``) checkpoints and raises :class:`Preempted`."""
    state, cfg = run.state, run.state.cfg
    eval_every = max(1, to_steps(cfg.trainer.eval_every, cfg.trainer.eval_unit, state.steps_per_epoch))
    log_every = int(cfg.trainer.log_every)
    clock = CheckpointClock(cfg.trainer.checkpoint_every, cfg.trainer.checkpoint_unit, state.steps_per_epoch, log_every)
    state.model.train()
    stream = loaders.epochs_from(state.step)
    bar = tqdm(total=state.total_steps, initial=state.step, desc="train", disable=not sys.stderr.isatty(),
               dynamic_ncols=True)
    lr, status = state.lr, "completed"
    while state.step < state.total_steps:
        x, y = next(stream)
        x, y = x.to(state.device, non_blocking=True), y.to(state.device, non_blocking=True)
        lr = state.lr
        logits, loss = train_step(run.net, state.optimizer, run.callbacks, state, x, y)
        last = end_step(state, run.meter, run.callbacks, loss, logits, y, bar)
        if state.step % log_every == 0 or state.step % eval_every == 0 or last:
            train_loss, train_acc = run.meter.read()
            if not math.isfinite(train_loss):
                status = "diverged"
                log.warning("non-finite training loss at step %d: stopping (status diverged)", state.step)
                break
            bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.4g}")
            if bar.disable and state.step % log_every == 0:
                log.info("step %d/%d epoch %.2f loss %.4f acc %.2f%% lr %.4g", state.step, state.total_steps,
                         state.epoch, train_loss, train_acc, lr)
        if state.step % eval_every == 0 or last:
            run.evaluate(loaders.test, num_classes, lr)
        checkpoint_or_stop(guard, clock, state, last, run.save_periodic, [run.summary])
    bar.close()
    return status, lr


def finish_run(run: Run, status: str, test: DataLoader, num_classes: int, lr: float) -> None:
    """After the last step: an evaluation if the run has none, the summary's status and, for a
    completed run, the final checkpoint (the periodic ones are then removed)."""
    state = run.state
    if not run.metrics.rows:
        run.evaluate(test, num_classes, lr)
    run.summary.update(status=status, steps=state.step, epochs=round(state.epoch, 4))
    if status == "completed":
        payload = run.payload()
        then = "the run's metrics and summary stand (status completed); any periodic checkpoints are kept"
        if state.dist.is_main and run.save(payload, state.run_dir / checkpoint.FINAL, then):
            checkpoint.prune(state.run_dir, 0)


def train(cfg: DictConfig, run_dir: Path, callbacks: list[Callback] | None = None) -> dict[str, Any]:
    """Run one job in ``run_dir`` and return its summary; exceptions are recorded, then re-raised."""
    main_process = distributed.from_environment().is_main  # only rank 0 writes files
    run_dir.mkdir(parents=True, exist_ok=True)
    if main_process:
        checkpoint.remove_partial_files(run_dir)
        OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    started = time.perf_counter()
    summary: dict[str, Any] = {"status": "failed", **version_stamp(), "fingerprint": fingerprint(cfg),
                               "config": OmegaConf.to_container(cfg, resolve=True)}
    try:
        validate(cfg)
        with distributed.peers_timeout_named(float(cfg.trainer.dist_timeout)):
            fit(cfg, run_dir, summary, list(callbacks or []))
    except Preempted:
        raise
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started: no checkpoint
        summary.update(status="interrupted", error="KeyboardInterrupt: stopped by Ctrl-C")
        raise
    except BaseException as err:
        summary.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        raise
    finally:
        summary["wall_seconds"] = round(time.perf_counter() - started, 3)
        if main_process:
            write_json(run_dir / "summary.json", summary)
    return summary
