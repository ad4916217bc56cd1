"""``data.loader=device``: an in-memory data set kept on the training device, batched there.

The uint8 images of both splits are copied to the device once. Every training batch is
gathered from them by index, augmented there (pad-and-crop plus horizontal flip for the
whole batch in one gather) and normalized there: no worker processes, no per-sample
Python, one small index copy per epoch.

Indices come from the run's :class:`~bnexp.data.sampling.EpochSampler`, so the data order
is the same as with ``data.loader=torch``: drawn once per epoch on the host as a tensor and
copied to the device in one transfer. The crops and flips of a whole epoch are drawn at
its start, on the device, from a generator seeded by (seed, epoch, rank): three kernels per
epoch, and a batch takes its slice (no re-seeding, no host work, no random kernels per
batch). The draws are a pure function of (seed, epoch, rank, position in the epoch), so a
resumed run recreates the same crops and flips without any saved state. Crops and flips follow torchvision's
``RandomCrop(size, padding)`` + ``RandomHorizontalFlip()`` distribution and the
normalization repeats ``ToDtype(float32, scale=True)`` + ``Normalize`` operation for
operation, so evaluation batches are bit-identical between the two loaders.
"""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Optional, Sequence

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from bnexp.data.arrays import ArrayData
from bnexp.data.sampling import EpochSampler
from bnexp.data.transfer import normalize

Batch = tuple[Tensor, Tensor]


Draws = tuple[Tensor, Tensor, Tensor]  # crop top, crop left, flip: (N, 1) each


def epoch_seed(seed: int, epoch: int, rank: int) -> int:
    """The augmentation seed of one epoch of one process: a pure function of its position."""
    return int(np.random.SeedSequence([seed, epoch, rank, 1]).generate_state(1)[0])


def draws(n: int, padding: int, generator: torch.Generator) -> Draws:
    """Crop offsets uniform in ``0..2*padding`` along each axis and flips of probability 1/2
    for ``n`` images, on the generator's device."""
    device = generator.device
    top = torch.randint(2 * padding + 1, (n, 1), generator=generator, device=device)
    left = torch.randint(2 * padding + 1, (n, 1), generator=generator, device=device)
    flip = torch.rand((n, 1), generator=generator, device=device) < 0.5
    return top, left, flip


def pad_crop_flip(images: Tensor, padding: int, drawn: Draws) -> Tensor:
    """Pad-crop and flip a batch (N, C, H, W) back to its own size, image ``i`` by the
    ``i``-th of ``drawn`` (:func:`draws`). The flip is folded into the column index, so
    cropping and flipping are one advanced-indexing gather.
    """
    n, c, h, w = images.shape
    device = images.device
    top, left, flip = drawn
    rows = top + torch.arange(h, device=device)
    cols = torch.arange(w, device=device)
    cols = left + torch.where(flip, w - 1 - cols, cols)
    padded = F.pad(images, (padding, padding, padding, padding))
    return padded[
        torch.arange(n, device=device)[:, None, None, None],
        torch.arange(c, device=device)[None, :, None, None],
        rows[:, None, :, None],
        cols[:, None, None, :],
    ]


class DeviceSplit:
    """One split's uint8 images and labels on the device, with the normalization constants."""

    def __init__(self, images: Tensor, labels: Tensor, data: ArrayData, device: torch.device) -> None:
        self.images = images.to(device)
        self.labels = labels.to(device)
        self.mean = torch.as_tensor(data.mean, dtype=torch.float32, device=device).view(-1, 1, 1)
        self.std = torch.as_tensor(data.std, dtype=torch.float32, device=device).view(-1, 1, 1)

    def __len__(self) -> int:
        return len(self.labels)

    def batch(self, index: Tensor | slice, padding: Optional[int] = None, drawn: Optional[Draws] = None) -> Batch:
        """Normalized images and labels at ``index``, augmented by ``drawn`` when ``padding`` is given."""
        images = self.images[index]
        if padding is not None:
            images = pad_crop_flip(images, padding, drawn)
        return normalize(images, self.mean, self.std), self.labels[index]


class EvalBatches:
    """A split in order, in batches of ``batch_size``, without augmentation."""

    def __init__(self, split: DeviceSplit, batch_size: int) -> None:
        self.split = split
        self.batch_size = batch_size

    def __len__(self) -> int:
        return -(-len(self.split) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        for start in range(0, len(self.split), self.batch_size):
            yield self.split.batch(slice(start, start + self.batch_size))


class TrainBatches:
    """The sampler's current epoch (from its offset on) in augmented batches.

    Iterating reads the sampler's epoch and offset, like a DataLoader over the same
    sampler; the epoch's crops and flips are drawn at its start from :func:`epoch_seed`
    ``(seed, epoch, rank)``, and image ``i`` of the epoch takes draw ``i``. Offsets are whole
    batches (see ``Loaders.epochs_from``).
    """

    def __init__(self, split: DeviceSplit, sampler: EpochSampler, batch_size: int, padding: Optional[int]) -> None:
        self.split = split
        self.sampler = sampler
        self.batch_size = batch_size
        self.padding = padding
        self.generator = torch.Generator(split.images.device)

    def __len__(self) -> int:
        return -(-len(self.sampler) // self.batch_size)

    def __iter__(self) -> Iterator[Batch]:
        s = self.sampler
        indices = s.epoch_tensor()[s.offset :].to(self.split.images.device, non_blocking=True)
        drawn: Optional[Draws] = None
        if self.padding is not None:
            self.generator.manual_seed(epoch_seed(s.seed, s.epoch, s.rank))
            drawn = tuple(d[s.offset :] for d in draws(s.num_samples, self.padding, self.generator))
        for start in range(0, len(indices), self.batch_size):
            part = slice(start, start + self.batch_size)
            yield self.split.batch(indices[part], self.padding, None if drawn is None else tuple(d[part] for d in drawn))


def device_batches(data: ArrayData, cfg: Mapping[str, Any], samplers: Sequence[EpochSampler], batch_size: int,
                   device: torch.device, test_share: range) -> tuple[list[TrainBatches], EvalBatches]:
    """Training batches of ``data`` made on ``device``, one stream per sampler (the members of
    a pack) over one copy of the training images, and the test batches; augmentation as
    ``data.augment``.

    Only this process's ``test_share`` of the test images (a strided range) is copied and evaluated.
    """
    padding = int(cfg.get("padding", 4)) if cfg.get("augment", True) else None
    images = DeviceSplit(data.x_train, data.y_train, data, device)  # copied once, however many samplers
    trains = [TrainBatches(images, sampler, batch_size, padding) for sampler in samplers]
    share = slice(test_share.start, test_share.stop, test_share.step)
    test = EvalBatches(DeviceSplit(data.x_test[share], data.y_test[share], data, device),
                       int(cfg.get("eval_batch_size", 500)))
    return trains, test
