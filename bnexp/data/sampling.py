"""Training-index sampling that resumes exactly.

Training indices are a pure function of (seed, epoch, rank): nothing but the epoch number
and the position inside it decides the next index, so a run resumed from a checkpoint draws
exactly the batches the uninterrupted run would have drawn (the trainer sets the epoch and
the number of samples already consumed).
"""

from __future__ import annotations

from typing import Iterator, Sized

import numpy as np
import torch
from torch.utils.data import DistributedSampler, Sampler

from bnexp.support.errors import unknown_choice

SAMPLINGS = ("with_replacement", "shuffle")


def epoch_steps(size: int, batch_size: int, world_size: int = 1, sampling: str = "with_replacement",
                drop_last: bool = False) -> int:
    """The batches of one process's share of an epoch of ``size`` images (:class:`EpochSampler`):
    the share rounded up to whole batches, or down with ``shuffle`` and ``drop_last``."""
    share = -(-size // world_size)
    return share // batch_size if sampling == "shuffle" and drop_last else -(-share // batch_size)


class EpochSampler(Sampler[int]):
    """Indices of one process's share of an epoch, in whole batches, resumable mid-epoch.

    ``with_replacement``: each rank draws its share independently, uniformly with
    replacement, from a generator seeded by (seed, epoch, rank); the share is rounded up to
    whole batches, so every batch is full (CIFAR: 391 batches of 128 per epoch).
    ``shuffle``: torch's DistributedSampler (one permutation per epoch shared by all ranks,
    split between them); with ``drop_last`` the incomplete batch at the end is left out.
    """

    def __init__(self, data: Sized, sampling: str, seed: int, batch_size: int, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False) -> None:
        if sampling not in SAMPLINGS:
            raise unknown_choice("data.sampling", sampling, SAMPLINGS)
        self.size = len(data)
        self.seed, self.rank, self.world_size = seed, rank, world_size
        self.batch_size = batch_size
        self.shuffler = (
            DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=True, seed=seed)
            if sampling == "shuffle"
            else None
        )
        self.steps = epoch_steps(self.size, batch_size, world_size, sampling, drop_last)
        whole_batches = self.shuffler is None or drop_last
        self.num_samples = self.steps * batch_size if whole_batches else -(-self.size // world_size)
        self.epoch = 0
        self.offset = 0

    @property
    def smallest_batch(self) -> int:
        """The size of an epoch's last batch (the others are full)."""
        return self.num_samples - (self.steps - 1) * self.batch_size

    def set_epoch(self, epoch: int, offset: int = 0) -> None:
        """Select the epoch to draw and how many of its samples were already consumed."""
        self.epoch, self.offset = epoch, offset

    def epoch_tensor(self) -> torch.Tensor:
        """This rank's whole share of the current epoch, as a LongTensor on the host."""
        if self.shuffler is not None:
            self.shuffler.set_epoch(self.epoch)
            return torch.tensor(list(self.shuffler)[: self.num_samples], dtype=torch.long)
        seed = int(np.random.SeedSequence([self.seed, self.epoch, self.rank]).generate_state(1)[0])
        g = torch.Generator().manual_seed(seed)
        return torch.randint(self.size, (self.num_samples,), generator=g)

    def epoch_indices(self) -> list[int]:
        """This rank's whole share of the current epoch."""
        return self.epoch_tensor().tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices()[self.offset :])

    def __len__(self) -> int:
        return self.num_samples - self.offset
