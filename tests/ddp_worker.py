"""Run by tests/test_distributed.py under torchrun: train, then save this rank's full state.

Usage: python -m torch.distributed.run --nproc_per_node=2 tests/ddp_worker.py OUT NAME OVERRIDES...
(NAME=overrides pairs separated by ';' train one after another in the same process group.)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bnexp.engine.callbacks import Callback, TrainState  # noqa: E402
from bnexp.engine.method_hooks import BnpPreconditioner  # noqa: E402
from tests.conftest import compose_cfg  # noqa: E402

BNP_STATE: dict[str, torch.Tensor] = {}
_bnp_end = BnpPreconditioner.on_train_end


def _capture_bnp(self: BnpPreconditioner, state: TrainState, status: str) -> None:
    """Keep BNP's running statistics (they live outside the model) for the comparison."""
    BNP_STATE.update({f"bnp.{k}": v.clone() for k, v in self.bnp.state_dict().items()})
    _bnp_end(self, state, status)


BnpPreconditioner.on_train_end = _capture_bnp  # type: ignore[method-assign]


class SaveRankState(Callback):
    """Write every parameter, buffer, momentum buffer and BNP statistic of this rank at the end
    (registered after the method callbacks, so BNP's state is captured by then)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_end(self, state: TrainState, status: str) -> None:
        tensors = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
        tensors.update(BNP_STATE)
        tensors.update({f"optimizer.{i}": s["momentum_buffer"] for i, s in state.optimizer.state_dict()["state"].items()
                        if s.get("momentum_buffer") is not None})
        torch.save(tensors, self.path)


def main() -> None:
    from bnexp.engine.trainer import train

    out, jobs = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["RANK"])
    for job in jobs.split(";"):
        name, *overrides = job.split()
        BNP_STATE.clear()
        cfg = compose_cfg(overrides)
        train(cfg, out / name, [SaveRankState(out / f"{name}.rank{rank}.pt")])


if __name__ == "__main__":
    main()
