"""``bnexp bench graph``: one run's training step at the GPU's pace (``make gpu-check``'s step-graph section).

For each ``amps`` and each of ``norms`` (ResNet-20 at batch ``batch`` on CIFAR-10-sized
synthetic images, ``data.loader=device``, channels_last), in that order, first every
comparison (seconds each, nothing compiled), then every speed block:

1. on a GPU, **replayed vs plain**: the engine's step (:class:`bnexp.engine.step.TrainStep`)
   on two copies of the same run, one plain and one with ``trainer.cuda_graph``, over
   ``compare_steps`` steps after the graph's warm-up (a warmup and an lr milestone among them,
   deterministic kernels): the largest difference of any weight, buffer or momentum (0
   expected); and the engine's plain step against today's (:func:`bnexp.engine.trainer.train_step`
   with the loader's batches), which on a GPU may round otherwise;
2. **speed** of each of ``cases``: ``eager`` and ``compiled`` (today's step, with the device
   loader's per-step batches and ``trainer.compile``), ``step`` (the engine's step, plain),
   ``graph`` and ``compile+graph`` (captured, ``trainer.cuda_graph``), and ``bare`` (a plain
   PyTorch loop: forward, cross-entropy, backward, torch's SGD step, the schedule; no method
   hooks, so a baseline for ``bn`` only): ms per step and images per second (``reps`` blocks
   of ``number`` steps, interleaved; ``ratio`` to ``eager`` and ``ratio_to_bare``, each the
   median of the blocks' ratios), the share of that time the GPU is busy (kernel time under
   torch.profiler over ``number`` more steps), one evaluation of the test split, and the
   projected minutes of ``epochs`` x ``steps_per_epoch`` steps with one evaluation per epoch.

``clock=cpu`` times this process's CPU time instead of the wall's (steadier on a CPU shared
with other work; for a run on one thread). The records go to ``out`` after the comparisons
and after each speed block, so a run stopped from outside keeps what it measured. ``budget``
(seconds, 0: none) starts no speed block that would end past it, expecting each to take as
long as the one before (its compilations included); those left out are recorded as such.
On a CPU the graph cases are left out (they need CUDA).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
import torch.nn.functional as F
from omegaconf import DictConfig
from torch import nn

from bnexp.bench.common import COMMON, Budget, Record, compose_train, device_of, measure, record, synchronize
from bnexp.data import DataBundle, build_data
from bnexp.data.loaders import build_seeded_loaders
from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.callbacks import TrainState
from bnexp.engine.evaluation import DeviceEvaluation
from bnexp.engine.optim import build_optimizer, build_schedule
from bnexp.engine.step import WARMUP, TrainMeter, TrainStep, step_batches
from bnexp.engine.trainer import build_callbacks, evaluate, train_step
from bnexp.models import build_model
from bnexp.support.errors import unknown_choice
from bnexp.support.runinfo import atomic_write, configure_backends, seed_everything

CASES = ("eager", "compiled", "step", "graph", "compile+graph", "bare")
TODAY = ("eager", "compiled", "bare")  # cases without the engine's step
DEFAULTS: dict[str, Any] = {**COMMON, "warmup": WARMUP + 3, "number": 20, "reps": 3, "norms": ("bn", "cbn"),
                            "amps": ("bf16", "off"), "cases": CASES, "batch": 128, "compare_steps": 20,
                            "epochs": 120, "steps_per_epoch": 391, "clock": "wall", "budget": 0.0,
                            "out": "results/bench/graph.json"}
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}  # cpu: this process's CPU time (a shared CPU machine)
COLUMNS = ("name", "mode", "amp", "ms_per_step", "images_per_s", "gpu_busy", "ratio", "ratio_to_bare",
           "projected_minutes", "max_difference")
DATA = ("data=synthetic", "data.train_size=50000", "data.test_size=10000", "data.image_size=32", "data.loader=device",
        "trainer.channels_last=true")
# the replayed-vs-plain comparison crosses a warmup and a milestone inside its steps
COMPARE_SCHEDULE = ("schedule.unit=step", "schedule.milestones=[12]", "schedule.warmup=6",
                    "schedule.warmup_mode=linear")


@dataclass
class Case:
    """One way of training a run: ``step()`` trains one step, ``evaluate()`` evaluates it."""

    step: Callable[[], None]
    evaluate: Callable[[], Any]
    model: nn.Module
    optimizer: torch.optim.Optimizer


def config(options: Mapping[str, Any], norm: str, amp: str, compiled: bool, overrides: Sequence[str]) -> DictConfig:
    return compose_train(["model=resnet20", f"norm={norm}", *DATA, f"trainer.amp={amp}", f"trainer.compile={compiled}",
                          f"trainer.batch_size={options['batch']}", f"trainer.device={options['device']}", *overrides])


def build_case(cfg: DictConfig, bundle: DataBundle, device: torch.device, kind: str, run_dir: Path) -> Case:
    """A fresh run of ``cfg`` (seeded as ``bnexp train`` seeds it) trained the ``kind`` way."""
    seed_everything(cfg.trainer.seed)
    loaders = build_seeded_loaders(bundle, cfg.data, int(cfg.trainer.batch_size), [cfg.trainer.seed], False,
                                   device)[0]
    model = build_model(cfg.model, cfg.norm, cfg.act.name, bundle.spec).to(device)
    net = AmpCompileWrapper.from_config(model, device, cfg.trainer)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_schedule(optimizer, cfg.schedule, loaders.steps_per_epoch)
    state = TrainState(cfg, run_dir, device, model, optimizer, scheduler, loaders.steps_per_epoch, 10**9)
    callbacks = build_callbacks(cfg)
    for cb in callbacks:
        cb.on_train_start(state)
    meter = TrainMeter(device)
    classes = bundle.spec.num_classes

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return ((x.to(device), y.to(device)) for x, y in loaders.epochs_from(0))

    if kind in TODAY:
        work = bare_step(net, optimizer, batches()) if kind == "bare" else todays_step(net, state, callbacks, meter,
                                                                                         batches())
        evaluation: Callable[[], Any] = partial(evaluate, net, loaders.test, device, classes)
    else:
        graph = "graph" in kind
        engine = TrainStep(state, net, meter, callbacks, F.cross_entropy, step_batches([loaders], batches), graph)
        work = engine.run
        evaluation = DeviceEvaluation(net, loaders.test, classes, 1, graph)

    def step() -> None:
        work()
        scheduler.step()
        state.step += 1

    model.train()
    return Case(step, evaluation, model, optimizer)


def todays_step(net: AmpCompileWrapper, state: TrainState, callbacks: list, meter: TrainMeter,
                batches: Any) -> Callable[[], None]:
    """The step as the loop took it before the engine's step: the batch, train_step, the meter."""
    def step() -> None:
        x, y = next(batches)
        logits, loss = train_step(net, state.optimizer, callbacks, state, x, y)
        meter.add(loss.detach(), logits.detach(), y)
    return step


def bare_step(net: AmpCompileWrapper, optimizer: torch.optim.Optimizer, batches: Any) -> Callable[[], None]:
    """A plain PyTorch training step of ``net``'s model under its autocast (torch's SGD step;
    the schedule is the caller's)."""
    def step() -> None:
        x, y = next(batches)
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(net.device_type, dtype=net.dtype, enabled=net.dtype is not None):
            logits = net.model(x)
        F.cross_entropy(logits.float(), y).backward()
        optimizer.step()
    return step


def max_difference(a: Case, b: Case) -> float:
    """The largest absolute difference between two cases' weights, buffers and momentum."""
    pairs = list(zip(a.model.state_dict().values(), b.model.state_dict().values()))
    pairs += [(sa["momentum_buffer"], sb["momentum_buffer"])
              for sa, sb in zip(a.optimizer.state.values(), b.optimizer.state.values())]
    return max(float((x.double() - y.double()).abs().max()) if x.numel() else 0.0 for x, y in pairs)


def compare(cfg: DictConfig, bundle: DataBundle, device: torch.device, steps: int, run_dir: Path) -> list[Record]:
    """Replayed vs plain, and the engine's plain step vs today's, from the same start over the
    graph's warm-up and capture and ``steps`` more steps, with deterministic kernels."""
    configure_backends(tf32=False, deterministic=True)
    torch.use_deterministic_algorithms(True)
    try:
        plain, graphed, today = (build_case(cfg, bundle, device, kind, run_dir) for kind in ("step", "graph", "eager"))
        for _ in range(WARMUP + 1 + steps):
            for case in (plain, graphed, today):
                case.step()
        synchronize(device)
        found = [("replayed vs plain", max_difference(graphed, plain)), ("engine vs today's", max_difference(plain, today))]
    finally:
        torch.use_deterministic_algorithms(False)
        configure_backends(tf32=False, deterministic=False)
    return [{"name": cfg.norm.name, "mode": mode, "amp": str(cfg.trainer.amp), "device": device.type,
             "steps": WARMUP + 1 + steps, "max_difference": diff} for mode, diff in found]


def kernel_seconds(step: Callable[[], None], steps: int, device: torch.device) -> float | None:
    """Seconds of kernels per step over ``steps`` steps, from torch.profiler (None on a CPU)."""
    if device.type != "cuda":
        return None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e6 / steps


def eval_seconds(evaluation: Callable[[], Any], device: torch.device) -> float:
    """Seconds of one evaluation after two (which compile and capture where they do)."""
    for _ in range(2):
        evaluation()
    synchronize(device)
    start = time.perf_counter()
    evaluation()
    synchronize(device)
    return time.perf_counter() - start


def speed(options: Mapping[str, Any], norm: str, amp: str, bundle: DataBundle, device: torch.device,
          overrides: Sequence[str], run_dir: Path) -> list[Record]:
    """Every case of ``cases`` for one norm and amp, timed in interleaved blocks."""
    kinds = [k for k in options["cases"] if device.type == "cuda" or "graph" not in k]
    cases = {kind: build_case(config(options, norm, amp, "compile" in kind, overrides), bundle, device, kind, run_dir)
             for kind in kinds}
    times = measure({kind: case.step for kind, case in cases.items()}, options["reps"], options["number"],
                    options["warmup"], device, clock=CLOCKS[options["clock"]])
    batch, steps = options["batch"], options["epochs"] * options["steps_per_epoch"]
    base = "eager" if "eager" in times else kinds[0]
    records = []
    for kind, case in cases.items():
        seconds = statistics.median(times[kind])
        kernels = kernel_seconds(case.step, options["number"], device)
        evaluation = eval_seconds(case.evaluate, device)
        bare = [t / b for t, b in zip(times[kind], times.get("bare", ()))]  # per block, as the ratio
        records.append(record(norm, kind, device, times[kind], f"{norm}/{base}/{amp}", times[base], amp=amp,
                              ratio_to_bare=statistics.median(bare) if bare else None,
                              batch=batch, ms_per_step=1e3 * seconds, images_per_s=batch / seconds,
                              gpu_busy=None if kernels is None else kernels / seconds, eval_seconds=evaluation,
                              projected_minutes=(steps * seconds + options["epochs"] * evaluation) / 60))
    return records


def save(records: list[Record], out: str) -> None:
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(records, indent=2, default=str)
    atomic_write(path, lambda f: f.write(text.encode()))


def left_out(norm: str, amp: str, device: torch.device) -> Record:
    """The record of a speed block that ``budget`` left out."""
    return {"name": norm, "mode": "left out (budget)", "amp": amp, "device": device.type, "skipped": "budget"}


def bench(options: Mapping[str, Any], overrides: Sequence[str]) -> list[Record]:
    device = device_of(options)
    if options["clock"] not in CLOCKS:
        raise unknown_choice("clock", options["clock"], CLOCKS)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS for the comparison
    budget = Budget(float(options["budget"]))
    blocks = [(amp, norm) for amp in options["amps"] for norm in options["norms"]]
    records: list[Record] = []
    bundle = build_data(config(options, options["norms"][0], "off", False, overrides).data)
    with tempfile.TemporaryDirectory() as tmp:
        if device.type == "cuda" and options["compare_steps"]:  # the decisive figures first
            for amp, norm in blocks:
                cfg = config(options, norm, amp, False, [*COMPARE_SCHEDULE, *overrides])
                records += compare(cfg, bundle, device, options["compare_steps"], Path(tmp))
            save(records, options["out"])
        expected = 0.0  # seconds of a speed block, as long as the last one took
        for amp, norm in blocks:
            if not budget.allows(expected):
                records.append(left_out(norm, amp, device))
                continue
            started = time.perf_counter()
            records += speed(options, norm, amp, bundle, device, overrides, Path(tmp))
            expected = time.perf_counter() - started
            save(records, options["out"])
    return records
