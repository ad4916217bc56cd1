"""How a batch reaches the training device: as uint8 images, normalized there.

A DataLoader's workers hand over augmented uint8 images (or, for ImageNet with
``data.decode=gpu``, JPEG bytes and their drawn augmentation, :mod:`bnexp.data.jpeg`); the
batch crosses to the device at one byte per pixel and channel, a quarter of float32's, and
:func:`normalize` makes it float32 there. Every path normalizes with this one function
(the on-device loader too), which repeats torchvision's ``ToDtype(float32, scale=True)``
and ``Normalize`` operation for operation: on the CPU a batch normalized after the transfer
is bit-identical to one whose images were normalized one by one in the workers.

A data set says what its DataLoaders read through a :class:`Feed`, made for the device a run
trains on (``DataBundle.feed``); the engine puts each training batch on the device with the
loaders' ``to_device`` and evaluates on :class:`DeviceBatches`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch import Tensor
from torch.utils.data import Dataset

Batch = tuple[Tensor, Tensor]
ToDevice = Callable[[Any, Tensor], Batch]  # what a loader yields -> (normalized images, labels) on the device


def normalize(images: Tensor, mean: Tensor, std: Tensor) -> Tensor:
    """uint8 -> float32 ``(x / 255 - mean) / std`` with torchvision's exact operations."""
    return images.to(torch.float32).mul_(1.0 / 255).sub_(mean).div_(std)


class Normalized:
    """uint8 images and labels moved to ``device`` (asynchronously from pinned memory), the
    images normalized there by ``mean`` and ``std`` (one value per channel)."""

    def __init__(self, mean: Sequence[float], std: Sequence[float], device: torch.device) -> None:
        self.device = device
        self.mean = torch.as_tensor(mean, dtype=torch.float32, device=device).view(-1, 1, 1)
        self.std = torch.as_tensor(std, dtype=torch.float32, device=device).view(-1, 1, 1)

    def __call__(self, images: Tensor, labels: Tensor) -> Batch:
        return (normalize(images.to(self.device, non_blocking=True), self.mean, self.std),
                labels.to(self.device, non_blocking=True))


def on_device(images: Tensor, labels: Tensor) -> Batch:
    """A batch the on-device loader made: already there and normalized."""
    return images, labels


@dataclass
class Feed:
    """What a run's DataLoaders read, and how each split's batches reach the device.

    ``train`` and ``test`` hold the same samples as the data set's own splits (same order,
    same augmentation draws) in the form the workers hand over; ``collate`` joins them into
    a batch (None: torch's default).
    """

    train: Dataset
    test: Dataset
    train_to_device: ToDevice
    test_to_device: ToDevice
    collate: Optional[Callable[[list[Any]], Any]] = None


class DeviceBatches:
    """The batches of ``loader``, each put on the device by ``to_device``."""

    def __init__(self, loader: Iterable[tuple[Any, Tensor]], to_device: ToDevice) -> None:
        self.loader = loader
        self.to_device = to_device

    def __len__(self) -> int:
        return len(self.loader)  # type: ignore[arg-type]

    def __iter__(self) -> Iterator[Batch]:
        for x, y in self.loader:
            yield self.to_device(x, y)
