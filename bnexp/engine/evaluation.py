"""Evaluation rows, and evaluation at the GPU's pace where the test split is on the device.

:class:`DeviceEvaluation` evaluates every run of a pack at once under ``data.loader=device``:
each batch is gathered from the split on the device at a position held there, goes through
the (packed) model in one forward, and the losses and top-k hits of all runs are summed on
the device in one set of kernels, with no Python loop over runs and one read by the host at
the end. Its batches are all of one size (the last one padded and its padding masked out),
so with ``trainer.cuda_graph`` it is one CUDA graph replayed once per batch. The loss of each
image is the one cross-entropy gives; the sums are in float64 (the DataLoader path,
:func:`bnexp.engine.trainer.evaluate`, sums each batch in the model's precision first), so
the two agree to float64 rounding in a float64 model (tests/test_step.py) and to the model's
rounding otherwise.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from bnexp.data.device import EvalBatches
from bnexp.engine.amp_compile import AmpCompileWrapper
from bnexp.engine.step import StepGraphs
from bnexp.models.packing import pack_inputs, per_run
from bnexp.support.distributed import sum_over_ranks


def test_rows(sums: Tensor, count: int, k: int) -> list[dict[str, float]]:
    """One metrics dict per run from its sums ``[loss, top-1 hits, top-k hits]`` (``sums``:
    ``(runs, 3)``) over ``count`` test images, both summed over the processes: the mean
    cross-entropy and the accuracies in percent (top-5 when ``k`` is 5)."""
    totals = sum_over_ranks(torch.cat([sums.flatten(), sums.new_tensor([count])])).tolist()
    count = totals.pop()
    rows = []
    for loss_sum, top1, topk in zip(totals[0::3], totals[1::3], totals[2::3]):
        row = {"test_loss": loss_sum / count, "test_acc": 100 * top1 / count}
        if k == 5:
            row["test_top5"] = 100 * topk / count
        rows.append(row)
    return rows


class DeviceEvaluation:
    """Evaluation of ``runs`` packed runs over ``test``, a split on the device (see the
    module's docstring); ``graph`` replays its batch as a CUDA graph after three plain ones."""

    def __init__(self, net: AmpCompileWrapper, test: EvalBatches, num_classes: int, runs: int,
                 graph: bool = False) -> None:
        self.net, self.split, self.runs = net, test.split, runs
        self.size = min(test.batch_size, len(test.split))
        self.k = 5 if num_classes > 5 else 1
        device = test.split.images.device
        self.start = torch.zeros((), dtype=torch.long, device=device)  # the batch's first image
        self.sums = torch.zeros(runs, 3, dtype=torch.float64, device=device)  # loss, top-1, top-k per run
        self.graphs: Optional[StepGraphs] = StepGraphs(lambda *_: self.batch()) if graph else None

    @torch.no_grad()
    def __call__(self) -> list[dict[str, float]]:
        """Each run's test loss and accuracies over this process's share, summed over processes."""
        was_training = self.net.training
        self.net.eval()
        self.sums.zero_()
        for start in range(0, len(self.split), self.size):
            self.start.fill_(start)
            if self.graphs is None:
                self.batch()
            else:
                self.graphs.step(None, None, None, None)
        self.net.train(was_training)
        return test_rows(self.sums, len(self.split), self.k)

    def batch(self) -> None:
        """Add the batch at :attr:`start` to the sums (positions past the split's end repeat
        its last image and count nothing)."""
        n, runs = len(self.split), self.runs
        positions = torch.arange(self.size, device=self.start.device) + self.start
        x, y = self.split.batch(positions.clamp(max=n - 1))
        logits = per_run(self.net(pack_inputs([x] * runs)), runs)  # (size, runs, classes)
        targets = y[:, None].expand(-1, runs)
        losses = F.cross_entropy(logits.reshape(-1, logits.shape[2]), targets.reshape(-1), reduction="none")
        hits = logits.topk(self.k, dim=2).indices.eq(targets[..., None])  # (size, runs, k)
        counted = (positions < n)[:, None]
        self.sums[:, 0].add_(torch.where(counted, losses.view(-1, runs).double(), 0.0).sum(0))
        self.sums[:, 1].add_((hits[..., 0] & counted).sum(0))
        self.sums[:, 2].add_((hits.any(dim=2) & counted).sum(0))

