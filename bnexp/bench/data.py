"""``bnexp bench data``: training images per second of the device pipeline and the DataLoader.

Both loaders draw the same training stream (``Loaders.epochs_from``) of an in-memory data
set, by default CIFAR-shaped synthetic images with augmentation on; a DataLoader batch is
also put on the device, as the trainer does (``Loaders.to_device``: uint8 copied, normalized
there). ``torch-float32`` is the DataLoader path as it was before uint8 transfer: each image
normalized in the workers, the float32 batch copied. Hydra overrides choose another data set
(``data=cifar10``) or DataLoader settings (``data.num_workers=4``).
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import torch
from omegaconf import OmegaConf
from torch.utils.data import DataLoader

from bnexp.bench.common import COMMON, Record, compose_train, device_of, measure, record
from bnexp.data import DataBundle, build_data
from bnexp.data.loaders import Loaders, build_loaders

DEFAULTS: dict[str, Any] = {**COMMON, "number": 20, "batch": 128, "train_size": 10_000,
                            "out": "results/bench/data.json"}
COLUMNS = ("name", "batch", "images_per_s", "seconds_median", "seconds_iqr", "ratio", "speedup")
BASELINE = "torch"


def next_batch(loaders: Loaders) -> Callable[[], None]:
    """Draw one batch of ``loaders``' training stream and put it on the device."""
    stream = loaders.epochs_from(0)
    return lambda: loaders.to_device(*next(stream))


def float32_loaders(bundle: DataBundle, loaders: Loaders, device: torch.device) -> Loaders:
    """``loaders`` (a DataLoader path's, for this case alone) reading the data set's own
    normalized images instead, the batch copied as it is."""
    common = {key: getattr(loaders.train, key) for key in ("batch_size", "sampler", "num_workers", "pin_memory",
                                                             "persistent_workers", "generator")}
    return Loaders(DataLoader(bundle.train, **common), loaders.test, loaders.sampler, loaders.batch_size,
                   to_device=lambda x, y: (x.to(device, non_blocking=True), y.to(device, non_blocking=True)))


def bench(options: Mapping[str, Any], overrides: Sequence[str]) -> list[Record]:
    device = device_of(options)
    cfg = compose_train(["data=synthetic", f"data.train_size={options['train_size']}", "data.test_size=1",
                         "data.augment=true", *overrides])
    bundle = build_data(cfg.data)
    cases = {}
    for kind in ("torch", "device"):
        data_cfg = OmegaConf.merge(cfg.data, {"loader": kind})
        loaders = build_loaders(bundle, data_cfg, options["batch"], 0, device.type == "cuda", device)
        cases[kind] = next_batch(loaders)
    own = build_loaders(bundle, OmegaConf.merge(cfg.data, {"loader": "torch"}), options["batch"], 0,
                        device.type == "cuda", device)
    cases["torch-float32"] = next_batch(float32_loaders(bundle, own, device))
    # Not interleaved: DataLoader workers would keep prefetching while the device path is
    # timed. Timed after them, the device path finds them idle with a full queue.
    times = measure(cases, options["reps"], options["number"], options["warmup"], device, interleave=False)
    records = []
    for kind, seconds in times.items():
        r = record(kind, "eager", device, seconds, BASELINE, times[BASELINE], batch=options["batch"],
                   data=cfg.data.name, num_workers=cfg.data.get("num_workers", 0))
        r["images_per_s"] = options["batch"] / r["seconds_median"]
        r["speedup"] = 1 / r["ratio"]
        records.append(r)
    return records
