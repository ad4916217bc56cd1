"""The training engine: a run alone, or a pack of K runs trained as one model, from composed
configs to each run's metrics.csv, checkpoints and summary.json.

A :class:`Trainer` holds K members (one per run directory; K = 1 for a run alone, the path
:func:`train` takes) around one model, optimizer and schedule. Read :meth:`Trainer.run` and
:meth:`Trainer.train_steps` top to bottom: resume from the newest checkpoint if there is one;
loop over steps (batch, forward, backward, hooks, optimizer step: :class:`bnexp.engine.step.TrainStep`);
check the training loss every ``trainer.log_every`` steps (a member whose loss is not finite
diverged: a run alone stops there), write each member's evaluation row every
``trainer.eval_every`` and its checkpoint every ``trainer.checkpoint_every``; on a preemption
signal checkpoint and stop; at the end each member's final checkpoint and summary.
:class:`bnexp.engine.pack.PackTrainer` overrides the few methods a pack does otherwise (where
batches come from, the loss, how the model's state splits into each member's checkpoint and
joins back, which checkpoints it resumes from, freezing a diverged member).
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

from bnexp.data import DataBundle, build_data, data_identity
from bnexp.data.device import EvalBatches
from bnexp.data.files import DataFile, identify
from bnexp.data.loaders import Loaders, build_seeded_loaders, drop_last
from bnexp.engine import checkpoint
from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.callbacks import Callback, TrainState, ended_on_stop
from bnexp.engine.config import check_step_counts, validate
from bnexp.engine.console import RunConsole
from bnexp.engine.evaluation import DeviceEvaluation, test_rows
from bnexp.engine.identity import fingerprint, run_differences, run_labels
from bnexp.engine.loggers import logger_callback
from bnexp.engine.method_hooks import method_callbacks
from bnexp.engine.optim import build_optimizer, build_schedule, to_steps
from bnexp.engine.preemption import Preempted, PreemptionGuard, StopAtOnce
from bnexp.engine.schema import RESUME_MODES
from bnexp.engine.step import TrainMeter, TrainStep, cuda_graph_wanted, step_batches
from bnexp.models import build_model, count_parameters
from bnexp.models.packing import pack_inputs, per_run
from bnexp.nn.create_norm import uses_batch_statistics
from bnexp.probes.callback import probes_callback
from bnexp.support import distributed
from bnexp.support.distributed import Dist, gather_objects, max_over_ranks
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
    return test_rows(sums, count, k)


def pad_batch(x: torch.Tensor, size: int) -> torch.Tensor:
    """``x`` with zero images appended up to ``size``: a compiled model in eval mode (each
    image on its own) then runs every evaluation batch through one graph."""
    return x if len(x) == size else torch.cat([x, x.new_zeros(size - len(x), *x.shape[1:])])


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


@dataclass
class Member:
    """One run of a :class:`Trainer` (the run itself when it trains alone): its settings,
    directory, summary, evaluation rows, its own hooks and its status, the one record of how
    it ended (``running``, then ``completed`` or ``diverged``)."""

    index: int  # its slot in the (packed) model
    cfg: DictConfig
    run_dir: Path
    summary: dict[str, Any]
    callbacks: list[Callback] = field(default_factory=list)  # hooks whose state goes into its checkpoint only
    writes: bool = True  # writes its files (rank 0 of a torchrun run only)
    status: str = "running"
    metrics: MetricsWriter = field(init=False)

    def __post_init__(self) -> None:
        self.metrics = MetricsWriter(self.run_dir / "metrics.csv", enabled=self.writes)

    def start(self) -> None:
        """Ready the run directory (a killed write's partial files removed, config.yaml) and
        start the summary: ``failed`` until training says otherwise."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.writes:
            checkpoint.remove_partial_files(self.run_dir)
            OmegaConf.save(self.cfg, self.run_dir / "config.yaml", resolve=True)
        self.summary.update({"status": "failed", **version_stamp(), "fingerprint": fingerprint(self.cfg),
                             "config": OmegaConf.to_container(self.cfg, resolve=True)})

    def end(self, status: str, state: TrainState) -> None:
        """Record how this run ended in its summary (with where training was)."""
        self.status = status
        self.summary.update(status=status, steps=state.step, epochs=round(state.epoch, 4))


class Trainer:
    """K members (K = 1: a run alone) trained as one model: the step loop, evaluation rows,
    checkpoints, resuming and finishing. The methods under "what a pack does otherwise" are
    those :class:`bnexp.engine.pack.PackTrainer` overrides.

    Hooks: ``shared`` serve every member (a pack's method hooks; none alone), each member has
    its own (alone: all of them). :attr:`callbacks` lists those the step calls, in order; a
    member's leave it when the member ends, so each hook ends once (:meth:`end_member`)."""

    AFTER_DIVERGENCE = "stopping"  # what a run does once its loss turned non-finite

    def __init__(self, state: TrainState, net: AmpCompileWrapper, members: list[Member], loaders: list[Loaders],
                 num_classes: int, shared: Sequence[Callback] = ()) -> None:
        self.state = state
        self.net = net  # the model under the run's amp / channels_last / compile settings
        self.members = members
        self.loaders = loaders  # one per member, sharing one copy of the data and the test batches
        self.num_classes = num_classes
        self.shared = list(shared)
        self.console = RunConsole([m.run_dir for m in members], run_labels([m.cfg for m in members]),
                                  members[0].summary.get("params"))
        self.callbacks = [*self.shared, *(cb for m in self.running() for cb in m.callbacks), self.console]
        self.meter = TrainMeter(state.device, len(members))
        self.graphed = cuda_graph_wanted(state, net, self.callbacks)  # trainer.cuda_graph, where it can be had
        test = loaders[0].test
        self.test_metrics = (DeviceEvaluation(net, test, num_classes, len(members), self.graphed)
                             if isinstance(test, EvalBatches) else
                             partial(evaluate, net, test, state.device, num_classes, len(members)))
        self.elapsed_before = 0.0  # seconds trained before the latest resume
        self.started = time.perf_counter()

    def running(self) -> list[Member]:
        return [m for m in self.members if m.status == "running"]

    def seconds(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.started

    # -- what a pack does otherwise --

    def batches(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Training batches on the device, from the current step on."""
        for x, y in self.loaders[0].epochs_from(self.state.step):
            yield self.loaders[0].to_device(x, y)

    def criterion(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits, y)

    def split_state(self, state: dict[str, Any]) -> list[dict[str, Any]]:
        """Each member's part of a state of the model, the optimizer or a shared hook."""
        return [state]

    def join_states(self, states: list[dict[str, Any]]) -> dict[str, Any]:
        """The inverse of :meth:`split_state`."""
        return states[0]

    def rng_entry(self, member: Member) -> list[dict[str, Any]]:
        """The random state a member's checkpoint holds: every process's (gathered in rank order)."""
        return gather_objects(checkpoint.capture_rng())

    def restore_rng(self, member: Member, entry: list[dict[str, Any]]) -> None:
        checkpoint.restore_rng(entry[self.state.dist.rank])

    def find_checkpoints(self, mode: str) -> list[tuple[Path, dict[str, Any]]] | None:
        """What to resume from, one (path, payload) per member: the file ``mode`` names, or
        (``auto``) the newest valid checkpoint in the run directory; None if there is none."""
        (member,) = self.members
        if mode not in RESUME_MODES:  # a file (validate checked it exists)
            try:
                return [(Path(mode), checkpoint.load(Path(mode), require_checksum=False))]
            except ValueError as err:
                raise ConfigError(f"trainer.resume={mode}: {err}") from err
        found = checkpoint.newest_valid(member.run_dir)
        if found is None and checkpoint.resume_candidates(member.run_dir):
            log.warning("no valid checkpoint in %s: starting over", member.run_dir)
        return None if found is None else [found]

    def member_lr(self, member: Member, lr: float) -> float:
        """The lr of ``member``'s last step, given the trainer's (a pack's runs may differ in it)."""
        return lr

    def lr_text(self, lr: float) -> str:
        """The last step's lr as the bar and the log show it: each running member's."""
        return " ".join(dict.fromkeys(f"{self.member_lr(m, lr):.4g}" for m in self.running()))

    def diverge(self, member: Member, lr: float) -> None:
        """``member``'s training loss is not finite: an evaluation row if it has none yet (its
        state as it diverged), its summary final now (rewritten with the wall time at the
        end), its hooks ended."""
        if not member.metrics.rows:
            self.evaluate(lr, only=member)
        member.end("diverged", self.state)
        if member.writes:
            write_json(member.run_dir / "summary.json", member.summary)
        log.warning("%s: non-finite training loss at step %d: %s (status diverged)", member.run_dir, self.state.step,
                    self.AFTER_DIVERGENCE)
        self.end_member(member)

    # -- the same for one run and for a pack --

    def run(self) -> None:
        """Start the hooks, resume, train, finish; a stop (a signal, Ctrl-C, an error) ends
        the hooks still training as stopped (:func:`ended_on_stop`), for a pack as alone."""
        state = self.state
        for cb in self.callbacks:
            cb.on_train_start(state)
        with PreemptionGuard() as guard:  # a signal while the final checkpoint is written waits for it
            with ended_on_stop(self.callbacks, state):  # trackers close as preempted or failed on a stop
                self.resume(str(state.cfg.trainer.resume))
                for m in (m for m in self.running() if m.writes):
                    checkpoint.drop_stale_best(m.run_dir, state.step)
                lr = self.train_steps(guard)
                self.finish(lr)
            stop_if_signalled(guard)

    def train_steps(self, guard: PreemptionGuard) -> float:
        """Train from the current step to the last, or until no member trains: log, evaluate
        and checkpoint on their schedules. Returns the last step's lr; a signal (``guard``)
        checkpoints and raises :class:`Preempted`."""
        state, cfg = self.state, self.state.cfg.trainer
        eval_every = max(1, to_steps(cfg.eval_every, cfg.eval_unit, state.steps_per_epoch))
        log_every = int(cfg.log_every)
        clock = CheckpointClock(cfg.checkpoint_every, cfg.checkpoint_unit, state.steps_per_epoch, log_every)
        state.model.train()
        step = TrainStep(state, self.net, self.meter, self.callbacks, self.criterion,
                         step_batches(self.loaders, self.batches), self.graphed)
        runs = len(self.members)
        bar = tqdm(total=state.total_steps, initial=state.step, desc="train" if runs == 1 else f"train x{runs}",
                   disable=not sys.stderr.isatty(), dynamic_ncols=True)
        lr = state.lr
        while state.step < state.total_steps:
            lr = state.lr
            step.run()
            last = end_step(state, self.callbacks, bar)
            if state.step % log_every == 0 or state.step % eval_every == 0 or last:
                train = self.check_losses(lr)
                if not self.running():
                    break
                losses, accuracies = (" ".join(f"{v:.4f}" for v, _ in train), " ".join(f"{a:.2f}%" for _, a in train))
                bar.set_postfix(loss=losses, lr=self.lr_text(lr), **self.console.postfix())
                if bar.disable and state.step % log_every == 0:
                    log.info("step %d/%d epoch %.2f loss %s acc %s lr %s", state.step, state.total_steps,
                             state.epoch, losses, accuracies, self.lr_text(lr))
            if state.step % eval_every == 0 or last:
                self.evaluate(lr)
            checkpoint_or_stop(guard, clock, state, last, self.save_periodic, [m.summary for m in self.running()])
        bar.close()
        return lr

    def check_losses(self, lr: float) -> list[tuple[float, float]]:
        """Each member's (mean training loss, accuracy) since the last evaluation; a running
        member whose loss is not finite diverged (:meth:`diverge`)."""
        train = self.meter.read_runs()
        for m, (loss, _) in zip(self.members, train):
            if m.status == "running" and not math.isfinite(loss):
                self.diverge(m, lr)
        return train

    def evaluate(self, lr: float, only: Member | None = None) -> None:
        """Each running member's evaluation row (only ``only``'s, without resetting the others'
        training sums, for a member that diverged before its first evaluation)."""
        train = self.meter.read_runs()
        if only is None:
            self.meter.reset()
        s, improved = self.state, []
        tests = self.test_metrics()
        for m, run_train, test in zip(self.members, train, tests):
            if m is not only and (only is not None or m.status != "running"):
                continue
            row = eval_row(s, self.member_lr(m, lr), run_train, test, self.seconds())
            m.metrics.write(row)
            if only is None and row["test_acc"] > m.summary.get("best_top1", -math.inf):
                improved.append(m.index)
            record_eval(m.summary, row)
            self.console.evaluated(m.index, row, s.total_steps, m.summary["best_top1"])
            for cb in m.callbacks:
                cb.on_eval(s, row)
        self.save_best(improved)

    def save_best(self, improved: list[int]) -> None:
        """``trainer.keep_best``: the checkpoint of each member whose evaluation just beat its
        best so far, as :data:`~bnexp.engine.checkpoint.BEST` in its directory."""
        keep = {m.index for m in self.running() if m.index in improved and m.cfg.trainer.get("keep_best")}
        if keep:
            for m, payload in zip(self.running(), self.payloads()):
                if m.index in keep and m.writes:
                    self.save_checkpoint(m, payload, m.run_dir / checkpoint.BEST, "training goes on without it")

    def payloads(self) -> list[dict[str, Any]]:
        """The checkpoint of each running member: everything needed to continue it bit for bit,
        as the same run trained alone would hold it. Every process takes part (it gathers their
        RNG states and training sums)."""
        s = self.state
        models, optimizers = self.split_state(s.model.state_dict()), self.split_state(s.optimizer.state_dict())
        shared = [self.split_state(cb.state_dict()) for cb in self.shared]
        meters = torch.stack(gather_objects(self.meter.state().cpu()))  # (processes, members, 3)
        out = []
        for m in self.running():
            i = m.index
            hooks = [*self.shared, *m.callbacks]
            hook_states = [*(part[i] for part in shared), *(cb.state_dict() for cb in m.callbacks)]
            out.append({
                "model": models[i], "optimizer": optimizers[i], "scheduler": s.scheduler.state_dict(), "step": s.step,
                "scaler": self.net.scaler.state_dict(), "rng": self.rng_entry(m), "meter": meters[:, i:i + 1].clone(),
                "metrics": m.metrics.rows,
                "callbacks": {callback_key(j, cb): st for j, (cb, st) in enumerate(zip(hooks, hook_states))},
                "seconds": self.seconds(), "config": OmegaConf.to_container(m.cfg, resolve=True),
                "data_files": m.summary.get("data_files", {}),
            })
            if "init_weights" in m.summary:  # a run started from trainer.init_from
                out[-1]["init_weights"] = m.summary["init_weights"]
        return out

    def restore(self, payloads: list[dict[str, Any]]) -> None:
        """Continue from each member's checkpoint (:meth:`payloads`); a member not running
        (a pack's frozen one) only has its slot filled."""
        s, first = self.state, payloads[0]
        s.model.load_state_dict(self.join_states([p["model"] for p in payloads]))
        s.optimizer.load_state_dict(self.join_states([p["optimizer"] for p in payloads]))
        s.scheduler.load_state_dict(first["scheduler"])
        s.step = first["step"]
        if first.get("scaler"):  # empty unless trainer.amp=fp16
            self.net.scaler.load_state_dict(first["scaler"])
        for j, cb in enumerate(self.shared):
            cb.load_state_dict(self.join_states([p["callbacks"].get(callback_key(j, cb), {}) for p in payloads]))
        self.meter.load([p["meter"] for p in payloads], s.dist.rank)
        for m, p in zip(self.members, payloads):
            self.restore_rng(m, p["rng"])
            if m.status != "running":
                continue
            m.metrics.restore(p["metrics"])
            for row in p["metrics"]:
                record_eval(m.summary, row)
            for j, cb in enumerate(m.callbacks, start=len(self.shared)):
                cb.load_state_dict(p["callbacks"].get(callback_key(j, cb), {}))
        self.elapsed_before = first["seconds"]
        self.started = time.perf_counter()

    def resume(self, mode: str) -> None:
        """``auto``: the newest valid checkpoint (:meth:`find_checkpoints`), if any, written
        with these settings; ``never``; or a file path (other settings allowed, with a warning)."""
        if mode == "never":
            return
        found = self.find_checkpoints(mode)
        if found is None:
            return
        for m, (path, payload) in zip(self.members, found):
            if m.status != "running":
                continue
            change = run_differences(payload.get("config", {}), m.cfg, payload)
            if change:
                if mode == "auto":
                    raise OtherRunThere(f"{path} was written by a run with other settings ({change}): run with "
                                        "trainer.resume=never to start over in this directory, or use another one")
                log.warning("resuming from %s, written with other settings: %s", path, change)
            m.summary["resumed_from"] = str(path)
        self.restore([payload for _, payload in found])
        log.info("resumed from %s at step %d", ", ".join(m.summary["resumed_from"] for m in self.running()),
                 self.state.step)

    def save_periodic(self) -> None:
        """Each running member's periodic checkpoint (a diverged one keeps its last ones)."""
        for m, payload in zip(self.running(), self.payloads()):
            if m.writes and self.save_checkpoint(m, payload, checkpoint.periodic_path(m.run_dir, self.state.step),
                                                 "training goes on (earlier checkpoints untouched)"):
                checkpoint.prune(m.run_dir, int(m.cfg.trainer.keep_checkpoints))

    def save_checkpoint(self, member: Member, payload: dict[str, Any], path: Path, then: str) -> bool:
        """Write one of ``member``'s checkpoints; a failure (a full disk, a quota, torch's zip
        writer) is logged with ``then`` (what happens next) and noted in its summary under
        ``checkpoint_errors``."""
        try:
            checkpoint.save_with_checksum(payload, path)
        except (OSError, RuntimeError) as err:
            log.error("checkpoint %s at step %d could not be written (%s: %s); %s", path, self.state.step,
                      type(err).__name__, err, then)
            member.summary.setdefault("checkpoint_errors", []).append(f"step {self.state.step}, {path.name}: "
                                                                      f"{type(err).__name__}: {err}")
            return False
        return True

    def finish(self, lr: float) -> None:
        """After the last step: an evaluation if a running member has no row yet, then each
        running member completed (its summary; its final checkpoint, the periodic ones then
        removed; its hooks ended); last, the shared hooks end."""
        completed = self.running()
        if any(not m.metrics.rows for m in completed):
            self.evaluate(lr)
        then = "the run's metrics and summary stand (status completed); any periodic checkpoints are kept"
        for m, payload in zip(completed, self.payloads() if completed else []):
            m.end("completed", self.state)
            if m.writes and self.save_checkpoint(m, payload, m.run_dir / checkpoint.FINAL, then):
                checkpoint.prune(m.run_dir, 0)
        for m in completed:
            self.end_member(m)
        self.end_shared()

    def end_member(self, member: Member) -> None:
        """``on_train_end`` of ``member``'s own hooks, with its status. They leave the step's
        hooks first: a hook that fails to end is not then told the run stopped."""
        self.callbacks[:] = [cb for cb in self.callbacks if all(cb is not own for own in member.callbacks)]
        for cb in member.callbacks:
            cb.on_train_end(self.state, member.status)

    def end_shared(self) -> None:
        """``on_train_end`` of the hooks left (those every member shares): ``completed`` when
        some member completed, ``diverged`` when all diverged."""
        status = "completed" if any(m.status == "completed" for m in self.members) else "diverged"
        hooks, self.callbacks[:] = list(self.callbacks), []
        for cb in hooks:
            cb.on_train_end(self.state, status)


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


def train_step(net: AmpCompileWrapper, optimizer: torch.optim.Optimizer, callbacks: list[Callback], state: TrainState,
               x: torch.Tensor, y: torch.Tensor,
               criterion: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.cross_entropy,
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimization step on ``(x, y)``: callbacks around forward, loss, backward and update,
    at the learning rates of the optimizer's groups (host floats).

    Returns the logits and the loss: ``criterion``'s, the mean cross-entropy, or for a packed
    model one mean loss per run, whose sum is differentiated (each run's gradient is its
    own). The learning-rate schedule, buffer averaging and the step count are the caller's.
    This is the step as the loop took it before :class:`bnexp.engine.step.TrainStep`, which
    computes the same bits (tests/test_step.py); ``bnexp bench step`` and ``bench graph``
    time it as "today's" step.
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


def end_step(state: TrainState, callbacks: list[Callback], bar: tqdm) -> bool:
    """After a training step (:class:`bnexp.engine.step.TrainStep`): the lr schedule, buffer
    averaging (under torchrun), the step count and the hooks' ``after_step``. Whether it was
    the last step."""
    state.scheduler.step()
    if state.run_rates is not None:
        state.run_rates.step()
    distributed.average_buffers(state.model)
    state.step += 1
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
        # an interval that rounds to no step means every step, not never (validate refuses it first)
        self.steps = 0 if self.seconds is not None or every == 0 else max(1, to_steps(every, unit, steps_per_epoch))
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


def init_weights(model: nn.Module, source: Path) -> dict[str, dict[str, Any]]:
    """``trainer.init_from``: the weights of a checkpoint (file or run directory) into ``model``,
    every key and shape matching; a ConfigError naming the differences otherwise. Returns what
    identifies the file's content (:func:`bnexp.data.files.identify`: its sha256), which a
    re-run compares as it compares the data files."""
    weights = checkpoint.load_weights(source)
    try:
        model.load_state_dict(weights)
    except RuntimeError as err:
        first = str(err).splitlines()[1:3]
        raise ConfigError(f"trainer.init_from={source}: its weights do not fit this model (same model, norm, "
                          f"placement and classes needed): {' '.join(s.strip() for s in first)}") from err
    return identify([DataFile(checkpoint.weights_file(source))], verified=False)


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


def training_loaders(cfg: DictConfig, bundle: DataBundle, batch_size: int, seeds: list[int], device: torch.device,
                     d: Dist) -> list[Loaders]:
    """Each member's loaders (one per seed, over one copy of the data), checked: a batch no
    larger than the training set, no one-image last batch under batch statistics."""
    check_batch_size(cfg, bundle, batch_size, d)
    loaders = build_seeded_loaders(bundle, cfg.data, batch_size, seeds, device.type == "cuda", device, rank=d.rank,
                                   world_size=d.world_size, drop_last=drop_last(cfg.data, uses_batch_statistics(cfg.norm)))
    check_last_batch(cfg, loaders[0], batch_size, d)
    check_step_counts(cfg, loaders[0].steps_per_epoch)  # checked before the run for data of a known size
    return loaders


def setup_summary(bundle: DataBundle, model: nn.Module, device: torch.device, loaders: Loaders, d: Dist) -> dict[str, Any]:
    """What a run's summary records of how it was set up."""
    setup = dict(params=count_parameters(model), device=str(device), steps_per_epoch=loaders.steps_per_epoch,
                 loader=loaders.kind, world_size=d.world_size, num_classes=bundle.spec.num_classes)
    if bundle.skipped_images:  # data.check_images=true data.bad_images=skip
        setup["skipped_images"] = len(bundle.skipped_images)
    return setup


def fit(member: Member, extra_callbacks: list[Callback]) -> None:
    """Train a run alone (a :class:`Trainer` of one member), filling its summary as it goes."""
    cfg, summary = member.cfg, member.summary
    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
    summary["backends"] = configure_backends(cfg.trainer.tf32, cfg.trainer.deterministic)
    d = distributed.from_environment()
    device = resolve_device(cfg.trainer.device, d.local_rank if d.enabled else None)
    distributed.init_process_group(d, device, float(cfg.trainer.dist_timeout))
    batch_size = distributed.split_batch(cfg.trainer.batch_size, d)
    bundle = build_data(cfg.data)
    summary["data_files"] = data_identity(cfg.data)  # compared by a re-run (the fingerprint holds settings only)
    (loaders,) = training_loaders(cfg, bundle, batch_size, [cfg.trainer.seed], device, d)
    model = build_model(cfg.model, cfg.norm, cfg.act.name, bundle.spec).to(device)
    if cfg.trainer.get("init_from"):
        summary["init_weights"] = init_weights(model, Path(cfg.trainer.init_from))  # compared by a re-run
        summary["init_from"] = str(cfg.trainer.init_from)
    if d.enabled:  # same initial weights everywhere, then each process its own random stream
        seed_everything(cfg.trainer.seed + d.rank, cfg.trainer.deterministic)
    net = AmpCompileWrapper.from_config(model, device, cfg.trainer, distributed=d.enabled)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_schedule(optimizer, cfg.schedule, loaders.steps_per_epoch)
    state = TrainState(cfg, member.run_dir, device, model, optimizer, scheduler, loaders.steps_per_epoch,
                       total_steps(cfg.trainer, loaders.steps_per_epoch), dist=d, train_data=bundle.train,
                       summary=summary)
    member.callbacks = build_callbacks(cfg) + extra_callbacks
    summary.update(setup_summary(bundle, model, device, loaders, d))
    Trainer(state, net, [member], [loaders], bundle.spec.num_classes).run()


@contextmanager
def outcome_recorded(members: Sequence[Member]) -> Iterator[None]:
    """Training inside: an exception is recorded in the summary of every member that did not
    diverge (``failed`` with its traceback, ``interrupted`` by Ctrl-C; a signal's stop set
    its status already) and re-raised; in any case each member that writes then writes its
    summary.json, with the wall time."""
    started = time.perf_counter()
    try:
        with StopAtOnce():  # a signal before the training loop takes over stops the set-up
            yield
    except Preempted as err:
        for m in members:
            if m.summary.get("status") == "failed":  # stopped before training: no checkpoint set it
                m.summary.update(status=err.status, error=str(err))
        raise
    except KeyboardInterrupt:  # a second Ctrl-C, or one before training started: no checkpoint
        for m in members:
            if m.status != "diverged":
                m.summary.update(status="interrupted", error="KeyboardInterrupt: stopped by Ctrl-C")
        raise
    except BaseException as err:
        for m in members:
            if m.status != "diverged":
                m.summary.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        raise
    finally:
        for m in members:
            if m.writes:
                m.summary["wall_seconds"] = round(time.perf_counter() - started, 3)
                write_json(m.run_dir / "summary.json", m.summary)


def train(cfg: DictConfig, run_dir: Path, callbacks: list[Callback] | None = None) -> dict[str, Any]:
    """Run one job in ``run_dir`` and return its summary; exceptions are recorded, then re-raised."""
    member = Member(0, cfg, run_dir, {}, writes=distributed.from_environment().is_main)  # only rank 0 writes files
    member.start()
    with outcome_recorded([member]):
        validate(cfg)
        with distributed.peers_timeout_named(float(cfg.trainer.dist_timeout)):
            fit(member, list(callbacks or []))
    return member.summary
