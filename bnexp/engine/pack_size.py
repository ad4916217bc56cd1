"""``trainer.pack=auto``: the largest pack that fits the device, from measured training steps;
``trainer.pack_conv=auto``: the faster form of a pack's convolutions, from measured steps.

One training step of a pack of 1 and of a pack of 2 runs of the sweep's model (its norm,
batch, data shapes, amp and channels_last; eager, on fixed random batches) is measured:
the bytes it holds at its peak and its seconds. Two runs cost ``fixed + 2 * per_run``, one
``fixed + per_run``; a worker may use :data:`MEMORY_SHARE` of the device's free memory
divided among the workers that share it (``hydra.launcher.per_gpu``), so

    K = floor((MEMORY_SHARE * free / workers - fixed) / per_run),

at least 1 and at most :data:`MAX_AUTO_PACK` (and the number of runs there are to pack).
On a GPU the bytes are what the caching allocator hands out at the step's peak
(``torch.cuda.max_memory_allocated``) and the free memory is the driver's
(``torch.cuda.mem_get_info``); on a CPU they are the parameters, gradients and optimizer
state plus every tensor the forward saves for the backward (counted once per storage), and
the free memory is the kernel's estimate of what can be had without swapping
(``MemAvailable``).

``trainer.pack_conv=auto`` times :data:`CONV_STEPS` eager training steps of the pack about
to train (its model, K, batch, precision and memory layout, on its device) once with each
form of :data:`bnexp.nn.packed.PACK_CONVS` and keeps the faster; a process measures each kind
of pack once (:func:`conv_form`) and says what it measured in one line. The steps are
eager, outside a CUDA graph: the launches of ``streams``' K convolutions per layer, which a
graph would remove, are counted (``bench table_cost`` measures the graphed forms).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from omegaconf import DictConfig, OmegaConf
from torch import nn

from bnexp.data import build_data
from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.callbacks import Callback, TrainState
from bnexp.engine.identity import shared_settings
from bnexp.engine.method_hooks import WeightNormLog, method_callbacks
from bnexp.engine.optim import build_optimizer, build_schedule
from bnexp.engine.trainer import train_step
from bnexp.models import DataSpec, build_model
from bnexp.models.packing import pack_models, packed_losses
from bnexp.nn.packed import AUTO_CONV, GROUPED, PACK_CONVS
from bnexp.support.runinfo import resolve_device

log = logging.getLogger("bnexp.engine.pack_size")

MAX_AUTO_PACK = 60  # the largest pack auto picks: a CBN Table 1 row's rho grid x 10 seeds
MEMORY_SHARE = 0.8  # of the free memory: the rest for the allocator's slack, cuDNN's workspaces, evaluation
CONV_STEPS = 3  # timed steps per form (after two untimed: the optimizer's state, cuDNN's choices)
_conv_forms: dict[tuple[Any, ...], str] = {}  # this process's choices, by kind of pack


@dataclass(frozen=True)
class StepCost:
    """One measured training step of a pack of ``runs`` runs: peak bytes and seconds."""

    runs: int
    bytes: int
    seconds: float


def free_bytes(device: torch.device) -> int:
    """Memory that can still be had on ``device``: the driver's free memory on a GPU (after
    this process's cache, the measured steps', is handed back), the kernel's ``MemAvailable``
    on a CPU (all physical pages where /proc/meminfo is missing)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Parameters, their gradients and the optimizer's state."""
    tensors = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None),
               *(v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))]
    return sum(t.numel() * t.element_size() for t in tensors)


def packed_step(cfg: DictConfig, spec: DataSpec, batch: int, runs: int, device: torch.device,
                run_dir: Path = Path("."), conv: str | None = None) -> tuple[Callable[[], Any], TrainState, list[Callback]]:
    """One training step of a pack of ``runs`` runs of ``cfg``'s model (seeds 0 and up) on a
    fixed random batch, under the run's amp / channels_last / compile settings, with its
    method hooks started, its convolutions in form ``conv`` (default: ``trainer.pack_conv``,
    ``grouped`` for ``auto``); the step, its state and its hooks."""
    models = []
    for seed in range(runs):
        torch.manual_seed(seed)
        models.append(build_model(cfg.model, cfg.norm, cfg.act.name, spec))
    form = conv or str(cfg.trainer.get("pack_conv", GROUPED))
    model = pack_models(models, GROUPED if form == AUTO_CONV else form).to(device)
    net = AmpCompileWrapper.from_config(model, device, cfg.trainer)
    optimizer = build_optimizer(model, cfg.optim)
    state = TrainState(cfg, run_dir, device, model, optimizer, build_schedule(optimizer, cfg.schedule, 1), 1, 10**9)
    callbacks = [cb for cb in method_callbacks(cfg) if not isinstance(cb, WeightNormLog)]
    for cb in callbacks:
        cb.on_train_start(state)
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(batch, runs * spec.in_channels, spec.image_size, spec.image_size, device=device, generator=g)
    y = torch.randint(spec.num_classes, (batch, runs), device=device, generator=g)
    model.train()
    return (lambda: train_step(net, optimizer, callbacks, state, x, y, packed_losses)), state, callbacks


def step_cost(cfg: DictConfig, spec: DataSpec, runs: int, device: torch.device) -> StepCost:
    """Measure one eager training step (the second: the first creates the optimizer's state)
    of a pack of ``runs`` runs of ``cfg``'s model at ``trainer.batch_size``."""
    eager = cfg.copy()
    OmegaConf.update(eager, "trainer.compile", False, merge=False)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    step, state, callbacks = packed_step(eager, spec, int(cfg.trainer.batch_size), runs, device)
    step()
    params = {p.untyped_storage().data_ptr() for p in state.model.parameters()}
    saved: dict[int, int] = {}

    def keep(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:  # weights are counted with the model's state
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        peak = _state_bytes(state.model, state.optimizer) + sum(saved.values())
    seconds = time.perf_counter() - started
    for cb in callbacks:
        cb.on_train_end(state, "completed")
    return StepCost(runs, peak, seconds)


def auto_pack(cfg: DictConfig, spec: DataSpec, device: torch.device, workers: int = 1,
              limit: int = MAX_AUTO_PACK) -> tuple[int, str]:
    """``trainer.pack=auto``: the pack size for ``cfg``'s runs on ``device`` shared by
    ``workers`` workers, at most ``limit``; and one line saying how it was found."""
    one, two = step_cost(cfg, spec, 1, device), step_cost(cfg, spec, 2, device)
    per_run = max(two.bytes - one.bytes, 1)
    fixed = max(one.bytes - per_run, 0)
    free = free_bytes(device)
    budget = MEMORY_SHARE * free / workers
    size = max(1, min(limit, MAX_AUTO_PACK, int((budget - fixed) // per_run)))
    mib = 2**20
    return size, (f"trainer.pack=auto: {size} runs per pack on {device} ({free / mib:,.0f} MiB free, "
                  f"{MEMORY_SHARE:.0%} of it over {workers} worker(s); a step holds {fixed / mib:,.1f} MiB + "
                  f"{per_run / mib:,.1f} MiB per run; measured steps: 1 run {one.seconds * 1e3:.1f} ms, "
                  f"2 runs {two.seconds * 1e3:.1f} ms; at most {min(limit, MAX_AUTO_PACK)})")


def measured_pack(cfg: DictConfig, workers: int) -> tuple[int, str]:
    """:func:`auto_pack` for ``cfg``'s runs on the device it trains on, its data's shapes."""
    return auto_pack(cfg, build_data(cfg.data).spec, resolve_device(cfg.trainer.device), workers)


def conv_seconds(cfg: DictConfig, spec: DataSpec, runs: int, device: torch.device, conv: str) -> float:
    """Seconds of one eager training step of a pack of ``runs`` runs of ``cfg``'s model with
    its convolutions in form ``conv``: the mean of :data:`CONV_STEPS` steps after two."""
    eager = cfg.copy()
    OmegaConf.update(eager, "trainer.compile", False, merge=False)
    step, state, callbacks = packed_step(eager, spec, int(cfg.trainer.batch_size), runs, device, conv=conv)
    for _ in range(2):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(CONV_STEPS):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - started) / CONV_STEPS
    for cb in callbacks:
        cb.on_train_end(state, "completed")
    del step, state, callbacks
    if device.type == "cuda":  # blocks cached for the side streams serve no other stream: hand them back
        torch.cuda.empty_cache()
    return seconds


def conv_form(cfg: DictConfig, spec: DataSpec, runs: int, device: torch.device) -> str:
    """The form of a pack's convolutions: ``trainer.pack_conv``, or for ``auto`` the faster of
    :data:`PACK_CONVS` for this kind of pack (model, norm, K, batch, data shapes, precision,
    memory layout, device), measured once per process (:func:`conv_seconds`) and logged."""
    setting = str(cfg.trainer.get("pack_conv", GROUPED))
    if setting != AUTO_CONV or runs == 1:
        return GROUPED if setting == AUTO_CONV else setting
    kind = (pack_kind(cfg), spec, runs, str(device))
    if kind not in _conv_forms:
        seconds = {form: conv_seconds(cfg, spec, runs, device, form) for form in PACK_CONVS}
        _conv_forms[kind] = min(PACK_CONVS, key=lambda form: seconds[form])
        log.info("trainer.pack_conv=auto: %s for packs of %d %s runs on %s (amp %s, channels_last %s; a step takes %s)",
                 _conv_forms[kind], runs, cfg.model.name, device, cfg.trainer.get("amp"),
                 bool(cfg.trainer.get("channels_last")),
                 ", ".join(f"{seconds[form] * 1e3:.1f} ms {form}" for form in PACK_CONVS))
    return _conv_forms[kind]


def pack_kind(cfg: DictConfig) -> str:
    """What decides a pack's step time besides K and the data's shapes: the model, norm, act,
    batch, precision and memory layout, without the per-run settings (a pack of other rho or
    seeds is the same kind)."""
    tree = shared_settings(cfg)
    trainer = tree["trainer"]
    return json.dumps([tree["model"], tree["norm"], tree["act"], trainer["batch_size"], trainer.get("amp"),
                       trainer.get("channels_last")], sort_keys=True, default=str)
