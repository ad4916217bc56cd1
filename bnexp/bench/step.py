"""``bnexp bench step``: one training step of each model with each norm, against ``bn``.

A step is the trainer's own `train_step`: callbacks (AMAT learning rate, BNP
preconditioning), forward under the run's amp / channels_last / compile settings,
cross-entropy, backward, optimizer step, on a fixed random batch already on the device.
Ratios are against ``norm=bn`` on the same model and mode; ``bnp`` (BNP without norms) is
against ``norm=none``. Hydra overrides (``model.width=4``, ``trainer.amp=bf16``, ...)
apply to every case.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from omegaconf import DictConfig

from bnexp.bench.common import COMMON, MODES, Record, compose_train, device_of, measure, norm_presets, record
from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.callbacks import TrainState
from bnexp.engine.optim import build_optimizer, build_schedule
from bnexp.engine.trainer import build_callbacks, train_step
from bnexp.models import DataSpec, build_model

# model -> (the data it trains on, its usual per-GPU batch)
MODELS: dict[str, tuple[DataSpec, int]] = {
    "resnet20": (DataSpec(10, 3, 32), 128),
    "vgg16": (DataSpec(10, 3, 32), 128),
    "resnet50": (DataSpec(1000, 3, 224), 32),
}
DEFAULTS: dict[str, Any] = {**COMMON, "modes": MODES, "number": 5, "models": tuple(MODELS), "norms": tuple(norm_presets()),
                            "batch": 0, "image_size": 0, "out": "results/bench/step.json"}
COLUMNS = ("model", "name", "mode", "baseline", "seconds_median", "seconds_iqr", "ratio", "ratio_iqr")
# A small learning rate keeps random-label steps finite (NaNs would distort the timings).
STEP_OVERRIDES = ("optim.lr=0.001",)


def step_case(cfg: DictConfig, spec: DataSpec, batch: int, device: torch.device,
              run_dir: Path) -> Callable[[], object]:
    """One training step of ``cfg``'s model on a fixed batch, as the trainer's loop takes it."""
    model = build_model(cfg.model, cfg.norm, cfg.act.name, spec).to(device)
    net = AmpCompileWrapper.from_config(model, device, cfg.trainer)
    optimizer = build_optimizer(model, cfg.optim)
    state = TrainState(cfg, run_dir, device, model, optimizer, build_schedule(optimizer, cfg.schedule, 1), 1, 10**9)
    callbacks = build_callbacks(cfg)
    for cb in callbacks:
        cb.on_train_start(state)
    g = torch.Generator(device).manual_seed(0)
    x = torch.randn(batch, spec.in_channels, spec.image_size, spec.image_size, device=device, generator=g)
    y = torch.randint(spec.num_classes, (batch,), device=device, generator=g)
    model.train()
    return lambda: train_step(net, optimizer, callbacks, state, x, y)


def baseline(norm: str) -> str:
    """The preset a norm's step is compared with: ``none`` for a preset that adds something
    other than normalization layers (``bnp``: BNP without norms), ``bn`` for the others."""
    return "none" if norm != "none" and compose_train([f"norm={norm}"]).norm.layer is None else "bn"


def bench(options: Mapping[str, Any], overrides: Sequence[str]) -> list[Record]:
    device = device_of(options)
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for model in options["models"]:
            spec, batch = MODELS.get(model, MODELS["resnet20"])
            if options["image_size"]:
                spec = DataSpec(spec.num_classes, spec.in_channels, options["image_size"])
            batch = options["batch"] or batch
            bases = {norm: baseline(norm) for norm in options["norms"]}
            norms = list(dict.fromkeys([*options["norms"], *bases.values()]))
            cases = {}
            for norm in norms:
                for mode in options["modes"]:
                    cfg = compose_train([f"model={model}", f"norm={norm}", f"trainer.compile={mode == 'compiled'}",
                                         *STEP_OVERRIDES, *overrides])
                    cases[f"{norm}/{mode}"] = step_case(cfg, spec, batch, device, Path(tmp))
            times = measure(cases, options["reps"], options["number"], options["warmup"], device)
            for norm in options["norms"]:
                base = bases[norm]
                for mode in options["modes"]:
                    records.append(record(norm, mode, device, times[f"{norm}/{mode}"], f"{base}/{mode}",
                                          times[f"{base}/{mode}"], model=model, batch=batch,
                                          image_size=spec.image_size, amp=cfg.trainer.amp,
                                          channels_last=cfg.trainer.channels_last))
    return records
