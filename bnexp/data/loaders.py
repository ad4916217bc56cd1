"""The loaders a run iterates: torch DataLoaders or batches cut on the device, drawn in the
order of :class:`bnexp.data.sampling.EpochSampler`. A DataLoader's batch crosses to the device
as uint8 images (or JPEG bytes) and is normalized there (:mod:`bnexp.data.transfer`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Iterator, Mapping, Sequence

import torch
from torch.utils.data import DataLoader, Subset

from bnexp.data import DataBundle
from bnexp.data.device import device_batches
from bnexp.data.sampling import EpochSampler
from bnexp.data.transfer import Batch, DeviceBatches, ToDevice, on_device
from bnexp.support.errors import ConfigError, unknown_choice

LOADERS = ("auto", "device", "torch")


@dataclass
class Loaders:
    """The training batches (driven by an :class:`EpochSampler`) and the test batches.

    ``kind`` is ``torch`` (DataLoaders) or ``device`` (:mod:`bnexp.data.device`).
    ``to_device(x, y)`` makes a training batch as ``train`` yields it the model's input on
    the device (the test batches come out of ``test`` on the device already).
    """

    train: Iterable[tuple[Any, torch.Tensor]]
    test: Iterable[Batch]
    sampler: EpochSampler
    batch_size: int
    kind: str = "torch"
    to_device: ToDevice = on_device

    @property
    def steps_per_epoch(self) -> int:
        return self.sampler.steps

    def epochs_from(self, step: int) -> Iterator[tuple[Any, torch.Tensor]]:
        """Endless training batches starting at optimizer step ``step`` (0 or a resume point)."""
        epoch, batch = divmod(step, self.steps_per_epoch)
        offset = batch * self.batch_size
        while True:
            self.sampler.set_epoch(epoch, offset)
            yield from self.train
            epoch, offset = epoch + 1, 0


def drop_last(cfg: Mapping[str, Any], batch_statistics: bool) -> bool:
    """``data.drop_last``; null means "when the norm uses batch statistics" (a short last
    batch would normalize with the statistics of a few images, or fail with one)."""
    value = cfg.get("drop_last")
    if value is None:
        return batch_statistics
    if not isinstance(value, bool):
        raise ConfigError(f"data.drop_last={value!r} is not valid: use true, false or null (by the norm)")
    return value


def loader_kind(bundle: DataBundle, cfg: Mapping[str, Any], device: torch.device) -> str:
    """``data.loader``: ``auto`` is ``device`` for in-memory data on a GPU, else ``torch``."""
    kind = cfg.get("loader", "auto")
    if kind not in LOADERS:
        raise unknown_choice("data.loader", kind, LOADERS)
    if kind == "auto":
        return "device" if device.type == "cuda" and bundle.arrays is not None else "torch"
    if kind == "device" and bundle.arrays is None:
        raise ConfigError(f"data.loader=device needs an in-memory data set; data.name={cfg['name']} is read "
                          "from files: use data.loader=torch (or auto)")
    return kind


def build_loaders(bundle: DataBundle, cfg: Mapping[str, Any], batch_size: int, seed: int, pin_memory: bool,
                  device: torch.device = torch.device("cpu"), rank: int = 0, world_size: int = 1,
                  drop_last: bool = False) -> Loaders:
    """Training batches drawn with replacement or shuffled (``data.sampling``); test in order.

    Batches drawn with replacement are always full; shuffled ones leave out the incomplete
    last batch of an epoch when ``drop_last`` (see :func:`drop_last`).

    ``batch_size`` is per process. Under torchrun each process draws its own share of every
    epoch (:class:`EpochSampler`) and evaluates every ``world_size``-th test image, from its
    rank on (the same images on both paths).

    ``data.loader`` picks the DataLoader path or the on-device one (:func:`loader_kind`).
    The DataLoaders read what the data set's ``feed`` gives for ``device`` (uint8 images or
    JPEG bytes, put on the device by ``Loaders.to_device``). Both DataLoaders get their own
    generator (for worker seeds) so creating an iterator never draws from the global RNG,
    from which augmentation and the training step's own randomness draw (a packed run swaps
    in its own global state around its batches only).
    ``pin_memory`` is the caller's default; a non-null ``data.pin_memory`` overrides it.
    """
    return build_seeded_loaders(bundle, cfg, batch_size, [seed], pin_memory, device, rank, world_size, drop_last)[0]


def build_seeded_loaders(bundle: DataBundle, cfg: Mapping[str, Any], batch_size: int, seeds: Sequence[int],
                         pin_memory: bool, device: torch.device = torch.device("cpu"), rank: int = 0,
                         world_size: int = 1, drop_last: bool = False) -> list[Loaders]:
    """:func:`build_loaders` for each of ``seeds`` (the members of a pack) over one copy of the
    data: each draws its own indices and augmentation, exactly as alone, while the test
    batches (seeded by the first seed) and, under ``data.loader=device``, the images copied
    to the device are shared."""
    samplers = [EpochSampler(bundle.train, cfg.get("sampling", "with_replacement"), seed, batch_size, rank,
                             world_size, drop_last) for seed in seeds]
    if samplers[0].steps == 0:
        raise ConfigError(f"a batch of {batch_size} per process is larger than this process's share of the "
                          f"{samplers[0].size} training images and data.drop_last leaves no batch: use a smaller "
                          "trainer.batch_size or data.drop_last=false")
    test_share = range(rank, len(bundle.test), world_size)
    if loader_kind(bundle, cfg, device) == "device":
        assert bundle.arrays is not None  # checked by loader_kind
        trains, test = device_batches(bundle.arrays, cfg, samplers, batch_size, device, test_share)
        return [Loaders(train, test, sampler, batch_size, "device") for train, sampler in zip(trains, samplers)]
    feed = bundle.feed(device)
    workers = int(cfg.get("num_workers", 0))
    pin = pin_memory if cfg.get("pin_memory") is None else bool(cfg.get("pin_memory"))
    common: dict[str, Any] = dict(num_workers=workers, pin_memory=pin, persistent_workers=workers > 0,
                                  collate_fn=feed.collate)
    test = feed.test if world_size == 1 else Subset(feed.test, test_share)
    # its own generator too: an iterator draws its workers' base seed, never from the global RNG
    test_loader = DataLoader(test, batch_size=int(cfg.get("eval_batch_size", 500)), shuffle=False,
                             generator=torch.Generator().manual_seed(seeds[0]), **common)
    test_batches = DeviceBatches(test_loader, feed.test_to_device)
    return [Loaders(DataLoader(feed.train, batch_size=batch_size, sampler=sampler,
                               generator=torch.Generator().manual_seed(seed), **common), test_batches, sampler,
                    batch_size, to_device=feed.train_to_device)
            for seed, sampler in zip(seeds, samplers)]
