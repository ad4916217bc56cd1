"""``bnexp bench pack``: training steps of K packed runs against K runs one at a time.

For each ``K`` of ``runs`` (default 1, 2, 5, 10), one training step of a pack of K runs of
``model`` with ``norm`` (:mod:`bnexp.engine.pack`: grouped convolutions, one loss per run) is
timed against one step of a run alone (the trainer's own step, as ``bnexp bench step``
times it); the baseline of K is K steps alone, one after the other, in this process. The
ratio is the pack's time over that baseline (below 1: packing is faster), and
``runs_per_hour`` converts the step time into finished runs of ``epochs`` epochs of
``steps_per_epoch`` steps (ResNet-20 on CIFAR-10 at batch 128: 120 x 391). Options:
``runs``, ``model`` and ``norm``, ``batch`` and ``image_size`` (0: the model's usual),
``modes`` (eager); other ``key=value`` are Hydra overrides (``trainer.amp=bf16``).
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch
from omegaconf import DictConfig

from bnexp.bench.common import COMMON, Record, compose_train, device_of, measure, record
from bnexp.bench.step import MODELS, STEP_OVERRIDES, step_case
from bnexp.engine.pack_size import packed_step
from bnexp.models import DataSpec

DEFAULTS: dict[str, Any] = {**COMMON, "modes": ("eager",), "number": 3, "model": "resnet20", "norm": "cbn",
                            "runs": ("1", "2", "5", "10"), "batch": 0, "image_size": 0, "epochs": 120,
                            "steps_per_epoch": 391,
                            "out": "results/bench/pack.json"}
COLUMNS = ("name", "mode", "seconds_median", "seconds_iqr", "ratio", "ratio_iqr", "runs_per_hour",
           "runs_per_hour_alone")


def pack_case(cfg: DictConfig, spec: DataSpec, batch: int, runs: int, device: torch.device,
              run_dir: Path) -> Callable[[], object]:
    """One training step of a pack of ``runs`` runs of ``cfg`` on fixed batches."""
    return packed_step(cfg, spec, batch, runs, device, run_dir)[0]


def bench(options: Mapping[str, Any], overrides: Sequence[str]) -> list[Record]:
    device = device_of(options)
    spec, batch = MODELS.get(options["model"], MODELS["resnet20"])
    if options["image_size"]:
        spec = DataSpec(spec.num_classes, spec.in_channels, options["image_size"])
    batch = options["batch"] or batch
    steps = options["epochs"] * options["steps_per_epoch"]
    sizes = [int(k) for k in options["runs"]]
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in options["modes"]:
            cfg = compose_train([f"model={options['model']}", f"norm={options['norm']}",
                                 f"trainer.compile={mode == 'compiled'}", *STEP_OVERRIDES, *overrides])
            cases = {"alone": step_case(cfg, spec, batch, device, Path(tmp))}
            cases.update({f"K={k}": pack_case(cfg, spec, batch, k, device, Path(tmp)) for k in sizes})
            times = measure(cases, options["reps"], options["number"], options["warmup"], device)
            alone = times["alone"]
            for k in sizes:
                packed = times[f"K={k}"]
                records.append(record(f"K={k}", mode, device, packed, f"{k} x alone", [k * t for t in alone],
                                      model=options["model"], norm=options["norm"], batch=batch, runs=k,
                                      runs_per_hour=k * 3600 / (steps * statistics.median(packed)),
                                      runs_per_hour_alone=3600 / (steps * statistics.median(alone))))
    return records
