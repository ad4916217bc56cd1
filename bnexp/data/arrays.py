"""In-memory image data sets (CIFAR, MNIST, npz, synthetic) and their DataLoader path.

Every small data set is held as uint8 images ``N x C x H x W`` plus integer labels; the
normalization statistics are computed from the training split. The ``torch`` loader path
applies torchvision transforms per sample inside a DataLoader and normalizes each batch on
the device (:mod:`bnexp.data.transfer`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
from torch.utils.data import Dataset
from torchvision.transforms import v2

from bnexp.data.transfer import Feed, Normalized
from bnexp.models import DataSpec


@dataclass
class ArrayData:
    """A train/test split of uint8 images (NCHW) and int64 labels."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    num_classes: int

    def __post_init__(self) -> None:
        stats = self.x_train.double().div(255)
        self.mean = tuple(stats.mean(dim=(0, 2, 3)).tolist())
        self.std = tuple(stats.std(dim=(0, 2, 3)).clamp_min(1e-6).tolist())

    @property
    def spec(self) -> DataSpec:
        return DataSpec(self.num_classes, self.x_train.shape[1], self.x_train.shape[-1])


class ImageTensorDataset(Dataset):
    """Indexable (image, label) pairs with a per-sample transform."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, transform: v2.Transform) -> None:
        self.images = images
        self.labels = labels
        self.transform = transform

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.transform(self.images[i]), self.labels[i]


def cifar_transforms(data: ArrayData, cfg: Mapping[str, Any], train: bool, normalized: bool = True) -> v2.Transform:
    """Pad-and-crop plus horizontal flip (training, when ``data.augment``), then mean/std
    (unless ``normalized`` is false: uint8 images, as a DataLoader hands them to the device)."""
    steps: list[v2.Transform] = []
    if train and cfg.get("augment", True):
        size = data.x_train.shape[-1]
        steps += [v2.RandomCrop(size, padding=cfg.get("padding", 4)), v2.RandomHorizontalFlip()]
    if normalized:
        steps += [v2.ToDtype(torch.float32, scale=True), v2.Normalize(data.mean, data.std)]
    return v2.Compose(steps) if steps else v2.Identity()


def torch_datasets(data: ArrayData, cfg: Mapping[str, Any], normalized: bool = True) -> tuple[Dataset, Dataset]:
    """The train and test splits as DataLoader-ready data sets (see :func:`cifar_transforms`)."""
    return (
        ImageTensorDataset(data.x_train, data.y_train, cifar_transforms(data, cfg, True, normalized)),
        ImageTensorDataset(data.x_test, data.y_test, cifar_transforms(data, cfg, False, normalized)),
    )


def array_feed(data: ArrayData, cfg: Mapping[str, Any], device: torch.device) -> Feed:
    """What the DataLoaders of ``data`` read: its uint8 images, augmented, normalized on ``device``."""
    train, test = torch_datasets(data, cfg, normalized=False)
    to_device = Normalized(data.mean, data.std, device)
    return Feed(train, test, to_device, to_device)
