"""The training loop: one run from a composed config to metrics.csv and summary.json.

Read it top to bottom: build data, model, optimizer and schedule; loop over steps
(forward, backward, hooks, optimizer step); evaluate every ``trainer.eval_every``;
stop on the step budget or a non-finite loss; write the summary whatever happens.
"""

from __future__ import annotations

import logging
import math
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch import nn
from torch.utils.data import DataLoader
from tqdm import tqdm

import bnexp.plugins  # noqa: F401  (registers the callbacks methods and loggers need)
from bnexp.callbacks import Callback, TrainState, callbacks_for
from bnexp.config import validate
from bnexp.data import build_data, build_loaders
from bnexp.models import build_model, count_parameters
from bnexp.optim import build_optimizer, build_schedule, to_steps
from bnexp.runinfo import MetricsWriter, resolve_device, seed_everything, version_stamp, write_json

log = logging.getLogger("bnexp.train")


def batches(loader: DataLoader) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Endless training batches; every pass over the loader is one epoch of the sampler."""
    while True:
        yield from loader


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, num_classes: int) -> dict[str, float]:
    """Mean cross-entropy and top-1 (and top-5 when there are more than 5 classes) in percent."""
    was_training = model.training
    model.eval()
    loss = torch.zeros((), device=device, dtype=torch.float64)
    correct = torch.zeros(2, device=device, dtype=torch.float64)
    count = 0
    k = 5 if num_classes > 5 else 1
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        logits = model(x)
        loss += F.cross_entropy(logits, y, reduction="sum").double()
        hits = logits.topk(k, dim=1).indices.eq(y[:, None])
        correct += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum()]).double()
        count += len(y)
    model.train(was_training)
    out = {"test_loss": loss.item() / count, "test_acc": 100 * correct[0].item() / count}
    if k == 5:
        out["test_top5"] = 100 * correct[1].item() / count
    return out


class TrainMeter:
    """Sums loss and correct predictions on the device; read (one sync) when reported."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.sums = torch.zeros(3, device=self.device, dtype=torch.float64)  # loss*n, correct, n

    def add(self, loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> None:
        n = torch.tensor(float(len(y)), device=self.device, dtype=torch.float64)
        correct = logits.argmax(dim=1).eq(y).sum().double()
        self.sums += torch.stack([loss.double() * n, correct, n])

    def read(self) -> tuple[float, float]:
        """(mean loss, accuracy in percent) since the last reset; NaN loss if non-finite."""
        loss_sum, correct, n = self.sums.tolist()
        return (loss_sum / n, 100 * correct / n) if n else (float("nan"), float("nan"))


def total_steps(cfg: DictConfig, steps_per_epoch: int) -> int:
    """``trainer.max_steps`` when set, else ``trainer.epochs`` worth of steps."""
    if cfg.max_steps is not None:
        return int(cfg.max_steps)
    return int(round(cfg.epochs * steps_per_epoch))


def fit(cfg: DictConfig, run_dir: Path, summary: dict[str, Any], callbacks: list[Callback]) -> None:
    """Train one run, writing metrics.csv and the checkpoint; fill ``summary`` as it goes."""
    seed_everything(cfg.trainer.seed, cfg.trainer.deterministic)
    device = resolve_device(cfg.trainer.device)
    bundle = build_data(cfg.data)
    loaders = build_loaders(bundle, cfg.data, cfg.trainer.batch_size, cfg.trainer.seed, device.type == "cuda")
    model = build_model(cfg.model, cfg.norm, cfg.act.name, bundle.spec).to(device)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    scheduler = build_schedule(optimizer, cfg.schedule, loaders.steps_per_epoch)
    state = TrainState(
        cfg, run_dir, device, model, optimizer, scheduler, loaders.steps_per_epoch,
        total_steps(cfg.trainer, loaders.steps_per_epoch),
    )
    callbacks = callbacks_for(cfg) + callbacks
    summary.update(params=count_parameters(model), device=str(device), steps_per_epoch=state.steps_per_epoch)
    eval_every = max(1, to_steps(cfg.trainer.eval_every, cfg.trainer.eval_unit, state.steps_per_epoch))
    log_every = int(cfg.trainer.log_every)
    writer = MetricsWriter(run_dir / "metrics.csv")
    meter = TrainMeter(device)
    start = time.perf_counter()
    for cb in callbacks:
        cb.on_train_start(state)

    def evaluate_and_log(lr: float) -> None:
        train_loss, train_acc = meter.read()
        meter.reset()
        row = {"step": state.step, "epoch": round(state.epoch, 4), "lr": lr, "train_loss": train_loss,
               "train_acc": train_acc, **evaluate(model, loaders.test, device, bundle.spec.num_classes),
               "seconds": round(time.perf_counter() - start, 3)}
        writer.write(row)
        record_eval(summary, row)
        for cb in callbacks:
            cb.on_eval(state, row)

    model.train()
    stream = batches(loaders.train)
    bar = tqdm(total=state.total_steps, desc="train", disable=not sys.stderr.isatty(), dynamic_ncols=True)
    lr = state.lr
    status = "completed"
    while state.step < state.total_steps:
        x, y = next(stream)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        lr = state.lr
        for cb in callbacks:
            cb.before_step(state)
        logits = model(x)
        loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        for cb in callbacks:
            cb.after_backward(state)
        optimizer.step()
        scheduler.step()
        state.step += 1
        meter.add(loss.detach(), logits.detach(), y)
        for cb in callbacks:
            cb.after_step(state)
        bar.update(1)
        last = state.step == state.total_steps
        if state.step % log_every == 0 or state.step % eval_every == 0 or last:
            train_loss, train_acc = meter.read()
            if not math.isfinite(train_loss):
                status = "diverged"
                log.warning("non-finite training loss at step %d: stopping (status diverged)", state.step)
                break
            bar.set_postfix(loss=f"{train_loss:.4f}", lr=f"{lr:.4g}")
            if bar.disable and state.step % log_every == 0:
                log.info("step %d/%d epoch %.2f loss %.4f acc %.2f%% lr %.4g", state.step, state.total_steps,
                         state.epoch, train_loss, train_acc, lr)
        if state.step % eval_every == 0 or last:
            evaluate_and_log(lr)
    bar.close()
    if state.total_steps == 0:
        evaluate_and_log(lr)
    summary.update(status=status, steps=state.step, epochs=round(state.epoch, 4))
    save_checkpoint(run_dir / "checkpoint.pt", state)
    for cb in callbacks:
        cb.on_train_end(state, status)


def record_eval(summary: dict[str, Any], row: dict[str, Any]) -> None:
    """Keep the final and best test accuracies of a run in its summary."""
    summary["final_top1"] = row["test_acc"]
    summary["final_test_loss"] = row["test_loss"]
    summary["final_train_loss"] = row["train_loss"]
    summary["best_top1"] = max(summary.get("best_top1", -math.inf), row["test_acc"])
    if "test_top5" in row:
        summary["final_top5"] = row["test_top5"]
        summary["best_top5"] = max(summary.get("best_top5", -math.inf), row["test_top5"])


def save_checkpoint(path: Path, state: TrainState) -> None:
    """Model, optimizer and schedule state, step and config, written through a rename."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save(
        {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "step": state.step,
            "config": OmegaConf.to_container(state.cfg, resolve=True),
        },
        tmp,
    )
    tmp.replace(path)


def train(cfg: DictConfig, run_dir: Path, callbacks: list[Callback] | None = None) -> dict[str, Any]:
    """Run one job in ``run_dir`` and return its summary; exceptions are recorded, then re-raised."""
    run_dir.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(cfg, run_dir / "config.yaml", resolve=True)
    started = time.perf_counter()
    summary: dict[str, Any] = {"status": "failed", **version_stamp(),
                               "config": OmegaConf.to_container(cfg, resolve=True)}
    try:
        validate(cfg)
        fit(cfg, run_dir, summary, list(callbacks or []))
    except BaseException as err:
        summary.update(status="failed", error=f"{type(err).__name__}: {err}", traceback=traceback.format_exc())
        raise
    finally:
        summary["wall_seconds"] = round(time.perf_counter() - started, 3)
        write_json(run_dir / "summary.json", summary)
    return summary
