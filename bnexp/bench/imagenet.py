"""``bnexp bench imagenet``: ImageNet images per second of the input paths against what a
ResNet-50 training step consumes, so a record says whether the input or the model is the limit.

Cases, each a record with ``images_per_s`` (and ``ratio``: its seconds per image over the
ResNet-50 step's at the largest batch measured; below 1 the input keeps up):

- ``pixels/<aug>``: the device path against the CPU path on the same draws, for the first
  ``compare`` training images through the training and the validation transforms: the
  largest and the mean difference in uint8 levels and the share of values that differ
  (``max_levels``, ``mean_levels``, ``differing``: the decoders' and resizers' difference).
- ``device/<aug>``: the device half alone (``JpegBatches``: decode, crop, resize, flip,
  normalize) on batches already read, the ceiling of ``data.decode=gpu`` whatever the workers.
- ``gpu/<aug>/w<N>``: ``data.decode=gpu`` end to end with ``gpu_workers`` DataLoader
  workers (bytes read, augmentation drawn) and the device half.
- ``cpu/<aug>/w<N>``: ``data.decode=cpu`` (PIL in the workers, uint8 normalized on the
  device) with each of ``workers``; ``w1`` is the rate of one worker.
- ``resnet50/b<B>``: one training step of ResNet-50 with ``norm=bn`` (bf16, channels_last,
  compiled) on a batch already on the device, for each of ``model_batches`` (largest first).

``root=`` reads an ImageNet folder tree (``DIR/train/<wnid>/*.JPEG``); by default a tree of
``classes`` x ``per_class`` images is written by :mod:`bnexp.data.make_imagenet` into a
temporary folder. DataLoader cases time ``max(8, 4N)`` batches after ``2N + 2`` untimed ones
(past the workers' start and their prefetched queue). ``budget_s`` (0: none) stops starting
cases once their expected time would pass it; a skipped case is a record with ``skipped``.
The records are also written as one markdown row (``out`` with ``.md``) for
docs/benchmarks.md.
"""

from __future__ import annotations

import itertools
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch
from PIL import Image
from torchvision.io import ImageReadMode, decode_jpeg

from bnexp.bench.common import COMMON, Budget, Record, compose_train, device_of, environment, measure, record
from bnexp.bench.step import MODELS, STEP_OVERRIDES, step_case
from bnexp.data import build_data
from bnexp.data.imagenet import AUGS, augment_steps, imagenet_transform
from bnexp.data.jpeg import apply_params, draw_params, read_encoded
from bnexp.data.loaders import Loaders, build_loaders
from bnexp.data.make_imagenet import write_imagenet

DEFAULTS: dict[str, Any] = {**COMMON, "reps": 2, "root": "", "classes": 8, "per_class": 64, "batch": 64,
                            "workers": (1, 8, 16), "gpu_workers": 8, "augs": AUGS, "compare": 32,
                            "model_batches": (128, 64, 32), "budget_s": 0, "out": "results/bench/imagenet.json"}
COLUMNS = ("name", "batch", "workers", "seconds_median", "images_per_s", "ratio", "max_levels", "mean_levels",
           "differing", "skipped")
MODEL_ESTIMATE_S = 60  # a first compiled ResNet-50 step, until one has been timed


def rate(r: Record, batch: int, **fields: Any) -> Record:
    return {**r, "batch": batch, "images_per_s": batch / r["seconds_median"], **fields}


def timed(name: str, draw: Callable[[], Any], number: int, warmup: int, batch: int, options: Mapping[str, Any],
          device: torch.device, **fields: Any) -> Record:
    """The record of ``draw`` (one batch of ``batch`` images per call)."""
    times = measure({name: draw}, options["reps"], number, warmup, device)
    return rate(record(name, "eager", device, times[name], "resnet50"), batch, **fields)


def imagenet_loaders(root: Path, aug: str, decode: str, workers: int, options: Mapping[str, Any],
                     device: torch.device) -> Loaders:
    cfg = {"name": "imagenet", "root": str(root), "aug": aug, "decode": decode, "num_workers": workers,
           "sampling": "shuffle", "eval_batch_size": options["batch"]}
    return build_loaders(build_data(cfg), cfg, options["batch"], 0, device.type == "cuda", device)


def loader_case(name: str, loaders: Loaders, workers: int, options: Mapping[str, Any],
                device: torch.device) -> Record:
    """Images per second of ``loaders``' training stream put on the device, past the workers' start."""
    stream = loaders.epochs_from(0)
    return timed(name, lambda: loaders.to_device(*next(stream)), max(8, 4 * workers), 2 * workers + 2,
                 options["batch"], options, device, workers=workers)


def device_case(root: Path, aug: str, options: Mapping[str, Any], device: torch.device) -> Record:
    """The device half alone, cycling over 4 batches already read (in this process)."""
    loaders = imagenet_loaders(root, aug, "gpu", 0, options, device)
    ready = itertools.cycle(list(itertools.islice(loaders.epochs_from(0), 4)))
    return timed(f"device/{aug}", lambda: loaders.to_device(*next(ready)), 8, 2, options["batch"], options, device,
                 workers=0)


def pixel_case(paths: Sequence[str], aug: str, device: torch.device) -> Record:
    """How far the device path's images are from the CPU path's, each image with the same
    draws (seed = its position) in both, training and validation transforms: the largest
    and the mean |difference| in uint8 levels over ``paths``, and the share of values that
    differ at all."""
    started, differences = time.perf_counter(), []
    for train in (True, False):
        steps, pil = augment_steps({"aug": aug}, train), imagenet_transform({"aug": aug}, train, normalized=False)
        for seed, path in enumerate(paths):
            torch.manual_seed(seed)
            with Image.open(path) as image:
                expected = pil(image.convert("RGB")).to(device)
            encoded = read_encoded(path)
            torch.manual_seed(seed)
            params = draw_params(steps, *encoded.size)
            image = (decode_jpeg(encoded.data, mode=ImageReadMode.RGB, device=device) if encoded.jpeg
                     else encoded.data.to(device))
            differences.append((apply_params(steps, image, params).int() - expected.int()).abs().flatten())
    found = torch.cat(differences).double()
    seconds = (time.perf_counter() - started) / (2 * len(paths))
    return {**record(f"pixels/{aug}", "eager", device, [seconds], "cpu"), "images": len(paths),
            "max_levels": int(found.max()), "mean_levels": round(float(found.mean()), 4),
            "differing": round(float((found > 0).double().mean()), 5)}


def model_case(batch: int, options: Mapping[str, Any], device: torch.device, run_dir: Path) -> Record:
    """Images per second of a compiled bf16 channels_last ResNet-50 ``bn`` training step."""
    cfg = compose_train(["model=resnet50", "norm=bn", "trainer.amp=bf16", "trainer.channels_last=true",
                         "trainer.compile=true", *STEP_OVERRIDES])
    name = f"resnet50/b{batch}"
    times = measure({name: step_case(cfg, MODELS["resnet50"][0], batch, device, run_dir)}, options["reps"], 5, 3,
                    device)
    return rate(record(name, "compiled", device, times[name], name), batch)


def skipped(name: str, batch: int, device: torch.device) -> Record:
    """The record of a case left out for want of time (``budget_s``)."""
    return {"name": name, "mode": "eager", "device": device.type, "batch": batch, "skipped": "budget_s",
            "seconds_median": None, "seconds_iqr": None, "reps": 0, "baseline": "resnet50", "ratio": None}


def input_cases(root: Path, options: Mapping[str, Any], device: torch.device, budget: Budget) -> Iterator[Record]:
    """The records of the input paths, for each of ``augs``."""
    paths = sorted(str(p) for p in (root / "train").rglob("*.JPEG"))[: options["compare"]]
    gpu_workers = int(options["gpu_workers"])
    for aug in options["augs"]:
        yield pixel_case(paths, aug, device)
        yield device_case(root, aug, options, device)
        yield loader_case(f"gpu/{aug}/w{gpu_workers}", imagenet_loaders(root, aug, "gpu", gpu_workers, options, device),
                          gpu_workers, options, device)
        for workers in map(int, options["workers"]):
            name = f"cpu/{aug}/w{workers}"
            yield (loader_case(name, imagenet_loaders(root, aug, "cpu", workers, options, device), workers, options,
                               device) if budget.allows(0) else skipped(name, options["batch"], device))


def model_cases(options: Mapping[str, Any], device: torch.device, budget: Budget) -> Iterator[Record]:
    """The records of the ResNet-50 step at each of ``model_batches``, while the budget allows
    one more (expected to take as long as the one before)."""
    expected = float(MODEL_ESTIMATE_S)
    with tempfile.TemporaryDirectory() as tmp:
        for batch in map(int, options["model_batches"]):
            if not budget.allows(expected):
                yield skipped(f"resnet50/b{batch}", batch, device)
                continue
            started = time.perf_counter()
            yield model_case(batch, options, device, Path(tmp))
            expected = time.perf_counter() - started


def against_model(records: list[Record]) -> None:
    """Each input record's ``ratio``: its seconds per image over the ResNet-50 step's at the
    largest batch measured (below 1: the input path keeps up with the model)."""
    models = [r for r in records if r["name"].startswith("resnet50/") and r.get("images_per_s")]
    if not models:
        return
    consumed = max(models, key=lambda r: r["batch"])
    for r in records:
        if r.get("images_per_s") and r is not consumed and not r["name"].startswith("resnet50/"):
            r["ratio"], r["baseline"] = consumed["images_per_s"] / r["images_per_s"], consumed["name"]


def cell(r: Record) -> str:
    if r.get("skipped"):
        return f"{r['name']} skipped"
    if "max_levels" in r:
        return f"{r['name']} max {r['max_levels']} mean {r['mean_levels']} levels ({r['differing']:.2%} differ)"
    return f"{r['name']} {r['images_per_s']:.0f}/s"


def markdown_row(records: Sequence[Record], device: torch.device) -> str:
    """One row of docs/benchmarks.md: date, device, versions, then each case's figure."""
    env = environment(device)
    return (f"| {env['date'][:10]} | {env['device_name']} | torch {env['torch']}, torchvision {env['torchvision']} | "
            f"{'; '.join(cell(r) for r in records)} |\n")


def bench(options: Mapping[str, Any], overrides: Sequence[str]) -> list[Record]:
    device = device_of(options)
    budget = Budget(options["budget_s"])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(options["root"] or tmp)
        if not options["root"]:
            write_imagenet(root, options["classes"], options["per_class"], val_per_class=1)
        records = list(input_cases(root, options, device, budget))
    records += model_cases(options, device, budget)
    against_model(records)
    out = Path(options["out"]).with_suffix(".md")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown_row(records, device))
    return records
