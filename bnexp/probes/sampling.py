"""Extra forward passes that leave no trace on training, and the probes built on them.

A probe that draws its own training batches (``grad_var``, ``loss``) runs the model in
training mode, which would otherwise move running statistics, AMAT averages, BNP's input
statistics and the random generators. :func:`isolated` saves and restores all of them.
"""

from __future__ import annotations

import contextlib
import zlib
from collections import OrderedDict
from typing import Any, Iterator, Mapping

import numpy as np
import torch
from omegaconf import DictConfig
from torch import Tensor, nn
from torch.utils.data import Dataset, default_collate

from bnexp.engine.callbacks import TrainState
from bnexp.engine.checkpoint import capture_rng, restore_rng
from bnexp.nn import set_learning_rate
from bnexp.probes.callback import FixedWeightProbe
from bnexp.support.errors import ConfigError

Batch = tuple[Tensor, Tensor]


def derive_seed(*words: int) -> int:
    """A 32-bit seed from a tuple of integers (independent streams for different tuples)."""
    return int(np.random.SeedSequence(list(words)).generate_state(1)[0])


def name_word(name: str) -> int:
    """A stable integer for a probe name, to keep the probes' random streams apart."""
    return zlib.crc32(name.encode())


@contextlib.contextmanager
def preserved_rng() -> Iterator[None]:
    """Every global random generator (python, numpy, torch, CUDA) as it was on entry, on exit."""
    state = capture_rng()
    try:
        yield
    finally:
        restore_rng(state)


@contextlib.contextmanager
def suspended_forward_hooks(model: nn.Module) -> Iterator[None]:
    """Forward hooks and pre-hooks of every module switched off. BNP (and the probes
    themselves) collect statistics in such hooks; a probe's forward must not feed them."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in model.modules()]
    for m, _, _ in saved:
        m._forward_pre_hooks, m._forward_hooks = OrderedDict(), OrderedDict()
    try:
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


@contextlib.contextmanager
def isolated(model: nn.Module, seed: int) -> Iterator[None]:
    """Run training-mode computations on ``model`` without changing the run.

    Inside, the global torch generator is seeded with ``seed`` (so a probe's batches,
    augmentations and dropout are reproducible) and forward hooks are off. On exit the
    random generators and every buffer are restored: values copied back into the original
    tensors, and buffers a module replaced (AMAT does) put back.
    """
    buffers = [(m, name, b, b.clone()) for m in model.modules() for name, b in m.named_buffers(recurse=False)]
    with preserved_rng(), suspended_forward_hooks(model):
        torch.manual_seed(seed)
        try:
            yield
        finally:
            with torch.no_grad():
                for m, name, original, copy in buffers:
                    original.copy_(copy)
                    setattr(m, name, original)


def draw_batches(data: Dataset, count: int, batch_size: int, device: torch.device) -> list[Batch]:
    """``count`` batches of ``batch_size`` samples drawn uniformly with replacement, through
    the data set's own (training) transform, from the global torch generator."""
    indices = torch.randint(len(data), (count, batch_size))
    batches = [default_collate([data[i] for i in row.tolist()]) for row in indices]
    return [(x.to(device), y.to(device)) for x, y in batches]


class SampledProbe(FixedWeightProbe):
    """A fixed-weight probe measured on ``k`` batches of its own from the training set.

    The batches come from the trainer's training set (``state.train_data``, its training
    transform included) through a generator seeded by (``trainer.seed``, probe name,
    step), or without the step when ``fresh_batches`` is False (the same batches every
    time), so the training data stream is untouched and a rerun measures the same batches.
    """

    fresh_batches = True

    def __init__(self, settings: Mapping[str, Any], cfg: DictConfig) -> None:
        super().__init__(settings, cfg)
        self.k = int(settings.get("k", 4))
        self.batch_size = int(settings.get("batch_size") or cfg.trainer.batch_size)
        if self.k < 1 or self.batch_size < 1:
            raise ConfigError(f"probe.{self.name}.k and batch_size must be at least 1, got {self.k}, {self.batch_size}")
        self.seed = int(cfg.trainer.seed)

    def on_train_start(self, state: TrainState) -> None:
        if state.train_data is None:
            raise ConfigError(f"probe {self.name} draws training batches and this run has no training set")
        self.data = state.train_data

    def measure(self, state: TrainState, step: int) -> None:
        words = (self.seed, name_word(self.name), step) if self.fresh_batches else (self.seed, name_word(self.name))
        with isolated(state.model, derive_seed(*words)):
            # AMAT layers refuse a training forward until they know the step's lr; the value
            # only feeds their statistics update, which isolated() undoes.
            set_learning_rate(state.model, state.lr)
            self.measure_batches(state, step, draw_batches(self.data, self.k, self.batch_size, state.device))

    def measure_batches(self, state: TrainState, step: int, batches: list[Batch]) -> None:
        raise NotImplementedError
